"""The `vllm` engine (GPU): vLLM's offline ``LLM`` with per-token log-probs of the sampled tokens,
and weight updates through a worker extension.

vLLM is imported only when an engine is built, so this module imports (and its helpers are tested)
without vLLM or a GPU. Not yet run on a GPU: see docs/gpu.md and tests/gpu/.

Behaviour log-probs. vLLM returns one of two kinds, chosen once per engine (``logprobs_mode``):
``raw_logprobs`` = log_softmax(z) of the raw logits, before temperature; ``processed_logprobs`` =
after temperature AND top-k / top-p (renormalised over the kept tokens). Our convention is
log_softmax(z / T) over the full vocabulary (`base` module docstring), which is

    raw_logprobs        when T is 1 (or 0: greedy, whose log-probs are taken at T = 1);
    processed_logprobs  when top_k and top_p are off (then "processed" is only z / T).

T != 1 together with top-k or top-p has no exact vLLM equivalent: such an engine is refused at
construction, and a `generate` call whose params do not fit the engine's mode raises.

Weights. `update_weights` and `load_weights_from_dir` check every name and shape here (against the
HF model's state_dict, built on the meta device), then run `WeightSyncExtension`'s methods in every
vLLM worker through ``LLM.collective_rpc``; those call the model's own ``load_weights``, which maps
HF names onto vLLM's fused layers. The prefix cache is reset afterwards (its KV came from the old
weights).
"""

from __future__ import annotations

import gc
import logging
from typing import Any, Iterable, Iterator, Sequence

import torch

from fleetrl.common.config.schema import ModelConfig, RolloutConfig
from fleetrl.rollout.engines.base import (
    Engine,
    Generation,
    ParamSpec,
    SamplingParams,
    check_named_shapes,
    missing_weights,
    safetensors_files,
    safetensors_shapes,
    state_specs,
)

log = logging.getLogger(__name__)

WORKER_EXTENSION = f"{__name__}.WeightSyncExtension"
# Weights are sent to the workers in buckets of about this many bytes (one RPC each).
BUCKET_BYTES = 512 << 20


def logprobs_mode_for(temperature: float, top_k: int, top_p: float) -> str:
    """The vLLM ``logprobs_mode`` whose values equal log_softmax(z / T) for these settings."""
    if temperature in (0.0, 1.0):
        return "raw_logprobs"
    if top_k == 0 and top_p == 1.0:
        return "processed_logprobs"
    raise ValueError(
        f"rollout.temperature={temperature} with top_k={top_k} / top_p={top_p}: vLLM returns log-probs either "
        "before temperature or after top-k/top-p, neither is the behaviour log-prob log_softmax(logits / T) "
        "the learner uses. Set rollout.temperature=1, or turn top_k/top_p off (top_k=0, top_p=1), "
        "or use rollout.engine=hf."
    )


def check_params_fit(params: SamplingParams, mode: str) -> None:
    """Raise when ``params`` would get log-probs of another kind than the engine's ``mode`` gives."""
    if mode == "raw_logprobs" and params.temperature not in (0.0, 1.0):
        raise ValueError(
            f"this vllm engine returns raw log-probs (built for temperature 1) but the call asks for "
            f"temperature={params.temperature}; build the engine with the temperature you sample at"
        )
    if mode == "processed_logprobs" and (params.top_k > 0 or params.top_p < 1.0):
        raise ValueError(
            f"this vllm engine returns temperature-scaled log-probs; top_k={params.top_k} / top_p={params.top_p} "
            "would make them top-k/top-p renormalised. Turn top_k/top_p off or sample at temperature 1"
        )


def to_vllm_params(params: SamplingParams, n: int) -> Any:
    from vllm import SamplingParams as VllmSamplingParams

    return VllmSamplingParams(
        n=n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,  # 0 = off, as in vLLM
        max_tokens=params.max_new_tokens,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        include_stop_str_in_output=False,
        skip_special_tokens=True,
        seed=params.seed,
        logprobs=0,  # the sampled token's log-prob only
    )


def to_generations(request_output: Any) -> list[Generation]:
    """A vLLM ``RequestOutput`` (one prompt, n completions) as our `Generation` records, in sample order."""
    samples = []
    for out in sorted(request_output.outputs, key=lambda o: o.index):
        if out.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM finished a sample with reason {out.finish_reason!r} (request aborted?)")
        token_ids = list(out.token_ids)
        logprobs = [position[token].logprob for position, token in zip(out.logprobs, token_ids)]
        samples.append(Generation(token_ids, logprobs, out.finish_reason, out.text))
    return samples


