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


def apply_aliases(raw: dict[str, Any], note: bool = True, notes: list[str] | None = None) -> None:
    """TRL's / verl's names at the top level are accepted with a one-line note naming fleetrl's key, appended to
    ``notes`` when given (the command the user runs prints them once, with its name), else logged. TRL's
    ``beta`` > 0 turns on a KL loss term (its GRPO adds beta x KL to the loss) unless algorithm.kl.placement is set."""
    said: list[str] = []
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
        if (
            target == "algorithm.kl.coef"
            and isinstance(value, (int, float))
            and value > 0
            and get_key(raw, "algorithm.kl.placement") is None
        ):
            set_key(raw, "algorithm.kl.placement", "loss")
            extra = " and algorithm.kl.placement=loss (a KL loss term, as TRL's GRPO)"
        said.append(f"{alias}={value} is read as {target}={value}{extra}; write fleetrl's key to drop this note")
    batch = apply_batch_aliases(raw)
    said += [batch] if batch else []
    if notes is not None:
        notes += said
    elif note:
        for line in said:
            log.warning("config: %s", line)


BATCH_ALIASES = ("per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size")  # TRL's


def _count(raw: dict[str, Any], key: str, default: int) -> int:
    value = raw.pop(key, None) if "." not in key else get_key(raw, key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}={value!r}: give a whole number >= 1")
    return value


def apply_batch_aliases(raw: dict[str, Any]) -> str:
    """TRL's batch sizes, counted in completions, as fleetrl's counted in groups of rollout.group_size (G):

    - ``per_device_train_batch_size`` P x ``gradient_accumulation_steps`` A (default 1) completions per rank and
      optimizer step, whole groups (a group is trained on one rank); x ``learner.num_ranks`` W = E completions
      per optimizer step (TRL's effective batch);
    - ``generation_batch_size`` B (default E) completions per generation round = one learner step:
      ``learner.groups_per_step`` = B / G, and ``learner.mini_batches`` = B / E optimizer steps per round (TRL's
      ``steps_per_generation``).

    Sizes that do not divide are refused naming what to change. Returns the one-line note ("" when none is set)."""
    given = [k for k in BATCH_ALIASES if k in raw]
    if not given:
        return ""
    alg = raw.get("algorithm")
    if isinstance(alg, dict) and alg.get("type") == "dpo":
        raise ConfigError(
            f"{', '.join(given)}: TRL's batch sizes count completions; a DPO step counts pairs: set "
            "learner.groups_per_step (pairs per step across all ranks) instead"
        )
    for key in ("learner.groups_per_step", *(["learner.mini_batches"] if "per_device_train_batch_size" in raw else [])):
        if get_key(raw, key) is not None:
            raise ConfigError(
                f"{', '.join(given)} (TRL's batch sizes, in completions) and {key} are both set; "
                f"keep one (fleetrl's {key} counts groups of rollout.group_size)"
            )
    if "gradient_accumulation_steps" in raw and "per_device_train_batch_size" not in raw:
        raise ConfigError(
            "gradient_accumulation_steps counts with per_device_train_batch_size only (fleetrl "
            "splits micro-batches by tokens, learner.max_tokens_per_microbatch); set "
            "per_device_train_batch_size too, or learner.groups_per_step and learner.mini_batches"
        )
    defaults = JobConfig()
    group = _count(raw, "rollout.group_size", defaults.rollout.group_size)
    ranks = _count(raw, "learner.num_ranks", defaults.learner.num_ranks)
    per_device, accum = _count(raw, "per_device_train_batch_size", 0), _count(raw, "gradient_accumulation_steps", 1)
    per_rank = per_device * accum  # completions per rank and optimizer step (0: not given)
    how = (
        f"per_device_train_batch_size={per_device} x gradient_accumulation_steps={accum} = {per_rank} completions "
        f"per rank and optimizer step"
    )
    if per_rank % group:
        raise ConfigError(
            f"{how} is not a whole number of groups of rollout.group_size={group} (a group is trained "
            f"on one rank); make it a multiple of {group}, or set learner.groups_per_step"
        )
    step = per_rank * ranks  # completions per optimizer step
    generation = _count(raw, "generation_batch_size", step)
    unit = step or group * ranks  # what a generation batch must be a multiple of
    if generation % unit:
        what = (
            f"optimizer steps of {step} completions ({how}, x learner.num_ranks={ranks})"
            if step
            else f"groups per learner rank (rollout.group_size={group} x learner.num_ranks={ranks})"
        )
        raise ConfigError(
            f"generation_batch_size={generation} is not a whole number of {what}; make it a multiple of {unit}"
        )
    set_key(raw, "learner.groups_per_step", generation // group)
    said = f"learner.groups_per_step={generation // group}"
    if step:
        set_key(raw, "learner.mini_batches", generation // step)
        said += f", learner.mini_batches={generation // step}"
    detail = f"{how}, x learner.num_ranks={ranks} = {step} per optimizer step; " if step else ""
    return (
        f"{', '.join(given)} (TRL's, in completions) read as {said}: {detail}{generation} completions a learner "
        f"step = {generation // group} groups of rollout.group_size={group} (memory: "
        "learner.max_tokens_per_microbatch, not a per-device count); write fleetrl's keys to drop this note"
    )


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
            value = (
                [r.name for r in cfg.rollout.rewards]
                if key == "rollout.rewards"
                else get_key(msgspec.to_builtins(cfg), key)
            )
            notes.append(f"{key} is not set, so the default {value} is used; set it in the job file to drop this note")
    return notes


PATH_KEYS = (
    "model.path",
    "model.tokenizer",
    "data.train",
    "data.eval",
    "data.preference",
    "data.preference_eval",
    "algorithm.critic.path",
)  # local paths or `datasets` / hub names


def _absolute(value: Any, function: bool = False) -> Any:
    """A relative path that exists from here, made absolute; anything else (a dataset name, a module) as it is."""
    if not isinstance(value, str) or not value:
        return value
    path, sep, name = value.rpartition(":") if function else (value, "", "")
    if not path or Path(path).is_absolute() or not Path(path).exists() or (function and not path.endswith(".py")):
        return value
    return str(Path(path).resolve()) + sep + name


def _node(raw: dict[str, Any], dotted: str) -> tuple[dict[str, Any] | None, str]:
    *parents, leaf = dotted.split(".")
    node: Any = raw
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) and leaf in node else None), leaf


