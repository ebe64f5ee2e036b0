"""Inputs and outputs of the losses: one dataclass per direction, shared by every registry entry.

Shape legend: B sequences in the micro-batch, T padded response positions.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class LossInputs:
    """Per-token inputs of a policy loss (``POLICY_LOSSES``).

    Attributes:
        logp: ``[B, T]`` log pi_theta(y_t | y_<t) of the sampled tokens under the policy being trained;
            the only input that carries gradient.
        old_logp: ``[B, T]`` log-probs the PPO ratio is taken against: the learner's own recomputed
            log-probs before this update (``off_policy.mode`` none / tis), or the proximal policy's
            (``decoupled``). Treated as a constant.
        behav_logp: ``[B, T]`` log mu(y_t): what the rollout engine reported when it sampled the token.
            Treated as a constant.
        adv: ``[B, T]`` advantages (zero where masked). Treated as a constant.
        mask: ``[B, T]`` bool or 0/1: response tokens that count in the loss.
        agg_denom: the global token or sequence count of the optimizer step (``aggregate``'s ``denom``):
            the loss is then this micro-batch's share of the whole step's aggregate, and
            ``actor/pg_loss`` stays this micro-batch's own aggregate. None: the micro-batch's own count.
    """

    logp: Tensor
    old_logp: Tensor
    behav_logp: Tensor
    adv: Tensor
    mask: Tensor
    agg_denom: float | None = None


@dataclass(frozen=True)
class LossOutputs:
    """A loss and what to log about it.

    Attributes:
        loss: scalar tensor, already aggregated (``algorithm.loss_agg``, over ``agg_denom`` when given);
            call ``backward`` on it.
        metrics: namespaced floats, e.g. ``actor/clipfrac``, ``off_policy/is_ess``.
    """

    loss: Tensor
    metrics: dict[str, float]


@dataclass(frozen=True)
class PreferenceInputs:
    """Summed response log-probs of preference pairs (``PREFERENCE_LOSSES``); every field is ``[B]``.

    Attributes:
        chosen_logp: sum_t log pi_theta over the chosen response (carries gradient).
        rejected_logp: sum_t log pi_theta over the rejected response (carries gradient).
        ref_chosen_logp: the same sum under the frozen reference model (0 with ``reference_free``).
        ref_rejected_logp: the same sum under the frozen reference model (0 with ``reference_free``).
        chosen_len: number of tokens of each chosen response (``ipo_norm`` averages over them).
        rejected_len: number of tokens of each rejected response.
    """

    chosen_logp: Tensor
    rejected_logp: Tensor
    ref_chosen_logp: Tensor
    ref_rejected_logp: Tensor
    chosen_len: Tensor | None = None
    rejected_len: Tensor | None = None


@dataclass(frozen=True)
class PreferenceOutputs:
    """A preference loss, the implicit rewards and what to log.

    Attributes:
        loss: scalar tensor (mean over pairs).
        chosen_rewards: ``[B]`` beta * (log pi - log pi_ref) of the chosen responses, detached.
        rejected_rewards: ``[B]`` the same for the rejected responses, detached.
        metrics: ``dpo/loss``, ``dpo/accuracy`` (share of pairs with chosen reward > rejected),
            ``dpo/margin`` (mean chosen - rejected reward), ``dpo/rewards_chosen``, ``dpo/rewards_rejected``.
    """

    loss: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor
    metrics: dict[str, float]
