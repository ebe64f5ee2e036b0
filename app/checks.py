"""Up-front checks of a job: what the config names exists and is what it should be, before anything starts.

`fleetrl config validate` and `fleetrl run` call :func:`check_job` after the config decoded (decoding
already refused unknown keys, bad types and unknown plug-in names, which are ``Literal`` types with a
did-you-mean). It returns one line per problem, each naming the key and the fix:

- ``model.path`` / ``model.tokenizer``: a local Hugging Face model directory (config.json, weights, a
  tokenizer) — jobs run offline, so a hub id is refused with the download command instead of
  failing later in a child process with a connection error;
- ``data.apply_chat_template``: the tokenizer has a chat template;
- ``data.train`` / ``data.eval`` / ``data.preference*``: they exist (or, as a `datasets` name, are in
  the local cache), their first row has the prompt column (and the answer column when a reward
  needs one), and ``data.map`` imports;
- ``rollout.env``: tool functions import and have a schema, a user environment class imports, has
  reset/step and takes its args;
- ``rollout.rewards``: each reward's arguments, a ``python`` function importable with a signature
  that fits, a reward model directory that exists (through ``fleetrl.rollout.rewards``, imported
  only when the checks run, so that `fleetrl --help` stays light);
- the telemetry sinks' libraries, the CURVE key files, ``checkpoint.resume``, and the eval threshold.

Nothing here loads a model or a whole data set.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

from fleetrl.common.config.preflight import (
    NEEDS_ANSWER,
    default_success_threshold,
    has_chat_template,
    model_dir_problem,
    tokenizer_problem,
)
from fleetrl.common.config.schema import JobConfig


def check_job(cfg: JobConfig) -> list[str]:
    """Every problem found, one line each (empty: the job can start)."""
    problems: list[str] = []
    for check in CHECKS:
        problems += check(cfg)
    return problems


# ----------------------------------------------------------------------------------- model


def check_model(cfg: JobConfig) -> list[str]:
    m = cfg.model
    problem = model_dir_problem(m.path, "model.path")
    if problem:
        return [problem]
    out = []
    tok_key, tok_dir = ("model.tokenizer", m.tokenizer) if m.tokenizer else ("model.path", m.path)
    tok_problem = tokenizer_problem(tok_dir, tok_key)
    if tok_problem:
        out.append(tok_problem)
    elif cfg.data.apply_chat_template and not has_chat_template(tok_dir):
        out.append(
            f"data.apply_chat_template is true but the tokenizer in {tok_dir!r} has no chat template (no "
            "chat_template.jinja, none in tokenizer_config.json); set data.apply_chat_template=false (raw "
            "prompts) or model.tokenizer to a tokenizer with a template"
        )
    return out


# ------------------------------------------------------------------------------------ data


def data_problems(source: str, key: str, cfg: JobConfig, columns: list[tuple[str, str]]) -> list[str]:
    """``source`` readable; its first row has each (setting, column) of ``columns`` (local files only)."""
    from fleetrl.common.data.tables import DataError, first_row, get_path

    p = Path(source).expanduser()
    if not p.exists():
        return dataset_name_problems(source, key, cfg)
    try:
        row = first_row(p, key)
    except DataError as e:
        return [str(e)]
    if row is None:  # a directory: its columns need the data set loaded
        return []
    if not row:
        return [f"{key}={source!r} is empty; give it rows"]
    if cfg.data.map:  # the hook may add or rename columns: the row it returns is what counts
        from fleetrl.common.data.tables import apply_map

        try:
            mapped = apply_map([row], cfg.data.map, key)
        except DataError as e:
            return [str(e)]
        if not mapped:
            return []
        row = mapped[0]
    missing = [(setting, col) for setting, col in columns if not get_path(row, col)[0]]
    return [
        f"{setting}={col!r} is not a column of {key} (its first row has: {', '.join(sorted(row))}); set {setting}"
        for setting, col in missing
    ]


def dataset_name_problems(source: str, key: str, cfg: JobConfig) -> list[str]:
    """A path that does not exist: a `datasets` name must be in the local cache (offline)."""
    if Path(source).suffix in (".jsonl", ".json", ".parquet", ".csv") or source.startswith((".", "/", "~")):
        return [f"{key}={source!r} does not exist; create it (e.g. `fleetrl init-data`) or fix the path"]
    if importlib.util.find_spec("datasets") is None:
        return [
            f"{key}={source!r} is not a local file or directory, and reading it as a `datasets` name needs the "
            "datasets package; pip install datasets, or point it at a local file"
        ]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    try:
        datasets.load_dataset_builder(source, cfg.data.subset, data_files=cfg.data.data_files)
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; each means "not available here"
        return [
            f"{key}={source!r} is neither a local file or directory nor a dataset in the local HF cache "
            f"({type(e).__name__}: {str(e).splitlines()[0][:160]}); jobs run offline: save it first "
            f"(`datasets.load_dataset({source!r}, {cfg.data.subset or 'CONFIG'!r}).save_to_disk('data/x')`, "
            "CONFIG being its configuration, e.g. 'main' for openai/gsm8k) and set "
            f"{key}=data/x"
        ]
    return []


def check_data(cfg: JobConfig) -> list[str]:
    d = cfg.data
    out = []
    if d.map:
        from fleetrl.common.plugins.userfn import FunctionRefError, load_function

        try:
            load_function(d.map)
        except FunctionRefError as e:
            return [f"data.map: {e}"]
    answer = [("data.answer_key", d.answer_key)] if any(s.name in NEEDS_ANSWER for s in cfg.rollout.rewards) else []
    if cfg.needs_fleet:
        out += data_problems(d.train, "data.train", cfg, [("data.prompt_key", d.prompt_key), *answer])
    pair_cols = [
        ("data.prompt_key", d.prompt_key),
        ("data.chosen_key", d.chosen_key),
        ("data.rejected_key", d.rejected_key),
    ]
    for key, source, cols in (
        ("data.eval", d.eval, [("data.prompt_key", d.prompt_key), *answer]),
        ("data.preference", d.preference, pair_cols),
        ("data.preference_eval", d.preference_eval, pair_cols),
    ):
        if source:
            out += data_problems(source, key, cfg, cols)
    if cfg.run.eval_interval and not d.eval and not d.preference_eval:
        out.append(
            f"run.eval_interval={cfg.run.eval_interval} evaluates on data.eval, which is not set; set data.eval "
            "or run.eval_interval=0"
        )
    return out


# --------------------------------------------------------------------------------- rewards


def check_rewards(cfg: JobConfig) -> list[str]:
    if not cfg.needs_fleet:
        return []
    from fleetrl.rollout.rewards import check_rewards as reward_problems  # the rollout, only when the checks run

    problems: list[str] = reward_problems(cfg.rollout.rewards)
    if not problems:
        problems += reward_column_problems(cfg)
    if cfg.run.eval_interval and cfg.data.eval and cfg.run.eval_success is None:
        if default_success_threshold(cfg.rollout.rewards) is None:
            problems.append(
                "run.eval_success: which reward counts as correct in evaluation is ambiguous for these "
                "rollout.rewards (only a single exact or math reward means reward >= 1 is right); set "
                "run.eval_success"
            )
    return problems


def check_env(cfg: JobConfig) -> list[str]:
    """rollout.env's user code: every tool function (`type: tool`) imports and has a schema; the environment
    class (`type: user`) imports, has reset/step and takes rollout.env.user.args; the verifiers taskset
    (`type: verifiers`) imports, takes rollout.env.verifiers.args and runs in-process."""
    if not cfg.needs_fleet:
        return []
    from fleetrl.rollout.envs.tool_env import tool_problems
    from fleetrl.rollout.envs.user_env import user_env_problems
    from fleetrl.rollout.envs.verifiers_env import verifiers_problems

    return tool_problems(cfg) + user_env_problems(cfg) + verifiers_problems(cfg)


def first_train_row(cfg: JobConfig) -> dict | None:
    """data.train's first row after data.map (local files only), or None (no file, unreadable: check_data says)."""
    from fleetrl.common.data.tables import DataError, apply_map, first_row

    p = Path(cfg.data.train).expanduser()
    if not p.exists():
        return None
    try:
        row = first_row(p, "data.train")
        if row and cfg.data.map:
            row = (apply_map([row], cfg.data.map, "data.train") or [None])[0]
    except DataError:
        return None
    return row or None


