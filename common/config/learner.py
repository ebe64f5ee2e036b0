"""The learner's config sections: ``learner`` (optimisation and batching) and ``health`` (the monitor's
rules). The ``algorithm`` section, the objective the learner trains, is in ``algorithm.py``.

Part of the job schema, which ``schema.py`` assembles into ``JobConfig``; the conventions (a ``doc``
on every field, ranges checked while decoding, cross-field rules in ``__post_init__``) are the same.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, field

from fleetrl.common.config.base import Section, doc

HealthRuleName = Literal[
    "reward_drop",
    "reward_floor",
    "reward_checkpoint_decline",
    "kl_ceiling",
    "mismatch_kl_ceiling",
    "entropy_floor",
    "length_collapse",
    "grad_spike",
    "non_finite",
    "reward_hacking",
    "server_poison",
    "stale_weights",
]
"""The names of ``learner/health_rules.py``'s registry; a test keeps the two equal."""


# ------------------------------------------------------------------------------------- learner


class LearnerConfig(Section):
    num_ranks: Annotated[int, doc("Learner processes `fleetrl run` starts (torchrun when > 1).", ge=1)] = 1
    device: Annotated[Literal["auto", "cpu", "cuda"], doc("Training device; auto picks cuda when available.")] = "auto"
    precision: Annotated[
        Literal["auto", "fp32", "bf16"], doc("Training precision; auto = bf16 on GPU, fp32 on CPU.")
    ] = "auto"
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
    shared_prompts: Annotated[
        bool,
        doc(
            "Forward each distinct prompt of a micro-batch once and let its samples' responses attend to its "
            "keys and values (a group's samples share their prompt): the same log-probs and gradients up to "
            "float rounding, for fewer FLOPs; false = one forward over every prompt + response row."
        ),
    ] = True
    lr: Annotated[float, doc("Peak learning rate of AdamW.", gt=0)] = 1e-6
    weight_decay: Annotated[float, doc("AdamW weight decay.", ge=0)] = 0.0
    betas: Annotated[list[float], doc("AdamW betas.")] = field(default_factory=lambda: [0.9, 0.999])
    lr_schedule: Annotated[Literal["constant", "linear", "cosine"], doc("Learning-rate schedule after warmup.")] = (
        "constant"
    )
    warmup_steps: Annotated[int, doc("Linear warmup steps.", ge=0)] = 0
    lr_decay_by: Annotated[
        Literal["steps", "time"],
        doc(
            "What the linear/cosine decay after warmup runs over: steps (it ends at total_steps) or time (it ends "
            "when max_minutes of training are up, so a time-budgeted run ends at the floor of its schedule; a run "
            "that reaches total_steps first stops mid-schedule, as a step schedule does when max_minutes comes "
            "first; without max_minutes the LR stays at its peak, and the learner says so at start)."
        ),
    ] = "steps"
    min_lr_ratio: Annotated[float, doc("Floor of linear/cosine decay as a fraction of `lr`.", ge=0, le=1)] = 0.0
    grad_clip: Annotated[float, doc("Clip the global grad norm to this (0 = off).", ge=0)] = 1.0
    batch_wait_s: Annotated[float, doc("Longest wait for a batch before the learner reports the fleet idle.", gt=0)] = (
        600.0
    )
    peer_timeout_s: Annotated[
        float,
        doc(
            "With several ranks: a rank not heard from this long (its node cut off, its process frozen or killed) ends the "
            "others at once, naming it and its host, instead of a collective waiting out the process group's 30-minute "
            "timeout (learner/peers.py); 0 = off.",
            ge=0,
        ),
    ] = 60.0
    prefetch: Annotated[
        bool,
        doc(
            "Lease the next step's batch on a thread while this step trains (the staleness bound counts from the "
            "version that step will train at); a batch whose version or quarantine changed meanwhile goes back to "
            "the queue and the step leases again.",
        ),
    ] = True
    max_lease_rounds: Annotated[
        int, doc("Leases per step when dynamic sampling filters groups out (bounds the wait).", ge=1)
    ] = 8
    seed: Annotated[int, doc("Seed of the learner's RNGs.")] = 0


# -------------------------------------------------------------------------------------- health


