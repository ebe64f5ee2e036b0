"""Preference losses for DPO-style training, looked up by ``algorithm.loss`` (``algorithm.type: dpo``).

Shape legend: B preference pairs. Every loss has one signature::

    out = PREFERENCE_LOSSES[name](PreferenceInputs(chosen_logp, rejected_logp, ref_chosen_logp,
                                                   ref_rejected_logp, chosen_len, rejected_len), cfg)
                                                   # cfg: DpoAlgorithm

Inputs are log-probs summed over each response's tokens, ``[B]``. With the log-ratio margin

    h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))

the implicit rewards are beta * (log pi(y) - log pi_ref(y)) (Rafailov et al. 2023, Eq. 5).
Reference-free DPO (``algorithm.reference_free``) passes 0 for the reference sums, so h is the
policy's own log-likelihood margin.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from fleetrl.common.config.algorithm import DpoAlgorithm
from fleetrl.common.plugins.registry import Registry
from fleetrl.learner.algorithms.common import to_floats
from fleetrl.learner.algorithms.structs import PreferenceInputs, PreferenceOutputs

PreferenceLoss = Callable[[PreferenceInputs, DpoAlgorithm], PreferenceOutputs]
PREFERENCE_LOSSES: Registry[PreferenceLoss] = Registry("preference loss", config_key="algorithm.loss")


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
def sigmoid(inp: PreferenceInputs, cfg: DpoAlgorithm) -> PreferenceOutputs:
    """DPO (Rafailov et al. 2023, arXiv 2305.18290, Eq. 7) with conservative label smoothing eps
    (Mitchell 2023, "A note on DPO with noisy preferences"):

        l = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)

    Config: ``beta`` (0.1), ``label_smoothing`` (0). ``logsigmoid`` keeps it finite for any h.
    """
    beta, eps = cfg.beta, cfg.label_smoothing
    logits_B = beta * _margin(inp)
    loss_B = -(1.0 - eps) * F.logsigmoid(logits_B) - eps * F.logsigmoid(-logits_B)
    return _outputs(loss_B, inp, beta)


@PREFERENCE_LOSSES.register("ipo")
def ipo(inp: PreferenceInputs, cfg: DpoAlgorithm) -> PreferenceOutputs:
    """IPO (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
    Preferences", arXiv 2310.12036), with tau = ``beta``:

        l = (h - 1 / (2 tau))^2

    It regresses the margin to a finite target instead of pushing it to infinity, so it does not
    overfit deterministic preferences. The paper's h uses summed log-probs, as here.
    """
    beta = cfg.beta
    loss_B = torch.square(_margin(inp) - 1.0 / (2.0 * beta))
    return _outputs(loss_B, inp, beta)


@PREFERENCE_LOSSES.register("ipo_norm")
def ipo_norm(inp: PreferenceInputs, cfg: DpoAlgorithm) -> PreferenceOutputs:
    """Length-normalised IPO: the IPO loss with each log-likelihood averaged over its response's tokens
    (the form of TRL's ``loss_type="ipo"``, which averages the log-probs):

        h_norm = (log pi(y_w) - log pi_ref(y_w)) / |y_w| - (log pi(y_l) - log pi_ref(y_l)) / |y_l|
        l      = (h_norm - 1 / (2 tau))^2

    so a long response does not dominate the margin by its length alone.
    """
    if inp.chosen_len is None or inp.rejected_len is None:
        raise ValueError("dpo loss ipo_norm needs the response lengths (PreferenceInputs.chosen_len / rejected_len)")
    beta = cfg.beta
    h_B = (inp.chosen_logp - inp.ref_chosen_logp) / inp.chosen_len.clamp_min(1) - (
        inp.rejected_logp - inp.ref_rejected_logp
    ) / inp.rejected_len.clamp_min(1)
    return _outputs(torch.square(h_B - 1.0 / (2.0 * beta)), inp, beta)


@PREFERENCE_LOSSES.register("hinge")
def hinge(inp: PreferenceInputs, cfg: DpoAlgorithm) -> PreferenceOutputs:
    """Hinge loss on the margin (SLiC-HF, Zhao et al. 2023, arXiv 2305.10425; RSO, Liu et al. 2023,
    arXiv 2309.06657, Eq. 7), with the reference terms of DPO:

        l = max(0, 1 - beta h)

    Pairs with a margin above 1 / beta contribute no gradient.
    """
    beta = cfg.beta
    return _outputs(torch.relu(1.0 - beta * _margin(inp)), inp, beta)


@PREFERENCE_LOSSES.register("robust")
def robust(inp: PreferenceInputs, cfg: DpoAlgorithm) -> PreferenceOutputs:
    """Robust DPO (Chowdhury et al. 2024, "Provably Robust DPO", arXiv 2403.00409, Eq. 8): an unbiased
    loss when each preference label is flipped with probability eps (``label_smoothing``, < 0.5):

        l = ((1 - eps) (-log sigmoid(beta h)) - eps (-log sigmoid(-beta h))) / (1 - 2 eps)

    With eps = 0 it is DPO. Unlike conservative DPO it can be negative per pair.
    """
    beta, eps = cfg.beta, cfg.label_smoothing
    logits_B = beta * _margin(inp)
    loss_B = (-(1.0 - eps) * F.logsigmoid(logits_B) + eps * F.logsigmoid(-logits_B)) / (1.0 - 2.0 * eps)
    return _outputs(loss_B, inp, beta)
