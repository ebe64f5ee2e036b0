"""The names users write, beyond the schema's own keys: TRL's / verl's names for fleetrl's keys (read
with a note), the defaults a job should not rely on silently, and local paths made absolute in the
config a run saves (so it means the same from any directory).

``loader.py`` calls :func:`apply_aliases` while validating and :func:`with_absolute_paths` when saving;
the functions that read a job file use ``overrides.py`` (below the loader).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import msgspec

from fleetrl.common.config.base import ConfigError
from fleetrl.common.config.overrides import apply_overrides, read_yaml
from fleetrl.common.config.schema import JobConfig

log = logging.getLogger("fleetrl.config")


ALIASES = {  # a top-level key as TRL / verl users write it -> fleetrl's key
    "num_generations": "rollout.group_size",
    "max_completion_length": "rollout.max_new_tokens",
    "max_prompt_length": "data.max_prompt_tokens",
    "learning_rate": "learner.lr",
    "beta": "algorithm.kl.coef",  # algorithm.beta for type: dpo
}


def get_key(raw: dict[str, Any], dotted: str) -> Any:
    node: Any = raw
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def set_key(raw: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = raw
    for part in parents:
        if node.get(part) is None:
            node[part] = {}
        if not isinstance(node[part], dict):
            raise ConfigError(f"{dotted}: {part} is a section; give it keys, not a value")
        node = node[part]
    node[leaf] = value


def apply_aliases(raw: dict[str, Any], note: bool = True) -> None:
    """TRL's / verl's names at the top level are accepted with a one-line note naming fleetrl's key. TRL's
    ``beta`` > 0 turns on a KL loss term (its GRPO adds beta x KL to the loss) unless algorithm.kl.placement is set."""
    for alias, target in ALIASES.items():
        if alias not in raw:
            continue
        value = raw.pop(alias)
        if alias == "beta" and isinstance(raw.get("algorithm"), dict) and raw["algorithm"].get("type") == "dpo":
            target = "algorithm.beta"
        if get_key(raw, target) is not None:
            raise ConfigError(f"{alias} (the TRL/verl name of {target}) and {target} are both set; keep one")
        set_key(raw, target, value)
        extra = ""
        if target == "algorithm.kl.coef" and isinstance(value, (int, float)) and value > 0 \
                and get_key(raw, "algorithm.kl.placement") is None:
            set_key(raw, "algorithm.kl.placement", "loss")
            extra = " and algorithm.kl.placement=loss (a KL loss term, as TRL's GRPO)"
        if note:
            log.warning("config: %s=%s is read as %s=%s%s; write fleetrl's key to drop this note", alias, value,
                        target, value, extra)


def job_setting(path: str | Path | None, overrides: list[str], key: str) -> Any:
    """One dotted key as the job file and overrides set it (None when unset or unreadable), without validating
    the whole job: what a process needs before anything else (``run.file_access``)."""
    try:
        raw = read_yaml(path) if path is not None else {}
        apply_overrides(raw, overrides)
    except (ConfigError, OSError):
        return None
    return get_key(raw, key)


NAMED_DEFAULTS = ("model.path", "rollout.rewards")  # a job should not train some model on some reward silently


def defaults_used(cfg: JobConfig, path: str | Path | None, overrides: list[str] | None = None) -> list[str]:
    """One note per key of NAMED_DEFAULTS that neither the file nor an override sets, naming the default the
    job then uses (``rollout.rewards`` only for jobs with rollout servers)."""
    raw = read_yaml(path) if path is not None else {}
    apply_overrides(raw, list(overrides or []))
    apply_aliases(raw, note=False)
    notes = []
    for key in NAMED_DEFAULTS:
        if key == "rollout.rewards" and not cfg.needs_fleet:
            continue
        if get_key(raw, key) is None:
            value = [r.name for r in cfg.rollout.rewards] if key == "rollout.rewards" else get_key(msgspec.to_builtins(cfg), key)
            notes.append(f"{key} is not set, so the default {value} is used; set it in the job file to drop this note")
    return notes


PATH_KEYS = ("model.path", "model.tokenizer", "data.train", "data.eval", "data.preference", "data.preference_eval",
             "algorithm.critic.path")  # local paths or `datasets` / hub names
FUNCTION_KEYS = ("data.map",)  # `path/file.py:function` or `pkg.module:function`


def _absolute(value: Any, function: bool = False) -> Any:
    """A relative path that exists from here, made absolute; anything else (a dataset name, a module) as it is."""
    if not isinstance(value, str) or not value:
        return value
    path, sep, name = value.rpartition(":") if function else (value, "", "")
    if not path or Path(path).is_absolute() or not Path(path).exists() or (function and not path.endswith(".py")):
        return value
    return str(Path(path).resolve()) + sep + name


def with_absolute_paths(cfg: JobConfig) -> JobConfig:
    """``cfg`` with every relative local path that exists from the working directory made absolute (model and
    data paths, ``data.map`` and python reward files), so a saved config means the same from any directory
    (``fleetrl run --resume RUN_DIR`` from elsewhere)."""
    raw = msgspec.to_builtins(cfg)
    for key in (*PATH_KEYS, *FUNCTION_KEYS):
        *parents, leaf = key.split(".")
        node = raw
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            node[leaf] = _absolute(node[leaf], function=key in FUNCTION_KEYS)
    for reward in raw.get("rollout", {}).get("rewards", []):
        args = reward.get("args") if isinstance(reward, dict) else None
        if isinstance(args, dict) and "function" in args:
            args["function"] = _absolute(args["function"], function=True)
    return msgspec.convert(raw, JobConfig)
