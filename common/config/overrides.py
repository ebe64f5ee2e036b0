"""A job file read as YAML and ``dotted.key=value`` overrides applied to it, before any validation.

Values in overrides are YAML scalars, so ints, floats (``1e-3`` included), bools, ``null`` and flow
lists/maps (``[a, b]``, ``{name: exact}``) all work; ``loader.py`` validates the result into a ``JobConfig``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from fleetrl.common.config.base import ConfigError

# ------------------------------------------------------------------------------------ YAML


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-3`` as a float (PyYAML's YAML 1.1 resolver wants ``1.0e-3``)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^[-+]?(?:\d[\d_]*)?(?:\.\d*)?[eE][-+]?\d+$|^[-+]?\d[\d_]*\.\d*$|^[-+]?\.\d+$|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"
    ),
    list("-+0123456789."),
)


def parse_value(text: str) -> Any:
    """Parse one override value as a YAML scalar or flow collection (``"3"`` -> 3, ``"null"`` -> None)."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        return text  # not YAML: keep the raw string and let type validation judge it


def read_yaml(path: str | Path) -> dict[str, Any]:
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
