"""A heterogeneous Slurm job (``cluster.slurm.heterogeneous``: one het-job component per role, each sized for its
own role) in the multi-host layout of tests/cluster/hostjob.py, with every client's link to the broker going
through a TCP proxy that adds latency (tests/cluster/latency_proxy.py: this kernel has no netem).

The broker host's name resolves, on the learner and rollout hosts, to the proxy on the login host, which
forwards the broker's two ports; weights still go straight from learner rank 0 to the rollouts. The same
running job is measured with 0 and 50 ms each way, in turn (ABAB), so the samples/s compare like with like."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.cluster.conftest import events, wait_for
from tests.cluster.hostjob import placed, save, steps, submit_job

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]
BASE_PORT = 23500  # tests/cluster/job.yaml's cluster.base_port: broker requests, announcements at +1
DELAY_MS, WINDOW_S, SETTLE_S = 50, 25.0, 3.0


def window(rows: list[dict], t0: float, t1: float) -> dict:
    """Samples trained per second between t0 and t1: from the last step before t0 to the last one by t1."""
    before = [r for r in rows if r["time"] < t0]
    inside = [r for r in rows if t0 <= r["time"] <= t1]
    if not inside:
        return {"steps": 0, "samples_per_s": 0.0}
    first = before[-1] if before else inside[0]
    samples = inside[-1]["batch/samples_total"] - first["batch/samples_total"]
    return {"steps": len(inside), "samples_per_s": round(samples / max(1e-9, inside[-1]["time"] - first["time"]), 1)}


@pytest.mark.timeout(900)
def test_a_heterogeneous_job_keeps_training_through_a_50_ms_link_to_the_broker(lane_slurm, assets, tmp_path):
    hosts, slurm = lane_slurm
    names, run = hosts.names, tmp_path / "run"
    delay, ready, stats = tmp_path / "delay_ms", tmp_path / "proxy.ready", tmp_path / "proxy.stats"
    delay.write_text("0")
    routes = [f"--route=0.0.0.0:{p}={hosts.addrs[1]}:{p}" for p in (BASE_PORT, BASE_PORT + 1)]
    proxy = hosts.popen(
        0,
        [
            sys.executable,
            "-m",
            "tests.cluster.latency_proxy",
            *routes,
            "--delay-file",
            str(delay),
            "--ready",
            str(ready),
            "--stats",
            str(stats),
        ],
        cwd=ROOT,
    )
    wait_for(lambda: ready.exists() or proxy.poll() is not None, 60, "the latency proxy to listen")
    assert proxy.poll() is None, "the latency proxy exited"
    clients = [2, 3, 4, 5]
    hosts.point(1, hosts.addrs[0], on=clients)  # on the learner and rollout hosts the broker's name leads to the proxy
    try:
        job = submit_job(hosts, slurm, run, assets, "cluster.slurm.heterogeneous=true", "learner.max_minutes=6")
        script = (run / "launch" / "job.sbatch").read_text()
        assert script.count("#SBATCH hetjob\n") == 2 and "--het-group=2" in script, script
        ready_ev = wait_for(lambda: events(run, event="all_ready"), 240, "every process registered", run)
        components = slurm.slurm_cmd(["squeue", "-h", "-o", "%i"]).stdout.split()
        assert {f"{job}+0", f"{job}+1", f"{job}+2"} <= set(components), components
        by_role = lambda role: sorted(h for r, _, h in placed(run) if r == role)  # noqa: E731
        assert (by_role("broker"), by_role("learner"), by_role("rollout")) == ([names[1]], names[2:4], names[4:6])
        wait_for(lambda: len(steps(run)) >= 5, 180, "5 learner steps", run)
        carried = json.loads(stats.read_text())
        assert carried["connections"] >= 4 and carried["bytes_to_server"] > 0, carried  # 2 ranks + 2 servers at least

        windows = []
        for ms in (0, DELAY_MS, 0, DELAY_MS):  # A B A B on the same job
            delay.write_text(str(ms))
            time.sleep(SETTLE_S)  # the proxy reads the file every 0.2 s; requests in flight finish on the old delay
            t0 = time.time()
            time.sleep(WINDOW_S)
            windows.append({"delay_ms": ms, **window(steps(run), t0, time.time())})
            print(f"hosts: broker link +{ms} ms each way: {windows[-1]}")
        after = json.loads(stats.read_text())
        assert (
            after["bytes_to_server"] > carried["bytes_to_server"]
            and after["bytes_to_client"] > carried["bytes_to_client"]
        )
        assert all(w["steps"] > 0 for w in windows), windows  # it keeps training at 50 ms
        rate = {ms: sum(w["samples_per_s"] for w in windows if w["delay_ms"] == ms) / 2 for ms in (0, DELAY_MS)}
        save(
            "hosts_latency",
            {
                "delay_ms_each_way": DELAY_MS,
                "window_s": WINDOW_S,
                "windows": windows,
                "samples_per_s_0ms": round(rate[0], 1),
                f"samples_per_s_{DELAY_MS}ms": round(rate[DELAY_MS], 1),
                "ratio": round(rate[DELAY_MS] / max(1e-9, rate[0]), 3),
                "proxy": after,
                "heterogeneous_job": True,
                "all_registered_s": ready_ev[0].get("since_alloc_s"),
            },
        )
        slurm.slurm_cmd(["scancel", job])
        assert slurm.wait_state(job, {"CANCELLED", "COMPLETED", "FAILED"}, 180) in {"CANCELLED", "COMPLETED"}
    finally:
        hosts.point(1, None, on=clients)
        proxy.terminate()
        proxy.wait(10)
