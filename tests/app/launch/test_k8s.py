"""`fleetrl launch k8s`: the manifests, the fields the job relies on, and every object validated against
the Kubernetes 1.37 object schemas (kubernetes-validate, strict: unknown fields fail)."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml

from fleetrl.app.launch.k8s import render
from fleetrl.app.launch.world import Layout, world_map
from fleetrl.common.config import ConfigError, load_config, validate

JOB = [
    "run.name=Grpo_Run",
    "cluster.image=registry.example/fleetrl:0.1",
    "cluster.k8s.namespace=rl",
    "learner.num_ranks=4",
    "cluster.learner.nodes=2",
    "cluster.learner.gpus_per_node=2",
    "learner.device=cuda",
    "cluster.rollout.nodes=3",
    "cluster.rollout.gpus_per_node=4",
    "cluster.base_port=20000",
    "cluster.k8s.curve_secret=fleetrl-keys",
    "cluster.interface=eth0",
]


def objects(*extra: str) -> dict[tuple[str, str], dict]:
    docs = list(yaml.safe_load_all(render(load_config(None, [*JOB, *extra]))))
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def test_every_object_passes_the_kubernetes_schemas():
    objs = objects()
    assert sorted(objs) == [
        ("ConfigMap", "grpo-run-job"),
        ("Deployment", "grpo-run-broker"),
        ("Deployment", "grpo-run-rollout"),
        ("Job", "grpo-run-learner"),
        ("PersistentVolumeClaim", "grpo-run-run"),
        ("Service", "grpo-run-broker"),
        ("Service", "grpo-run-learner"),
    ]
    for obj in objs.values():
        kubernetes_validate.validate(obj, "1.37", strict=True)


def test_the_validator_is_not_a_rubber_stamp():
    job = copy.deepcopy(objects()[("Job", "grpo-run-learner")])
    job["spec"]["completionMod"] = "Indexed"  # a typo'd field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, "1.37", strict=True)
    job = copy.deepcopy(objects()[("Deployment", "grpo-run-rollout")])
    job["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, "1.37", strict=True)


def test_the_fields_the_job_relies_on():
    objs = objects()
    job = objs[("Job", "grpo-run-learner")]
    assert job["metadata"]["namespace"] == "rl"
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == (
        "Indexed",
        2,
        2,
        0,
    )
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == "grpo-run-learner" and pod["restartPolicy"] == "Never"
    learner = pod["containers"][0]
    assert learner["resources"]["limits"] == {"nvidia.com/gpu": 2}
    assert learner["command"][-6:] == [
        "--role",
        "learner",
        "--config",
        "/etc/fleetrl/job.yaml",
        "--run-dir",
        "/fleetrl/grpo-run",
    ]
    env = {e["name"]: e for e in learner["env"]}
    assert env["FLEETRL_K8S_NAME"]["value"] == "grpo-run" and env["GLOO_SOCKET_IFNAME"]["value"] == "eth0"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    headless = objs[("Service", "grpo-run-learner")]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    assert headless["selector"].items() <= spec["template"]["metadata"]["labels"].items()  # it selects the pods
    assert [p["port"] for p in headless["ports"]] == [20002, 20003]
    broker = objs[("Service", "grpo-run-broker")]["spec"]
    assert [p["port"] for p in broker["ports"]] == [20000, 20001]
    rollout = objs[("Deployment", "grpo-run-rollout")]["spec"]
    assert rollout["replicas"] == 3
    assert rollout["template"]["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 4}
    volumes = {v["name"]: v for v in rollout["template"]["spec"]["volumes"]}
    assert volumes["run"]["persistentVolumeClaim"]["claimName"] == "grpo-run-run"
    assert volumes["keys"]["secret"]["secretName"] == "fleetrl-keys"
    assert objs[("PersistentVolumeClaim", "grpo-run-run")]["spec"]["accessModes"] == ["ReadWriteMany"]


def test_the_config_map_holds_the_job_and_the_world_map_finds_the_rendered_names():
    objs = objects()
    cfg = validate(yaml.safe_load(objs[("ConfigMap", "grpo-run-job")]["data"]["job.yaml"]))
    assert cfg.cluster.learner.nodes == 2 and cfg.run.name == "Grpo_Run"
    env = {"FLEETRL_K8S_NAME": "grpo-run", "POD_NAMESPACE": "rl", "JOB_COMPLETION_INDEX": "1"}
    w = world_map(env, "learner", Layout.from_config(cfg, "/fleetrl/grpo-run"))
    job = objs[("Job", "grpo-run-learner")]
    # Indexed Job pods are <job>-<index>; with the subdomain they resolve as <pod>.<subdomain>.<ns>.svc
    assert w.master_addr == f"{job['metadata']['name']}-0.{job['spec']['template']['spec']['subdomain']}.rl.svc"
    service = objs[("Service", "grpo-run-broker")]
    assert w.broker_address == f"tcp://{service['metadata']['name']}.rl.svc:{service['spec']['ports'][0]['port']}"


def test_an_existing_claim_is_used_not_rendered():
    objs = objects("cluster.k8s.pvc=shared-nfs")
    assert ("PersistentVolumeClaim", "grpo-run-run") not in objs
    pod = objs[("Deployment", "grpo-run-broker")]["spec"]["template"]["spec"]
    assert pod["volumes"][1]["persistentVolumeClaim"]["claimName"] == "shared-nfs"


def test_refusals():
    with pytest.raises(ConfigError, match="cluster.image"):
        render(load_config(None, []))
    with pytest.raises(ConfigError, match="learner.num_ranks=4"):
        render(load_config(None, ["cluster.image=x", "learner.num_ranks=4"]))


def pods(objs: dict) -> list[dict]:
    return [o["spec"]["template"]["spec"] for o in objs.values() if o["kind"] in ("Deployment", "Job")]


def path_args(container: dict) -> list[str]:
    """Every path the launcher passes a container: the values of its --config and --run-dir arguments."""
    cmd = container["command"]
    return [cmd[i + 1] for i, a in enumerate(cmd) if a in ("--config", "--run-dir")]


def on_a_mount(path: str, container: dict) -> str | None:
    """The mount the path lies on (the longest mountPath that holds it), or None: the container's own disk."""
    hits = [
        mt["mountPath"]
        for mt in container["volumeMounts"]
        if path == mt["mountPath"] or path.startswith(mt["mountPath"].rstrip("/") + "/")
    ]
    return max(hits, key=len, default=None)


