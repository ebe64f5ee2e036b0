"""The ``Engine`` interface every generation engine implements (``hf``, ``vllm``; docs/rollout.md, "Engines").

The pieces it is made of live one concept per file: ``params.py`` (``SamplingParams`` and the behaviour
log-prob convention), ``records.py`` (``Request``, ``Generation``), ``event_loop.py`` (``EngineLoop``),
``stops.py`` (eos ids, stop strings) and ``weight_files.py`` (weight checks, safetensors readers).

This module imports no torch at import time: the rollout server's light modules and the CPU test
collection can import it without it.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from fleetrl.rollout.engines.event_loop import EngineLoop
from fleetrl.rollout.engines.params import SamplingParams
from fleetrl.rollout.engines.records import Generation, Request
from fleetrl.rollout.engines.weight_files import ParamSpec

if TYPE_CHECKING:
    import torch

    from fleetrl.common.config.schema import JobConfig

INFLIGHT_MODES = ("keep", "recompute", "finish")


class Engine(abc.ABC):
    """A generation engine of one rollout server: one request at a time in, one response out.

    The interface (docs/rollout.md, "Engines"):

    - ``await generate(request) -> Generation``: any number of requests may be in flight; the
      engine batches them as it likes (vLLM's continuous batching; hf: its own, `rollout.hf`)
      and returns each as soon as it is done.
    - ``await swap_weights(load, mode)``: an in-flight weight update. Pauses generation as
      ``mode`` says (`INFLIGHT_MODES`: ``keep`` the in-flight requests and their KV cache,
      ``recompute`` their KV cache with the new weights, or let them ``finish`` on the old ones
      first), runs ``load()`` (which calls `update_weights` / `load_weights_from_dir` and returns
      the new version, or None when nothing changed), sets `version`, resumes. Tokens sampled
      after it carry the new version in `Generation.versions`.
    - `param_specs`, `update_weights`, `load_weights_from_dir`: the weights, by HF name (called
      while paused).
    - `weight_receiver(...)`: what takes announced versions in for this engine (an in-process
      `WeightReceiver`; vLLM: a receiver inside each of its workers).

    Every coroutine runs on the engine's `EngineLoop` (``self.loop``); `submit` and
    `generate_batch` are the synchronous doors to it.
    """

    tokenizer: Any
    loop: EngineLoop
    version: int = 0  # the policy version of the weights held (0 = model.path)

    @abc.abstractmethod
    async def generate(self, request: Request) -> Generation:
        """Sample one response to ``request``."""

    @abc.abstractmethod
    async def pause(self, mode: str) -> None:
        """Stop sampling (see the class docstring for ``mode``); returns once no step runs."""

    @abc.abstractmethod
    async def resume(self, new_version: int | None, mode: str) -> None:
        """Sample again; ``new_version`` is the version just loaded (None = the weights did not change)."""

    async def swap_weights(self, load: Callable[[], int | None], mode: str) -> int | None:
        """pause -> ``load()`` (in a worker thread) -> resume; returns the version loaded or None."""
        if mode not in INFLIGHT_MODES:
            raise ValueError(f"rollout.inflight_update={mode!r}; valid: {', '.join(INFLIGHT_MODES)}")
        await self.pause(mode)
        version = None
        try:
            version = await asyncio.to_thread(load)
        finally:
            if version is not None:
                self.version = version
            await self.resume(version, mode)
        return version

    async def generate_many(self, requests: Sequence[Request]) -> list[Generation]:
        """Every request of ``requests``, admitted together (one prefill on hf: reproducible with the engine seed)."""
        return list(await asyncio.gather(*(self.generate(r) for r in requests)))

    def submit(self, request: Request) -> concurrent.futures.Future[Generation]:
        """`generate` from synchronous code: the future completes with the Generation."""
        return self.loop.submit(self.generate(request))

    def generate_batch(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, n: int
    ) -> list[list[Generation]]:
        """``n`` samples for each prompt, blocking: ``out[i][j]`` is sample ``j`` of ``prompt_ids[i]``.

        With ``params.seed`` set, sample ``j`` is seeded ``seed + j`` (as vLLM seeds its n children)."""
        if n < 1:
            raise ValueError(f"n={n}: ask for at least one sample per prompt")
        requests = [
            Request(list(ids), params if params.seed is None else dataclasses.replace(params, seed=params.seed + j))
            for ids in prompt_ids
            for j in range(n)
        ]
        flat = self.loop.call(self.generate_many(requests)) if requests else []
        return [flat[i * n : (i + 1) * n] for i in range(len(prompt_ids))]

    @abc.abstractmethod
    def param_specs(self) -> list[ParamSpec]:
        """(name, shape, dtype) of each distinct weight tensor, in state_dict order (HF names).

        Tied aliases (``lm_head.weight`` when embeddings are tied) are not listed but are accepted by
        `update_weights`, so a sender may send either its full state_dict or exactly these.
        """

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the given weights in place. Every name, shape and dtype is checked before anything is
        copied: an unknown name, a wrong shape or a non-float tensor for a float weight raises
        ``ValueError`` and leaves all weights unchanged."""

    @abc.abstractmethod
    def load_weights_from_dir(self, path: str) -> None:
        """Load every weight from the safetensors file(s) of a HF model directory (same checks)."""

    def weights_fingerprint(self) -> tuple[str, str, str] | None:
        """``(dtype, names, fp)`` of the weights this engine samples from now, read from its live parameters
        (common/weightsync/fingerprint.py); None when the engine cannot give it cheaply (then the learner's
        ``stale_weights`` rule has nothing to compare: the vLLM engine, whose workers hold fused tensors)."""
        return None

    def weight_receiver(self, cfg: JobConfig, device: str, client_id: str) -> Any:
        """What receives announced versions for this engine: an in-process `WeightReceiver`."""
        from fleetrl.common.weightsync.receiver.receiver import WeightReceiver

        return WeightReceiver(cfg, self.param_specs(), device, client_id)

    def close(self) -> None:
        """Release the model and its memory. The engine is unusable afterwards."""

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
