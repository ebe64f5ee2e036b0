"""Fixtures of the real-engine lane (`make test-cluster`, marker `cluster`): the demo task's model and data
(built locally, warm-started by `fleetrl sft`), a one-host Slurm cluster, helpers to read a run directory.

Nothing here skips: a missing tool fails the test with what to install (scripts/cluster_deps.sh does it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster.hosts import Hosts, HostsError
from tests.cluster.localslurm import HostsSlurm, LocalSlurm, missing_tools

JOB = str(Path(__file__).with_name("job.yaml"))
TEST_TIMEOUT_S = 900  # pytest-timeout counts session-fixture setup (the warm-started model: 1-5 min by load) too


def pytest_collection_modifyitems(items):
    """The lane's tests wait up to several minutes each by design; the suite's 300 s default would also have to
    cover the `assets` and cluster fixtures the first test sets up, which a loaded 2-core box does not."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.path)).parents and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT_S))


def fleetrl(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fleetrl.app.cli", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> dict[str, str]:
    """The demo's small model warm-started to ~25% held-out accuracy, and the arithmetic data (~1 min).
    FLEETRL_CLUSTER_ASSETS=DIR keeps them in DIR and reuses them there (iterating on one test by hand)."""
    keep = os.environ.get("FLEETRL_CLUSTER_ASSETS")
    root = Path(keep) if keep else tmp_path_factory.mktemp("assets")
    model, warm, data = root / "small", root / "warm", root / "arith.jsonl"
    if keep and (warm / "config.json").exists() and (root / "arith.eval.jsonl").exists():
        return {"model": str(warm), "train": str(data), "eval": str(root / "arith.eval.jsonl")}
    for args in (
        ["init-model", "--out", str(model), "--preset", "small"],
        ["init-data", "--task", "arithmetic", "--out", str(data), "--n", "20000", "--eval-n", "500"],
        [
            "sft",
            "--model",
            str(model),
            "--data",
            str(data),
            "--eval-data",
            str(root / "arith.eval.jsonl"),
            "--out",
            str(warm),
            "--target-acc",
            "0.25",
            "--threads",
            "1",
            "--max-minutes",
            "8",
        ],
    ):
        out = fleetrl(*args)
        assert out.returncode == 0, f"fleetrl {args[0]} failed:\n{out.stdout}\n{out.stderr}"
    return {"model": str(warm), "train": str(data), "eval": str(root / "arith.eval.jsonl")}


def job_overrides(assets: dict[str, str], *extra: str) -> list[str]:
    return [f"model.path={assets['model']}", f"data.train={assets['train']}", f"data.eval={assets['eval']}", *extra]


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    missing = missing_tools()
    if missing:
        pytest.fail(
            f"Slurm tools missing: {', '.join(missing)}; run `bash scripts/cluster_deps.sh` (apt-get install "
            "slurm-wlm munge) or `make test-cluster`, which does"
        )
    if os.geteuid() != 0:
        pytest.fail("the local Slurm cluster runs slurmctld/slurmd as root; run `make test-cluster` as root")
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    yield cluster
    cluster.stop()


def make_hosts(n: int) -> Hosts:
    """N network-namespace hosts, or a failed test saying why (never a skip: the lane must not pass silently)."""
    try:
        return Hosts(n).start()
    except HostsError as e:
        pytest.fail(f"could not make {n} hosts in network namespaces: {e}")


LANE_HOSTS = 7  # a login host and six compute hosts, shared by the lane's multi-host tests (Slurm and Ray)


@pytest.fixture(scope="session")
def lane_hosts():
    """The lane's one set of hosts: host 0 is the login host (slurmctld, Ray drivers, the latency proxy),
    hosts 1-6 compute hosts (one slurmd each; Ray's head and workers on 1-3)."""
    hosts = make_hosts(LANE_HOSTS)
    try:
        yield hosts
    finally:
        hosts.close()


@pytest.fixture(scope="session")
def hosts_slurm(lane_hosts, tmp_path_factory):
    """Slurm across the lane's hosts: slurmctld on host 0, a slurmd on each of hosts 1-6."""
    missing = missing_tools()
    if missing:
        pytest.fail(f"Slurm tools missing: {', '.join(missing)}; run `bash scripts/cluster_deps.sh`")
    slurm = HostsSlurm(tmp_path_factory.mktemp("hslurm"), lane_hosts, compute=list(range(1, LANE_HOSTS)))
    try:
        slurm.start()
        yield lane_hosts, slurm
    finally:
        slurm.stop()


@pytest.fixture
def lane_slurm(hosts_slurm):
    """The lane's Slurm hosts for one test; whatever job it leaves behind (it failed midway) is cancelled, so the
    next test does not share the nodes with it."""
    yield hosts_slurm
    hosts_slurm[1].cancel_all()


@pytest.fixture
def hosts3():
    hosts = make_hosts(3)
    try:
        yield hosts
    finally:
        hosts.close()


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by a SIGKILL
    return rows


def events(run_dir: Path, **match) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "launch" / "events.jsonl") if all(e.get(k) == v for k, v in match.items())]


def wait_for(predicate, timeout: float, what: str, dump: Path | None = None):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            tail = ""
            if dump is not None:
                tail = "\n".join(
                    f"--- {p}\n{p.read_text(errors='replace')[-3000:]}"
                    for p in sorted([*dump.rglob("*.out"), *dump.rglob("output.log")])
                )
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{tail}")
        time.sleep(0.5)


def evals(run_dir: Path) -> list[float]:
    return [r["eval/accuracy"] for r in read_jsonl(run_dir / "metrics.jsonl") if "eval/accuracy" in r]


def learned(run_dir: Path, gain: float = 0.05) -> bool:
    """Held-out accuracy up: the mean of the last three evaluations beats the step-0 one by ``gain``."""
    acc = evals(run_dir)
    return len(acc) >= 4 and sum(acc[-3:]) / 3 >= acc[0] + gain


def trained_ids(run_dir: Path) -> list[str]:
    return [
        g
        for path in sorted(run_dir.glob("trained-*.jsonl"))
        for row in read_jsonl(path)
        for g in row.get("group_ids", [])
    ]


def lineage(run_dir: Path, key: str = "group_ids") -> list[str]:
    """Group ids (``group_ids`` trained, ``filtered_ids`` acknowledged untrained) of the steps that made the final
    model: a learner that resumed from a checkpoint (a ``resume`` row) replays the steps after it, so the rows of
    those steps from before the resume are dropped, per rank."""
    ids = []
    for path in sorted(run_dir.glob("trained-*.jsonl")):
        kept: list[dict] = []
        for row in read_jsonl(path):
            if "resume" in row:
                kept = [r for r in kept if r["step"] <= row["resume"]]
            elif "step" in row:
                kept.append(row)
        ids += [g for r in kept for g in r.get(key, [])]
    return ids


def ready_pid(path: Path) -> int:
    return json.loads(path.read_text())["pid"]
