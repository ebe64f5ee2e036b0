"""The `hf` engine: a transformers causal LM and our own sampling loop over its KV cache.

Why not ``model.generate``: this loop is faster on the CPU presets (benchmarks/engine_throughput.py,
2 cores: ~25k vs ~18k tokens/s on tiny, ~7k vs ~5.5k on small), and ``generate`` returns the raw
logits of all steps at the end (``output_logits``: steps x rows x vocabulary floats, 77 GB for
1,000 tokens x 128 rows x 150k vocabulary), samples n copies of each prompt through n prefills, and
keeps finished rows in the batch. This loop computes each token's log-prob as it samples, prefills
each prompt once, drops finished rows, draws one random number per row, and decides each row's stop
(eos / stop id / stop string) itself.

Shape legend: B prompts, R rows decoded together (B * n, fewer once finished rows are dropped),
P padded prompt length, L = P + max_new_tokens, V vocabulary, K tokens of the stop-string window,
S samples (B * n), M max_new_tokens.
Left padding: prompt tokens get positions 0..len-1 whatever their padding, as in the learner's
unpadded forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from fleetrl.common.config.schema import ModelConfig, RolloutConfig
from fleetrl.rollout.engines.base import (
    Engine,
    Generation,
    ParamSpec,
    SamplingParams,
    check_named_shapes,
    eos_token_ids,
    find_stop,
    missing_weights,
    safetensors_files,
    safetensors_shapes,
    state_specs,
    stop_window,
)

log = logging.getLogger(__name__)

# Drop finished rows from the batch once this fraction of it is finished.
COMPACT_FRACTION = 0.25


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"rollout.device={device!r} but no CUDA device is visible; use cpu or auto")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def filter_top_k_top_p(scores_RV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf every score outside the top ``top_k`` (0 = off) and outside the nucleus: the
    smallest set of highest-probability tokens whose mass reaches ``top_p`` (1 = off)."""
    if 0 < top_k < scores_RV.shape[-1]:
        kth_R1 = scores_RV.topk(top_k, dim=-1).values[:, -1:]
        scores_RV = scores_RV.masked_fill(scores_RV < kth_R1, float("-inf"))
    if top_p < 1.0:
        sorted_RV, order_RV = scores_RV.sort(dim=-1, descending=True)
        probs_RV = sorted_RV.softmax(dim=-1)
        mass_before_RV = probs_RV.cumsum(dim=-1) - probs_RV
        drop_RV = mass_before_RV >= top_p
        drop_RV[:, 0] = False
        scores_RV = scores_RV.scatter(-1, order_RV, sorted_RV.masked_fill(drop_RV, float("-inf")))
    return scores_RV


