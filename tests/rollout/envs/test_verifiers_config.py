"""`rollout.env.type: verifiers` without verifiers, and its config errors: what `make test` checks (verifiers is an
optional extra; the adapter's normal path is tested in tests/verifiers, the lane with verifiers installed)."""

from __future__ import annotations

import sys

import pytest

from fleetrl.app.checks import check_env
from fleetrl.common.config import ConfigError, load_config
from fleetrl.rollout.envs import create_env

ENV = ["rollout.env.type=verifiers", "rollout.env.verifiers.taskset=fleet_arith"]


def test_without_verifiers_the_error_says_which_extra_to_install(monkeypatch, tiny_model_dir):
    for name in ("verifiers", "verifiers.v1"):
        monkeypatch.setitem(sys.modules, name, None)  # `import verifiers.v1` raises ImportError, as when absent
    cfg = load_config(None, [f"model.path={tiny_model_dir}", *ENV])
    with pytest.raises(ConfigError) as e:
        create_env(cfg, tokenizer=None)
    assert "rollout.env.type=verifiers" in str(e.value) and "pip install 'fleetrl[verifiers]'" in str(e.value)
    assert any("pip install 'fleetrl[verifiers]'" in p for p in check_env(cfg))  # `fleetrl config validate` too


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["rollout.env.type=verifiers"], "rollout.env.verifiers.taskset is not set"),
        ([*ENV, "rollout.env.verifiers.limit=0"], "rollout.env.verifiers.limit must be >= 1"),
        ([*ENV, "rollout.env.verifiers.score_timeout_s=0"], "rollout.env.verifiers.score_timeout_s"),
    ],
)
def test_config_errors_name_the_key(overrides, says):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert says in str(e.value), str(e.value)
