"""A cheap fingerprint of the weights an engine actually serves, to catch a silent sync failure.

A weight round can complete, the receiver can verify every bucket's digest, the server can report the
new version, and the engine can still sample from other weights (a load that went to a copy, a worker
that kept its old tensors: ``FLEETRL_FAULT=stale_fleet``). The bucket digests (``auth.py``) vouch for
what *arrived*; this vouches for what the engine *holds*:

- the rollout server, after each load, samples its engine's live parameters (:func:`fingerprint`) and
  sends ``[version, dtype, names, fp]`` in every group's ``metadata["weights_fp"]``;
- the learner, at each publish, fingerprints the tensors it sends under every dtype an engine may hold
  them in (:func:`fingerprints`), and the per-server health rule ``stale_weights`` compares.

Per tensor (in name order) at most ``SAMPLE`` elements at a fixed stride are cast to the engine's dtype
and hashed with the name: a few KB a version, and any update that moves the weights moves the sampled
elements too. The same bytes on both sides, so the comparison is exact: no tolerance to tune. ``names``
(a digest of the names hashed) says whether the two sides fingerprinted the same tensors; when it
differs the comparison is skipped (an engine that fuses or renames parameters, e.g. vLLM's
``qkv_proj``), never a false alarm.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

SAMPLE = 64  # elements per tensor
DTYPES = ("float32", "bfloat16", "float16")  # what an engine may hold a learner's float32 weights in


def names_digest(names: Iterable[str]) -> str:
    """Which tensors were fingerprinted (sorted names), 12 hex characters."""
    return hashlib.sha256("\n".join(sorted(names)).encode()).hexdigest()[:12]


def sample(tensor: Any) -> Any:
    """At most ``SAMPLE`` elements of ``tensor`` at a fixed stride (the same on every side): a copy on the CPU,
    so a later update of the tensor does not reach it."""
    flat = tensor.detach().reshape(-1)
    stride = max(1, flat.numel() // SAMPLE)
    return flat[::stride][:SAMPLE].to("cpu", copy=True)


def digest_samples(samples: dict[str, Any], dtype: str) -> str:
    """The fingerprint of sampled tensors ``{name: elements}`` held in ``dtype``, 16 hex characters."""
    import torch  # only here: this package imports without torch

    low = getattr(torch, dtype)
    h = hashlib.sha256()
    for name in sorted(samples):
        h.update(name.encode())
        h.update(samples[name].to(low).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def fingerprint(named: Iterable[tuple[str, Any]]) -> tuple[str, str, str] | None:
    """An engine's own fingerprint of its live floating parameters: ``(dtype, names, fp)``; None when it has
    none or holds them in a dtype outside ``DTYPES`` (nothing to compare with)."""
    samples = {name: sample(t) for name, t in named if t.is_floating_point()}
    if not samples:
        return None
    dtype = str(next(iter(samples.values())).dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        return None
    return dtype, names_digest(samples), digest_samples(samples, dtype)


def fingerprints(samples: dict[str, Any]) -> dict[str, str]:
    """The learner's side: ``{"names": ..., dtype: fp for every dtype in DTYPES}`` of the sampled tensors it sent."""
    return {"names": names_digest(samples), **{d: digest_samples(samples, d) for d in DTYPES}}


def mismatch(reported: Any, published: dict[str, str] | None) -> str | None:
    """Why ``reported`` (a group's ``metadata["weights_fp"]``) is not the weights published, or None (they
    agree, or cannot be compared: no record of that version, other tensors, an unknown dtype)."""
    if published is None or not isinstance(reported, (list, tuple)) or len(reported) != 4:
        return None
    version, dtype, names, fp = reported
    if names != published.get("names") or dtype not in published:
        return None
    if fp == published[dtype]:
        return None
    return f"serves weights with fingerprint {fp} under version {version}; the learner published {published[dtype]}"
