"""The world map: Slurm (plain and het-job), torchrun, Kubernetes, Ray and local inputs -> one World."""

from __future__ import annotations

import pytest

from fleetrl.app.launch.world import Layout, WorldError, expand_hostlist, k8s_name, world_map

GPU = Layout(
    base_port=29500,
    learner_nodes=1,
    ranks_per_node=8,
    learner_gpus_per_node=8,
    rollout_nodes=2,
    servers_per_node=4,
    gpus_per_server=2,
    run_dir="/shared/run",
)


def slurm(procid: int, nodelist: str = "gpu[01-03]", **extra: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": nodelist, "SLURM_PROCID": str(procid), **extra}


@pytest.mark.parametrize(
    "text, names",
    [
        ("vm", ["vm"]),
        ("gpu[01-03,7],cpu1", ["gpu01", "gpu02", "gpu03", "gpu7", "cpu1"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("a[1-2]-ib", ["a1-ib", "a2-ib"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ],
)
def test_expand_hostlist(text, names):
    assert expand_hostlist(text) == names


def test_bad_hostlist_names_the_entry():
    with pytest.raises(WorldError, match=r"gpu\[a-b\]"):
        expand_hostlist("gpu[a-b]")


def test_slurm_roles_get_their_nodes_addresses_and_gpu_slices():
    broker = world_map(slurm(0), "broker", GPU)
    assert (broker.source, broker.host, broker.broker_address) == ("slurm", "gpu01", "tcp://gpu01:29500")
    assert broker.overrides()[:4] == [
        "broker.host=0.0.0.0",
        "broker.insecure_bind=true",
        "broker.port=29500",
        "broker.pub_port=29501",
    ]
    learner = world_map(slurm(0), "learner", GPU)
    assert (learner.master_addr, learner.master_port, learner.nnodes, learner.nproc_per_node) == ("gpu01", 29502, 1, 8)
    assert (learner.world_size, learner.rank, learner.sync_addr, learner.sync_port) == (8, None, "gpu01", 29503)
    second = world_map(slurm(1), "rollout", GPU)  # the second rollout node is the third node of the job
    assert second.host == "gpu03" and second.rollout_indices == (4, 5, 6, 7)
    assert second.rollout_gpus == ("0,1", "2,3", "4,5", "6,7")
    assert "broker.address=tcp://gpu01:29500" in second.overrides() and "sync.master_addr=gpu01" in second.overrides()
    assert second.env()["MASTER_ADDR"] == "gpu01" and second.run_dir == "/shared/run"


def test_het_job_node_lists_and_a_broker_node_of_its_own():
    layout = Layout(learner_nodes=2, rollout_nodes=1, broker_own_node=True, interface="ib0")
    env = {
        "SLURM_JOB_ID": "7",
        "SLURM_PROCID": "1",
        "SLURM_JOB_NODELIST_HET_GROUP_1": "gpu[1-3]",
        "SLURM_JOB_NODELIST_HET_GROUP_0": "cpu9",
    }
    learner = world_map(env, "learner", layout)
    assert (learner.host, learner.node_rank, learner.rank, learner.master_addr) == ("gpu2", 1, 1, "gpu1")
    assert learner.broker_address == "tcp://cpu9:29500"
    assert learner.env()["NCCL_SOCKET_IFNAME"] == learner.env()["GLOO_SOCKET_IFNAME"] == "ib0"
    assert learner.env()["RANK"] == "1" and learner.env()["WORLD_SIZE"] == "2"
    assert world_map({**env, "SLURM_PROCID": "0"}, "rollout", layout).host == "gpu3"


def test_shared_nodes_put_rollout_gpus_after_the_learners():
    layout = Layout(
        learner_nodes=1,
        ranks_per_node=2,
        learner_gpus_per_node=2,
        rollout_nodes=1,
        servers_per_node=2,
        gpus_per_server=1,
        share_nodes=True,
    )
    w = world_map(slurm(0, "vm"), "rollout", layout)
    assert (w.host, w.rollout_indices, w.rollout_gpus) == ("vm", (0, 1), ("2", "3"))
    assert layout.nodes_needed() == 1


def test_an_add_rollout_job_joins_the_given_broker_with_later_indices():
    layout = Layout(rollout_nodes=1, servers_per_node=2, run_dir="/r")
    env = slurm(
        1,
        "n[5-6]",
        FLEETRL_BROKER_ADDRESS="tcp://gpu01:29500",
        FLEETRL_SYNC_ADDR="gpu02:29503",
        FLEETRL_ROLLOUT_OFFSET="4",
        FLEETRL_ROLLOUT_SERVERS="3",
    )
    first, second = world_map({**env, "SLURM_PROCID": "0"}, "rollout", layout), world_map(env, "rollout", layout)
    assert first.rollout_indices == (4, 5) and second.rollout_indices == (6,)
    assert second.broker_address == "tcp://gpu01:29500" and (second.sync_addr, second.sync_port) == ("gpu02", 29503)
    assert second.host == "n6"


def test_slurm_inputs_that_do_not_place_a_process():
    with pytest.raises(WorldError, match="SLURM_PROCID=2 but the learner role has 1 node"):
        world_map(slurm(2), "learner", GPU)
    with pytest.raises(WorldError, match="SLURM_PROCID is not set"):
        world_map({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "a"}, "broker", GPU)
    with pytest.raises(WorldError, match="has 2 node.*needs 3"):
        world_map(slurm(0, "gpu[1-2]"), "broker", GPU)
    with pytest.raises(WorldError, match="unknown role 'trainer'; valid roles: broker, rollout, learner"):
        world_map(slurm(0), "trainer", GPU)


def test_torchrun_environment():
    env = {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "MASTER_ADDR": "h0",
        "MASTER_PORT": "29999",
        "GROUP_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "FLEETRL_BROKER_ADDRESS": "tcp://b:1",
    }
    w = world_map(env, "learner", Layout())
    assert (w.source, w.rank, w.local_rank, w.node_rank, w.world_size) == ("torchrun", 3, 1, 1, 4)
    assert (w.master_addr, w.master_port, w.broker_address) == ("h0", 29999, "tcp://b:1")
    assert w.env()["RANK"] == "3" and w.env()["LOCAL_RANK"] == "1"


def test_kubernetes_pods():
    layout = Layout(learner_nodes=2, rollout_nodes=3, servers_per_node=2, gpus_per_server=1, base_port=20000)
    env = {
        "FLEETRL_K8S_NAME": "demo",
        "POD_NAMESPACE": "rl",
        "JOB_COMPLETION_INDEX": "1",
        "POD_NAME": "demo-learner-1-x",
    }
    learner = world_map(env, "learner", layout)
    assert (learner.source, learner.rank, learner.node_rank) == ("k8s", 1, 1)
    assert learner.master_addr == "demo-learner-0.demo-learner.rl.svc" and learner.master_port == 20002
    assert learner.broker_address == "tcp://demo-broker.rl.svc:20000"
    pod = {k: v for k, v in env.items() if k != "JOB_COMPLETION_INDEX"}
    a = world_map({**pod, "POD_NAME": "demo-rollout-abc"}, "rollout", layout)
    b = world_map({**pod, "POD_NAME": "demo-rollout-xyz"}, "rollout", layout)
    assert a.rollout_indices == world_map({**pod, "POD_NAME": "demo-rollout-abc"}, "rollout", layout).rollout_indices
    assert len(a.rollout_indices) == 2 and not set(a.rollout_indices) & set(b.rollout_indices)
    assert a.rollout_gpus == ("0", "1")
    with pytest.raises(WorldError, match="JOB_COMPLETION_INDEX"):
        world_map(pod, "learner", layout)


def test_ray_actor_context():
    ctx = {
        "rank": 1,
        "world_size": 2,
        "node_ip": "10.0.0.5",
        "master_addr": "10.0.0.4",
        "master_port": 41000,
        "broker_address": "tcp://10.0.0.3:40000",
        "run_dir": "/nfs/run",
    }
    w = world_map({}, "learner", Layout(), ray=ctx)
    assert (w.source, w.rank, w.local_rank, w.world_size, w.host) == ("ray", 1, 0, 2, "10.0.0.5")
    assert w.env()["MASTER_ADDR"] == "10.0.0.4" and w.env()["MASTER_PORT"] == "41000" and w.run_dir == "/nfs/run"
    r = world_map({}, "rollout", Layout(), ray={**ctx, "server_index": 5})
    assert r.rollout_indices == (5,) and r.broker_address == "tcp://10.0.0.3:40000"
    with pytest.raises(WorldError, match="broker_address"):
        world_map({}, "rollout", Layout(), ray={"node_ip": "1.2.3.4"})


def test_local_without_a_launcher():
    w = world_map({}, "rollout", Layout(rollout_nodes=1, servers_per_node=3))
    assert w.source == "local" and w.rollout_indices == (0, 1, 2) and w.broker_address == "tcp://127.0.0.1:29500"


def test_k8s_name_is_a_dns_label():
    assert k8s_name("My_Run.v2") == "my-run-v2"
    assert k8s_name("7up") == "fleetrl-7up"
    assert len(k8s_name("x" * 80)) <= 40