def hf_state_specs(model_cfg: ModelConfig, dtype: torch.dtype) -> tuple[list[ParamSpec], dict[str, str]]:
    """Specs and tied aliases of the HF model at ``model_cfg.path``, built on the meta device (no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_cfg.path, trust_remote_code=model_cfg.trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=model_cfg.trust_remote_code)
    return state_specs(model.state_dict(keep_vars=True))


def buckets(named: Sequence[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of ``named`` of at most ``max_bytes`` each (a bigger tensor goes alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


class WeightSyncExtension:
    """Mixed into every vLLM GPU worker (``worker_extension_cls``); called by ``collective_rpc``.

    Runs inside vLLM's worker processes, where ``self.model_runner`` and ``self.device`` exist.
    Names are prefixed so that they cannot collide with the worker's own methods.
    """

    def fleetrl_load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        weights = [(name, tensor.to(self.device, non_blocking=True)) for name, tensor in named]
        self.model_runner.model.load_weights(weights=weights)
        torch.cuda.synchronize()

    def fleetrl_load_weights_from_files(self, files: list[str]) -> None:
        from safetensors import safe_open

        for file in files:
            with safe_open(file, framework="pt", device=str(self.device)) as f:
                self.model_runner.model.load_weights(weights=((name, f.get_tensor(name)) for name in f.keys()))
        torch.cuda.synchronize()


class VllmEngine(Engine):
    def __init__(self, model_cfg: ModelConfig, rollout_cfg: RolloutConfig, device: str, seed: int):
        if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
            raise ValueError(
                f"rollout.engine=vllm needs a CUDA GPU (device={device!r}); use rollout.engine=hf on CPU"
            )
        if device.startswith("cuda:"):
            log.warning("vllm uses the GPUs in CUDA_VISIBLE_DEVICES, not device=%s; set it per server", device)
        self._llm = None
        self.mode = logprobs_mode_for(rollout_cfg.temperature, rollout_cfg.top_k, rollout_cfg.top_p)
        dtype = "bfloat16" if model_cfg.dtype == "auto" else model_cfg.dtype
        self._specs, self._aliases = hf_state_specs(model_cfg, getattr(torch, dtype))
        self._shapes = {name: shape for name, shape, _ in self._specs}
        self._shapes.update({alias: self._shapes[name] for alias, name in self._aliases.items()})
        self._llm = self._start(model_cfg, rollout_cfg, dtype, seed)
        self.tokenizer = self._load_tokenizer(model_cfg)
        log.info("vllm engine: %s, %s, logprobs_mode=%s", model_cfg.path, dtype, self.mode)

    def _start(self, model_cfg: ModelConfig, rollout_cfg: RolloutConfig, dtype: str, seed: int) -> Any:
        from vllm import LLM

        settings = rollout_cfg.vllm
        return LLM(
            model=model_cfg.path,
            tokenizer=model_cfg.tokenizer or model_cfg.path,
            dtype=dtype,
            seed=seed,
            trust_remote_code=model_cfg.trust_remote_code,
            tensor_parallel_size=settings.tensor_parallel_size,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            enforce_eager=settings.enforce_eager,
            max_model_len=settings.max_model_len,
            worker_extension_cls=WORKER_EXTENSION,
            logprobs_mode=self.mode,
        )

    @staticmethod
    def _load_tokenizer(model_cfg: ModelConfig) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(
            model_cfg.tokenizer or model_cfg.path, trust_remote_code=model_cfg.trust_remote_code
        )

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, n: int) -> list[list[Generation]]:
        if n < 1:
            raise ValueError(f"n={n}: ask for at least one sample per prompt")
        check_params_fit(params, self.mode)
        if not prompt_ids:
            return []
        prompts = [{"prompt_token_ids": list(ids)} for ids in prompt_ids]
        outputs = self._llm.generate(prompts, to_vllm_params(params, n), use_tqdm=False)
        return [to_generations(out) for out in outputs]

    def param_specs(self) -> list[ParamSpec]:
        return list(self._specs)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        named = list(named_tensors)
        check_named_shapes([(name, tuple(t.shape)) for name, t in named], self._shapes, "update_weights")
        for bucket in buckets(named, BUCKET_BYTES):
            cpu_bucket = [(name, tensor.detach().to("cpu")) for name, tensor in bucket]
            self._llm.collective_rpc("fleetrl_load_weights", args=(cpu_bucket,))
        self._llm.reset_prefix_cache()

    def load_weights_from_dir(self, path: str) -> None:
        files = safetensors_files(path)
        shapes = safetensors_shapes(files)
        check_named_shapes(shapes, self._shapes, f"load_weights_from_dir({path!r})")
        missing = missing_weights(self._specs, [name for name, _ in shapes], self._aliases)
        if missing:
            raise ValueError(
                f"load_weights_from_dir({path!r}): {len(missing)} weights are missing, e.g. {missing[:3]}. "
                "No weight was changed."
            )
        self._llm.collective_rpc("fleetrl_load_weights_from_files", args=([str(f.resolve()) for f in files],))
        self._llm.reset_prefix_cache()

    def close(self) -> None:
        if self._llm is None:
            return
        # The V1 engine core runs in its own process; shut it down rather than wait for exit.
        self._llm.llm_engine.engine_core.shutdown()
        self._llm = None
        gc.collect()
        torch.cuda.empty_cache()
