"""Shared fixtures. Everything runs on CPU with models built locally (no hub)."""

from __future__ import annotations

import os
import sys

import pytest

from fleetrl.common.net import free_port  # noqa: F401 - tests import it from here

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny Qwen2 model + byte-level tokenizer, written once per test session."""
    from fleetrl.learner.init_model import init_model

    return str(init_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny", seed=0))


@pytest.fixture(scope="session")
def arith_data(tmp_path_factory) -> str:
    from fleetrl.common.data.tasks import init_data

    train, _ = init_data("arithmetic", str(tmp_path_factory.mktemp("data") / "arith.jsonl"), 2000, 100, 0, 99)
    return str(train)


PYTHON = sys.executable
