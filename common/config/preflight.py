"""Checks a component runs on its own before it loads anything: the model directory a key names is a local
Hugging Face directory (no hub), with a tokenizer and maybe a chat template; which reward counts as correct.

``fleetrl config validate`` and ``fleetrl run`` run these too, among the job-wide checks of ``app/checks.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

from fleetrl.common.config.base import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "*.bin.index.json")
NEEDS_ANSWER = ("exact", "math")


def model_dir_problem(path: str, key: str) -> str | None:
    """Why ``path`` (the value of ``key``) is not a local model directory, or None."""
    p = Path(path).expanduser()
    if not p.exists():
        local = f"models/{path.rstrip('/').split('/')[-1].lower()}"
        # a hub id looks like org/name, and its "org" is no folder here (`models/nope` is a typo, not a hub id)
        hub_like = (
            path.count("/") == 1 and not path.startswith((".", "/", "~")) and not Path(path.split("/")[0]).is_dir()
        )
        hub = (
            f"; if it is a hub id, download it first (`hf download {path} --local-dir {local}`, with huggingface_hub "
            f"installed) and set {key}={local}"
            if hub_like
            else ""
        )
        return (
            f"{key}={path!r} does not exist; fleetrl loads models from local directories only (jobs run offline, "
            f"HF_HUB_OFFLINE=1): fix the path or create a model there (`fleetrl init-model --out {path}`){hub}"
        )
    if not (p / "config.json").is_file():
        return (
            f"{key}={path!r} is not a Hugging Face model directory (no config.json); set {key} to the directory "
            "save_pretrained wrote"
        )
    if not any(any(p.glob(g)) for g in WEIGHT_GLOBS):
        return f"{key}={path!r} has no weights (no *.safetensors or pytorch_model*.bin); set {key} to a complete model"
    return None


def tokenizer_problem(path: str, key: str) -> str | None:
    p = Path(path).expanduser()
    if key == "model.tokenizer" and not p.is_dir():
        return f"{key}={path!r} is not a directory; set it to a tokenizer directory, or null to use model.path's"
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        return (
            f"{key}={path!r} has no tokenizer ({', '.join(TOKENIZER_FILES)}); save the tokenizer there "
            "(tokenizer.save_pretrained) or set model.tokenizer"
        )
    return None


def has_chat_template(tokenizer_dir: str) -> bool:
    p = Path(tokenizer_dir).expanduser()
    if (
        (p / "chat_template.jinja").is_file()
        or (p / "chat_template.json").is_file()
        or any(p.glob("chat_template*.jinja"))
    ):
        return True
    try:
        return bool(json.loads((p / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def require_model_dir(path: str, key: str = "model.path") -> None:
    """Raise ConfigError (one line naming ``key``) unless ``path`` is a local model directory: what a
    component started by hand checks before ``from_pretrained`` would try the hub."""
    problem = model_dir_problem(path, key)
    if problem:
        raise ConfigError(problem)


def default_success_threshold(specs) -> float | None:
    """1.0 when the only reward is `exact` or `math` with weight 1 (1.0 = a right answer); else None: what
    counts as correct must be said (``--success`` / ``run.eval_success``)."""
    return 1.0 if len(specs) == 1 and specs[0].name in NEEDS_ANSWER and specs[0].weight == 1.0 else None
