"""The ``cluster:`` section: where `fleetrl launch slurm|ray|k8s` places a job's processes.

It says how many nodes (and GPUs per node) each role gets, the scheduler's partition, account and time
limit, an optional container image and the fixed base port the job's sockets use:

    broker requests = base_port, broker announcements = base_port + 1,
    learner rendezvous (MASTER_PORT) = base_port + 2, weight-sync TCPStore = base_port + 3.

``check_placement`` refuses a section that cannot be placed (more ranks than nodes x GPUs per node, a
port in the ephemeral range, ...) naming the key; every launcher calls it before rendering anything,
so `--dry-run` refuses too. `fleetrl run` ignores this section.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from msgspec import field

from fleetrl.common.config.base import Section, doc

PORTS_USED = 4  # base_port .. base_port + 3
EPHEMERAL_DEFAULT = (32768, 60999)  # Linux's default ip_local_port_range
GiB = Annotated[int, doc("GiB", ge=1)]


class LearnerNodes(Section):
    nodes: Annotated[int, doc("Nodes the learner ranks run on (torchrun across them).", ge=1)] = 1
    gpus_per_node: Annotated[int, doc("GPUs per learner node: one rank per GPU (0 = CPU ranks).", ge=0)] = 0
    ranks_per_node: Annotated[int, doc("Learner ranks per node when gpus_per_node is 0 (CPU ranks).", ge=1)] = 1
    cpus_per_rank: Annotated[int, doc("CPU cores reserved for each learner rank.", ge=1)] = 1
    mem_gb_per_rank: Annotated[
        GiB | None,
        doc(
            "Host memory (GiB) for each learner rank: Slurm --mem and the k8s memory request (null = no "
            "--mem, the partition's default; k8s requests 16)."
        ),
    ] = None


class RolloutNodes(Section):
    nodes: Annotated[int, doc("Nodes of rollout servers (more join later with `--add-rollout`).", ge=0)] = 1
    gpus_per_node: Annotated[int, doc("GPUs per rollout node (0 = CPU servers).", ge=0)] = 0
    servers_per_node: Annotated[
        int | None, doc("Rollout servers per node (null = one per GPU or tensor-parallel group; 1 on CPU).")
    ] = None
    cpus_per_server: Annotated[int, doc("CPU cores reserved for each rollout server.", ge=0)] = 1
    mem_gb_per_server: Annotated[
        GiB | None,
        doc(
            "Host memory (GiB) for each rollout server: Slurm --mem and the k8s memory request (null = "
            "no --mem, the partition's default; k8s requests 16)."
        ),
    ] = None
    max_restarts: Annotated[
        int, doc("Restarts of one crashed rollout server by its node's supervisor before it is given up.", ge=0)
    ] = 3


class SlurmConfig(Section):
    signal_s: Annotated[
        int, doc("Seconds before the time limit Slurm sends SIGUSR1 (checkpoint, then a clean exit).", ge=0)
    ] = 300
    requeue: Annotated[bool, doc("After the walltime checkpoint, requeue the job; it resumes from the checkpoint.")] = (
        True
    )
    exclusive: Annotated[bool, doc("Ask for whole nodes (`--exclusive`).")] = True
    broker_own_node: Annotated[
        bool, doc("Give the broker a node of its own (first in the allocation) instead of a task on learner node 0.")
    ] = False
    extra_args: Annotated[list[str], doc("More `#SBATCH` options, verbatim, e.g. [--qos=high, --constraint=h100].")] = (
        field(default_factory=list)
    )


class RayConfig(Section):
    address: Annotated[
        str | None, doc("Ray cluster to join: `auto`, ray://host:10001 or host:6379 (null = start a local one).")
    ] = None
    namespace: Annotated[str, doc("Ray namespace of the job's named actors.")] = "fleetrl"
    num_cpus: Annotated[
        int | None, doc("Logical CPUs of a local cluster the launcher starts (null = this machine's cores).")
    ] = None


class K8sConfig(Section):
    namespace: Annotated[str, doc("Kubernetes namespace of every rendered object.")] = "default"
    pvc: Annotated[str | None, doc("Existing PersistentVolumeClaim for the run directory (null = render one).")] = None
    storage: Annotated[str, doc("Size of the rendered run-directory claim (ReadWriteMany).")] = "100Gi"
    storage_class: Annotated[str | None, doc("StorageClass of that claim (null = the cluster's default).")] = None
    mount_path: Annotated[str, doc("Where the run-directory volume is mounted in every pod.")] = "/fleetrl"
    curve_secret: Annotated[
        str | None, doc("Secret holding the CURVE key files (`fleetrl keys generate`), mounted at /fleetrl-keys.")
    ] = None
    image_pull_policy: Annotated[Literal["Always", "IfNotPresent", "Never"], doc("Pull policy of the image.")] = (
        "IfNotPresent"
    )


class ClusterConfig(Section):
    learner: Annotated[LearnerNodes, doc("Nodes and GPUs of the learner ranks.")] = field(default_factory=LearnerNodes)
    rollout: Annotated[RolloutNodes, doc("Nodes and GPUs of the rollout servers.")] = field(
        default_factory=RolloutNodes
    )
    share_nodes: Annotated[
        bool, doc("Put every role on the same nodes (one-node jobs, CPU tests); else roles get nodes of their own.")
    ] = False
    partition: Annotated[str | None, doc("Slurm partition (null = the cluster's default).")] = None
    account: Annotated[str | None, doc("Slurm account charged for the job.")] = None
    time_limit: Annotated[str | int, doc("Wall-clock limit: minutes, or HH:MM:SS, or D-HH:MM:SS.")] = "04:00:00"
    image: Annotated[
        str | None, doc("Container image: the pods' image on Kubernetes, `srun --container-image` on Slurm (pyxis).")
    ] = None
    base_port: Annotated[
        int,
        doc(
            "First of the 4 fixed ports (broker, announcements, learner rendezvous, weight-sync store).", ge=1, le=65532
        ),
    ] = 29500
    interface: Annotated[
        str | None, doc("Network interface for NCCL/gloo (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME); null = auto.")
    ] = None
    run_dir: Annotated[
        str | None, doc("Run directory on storage every node mounts (null = run.dir, else run.root/run.name).")
    ] = None
    python: Annotated[str | None, doc("Python on the nodes (null = the one running `fleetrl launch`).")] = None
    broker_wait_s: Annotated[
        float, doc("How long a rollout or learner waits for the broker's port before failing with the address.", gt=0)
    ] = 120.0
    slurm: Annotated[SlurmConfig, doc("Slurm-only settings.")] = field(default_factory=SlurmConfig)
    ray: Annotated[RayConfig, doc("Ray-only settings.")] = field(default_factory=RayConfig)
    k8s: Annotated[K8sConfig, doc("Kubernetes-only settings.")] = field(default_factory=K8sConfig)


# ----------------------------------------------------------------------------------- checks

_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def time_limit_s(text: str | int) -> int:
    """Slurm's time formats in seconds: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``."""
    m = _TIME.match(str(text).strip())
    if not m:
        raise ValueError(f"cluster.time_limit={text!r} is not a Slurm time; write MM, HH:MM:SS or D-HH:MM:SS")
    days, a, b, c = (int(x) if x else None for x in m.groups())
    a = a or 0  # the pattern always captures the first number
    if days is not None:  # D-HH[:MM[:SS]]
        return days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    if c is not None:
        return a * 3600 + (b or 0) * 60 + c
    return a * 60 + (b or 0)


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """This machine's ephemeral port range (the nodes usually share it), else Linux's default."""
    try:
        low, high = (int(x) for x in Path(path).read_text().split())
        return low, high
    except (OSError, ValueError):
        return EPHEMERAL_DEFAULT


