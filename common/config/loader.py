"""Load, override, validate and print job configs.

A job is one YAML file decoded into :class:`~fleetrl.common.config.schema.JobConfig`, with ``dotted.key=value``
overrides from the command line applied first. Values in overrides are YAML scalars, so ints, floats
(``1e-3`` included), bools, ``null`` and flow lists/maps (``[a, b]``, ``{name: exact}``) all work.
Every error names the key, the bad value and what to do, e.g.::

    learner.lrr: unknown key; did you mean `learner.lr`? (valid keys of learner: ...)
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import msgspec
import yaml

from fleetrl.common.config.schema import JobConfig
from fleetrl.common.config.base import Section

__all__ = [
    "ConfigError",
    "JobConfig",
    "apply_overrides",
    "config_docs",
    "dump_yaml",
    "load_config",
    "parse_value",
    "save_resolved",
]


class ConfigError(ValueError):
    """A config file or override is wrong; the message says which key and how to fix it."""


# ------------------------------------------------------------------------------------ YAML


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-3`` as a float (PyYAML's YAML 1.1 resolver wants ``1.0e-3``)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*)?(?:\.\d*)?[eE][-+]?\d+$|^[-+]?\d[\d_]*\.\d*$|^[-+]?\.\d+$|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"),
    list("-+0123456789."),
)


def parse_value(text: str) -> Any:
    """Parse one override value as a YAML scalar or flow collection (``"3"`` -> 3, ``"null"`` -> None)."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        return text  # not YAML: keep the raw string and let type validation judge it


def _read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist; pass an existing YAML file (see configs/)")
    try:
        data = yaml.load(p.read_text(), Loader=_Loader)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections, got {type(data).__name__}")
    return data


# ------------------------------------------------------------------------------- overrides


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to a nested dict in place (list items by index: ``a.0.b=1``)."""
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} is not of the form section.key=value (e.g. learner.lr=1e-5)")
        parts = key.split(".")
        node: Any = raw
        for i, part in enumerate(parts[:-1]):
            node = _descend(node, part, ".".join(parts[: i + 1]))
        _assign(node, parts[-1], parse_value(value), key)
    return raw


def _descend(node: Any, part: str, where: str) -> Any:
    if isinstance(node, list):
        idx = _list_index(node, part, where)
        return node[idx]
    if not isinstance(node, dict):
        raise ConfigError(f"override path {where!r} goes through a value that is not a section")
    if part.isdigit():
        raise ConfigError(f"{where}: indexes a list the config file does not set; override the whole list instead")
    if node.get(part) is None:
        node[part] = {}
    return node[part]


def _assign(node: Any, part: str, value: Any, key: str) -> None:
    if isinstance(node, list):
        node[_list_index(node, part, key)] = value
    elif isinstance(node, dict) and not part.isdigit():
        node[part] = value
    else:
        raise ConfigError(f"override {key!r} goes through a value that is not a section")


def _list_index(node: list, part: str, where: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"{where}: index {part!r} is not in the list of {len(node)} item(s)")
    return int(part)


# ------------------------------------------------------------------------------ validation


def _struct_of(tp: Any) -> type[Section] | None:
    """The Section type inside ``tp`` (plain, Optional, or list item), else None."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _struct_of(typing.get_args(tp)[0])
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            found = _struct_of(arg)
            if found is not None:
                return found
        return None
    if origin is list:
        return _struct_of(typing.get_args(tp)[0])
    if isinstance(tp, type) and issubclass(tp, Section):
        return tp
    return None


def _field_types(struct: type[Section]) -> dict[str, Any]:
    return typing.get_type_hints(struct, include_extras=True)


def _check_keys(raw: Any, struct: type[Section], prefix: str) -> None:
    """Reject unknown keys with a did-you-mean, recursing into sections and lists of sections."""
    if not isinstance(raw, dict):
        return  # wrong type: msgspec reports it with the path
    hints = _field_types(struct)
    for key, value in raw.items():
        path = f"{prefix}{key}"
        if key not in hints:
            raise ConfigError(_unknown_key_message(path, str(key), list(hints), prefix))
        sub = _struct_of(hints[key])
        if sub is None:
            continue
        if isinstance(value, list):
            for i, item in enumerate(value):
                _check_keys(item, sub, f"{path}.{i}.")
        else:
            _check_keys(value, sub, f"{path}.")


def _unknown_key_message(path: str, key: str, valid: list[str], prefix: str) -> str:
    section = prefix.rstrip(".") or "the top level"
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"did you mean `{prefix}{close[0]}`? " if close else ""
    return f"{path}: unknown key; {hint}(valid keys of {section}: {', '.join(valid)})"