def sample_next(
    logits_RV: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; returns (token_R, logp_R) with logp = log_softmax(z / T)[token]
    over the full vocabulary (T = 1 for greedy), not over the top-k / top-p filtered scores."""
    if params.greedy:
        token_R = logits_RV.argmax(dim=-1)
        logp_RV = logits_RV.log_softmax(dim=-1)
    else:
        scaled_RV = logits_RV / params.temperature if params.temperature != 1.0 else logits_RV
        logp_RV = scaled_RV.log_softmax(dim=-1)
        if params.top_k > 0 or params.top_p < 1.0:
            probs_RV = filter_top_k_top_p(scaled_RV, params.top_k, params.top_p).softmax(dim=-1)
        else:
            probs_RV = logp_RV.exp()
        token_R = draw(probs_RV, generator)
    return token_R, logp_RV.gather(1, token_R[:, None]).squeeze(1)


def draw(probs_RV: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row by inverse-CDF sampling: the first token whose cumulative mass exceeds
    u * total, u ~ U[0, 1). One random number per row (``torch.multinomial`` draws one per
    vocabulary entry on CPU, ~10x slower here); tokens of zero mass are never drawn."""
    cdf_RV = probs_RV.cumsum(dim=-1)
    u_R1 = torch.rand(cdf_RV.shape[0], 1, generator=generator, device=cdf_RV.device) * cdf_RV[:, -1:]
    return torch.searchsorted(cdf_RV, u_R1, right=True).squeeze(1)


@dataclass
class _Batch:
    """The rows being decoded. ``rows_R`` maps each to its sample index in 0..B*n-1."""

    cache: DynamicCache
    mask_RL: torch.Tensor  # attention mask over the prompt and every step (steps are all 1)
    pos_R: torch.Tensor  # position of the next token fed
    limit_R: torch.Tensor  # most tokens the row may sample (max_new_tokens or context length)
    rows_R: torch.Tensor
    live_R: torch.Tensor  # False once finished (kept in the batch until compaction)
    prompt_len: int

    def select(self, keep_R: torch.Tensor) -> None:
        index = keep_R.nonzero().squeeze(1)
        self.cache.batch_select_indices(index)
        for name in ("mask_RL", "pos_R", "limit_R", "rows_R", "live_R"):
            setattr(self, name, getattr(self, name)[index])


@dataclass
class _Outcome:
    """Per sample: tokens / log-probs written at each step, and where and why it stopped."""

    tokens_SM: torch.Tensor
    logp_SM: torch.Tensor
    length: list[int] = field(default_factory=list)
    by_string: list[bool] = field(default_factory=list)


class HFEngine(Engine):
    def __init__(
        self, model_cfg: ModelConfig, rollout_cfg: RolloutConfig, device: str, seed: int, num_threads: int | None = None
    ):
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        device_ = resolve_device(device)
        tokenizer = AutoTokenizer.from_pretrained(
            model_cfg.tokenizer or model_cfg.path, trust_remote_code=model_cfg.trust_remote_code
        )
        model = AutoModelForCausalLM.from_pretrained(
            model_cfg.path,
            dtype=resolve_dtype(model_cfg.dtype, device_),
            trust_remote_code=model_cfg.trust_remote_code,
        ).to(device_)
        model.eval().requires_grad_(False)
        self._attach(model, tokenizer, device_, seed)
        log.info("hf engine: %s on %s (%s)", model_cfg.path, self.device, self.model.dtype)

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer, device: torch.device, seed: int = 0) -> "HFEngine":
        """An engine over a model already in memory (the learner's evaluation: its weights, not a copy).

        The caller owns the model's train/eval mode; the engine never changes the weights.
        """
        engine = cls.__new__(cls)
        engine._attach(model, tokenizer, device, seed)
        return engine

    def _attach(self, model: torch.nn.Module, tokenizer, device: torch.device, seed: int) -> None:
        self.device, self.tokenizer, self.model = device, tokenizer, model
        self._rust_tokenizer = getattr(self.tokenizer, "backend_tokenizer", None)  # None for Python tokenizers
        self.max_positions = self.model.config.max_position_embeddings
        self._generator = torch.Generator(self.device).manual_seed(seed)
        self._targets = self.model.state_dict(keep_vars=True)  # every name, tied aliases included
        self._shapes = {name: tuple(t.shape) for name, t in self._targets.items()}
        self._specs, self._aliases = state_specs(self._targets)

    # ------------------------------------------------------------------------------ generation

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, n: int) -> list[list[Generation]]:
        if n < 1:
            raise ValueError(f"n={n}: ask for at least one sample per prompt")
        self._check_prompts(prompt_ids)
        if not prompt_ids:
            return []
        generator = self._generator
        if params.seed is not None:
            generator = torch.Generator(self.device).manual_seed(params.seed)
        with torch.inference_mode():
            outcome = self._decode(prompt_ids, params, n, generator)
        samples = self._assemble(outcome, params)
        return [samples[i * n : (i + 1) * n] for i in range(len(prompt_ids))]

    def _check_prompts(self, prompt_ids: Sequence[Sequence[int]]) -> None:
        vocab = self.model.config.vocab_size
        for i, ids in enumerate(prompt_ids):
            if not ids:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            if len(ids) >= self.max_positions:
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens but the model's context is {self.max_positions}; "
                    "lower data.max_prompt_tokens"
                )
            if min(ids) < 0 or max(ids) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab})")

    def _decode(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, n: int, generator: torch.Generator
    ) -> _Outcome:
        """The sampling loop: one forward per step over the live rows, log-probs from raw logits."""
        batch, logits_RV = self._prefill(prompt_ids, params.max_new_tokens, n)
        rows = batch.rows_R.numel()
        outcome = _Outcome(
            tokens_SM=torch.zeros(rows, params.max_new_tokens, dtype=torch.long, device=self.device),
            logp_SM=torch.zeros(rows, params.max_new_tokens, dtype=torch.float32, device=self.device),
            length=[params.max_new_tokens] * rows,
            by_string=[False] * rows,
        )
        stop_ids = torch.tensor(
            eos_token_ids(self.tokenizer, self.model.generation_config.eos_token_id, params), device=self.device
        )
        for step in range(params.max_new_tokens):
            token_R, logp_R = sample_next(logits_RV, params, generator)
            outcome.tokens_SM[batch.rows_R, step] = token_R
            outcome.logp_SM[batch.rows_R, step] = logp_R
            done_R = torch.isin(token_R, stop_ids) | (batch.limit_R <= step + 1)
            if params.stop:
                by_string_R = self._stop_string_hits(outcome.tokens_SM, batch, step, params.stop)
                done_R |= by_string_R
            newly_R = done_R & batch.live_R
            if newly_R.any():
                for row in batch.rows_R[newly_R].tolist():
                    outcome.length[row] = step + 1
                if params.stop:
                    for row in batch.rows_R[newly_R & by_string_R].tolist():
                        outcome.by_string[row] = True
                batch.live_R &= ~newly_R
                live = int(batch.live_R.sum())
                if live == 0:
                    break
                if live <= (1 - COMPACT_FRACTION) * batch.live_R.numel():
                    token_R = token_R[batch.live_R]
                    batch.select(batch.live_R)
            logits_RV = self._step(batch, token_R, step)
        return outcome

    def _prefill(self, prompt_ids: Sequence[Sequence[int]], max_new: int, n: int) -> tuple[_Batch, torch.Tensor]:
        """Run the B distinct prompts once, then repeat their cache n times (rows i*n .. i*n+n-1)."""
        lengths = [len(ids) for ids in prompt_ids]
        width = max(lengths)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids_BP = torch.tensor([[pad] * (width - len(ids)) + list(ids) for ids in prompt_ids], device=self.device)
        length_B = torch.tensor(lengths, device=self.device)
        mask_BP = (torch.arange(width, device=self.device) >= (width - length_B)[:, None]).long()
        pos_BP = (mask_BP.cumsum(dim=-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids_BP, attention_mask=mask_BP, position_ids=pos_BP, past_key_values=cache, use_cache=True,
            logits_to_keep=1,
        )
        cache.batch_repeat_interleave(n)
        mask_RL = torch.cat([mask_BP, mask_BP.new_ones(len(lengths), max_new)], dim=1).repeat_interleave(n, dim=0)
        length_R = length_B.repeat_interleave(n)
        batch = _Batch(
            cache=cache,
            mask_RL=mask_RL,
            pos_R=length_R,
            limit_R=(self.max_positions - length_R).clamp(max=max_new),
            rows_R=torch.arange(len(lengths) * n, device=self.device),
            live_R=torch.ones(len(lengths) * n, dtype=torch.bool, device=self.device),
            prompt_len=width,
        )
        return batch, out.logits[:, -1].float().repeat_interleave(n, dim=0)

    def _step(self, batch: _Batch, token_R: torch.Tensor, step: int) -> torch.Tensor:
        """Feed the tokens sampled at ``step``; returns the next logits, float32 [R, V]."""
        out = self.model(
            input_ids=token_R[:, None],
            attention_mask=batch.mask_RL[:, : batch.prompt_len + step + 1],
            position_ids=batch.pos_R[:, None],
            past_key_values=batch.cache,
            use_cache=True,
        )
        batch.pos_R = batch.pos_R + 1
        return out.logits[:, -1].float()

    def _stop_string_hits(
        self, tokens_SM: torch.Tensor, batch: _Batch, step: int, stops: Sequence[str]
    ) -> torch.Tensor:
        """Rows whose text gained a stop string with the token of ``step`` (window of the last K tokens)."""
        start = max(0, step + 1 - stop_window(stops))
        windows_RK = tokens_SM[batch.rows_R, start : step + 1].tolist()
        if self._rust_tokenizer is not None:  # the same text, ~3x faster than batch_decode
            texts = self._rust_tokenizer.decode_batch(windows_RK, skip_special_tokens=True)
        else:
            texts = self.tokenizer.batch_decode(windows_RK, skip_special_tokens=True)
        return torch.tensor([any(stop in text for stop in stops) for text in texts], device=self.device)

    def _assemble(self, outcome: _Outcome, params: SamplingParams) -> list[Generation]:
        """Cut each sample at its length and decode its reward text."""
        stop_ids = set(eos_token_ids(self.tokenizer, self.model.generation_config.eos_token_id, params))
        tokens = outcome.tokens_SM.tolist()
        logps = outcome.logp_SM.tolist()
        samples = []
        for row, length in enumerate(outcome.length):
            ids, lps = tokens[row][:length], logps[row][:length]
            by_id = ids[-1] in stop_ids
            text = self.tokenizer.decode(ids[:-1] if by_id else ids, skip_special_tokens=True)
            cut = find_stop(text, params.stop) if params.stop else -1
            if cut >= 0 and not outcome.by_string[row]:
                # A stop string the window could not see (a special token inside it): cut the
                # tokens after the one that completed it, as the per-step check would have.
                length = self._first_stop_prefix(ids, params.stop)
                ids, lps, by_id = ids[:length], lps[:length], False
            finished = by_id or cut >= 0
            samples.append(Generation(ids, lps, "stop" if finished else "length", text[:cut] if cut >= 0 else text))
        return samples

    def _first_stop_prefix(self, ids: list[int], stops: Sequence[str]) -> int:
        """Fewest leading tokens of ``ids`` whose text contains a stop string."""
        texts = (self.tokenizer.decode(ids[:k], skip_special_tokens=True) for k in range(1, len(ids) + 1))
        return next(k for k, text in enumerate(texts, start=1) if find_stop(text, stops) >= 0)

    # --------------------------------------------------------------------------------- weights

    def param_specs(self) -> list[ParamSpec]:
        return list(self._specs)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        named = list(named_tensors)
        check_named_shapes([(name, tuple(t.shape)) for name, t in named], self._shapes, "update_weights")
        with torch.no_grad():
            for name, tensor in named:
                self._targets[name].copy_(tensor)

    def load_weights_from_dir(self, path: str) -> None:
        from safetensors import safe_open

        files = safetensors_files(path)
        shapes = safetensors_shapes(files)
        check_named_shapes(shapes, self._shapes, f"load_weights_from_dir({path!r})")
        missing = missing_weights(self.param_specs(), [name for name, _ in shapes], self._aliases)
        if missing:
            raise ValueError(
                f"load_weights_from_dir({path!r}): {len(missing)} weights are missing, e.g. {missing[:3]}. "
                "No weight was changed."
            )
        with torch.no_grad():
            for file in files:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in f.keys():
                        self._targets[name].copy_(f.get_tensor(name))

    def close(self) -> None:
        self.model = None
        self._targets = {}
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