def rollout_gpus_per_server(cfg) -> int:
    """GPUs one rollout server takes: its vLLM tensor-parallel group, 1 for hf on a GPU node, 0 on CPU."""
    if cfg.cluster.rollout.gpus_per_node == 0:
        return 0
    return cfg.rollout.vllm.tensor_parallel_size if cfg.rollout.engine == "vllm" else 1


def servers_per_node(cfg) -> int:
    r = cfg.cluster.rollout
    if r.servers_per_node is not None:
        return r.servers_per_node
    per = rollout_gpus_per_server(cfg)
    return r.gpus_per_node // per if per else 1


def learner_ranks_per_node(cfg) -> int:
    c = cfg.cluster.learner
    return c.gpus_per_node or c.ranks_per_node


def placement_errors(cfg, ephemeral: tuple[int, int] | None = None) -> list[str]:
    """Why this job's ``cluster:`` section cannot be placed, one message per problem (empty = it can)."""
    c, errors = cfg.cluster, []
    low, high = ephemeral or ephemeral_range()
    last = c.base_port + PORTS_USED - 1
    if c.base_port < 1024:
        errors.append(
            f"cluster.base_port={c.base_port}: ports below 1024 need root on every node; use 1024..{low - PORTS_USED}"
        )
    elif last >= low and c.base_port <= high:
        errors.append(
            f"cluster.base_port={c.base_port}: ports {c.base_port}..{last} overlap the ephemeral range "
            f"{low}-{high}, where the OS picks client ports (a bind can collide); choose cluster.base_port "
            f"between 1024 and {low - PORTS_USED}"
        )
    capacity = c.learner.nodes * learner_ranks_per_node(cfg)
    if cfg.learner.num_ranks != capacity:
        unit = "GPUs" if c.learner.gpus_per_node else "CPU ranks"
        per = (
            f"cluster.learner.gpus_per_node={c.learner.gpus_per_node}"
            if c.learner.gpus_per_node
            else f"cluster.learner.ranks_per_node={c.learner.ranks_per_node}"
        )
        errors.append(
            f"learner.num_ranks={cfg.learner.num_ranks} but cluster.learner.nodes={c.learner.nodes} x {per} "
            f"gives {capacity} {unit}; make learner.num_ranks equal cluster.learner.nodes x {per.split('=')[0]}"
        )
    if cfg.learner.device == "cuda" and not c.learner.gpus_per_node:
        errors.append("learner.device=cuda but cluster.learner.gpus_per_node=0; give the learner nodes GPUs")
    errors += _rollout_errors(cfg)
    try:
        limit = time_limit_s(c.time_limit)
        if c.slurm.signal_s >= limit:
            errors.append(
                f"cluster.slurm.signal_s={c.slurm.signal_s} is not shorter than cluster.time_limit="
                f"{c.time_limit} ({limit} s); the checkpoint signal would come before the job starts"
            )
    except ValueError as e:
        errors.append(str(e))
    return errors