def user_code_refs(raw: dict[str, Any]) -> list[tuple[dict[str, Any] | list[Any], str | int]]:
    """Where a config names user code (``path/file.py:function`` or ``pkg.module:function``), as (container,
    key) pairs: ``data.map``, python rewards' ``function``, ``rollout.env.tool.tools``, ``rollout.env.user.cls``."""
    out: list[tuple[dict[str, Any] | list[Any], str | int]] = []
    for dotted in ("data.map", "rollout.env.user.cls"):
        node, leaf = _node(raw, dotted)
        if node is not None and node[leaf]:
            out.append((node, leaf))
    tools, leaf = _node(raw, "rollout.env.tool.tools")
    if tools is not None and isinstance(tools[leaf], list):
        out += [(tools[leaf], i) for i in range(len(tools[leaf]))]
    for reward in (raw.get("rollout") or {}).get("rewards") or []:
        args = reward.get("args") if isinstance(reward, dict) else None
        if isinstance(args, dict) and "function" in args:
            out.append((args, "function"))
    return out


def _found_here(ref: Any) -> bool:
    """Whether ``ref`` names a module (not a file) whose top package lies in the working directory."""
    if not isinstance(ref, str) or ":" not in ref or ref.rpartition(":")[0].endswith(".py"):
        return False
    top = ref.rpartition(":")[0].split(".")[0]
    return bool(top) and (Path(top).is_dir() or Path(f"{top}.py").is_file())


def with_absolute_paths(cfg: JobConfig) -> JobConfig:
    """``cfg`` as it means the same from any directory (``fleetrl run --resume RUN_DIR`` from elsewhere): every
    relative local path that exists from the working directory made absolute (model and data paths, user code
    files), ``run.python_path`` absolute, and the working directory added to it when a ``pkg.module:function``
    reference is found there."""
    raw = msgspec.to_builtins(cfg)
    for key in PATH_KEYS:
        node, leaf = _node(raw, key)
        if node is not None:
            node[leaf] = _absolute(node[leaf])
    refs: list[tuple[Any, Any]] = user_code_refs(raw)  # (dict or list, key or index)
    for container, key in refs:
        container[key] = _absolute(container[key], function=True)
    run = raw.setdefault("run", {})
    folders = [str(Path(p).resolve()) for p in run.get("python_path") or []]
    here = str(Path.cwd().resolve())
    if any(_found_here(container[key]) for container, key in refs) and here not in folders:
        folders.append(here)
    run["python_path"] = folders
    return msgspec.convert(raw, JobConfig)
