"""What every generation engine shares: sampling parameters, the `Generation` record, the `Engine`
interface, and the helpers both engines use (stop handling, weight validation, safetensors reading).

Behaviour log-prob convention (the learner computes the same): for a sampled token ``y_t``,

    logp_t = log_softmax(z_t / T)[y_t]        z_t: raw logits over the FULL vocabulary, T: temperature

taken before top-k / top-p filtering, which only decide what may be sampled. ``T == 0`` means greedy
decoding, whose log-probs are taken at ``T = 1``.

This module imports no torch at import time: the rollout server's light modules and the CPU test
collection can import `SamplingParams` and `Generation` without it.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import dataclasses
import difflib
import json
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Iterable, Sequence, TypeVar

if TYPE_CHECKING:
    import torch

    from fleetrl.common.config.schema import JobConfig, RolloutConfig

T = TypeVar("T")

ParamSpec = tuple[str, tuple[int, ...], "torch.dtype"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. ``temperature == 0`` is greedy; ``top_k == 0`` is off; ``seed`` None =
    the engine's own generator."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1 = off)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 = off)")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        # Lists from configs are accepted and frozen, so that the params stay hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_config(cls, rollout_cfg: RolloutConfig) -> SamplingParams:
        """The `rollout` section's sampling settings; the seed stays with the engine (None here)."""
        return cls(
            temperature=rollout_cfg.temperature,
            top_p=rollout_cfg.top_p,
            top_k=rollout_cfg.top_k,
            max_new_tokens=rollout_cfg.max_new_tokens,
            stop=tuple(rollout_cfg.stop),
            stop_token_ids=tuple(rollout_cfg.stop_token_ids),
        )


INFLIGHT_MODES = ("keep", "recompute", "finish")


@dataclass
class Request:
    """One generation request, token-in/token-out.

    prompt_ids: the whole context so far (an episode's prompt plus every earlier turn, as tokens;
        never re-tokenized).
    params: how to sample it: temperature, top-p/k, max_new_tokens, stop strings/ids and the seed
        (None = the engine's own generator).
    request_id: unique while the request is in flight (abort and logs use it).
    trace: the W3C trace context (traceparent, tracestate) of the caller's span, or None.
    on_token: streaming: called with the token ids sampled since its last call, as they are produced
        (hf: from the decode thread; vllm: on the engine loop), so it must be thread-safe and quick.
        What it got is not final (a stop string may cut the last tokens): the `Generation` is.
    """

    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    trace: dict[str, str] | None = None
    on_token: Callable[[list[int]], None] | None = field(default=None, compare=False, repr=False)


