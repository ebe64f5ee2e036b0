"""The world map: one pure function from a launcher's environment to what one process needs.

    world = world_map(os.environ, "rollout", Layout.from_config(cfg, run_dir))
    world.overrides()   # broker.address=tcp://n1:29500, sync.master_addr=n2, ... for the role's commands
    world.env()         # MASTER_ADDR/PORT, WORLD_SIZE, GLOO_SOCKET_IFNAME, ...

Inputs, by source (``world.source``):

- ``slurm``: ``SLURM_JOB_NODELIST`` (or the het-job ``SLURM_JOB_NODELIST_HET_GROUP_<i>`` lists, joined in
  group order), ``SLURM_PROCID`` (the task's index in its step: one task per node, so the node's index
  within its role), ``SLURM_LOCALID``. The allocation's nodes are split in a fixed order: [broker node
  when ``cluster.slurm.broker_own_node``], learner nodes, rollout nodes (or all roles on the same nodes
  with ``cluster.share_nodes``). The broker runs on the first node, the learner rendezvous on the first
  learner node.
- ``torchrun``: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``GROUP_RANK``.
- ``k8s``: ``FLEETRL_K8S_NAME`` (the rendered objects' name prefix), ``POD_NAMESPACE``, ``POD_NAME`` and,
  for the learner's indexed Job, ``JOB_COMPLETION_INDEX``; addresses are the Services' DNS names.
- ``ray``: an actor context mapping (rank, world_size, node_ip, master_addr, master_port, broker_address)
  that the Ray launcher builds from what the broker and rank-0 actors reported.
- ``local``: none of the above: everything on 127.0.0.1.

``FLEETRL_BROKER_ADDRESS``, ``FLEETRL_SYNC_ADDR`` and ``FLEETRL_ROLLOUT_OFFSET`` / ``FLEETRL_ROLLOUT_SERVERS``
override the derived values (an `--add-rollout` job joins a fleet it did not start).

Ports are fixed (``cluster.base_port`` + 0 broker, + 1 announcements, + 2 rendezvous, + 3 weight store)
so every process computes every address without asking anyone; only Ray, whose actors share machines
with other jobs, binds free ports and passes them in the actor context.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ROLES = ("broker", "rollout", "learner")


class WorldError(ValueError):
    """The environment does not describe a place for this process; the message says what is missing."""


# ------------------------------------------------------------------------------------ hostlists


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed node list -> names: ``"gpu[01-03,7],cpu1"`` -> gpu01 gpu02 gpu03 gpu7 cpu1."""
    names: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", text.strip()):
        names.extend(_expand_one(item))
    return names


def _expand_one(item: str) -> list[str]:
    m = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", item)
    if not m:
        return [item]
    prefix, ranges, rest = m.groups()
    out = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise WorldError(f"cannot read the node list entry {item!r} (range {part!r})")
        for n in range(int(lo), int(hi or lo) + 1):
            out.extend(f"{prefix}{n:0{len(lo)}d}{tail}" for tail in _expand_one(rest))
    return out


# --------------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    """The ``cluster:`` section reduced to what the world map needs (pure data)."""

    base_port: int = 29500
    learner_nodes: int = 1
    ranks_per_node: int = 1
    learner_gpus_per_node: int = 0
    rollout_nodes: int = 1
    servers_per_node: int = 1
    gpus_per_server: int = 0
    share_nodes: bool = False
    broker_own_node: bool = False
    interface: str | None = None
    run_dir: str = "runs/fleetrl"
    name: str = "fleetrl"
    namespace: str = "default"

    @classmethod
    def from_config(cls, cfg: Any, run_dir: str) -> Layout:
        from fleetrl.common.config.cluster import learner_ranks_per_node, rollout_gpus_per_server, servers_per_node

        c = cfg.cluster
        return cls(
            base_port=c.base_port,
            learner_nodes=c.learner.nodes,
            ranks_per_node=learner_ranks_per_node(cfg),
            learner_gpus_per_node=c.learner.gpus_per_node,
            rollout_nodes=c.rollout.nodes,
            servers_per_node=servers_per_node(cfg),
            gpus_per_server=rollout_gpus_per_server(cfg),
            share_nodes=c.share_nodes,
            broker_own_node=c.slurm.broker_own_node,
            interface=c.interface,
            run_dir=str(run_dir),
            name=k8s_name(cfg.run.name),
            namespace=c.k8s.namespace,
        )

    @property
    def world_size(self) -> int:
        return self.learner_nodes * self.ranks_per_node

    @property
    def num_servers(self) -> int:
        return self.rollout_nodes * self.servers_per_node

    def nodes_needed(self) -> int:
        own = int(self.broker_own_node)
        if self.share_nodes:
            return own + max(self.learner_nodes, self.rollout_nodes)
        return own + self.learner_nodes + self.rollout_nodes

    def split(self, nodes: list[str]) -> dict[str, list[str]]:
        """The allocation's nodes by role, in the fixed order the sbatch script asked for them."""
        if len(nodes) < self.nodes_needed():
            raise WorldError(
                f"the allocation has {len(nodes)} node(s) ({','.join(nodes)}) but the layout needs "
                f"{self.nodes_needed()}; submit with `fleetrl launch slurm`, which asks for them"
            )
        off = int(self.broker_own_node)
        learner = nodes[off : off + self.learner_nodes]
        rollout = (
            nodes[off : off + self.rollout_nodes]
            if self.share_nodes
            else nodes[off + self.learner_nodes : off + self.learner_nodes + self.rollout_nodes]
        )
        return {"broker": nodes[:1], "learner": learner, "rollout": rollout}


