"""The building blocks of every config section: ``Section`` (the Struct base) and ``doc`` (field metadata).

The sections themselves are in ``schema.py`` (model, data, rollout, broker, sync, checkpoint,
telemetry, run and the whole ``JobConfig``) and ``schema_learner.py`` (learner, algorithm, health).
Reward functions use ``doc`` to describe their arguments too.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Meta


def doc(text: str, **constraints: Any) -> Meta:
    """Field metadata: a one-line description plus msgspec range constraints (ge, gt, le, lt, ...)."""
    return Meta(description=text, **constraints)


class Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=False):
    """Base of every config section: keyword-only, unknown keys rejected."""


class ConfigError(ValueError):
    """A config file or override is wrong; the message says which key and how to fix it."""
