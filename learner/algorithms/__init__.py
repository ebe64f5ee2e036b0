"""The learner's algorithm math: pure torch, no DeepSpeed, no sockets. See docs/algorithms.md.

One registry per plug-in kind, keyed by the names in the config::

    ADV_ESTIMATORS[cfg.adv_estimator](token_rewards, mask, group_index, values, cfg) -> (adv, returns)
    POLICY_LOSSES[cfg.policy_loss](LossInputs(...), cfg) -> LossOutputs(loss, metrics)
    KL_ESTIMATORS[cfg.kl.estimator](logp, ref_logp) -> kl per token
    PREFERENCE_LOSSES[cfg.dpo.loss](PreferenceInputs(...), cfg) -> PreferenceOutputs
"""

from fleetrl.learner.algorithms.advantages import ADV_ESTIMATORS, discounted_returns
from fleetrl.learner.algorithms.aggregation import AGGREGATIONS, aggregate, global_counts, per_token
from fleetrl.learner.algorithms.common import (
    entropy_from_logits,
    group_stats,
    masked_mean,
    masked_whiten,
    value_loss,
)
from fleetrl.learner.algorithms.dapo import dynamic_sampling_filter, overlong_penalty
from fleetrl.learner.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_controller_from_config,
)
from fleetrl.learner.algorithms.off_policy import BehaviourWeights, behaviour_weights
from fleetrl.learner.algorithms.policy_losses import POLICY_LOSSES
from fleetrl.learner.algorithms.preference import PREFERENCE_LOSSES
from fleetrl.learner.algorithms.structs import LossInputs, LossOutputs, PreferenceInputs, PreferenceOutputs

__all__ = [
    "ADV_ESTIMATORS",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "PREFERENCE_LOSSES",
    "AdaptiveKLController",
    "BehaviourWeights",
    "FixedKLController",
    "LossInputs",
    "LossOutputs",
    "PreferenceInputs",
    "PreferenceOutputs",
    "aggregate",
    "apply_kl_penalty",
    "behaviour_weights",
    "discounted_returns",
    "dynamic_sampling_filter",
    "entropy_from_logits",
    "global_counts",
    "group_stats",
    "kl_controller_from_config",
    "masked_mean",
    "masked_whiten",
    "overlong_penalty",
    "per_token",
    "value_loss",
]