def chat_prompt_problems(cfg: JobConfig) -> list[str]:
    """Chat-message prompts (a list of {role, content}) need a tokenizer with a chat template."""
    row = first_train_row(cfg) if cfg.needs_fleet else None
    tok_dir = cfg.model.tokenizer or cfg.model.path
    if row is None or not isinstance(row.get(cfg.data.prompt_key), list) or not Path(tok_dir).expanduser().is_dir():
        return []
    if has_chat_template(tok_dir):
        return []
    return [
        f"data.train's prompts ({cfg.data.prompt_key!r}) are chat messages, but the tokenizer in {tok_dir!r} has no "
        "chat template to render them; set model.tokenizer to a tokenizer with one, or give plain-text prompts"
    ]


def reward_column_problems(cfg: JobConfig) -> list[str]:
    """Each batched python reward against data.train's first row (after data.map): the columns it requires
    must be there, or every call fails at run time (local files only, as `data_problems`)."""
    specs = [(i, s) for i, s in enumerate(cfg.rollout.rewards) if s.name == "python"]
    row = first_train_row(cfg) if specs else None
    if row is None:
        return []
    from fleetrl.rollout.rewards.python import missing_columns

    columns = [k for k in row if k != cfg.data.prompt_key]
    out = []
    for i, spec in specs:
        missing = missing_columns(spec.args, columns)
        if missing:
            out.append(
                f"rollout.rewards[{i}]: {spec.args.get('function')} needs the data column(s) {missing}, which "
                f"data.train's first row does not have (columns: {sorted(columns)}); rename the column (a "
                "data.map hook), or give the parameter a default"
            )
    return out


