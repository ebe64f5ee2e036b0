"""The `hf` engine: a transformers causal LM and our own sampling loop over its KV cache.

Requests (`Engine.generate`) queue for a decode thread that runs them in *waves*: every pending
request whose sampling settings match (the seed and max_new_tokens may differ) is decoded together,
each distinct prompt prefilled once. A request returns the moment its own row finishes, not when
the wave does; requests that arrive meanwhile wait for the next wave. Weight updates happen only
between two steps (`pause`): ``keep`` parks the wave and continues it on the same KV cache,
``recompute`` ends it and queues every unfinished row again as prompt + tokens so far (prefilled
with the new weights), ``finish`` lets the wave end before parking.

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

import asyncio
import logging
import threading
import time
from collections import deque
from typing import Iterable, Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from fleetrl.common.config.schema import ModelConfig, RolloutConfig
from fleetrl.rollout.engines.sampling import (  # noqa: F401 - draw and filter_top_k_top_p are tested from here
    _Batch,
    _Job,
    _Wave,
    draw,
    filter_top_k_top_p,
    resolve_device,
    resolve_dtype,
    sample_next,
    wave_key,
)
from fleetrl.rollout.engines.base import (
    Engine,
    EngineLoop,
    Generation,
    ParamSpec,
    Request,
    check_named_shapes,
    check_named_tensors,
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
IDLE_S = 2.0  # a decode thread without work for this long ends (engines over a learner's model are never closed)

_LOOP: EngineLoop | None = None
_LOOP_LOCK = threading.Lock()


def shared_loop() -> EngineLoop:
    """One event loop thread for every `hf` engine of the process (their work runs on decode threads)."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            _LOOP = EngineLoop("hf-engines-loop")
        return _LOOP


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
        self._floats = {name for name, t in self._targets.items() if t.is_floating_point()}
        self._specs, self._aliases = state_specs(self._targets)
        self._cv = threading.Condition()
        self._pending: deque[_Job] = deque()
        self._pause_mode: str | None = None  # set by pause(): the decode thread parks at the next point
        self._parked = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None  # started on demand, ends after IDLE_S without work
        self.loop = shared_loop()

    # ------------------------------------------------------------------------- the interface

    async def generate(self, request: Request) -> Generation:
        [generation] = await self.generate_many([request])
        return generation

    async def generate_many(self, requests: Sequence[Request]) -> list[Generation]:
        self._check_prompts([r.prompt_ids for r in requests])
        loop = asyncio.get_running_loop()
        jobs = [_Job(r, loop.create_future(), loop) for r in requests]
        for job in jobs:
            if job.request.params.seed is not None:
                job.generator = torch.Generator(self.device).manual_seed(job.request.params.seed)
        with self._cv:
            if self._closed:
                raise RuntimeError("the hf engine is closed")
            self._pending.extend(jobs)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="hf-engine-decode", daemon=True)
                self._thread.start()
            self._cv.notify_all()
        return list(await asyncio.gather(*(job.future for job in jobs)))

    async def pause(self, mode: str) -> None:
        with self._cv:
            self._parked.clear()
            self._pause_mode = mode
            if self._thread is None:  # no decode thread: nothing runs
                self._parked.set()
            self._cv.notify_all()
        while not self._parked.is_set():
            await asyncio.to_thread(self._parked.wait, 0.05)

    async def resume(self, new_version: int | None, mode: str) -> None:
        with self._cv:
            self._pause_mode = None
            self._cv.notify_all()

    # ------------------------------------------------------------------------- decode thread

    def _serve(self) -> None:
        while True:
            with self._cv:
                idle_since = time.monotonic()
                while not self._closed and (self._pause_mode is not None or not self._pending):
                    if self._pause_mode is not None:
                        self._parked.set()  # idle or between waves: nothing runs
                        idle_since = time.monotonic()
                    elif time.monotonic() - idle_since > IDLE_S:
                        self._thread = None  # the next request starts a new one
                        return
                    self._cv.wait(IDLE_S)
                if self._closed:
                    break
                jobs = self._take_wave()
            try:
                with torch.inference_mode():
                    self._decode(jobs)
            except BaseException as e:  # noqa: BLE001 - reported to each request, the thread goes on
                log.exception("hf engine: a wave of %d requests failed", len(jobs))
                for job in jobs:
                    job.resolve(e)
        for job in self._pending:
            job.resolve(RuntimeError("the hf engine was closed"))

    def _take_wave(self) -> list[_Job]:
        """Every pending job whose sampling settings match the oldest one's (called under the lock)."""
        key = wave_key(self._pending[0].request.params)
        jobs = [job for job in self._pending if wave_key(job.request.params) == key]
        self._pending = deque(job for job in self._pending if wave_key(job.request.params) != key)
        return jobs

    def _park(self, mode_in_wave: bool) -> str | None:
        """At a step boundary: park while paused when the pause mode acts inside a wave; returns the
        mode it parked for (None: not paused, or ``finish``, which waits for the wave's end)."""
        with self._cv:
            if self._closed:
                return "closed"
            mode = self._pause_mode
            if mode is None or (mode == "finish" and mode_in_wave):
                return None
            self._parked.set()
            while self._pause_mode is not None and not self._closed:
                self._cv.wait()
        return mode

    def _decode(self, jobs: list[_Job]) -> None:
        """The sampling loop of one wave: one forward per step over the live rows."""
        params = jobs[0].request.params
        width = max(job.budget for job in jobs)
        batch, logits_RV = self._prefill(jobs, width)
        wave = _Wave(jobs, params, torch.zeros(len(jobs), width, dtype=torch.long, device=self.device),
                     torch.zeros(len(jobs), width, dtype=torch.float32, device=self.device))
        stop_ids = torch.tensor(
            eos_token_ids(self.tokenizer, self.model.generation_config.eos_token_id, params), device=self.device
        )
        seeded = [i for i, job in enumerate(jobs) if job.generator is not None]
        for step in range(width):
            wave.step_versions.append(self.version)
            token_R, logp_R = sample_next(logits_RV, params, self._generator, self._uniforms(batch, jobs, seeded))
            wave.tokens_SM[batch.rows_R, step] = token_R
            wave.logp_SM[batch.rows_R, step] = logp_R
            done_R = torch.isin(token_R, stop_ids) | (batch.limit_R <= step + 1)
            by_string_R = self._stop_string_hits(wave.tokens_SM, batch, step, params.stop) if params.stop else None
            if by_string_R is not None:
                done_R |= by_string_R
            newly_R = done_R & batch.live_R
            if newly_R.any():
                strings = set(batch.rows_R[newly_R & by_string_R].tolist()) if by_string_R is not None else set()
                for row in batch.rows_R[newly_R].tolist():
                    jobs[row].resolve(self._assemble(wave, row, step + 1, row in strings))
                batch.live_R &= ~newly_R
                live = int(batch.live_R.sum())
                if live == 0:
                    return
                if live <= (1 - COMPACT_FRACTION) * batch.live_R.numel():
                    token_R = token_R[batch.live_R]
                    batch.select(batch.live_R)
            parked = self._park(mode_in_wave=True)
            if parked == "recompute":
                self._requeue(wave, batch, step + 1)
                return
            if parked == "closed":
                for row in batch.rows_R[batch.live_R].tolist():
                    jobs[row].resolve(RuntimeError("the hf engine was closed"))
                return
            logits_RV = self._step(batch, token_R, step)

    def _uniforms(self, batch: _Batch, jobs: list[_Job], seeded: list[int]) -> torch.Tensor | None:
        """Per-row uniforms when some rows have their own seed (else None: one draw for all)."""
        if not seeded:
            return None
        u_R = torch.rand(batch.rows_R.numel(), generator=self._generator, device=self.device)
        for pos, row in enumerate(batch.rows_R.tolist()):
            gen = jobs[row].generator
            if gen is not None:
                u_R[pos] = torch.rand(1, generator=gen, device=self.device)[0]
        return u_R

    def _requeue(self, wave: _Wave, batch: _Batch, steps: int) -> None:
        """``recompute``: the wave's unfinished rows go back to the queue's front as prompt + tokens
        so far; the next wave prefills them with the new weights."""
        rows = batch.rows_R[batch.live_R].tolist()
        tokens, logps = wave.tokens_SM[rows, :steps].tolist(), wave.logp_SM[rows, :steps].tolist()
        with self._cv:
            for row, toks, lps in reversed(list(zip(rows, tokens, logps))):
                job = wave.jobs[row]
                job.tokens, job.logprobs = job.tokens + toks, job.logprobs + lps
                job.versions = job.versions + wave.step_versions[:steps]
                self._pending.appendleft(job)
            self._cv.notify_all()

    def _prefill(self, jobs: list[_Job], width: int) -> tuple[_Batch, torch.Tensor]:
        """Run each distinct context once, then repeat its cache for each job that shares it."""
        contexts = [tuple(job.context) for job in jobs]
        distinct = list(dict.fromkeys(contexts))
        order = sorted(range(len(jobs)), key=lambda i: distinct.index(contexts[i]))  # sharers side by side
        jobs[:] = [jobs[i] for i in order]
        contexts = [contexts[i] for i in order]
        counts = torch.tensor([contexts.count(c) for c in distinct], device=self.device)
        lengths = [len(c) for c in distinct]
        longest = max(lengths)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids_BP = torch.tensor([[pad] * (longest - len(c)) + list(c) for c in distinct], device=self.device)
        length_B = torch.tensor(lengths, device=self.device)
        mask_BP = (torch.arange(longest, device=self.device) >= (longest - length_B)[:, None]).long()
        pos_BP = (mask_BP.cumsum(dim=-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids_BP, attention_mask=mask_BP, position_ids=pos_BP, past_key_values=cache, use_cache=True,
            logits_to_keep=1,
        )
        if bool((counts > 1).any()):
            cache.batch_select_indices(torch.arange(len(distinct), device=self.device).repeat_interleave(counts))
        mask_RL = torch.cat([mask_BP, mask_BP.new_ones(len(distinct), width)], dim=1).repeat_interleave(counts, dim=0)
        length_R = length_B.repeat_interleave(counts)
        budget_R = torch.tensor([job.budget for job in jobs], device=self.device)
        batch = _Batch(
            cache=cache,
            mask_RL=mask_RL,
            pos_R=length_R,
            limit_R=torch.minimum(self.max_positions - length_R, budget_R),
            rows_R=torch.arange(len(jobs), device=self.device),
            live_R=torch.ones(len(jobs), dtype=torch.bool, device=self.device),
            prompt_len=longest,
        )
        return batch, out.logits[:, -1].float().repeat_interleave(counts, dim=0)

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

    def _assemble(self, wave: _Wave, row: int, length: int, by_string: bool) -> Generation:
        """One finished row as a Generation: its tokens (after any earlier ``recompute`` part), reward text."""
        job, params = wave.jobs[row], wave.params
        stop_ids = set(eos_token_ids(self.tokenizer, self.model.generation_config.eos_token_id, params))
        ids = job.tokens + wave.tokens_SM[row, :length].tolist()
        lps = job.logprobs + wave.logp_SM[row, :length].tolist()
        versions = job.versions + wave.step_versions[:length]
        by_id = ids[-1] in stop_ids
        text = self.tokenizer.decode(ids[:-1] if by_id else ids, skip_special_tokens=True)
        cut = find_stop(text, params.stop) if params.stop else -1
        if cut >= 0 and not by_string:
            # A stop string the window could not see (a special token inside it, or a recompute
            # boundary): cut the tokens after the one that completed it, as the per-step check would.
            length = self._first_stop_prefix(ids, params.stop)
            ids, lps, versions, by_id = ids[:length], lps[:length], versions[:length], False
        finished = by_id or cut >= 0
        return Generation(ids, lps, "stop" if finished else "length", text[:cut] if cut >= 0 else text,
                          versions=versions, request_id=job.request.request_id)

    def _first_stop_prefix(self, ids: list[int], stops: Sequence[str]) -> int:
        """Fewest leading tokens of ``ids`` whose text contains a stop string."""
        texts = (self.tokenizer.decode(ids[:k], skip_special_tokens=True) for k in range(1, len(ids) + 1))
        return next(k for k, text in enumerate(texts, start=1) if find_stop(text, stops) >= 0)

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

    # --------------------------------------------------------------------------------- weights

    def param_specs(self) -> list[ParamSpec]:
        return list(self._specs)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        named = list(named_tensors)
        check_named_tensors(named, self._shapes, self._floats, "update_weights")
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
        with self._cv:
            self._closed = True
            thread = self._thread
            self._cv.notify_all()
        if thread is not None:
            thread.join(timeout=30.0)
        self.model = None
        self._targets = {}
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