@dataclass
class Generation:
    """One sampled response (the result of one `Request`).

    token_ids: the sampled tokens, including the eos / stop token (or the token completing a stop
        string) that ended the response; the learner trains on all of them.
    logprobs: behaviour log-prob of each token in ``token_ids`` (see the module docstring).
    finish_reason: ``"stop"`` (eos, stop id or stop string) or ``"length"`` (max_new_tokens or the
        model's context length).
    text: the decoded response for rewards: special tokens skipped, a final stop token not decoded,
        cut before the first stop string.
    versions: the policy version of the weights that sampled each token (one per token; empty =
        all the engine's version at the time). A response sampled across an in-flight weight update
        spans two or more versions.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str
    versions: list[int] = field(default_factory=list)
    request_id: str = field(default="", compare=False)


class EngineLoop:
    """The asyncio event loop an engine runs on, in a thread of its own.

    Synchronous code (the rollout server's main loop, `fleetrl eval`, tests) hands coroutines to it
    with `submit` (a `concurrent.futures.Future`) or `call` (blocks for the result); coroutines
    that already run on it (a multi-turn episode) simply ``await engine.generate(request)``.
    """

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5.0)


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

    def generate_batch(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, n: int) -> list[list[Generation]]:
        """``n`` samples for each prompt, blocking: ``out[i][j]`` is sample ``j`` of ``prompt_ids[i]``.

        With ``params.seed`` set, sample ``j`` is seeded ``seed + j`` (as vLLM seeds its n children)."""
        if n < 1:
            raise ValueError(f"n={n}: ask for at least one sample per prompt")
        requests = [Request(list(ids), params if params.seed is None else dataclasses.replace(params, seed=params.seed + j))
                    for ids in prompt_ids for j in range(n)]
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

    def weight_receiver(self, cfg: JobConfig, device: str, client_id: str) -> Any:
        """What receives announced versions for this engine: an in-process `WeightReceiver`."""
        from fleetrl.rollout.weights import WeightReceiver

        return WeightReceiver(cfg, self.param_specs(), device, client_id)

    def close(self) -> None:
        """Release the model and its memory. The engine is unusable afterwards."""

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------ stopping


def eos_token_ids(tokenizer, generation_eos: int | list[int] | None, params: SamplingParams) -> list[int]:
    """Token ids that end a response: the tokenizer's eos, the model's generation-config eos
    (an int or a list), and ``params.stop_token_ids``; sorted, without duplicates."""
    ids = set(params.stop_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if isinstance(generation_eos, int):
        ids.add(generation_eos)
    elif generation_eos is not None:
        ids.update(generation_eos)
    return sorted(ids)


def find_stop(text: str, stops: Sequence[str]) -> int:
    """Index of the earliest occurrence of any stop string in ``text``, or -1."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else -1


def stop_window(stops: Sequence[str]) -> int:
    """Trailing tokens whose text must contain a stop string completed by the newest token.

    Every non-special token of a byte-level vocabulary is at least one byte, so a stop string of b
    bytes spans at most b tokens, plus up to 3 for a multi-byte character cut at the window's
    start. (A special token inside a stop string can still hide it from the window; the final
    full-text pass in the engine catches that case.)
    """
    return max(len(s.encode("utf-8")) for s in stops) + 3


# ------------------------------------------------------------------------------------- weights


def state_specs(state: dict[str, torch.Tensor]) -> tuple[list[ParamSpec], dict[str, str]]:
    """Specs of the distinct tensors of a state_dict (taken with ``keep_vars=True``), in its order,
    and the tied aliases: alias name -> first name of the same tensor (``lm_head.weight`` ->
    ``model.embed_tokens.weight`` when embeddings are tied)."""
    first: dict[int, str] = {}
    specs, aliases = [], {}
    for name, tensor in state.items():
        if id(tensor) in first:
            aliases[name] = first[id(tensor)]
        else:
            first[id(tensor)] = name
            specs.append((name, tuple(tensor.shape), tensor.dtype))
    return specs, aliases


def check_named_tensors(named: Sequence[tuple[str, Any]], expected: dict[str, tuple[int, ...]],
                        float_names: set[str], where: str) -> None:
    """`check_named_shapes`, and a tensor that is not floating point for a float weight is refused
    (float dtypes convert while copying: a bf16 learner may feed an fp32 rollout)."""
    check_named_shapes([(name, tuple(t.shape)) for name, t in named], expected, where)
    for name, tensor in named:
        if name in float_names and not tensor.is_floating_point():
            raise ValueError(f"{where}: weight {name!r} arrives as {tensor.dtype} but the model's is floating point; "
                             "send the model's own float weights. No weight was changed.")


def check_named_shapes(
    named: Sequence[tuple[str, tuple[int, ...]]], expected: dict[str, tuple[int, ...]], where: str
) -> None:
    """Raise ``ValueError`` naming the first unknown name or wrong shape in ``named``."""
    for name, shape in named:
        if name not in expected:
            close = difflib.get_close_matches(name, list(expected), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"{where}: unknown weight {name!r}{hint}; send the model's own (HF) names, see "
                "Engine.param_specs(). No weight was changed."
            )
        if tuple(shape) != tuple(expected[name]):
            raise ValueError(
                f"{where}: weight {name!r} has shape {tuple(shape)} but the model expects "
                f"{tuple(expected[name])}. No weight was changed."
            )


def safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors files of a HF model directory: the shards named by
    ``model.safetensors.index.json``, else ``model.safetensors``, else every ``*.safetensors``."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"weights directory {str(root)!r} does not exist")
    index = root / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / s for s in shards]
    single = root / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {str(root)!r} (expected model.safetensors or a sharded index)")
    return files


def safetensors_shapes(files: Sequence[Path]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor in ``files``, read from the headers only (no tensor data)."""
    from safetensors import safe_open

    shapes = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            shapes += [(name, tuple(f.get_slice(name).get_shape())) for name in f.keys()]
    return shapes


def missing_weights(specs: Sequence[ParamSpec], names: Iterable[str], aliases: dict[str, str]) -> list[str]:
    """Distinct weights of ``specs`` that neither their own name nor a tied alias in ``names`` covers."""
    covered = {aliases.get(n, n) for n in names}
    return [name for name, _, _ in specs if name not in covered]
