"""The one update skeleton every objective uses: log-probs, collective-matched passes, accumulate and step.

    logp, entropy = response_logprobs(model, mb, temperature, entropy=True)
    outs = forward_passes(model_fn, items, device)               # no-grad passes, ranks matched
    stats = accumulate_and_step(engine, items, loss_fn, device)  # backward per item, one optimizer step

``loss_fn(item) -> Piece(loss, share, metrics)`` is all an objective writes: the policy loss, the
critic's value loss and the DPO losses are such functions. The skeleton owns what is the same for
each of them:

- **ranks stay matched.** Under ZeRO-3 every forward gathers parameters collectively, so every rank
  runs as many forwards as the busiest one (``sync_max``); the extra ones are dummy passes over a
  real item whose loss is multiplied by 0.
- **share weighting.** ``loss * share`` is backpropagated, where ``share`` is the item's weight in
  the aggregate (its tokens or samples over the mini-batch's), so the gradient of the accumulated
  micro-batches equals the gradient of the whole mini-batch's aggregated loss. A loss that already
  divides by a global count (the policy's, over every micro-batch and rank: aggregation.py) sets
  ``grad_scale`` instead: the world size, which undoes DeepSpeed's average of the ranks' gradients.
- **the step and its grad norm.** One ``engine.step()`` (DeepSpeed clips there); the global grad norm
  from DeepSpeed, or this rank's accumulated gradient norm under ZeRO-0, which keeps none.
- **metric reduction.** Share-weighted means over items; ``*_min`` / ``*_max`` keep extremes.

Log-probs follow the rollout engines' convention: log_softmax(logits / temperature) over the full
vocabulary, so the importance ratio against the behaviour log-probs compares like with like.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as tdist

from fleetrl.learner.algorithms import entropy_from_logits
from fleetrl.learner.batch import MicroBatch, SharedPrompts

T = TypeVar("T")


@dataclass
class Piece:
    """What a loss function returns for one item: the loss, its share of the aggregate, metrics.

    ``share`` weighs the item's metrics; the backward pass takes ``loss * share``, or ``loss * grad_scale``
    when that is set (a loss over a global denominator, which already carries its share)."""

    loss: torch.Tensor
    share: float
    metrics: dict[str, float]
    grad_scale: float | None = None


def sync_max(n: int, device: torch.device) -> int:
    """The largest ``n`` over ranks: every rank runs as many forwards (ZeRO-3 gathers are collective)."""
    if not tdist.is_initialized() or tdist.get_world_size() == 1:
        return n
    t = torch.tensor([n], device=device)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return int(t.item())


def response_logprobs(
    model, mb: MicroBatch, temperature: float, entropy: bool | str = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(y_t | prompt, y_<t) ``[b, T]`` of a micro-batch's response tokens (and the entropy there).

    ``entropy``: False (none), True (with its gradient, for an entropy bonus) or ``"metric"`` (only
    logged: computed without building a graph through it)."""
    if mb.shared is not None:
        logits_bTV = shared_prompt_logits(model, mb.shared).float()
    else:
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
        logits_bTV = torch.gather(logits, 1, mb.logit_pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1])).float()
    if temperature > 0 and temperature != 1.0:
        logits_bTV = logits_bTV / temperature
    logp = torch.log_softmax(logits_bTV, dim=-1).gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return logp, None
    if entropy == "metric":  # only logged: no graph through it
        with torch.no_grad():
            return logp, entropy_from_logits(logits_bTV.detach())
    return logp, entropy_from_logits(logits_bTV)


