"""Helpers of the lane's multi-host Slurm tests (tests/cluster/test_hosts_*.py): submit `fleetrl launch slurm`
from the login host, read a run's learner steps and placement, account for every acknowledged group, and
save a test's figures where benchmarks/launch.py --hosts collects them."""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter
from pathlib import Path

from tests.cluster.conftest import JOB, events, job_overrides, lineage, read_jsonl

RESULTS = Path(
    os.environ.get("FLEETRL_HOSTS_RESULTS") or Path(__file__).resolve().parents[2] / "benchmarks" / "results"
)
# The layout of docs/deploy.md's "Multi-host layout": each role on nodes of its own (a cut node is one fault)
LAYOUT = [
    "cluster.share_nodes=false",
    "cluster.slurm.broker_own_node=true",
    "cluster.learner.nodes=2",
    "learner.num_ranks=2",
    "cluster.rollout.nodes=2",
    "cluster.rollout.servers_per_node=1",
    "cluster.interface=eth0",
]


def submit(hosts, slurm, *args: str) -> str:
    """`fleetrl launch slurm ARGS` on the login host; returns the job id."""
    out = hosts.run(0, [sys.executable, "-m", "fleetrl.app.cli", "launch", "slurm", *args], env=slurm.env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return re.search(r"submitted job (\d+)", out.stdout).group(1)


def submit_job(hosts, slurm, run: Path, assets: dict, *overrides: str) -> str:
    """The lane's demo job in the multi-host layout, kept off the last compute host (left for `--add-rollout`)."""
    keep_off = f'cluster.slurm.extra_args=["--exclude={hosts.names[-1]}"]'
    return submit(
        hosts, slurm, "--config", JOB, "--run-dir", str(run), *job_overrides(assets, *LAYOUT, keep_off, *overrides)
    )


def steps(run: Path) -> list[dict]:
    """The learner's metric rows (one per step), in order."""
    return [r for r in read_jsonl(run / "metrics.jsonl") if "policy/version" in r]


def placed(run: Path) -> set[tuple[str, str, str]]:
    """(role, process, host) of every process a supervisor started."""
    return {(e["role"], e["child"], e["host"]) for e in events(run, event="started")}


def acked(run: Path, index: int) -> list[dict]:
    return read_jsonl(run / f"rollout-{index}.acked.jsonl")


def dropped_stale(run: Path) -> list[int]:
    """Each broker process's final count of groups dropped stale (its `broker stopped` line; one per attempt of
    the job): the learner's metric rows miss what a broker dropped after the last step it reported."""
    return [
        int(n)
        for path in sorted(run.glob("logs/broker/attempt-*/output.log"))
        for n in re.findall(r"broker stopped: .*, (\d+) dropped stale", path.read_text(errors="replace"))
    ]


def account(run: Path, spool: Path, stale: int) -> dict:
    """Every group the broker acknowledged to a rollout server: trained (in the final model's lineage),
    acknowledged untrained by dynamic sampling, still in the spool, or — at most ``stale`` of them — dropped
    stale by design (counted by the broker, not named). Trained twice = twice in the lineage."""
    from fleetrl.broker.server.spool import Spool

    acked_ids = {g for path in run.glob("rollout-*.acked.jsonl") for r in read_jsonl(path) for g in r["group_ids"]}
    trained, filtered = lineage(run, "group_ids"), set(lineage(run, "filtered_ids"))
    queued = set(Spool(spool, fsync="never").recover().groups)
    lost = acked_ids - set(trained) - filtered - queued
    twice = [g for g, c in Counter(trained).items() if c > 1]
    versions = [r["policy/version"] for r in steps(run)]
    return {
        "acknowledged": len(acked_ids),
        "trained": len(set(trained)),
        "filtered": len(filtered),
        "still_queued": len(queued),
        "dropped_stale": stale,
        "acked_not_trained_filtered_or_queued": len(lost),
        "lost": max(0, len(lost) - stale),
        "trained_twice": len(twice),
        "twice_ids": twice[:5],
        "versions_monotonic": all(a <= b for a, b in zip(versions, versions[1:])),
    }


def save(name: str, report: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    report = {
        **report,
        "load_avg": os.getloadavg(),
        "note": report.get("note", "shared 2-core box: not a quiet-box figure unless others_cpu_share < 0.1"),
    }
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2))
    print(f"hosts: {name}:", json.dumps(report))