class HealthRule(Section):
    name: Annotated[HealthRuleName, doc("Rule from the health registry (docs/monitoring.md).")]
    action: Annotated[
        Literal["alert", "stop", "rollback", "quarantine"],
        doc(
            "When the rule fires: alert (log and record), stop (checkpoint and end the run), rollback "
            "(restore the newest healthy checkpoint with a lower learning rate), or quarantine (per-server rules "
            "only: the broker stops leasing to that rollout server and drops its groups)."
        ),
    ] = "alert"
    metric: Annotated[str | None, doc("Metric the rule watches (null = the rule's default, e.g. reward/mean).")] = None
    window: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        doc(
            "Steps the rule averages or looks back over, >= 1 (checkpoints for reward_checkpoint_decline; "
            "null = the rule's default)."
        ),
    ] = None
    threshold: Annotated[
        float | None,
        doc(
            "The rule's limit: a drop, floor, ceiling, fraction or factor depending on the rule "
            "(null = the rule's default; reward_floor needs one)."
        ),
    ] = None
    persist: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        doc(
            "reward_drop only: fire when each of the last `persist` steps' own reward is more than threshold "
            "under the best `window`-step average (a drop that lasts; the average counts from 10 steps in); "
            "null = compare the `window`-step average itself (the older, noisier form)."
        ),
    ] = None
    evidence: Annotated[
        list[Literal["divergence", "answers", "signals"]] | None,
        doc(
            "reward_hacking only: which evidence may fire it: divergence (held-out accuracy falls while the reward "
            "rises), answers (the held-out greedy answers change, shorter, while the reward holds), signals (the "
            "training samples' length, distinct-2 or identical share against the run's baseline); null = all three."
        ),
    ] = None


class ScreenConfig(Section):
    enabled: Annotated[
        bool,
        doc(
            "Leave out of each step the leased groups no honest rollout server could have sent "
            "(learner/screen.py), counted per server for the server_poison rule."
        ),
    ] = True
    reward_spread: Annotated[
        float,
        doc(
            "A reward further than this x max(IQR, 1) from the median of the fleet's recent rewards is implausible "
            "(100: a -10 format penalty among 0/1 rewards passes, -1e6 does not); raise it for heavier tails.",
            gt=0,
        ),
    ] = 100.0
    history: Annotated[int, doc("Recent rewards (samples that passed) the median and IQR are taken over.", ge=8)] = 1024
    warmup: Annotated[
        int, doc("Samples that must pass before rewards are judged (log-probs are judged at once).", ge=1)
    ] = 64


class HealthConfig(Section):
    enabled: Annotated[bool, doc("Run the health monitor in the learner.")] = True
    rules: Annotated[
        list[HealthRule], doc("Rules checked after every step (and at every checkpoint); see docs/monitoring.md.")
    ] = field(
        default_factory=lambda: [
            # tuned on benchmarks/health.py (docs/monitoring.md, "The breaker, measured")
            HealthRule(name="non_finite", action="rollback"),
            HealthRule(name="grad_spike", action="alert"),
            # 5 steps in a row 0.25 under the best 30-step average: quiet on 12,850 healthy 4 x 4 steps, where
            # the 10-step average 0.2 under its best rolled back 15 times; divergence still caught (docs/monitoring.md)
            HealthRule(name="reward_drop", action="rollback", window=30, threshold=0.25, persist=5),
            HealthRule(name="length_collapse", action="rollback", window=10, threshold=0.6),
            HealthRule(name="entropy_floor", action="alert"),
            HealthRule(name="mismatch_kl_ceiling", action="rollback"),  # ceiling 0.01: see the rule
            # held-out answers and cheap signals: 0 rollbacks on 32,100 healthy steps, every recorded hack caught
            # 4-19 steps after its onset; the accuracy divergence (8 false rollbacks there) is opt-in
            HealthRule(name="reward_hacking", action="rollback", evidence=["answers", "signals"]),
            HealthRule(name="server_poison", action="quarantine"),  # one server's poison: that server, not the run
            HealthRule(name="stale_weights", action="alert"),  # a server serving other weights than it reports
        ]
    )
    screen: Annotated[ScreenConfig, doc("The per-group screen in front of every step (docs/monitoring.md).")] = field(
        default_factory=ScreenConfig
    )
    healthy_window: Annotated[
        int, doc("A checkpoint is healthy when no rule fired at its step or in this many steps before it.", ge=0)
    ] = 10
    lr_factor: Annotated[float, doc("Learning rate multiplier applied at each rollback.", gt=0, le=1)] = 0.5
    max_rollbacks: Annotated[
        int, doc("Rollbacks allowed; a rollback beyond this stops the run with the health report.", ge=0)
    ] = 3
    rollback_cooldown_steps: Annotated[
        int,
        doc(
            "After a rollback, a rule asking for another within this many steps raises an alert instead (the "
            "restored weights were healthy, so evidence back at once comes from outside them: the fleet, the data "
            "or the reward); the rule rolls back again once the cooldown is over. non_finite always rolls back. "
            "0 = off.",
            ge=0,
        ),
    ] = 10
