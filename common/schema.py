"""The typed schema of one fleetrl job: one msgspec Struct per config section.

Every field carries a one-line description (``doc(...)``) that `fleetrl config docs` turns into
docs/config.md, and range constraints that msgspec checks while decoding. Cross-field rules live in
``__post_init__`` and raise ``ValueError`` with the key to change.

This module imports nothing heavy: the broker, the CLI and tests load configs without torch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, field


def doc(text: str, **constraints: Any) -> Meta:
    """Field metadata: a one-line description plus msgspec range constraints (ge, gt, le, lt, ...)."""
    return Meta(description=text, **constraints)


class Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=False):
    """Base of every config section: keyword-only, unknown keys rejected."""


# --------------------------------------------------------------------------------------- model


class LoraConfig(Section):
    r: Annotated[int, doc("LoRA rank; 8-64 is typical, higher adapts more but costs memory.", ge=1)] = 8
    alpha: Annotated[float, doc("LoRA scaling numerator (scale = alpha / r).", gt=0)] = 16.0
    dropout: Annotated[float, doc("Dropout on the LoRA input during training.", ge=0, lt=1)] = 0.0
    target_modules: Annotated[
        list[str], doc("Module name suffixes that get adapters, e.g. [q_proj, v_proj].")
    ] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


class ModelConfig(Section):
    path: Annotated[str, doc("Local Hugging Face model directory of the policy (see `fleetrl init-model`).")] = (
        "models/tiny"
    )
    tokenizer: Annotated[str | None, doc("Tokenizer directory when it differs from `model.path`.")] = None
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        doc("Weight dtype; `auto` is float32 on CPU and bfloat16 on GPU."),
    ] = "auto"
    trust_remote_code: Annotated[bool, doc("Allow custom modelling code shipped in the model directory.")] = False
    gradient_checkpointing: Annotated[bool, doc("Recompute activations in backward to save memory.")] = False
    lora: Annotated[LoraConfig | None, doc("Train LoRA adapters instead of all weights (null = full fine-tuning).")] = (
        None
    )


# ---------------------------------------------------------------------------------------- data


class DataConfig(Section):
    train: Annotated[str, doc("Prompt set: a .jsonl / .parquet file or a saved HF `datasets` directory.")] = (
        "data/arith.jsonl"
    )
    eval: Annotated[str | None, doc("Held-out prompt set for `fleetrl eval` and periodic evaluation.")] = None
    prompt_key: Annotated[str, doc("Column holding the prompt text (or a list of chat messages).")] = "prompt"
    answer_key: Annotated[str, doc("Column holding the ground-truth answer passed to reward functions.")] = "answer"
    shuffle: Annotated[bool, doc("Shuffle the prompt order every epoch.")] = True
    seed: Annotated[int, doc("Seed of the shuffle; the broker's data cursor is reproducible from it.")] = 0
    epochs: Annotated[int, doc("Passes over the prompt set before the broker reports it exhausted.", ge=1)] = 1000
    apply_chat_template: Annotated[
        bool, doc("Wrap prompts in the tokenizer's chat template; false sends the raw prompt text.")
    ] = False
    max_prompt_tokens: Annotated[int, doc("Prompts longer than this are truncated from the left.", ge=1)] = 1024
    preference: Annotated[
        str | None, doc("Preference pairs (prompt, chosen, rejected) for offline DPO: .jsonl / .parquet / HF dataset dir.")
    ] = None
    preference_eval: Annotated[
        str | None, doc("Held-out preference pairs for `dpo/heldout_accuracy` every run.eval_interval steps (null = off).")
    ] = None
    chosen_key: Annotated[str, doc("Column of the preferred response in `data.preference`.")] = "chosen"
    rejected_key: Annotated[str, doc("Column of the dispreferred response in `data.preference`.")] = "rejected"


# ------------------------------------------------------------------------------------- rollout


class RewardSpec(Section):
    name: Annotated[str, doc("Reward function from the registry: math, exact, regex, length, python, model.")]
    weight: Annotated[float, doc("Weight of this reward in the weighted sum.")] = 1.0
    args: Annotated[dict[str, Any], doc("Keyword arguments of the reward function (see docs/rewards).")] = field(
        default_factory=dict
    )


class VllmConfig(Section):
    tensor_parallel_size: Annotated[int, doc("GPUs per vLLM engine (tensor parallelism).", ge=1)] = 1
    gpu_memory_utilization: Annotated[float, doc("Fraction of GPU memory vLLM may take.", gt=0, le=1)] = 0.85
    enforce_eager: Annotated[bool, doc("Disable CUDA graphs (slower, starts faster).")] = False
    max_model_len: Annotated[int | None, doc("Context length vLLM reserves KV cache for (null = model's).")] = None


class RolloutConfig(Section):
    engine: Annotated[Literal["hf", "vllm"], doc("Generation engine: `hf` (transformers, CPU/GPU) or `vllm` (GPU).")] = (
        "hf"
    )
    num_servers: Annotated[int, doc("Rollout servers `fleetrl run` starts on this machine.", ge=0)] = 1
    device: Annotated[str, doc("Torch device of the `hf` engine: cpu, cuda, cuda:1, or auto.")] = "auto"
    group_size: Annotated[int, doc("Responses sampled per prompt (the G of GRPO).", ge=1)] = 8
    prompts_per_batch: Annotated[int, doc("Prompts leased and generated together in one engine call.", ge=1)] = 8
    temperature: Annotated[float, doc("Sampling temperature; 1.0 keeps behaviour log-probs on-policy.", ge=0)] = 1.0
    top_p: Annotated[float, doc("Nucleus sampling mass (1.0 = off).", gt=0, le=1)] = 1.0
    top_k: Annotated[int, doc("Top-k sampling (0 = off).", ge=0)] = 0
    max_new_tokens: Annotated[int, doc("Longest response generated; longer ones finish with reason `length`.", ge=1)] = (
        256
    )
    stop: Annotated[list[str], doc("Strings that end a response (kept out of the reward text).")] = field(
        default_factory=list
    )
    stop_token_ids: Annotated[list[int], doc("Token ids that end a response, besides the tokenizer's eos.")] = field(
        default_factory=list
    )
    rewards: Annotated[list[RewardSpec], doc("Reward functions and weights; the sample's reward is the weighted sum.")] = (
        field(default_factory=lambda: [RewardSpec(name="math")])
    )
    reward_timeout_s: Annotated[float, doc("Time limit of one user reward call; slower samples count as failed.", gt=0)] = (
        10.0
    )
    reward_workers: Annotated[int, doc("Threads that score rewards while the engine generates the next batch.", ge=1)] = 4
    on_reward_failure: Annotated[
        Literal["zero", "drop_group"], doc("A failed reward gives reward 0, or drops its whole group.")
    ] = "zero"
    seed: Annotated[int, doc("Base sampling seed; server i uses seed + i.")] = 0
    vllm: Annotated[VllmConfig, doc("vLLM engine settings (engine: vllm).")] = field(default_factory=VllmConfig)


# -------------------------------------------------------------------------------------- broker


class CurveConfig(Section):
    server_secret_key: Annotated[str, doc("Broker's secret key file (`fleetrl keys generate`).")]
    server_public_key: Annotated[str, doc("Broker's public key file, given to clients.")]
    client_secret_key: Annotated[str | None, doc("This client's secret key file (rollout / learner side).")] = None
    client_public_key: Annotated[str | None, doc("This client's public key file (rollout / learner side).")] = None
    authorized_keys_dir: Annotated[
        str | None, doc("Directory of client public keys the broker accepts (null = any client with the server key).")
    ] = None


class BrokerConfig(Section):
    host: Annotated[str, doc("Address the broker binds; keep 127.0.0.1 unless clients are on other machines.")] = (
        "127.0.0.1"
    )
    port: Annotated[int, doc("ROUTER port for requests (0 = pick a free port and write it to the run dir).", ge=0, le=65535)] = (
        5555
    )
    pub_port: Annotated[int, doc("PUB port for announcements (0 = free port).", ge=0, le=65535)] = 5556
    address: Annotated[
        str | None, doc("Where clients connect, e.g. tcp://10.0.0.1:5555 (null = derived from host and port).")
    ] = None
    max_staleness: Annotated[
        int, doc("Oldest policy lag (in versions) a group may have when trained; 0 = synchronous.", ge=0)
    ] = 2
    requeue_stale: Annotated[bool, doc("Re-issue the prompts of groups dropped as stale.")] = True
    max_message_bytes: Annotated[int, doc("Frames larger than this are refused with `too_large`.", ge=1024)] = (
        64 * 1024 * 1024
    )
    prompt_lease_s: Annotated[float, doc("Seconds a rollout server holds leased prompts before they are re-issued.", gt=0)] = (
        300.0
    )
    batch_lease_s: Annotated[float, doc("Seconds a learner holds leased groups before they are redelivered.", gt=0)] = (
        600.0
    )
    queue_capacity: Annotated[
        int | None, doc("Most groups queued + in flight (null = what learners use within max_staleness versions).")
    ] = None
    commit_on_checkpoint: Annotated[
        bool, doc("Keep consumed groups until a learner checkpoint covers them (exact resume).")
    ] = False
    spool_dir: Annotated[str | None, doc("Append-only on-disk log of accepted groups and leases (null = memory only).")] = (
        None
    )
    fsync: Annotated[
        Literal["never", "interval", "always"], doc("When the spool fsyncs: never, every `fsync_interval_s`, or every write.")
    ] = "interval"
    fsync_interval_s: Annotated[float, doc("Seconds between spool fsyncs with fsync: interval.", gt=0)] = 1.0
    vocab_size: Annotated[int | None, doc("Reject token ids >= this (null = read from the model's config.json).")] = None
    heartbeat_s: Annotated[float, doc("Seconds between client heartbeats.", gt=0)] = 2.0
    client_timeout_s: Annotated[float, doc("A client silent this long is reported dead.", gt=0)] = 30.0
    request_timeout_s: Annotated[float, doc("Client-side wait for one broker reply before retrying.", gt=0)] = 30.0
    curve: Annotated[CurveConfig | None, doc("CURVE encryption and client authentication (null = plaintext).")] = None


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


# ---------------------------------------------------------------------------------------- sync


class SyncConfig(Section):
    transport: Annotated[
        Literal["filesystem", "gloo", "nccl"],
        doc("How weights reach rollouts: safetensors files, or a torch.distributed broadcast (gloo CPU / nccl GPU)."),
    ] = "filesystem"
    interval: Annotated[int, doc("Publish weights every this many optimizer steps.", ge=1)] = 1
    bucket_mb: Annotated[float, doc("Size of one broadcast bucket in MB.", gt=0)] = 256.0
    dir: Annotated[str | None, doc("Directory of versioned safetensors (filesystem; null = <run dir>/weights).")] = None
    keep_versions: Annotated[int, doc("Weight versions kept on disk by the filesystem transport.", ge=1)] = 3
    master_addr: Annotated[str, doc("Address learner rank 0 hosts the broadcast TCPStore on.")] = "127.0.0.1"
    master_port: Annotated[int, doc("Port of that TCPStore (0 = free port, announced).", ge=0, le=65535)] = 0
    timeout_s: Annotated[float, doc("Longest wait of one broadcast round; late receivers are dropped.", gt=0)] = 120.0


# ---------------------------------------------------------------------------------- checkpoint


class CheckpointConfig(Section):
    dir: Annotated[str | None, doc("Checkpoint directory (null = <run dir>/checkpoints).")] = None
    interval: Annotated[int, doc("Save every this many steps (0 = only at the end and on SIGTERM).", ge=0)] = 50
    keep_last: Annotated[int, doc("Checkpoints kept (healthy-tagged ones are kept in addition).", ge=1)] = 3
    export_hf: Annotated[bool, doc("Also write an HF-format model (save_pretrained) with each checkpoint.")] = True
    resume: Annotated[str | None, doc("Resume: `auto` (newest in dir), a checkpoint path, or null.")] = None


# ----------------------------------------------------------------------------------- telemetry


class TelemetryConfig(Section):
    exporter: Annotated[
        Literal["none", "console", "jsonl", "otlp"], doc(
            "Where trace spans go: jsonl writes <run dir>/traces/<service>-<pid>.jsonl (read them with `fleetrl trace`), "
            "otlp posts to otlp_endpoint; none costs nothing.")
    ] = "none"
    otlp_endpoint: Annotated[str, doc("OTLP/HTTP collector endpoint for exporter: otlp (/v1/traces is appended).")] = (
        "http://127.0.0.1:4318"
    )
    prometheus_port: Annotated[
        int | None, doc("Serve the learner's metrics for Prometheus on this port at /metrics (null = off).")
    ] = None
    tensorboard: Annotated[bool, doc("Also write TensorBoard event files (needs the tracking extra).")] = False
    wandb_project: Annotated[str | None, doc("Also log to this wandb project (needs the tracking extra).")] = None
    wandb_mode: Annotated[Literal["online", "offline", "disabled"], doc("wandb mode; offline writes <run dir>/wandb (upload later with `wandb sync`).")] = "offline"
    log_level: Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"], doc("Logging level of every process.")] = "INFO"


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


# ----------------------------------------------------------------------------------------- run


class RunConfig(Section):
    name: Annotated[str, doc("Run name; the run directory is <root>/<name>-<timestamp>.")] = "fleetrl"
    root: Annotated[str, doc("Parent directory of run directories.")] = "runs"
    dir: Annotated[str | None, doc("Exact run directory (null = derived from root, name and time).")] = None
    ready_timeout_s: Annotated[float, doc("How long `fleetrl run` waits for each process to report ready.", gt=0)] = 300.0
    restart_policy: Annotated[
        Literal["never", "on-failure"], doc("Restart children that die (`fleetrl run`).")
    ] = "never"
    max_restarts: Annotated[int, doc("Restarts per child before the job fails.", ge=0)] = 3
    learner_threads: Annotated[int | None, doc("Torch threads per learner rank `fleetrl run` sets (null = split the cores).")] = (
        None
    )
    rollout_threads: Annotated[int | None, doc("Torch threads per rollout server `fleetrl run` sets (null = split the cores).")] = (
        None
    )
    eval_interval: Annotated[int, doc("Evaluate on data.eval every this many steps (0 = off).", ge=0)] = 0
    eval_n: Annotated[int, doc("Held-out items per periodic evaluation.", ge=1)] = 500


class JobConfig(Section):
    """One whole fleetrl job. Every process of the job reads the same file."""

    model: Annotated[ModelConfig, doc("The policy model.")] = field(default_factory=ModelConfig)
    data: Annotated[DataConfig, doc("Prompt and preference data.")] = field(default_factory=DataConfig)
    rollout: Annotated[RolloutConfig, doc("Rollout servers: generation and rewards.")] = field(
        default_factory=RolloutConfig
    )
    broker: Annotated[BrokerConfig, doc("The broker: queue, leases, staleness, spool, security.")] = field(
        default_factory=BrokerConfig
    )
    learner: Annotated[LearnerConfig, doc("DeepSpeed learner ranks.")] = field(default_factory=LearnerConfig)
    algorithm: Annotated[AlgorithmConfig, doc("Advantages, losses, KL, off-policy correction.")] = field(
        default_factory=AlgorithmConfig
    )
    sync: Annotated[SyncConfig, doc("Weight sync from learner to rollouts.")] = field(default_factory=SyncConfig)
    checkpoint: Annotated[CheckpointConfig, doc("Checkpoints and resume.")] = field(default_factory=CheckpointConfig)
    telemetry: Annotated[TelemetryConfig, doc("Traces, metric sinks and logging.")] = field(
        default_factory=TelemetryConfig
    )
    health: Annotated[HealthConfig, doc("Health monitor and circuit breaker.")] = field(default_factory=HealthConfig)
    run: Annotated[RunConfig, doc("The `fleetrl run` launcher.")] = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        if self.broker.max_staleness > 0 and self.algorithm.off_policy.mode == "none" and self.algorithm.policy_loss != "dpo":
            # Validated here too (not only in the learner) so that every process refuses the job.
            raise ValueError(
                f"broker.max_staleness={self.broker.max_staleness} trains on samples from older policies, but "
                "algorithm.off_policy.mode is `none`; set algorithm.off_policy.mode=tis (or decoupled), "
                "or broker.max_staleness=0 for a synchronous job"
            )
        self._check_dpo_and_lora()

    def _check_dpo_and_lora(self) -> None:
        dpo = self.algorithm.policy_loss == "dpo"
        if self.data.preference and not dpo:
            raise ValueError(f"data.preference={self.data.preference!r} is read only by offline DPO; set "
                             "algorithm.policy_loss=dpo, or data.preference=null for an RL job")
        if dpo and not self.data.preference and self.rollout.group_size < 2:
            raise ValueError(f"online DPO pairs the best and worst response of each group, but rollout.group_size="
                             f"{self.rollout.group_size}; set rollout.group_size >= 2 (or data.preference for offline DPO)")
        if self.model.lora is not None and self.learner.zero_stage == 3:
            raise ValueError("model.lora with learner.zero_stage=3 is not supported (merging partitioned base weights "
                             "for weight sync); use learner.zero_stage=2, which shards the adapters' optimizer state")