def shared_prompt_logits(model, sp: SharedPrompts) -> torch.Tensor:
    """The logits that predict each row's response tokens ``[b, T, V]``, with each distinct prompt forwarded once.

    Pass 1 runs the u prompts (right-padded) and keeps their keys and values; row r's copy of its prompt's
    cache (a differentiable gather: gradients from every sample reach the shared prompt) is the past of
    pass 2, which runs the rows' response tokens at positions ``prompt_len + t``, with the prompt's padding
    masked. Token 0 is predicted by the prompt's last position. Same attention as one forward over the
    row ``prompt + response``: the log-probs agree to float rounding."""
    from transformers import DynamicCache

    first = model(input_ids=sp.prompt_ids, attention_mask=sp.prompt_mask, use_cache=True)
    last = first.logits[torch.arange(sp.prompt_ids.shape[0], device=sp.prompt_len.device), sp.prompt_len - 1]
    head = last.index_select(0, sp.row_prompt).unsqueeze(1)  # [b, 1, V]
    if sp.response_ids.shape[1] == 0:
        return head
    past = DynamicCache(
        ddp_cache_data=[
            (layer.keys.index_select(0, sp.row_prompt), layer.values.index_select(0, sp.row_prompt))
            for layer in first.past_key_values.layers
        ]
    )
    positions = sp.prompt_len.index_select(0, sp.row_prompt).unsqueeze(1) + torch.arange(
        sp.response_ids.shape[1], device=sp.response_ids.device
    )
    rest = model(
        input_ids=sp.response_ids,
        attention_mask=torch.cat([sp.prompt_mask.index_select(0, sp.row_prompt), sp.response_mask], dim=1),
        position_ids=positions,
        past_key_values=past,
        use_cache=True,
    ).logits
    return torch.cat([head, rest], dim=1)


@torch.no_grad()
def forward_passes(
    fn: Callable[[T], torch.Tensor], items: Sequence[T], device: torch.device, collective: bool = True
) -> list[torch.Tensor]:
    """``fn(item)`` for every item, without gradients; with ``collective``, dummy passes keep ranks matched."""
    n = sync_max(len(items), device) if collective else len(items)
    out = []
    for k in range(n):
        result = fn(items[min(k, len(items) - 1)])
        if k < len(items):
            out.append(result)
    return out


def reduce_metric(name: str, values: list[float], weights: list[float] | None = None) -> float:
    """Combine a metric over items or updates: min/max for extremes, else a (weighted) mean."""
    if name.endswith("_min"):
        return min(values)
    if name.endswith("_max"):
        return max(values)
    if weights is None:
        return sum(values) / len(values)
    total = sum(weights)
    return sum(v * w for v, w in zip(values, weights)) / total if total else sum(values) / len(values)


def reduce_updates(metrics: dict[str, list[float]]) -> dict[str, float]:
    """Metrics of several updates (epochs x mini-batches) -> one value each."""
    return {name: reduce_metric(name, values) for name, values in metrics.items()}


def local_grad_norm(module: torch.nn.Module) -> float:
    """Norm of this rank's accumulated gradients before the step (ZeRO-0 keeps no global norm)."""
    grads = [p.grad.detach().float().norm() for p in module.parameters() if p.grad is not None]
    return float(torch.stack(grads).norm()) if grads else 0.0


def accumulate_and_step(
    engine,
    items: Sequence[T],
    loss_fn: Callable[[T], Piece],
    device: torch.device,
    zero_stage: int,
    norm_key: str = "actor/grad_norm",
    timing: str = "timing/",
) -> dict[str, float]:
    """Backward of ``loss * share`` (or ``* grad_scale``) for every item (dummy passes to match ranks), then one optimizer step.

    Returns the share-weighted metrics, ``norm_key`` (the grad norm), ``<timing>backward_s`` and
    ``<timing>step_s``. An empty ``items`` on every rank takes no step and returns no metrics.
    """
    n = sync_max(len(items), device)
    if n == 0:
        return {}
    part: dict[str, list[tuple[float, float]]] = defaultdict(list)
    t_bwd = 0.0
    for k in range(n):
        dummy = k >= len(items)
        piece = loss_fn(items[0] if dummy else items[k])
        t = time.perf_counter()
        scale = piece.share if piece.grad_scale is None else piece.grad_scale
        engine.backward(piece.loss * (0.0 if dummy else scale), scale_wrt_gas=False)
        t_bwd += time.perf_counter() - t
        if not dummy:
            for name, value in piece.metrics.items():
                part[name].append((value, piece.share))
    local_norm = local_grad_norm(engine.module) if zero_stage == 0 else None
    t = time.perf_counter()
    engine.step()
    norm = engine.get_global_grad_norm()
    result = {name: reduce_metric(name, [v for v, _ in vs], [s for _, s in vs]) for name, vs in part.items()}
    result.update(
        {
            f"{timing}step_s": time.perf_counter() - t,
            f"{timing}backward_s": t_bwd,
            norm_key: float(norm) if norm is not None else local_norm,
        }
    )
    return result
