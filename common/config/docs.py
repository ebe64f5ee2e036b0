"""`fleetrl config docs`: the Markdown reference of every config key (docs/config.md), from the Structs."""

from __future__ import annotations

import types
import typing
from typing import Any, Literal, Union

import msgspec
import yaml

from fleetrl.common.config.base import Section
from fleetrl.common.config.loader import field_types, strip_annotated, struct_of, tag_field_of, variants_of
from fleetrl.common.config.names import ALIASES
from fleetrl.common.config.schema import JobConfig


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _type_name(typing.get_args(tp)[0])
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    if origin is dict:
        return "mapping"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _describe(tp: Any) -> tuple[str, str]:
    """(description, constraints) from a field's Annotated metadata."""
    desc, limits = "", []
    for meta in typing.get_args(tp)[1:] if typing.get_origin(tp) is typing.Annotated else ():
        if isinstance(meta, msgspec.Meta):
            desc = meta.description or desc
            for name, sym in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
                val = getattr(meta, name)
                if val is not None:
                    limits.append(f"{sym} {val}")
    return desc, ", ".join(limits)


def _default_of(info: msgspec.structs.FieldInfo) -> str:
    if info.required:
        return "required"
    value = info.default_factory() if info.default is msgspec.NODEFAULT else info.default
    text = yaml.safe_dump(msgspec.to_builtins(value), default_flow_style=True, width=10_000).strip()
    return f"`{text.removesuffix('...').strip()}`"


def config_docs() -> str:
    """Markdown reference of every config key, generated from the Structs (docs/config.md)."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `common/config/schema.py` by `fleetrl config docs` — do not edit by hand.",
        "Every key can be set in the YAML file or overridden as `section.key=value` on the command line.",
        "",
        "TRL's / verl's names are read at the top level with a one-line note naming fleetrl's key: "
        + ", ".join(f"`{a}` = `{t}`" for a, t in ALIASES.items())
        + " (`algorithm.beta` for `type: dpo`; a `beta` > 0 also sets `algorithm.kl.placement: loss` when unset).",
        "TRL's batch sizes, counted in completions, are read the same way (not for `type: dpo`): "
        "`per_device_train_batch_size` x `gradient_accumulation_steps` (default 1) completions per rank and optimizer "
        "step (whole groups: a group trains on one rank), x `learner.num_ranks` per optimizer step; "
        "`generation_batch_size` (default: one optimizer step's) per learner step. So `learner.groups_per_step` = "
        "`generation_batch_size` / `rollout.group_size` and `learner.mini_batches` = `generation_batch_size` / the "
        "optimizer step's completions; sizes that do not divide are refused. Memory is bounded by "
        "`learner.max_tokens_per_microbatch`, not by a per-device count.",
        "",
    ]

    def walk(struct: type[Section], prefix: str) -> None:
        hints = field_types(struct)
        rows, subs = [], []
        for info in msgspec.structs.fields(struct):
            tp = hints[info.name]
            desc, limits = _describe(tp)
            sub = struct_of(tp)
            if sub is not None and typing.get_origin(strip_annotated(tp)) is not list:
                subs.append((sub, f"{prefix}{info.name}", desc))
            limits = f" ({limits})" if limits else ""
            rows.append(f"| `{prefix}{info.name}` | {_type_name(tp)} | {_default_of(info)} | {desc}{limits} |")
        lines.extend(["| key | type | default | description |", "| --- | --- | --- | --- |", *rows, ""])
        for sub, path, desc in subs:
            lines.extend([f"### `{path}`", "", desc, ""])
            walk(sub, f"{path}.")

    for info in msgspec.structs.fields(JobConfig):
        tp = field_types(JobConfig)[info.name]
        lines.extend([f"## `{info.name}`", "", _describe(tp)[0], ""])
        variants = variants_of(tp)
        pairs: list[tuple[str | None, Any]] = list(variants.items()) if variants else [(None, struct_of(tp))]
        for tag, variant in pairs:
            if variants is not None and tag is not None:
                field_ = tag_field_of(variants)
                lines.extend([f"### `{info.name}` with `{field_}: {tag}`", "", (variant.__doc__ or "").strip(), ""])
            walk(variant, f"{info.name}.")
    for section, key in (("rollout", "rewards"), ("health", "rules")):
        item = struct_of(field_types(struct_of(field_types(JobConfig)[section]))[key])  # type: ignore[arg-type]
        lines.extend([f"### Items of `{section}.{key}` ({item.__name__})", ""])  # type: ignore[union-attr]
        walk(item, f"{section}.{key}[].")  # type: ignore[arg-type]
    return "\n".join(lines).rstrip() + "\n"
