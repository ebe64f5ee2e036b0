"""The learner's config sections: ``learner`` (optimisation and batching), ``algorithm`` (advantages,
losses, KL, off-policy correction, DPO and the PPO critic) and ``health`` (the monitor's rules).

Part of the job schema, which ``schema.py`` assembles into ``JobConfig``; the conventions (a ``doc``
on every field, ranges checked while decoding, cross-field rules in ``__post_init__``) are the same.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, field

from fleetrl.common.config.base import Section, doc


# ------------------------------------------------------------------------------------- learner


class LearnerConfig(Section):
    num_ranks: Annotated[int, doc("Learner processes `fleetrl run` starts (torchrun when > 1).", ge=1)] = 1
    device: Annotated[Literal["auto", "cpu", "cuda"], doc("Training device; auto picks cuda when available.")] = "auto"
    precision: Annotated[Literal["auto", "fp32", "bf16"], doc("Training precision; auto = bf16 on GPU, fp32 on CPU.")] = (
        "auto"
    )
    zero_stage: Annotated[int, doc("DeepSpeed ZeRO stage (0-3).", ge=0, le=3)] = 0
    total_steps: Annotated[int, doc("Optimizer steps of the run.", ge=1)] = 100
    max_minutes: Annotated[
        float | None, doc("Stop (with a checkpoint) after this much training wall time, even before total_steps.")
    ] = None
    groups_per_step: Annotated[int, doc("Prompt groups per optimizer step, across all ranks.", ge=1)] = 16
    ppo_epochs: Annotated[int, doc("Passes over each leased batch.", ge=1)] = 1
    mini_batches: Annotated[int, doc("Optimizer updates per pass (the batch is split into this many).", ge=1)] = 1
    max_tokens_per_microbatch: Annotated[
        int, doc("Token budget of one forward/backward; responses are packed up to it.", ge=1)
    ] = 8192
    lr: Annotated[float, doc("Peak learning rate of AdamW.", gt=0)] = 1e-6
    weight_decay: Annotated[float, doc("AdamW weight decay.", ge=0)] = 0.0
    betas: Annotated[list[float], doc("AdamW betas.")] = field(default_factory=lambda: [0.9, 0.999])
    lr_schedule: Annotated[Literal["constant", "linear", "cosine"], doc("Learning-rate schedule after warmup.")] = (
        "constant"
    )
    warmup_steps: Annotated[int, doc("Linear warmup steps.", ge=0)] = 0
    min_lr_ratio: Annotated[float, doc("Floor of linear/cosine decay as a fraction of `lr`.", ge=0, le=1)] = 0.0
    grad_clip: Annotated[float, doc("Clip the global grad norm to this (0 = off).", ge=0)] = 1.0
    batch_wait_s: Annotated[float, doc("Longest wait for a batch before the learner reports the fleet idle.", gt=0)] = (
        600.0
    )
    max_lease_rounds: Annotated[
        int, doc("Leases per step when dynamic sampling filters groups out (bounds the wait).", ge=1)
    ] = 8
    seed: Annotated[int, doc("Seed of the learner's RNGs.")] = 0


# ----------------------------------------------------------------------------------- algorithm


class OffPolicyConfig(Section):
    mode: Annotated[
        Literal["none", "tis", "decoupled"],
        doc("Off-policy correction: none, truncated IS (min(pi_old/mu, C)), or AReaL's decoupled PPO."),
    ] = "tis"
    level: Annotated[
        Literal["token", "sequence"], doc("Importance weights per token or per sequence (gspo always uses sequence).")
    ] = "token"
    cap: Annotated[
        float, doc("Cap C of the importance weights: tis truncates them at C, decoupled drops tokens above C.", gt=0)
    ] = 2.0


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
    estimator: Annotated[str, doc("KL estimator: k1, k2, k3 (aliases kl, mse, low_var_kl).")] = "k3"
    coef: Annotated[float, doc("KL coefficient (initial value when adaptive).", ge=0)] = 0.001
    adaptive: Annotated[AdaptiveKlConfig | None, doc("Adaptive KL controller (null = fixed coefficient).")] = None


class OverlongConfig(Section):
    enabled: Annotated[bool, doc("DAPO overlong shaping: penalise responses in the last `buffer_len` tokens.")] = False
    buffer_len: Annotated[int, doc("Length of the penalty zone before max_new_tokens.", ge=1)] = 64
    penalty: Annotated[float, doc("Penalty at max length (linear from 0 at the zone's start).", ge=0)] = 1.0


class DpoConfig(Section):
    beta: Annotated[float, doc("DPO temperature beta.", gt=0)] = 0.1
    loss: Annotated[str, doc("Preference loss: sigmoid or ipo.")] = "sigmoid"
    label_smoothing: Annotated[float, doc("Conservative-DPO label smoothing.", ge=0, lt=0.5)] = 0.0


class CriticConfig(Section):
    path: Annotated[str | None, doc("Value model initialisation (null = the policy's weights plus a new head).")] = None
    lr: Annotated[float, doc("Critic learning rate.", gt=0)] = 1e-5
    warmup_steps: Annotated[int, doc("Critic-only steps before the policy starts updating.", ge=0)] = 0
    vf_coef: Annotated[float, doc("Weight of the value loss.", gt=0)] = 0.5
    cliprange_value: Annotated[float, doc("Clip of value predictions around the old values.", gt=0)] = 0.2


class AlgorithmConfig(Section):
    adv_estimator: Annotated[str, doc("Advantage estimator: gae, grpo, drgrpo, rloo, reinforce_pp, reinforce_pp_baseline.")] = (
        "grpo"
    )
    policy_loss: Annotated[str, doc("Policy loss: ppo_clip, dapo, gspo, dpo.")] = "ppo_clip"
    loss_agg: Annotated[
        Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"],
        doc("How token losses become one number (see docs/algorithms.md)."),
    ] = "token-mean"
    loss_agg_norm_len: Annotated[
        int | None, doc("Fixed length of seq-mean-token-sum-norm (null = rollout.max_new_tokens).")
    ] = None
    clip_low: Annotated[
        float | None, doc("Clip epsilon below 1 (ratio >= 1 - clip_low); null = the loss's default (ppo_clip/dapo 0.2, gspo 3e-4).")
    ] = None
    clip_high: Annotated[
        float | None, doc("Clip epsilon above 1; null = the loss's default (ppo_clip 0.2, dapo 0.28, gspo 4e-4).")
    ] = None
    dual_clip: Annotated[float | None, doc("Dual-clip constant c > 1 for negative advantages (null = off).")] = None
    norm_by_std: Annotated[bool, doc("GRPO: divide the group-centred reward by the group std.")] = True
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
    dpo: Annotated[DpoConfig, doc("DPO settings (policy_loss: dpo).")] = field(default_factory=DpoConfig)
    critic: Annotated[CriticConfig, doc("Value model settings (adv_estimator: gae).")] = field(default_factory=CriticConfig)

    def __post_init__(self) -> None:
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"algorithm.dual_clip must be > 1 (got {self.dual_clip}); set it to e.g. 3.0 or null")


# -------------------------------------------------------------------------------------- health


class HealthRule(Section):
    name: Annotated[
        str,
        doc("Rule from the health registry: reward_drop, reward_floor, reward_checkpoint_decline, kl_ceiling, "
            "mismatch_kl_ceiling, entropy_floor, length_collapse, grad_spike, non_finite (docs/monitoring.md)."),
    ]
    action: Annotated[
        Literal["alert", "stop", "rollback"],
        doc("When the rule fires: alert (log and record), stop (checkpoint and end the run), or rollback "
            "(restore the newest healthy checkpoint with a lower learning rate)."),
    ] = "alert"
    metric: Annotated[str | None, doc("Metric the rule watches (null = the rule's default, e.g. reward/mean).")] = None
    window: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        doc("Steps the rule averages or looks back over, >= 1 (checkpoints for reward_checkpoint_decline; "
            "null = the rule's default)."),
    ] = None
    threshold: Annotated[
        float | None,
        doc("The rule's limit: a drop, floor, ceiling, fraction or factor depending on the rule "
            "(null = the rule's default; reward_floor needs one)."),
    ] = None


class HealthConfig(Section):
    enabled: Annotated[bool, doc("Run the health monitor in the learner.")] = True
    rules: Annotated[
        list[HealthRule], doc("Rules checked after every step (and at every checkpoint); see docs/monitoring.md.")
    ] = field(
        default_factory=lambda: [
            HealthRule(name="non_finite", action="stop"),
            HealthRule(name="grad_spike", action="alert"),
            HealthRule(name="reward_drop", action="alert"),
            HealthRule(name="entropy_floor", action="alert"),
            HealthRule(name="mismatch_kl_ceiling", action="alert"),
        ]
    )
    healthy_window: Annotated[
        int, doc("A checkpoint is healthy when no rule fired at its step or in this many steps before it.", ge=0)
    ] = 10
    lr_factor: Annotated[float, doc("Learning rate multiplier applied at each rollback.", gt=0, le=1)] = 0.5
    max_rollbacks: Annotated[
        int, doc("Rollbacks allowed; a rollback beyond this stops the run with the health report.", ge=0)
    ] = 3