def k8s_name(run_name: str) -> str:
    """A DNS-1035 label from the run name (lower case, digits, '-', starts with a letter, <= 40 chars)."""
    name = re.sub(r"[^a-z0-9-]+", "-", run_name.lower()).strip("-")
    name = name if name and name[0].isalpha() else f"fleetrl-{name}".rstrip("-")
    return name[:40].rstrip("-")


# ---------------------------------------------------------------------------------------- world


@dataclass(frozen=True)
class World:
    """Where one process sits and every address it needs."""

    source: str  # slurm | torchrun | k8s | ray | local
    role: str  # broker | rollout | learner
    role_rank: int  # this node's index within its role (Ray, torchrun: the process's rank)
    host: str  # this node
    broker_address: str  # where clients send requests
    broker_pub_address: str  # where announcements come from
    broker_port: int  # what the broker binds (0 = a free port)
    broker_pub_port: int
    master_addr: str  # learner rendezvous (MASTER_ADDR / MASTER_PORT)
    master_port: int
    node_rank: int  # learner node rank (torchrun --node-rank)
    nnodes: int
    nproc_per_node: int
    world_size: int
    rank: int | None  # the process's learner rank, when one process stands for it
    local_rank: int | None
    sync_addr: str  # weight-sync TCPStore (learner rank 0)
    sync_port: int
    interface: str | None
    run_dir: str
    rollout_indices: tuple[int, ...] = ()  # rollout servers this node runs (global indices)
    rollout_gpus: tuple[str, ...] = ()  # CUDA_VISIBLE_DEVICES of each ("" = CPU)
    extra: dict[str, str] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        """Environment for the role's processes (torch.distributed rendezvous, socket interface, run dir)."""
        env = {
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "WORLD_SIZE": str(self.world_size),
            "FLEETRL_RUN_DIR": self.run_dir,
            "FLEETRL_BROKER_ADDRESS": self.broker_address,
        }
        if self.rank is not None:
            env["RANK"] = str(self.rank)
            env["LOCAL_RANK"] = str(self.local_rank or 0)
        if self.interface:
            env["NCCL_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = self.interface
        return {**env, **self.extra}

    def overrides(self) -> list[str]:
        """Config overrides that put the role's processes at these addresses."""
        common = [
            f"broker.address={self.broker_address}",
            f"sync.master_addr={self.sync_addr}",
            f"sync.master_port={self.sync_port}",
        ]
        if self.role == "broker":
            # Other nodes must reach it. Without broker.curve that is a plaintext bind, which the broker refuses
            # unless told explicitly (and then warns at every start): say so here; with CURVE it is ignored.
            return [
                "broker.host=0.0.0.0",
                "broker.insecure_bind=true",
                f"broker.port={self.broker_port}",
                f"broker.pub_port={self.broker_pub_port}",
                *common,
            ]
        return common


def world_map(env: Mapping[str, str], role: str, layout: Layout, ray: Mapping[str, Any] | None = None) -> World:
    """Turn a launcher's environment into this process's :class:`World` (see the module docstring)."""
    if role not in ROLES:
        raise WorldError(f"unknown role {role!r}; valid roles: {', '.join(ROLES)}")
    if ray is not None:
        return _from_ray(ray, role, layout, env)
    if env.get("SLURM_JOB_ID"):
        return _from_slurm(env, role, layout)
    if env.get("FLEETRL_K8S_NAME"):
        return _from_k8s(env, role, layout)
    if env.get("MASTER_ADDR") and env.get("RANK") is not None and role == "learner":
        return _from_torchrun(env, layout)
    return _from_local(env, role, layout)


def _rollout_slots(env: Mapping[str, str], layout: Layout, node_index: int, learner_node: bool) -> dict[str, Any]:
    """The rollout servers of the ``node_index``-th rollout node: global indices and GPU slices."""
    offset = int(env.get("FLEETRL_ROLLOUT_OFFSET", 0))
    total = int(env.get("FLEETRL_ROLLOUT_SERVERS", layout.num_servers))
    first = node_index * layout.servers_per_node
    count = max(0, min(layout.servers_per_node, total - first))
    start = layout.learner_gpus_per_node if (layout.share_nodes and learner_node) else 0
    g = layout.gpus_per_server
    gpus = tuple(",".join(str(start + j * g + k) for k in range(g)) for j in range(count))
    return {"rollout_indices": tuple(offset + first + j for j in range(count)), "rollout_gpus": gpus}


def _common(env: Mapping[str, str], layout: Layout, broker_host: str, learner0: str) -> dict[str, Any]:
    p = layout.base_port
    address = env.get("FLEETRL_BROKER_ADDRESS") or f"tcp://{broker_host}:{p}"
    pub = f"{address.rsplit(':', 1)[0]}:{p + 1}" if not env.get("FLEETRL_BROKER_ADDRESS") else ""
    sync_addr, _, sync_port = (env.get("FLEETRL_SYNC_ADDR") or f"{learner0}:{p + 3}").rpartition(":")
    return dict(
        broker_address=address,
        broker_pub_address=pub,
        broker_port=p,
        broker_pub_port=p + 1,
        master_addr=learner0,
        master_port=p + 2,
        nnodes=layout.learner_nodes,
        nproc_per_node=layout.ranks_per_node,
        world_size=layout.world_size,
        sync_addr=sync_addr,
        sync_port=int(sync_port),
        interface=layout.interface,
        run_dir=env.get("FLEETRL_RUN_DIR", layout.run_dir),
    )


def _from_slurm(env: Mapping[str, str], role: str, layout: Layout) -> World:
    het = sorted(
        (int(k.rsplit("_", 1)[1]), v) for k, v in env.items() if re.fullmatch(r"SLURM_JOB_NODELIST_HET_GROUP_\d+", k)
    )
    lists = [v for _, v in het] or [env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""]
    nodes = [n for text in lists for n in expand_hostlist(text)]
    if not nodes:
        raise WorldError("SLURM_JOB_ID is set but SLURM_JOB_NODELIST is empty; run inside an allocation (srun/sbatch)")
    if "SLURM_PROCID" not in env:
        raise WorldError("SLURM_PROCID is not set: start the supervisor with srun, one task per node")
    procid = int(env["SLURM_PROCID"])
    add_job = bool(env.get("FLEETRL_BROKER_ADDRESS")) and role == "rollout"
    roles = {"broker": nodes[:1], "learner": nodes[:1], "rollout": nodes} if add_job else layout.split(nodes)
    mine = roles[role]
    if procid >= len(mine):
        raise WorldError(
            f"SLURM_PROCID={procid} but the {role} role has {len(mine)} node(s) ({','.join(mine)}); "
            "start one task per node of the role"
        )
    host = env.get("SLURMD_NODENAME") or mine[procid]
    base = _common(env, layout, roles["broker"][0], roles["learner"][0])
    slots = _rollout_slots(env, layout, procid, host in roles["learner"]) if role == "rollout" else {}
    single = layout.ranks_per_node == 1
    return World(
        source="slurm",
        role=role,
        role_rank=procid,
        host=host,
        node_rank=procid if role == "learner" else 0,
        rank=procid if role == "learner" and single else None,
        local_rank=0 if single else None,
        **base,
        **slots,
    )


def _from_torchrun(env: Mapping[str, str], layout: Layout) -> World:
    rank = int(env["RANK"])
    base = _common(env, layout, env.get("FLEETRL_BROKER_HOST", "127.0.0.1"), env["MASTER_ADDR"])
    base.update(
        master_port=int(env.get("MASTER_PORT", base["master_port"])),
        world_size=int(env.get("WORLD_SIZE", 1)),
        nproc_per_node=int(env.get("LOCAL_WORLD_SIZE", layout.ranks_per_node)),
    )
    return World(
        source="torchrun",
        role="learner",
        role_rank=rank,
        host=env.get("HOSTNAME", env["MASTER_ADDR"]),
        node_rank=int(env.get("GROUP_RANK", 0)),
        rank=rank,
        local_rank=int(env.get("LOCAL_RANK", 0)),
        **base,
    )


def _from_k8s(env: Mapping[str, str], role: str, layout: Layout) -> World:
    name = env["FLEETRL_K8S_NAME"]
    ns = env.get("POD_NAMESPACE", layout.namespace)
    pod = env.get("POD_NAME") or env.get("HOSTNAME", "")
    learner0 = f"{name}-learner-0.{name}-learner.{ns}.svc"
    base = _common(env, layout, f"{name}-broker.{ns}.svc", learner0)
    if role == "learner":
        if "JOB_COMPLETION_INDEX" not in env:
            raise WorldError(
                "a learner pod needs JOB_COMPLETION_INDEX (an Indexed Job); render with `fleetrl launch k8s`"
            )
        index = int(env["JOB_COMPLETION_INDEX"])
        single = layout.ranks_per_node == 1
        return World(
            source="k8s",
            role=role,
            role_rank=index,
            host=pod,
            node_rank=index,
            rank=index if single else None,
            local_rank=0 if single else None,
            **base,
        )
    slots = {}
    if role == "rollout":  # a Deployment's pods have no index: a stable one from the pod name
        index = zlib.crc32(pod.encode()) % 1_000_000
        g = layout.gpus_per_server
        slots = {
            "rollout_indices": tuple(index * 100 + j for j in range(layout.servers_per_node)),
            "rollout_gpus": tuple(",".join(str(j * g + k) for k in range(g)) for j in range(layout.servers_per_node)),
        }
    return World(
        source="k8s", role=role, role_rank=0, host=pod, node_rank=0, rank=None, local_rank=None, **base, **slots
    )


def _from_ray(ctx: Mapping[str, Any], role: str, layout: Layout, env: Mapping[str, str]) -> World:
    for key in ("node_ip", "broker_address"):
        if role != "broker" and not ctx.get(key):
            raise WorldError(f"the Ray actor context has no {key!r}; the launcher passes it (broker actor first)")
    rank = int(ctx.get("rank", 0))
    broker = ctx.get("broker_address") or ""
    master_addr = ctx.get("master_addr") or ctx.get("node_ip", "127.0.0.1")
    slots = {}
    if role == "rollout":
        slots = {"rollout_indices": (int(ctx.get("server_index", rank)),), "rollout_gpus": ("",)}
    return World(
        source="ray",
        role=role,
        role_rank=rank,
        host=ctx.get("node_ip", "127.0.0.1"),
        broker_address=broker,
        broker_pub_address="",
        broker_port=0,
        broker_pub_port=0,
        master_addr=master_addr,
        master_port=int(ctx.get("master_port", 0)),
        node_rank=0,
        nnodes=1,
        nproc_per_node=1,
        world_size=int(ctx.get("world_size", layout.world_size)),
        rank=rank if role == "learner" else None,
        local_rank=0 if role == "learner" else None,
        sync_addr=master_addr,
        sync_port=0,
        interface=layout.interface,
        run_dir=str(ctx.get("run_dir") or layout.run_dir),
        **slots,
    )


def _from_local(env: Mapping[str, str], role: str, layout: Layout) -> World:
    base = _common(env, layout, "127.0.0.1", "127.0.0.1")
    slots = {}
    if role == "rollout":
        total = int(env.get("FLEETRL_ROLLOUT_SERVERS", layout.num_servers))
        offset = int(env.get("FLEETRL_ROLLOUT_OFFSET", 0))
        slots = {"rollout_indices": tuple(range(offset, offset + total)), "rollout_gpus": ("",) * total}
    return World(
        source="local",
        role=role,
        role_rank=0,
        host="127.0.0.1",
        node_rank=0,
        rank=0 if role == "learner" and layout.world_size == 1 else None,
        local_rank=0 if role == "learner" and layout.world_size == 1 else None,
        **base,
        **slots,
    )
