"""`fleetrl launch ray` across three hosts (network namespaces, tests/cluster/hosts.py): a Ray head on host 1,
workers on hosts 2 and 3, each node at its own address (``--node-ip-address``) and the launcher on the head's
host. The demo job (broker, 2 rollout actors, 1 learner rank) is placed by Ray across them; `--add-rollout`
adds a server from a second driver; weights reach all three servers across the bridge; a killed rollout actor
comes back; a killed learner fails the job by name, and the added server ends with the job. (Held-out accuracy
is checked on one host, tests/cluster/test_slurm.py: with eval_n 200 it is too noisy to rise reliably within
the few minutes a loaded box gives this job.)

CPUs are what spreads the job: the head offers 1 logical CPU and each worker 2, so the five 1-CPU actors
(broker, 3 rollouts, learner) can only fit by using every node."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.conftest import JOB, evals, events, job_overrides, read_jsonl, trained_ids, wait_for
from tests.cluster.hostjob import save

pytestmark = pytest.mark.cluster
RAY = str(Path(sys.executable).with_name("ray"))
HEAD, WORKERS, PORT = 1, (2, 3), 6380
NODE = ["--object-store-memory=100000000", "--disable-usage-stats"]  # 3 nodes share one /dev/shm


def temp_dir(hosts, host: int) -> str:
    """Each node's own Ray temp dir: on one filesystem the nodes would share /tmp/ray's session directory, where
    Ray numbers the sockets of each start, racily. Short: a socket path must fit in 107 bytes."""
    return f"/tmp/{hosts.names[host]}-ray"


@pytest.fixture(scope="module")
def ray_hosts(lane_hosts, tmp_path_factory):
    """`ray start --block` on hosts 1-3: each process we hold stops its node when it gets SIGTERM."""
    try:
        import ray  # noqa: F401
    except ImportError:
        pytest.fail("ray is not installed; `pip install -e '.[ray]'` (make test-cluster does it)")
    hosts, logs = lane_hosts, tmp_path_factory.mktemp("rayhosts")
    # a throw-away cluster on a private bridge (no token auth: see test_ray.py); a raylet on a loaded 2-core box
    # may take longer than Ray's 30 s to register
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_raylet_start_wait_time_s": "180"}
    address = f"{hosts.addrs[HEAD]}:{PORT}"
    nodes = [
        hosts.popen(
            HEAD,
            [
                RAY,
                "start",
                "--head",
                "--block",
                f"--node-ip-address={hosts.addrs[HEAD]}",
                f"--port={PORT}",
                "--num-cpus=1",
                "--include-dashboard=false",
                *NODE,
                f"--temp-dir={temp_dir(hosts, HEAD)}",
            ],
            env=env,
            stdout=(logs / "head.out").open("w"),
            stderr=subprocess.STDOUT,
        )
    ]
    alive = lambda: re.findall(
        r"^\s*1 node_",
        hosts.run(HEAD, [RAY, "status", f"--address={address}"], env=env).stdout,  # noqa: E731
        re.M,
    )
    try:
        wait_for(lambda: nodes[0].poll() is not None or alive(), 120, "ray start --head")
        assert nodes[0].poll() is None, (logs / "head.out").read_text()[-3000:]
        for n, i in enumerate(WORKERS, start=2):  # one after the other: each registers before the next starts
            nodes.append(
                hosts.popen(
                    i,
                    [
                        RAY,
                        "start",
                        "--block",
                        f"--address={address}",
                        f"--node-ip-address={hosts.addrs[i]}",
                        "--num-cpus=2",
                        *NODE,
                        f"--temp-dir={temp_dir(hosts, i)}",
                    ],
                    env=env,
                    stdout=(logs / f"worker{i}.out").open("w"),
                    stderr=subprocess.STDOUT,
                )
            )
            wait_for(lambda: len(alive()) == n or any(p.poll() is not None for p in nodes), 240, f"{n} Ray nodes")
            assert len(alive()) == n, [(logs / f).read_text()[-2000:] for f in os.listdir(logs) if f.endswith(".out")]
        yield hosts, address, env
    finally:
        for node in reversed(nodes):  # workers first, then the head
            node.send_signal(signal.SIGTERM)
        for node in reversed(nodes):
            try:
                node.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
        for i in (HEAD, *WORKERS):
            shutil.rmtree(temp_dir(hosts, i), ignore_errors=True)


def launch(hosts, env, run: Path, name: str, *args: str) -> tuple[subprocess.Popen, Path]:
    """A `fleetrl launch ray` driver on the head's host (a driver needs a Ray node on its own host)."""
    run.mkdir(parents=True, exist_ok=True)
    out = run.parent / f"{name}.out"
    proc = hosts.popen(
        HEAD,
        [sys.executable, "-m", "fleetrl.app.cli", "launch", "ray", *args],
        env=env,
        stdout=out.open("w"),
        stderr=subprocess.STDOUT,
    )
    return proc, out


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_job_spreads_over_three_hosts_takes_an_added_rollout_learns_and_reports_a_dead_learner(
    ray_hosts, assets, tmp_path
):
    hosts, address, env = ray_hosts
    run = tmp_path / "run"
    job, job_out = launch(
        hosts,
        env,
        run,
        "launch",
        "--config",
        JOB,
        "--run-dir",
        str(run),
        "--address",
        address,
        *job_overrides(assets, "learner.max_minutes=8", "cluster.interface=eth0"),
    )
    add = None
    try:
        ready = wait_for(lambda: events(run, event="all_ready") or job.poll() is not None, 240, "all registered", run)
        assert job.poll() is None, job_out.read_text()[-3000:]
        where = {e["child"]: e["host"] for e in events(run, event="started")}
        assert set(where.values()) <= {hosts.addrs[i] for i in (HEAD, *WORKERS)} and len(set(where.values())) >= 2, (
            where
        )
        wait_for(lambda: len(read_jsonl(run / "metrics.jsonl")) >= 5, 180, "5 learner steps", run)

        # --add-rollout from a second driver: the fifth 1-CPU actor, so now every node runs part of the job.
        add, add_out = launch(hosts, env, run, "add", "--add-rollout", "1", "--run", str(run), "--address", address)
        wait_for(
            lambda: (run / "rollout-2.ready").exists() or add.poll() is not None,
            180,
            "the added rollout registered",
            run,
        )
        assert add.poll() is None, add_out.read_text()[-3000:]
        wait_for(lambda: read_jsonl(run / "rollout-2.acked.jsonl"), 120, "groups of the added server accepted", run)
        where = {e["child"]: e["host"] for e in events(run, event="started")}
        assert set(where.values()) == {hosts.addrs[i] for i in (HEAD, *WORKERS)}, where

        killed = [e for e in events(run, child="rollout-0", event="started")][-1]
        os.kill(killed["actor_pid"], signal.SIGKILL)  # the rollout actor's process: Ray restarts it (maybe elsewhere)
        wait_for(lambda: events(run, child="rollout-0", event="rejoined"), 180, "rollout-0 restarted", run)
        restarted = events(run, child="rollout-0", event="rejoined")[0]["time"]
        rows = lambda: [r for r in read_jsonl(run / "metrics.jsonl") if r.get("time", 0) > restarted]  # noqa: E731
        wait_for(
            lambda: any(r.get("sync/receivers") == 3 for r in rows()),
            180,
            "a weight round reaching all three servers (the restarted one too) across the bridge",
            run,
        )
        out = job_out.read_text()
        assert out.count("rollout-0 died") == 1 and "out of restarts" not in out, out[-3000:]  # one death, one restart

        learner = [e for e in events(run, child="learner", event="started")][-1]
        os.kill(learner["actor_pid"], signal.SIGKILL)  # the learner actor: reported by name, the job fails
        assert job.wait(180) == 1
        assert "FAILED: learner rank learner died" in job_out.read_text(), job_out.read_text()[-3000:]
        assert add.wait(180) == 0, add_out.read_text()[-3000:]  # the broker's `done` ends the added server too
        assert "the added rollout servers have all ended" in add_out.read_text()
    finally:
        stop(job)
        if add is not None:
            stop(add)
    ids = trained_ids(run)
    assert ids and len(ids) == len(set(ids)), "a group was trained twice"
    save(
        "hosts_ray",
        {
            "hosts": 3,
            "all_registered_s": ready[0].get("since_alloc_s"),
            "target_s": 20.0,
            "placed": where,
            "evals": evals(run),
        },
    )
