"""Preference losses for DPO-style training, looked up by ``algorithm.dpo.loss``.

Shape legend: B preference pairs. Every loss has one signature::

    out = PREFERENCE_LOSSES[name](PreferenceInputs(chosen_logp, rejected_logp, ref_chosen_logp,
                                                   ref_rejected_logp), cfg)   # cfg: AlgorithmConfig

Inputs are log-probs summed over each response's tokens, ``[B]``. With the log-ratio margin

    h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))

the implicit rewards are beta * (log pi(y) - log pi_ref(y)) (Rafailov et al. 2023, Eq. 5).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from fleetrl.common.registry import Registry
from fleetrl.common.config.learner import AlgorithmConfig
from fleetrl.learner.algorithms.common import to_floats
from fleetrl.learner.algorithms.structs import PreferenceInputs, PreferenceOutputs

PreferenceLoss = Callable[[PreferenceInputs, AlgorithmConfig], PreferenceOutputs]
PREFERENCE_LOSSES: Registry[PreferenceLoss] = Registry("preference loss", config_key="algorithm.dpo.loss")


def _margin(inp: PreferenceInputs) -> Tensor:
    """h ``[B]``: how much more the policy prefers the chosen response than the reference does."""
    return (inp.chosen_logp - inp.ref_chosen_logp) - (inp.rejected_logp - inp.ref_rejected_logp)


def _outputs(loss_B: Tensor, inp: PreferenceInputs, beta: float) -> PreferenceOutputs:
    loss = loss_B.mean()
    chosen_B = (beta * (inp.chosen_logp - inp.ref_chosen_logp)).detach()
    rejected_B = (beta * (inp.rejected_logp - inp.ref_rejected_logp)).detach()
    metrics = {
        "dpo/loss": loss,
        "dpo/accuracy": (chosen_B > rejected_B).to(chosen_B.dtype).mean(),
        "dpo/margin": (chosen_B - rejected_B).mean(),
        "dpo/rewards_chosen": chosen_B.mean(),
        "dpo/rewards_rejected": rejected_B.mean(),
    }
    return PreferenceOutputs(
        loss=loss, chosen_rewards=chosen_B, rejected_rewards=rejected_B, metrics=to_floats(metrics)
    )


@PREFERENCE_LOSSES.register("sigmoid")
def sigmoid(inp: PreferenceInputs, cfg: AlgorithmConfig) -> PreferenceOutputs:
    """DPO (Rafailov et al. 2023, arXiv 2305.18290, Eq. 7) with conservative label smoothing eps
    (Mitchell 2023, "A note on DPO with noisy preferences"):

        l = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)

    Config: ``dpo.beta`` (0.1), ``dpo.label_smoothing`` (0). ``logsigmoid`` keeps it finite for any h.
    """
    beta, eps = cfg.dpo.beta, cfg.dpo.label_smoothing
    logits_B = beta * _margin(inp)
    loss_B = -(1.0 - eps) * F.logsigmoid(logits_B) - eps * F.logsigmoid(-logits_B)
    return _outputs(loss_B, inp, beta)


@PREFERENCE_LOSSES.register("ipo")
def ipo(inp: PreferenceInputs, cfg: AlgorithmConfig) -> PreferenceOutputs:
    """IPO (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
    Preferences", arXiv 2310.12036), with tau = ``dpo.beta``:

        l = (h - 1 / (2 tau))^2

    It regresses the margin to a finite target instead of pushing it to infinity, so it does not
    overfit deterministic preferences. The paper's h uses summed log-probs, as here.
    """
    beta = cfg.dpo.beta
    loss_B = torch.square(_margin(inp) - 1.0 / (2.0 * beta))
    return _outputs(loss_B, inp, beta)
