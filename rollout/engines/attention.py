"""Grouped-query attention without copied keys and values, for the `hf` engine on CPU.

transformers' ``sdpa`` attention expands every layer's keys and values to the query heads
(``repeat_kv``: a copy of the whole cache per layer per step) whenever a mask is passed and the
device is not XPU/MPS, because CUDA's fused kernels cannot take a mask and grouped heads at once.
The engine always passes a mask (its rows are left-padded), so on CPU it paid that copy at every
decode step. torch's CPU kernel takes both: ``enable_gqa=True`` reads each key/value head for its
group of query heads in place, with the same result bit for bit (tests/rollout/test_engine_attention.py)
and about half the attention time at the demo's shapes (6 query heads over 2 key/value heads).

`ATTENTION` is registered with transformers under its name; the engine loads a model with
``attn_implementation=ATTENTION`` on CPU only (`attention_for`). The learner keeps ``sdpa``.

Shape legend: R rows, H query heads, K key/value heads, Q query tokens, T key columns, D head size.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "fleetrl_sdpa_gqa"


def sdpa_gqa(
    module: torch.nn.Module,
    query_RHQD: torch.Tensor,
    key_RKTD: torch.Tensor,
    value_RKTD: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns [R, Q, H, D] and no weights."""
    if kwargs.get("position_bias") is not None or kwargs.get("cache") is not None:
        raise NotImplementedError(f"{ATTENTION}: position biases and paged caches need attn_implementation=sdpa")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = torch.nn.functional.scaled_dot_product_attention(
        query_RHQD,
        key_RKTD,
        value_RKTD,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=bool(query_RHQD.shape[2] > 1 and attention_mask is None and causal),
        enable_gqa=query_RHQD.shape[1] != key_RKTD.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, sdpa_gqa)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # the boolean masks ``sdpa`` gets


def attention_for(device: torch.device) -> str:
    """The attention implementation the engine loads its model with: ours on CPU, transformers' ``sdpa``
    elsewhere (CUDA's fused kernels take grouped heads only without a mask)."""
    return ATTENTION if device.type == "cpu" else "sdpa"
