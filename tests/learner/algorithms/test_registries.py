"""The four public registries: names, aliases, one signature per kind, and the errors."""

from __future__ import annotations

import typing

import pytest

from fleetrl.common.registry import RegistryError
from fleetrl.common.config.learner import AlgorithmConfig
from fleetrl.learner.algorithms import (
    ADV_ESTIMATORS,
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    PREFERENCE_LOSSES,
)


def test_registered_names():
    assert ADV_ESTIMATORS.names() == ["drgrpo", "gae", "grpo", "reinforce_pp", "reinforce_pp_baseline", "rloo"]
    assert POLICY_LOSSES.names() == ["dapo", "gspo", "ppo_clip"]
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3", "kl", "low_var_kl", "mse"]
    assert PREFERENCE_LOSSES.names() == ["ipo", "sigmoid"]


def test_kl_aliases_are_the_same_function():
    assert KL_ESTIMATORS["kl"] is KL_ESTIMATORS["k1"]
    assert KL_ESTIMATORS["mse"] is KL_ESTIMATORS["k2"]
    assert KL_ESTIMATORS["low_var_kl"] is KL_ESTIMATORS["k3"]


def test_config_defaults_and_choices_are_registered():
    cfg = AlgorithmConfig()
    assert cfg.adv_estimator in ADV_ESTIMATORS
    assert cfg.policy_loss in POLICY_LOSSES
    assert cfg.kl.estimator in KL_ESTIMATORS
    assert cfg.dpo.loss in PREFERENCE_LOSSES
    annotated = typing.get_type_hints(AlgorithmConfig, include_extras=True)["loss_agg"]
    agg_choices = typing.get_args(typing.get_args(annotated)[0])  # Annotated[Literal[...], doc]
    assert sorted(agg_choices) == AGGREGATIONS.names()


@pytest.mark.parametrize(
    ("registry", "bad", "key"),
    [
        (ADV_ESTIMATORS, "gpro", "algorithm.adv_estimator"),
        (POLICY_LOSSES, "ppo", "algorithm.policy_loss"),
        (KL_ESTIMATORS, "k4", "algorithm.kl.estimator"),
        (PREFERENCE_LOSSES, "hinge", "algorithm.dpo.loss"),
    ],
)
def test_unknown_name_raises_listing_valid_names(registry, bad, key):
    with pytest.raises(RegistryError) as err:
        registry[bad]
    message = str(err.value)
    assert key in message and repr(bad) in message
    for name in registry.names():
        assert name in message


@pytest.mark.parametrize(
    ("registry", "name"),
    [(ADV_ESTIMATORS, "grpo"), (POLICY_LOSSES, "ppo_clip"), (KL_ESTIMATORS, "low_var_kl"), (PREFERENCE_LOSSES, "ipo")],
)
def test_re_registering_a_name_raises(registry, name):
    before = registry[name]
    with pytest.raises(RegistryError, match="already registered"):
        registry.register(name)(lambda *args: None)
    assert registry[name] is before
