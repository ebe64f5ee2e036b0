"""`fleetrl launch slurm` across hosts (network namespaces, tests/cluster/hosts.py): slurmctld on a login host,
one slurmd per compute host. The demo job as rendered: the broker on its own node, a 2-rank learner across two
nodes (torchrun-style rendezvous across hosts, DeepSpeed over gloo on eth0), one rollout server on each of two
more nodes, weights broadcast across the bridge. Then a rollout host's link is down for 20 s and comes back.

Six hosts, not four: with the learner and the rollouts sharing nodes, cutting a rollout host would also cut a
learner rank (a different fault); the layout keeps the roles on nodes of their own so each cut is one fault."""

from __future__ import annotations

import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.cluster.conftest import JOB, events, job_overrides, make_hosts, read_jsonl, wait_for
from tests.cluster.localslurm import HostsSlurm, missing_tools

pytestmark = pytest.mark.cluster
CUT_S = 20.0
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "hosts_slurm.json"
LAYOUT = [
    "cluster.share_nodes=false",
    "cluster.slurm.broker_own_node=true",
    "cluster.learner.nodes=2",
    "learner.num_ranks=2",
    "cluster.rollout.nodes=2",
    "cluster.rollout.servers_per_node=1",
    "cluster.interface=eth0",
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = missing_tools()
    if missing:
        pytest.fail(f"Slurm tools missing: {', '.join(missing)}; run `bash scripts/cluster_deps.sh`")
    hosts = make_hosts(6)
    slurm = HostsSlurm(tmp_path_factory.mktemp("hslurm"), hosts, compute=[1, 2, 3, 4, 5])
    try:
        slurm.start()
        yield hosts, slurm
    finally:
        try:
            slurm.stop()
        finally:
            hosts.close()


def logged_ids(run: Path, key: str) -> list[str]:
    """Group ids of every learner rank's trained-<rank>.jsonl rows: ``group_ids`` trained, ``filtered_ids``
    acknowledged by dynamic sampling without training (all rewards equal: no gradient)."""
    return [g for path in sorted(run.glob("trained-*.jsonl")) for row in read_jsonl(path) for g in row.get(key, [])]


@pytest.mark.timeout(900)
def test_four_roles_on_five_nodes_learn_and_survive_a_rollout_host_cut_and_a_broker_host_cut(cluster, assets, tmp_path):
    hosts, slurm = cluster
    run, spool = tmp_path / "run", tmp_path / "spool"
    submit = hosts.run(
        0,
        [
            sys.executable,
            "-m",
            "fleetrl.app.cli",
            "launch",
            "slurm",
            "--config",
            JOB,
            "--run-dir",
            str(run),
            *job_overrides(assets, *LAYOUT, "learner.max_minutes=3", f"broker.spool_dir={spool}"),
        ],
        env=slurm.env,
        timeout=120,
    )
    assert submit.returncode == 0, submit.stdout + submit.stderr
    job = re.search(r"submitted job (\d+)", submit.stdout).group(1)

    ready = wait_for(lambda: events(run, event="all_ready"), 240, "every process registered", run)
    world = json.loads((run / "launch" / "world.json").read_text())
    names = hosts.names
    placed = {(e["role"], e["child"], e["host"]) for e in events(run, event="started")}
    print(f"hosts: all registered {ready[0].get('since_alloc_s')} s after allocation; world {world}; placed {placed}")
    by_role = lambda role: sorted(h for r, _, h in placed if r == role)  # noqa: E731
    # Each role on its own host(s): the broker on node 1, learner ranks on 2-3, rollouts on 4-5.
    assert (by_role("broker"), by_role("learner"), by_role("rollout")) == ([names[1]], names[2:4], names[4:6]), placed
    cut_index = int(next(c for r, c, h in placed if r == "rollout" and h == names[5]).rsplit("-", 1)[1])

    rows = lambda: [r for r in read_jsonl(run / "metrics.jsonl") if "policy/version" in r]  # noqa: E731
    wait_for(lambda: len(rows()) >= 5, 180, "5 learner steps", run)
    assert names[1] in json.dumps(world), world  # the broker's address names its host
    assert sorted(p.name for p in run.glob("trained-*.jsonl")) == ["trained-0.jsonl", "trained-1.jsonl"]
    # Weights across the bridge: both rollout servers (hosts 4 and 5) in the broadcast rounds.
    wait_for(
        lambda: any(r.get("sync/receivers") == 2 for r in rows()), 120, "a weight round reaching both rollouts", run
    )
    assert slurm.job_state(job) == "RUNNING"

    # Cut the host of one rollout server for CUT_S; the other server keeps the learner fed.
    acked = lambda i: read_jsonl(run / f"rollout-{i}.acked.jsonl")  # noqa: E731
    hosts.cut(5)
    steps_at_cut = len(rows())
    time.sleep(CUT_S)
    steps_during = len(rows()) - steps_at_cut
    hosts.restore(5)
    restored = time.time()
    back = wait_for(
        lambda: [r for r in acked(cut_index) if r["time"] > restored and r["group_ids"]],
        120,
        f"rollout-{cut_index}'s groups accepted again after its link returned",
        run,
    )
    back_s = back[0]["time"] - restored
    print(
        f"hosts: cut {names[5]} (rollout-{cut_index}) {CUT_S:.0f} s; {steps_during} learner steps during the cut; "
        f"its groups accepted again {back_s:.1f} s after the link returned"
    )

    # Cut the broker's host for CUT_S: every client's requests stall; a request is tried three times of
    # broker.request_timeout_s (10 s in job.yaml), so the clients outlast the cut and resume; nothing
    # acknowledged is lost. (With a request timeout of 60 s they resumed only ~40 s after the link returned:
    # the old TCP connection's retransmission backoff, not a fresh connection.)
    hosts.cut(1)
    time.sleep(CUT_S)
    hosts.restore(1)
    restored = time.time()
    resumed = wait_for(
        lambda: [r for r in rows() if r["time"] > restored], 120, "a learner step after the broker's link returned", run
    )
    broker_back_s = resumed[0]["time"] - restored
    print(
        f"hosts: cut the broker's host {names[1]} {CUT_S:.0f} s; next learner step {broker_back_s:.1f} s after "
        "the link returned"
    )

    assert slurm.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, 420) == "COMPLETED", (
        run / "launch" / f"slurm-{job}.out"
    ).read_text()[-3000:]
    # Accuracy up. The learner's held-out eval runs only with one rank (learner/evaluate.py), so this is the
    # exact-match accuracy of the groups it trained on (reward/mean of `exact`, temperature 1).
    reward = [r["reward/mean"] for r in rows() if "reward/mean" in r]
    first, last = sum(reward[:20]) / 20, sum(reward[-20:]) / 20
    assert len(reward) >= 60 and last >= first + 0.05, (
        f"training accuracy {first:.3f} -> {last:.3f} over {len(reward)} steps"
    )

    from fleetrl.broker.server.spool import Spool

    acked_ids = {g for i in (0, 1) for r in acked(i) for g in r["group_ids"]}
    trained, filtered = logged_ids(run, "group_ids"), set(logged_ids(run, "filtered_ids"))
    queued = set(Spool(spool, fsync="never").recover().groups)
    stale = int(rows()[-1]["broker/dropped_stale"])  # by design (broker.max_staleness); counted, not named
    lost = acked_ids - set(trained) - filtered - queued
    twice = [g for g, c in Counter(trained).items() if c > 1]
    versions = [r["policy/version"] for r in rows() if "policy/version" in r]
    report = {
        "hosts": len(names),
        "all_registered_s": ready[0].get("since_alloc_s"),
        "cut_s": CUT_S,
        "learner_steps_during_cut": steps_during,
        "rollout_back_after_link_s": round(back_s, 2),
        "training_after_broker_link_s": round(broker_back_s, 2),
        "acknowledged": len(acked_ids),
        "trained": len(set(trained)),
        "still_queued": len(queued),
        "filtered": len(filtered),
        "dropped_stale": stale,
        "acked_not_trained_filtered_or_queued": len(lost),
        "lost": max(0, len(lost) - stale),
        "trained_twice": len(twice),
        "versions_monotonic": all(a <= b for a, b in zip(versions, versions[1:])),
        "accuracy_first_last_20_steps": [round(first, 3), round(last, 3)],
        "note": "shared 2-core box, other sessions busy: not a quiet-box figure",
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    print("hosts:", json.dumps(report))
    # Stale drops are counted, not named; some of them were never acknowledged to their server (the ack lost
    # in a cut, the re-push answered `duplicate`), so the unaccounted groups are at most that count.
    assert len(lost) <= stale, (
        f"{len(lost)} acknowledged groups neither trained, filtered nor queued; {stale} dropped stale"
    )
    assert not twice, f"groups trained twice: {twice[:5]}"
    assert report["versions_monotonic"]
    assert steps_during > 0, "the learner stopped while one rollout host was cut off"
