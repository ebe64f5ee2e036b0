"""The `hf` engine: a transformers causal LM and our own sampling loop over its KV cache.

Requests (`Engine.generate`) queue for a decode thread that runs them with *continuous batching*
(`rollout.hf.continuous`, the default): at every step, waiting requests join the running rows (up
to `rollout.hf.max_rows`): each distinct context is prefilled once, left-padded with explicit
per-row positions, and its KV rows merge into the running cache (`kv_rows.py`); a row that finishes
leaves the cache at once and its request returns. Rows of different sampling settings share the
forward and are drawn per settings group. With ``continuous: false`` the thread runs the older
*waves*: the pending requests of the oldest one's sampling settings decode together and requests
that arrive meanwhile wait for the wave to end. Weight updates happen only between two steps
(`pause`): ``keep`` parks the rows and continues them on the same KV cache, ``recompute`` queues
every unfinished row again as prompt + tokens so far (prefilled with the new weights),
``finish`` admits nobody and parks once the running rows are done.

Why not ``model.generate``: this loop is faster on the CPU presets (benchmarks/engine_throughput.py,
2 cores: ~25k vs ~18k tokens/s on tiny, ~7k vs ~5.5k on small), and ``generate`` returns the raw
logits of all steps at the end (``output_logits``: steps x rows x vocabulary floats, 77 GB for
1,000 tokens x 128 rows x 150k vocabulary), samples n copies of each prompt through n prefills, and
keeps finished rows in the batch. This loop computes each token's log-prob as it samples, prefills
each prompt once, drops finished rows, draws one random number per row (a seeded request from its
own generator, so its tokens do not depend on its neighbours), and decides each row's stop (eos /
stop id / stop string) itself.

Shape legend: B distinct contexts of a prefill, R rows decoded together, P padded prompt length,
T cache columns, V vocabulary, K tokens of the stop-string window.
Left padding: prompt tokens get positions 0..len-1 whatever their padding, as in the learner's
unpadded forward.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from fleetrl.common.chat.codec import decode
from fleetrl.common.chat.tokenizer import job_tokenizer
from fleetrl.common.config.schema import HfConfig, ModelConfig, RolloutConfig
from fleetrl.rollout.engines.attention import attention_for
from fleetrl.rollout.engines.base import Engine
from fleetrl.rollout.engines.event_loop import EngineLoop
from fleetrl.rollout.engines.kv_rows import Rows
from fleetrl.rollout.engines.params import SamplingParams
from fleetrl.rollout.engines.records import Generation, Request
from fleetrl.rollout.engines.sampling import (  # noqa: F401 - draw and filter_top_k_top_p are tested from here
    _Job,
    draw,
    filter_top_k_top_p,
    resolve_all,
    resolve_device,
    resolve_dtype,
    sample_rows,
)
from fleetrl.rollout.engines.stops import eos_token_ids, find_stop, stop_window
from fleetrl.rollout.engines.weight_files import (
    ParamSpec,
    check_named_shapes,
    check_named_tensors,
    missing_weights,
    safetensors_files,
    safetensors_shapes,
    state_specs,
)

log = logging.getLogger(__name__)

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


def stream_tokens(jobs: Sequence[_Job], token_R: torch.Tensor) -> None:
    """Hand each streaming request (``Request.on_token``) the token its row just sampled. A failing
    callback is logged and dropped: it never fails the decode step of the other rows."""
    watching = [(row, job) for row, job in enumerate(jobs) if job.request.on_token is not None]
    if not watching:
        return
    tokens = token_R.tolist()
    for row, job in watching:
        try:
            job.request.on_token([tokens[row]])
        except Exception:  # noqa: BLE001 - the caller's callback; its request still gets its Generation
            log.exception(
                "hf engine: the token callback of request %s failed; it gets no more tokens", job.request.request_id
            )
            job.request.on_token = None


def load_model(model_cfg: ModelConfig, device: torch.device) -> torch.nn.Module:
    """The model at ``model.path``, with grouped-query attention that copies no keys on CPU (`attention.py`);
    a model whose code takes no registered attention function loads with its own default."""
    kwargs = dict(dtype=resolve_dtype(model_cfg.dtype, device), trust_remote_code=model_cfg.trust_remote_code)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_cfg.path, attn_implementation=attention_for(device), **kwargs
        )
    except ValueError as e:  # transformers refuses an attention implementation the model class does not support
        log.info("hf engine: %s; loading with the model's default attention", e)
        model = AutoModelForCausalLM.from_pretrained(model_cfg.path, **kwargs)
    return model.to(device)


class HFEngine(Engine):
    def __init__(
        self, model_cfg: ModelConfig, rollout_cfg: RolloutConfig, device: str, seed: int, num_threads: int | None = None
    ):
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        device_ = resolve_device(device)
        tokenizer = job_tokenizer(model_cfg)
        model = load_model(model_cfg, device_)
        model.eval().requires_grad_(False)
        self._attach(model, tokenizer, device_, seed, rollout_cfg.hf)
        log.info(
            "hf engine: %s on %s (%s, %s attention)",
            model_cfg.path,
            self.device,
            self.model.dtype,
            self.model.config._attn_implementation,
        )

    @classmethod
    def from_model(
        cls, model: torch.nn.Module, tokenizer, device: torch.device, seed: int = 0, hf_cfg: HfConfig | None = None
    ) -> HFEngine:
        """An engine over a model already in memory (the learner's evaluation: its weights, not a copy).

        The caller owns the model's train/eval mode; the engine never changes the weights.
        """
        engine = cls.__new__(cls)
        engine._attach(model, tokenizer, device, seed, hf_cfg or HfConfig())
        return engine

    def _attach(self, model: torch.nn.Module, tokenizer, device: torch.device, seed: int, hf_cfg: HfConfig) -> None:
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
        self._continuous, self._max_rows = hf_cfg.continuous, hf_cfg.max_rows
        self._window_s = hf_cfg.admission_wait_ms / 1000.0  # `rollout.hf.admission_wait_ms`
        self._stop_ids: dict[SamplingParams, torch.Tensor] = {}  # per sampling settings (`_Job.key`)
        self._pause_mode: str | None = None  # set by pause(): the decode thread parks at the next point
        self._parked = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None  # started on demand, ends after IDLE_S without work
        self.loop = shared_loop()

    # ------------------------------------------------------------------------- the interface

    async def generate(self, request: Request) -> Generation:
        [job] = self._enqueue([request])
        return await job.future  # one request: no gather around one future

    async def generate_many(self, requests: Sequence[Request]) -> list[Generation]:
        return list(await asyncio.gather(*(job.future for job in self._enqueue(requests))))

    def _enqueue(self, requests: Sequence[Request]) -> list[_Job]:
        """Queue ``requests`` for the decode thread (started if none runs); their jobs, whose futures resolve
        on the calling event loop."""
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
        return jobs

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
        rows = Rows.empty(self.device)
        while True:
            with self._cv:
                idle_since = time.monotonic()
                while not self._closed and not rows and (self._pause_mode is not None or not self._pending):
                    if self._pause_mode is not None:
                        self._parked.set()  # no rows: nothing runs
                        idle_since = time.monotonic()
                    elif time.monotonic() - idle_since > IDLE_S:
                        self._thread = None  # the next request starts a new one
                        return
                    self._cv.wait(IDLE_S)
                if not rows:
                    self._hold()
                if self._closed:
                    break
                jobs = self._take(len(rows))
                if not rows and not jobs:  # a pause ended the admission window's wait: park above
                    continue
            try:
                with torch.inference_mode():
                    rows = self._iterate(rows, jobs)
            except BaseException as e:  # noqa: BLE001 - reported to each request, the thread goes on
                log.exception("hf engine: a decode step of %d rows failed", len(rows) + len(jobs))
                resolve_all([(job, e) for job in rows.jobs + jobs])  # a request already resolved keeps its result
                rows = Rows.empty(self.device)
        resolve_all([(job, RuntimeError("the hf engine was closed")) for job in rows.jobs + list(self._pending)])

    def _take(self, running: int) -> list[_Job]:
        """The pending jobs that join now (called under the lock): none while paused; continuous: the
        oldest ones up to `rollout.hf.max_rows` rows; waves: with no rows running, every pending job
        whose sampling settings match the oldest one's."""
        if self._pause_mode is not None or (running and not self._continuous) or self._window_left(running):
            return []
        room = self._max_rows - running if self._max_rows else len(self._pending)
        key = None if self._continuous or not self._pending else self._pending[0].key
        taken: list[_Job] = []
        waiting: deque[_Job] = deque()
        for job in self._pending:
            (taken if len(taken) < room and key in (None, job.key) else waiting).append(job)
        self._pending = waiting
        return taken

    def _window_left(self, running: int) -> float:
        """Seconds the admission window (`rollout.hf.admission_wait_ms`) still holds the queued jobs (under the
        lock): it opens when the oldest queued job arrived and closes early once they fill `max_rows`. 0: closed."""
        if not self._window_s or not self._pending:
            return 0.0
        if self._max_rows and len(self._pending) >= self._max_rows - running:
            return 0.0
        return max(0.0, self._pending[0].queued_at + self._window_s - time.monotonic())

    def _hold(self) -> None:
        """No rows running: wait (under the lock) while the admission window is open, so that the requests
        arriving meanwhile join in one prefill; a close or a pause ends the wait at once."""
        while not self._closed and self._pause_mode is None and (left := self._window_left(0)) > 0:
            self._cv.wait(left)

    def _park(self) -> str | None:
        """At a step boundary: park while paused in a mode that acts on running rows; returns the mode
        it parked for (None: not paused, or ``finish``, which lets the rows end first)."""
        with self._cv:
            if self._closed:
                return "closed"
            mode = self._pause_mode
            if mode is None or mode == "finish":
                return None
            while self._pause_mode is not None and not self._closed:
                # set again after every wake: a resume and the next pause can both come before this thread
                # wakes, and that pause (which cleared the event) is waiting to hear that nothing runs
                mode = self._pause_mode
                self._parked.set()
                self._cv.wait()
        return mode

    def _iterate(self, rows: Rows, jobs: list[_Job]) -> Rows:
        """One decode step: ``jobs`` join (prefilled), every row samples a token, finished rows leave
        and return, then one forward over the rest (after any pause). Returns the rows still running."""
        if jobs:
            rows = rows.merge(self._prefill(jobs))
        assert rows.logits_RV is not None
        token_R, logp_R, done_R = sample_rows(
            rows.logits_RV, rows.groups, rows.jobs, self._generator, self._stop_ids_of
        )
        rows.record(token_R, logp_R, self.version)
        stream_tokens(rows.jobs, token_R)
        done_R |= rows.steps_R >= rows.limit_R
        by_string_R = self._stop_string_hits(rows)
        if by_string_R is not None:
            done_R |= by_string_R
        if bool(done_R.any()):
            finished = done_R.nonzero().squeeze(1).tolist()
            by_string = [False] * len(finished) if by_string_R is None else by_string_R[finished].tolist()
            resolve_all([(rows.jobs[row], self._assemble(rows, row, hit)) for row, hit in zip(finished, by_string)])
            token_R = token_R[~done_R]
            rows = rows.keep(~done_R)
        parked = self._park()
        if parked == "recompute":
            self._requeue(rows)
            return Rows.empty(self.device)
        if rows and parked != "closed":  # closed: `_serve` fails the rows left
            self._step(rows, token_R)
        return rows

    def _stop_ids_of(self, params: SamplingParams) -> torch.Tensor:
        if params not in self._stop_ids:
            eos = eos_token_ids(self.tokenizer, self.model.generation_config.eos_token_id, params)
            self._stop_ids[params] = torch.tensor(eos, device=self.device)
        return self._stop_ids[params]

    def _requeue(self, rows: Rows) -> None:
        """``recompute``: the unfinished rows go back to the queue's front as prompt + tokens so far;
        the next step prefills them with the new weights."""
        with self._cv:
            for row in reversed(range(len(rows))):
                job = rows.jobs[row]
                tokens, logps, versions = rows.sampled(row)
                job.tokens, job.logprobs, job.versions = (
                    job.tokens + tokens,
                    job.logprobs + logps,
                    job.versions + versions,
                )
                self._pending.appendleft(job)
            self._cv.notify_all()

    def _prefill(self, jobs: list[_Job]) -> Rows:
        """Run each distinct context once, then repeat its cache for each job that shares it."""
        contexts = [tuple(job.context) for job in jobs]
        distinct = list(dict.fromkeys(contexts))
        order = sorted(range(len(jobs)), key=lambda i: distinct.index(contexts[i]))  # sharers side by side
        jobs = [jobs[i] for i in order]
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
            input_ids=ids_BP,
            attention_mask=mask_BP,
            position_ids=pos_BP,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        if bool((counts > 1).any()):
            cache.batch_select_indices(torch.arange(len(distinct), device=self.device).repeat_interleave(counts))
        length_R = length_B.repeat_interleave(counts)
        budget_R = torch.tensor([job.budget for job in jobs], device=self.device)
        limit_R = torch.minimum(self.max_positions - length_R, budget_R)
        logits_RV = out.logits[:, -1].float().repeat_interleave(counts, dim=0)
        return Rows.start(jobs, cache, mask_BP.repeat_interleave(counts, dim=0), length_R, limit_R, logits_RV)

    def _step(self, rows: Rows, token_R: torch.Tensor) -> None:
        """Feed each row's newest token; sets the next logits, float32 [R, V]."""
        rows.mask_RT = torch.cat([rows.mask_RT, rows.mask_RT.new_ones(len(rows), 1)], dim=1)
        out = self.model(
            input_ids=token_R[:, None],
            attention_mask=rows.mask_RT,
            position_ids=rows.pos_R[:, None],
            past_key_values=rows.cache,
            use_cache=True,
        )
        rows.pos_R = rows.pos_R + 1
        rows.logits_RV = out.logits[:, -1].float()

    def _stop_string_hits(self, rows: Rows) -> torch.Tensor | None:
        """Rows whose text gained a stop string with their newest token (window of their last K
        tokens); None when no row has stop strings."""
        hits_R = None
        for params, index in rows.groups:
            if not params.stop:
                continue
            members = list(range(len(rows)))[index] if isinstance(index, slice) else index.tolist()
            windows = rows.last_tokens(index, stop_window(params.stop))
            if self._rust_tokenizer is not None:  # the same text, ~3x faster than batch_decode
                texts = self._rust_tokenizer.decode_batch(windows, skip_special_tokens=True)
            else:
                texts = self.tokenizer.batch_decode(windows, skip_special_tokens=True)
            if hits_R is None:
                hits_R = torch.zeros(len(rows), dtype=torch.bool, device=self.device)
            hits_R[members] = torch.tensor(
                [any(stop in text for stop in params.stop) for text in texts], dtype=torch.bool, device=self.device
            )
        return hits_R

    def _assemble(self, rows: Rows, row: int, by_string: bool) -> Generation:
        """One finished row as a Generation: its tokens (after any earlier ``recompute`` part), reward text."""
        job, params = rows.jobs[row], rows.jobs[row].request.params
        tokens, logps, versions_ = rows.sampled(row)
        ids, lps, versions = job.tokens + tokens, job.logprobs + logps, job.versions + versions_
        by_id = ids[-1] in set(self._stop_ids_of(job.key).tolist())
        text = decode(self.tokenizer, ids[:-1] if by_id else ids, skip_special_tokens=True)
        cut = find_stop(text, params.stop) if params.stop else -1
        if cut >= 0 and not by_string:
            # A stop string the window could not see (a special token inside it, or a recompute
            # boundary): cut the tokens after the one that completed it, as the per-step check would.
            length = self._first_stop_prefix(ids, params.stop)
            ids, lps, versions, by_id = ids[:length], lps[:length], versions[:length], False
        finished = by_id or cut >= 0
        return Generation(
            ids,
            lps,
            "stop" if finished else "length",
            text[:cut] if cut >= 0 else text,
            versions=versions,
            request_id=job.request.request_id,
        )

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

    def weights_fingerprint(self) -> tuple[str, str, str] | None:
        from fleetrl.common.weightsync.fingerprint import fingerprint

        return fingerprint(self.model.named_parameters()) if self.model is not None else None

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
