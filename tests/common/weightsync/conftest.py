"""Fixtures of the weight-sync tests."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM


@pytest.fixture
def learner_model(tiny_model_dir):
    """The learner's copy of the tiny model (what a publisher sends)."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)
