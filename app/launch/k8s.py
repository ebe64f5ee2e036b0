"""`fleetrl launch k8s --config job.yaml --dry-run`: Kubernetes manifests for one job (apply with kubectl).

    fleetrl launch k8s --config job.yaml --dry-run [--out job.k8s.yaml]
    kubectl apply -f RUN/launch/k8s.yaml
    kubectl scale deployment/<name>-rollout --replicas=8      # rollout servers up or down, mid-run

Objects (``<name>`` = the run name as a DNS label):

- ConfigMap ``<name>-job``: the resolved job file, mounted at /etc/fleetrl/job.yaml in every pod;
- PersistentVolumeClaim ``<name>-run`` (ReadWriteMany; or ``cluster.k8s.pvc``, an existing claim): the run
  directory (checkpoints, weights, metrics, spool) at ``cluster.k8s.mount_path``;
- Deployment + Service ``<name>-broker``: one broker, its request and announcement ports;
- Deployment ``<name>-rollout``: one pod per rollout node (``cluster.rollout.nodes`` replicas), each running
  the per-node supervisor and its servers; scale it with ``kubectl scale``;
- Indexed Job + headless Service ``<name>-learner``: one pod per learner node, ``JOB_COMPLETION_INDEX`` is the
  node rank, pod 0 (``<name>-learner-0.<name>-learner``) the rendezvous and weight-store address;
  ``backoffLimit: 0``, so a dead learner fails the Job.

Every pod runs the same supervisor as on Slurm; the world map reads ``FLEETRL_K8S_NAME``, ``POD_NAME``,
``POD_NAMESPACE`` and ``JOB_COMPLETION_INDEX``. CURVE keys come from a Secret (``cluster.k8s.curve_secret``).
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from fleetrl.app.launch.world import Layout
from fleetrl.common.config import ConfigError, dump_yaml, load_config
from fleetrl.common.config.cluster import check_placement
from fleetrl.common.config.schema import JobConfig

CONFIG_DIR = "/etc/fleetrl"
KEYS_DIR = "/fleetrl-keys"


BROKER_MEM_GB = 2  # the broker's memory request: its queue and spool index
ROLE_MEM_GB = 16  # a learner rank's / rollout server's memory request when cluster.*.mem_gb_per_* is null


def _mem_gb(per_process: int | None, processes: int) -> int:
    return (ROLE_MEM_GB if per_process is None else per_process) * max(1, processes)


def volume_paths(run_dir: str | None, mount_path: str, name: str) -> tuple[str, str]:
    """(the run directory every pod is given, where the run volume is mounted) so that the run directory is
    on the shared volume: a relative one goes under ``mount_path``; an absolute one outside it (docs/deploy.md's
    ``cluster.run_dir: /shared/runs/grpo``) gets the volume mounted at that very path; none = mount_path/name."""
    mount = mount_path.rstrip("/") or "/"
    if not run_dir:
        return f"{mount}/{name}", mount
    path = PurePosixPath(run_dir)
    if not path.is_absolute():
        return str(PurePosixPath(mount) / path), mount
    if path == PurePosixPath(mount) or PurePosixPath(mount) in path.parents:
        return str(path), mount
    return str(path), str(path)


def _meta(name: str, ns: str, role: str, app: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": ns,
        "labels": {"app.kubernetes.io/name": "fleetrl", "fleetrl/job": app, "fleetrl/role": role},
    }


def _selector(app: str, role: str) -> dict[str, str]:
    return {"fleetrl/job": app, "fleetrl/role": role}


class Renderer:
    def __init__(self, cfg: JobConfig, run_dir: str | None = None):
        self.cfg, c = cfg, cfg.cluster
        self.layout = Layout.from_config(cfg, run_dir or "")
        self.name, self.ns = self.layout.name, c.k8s.namespace
        self.run_dir, self.run_mount = volume_paths(run_dir or c.run_dir, c.k8s.mount_path, self.name)
        if not c.image:
            raise ConfigError(
                "fleetrl launch k8s needs cluster.image: an image with fleetrl installed (and the model "
                "and data, or put them on the run-directory volume)"
            )

    def container(self, role: str, gpus: int, cpus: int, ports: dict[str, int], mem_gb: int) -> dict[str, Any]:
        c = self.cfg.cluster
        env = [
            {"name": "FLEETRL_K8S_NAME", "value": self.name},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "HF_HUB_OFFLINE", "value": "1"},
        ]
        if c.interface:
            env += [
                {"name": "NCCL_SOCKET_IFNAME", "value": c.interface},
                {"name": "GLOO_SOCKET_IFNAME", "value": c.interface},
            ]
        resources: dict[str, Any] = {"requests": {"cpu": str(max(1, cpus)), "memory": f"{mem_gb}Gi"}}
        if gpus:
            resources["limits"] = {"nvidia.com/gpu": gpus}
        mounts = [
            {"name": "job", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "run", "mountPath": self.run_mount},
            {"name": "shm", "mountPath": "/dev/shm"},
        ]
        if c.k8s.curve_secret:
            mounts.append({"name": "keys", "mountPath": KEYS_DIR, "readOnly": True})
        return {
            "name": role,
            "image": c.image,
            "imagePullPolicy": c.k8s.image_pull_policy,
            "command": [
                c.python or "python",
                "-m",
                "fleetrl.app.launch.supervisor",
                "--role",
                role,
                "--config",
                f"{CONFIG_DIR}/job.yaml",
                "--run-dir",
                self.run_dir,
            ],
            "env": env,
            "resources": resources,
            "volumeMounts": mounts,
            "ports": [{"name": n, "containerPort": p} for n, p in ports.items()],
        }

    def pod_spec(
        self, role: str, gpus: int, cpus: int, ports: dict[str, int], restart: str, mem_gb: int = BROKER_MEM_GB
    ) -> dict[str, Any]:
        c = self.cfg.cluster.k8s
        volumes = [
            {"name": "job", "configMap": {"name": f"{self.name}-job"}},
            {"name": "run", "persistentVolumeClaim": {"claimName": c.pvc or f"{self.name}-run"}},
            {"name": "shm", "emptyDir": {"medium": "Memory"}},
        ]  # NCCL and vLLM need more than the 64 MiB default
        if c.curve_secret:
            volumes.append({"name": "keys", "secret": {"secretName": c.curve_secret}})
        return {
            "restartPolicy": restart,
            "containers": [self.container(role, gpus, cpus, ports, mem_gb)],
            "volumes": volumes,
        }

    def template(self, role: str, spec: dict[str, Any]) -> dict[str, Any]:
        return {
            "metadata": {"labels": {"app.kubernetes.io/name": "fleetrl", **_selector(self.name, role)}},
            "spec": spec,
        }

    def config_map(self) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _meta(f"{self.name}-job", self.ns, "config", self.name),
            "data": {"job.yaml": dump_yaml(self.cfg)},
        }

    def pvc(self) -> list[dict[str, Any]]:
        c = self.cfg.cluster.k8s
        if c.pvc:
            return []
        spec: dict[str, Any] = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": c.storage}}}
        if c.storage_class:
            spec["storageClassName"] = c.storage_class
        return [
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": _meta(f"{self.name}-run", self.ns, "run-dir", self.name),
                "spec": spec,
            }
        ]

    def broker(self) -> list[dict[str, Any]]:
        p = self.layout.base_port
        ports = {"requests": p, "announce": p + 1}
        name = f"{self.name}-broker"
        service = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(name, self.ns, "broker", self.name),
            "spec": {
                "selector": _selector(self.name, "broker"),
                "ports": [{"name": n, "port": v, "targetPort": v} for n, v in ports.items()],
            },
        }
        deploy = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": _meta(name, self.ns, "broker", self.name),
            "spec": {
                "replicas": 1,
                "strategy": {"type": "Recreate"},
                "selector": {"matchLabels": _selector(self.name, "broker")},
                "template": self.template("broker", self.pod_spec("broker", 0, 1, ports, "Always")),
            },
        }
        return [service, deploy]

    def rollout(self) -> list[dict[str, Any]]:
        r = self.cfg.cluster.rollout
        cpus = max(1, r.cpus_per_server * self.layout.servers_per_node)
        spec = self.pod_spec(
            "rollout", r.gpus_per_node, cpus, {}, "Always", _mem_gb(r.mem_gb_per_server, self.layout.servers_per_node)
        )
        return [
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": _meta(f"{self.name}-rollout", self.ns, "rollout", self.name),
                "spec": {
                    "replicas": r.nodes,
                    "selector": {"matchLabels": _selector(self.name, "rollout")},
                    "template": self.template("rollout", spec),
                },
            }
        ]

    def learner(self) -> list[dict[str, Any]]:
        c, p = self.cfg.cluster.learner, self.layout.base_port
        name = f"{self.name}-learner"
        ports = {"rendezvous": p + 2, "weights": p + 3}
        headless = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(name, self.ns, "learner", self.name),
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": _selector(self.name, "learner"),
                "ports": [{"name": n, "port": v, "targetPort": v} for n, v in ports.items()],
            },
        }
        spec = self.pod_spec(
            "learner",
            c.gpus_per_node,
            c.cpus_per_rank * self.layout.ranks_per_node,
            ports,
            "Never",
            _mem_gb(c.mem_gb_per_rank, self.layout.ranks_per_node),
        )
        spec["subdomain"] = name
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": _meta(name, self.ns, "learner", self.name),
            "spec": {
                "completionMode": "Indexed",
                "completions": c.nodes,
                "parallelism": c.nodes,
                "backoffLimit": 0,
                "template": self.template("learner", spec),
            },
        }
        return [headless, job]

    def objects(self) -> list[dict[str, Any]]:
        objs = [self.config_map(), *self.pvc()]
        if self.cfg.needs_fleet:
            objs += [*self.broker(), *self.rollout()]
        return objs + self.learner()


def render(cfg: JobConfig, run_dir: str | None = None) -> str:
    """Every manifest of the job as one multi-document YAML."""
    check_placement(cfg)
    return yaml.safe_dump_all(Renderer(cfg, run_dir).objects(), sort_keys=False, default_flow_style=False, width=120)


def main(args) -> int:
    if not args.config:
        raise ConfigError("fleetrl launch k8s needs --config JOB.yaml")
    cfg = load_config(args.config, list(args.overrides))
    text = render(cfg, args.run_dir)
    out = Path(args.out) if args.out else Path(cfg.run.root) / cfg.run.name / "launch" / "k8s.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"# wrote {out}; apply with: kubectl apply -f {out}  (nothing was applied)", flush=True)
    return 0