def _rollout_errors(cfg) -> list[str]:
    r, errors = cfg.cluster.rollout, []
    per = rollout_gpus_per_server(cfg)
    if cfg.rollout.engine == "vllm" and r.gpus_per_node == 0 and r.nodes > 0:
        errors.append(
            "rollout.engine=vllm needs GPUs but cluster.rollout.gpus_per_node=0; set it (or rollout.engine=hf)"
        )
    elif per > r.gpus_per_node:
        errors.append(
            f"rollout.vllm.tensor_parallel_size={per} needs more GPUs than cluster.rollout.gpus_per_node="
            f"{r.gpus_per_node}; lower the tensor-parallel size or use bigger nodes"
        )
    elif per and servers_per_node(cfg) * per > r.gpus_per_node:
        errors.append(
            f"cluster.rollout.servers_per_node={servers_per_node(cfg)} x {per} GPU(s) each is more than "
            f"cluster.rollout.gpus_per_node={r.gpus_per_node}; lower servers_per_node or set it to null"
        )
    if r.servers_per_node is not None and r.servers_per_node < 1:
        errors.append(f"cluster.rollout.servers_per_node={r.servers_per_node}: must be >= 1 (or null)")
    if r.nodes == 0 and cfg.needs_fleet:
        errors.append(
            "cluster.rollout.nodes=0 leaves an RL job without rollout servers; set cluster.rollout.nodes >= 1"
        )
    return errors


def check_placement(cfg) -> None:
    """Raise ConfigError listing every reason the ``cluster:`` section cannot be placed."""
    errors = placement_errors(cfg)
    if errors:
        from fleetrl.common.config.base import ConfigError

        raise ConfigError("the cluster: section cannot be placed:\n  - " + "\n  - ".join(errors))
