from __future__ import annotations

import pytest

from fleetrl.broker.server.prompts import PromptSource, rows_to_prompts
from fleetrl.broker.server.state import BrokerState
from fleetrl.common.config import load_config


def make_state(*overrides: str, n_prompts: int = 50, vocab_size: int = 100, spool=None, epochs: int = 1) -> BrokerState:
    cfg = load_config(None, ["learner.groups_per_step=4", "sync.interval=1", *overrides])
    rows = [{"prompt": f"{i:02d}+01=", "answer": str(i + 1)} for i in range(n_prompts)]
    prompts = PromptSource(rows_to_prompts(rows, "prompt", "answer", "test"), shuffle=False, seed=0, epochs=epochs)
    return BrokerState(cfg, prompts, vocab_size=vocab_size, spool=spool)


@pytest.fixture
def state() -> BrokerState:
    return make_state()
