"""The four public registries: names, aliases, one signature per kind, and the errors."""

from __future__ import annotations

import typing

import pytest

from fleetrl.common.config.algorithm import RlAlgorithm
from fleetrl.common.plugins.registry import RegistryError
from fleetrl.learner.algorithms import (
    ADV_ESTIMATORS,
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    PREFERENCE_LOSSES,
)


def test_registered_names():
    assert ADV_ESTIMATORS.names() == [
        "drgrpo",
        "gae",
        "grpo",
        "grpo_var_floor",
        "reinforce_pp",
        "reinforce_pp_baseline",
        "remax",
        "rloo",
    ]
    assert POLICY_LOSSES.names() == ["dapo", "gspo", "ppo_clip"]
    assert KL_ESTIMATORS.names() == [
        "abs",
        "abs+",
        "k1",
        "k1+",
        "k2",
        "k2+",
        "k3",
        "k3+",
        "kl",
        "kl+",
        "low_var_kl",
        "low_var_kl+",
        "mse",
        "mse+",
    ]
    assert PREFERENCE_LOSSES.names() == ["hinge", "ipo", "ipo_norm", "robust", "sigmoid"]


def test_kl_aliases_are_the_same_function():
    assert KL_ESTIMATORS["kl"] is KL_ESTIMATORS["k1"]
    assert KL_ESTIMATORS["mse"] is KL_ESTIMATORS["k2"]
    assert KL_ESTIMATORS["low_var_kl"] is KL_ESTIMATORS["k3"]
    assert KL_ESTIMATORS["low_var_kl+"] is KL_ESTIMATORS["k3+"]


def _literal(struct, name):
    annotated = typing.get_type_hints(struct, include_extras=True)[name]
    return sorted(typing.get_args(typing.get_args(annotated)[0]))  # Annotated[Literal[...], doc]


def test_config_literals_are_exactly_the_registries():
    """A name the config accepts is registered, and a registered name is accepted: typos fail at decode."""
    from fleetrl.common.config.algorithm import ALGORITHM_TYPES, DpoAlgorithm, KlConfig
    from fleetrl.common.config.learner import HealthRule
    from fleetrl.common.config.schema import RewardSpec, RolloutConfig
    from fleetrl.learner.health import HEALTH_RULES
    from fleetrl.learner.objectives import OBJECTIVES
    from fleetrl.rollout.engines import ENGINES
    from fleetrl.rollout.rewards import REWARDS

    assert _literal(RlAlgorithm, "adv_estimator") == ADV_ESTIMATORS.names()
    assert _literal(RlAlgorithm, "policy_loss") == POLICY_LOSSES.names()
    assert _literal(RlAlgorithm, "loss_agg") == AGGREGATIONS.names()
    assert _literal(KlConfig, "estimator") == KL_ESTIMATORS.names()
    assert _literal(DpoAlgorithm, "loss") == PREFERENCE_LOSSES.names()
    assert _literal(RewardSpec, "name") == REWARDS.names()
    assert _literal(HealthRule, "name") == HEALTH_RULES.names()
    assert _literal(RolloutConfig, "engine") == ENGINES.names()
    assert sorted(ALGORITHM_TYPES) == OBJECTIVES.names()


@pytest.mark.parametrize(
    ("registry", "bad", "key"),
    [
        (ADV_ESTIMATORS, "gpro", "algorithm.adv_estimator"),
        (POLICY_LOSSES, "ppo", "algorithm.policy_loss"),
        (KL_ESTIMATORS, "k4", "algorithm.kl.estimator"),
        (PREFERENCE_LOSSES, "hingee", "algorithm.loss"),
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
