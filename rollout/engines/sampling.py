"""The `hf` engine's sampling arithmetic and decode state: devices and dtypes, top-k / top-p filtering,
one token per row with its behaviour log-prob (the convention of `base.py`), which requests sample
alike (`wave_key`), and `_Job`, one request inside the engine (its rows: `kv_rows.py`)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fleetrl.rollout.engines.params import SamplingParams
from fleetrl.rollout.engines.records import Generation, Request


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
    logits_RV: torch.Tensor, params: SamplingParams, generator: torch.Generator, u_R: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; returns (token_R, logp_R) with logp = log_softmax(z / T)[token]
    over the full vocabulary (T = 1 for greedy), not over the top-k / top-p filtered scores.
    ``u_R``: the rows' uniform numbers (per-request seeds), else drawn from ``generator``."""
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
        token_R = draw(probs_RV, generator, u_R)
    return token_R, logp_RV.gather(1, token_R[:, None]).squeeze(1)


def sample_rows(
    logits_RV: torch.Tensor,
    groups: list,
    jobs: list[_Job],
    generator: torch.Generator,
    stop_ids: Callable[[SamplingParams], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A token per row, each group of rows (sampling settings, rows: a slice or an index tensor, as
    `kv_rows.groups_of` gives) by its own settings; returns (token_R, logp_R, stopped_R), stopped =
    the token is an eos or stop id of the row's settings (``stop_ids(settings)``)."""
    token_R = torch.empty(logits_RV.shape[0], dtype=torch.long, device=logits_RV.device)
    logp_R = torch.empty(logits_RV.shape[0], dtype=torch.float32, device=logits_RV.device)
    stopped_R = torch.empty(logits_RV.shape[0], dtype=torch.bool, device=logits_RV.device)
    for params, index in groups:
        members = jobs[index] if isinstance(index, slice) else [jobs[i] for i in index.tolist()]
        u_R = None if params.greedy else row_uniforms(members, generator, logits_RV.device)
        token_R[index], logp_R[index] = sample_next(logits_RV[index], params, generator, u_R)
        stopped_R[index] = torch.isin(token_R[index], stop_ids(params))
    return token_R, logp_R, stopped_R


def row_uniforms(jobs: list[_Job], generator: torch.Generator, device: torch.device) -> torch.Tensor | None:
    """Per-row uniforms when some rows have their own seed (a seeded row draws from its own
    generator, so its tokens do not depend on its neighbours); else None: one draw for all."""
    if all(job.generator is None for job in jobs):
        return None
    u_R = torch.rand(len(jobs), generator=generator, device=device)
    for pos, job in enumerate(jobs):
        if job.generator is not None:
            u_R[pos] = torch.rand(1, generator=job.generator, device=device)[0]
    return u_R


def draw(probs_RV: torch.Tensor, generator: torch.Generator, u_R: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row by inverse-CDF sampling: the first token whose cumulative mass exceeds
    u * total, u ~ U[0, 1). One random number per row (``torch.multinomial`` draws one per
    vocabulary entry on CPU, ~10x slower here); tokens of zero mass are never drawn."""
    cdf_RV = probs_RV.cumsum(dim=-1)
    if u_R is None:
        u_R = torch.rand(cdf_RV.shape[0], generator=generator, device=cdf_RV.device)
    return torch.searchsorted(cdf_RV, u_R[:, None] * cdf_RV[:, -1:], right=True).squeeze(1)


def wave_key(params: SamplingParams) -> SamplingParams:
    """What rows sampled by one draw must share (and, with waves, the requests of one wave):
    everything but the seed and max_new_tokens."""
    return dataclasses.replace(params, seed=None, max_new_tokens=1)


@dataclass
class _Job:
    """One request in the engine: its future, and what it sampled before a ``recompute``."""

    request: Request
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    generator: torch.Generator | None = None  # its own when the request has a seed
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    queued_at: float = field(default_factory=time.monotonic)  # when it was queued (the admission window)

    @property
    def context(self) -> list[int]:
        return list(self.request.prompt_ids) + self.tokens

    @functools.cached_property
    def key(self) -> SamplingParams:
        return wave_key(self.request.params)

    @property
    def budget(self) -> int:
        return self.request.params.max_new_tokens - len(self.tokens)

    def resolve(self, generation: Generation | BaseException) -> None:
        resolve_all([(self, generation)])


def _settle(job: _Job, outcome: Generation | BaseException) -> None:
    """On the job's event loop: its future gets ``outcome`` (a future already resolved keeps its result)."""
    if job.future.done():
        return
    if isinstance(outcome, BaseException):
        job.future.set_exception(outcome)
    else:
        job.future.set_result(outcome)


def _settle_all(outcomes: list[tuple[_Job, Generation | BaseException]]) -> None:
    for job, outcome in outcomes:
        _settle(job, outcome)


def resolve_all(outcomes: list[tuple[_Job, Generation | BaseException]]) -> None:
    """Resolve jobs from the decode thread with one wake-up of each event loop they wait on, not one per
    job: the rows that end in one decode step return together."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Job, Generation | BaseException]]] = {}
    for job, outcome in outcomes:
        by_loop.setdefault(job.loop, []).append((job, outcome))
    for loop, items in by_loop.items():
        loop.call_soon_threadsafe(_settle_all, items)