_PATH = re.compile(r" - at `\$((?:\.[A-Za-z_0-9]+|\[\d+\])*)`$")


def _lookup(raw: Any, dotted: str) -> Any:
    node = raw
    for part in filter(None, dotted.split(".")):
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, TypeError, ValueError):
            return None
    return node


def _literal_choices(struct: type[Section], dotted: str) -> list[str] | None:
    """The allowed values of a Literal field at ``dotted`` (None when it is not a Literal)."""
    tp: Any = struct
    for part in dotted.split("."):
        if part.isdigit():
            continue
        st = _struct_of(tp)
        if st is None:
            return None
        tp = _field_types(st).get(part)
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) is Literal:
        return [str(a) for a in typing.get_args(tp)]
    return None


def _rephrase(err: msgspec.ValidationError, raw: dict[str, Any]) -> ConfigError:
    text = str(err)
    m = _PATH.search(text)
    if not m:
        return ConfigError(f"invalid config: {text}")
    dotted = m.group(1).replace("[", ".").replace("]", "").lstrip(".")
    what = text[: m.start()]
    if what.startswith("Object missing required field"):
        return ConfigError(f"{dotted or 'config'}: {what[0].lower()}{what[1:]}; add it")
    bad = _lookup(raw, dotted)
    message = f"{dotted}: bad value {bad!r}: {what[0].lower()}{what[1:]}"
    choices = _literal_choices(JobConfig, dotted)
    if choices:
        close = difflib.get_close_matches(str(bad), choices, n=1, cutoff=0.5)
        message += f"; valid values: {', '.join(choices)}"
        if close:
            message += f" (did you mean {close[0]!r}?)"
    elif what.startswith("Expected `object`"):
        message += f"; `{dotted}` is a section: set its keys, e.g. {dotted}.<key>=value"
    elif what.startswith("Expected"):
        message += "; change the value"
    return ConfigError(message)


def validate(raw: dict[str, Any]) -> JobConfig:
    """Decode a nested dict into a JobConfig, raising ConfigError that names the key at fault."""
    _check_keys(raw, JobConfig, "")
    try:
        return msgspec.convert(raw, JobConfig)
    except msgspec.ValidationError as e:
        raise _rephrase(e, raw) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Read a YAML job (defaults when ``path`` is None), apply overrides, validate."""
    raw = _read_yaml(path) if path is not None else {}
    apply_overrides(raw, list(overrides or []))
    return validate(raw)


# ---------------------------------------------------------------------------------- output


def to_dict(cfg: JobConfig) -> dict[str, Any]:
    return msgspec.to_builtins(cfg)


def dump_yaml(cfg: JobConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=None, width=100)


def save_resolved(cfg: JobConfig, run_dir: str | Path) -> Path:
    """Write the resolved config as ``config.yaml`` into the run directory."""
    out = Path(run_dir) / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dump_yaml(cfg))
    return out


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
    ]

    def walk(struct: type[Section], prefix: str) -> None:
        hints = _field_types(struct)
        rows, subs = [], []
        for info in msgspec.structs.fields(struct):
            tp = hints[info.name]
            desc, limits = _describe(tp)
            sub = _struct_of(tp)
            if sub is not None and typing.get_origin(_strip(tp)) is not list:
                subs.append((sub, f"{prefix}{info.name}", desc))
            limits = f" ({limits})" if limits else ""
            rows.append(f"| `{prefix}{info.name}` | {_type_name(tp)} | {_default_of(info)} | {desc}{limits} |")
        lines.extend(["| key | type | default | description |", "| --- | --- | --- | --- |", *rows, ""])
        for sub, path, desc in subs:
            lines.extend([f"### `{path}`", "", desc, ""])
            walk(sub, f"{path}.")

    for info in msgspec.structs.fields(JobConfig):
        tp = _field_types(JobConfig)[info.name]
        lines.extend([f"## `{info.name}`", "", _describe(tp)[0], ""])
        walk(_struct_of(tp), f"{info.name}.")  # type: ignore[arg-type]
    for section, key in (("rollout", "rewards"), ("health", "rules")):
        item = _struct_of(_field_types(_struct_of(_field_types(JobConfig)[section]))[key])  # type: ignore[arg-type]
        lines.extend([f"### Items of `{section}.{key}` ({item.__name__})", ""])  # type: ignore[union-attr]
        walk(item, f"{section}.{key}[].")  # type: ignore[arg-type]
    return "\n".join(lines).rstrip() + "\n"


def _strip(tp: Any) -> Any:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp
