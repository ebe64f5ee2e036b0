"""The ``algorithm`` section: the objective the learner trains, a typed choice tagged by ``type``.

    algorithm: {type: rl, adv_estimator: grpo, policy_loss: ppo_clip, ...}     # RlAlgorithm (the default)
    algorithm: {type: dpo, loss: sigmoid, beta: 0.1, ...}                     # DpoAlgorithm

Each variant carries only its own fields and defaults, so a key of the other variant is an unknown
key, refused with the valid ones. Every plug-in name is a ``Literal`` of the names its registry in
``learner/algorithms/`` holds (a test keeps them equal), so a typo fails when the config is decoded,
with a did-you-mean, not after the model and the DeepSpeed engine were built. The learner builds
the actor, the batch source and the evaluator of ``algorithm.type`` from one registry
(``learner/objectives.py``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

from msgspec import field

from fleetrl.common.config.base import Section, doc

AdvEstimatorName = Literal[
    "grpo", "grpo_var_floor", "drgrpo", "rloo", "remax", "reinforce_pp", "reinforce_pp_baseline", "gae"
]
PolicyLossName = Literal["ppo_clip", "dapo", "gspo"]
KlEstimatorName = Literal[
    "k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs", "k1+", "kl+", "k2+", "mse+", "k3+", "low_var_kl+", "abs+"
]
PreferenceLossName = Literal["sigmoid", "ipo", "ipo_norm", "hinge", "robust"]
LossAggName = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

CLIP_DEFAULTS: dict[str, tuple[float, float]] = {
    "ppo_clip": (0.2, 0.2),  # Schulman et al. 2017
    "dapo": (0.2, 0.28),  # Yu et al. 2025, clip-higher
    "gspo": (3e-4, 4e-4),  # Zheng et al. 2025, sequence-level ratio
}
"""(eps_low, eps_high) of each policy loss when ``clip_low`` / ``clip_high`` are null: the one place
these defaults live."""


class OffPolicyConfig(Section):
    mode: Annotated[
        Literal["none", "tis", "decoupled"],
        doc("Off-policy correction: none, truncated IS (min(pi_old/mu, C)), or AReaL's decoupled PPO."),
    ] = "tis"
    level: Annotated[
        Literal["token", "sequence"],
        doc("Importance weights per token or per sequence (gspo ignores it: see gspo_level)."),
    ] = "token"
    gspo_level: Annotated[
        Literal["sequence", "token"],
        doc(
            "policy_loss gspo only: its importance weights per sequence (GSPO's length-normalised rho_i) or per "
            "token (token-level TIS / decoupled weights, min(pi_old/mu, C) per token)."
        ),
    ] = "sequence"
    cap: Annotated[
        float, doc("Cap C of the importance weights: tis truncates them at C, decoupled drops tokens above C.", gt=0)
    ] = 2.0
    batch_normalize: Annotated[
        bool,
        doc(
            "Divide the applied weights by their micro-batch mean (mean weight 1): over valid tokens at "
            "level token, over non-empty sequences at level sequence."
        ),
    ] = False


class AdaptiveKlConfig(Section):
    target: Annotated[float, doc("KL the adaptive controller steers towards.", gt=0)] = 0.01
    horizon: Annotated[
        int, doc("Samples over which the coefficient may move by 20% (Ziegler et al.; larger = slower).", ge=1)
    ] = 10000


class KlConfig(Section):
    placement: Annotated[
        Literal["none", "reward", "loss"],
        doc("KL to the reference model: off, as a per-token reward penalty, or as a loss term."),
    ] = "none"
    estimator: Annotated[
        KlEstimatorName,
        doc(
            "KL estimator: k1, k2, k3, abs (aliases kl, mse, low_var_kl); a trailing + keeps the value and takes "
            "k2's gradient (straight-through, for placement: loss; k2+ is k2 itself, for symmetry)."
        ),
    ] = "k3"
    coef: Annotated[float, doc("KL coefficient (initial value when adaptive).", ge=0)] = 0.001
    adaptive: Annotated[AdaptiveKlConfig | None, doc("Adaptive KL controller (null = fixed coefficient).")] = None


class OverlongConfig(Section):
    enabled: Annotated[bool, doc("DAPO overlong shaping: penalise responses in the last `buffer_len` tokens.")] = False
    buffer_len: Annotated[int, doc("Length of the penalty zone before max_new_tokens.", ge=1)] = 64
    penalty: Annotated[float, doc("Penalty at max length (linear from 0 at the zone's start).", ge=0)] = 1.0


class CriticConfig(Section):
    path: Annotated[str | None, doc("Value model initialisation (null = the policy's weights plus a new head).")] = None
    lr: Annotated[float, doc("Critic learning rate.", gt=0)] = 1e-5
    warmup_steps: Annotated[int, doc("Critic-only steps before the policy starts updating.", ge=0)] = 0
    vf_coef: Annotated[float, doc("Weight of the value loss.", gt=0)] = 0.5
    cliprange_value: Annotated[float, doc("Clip of value predictions around the old values.", gt=0)] = 0.2


class RlAlgorithm(Section, tag_field="type", tag="rl"):
    """Policy-gradient RL on rewarded groups: an advantage estimator, a clipped policy loss, KL, critic."""

    adv_estimator: Annotated[AdvEstimatorName, doc("Advantage estimator (docs/algorithms.md).")] = "grpo"
    policy_loss: Annotated[PolicyLossName, doc("Clipped policy loss (docs/algorithms.md).")] = "ppo_clip"
    loss_agg: Annotated[LossAggName, doc("How token losses become one number (see docs/algorithms.md).")] = "token-mean"
    loss_agg_norm_len: Annotated[
        int | None, doc("Fixed length of seq-mean-token-sum-norm (null = rollout.max_new_tokens).")
    ] = None
    clip_low: Annotated[
        float | None,
        doc("Clip epsilon below 1 (ratio >= 1 - clip_low); null = the loss's default (ppo_clip/dapo 0.2, gspo 3e-4)."),
    ] = None
    clip_high: Annotated[
        float | None, doc("Clip epsilon above 1; null = the loss's default (ppo_clip 0.2, dapo 0.28, gspo 4e-4).")
    ] = None
    dual_clip: Annotated[float | None, doc("Dual-clip constant c > 1 for negative advantages (null = off).")] = None
    norm_by_std: Annotated[bool, doc("GRPO: divide the group-centred reward by the group std.")] = True
    std_eps: Annotated[
        float, doc("GRPO: epsilon added to the group std before dividing (1e-6 as DeepSeekMath).", ge=0)
    ] = 1e-6
    var_floor: Annotated[float, doc("grpo_var_floor: the group variance is floored at this before the sqrt.", ge=0)] = (
        1e-6
    )
    gamma: Annotated[float, doc("Discount factor.", ge=0, le=1)] = 1.0
    lam: Annotated[float, doc("GAE lambda.", ge=0, le=1)] = 1.0
    whiten_advantages: Annotated[bool, doc("GAE: whiten advantages over the batch's valid tokens.")] = True
    entropy_coef: Annotated[float, doc("Entropy bonus coefficient (0 = off).", ge=0)] = 0.0
    dynamic_sampling: Annotated[bool, doc("DAPO dynamic sampling: drop groups whose rewards are all equal.")] = False
    overlong: Annotated[OverlongConfig, doc("DAPO overlong reward shaping.")] = field(default_factory=OverlongConfig)
    off_policy: Annotated[OffPolicyConfig, doc("Correction for samples from older policies.")] = field(
        default_factory=OffPolicyConfig
    )
    kl: Annotated[KlConfig, doc("KL penalty towards the frozen reference model.")] = field(default_factory=KlConfig)
    critic: Annotated[CriticConfig, doc("Value model settings (adv_estimator: gae).")] = field(
        default_factory=CriticConfig
    )

    def __post_init__(self) -> None:
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"algorithm.dual_clip must be > 1 (got {self.dual_clip}); set it to e.g. 3.0 or null")

    def clip_bounds(self, loss: str | None = None) -> tuple[float, float]:
        """(eps_low, eps_high) of ``loss`` (default ``policy_loss``): clip_low / clip_high, else CLIP_DEFAULTS."""
        low, high = CLIP_DEFAULTS[loss or self.policy_loss]
        return (low if self.clip_low is None else self.clip_low, high if self.clip_high is None else self.clip_high)

    @property
    def type(self) -> str:
        """The variant's tag, ``rl`` (also written as ``algorithm.type`` in every resolved config)."""
        return cast(str, self.__struct_config__.tag)

    @property
    def needs_reference(self) -> bool:
        return self.kl.placement != "none"

    def optimizer_steps(self, learner: Any) -> int:
        """Optimizer steps per learner step: ppo_epochs x mini_batches (the LR schedule counts learner steps)."""
        return learner.ppo_epochs * learner.mini_batches


