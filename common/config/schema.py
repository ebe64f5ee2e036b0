"""The typed schema of one fleetrl job: one msgspec Struct per config section.

Every field carries a one-line description (``doc(...)``) that `fleetrl config docs` turns into
docs/config.md, and range constraints that msgspec checks while decoding. Cross-field rules live in
``__post_init__`` and raise ``ValueError`` with the key to change.

The learner's sections (learner, health) are in ``learner.py``, the objective (``algorithm``, a
tagged choice of ``rl`` or ``dpo``) in ``algorithm.py``, the ``Section`` base and ``doc`` in
``base.py``; ``JobConfig`` here puts them all together.

This module imports nothing heavy: the broker, the CLI and tests load configs without torch.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from msgspec import Meta, field

from fleetrl.common.config.algorithm import AlgorithmConfig, DpoAlgorithm, RlAlgorithm
from fleetrl.common.config.base import Section, doc
from fleetrl.common.config.cluster import ClusterConfig
from fleetrl.common.config.env import EnvConfig, OpenAIConfig
from fleetrl.common.config.learner import HealthConfig, LearnerConfig

# --------------------------------------------------------------------------------------- model


class LoraConfig(Section):
    r: Annotated[int, doc("LoRA rank; 8-64 is typical, higher adapts more but costs memory.", ge=1)] = 8
    alpha: Annotated[float, doc("LoRA scaling numerator (scale = alpha / r).", gt=0)] = 16.0
    dropout: Annotated[float, doc("Dropout on the LoRA input during training.", ge=0, lt=1)] = 0.0
    target_modules: Annotated[list[str], doc("Module name suffixes that get adapters, e.g. [q_proj, v_proj].")] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )


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
    train: Annotated[
        str,
        doc(
            "Prompt set: a .jsonl / .json / .parquet / .csv file, a `save_to_disk` directory, a directory of data files, "
            "or a `datasets` name (offline: from the local HF cache) with data.split / data.subset / data.data_files."
        ),
    ] = "data/arith.jsonl"
    eval: Annotated[
        str | None,
        doc(
            "Held-out prompt set for `fleetrl eval` and periodic evaluation (same forms as "
            "data.train; its split is data.eval_split)."
        ),
    ] = None
    split: Annotated[
        str, doc("Split of data.train when it is a `datasets` name, a data directory or a saved DatasetDict.")
    ] = "train"
    eval_split: Annotated[
        str, doc("Split of data.eval when it is a `datasets` name, a data directory or a DatasetDict.")
    ] = "test"
    subset: Annotated[str | None, doc("Configuration (subset) of a `datasets` name, e.g. `main` for openai/gsm8k.")] = (
        None
    )
    data_files: Annotated[
        str | list[str] | dict[str, str | list[str]] | None,
        doc(
            "`data_files` of `datasets.load_dataset`: the files of data.train / data.eval when they name a builder "
            "(json, csv, parquet) or a repository or directory with several files."
        ),
    ] = None
    map: Annotated[
        str | None,
        doc(
            "Row hook `pkg.module:function` or `path/file.py:function`: called with every row (a dict) after loading, "
            "returns the row to use (a dict), or None to leave the row out; like `datasets.Dataset.map`."
        ),
    ] = None
    prompt_key: Annotated[
        str,
        doc(
            "Column holding the prompt text (or a list of chat messages); dotted for a nested "
            "column, e.g. `extra_info.question`."
        ),
    ] = "prompt"
    answer_key: Annotated[
        str,
        doc(
            "Column holding the ground truth passed to reward functions; dotted for a nested "
            "column, e.g. verl's `reward_model.ground_truth`."
        ),
    ] = "answer"
    shuffle: Annotated[bool, doc("Shuffle the prompt order every epoch.")] = True
    seed: Annotated[int, doc("Seed of the shuffle; the broker's data cursor is reproducible from it.")] = 0
    epochs: Annotated[int, doc("Passes over the prompt set before the broker reports it exhausted.", ge=1)] = 1000
    apply_chat_template: Annotated[
        bool, doc("Wrap prompts in the tokenizer's chat template; false sends the raw prompt text.")
    ] = False
    max_prompt_tokens: Annotated[int, doc("Prompts longer than this are truncated from the left.", ge=1)] = 1024
    preference: Annotated[
        str | None, doc("Preference pairs (prompt, chosen, rejected) for offline DPO: same forms as data.train.")
    ] = None
    preference_eval: Annotated[
        str | None,
        doc("Held-out preference pairs for `dpo/heldout_accuracy` every run.eval_interval steps (null = off)."),
    ] = None
    chosen_key: Annotated[str, doc("Column of the preferred response in `data.preference`.")] = "chosen"
    rejected_key: Annotated[str, doc("Column of the dispreferred response in `data.preference`.")] = "rejected"


# ------------------------------------------------------------------------------------- rollout

RewardName = Literal["math", "exact", "regex", "format", "length", "python", "model"]
"""The names of the reward registry (``rollout/rewards``); a test keeps the two equal."""


class RewardSpec(Section):
    name: Annotated[RewardName, doc("Reward function from the registry (docs/rewards.md).")]
    weight: Annotated[float, doc("Weight of this reward in the weighted sum.")] = 1.0
    label: Annotated[
        str | None,
        doc(
            "Its name in metrics (`reward/<label>/mean`); null = the reward's name, or the "
            "function's name for `python`."
        ),
    ] = None
    args: Annotated[dict[str, Any], doc("Keyword arguments of the reward function (see docs/rewards).")] = field(
        default_factory=dict
    )
    range: Annotated[
        list[float] | None,
        doc(
            "[low, high] its scores lie in, e.g. [0, 1] (null = the function's own: math/exact [0, 1], regex [miss, hit], "
            "length with max_penalty; python and model declare none); the broker refuses groups outside the job's range."
        ),
    ] = None

    def __post_init__(self) -> None:
        if self.range is not None and not (
            len(self.range) == 2 and self.range[0] <= self.range[1] and all(map(math.isfinite, self.range))
        ):
            raise ValueError(f"rollout.rewards[].range must be [low, high] with finite low <= high, got {self.range}")


class VllmConfig(Section):
    tensor_parallel_size: Annotated[int, doc("GPUs per vLLM engine (tensor parallelism).", ge=1)] = 1
    gpu_memory_utilization: Annotated[float, doc("Fraction of GPU memory vLLM may take.", gt=0, le=1)] = 0.85
    enforce_eager: Annotated[
        bool,
        doc(
            "Disable CUDA graphs and torch.compile (slower steps, much faster start-up; "
            "on vLLM's CPU backend start-up drops from ~25 s to ~12 s)."
        ),
    ] = False
    max_model_len: Annotated[int | None, doc("Context length vLLM reserves KV cache for (null = model's).")] = None
    max_num_seqs: Annotated[int | None, doc("Most requests vLLM decodes in one step (null = vLLM's default).")] = None


class HfConfig(Section):
    continuous: Annotated[
        bool,
        doc(
            "Continuous batching: a new request joins the running decode at the next step (its KV rows merge into "
            "the cache); false = the older waves, where new requests wait for the running wave to end."
        ),
    ] = True
    max_rows: Annotated[
        int | None,
        doc(
            "Most rows (requests) decoded at once; requests beyond it wait for a row to finish. "
            "null = no bound besides rollout.max_inflight x rollout.group_size. Lower it to bound the KV cache's memory.",
        ),
    ] = None
    admission_wait_ms: Annotated[
        float,
        doc(
            "Admission window (continuous batching): a request that arrives while others are queued or decoding "
            "waits up to this long for more to arrive, so that they join in one prefill and one cache merge (the "
            "endpoint's staggered calls). 0 = join at the next step. Bounded: no request waits longer than this "
            "for admission (besides max_rows)."
        ),
    ] = 0.0


class RolloutConfig(Section):
    engine: Annotated[
        Literal["hf", "vllm"],
        doc(
            "Generation engine: `hf` (transformers, CPU/GPU) or `vllm` (vLLM's async engine: GPU, or CPU in .venv-vllm)."
        ),
    ] = "hf"
    num_servers: Annotated[int, doc("Rollout servers `fleetrl run` starts on this machine.", ge=0)] = 1
    device: Annotated[str, doc("Device of the engine: cpu, cuda, cuda:1, or auto (vllm: cpu = its CPU backend).")] = (
        "auto"
    )
    group_size: Annotated[int, doc("Responses sampled per prompt (the G of GRPO).", ge=1)] = 8
    prompts_per_batch: Annotated[
        int,
        doc(
            "Most prompts asked for in one lease request (the loop leases again as "
            "groups finish, up to `max_inflight`).",
            ge=1,
        ),
    ] = 8
    max_inflight: Annotated[
        int | None,
        doc(
            "Most prompts (groups) generating at once on this server; null = the broker's admission window, "
            "learner.groups_per_step x sync.interval x (broker.max_staleness + 1). Lower it to bound memory; "
            "with `hf` more in flight means more rows decoded together (bounded by rollout.hf.max_rows)."
        ),
    ] = None
    inflight_update: Annotated[
        Literal["keep", "recompute", "finish"],
        doc(
            "What a weight update does to requests in flight: `keep` their KV cache and go on with the new weights "
            "(fastest; the tokens before the update keep their older version), `recompute` their KV cache with the "
            "new weights, or let them `finish` on the old weights first (new requests wait)."
        ),
    ] = "keep"
    temperature: Annotated[float, doc("Sampling temperature; 1.0 keeps behaviour log-probs on-policy.", ge=0)] = 1.0
    top_p: Annotated[float, doc("Nucleus sampling mass (1.0 = off).", gt=0, le=1)] = 1.0
    top_k: Annotated[int, doc("Top-k sampling (0 = off).", ge=0)] = 0
    max_new_tokens: Annotated[
        int, doc("Longest response generated; longer ones finish with reason `length`.", ge=1)
    ] = 256
    stop: Annotated[list[str], doc("Strings that end a response (kept out of the reward text).")] = field(
        default_factory=list
    )
    stop_token_ids: Annotated[list[int], doc("Token ids that end a response, besides the tokenizer's eos.")] = field(
        default_factory=list
    )
    rewards: Annotated[
        list[RewardSpec], doc("Reward functions and weights; the sample's reward is the weighted sum.")
    ] = field(default_factory=lambda: [RewardSpec(name="math")])
    reward_timeout_s: Annotated[
        float, doc("Time limit of one user reward call; slower samples count as failed.", gt=0)
    ] = 10.0
    reward_workers: Annotated[
        int, doc("Threads that score rewards while the engine generates the next batch.", ge=1)
    ] = 4
    on_reward_failure: Annotated[
        Literal["zero", "drop_group"], doc("A failed reward gives reward 0, or drops its whole group.")
    ] = "zero"
    reward_stop_after: Annotated[
        int,
        doc(
            "Stop the rollout server (exit code 4; `fleetrl run` then stops the job) once this many samples in a row got "
            "no usable reward (every reward failed or returned None), at the start of a run or later; 0 = never stop.",
            ge=0,
        ),
    ] = 32
    seed: Annotated[int, doc("Base sampling seed; server i uses seed + i.")] = 0
    stay_after_done: Annotated[
        bool,
        doc(
            "Keep this server up when the learner finishes or the broker shuts down (it waits for the next learner); "
            "false: it returns its prompts, leaves the fleet and exits 0."
        ),
    ] = False
    vllm: Annotated[VllmConfig, doc("vLLM engine settings (engine: vllm).")] = field(default_factory=VllmConfig)
    hf: Annotated[HfConfig, doc("`hf` engine settings (engine: hf).")] = field(default_factory=HfConfig)
    env: Annotated[
        EnvConfig, doc("How a sample is produced: single_turn, tool, user, http or openai (docs/environments.md).")
    ] = field(default_factory=EnvConfig)
    openai: Annotated[
        OpenAIConfig, doc("The OpenAI-compatible endpoint of each rollout server (docs/environments.md).")
    ] = field(default_factory=OpenAIConfig)

    def __post_init__(self) -> None:
        for key, value in (
            ("rollout.max_inflight", self.max_inflight),
            ("rollout.vllm.max_num_seqs", self.vllm.max_num_seqs),
            ("rollout.hf.max_rows", self.hf.max_rows),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{key}={value} must be >= 1 (or null for the default)")
        if not 0 <= self.hf.admission_wait_ms <= 60_000:
            raise ValueError(
                f"rollout.hf.admission_wait_ms={self.hf.admission_wait_ms} must be between 0 (no window) and 60000"
            )
        if self.env.type == "openai" and not self.openai.enabled:
            raise ValueError(
                "rollout.env.type is `openai` (samples come from agents through the endpoint) but "
                "rollout.openai.enabled is false; set rollout.openai.enabled=true"
            )


# -------------------------------------------------------------------------------------- broker


class CurveConfig(Section):
    server_secret_key: Annotated[str, doc("Broker's secret key file (`fleetrl keys generate`); must be mode 0600.")]
    server_public_key: Annotated[str, doc("Broker's public key file, given to clients.")]
    client_secret_key: Annotated[
        str | None, doc("This client's secret key file (rollout / learner / operator side); must be mode 0600.")
    ] = None
    client_public_key: Annotated[
        str | None, doc("This client's public key file (accepted, not read: the secret file holds both).")
    ] = None
    authorized_keys_dir: Annotated[
        str | None,
        doc(
            "The broker's allowlist: one subdirectory per role (rollout/, learner/, operator/) of client "
            "`<identity>.key` files. Required on the broker; an empty or missing one is refused at start-up."
        ),
    ] = None
    client_identity: Annotated[
        str | None,
        doc(
            "The identity this client's key is filed under (client ids start with it); null = the "
            "secret key file's name without `.key_secret`."
        ),
    ] = None


class BrokerConfig(Section):
    host: Annotated[str, doc("Address the broker binds; without broker.curve only a loopback address is allowed.")] = (
        "127.0.0.1"
    )
    insecure_bind: Annotated[
        bool,
        doc(
            "Allow a non-loopback broker.host without CURVE (anyone who reaches the port is trusted); logged as a "
            "warning at every start."
        ),
    ] = False
    port: Annotated[
        int, doc("ROUTER port for requests (0 = pick a free port and write it to the run dir).", ge=0, le=65535)
    ] = 5555
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
    prompt_lease_s: Annotated[
        float, doc("Seconds a rollout server holds leased prompts before they are re-issued.", gt=0)
    ] = 300.0
    batch_lease_s: Annotated[float, doc("Seconds a learner holds leased groups before they are redelivered.", gt=0)] = (
        600.0
    )
    queue_capacity: Annotated[int | None, doc("Most groups queued + in flight (null = sized by `admission`).")] = None
    admission: Annotated[
        Literal["measured", "static"],
        doc(
            "How a null queue_capacity is sized: `measured` = groups learners take per published version "
            "(dynamic sampling's filtered groups included) x (max_staleness + 1), between 1x and 8x `static`; "
            "`static` = groups_per_step x sync.interval x (max_staleness + 1)."
        ),
    ] = "measured"
    commit_on_checkpoint: Annotated[
        bool, doc("Keep consumed groups until a learner checkpoint covers them (exact resume).")
    ] = False
    spool_dir: Annotated[
        str | None, doc("Append-only on-disk log of accepted groups and leases (null = memory only).")
    ] = None
    fsync: Annotated[
        Literal["never", "interval", "always"],
        doc("When the spool fsyncs: never, every `fsync_interval_s`, or every write."),
    ] = "interval"
    fsync_interval_s: Annotated[float, doc("Seconds between spool fsyncs with fsync: interval.", gt=0)] = 1.0
    vocab_size: Annotated[int | None, doc("Reject token ids >= this (null = read from the model's config.json).")] = (
        None
    )
    heartbeat_s: Annotated[float, doc("Seconds between client heartbeats.", gt=0)] = 2.0
    client_timeout_s: Annotated[float, doc("A client silent this long is reported dead.", gt=0)] = 30.0
    request_timeout_s: Annotated[float, doc("Client-side wait for one broker reply before retrying.", gt=0)] = 30.0
    curve: Annotated[
        CurveConfig | None, doc("CURVE encryption, client keys bound to roles (null = plaintext, loopback only).")
    ] = None
    audit_log: Annotated[
        str | None,
        doc("JSONL audit of controls, publishes, commits, rewinds and refusals (null = <run dir>/audit.jsonl)."),
    ] = None
    accept_unleased: Annotated[
        bool,
        doc("Accept groups whose prompt_id the broker never leased (offline imports); they count against capacity."),
    ] = False
    max_abs_reward: Annotated[
        float, doc("Groups with a reward of larger magnitude are refused (invalid_group).", gt=0)
    ] = 1e6
    version_slack: Annotated[
        int,
        doc(
            "How far a group's or rollout's policy version may be ahead of the broker's (a future version is refused).",
            ge=0,
        ),
    ] = 0
    max_version_jump: Annotated[
        int,
        doc(
            "Most a PublishVersion may advance the broker's version by (refused beyond; unchecked until a version is known).",
            ge=1,
        ),
    ] = 1000
    max_clients: Annotated[
        int,
        doc("Client records kept; at the cap the longest-dead one is evicted, else Register gets `unavailable`.", ge=1),
    ] = 4096
    max_client_info_bytes: Annotated[
        int,
        doc(
            "Largest Register info / Heartbeat stats (keys + values, 8 bytes a number, 32 an entry); larger ones "
            "are refused.",
            ge=64,
        ),
    ] = 16384
    max_client_table_bytes: Annotated[
        int,
        doc(
            "Register info and heartbeat stats of all clients together (counted as max_client_info_bytes); "
            "beyond, a heartbeat's stats are dropped and a Register evicts monitors, else is `unavailable`.",
            ge=1 << 16,
        ),
    ] = 16 << 20
    max_groups_per_push: Annotated[
        int, doc("Most groups in one PushGroups frame (refused with `too_large` beyond).", ge=1)
    ] = 1024
    max_held_groups: Annotated[
        int | None,
        doc(
            "Most groups held in memory (queued, leased, uncommitted); pushes beyond are throttled "
            "(null = 16 x capacity, at least 10,000)."
        ),
    ] = None
    max_waiting_polls: Annotated[
        int, doc("Most LeaseBatch long polls held at once; more are answered at once.", ge=1)
    ] = 4096
    zmq_heartbeat_s: Annotated[
        float, doc("ZMTP heartbeat interval on every connection; a peer silent for 3 intervals is disconnected.", gt=0)
    ] = 5.0
    handshake_timeout_s: Annotated[
        float, doc("A connection that has not finished its ZMTP/CURVE handshake by then is closed.", gt=0)
    ] = 10.0
    idle_timeout_s: Annotated[
        float,
        doc(
            "A connection that sent no complete request for this long (and has no long poll waiting) is closed; "
            "ZeroMQ clients reconnect by themselves.",
            gt=0,
        ),
    ] = 60.0
    max_buffered_bytes: Annotated[
        int,
        doc(
            "Bytes the broker may hold in unfinished frames across all connections; the largest holders are "
            "disconnected beyond (one connection may hold 2 x max_message_bytes + 1 MiB).",
            ge=1 << 20,
        ),
    ] = 128 << 20
    max_connections: Annotated[
        int | None,
        doc("Open request connections; beyond, the idlest are closed (null = the open-files limit minus 64)."),
    ] = None
    # ---- bytes (issue 31): a count bounds nothing when one item can weigh 16 MiB
    max_group_metadata_bytes: Annotated[
        int,
        doc(
            "Largest wire size of one group's metadata, reward_parts, failed_parts, trace and per-response lists "
            "together, read before decoding (a push frame's groups: 8 x this together); larger is `too_large`.",
            ge=1024,
        ),
    ] = 1 << 20
    max_held_bytes: Annotated[
        Annotated[int, Meta(ge=1 << 20)] | None,
        doc(
            "Bytes of the groups held (queued, leased, uncommitted): arrays as they weigh, other fields 8 x "
            "their wire size; pushes beyond are throttled (null = 2 x capacity x the job's largest group, "
            "+ a checkpoint interval's groups with commit_on_checkpoint, at least 128 MiB)."
        ),
    ] = None
    max_dedupe_bytes: Annotated[
        int,
        doc(
            "Bytes of group ids remembered for de-duplication (each id + 96); the oldest are forgotten beyond "
            "(and beyond 2^20 ids).",
            ge=1 << 16,
        ),
    ] = 64 << 20
    max_status_bytes: Annotated[
        int,
        doc(
            "Largest GetStatus reply: learners and rollouts are listed first; beyond it the stats of the last "
            "clients, then monitor rows, are left out (counted in Status.clients_omitted / stats_omitted).",
            ge=1 << 16,
        ),
    ] = 8 << 20
    max_lease_bytes: Annotated[
        Annotated[int, Meta(ge=1 << 16)] | None,
        doc(
            "Largest BatchLease or PromptLease reply; a lease stops short of it, with at least one group or "
            "prompt (null = broker.max_held_bytes)."
        ),
    ] = None
    # ---- fairness per key (issue 31): one key cannot crowd out the others
    max_clients_per_key: Annotated[
        int,
        doc(
            "Client records one CURVE key may hold; at the cap its own longest-silent dead client is evicted, "
            "else its Register gets `unavailable` (other keys are not affected).",
            ge=1,
        ),
    ] = 1024
    max_monitor_clients: Annotated[
        int,
        doc(
            "Client records registered as `monitor`; beyond, the longest-silent monitor is evicted, and a "
            "fleet role's Register evicts one when the table is full.",
            ge=1,
        ),
    ] = 256
    key_requests_per_s: Annotated[
        float,
        doc(
            "Register, GetStatus and GetVersion requests one key (without CURVE: one client id) may send per "
            "second, bursts of twice that; beyond: `unavailable`, audited once per key per 10 s.",
            gt=0,
        ),
    ] = 500.0
    fair_prompt_share: Annotated[
        bool,
        doc(
            "While another key waits for prompts (throttled at capacity in the last 5 s), a CURVE key may hold "
            "at most capacity / keys leasing of the leased prompts."
        ),
    ] = True
    # ---- plausibility at ingest (issue 31): in-range poison from one rollout must not trip the breaker
    max_zero_logprob_fraction: Annotated[
        float,
        doc(
            "At rollout.temperature > 0, a group of 16+ sampled tokens of which this fraction or more have a "
            "behaviour log-prob of exactly 0.0 is refused as implausible (> 1 = off).",
            gt=0,
        ),
    ] = 0.9


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
    bucket_timeout_s: Annotated[
        float,
        doc(
            "Longest wait for one bucket (gathered, packed, sent); a receiver that misses it is dropped and the "
            "survivors re-form and carry on, so a dead one costs at most about twice this.",
            gt=0,
        ),
    ] = 20.0
    max_clock_skew_s: Annotated[
        float,
        doc("A version announced with a published_at further in the future than this is ignored by rollouts.", gt=0),
    ] = 300.0
    catchup: Annotated[
        bool,
        doc(
            "gloo/nccl: keep the last version in host memory (model size) and serve catch-up rounds to "
            "rollouts that missed a round; false = they wait for the next publish."
        ),
    ] = True
    overlap: Annotated[
        bool,
        doc(
            "gloo: announce the version, then stream it from a copy of the weights on a thread while the learner "
            "trains its next step (one round in flight); false = the learner waits for each round to finish."
        ),
    ] = True


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
        Literal["none", "console", "jsonl", "otlp"],
        doc(
            "Where trace spans go: jsonl writes <run dir>/traces/<service>-<pid>.jsonl (read them with `fleetrl trace`), "
            "otlp posts to otlp_endpoint; none costs nothing."
        ),
    ] = "none"
    otlp_endpoint: Annotated[str, doc("OTLP/HTTP collector endpoint for exporter: otlp (/v1/traces is appended).")] = (
        "http://127.0.0.1:4318"
    )
    prometheus_port: Annotated[
        int | None, doc("Serve the learner's metrics for Prometheus on this port at /metrics (null = off).")
    ] = None
    prometheus_host: Annotated[
        str, doc("Address the Prometheus endpoint binds; 0.0.0.0 exposes it to the network.")
    ] = "127.0.0.1"
    tensorboard: Annotated[bool, doc("Also write TensorBoard event files (needs the tracking extra).")] = False
    wandb_project: Annotated[
        str | None,
        doc("Also log to this wandb project (needs the tracking extra); null = WANDB_PROJECT if set, else no wandb."),
    ] = None
    wandb_mode: Annotated[
        Literal["online", "offline", "disabled"] | None,
        doc(
            "wandb mode; null = WANDB_MODE if set, else offline (writes <run dir>/wandb; upload later with `wandb sync`)."
        ),
    ] = None
    wandb_entity: Annotated[str | None, doc("wandb entity (team or user); null = WANDB_ENTITY or your default.")] = None
    wandb_group: Annotated[str | None, doc("wandb run group; null = WANDB_RUN_GROUP if set.")] = None
    wandb_tags: Annotated[list[str] | None, doc("wandb run tags; null = WANDB_TAGS if set.")] = None
    wandb_name: Annotated[
        str | None, doc("wandb run name; null = WANDB_NAME if set, else the run directory's name.")
    ] = None
    log_completions_every: Annotated[
        int,
        doc(
            "Every this many steps, log a few prompts with their responses, rewards, advantages and policy version to "
            "<run dir>/completions.jsonl, a wandb Table and TensorBoard text (0 = off).",
            ge=0,
        ),
    ] = 20
    log_completions_prompts: Annotated[int, doc("Prompts (each with all its responses) per completions log.", ge=1)] = 2
    log_level: Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"], doc("Logging level of every process.")] = "INFO"


# ----------------------------------------------------------------------------------------- run


class RunConfig(Section):
    name: Annotated[str, doc("Run name; the run directory is <root>/<name>-<timestamp>.")] = "fleetrl"
    root: Annotated[str, doc("Parent directory of run directories.")] = "runs"
    dir: Annotated[str | None, doc("Exact run directory (null = derived from root, name and time).")] = None
    ready_timeout_s: Annotated[float, doc("How long `fleetrl run` waits for each process to report ready.", gt=0)] = (
        300.0
    )
    restart_policy: Annotated[Literal["never", "on-failure"], doc("Restart children that die (`fleetrl run`).")] = (
        "never"
    )
    max_restarts: Annotated[int, doc("Restarts per child before the job fails.", ge=0)] = 3
    learner_threads: Annotated[
        int | None,
        doc("Torch threads per learner rank `fleetrl run` sets (null = an even split: cores / (ranks + servers))."),
    ] = None
    rollout_threads: Annotated[
        int | None,
        doc("Torch threads per rollout server `fleetrl run` sets (null = an even split: cores / (ranks + servers))."),
    ] = None
    eval_interval: Annotated[int, doc("Evaluate on data.eval every this many steps (0 = off).", ge=0)] = 0
    eval_n: Annotated[int, doc("Held-out items per periodic evaluation.", ge=1)] = 500
    eval_success: Annotated[
        float | None,
        doc(
            "Reward at or above which an evaluated response counts as correct (null = 1.0 when every reward is `exact` "
            "or `math`, which give 1.0 to a right answer; set it for other rewards)."
        ),
    ] = None
    stop_timeout_s: Annotated[
        float,
        doc(
            "Longest `fleetrl run` takes to stop after Ctrl-C or the end of training: the learner checkpoints first, "
            "then the rollouts and the broker exit; whatever is left after this is killed.",
            gt=0,
        ),
    ] = 180.0
    file_access: Annotated[
        Literal["owner", "group", "all"],
        doc(
            "Who may read what the job's processes write (umask 077 / 027 / 022): `owner` only, the `group` too (share "
            "checkpoints, logs, metrics and TensorBoard files on a cluster), or `all`. Keys, the broker spool and weight "
            "versions stay owner-only (0600 / 0700) whatever this says."
        ),
    ] = "owner"
    python_path: Annotated[
        list[str],
        doc(
            "Folders added at the end of sys.path, where user code named `pkg.module:function` is looked for (relative "
            "ones from the working directory); the config a run saves adds the working directory when such code was "
            "found there, so `--resume` from another directory imports the same code."
        ),
    ] = field(default_factory=list)


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
    algorithm: Annotated[
        AlgorithmConfig, doc("The objective: `type: rl` (advantages, clipped losses, KL, critic) or `type: dpo`.")
    ] = field(default_factory=RlAlgorithm)
    sync: Annotated[SyncConfig, doc("Weight sync from learner to rollouts.")] = field(default_factory=SyncConfig)
    checkpoint: Annotated[CheckpointConfig, doc("Checkpoints and resume.")] = field(default_factory=CheckpointConfig)
    telemetry: Annotated[TelemetryConfig, doc("Traces, metric sinks and logging.")] = field(
        default_factory=TelemetryConfig
    )
    health: Annotated[HealthConfig, doc("Health monitor and circuit breaker.")] = field(default_factory=HealthConfig)
    run: Annotated[RunConfig, doc("The `fleetrl run` launcher.")] = field(default_factory=RunConfig)
    cluster: Annotated[ClusterConfig, doc("Placement across machines by `fleetrl launch slurm|ray|k8s`.")] = field(
        default_factory=ClusterConfig
    )

    def __post_init__(self) -> None:
        alg = self.algorithm
        if isinstance(alg, RlAlgorithm) and self.broker.max_staleness > 0 and alg.off_policy.mode == "none":
            # Validated here too (not only in the learner) so that every process refuses the job.
            raise ValueError(
                f"broker.max_staleness={self.broker.max_staleness} trains on samples from older policies, but "
                "algorithm.off_policy.mode is `none`; set algorithm.off_policy.mode=tis (or decoupled), "
                "or broker.max_staleness=0 for a synchronous job"
            )
        if self.data.preference and not isinstance(alg, DpoAlgorithm):
            raise ValueError(
                f"data.preference={self.data.preference!r} is read only by offline DPO; set "
                "algorithm.type=dpo, or data.preference=null for an RL job"
            )
        if isinstance(alg, DpoAlgorithm) and not self.data.preference and self.rollout.group_size < 2:
            raise ValueError(
                f"online DPO pairs the best and worst response of each group, but rollout.group_size="
                f"{self.rollout.group_size}; set rollout.group_size >= 2 (or data.preference for offline DPO)"
            )
        if self.model.lora is not None and self.learner.zero_stage == 3:
            raise ValueError(
                "model.lora with learner.zero_stage=3 is not supported (merging partitioned base weights "
                "for weight sync); use learner.zero_stage=2, which shards the adapters' optimizer state"
            )

    @property
    def needs_fleet(self) -> bool:
        """Whether the job needs a broker and rollout servers: every job but offline DPO (``data.preference``)."""
        return not (isinstance(self.algorithm, DpoAlgorithm) and self.data.preference)