# --------------------------------------------------------------------- telemetry, keys, resume


SINK_LIBRARIES: list[tuple[str, Callable[[JobConfig], bool], str]] = [
    ("telemetry.tensorboard", lambda c: c.telemetry.tensorboard, "tensorboard"),
    ("telemetry.wandb_project", lambda c: bool(c.telemetry.wandb_project), "wandb"),
    ("telemetry.prometheus_port", lambda c: c.telemetry.prometheus_port is not None, "prometheus_client"),
]


def check_telemetry(cfg: JobConfig) -> list[str]:
    return [
        f"{key} needs the {lib} package; pip install 'fleetrl[tracking]', or turn {key} off"
        for key, wanted, lib in SINK_LIBRARIES
        if wanted(cfg) and importlib.util.find_spec(lib) is None
    ]


def check_files(cfg: JobConfig) -> list[str]:
    out = []
    curve = cfg.broker.curve
    if curve is not None:
        for key in ("server_secret_key", "server_public_key", "client_secret_key", "client_public_key"):
            value = getattr(curve, key)
            if value and not Path(value).is_file():
                out.append(f"broker.curve.{key}={value!r} does not exist; create keys with `fleetrl keys generate DIR`")
    resume = cfg.checkpoint.resume
    if resume and resume != "auto" and not (Path(resume) / "meta.json").is_file():
        out.append(
            f"checkpoint.resume={resume!r} is not a complete checkpoint (no meta.json); use `auto` or a "
            "step-* directory of a run's checkpoints"
        )
    return out


def newest_checkpoint(run_dir: Path, cfg: JobConfig) -> Path | None:
    """The newest complete checkpoint of a run directory (what ``checkpoint.resume=auto`` takes), or None."""
    root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    done = sorted(p.parent for p in root.glob("step-*/meta.json")) if root.is_dir() else []
    return done[-1] if done else None


def resume_problem(run_dir: Path, cfg: JobConfig | None) -> str | None:
    if not (run_dir / "config.yaml").is_file():
        return f"--resume {str(run_dir)!r}: no config.yaml there; pass the directory of a `fleetrl run`"
    if cfg is not None and cfg.learner is not None and newest_checkpoint(run_dir, cfg) is None:
        return (
            f"--resume {str(run_dir)!r}: the run has no complete checkpoint to resume from (checkpoint.interval="
            f"{cfg.checkpoint.interval}); start it again without --resume"
        )
    return None


CHECKS: list[Callable[[JobConfig], list[str]]] = [
    check_model,
    check_data,
    chat_prompt_problems,
    check_rewards,
    check_env,
    check_telemetry,
    check_files,
]