@pytest.mark.parametrize(
    "run_dir, expect",
    [
        (None, "/fleetrl/grpo-run"),
        ("cluster.run_dir=/shared/runs/grpo", "/shared/runs/grpo"),  # docs/deploy.md's own example
        ("cluster.run_dir=runs/grpo", "/fleetrl/runs/grpo"),
        ("cluster.run_dir=/fleetrl/exp/1", "/fleetrl/exp/1"),
    ],
)
def test_every_run_path_is_on_the_shared_volume(run_dir, expect):
    objs = objects(*([run_dir] if run_dir else []))
    for spec in pods(objs):
        [c] = spec["containers"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {mt["mountPath"]: mt["name"] for mt in c["volumeMounts"]}
        config, run = path_args(c)
        assert run == expect
        assert mounts[on_a_mount(run, c)] == "run" and "persistentVolumeClaim" in volumes["run"]
        assert mounts[on_a_mount(config, c)] == "job"
    for obj in objs.values():
        kubernetes_validate.validate(obj, "1.37", strict=True)


def test_pods_get_a_memory_backed_shm_and_memory_requests():
    objs = objects("cluster.learner.mem_gb_per_rank=24", "cluster.rollout.mem_gb_per_server=8")
    requests = {}
    for spec in pods(objs):
        [c] = spec["containers"]
        assert {"name": "shm", "emptyDir": {"medium": "Memory"}} in spec["volumes"]
        assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        requests[c["name"]] = c["resources"]["requests"]["memory"]
    # 2 learner ranks per node x 24 GiB; 4 rollout servers per node (one per GPU) x 8 GiB; the broker's 2 GiB
    assert requests == {"learner": "48Gi", "rollout": "32Gi", "broker": "2Gi"}
    unset = {c["name"]: c["resources"]["requests"]["memory"] for spec in pods(objects()) for c in spec["containers"]}
    assert unset == {"learner": "32Gi", "rollout": "64Gi", "broker": "2Gi"}  # null: 16 GiB per rank / server