class DpoAlgorithm(Section, tag_field="type", tag="dpo"):
    """Direct preference optimisation: offline from ``data.preference``, or online from the fleet's groups."""

    loss: Annotated[PreferenceLossName, doc("Preference loss: sigmoid (DPO), ipo, ipo_norm, hinge, robust.")] = (
        "sigmoid"
    )
    beta: Annotated[float, doc("DPO temperature beta (tau of IPO).", gt=0)] = 0.1
    label_smoothing: Annotated[
        float, doc("Flip probability eps: conservative DPO (sigmoid) or robust DPO (robust).", ge=0, lt=0.5)
    ] = 0.0
    reference_free: Annotated[
        bool, doc("Drop the reference model: its log-probs count as 0 (no second model in memory).")
    ] = False
    dynamic_sampling: Annotated[
        bool, doc("Online: lease replacements for groups whose rewards all tie (they give no pair).")
    ] = False

    @property
    def type(self) -> str:
        """The variant's tag, ``dpo``."""
        return cast(str, self.__struct_config__.tag)

    @property
    def needs_reference(self) -> bool:
        return not self.reference_free

    def optimizer_steps(self, learner: Any) -> int:
        """One optimizer step per learner step."""
        return 1


AlgorithmConfig = RlAlgorithm | DpoAlgorithm
"""The ``algorithm`` section: one of the variants, chosen by ``algorithm.type`` (default ``rl``)."""

ALGORITHM_TYPES: dict[str, type[Section]] = {"rl": RlAlgorithm, "dpo": DpoAlgorithm}
