"""Checks and readers an engine's weight loading shares: the specs of a state_dict (tied aliases included),
names and shapes checked before anything is copied, and safetensors files read from their headers.

This module imports no torch at import time."""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ParamSpec = tuple[str, tuple[int, ...], "torch.dtype"]  # (name, shape, dtype) of one distinct weight


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


def check_named_tensors(
    named: Sequence[tuple[str, Any]], expected: dict[str, tuple[int, ...]], float_names: set[str], where: str
) -> None:
    """`check_named_shapes`, and a tensor that is not floating point for a float weight is refused
    (float dtypes convert while copying: a bf16 learner may feed an fp32 rollout)."""
    check_named_shapes([(name, tuple(t.shape)) for name, t in named], expected, where)
    for name, tensor in named:
        if name in float_names and not tensor.is_floating_point():
            raise ValueError(
                f"{where}: weight {name!r} arrives as {tensor.dtype} but the model's is floating point; "
                "send the model's own float weights. No weight was changed."
            )


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
