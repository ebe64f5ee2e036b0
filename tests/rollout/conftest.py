"""Fixtures shared by the rollout tests."""

from __future__ import annotations

import pytest
import torch

from fleetrl.common.config.schema import ModelConfig, RolloutConfig
from fleetrl.rollout.engines import create_engine


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """An `hf` engine on the tiny model, one torch thread (the caller's thread count is restored)."""
    threads = torch.get_num_threads()
    eng = create_engine("hf", ModelConfig(path=tiny_model_dir), RolloutConfig(), "cpu", 0, num_threads=1)
    yield eng
    eng.close()
    torch.set_num_threads(threads)
