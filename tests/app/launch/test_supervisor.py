"""The per-node supervisor with real child processes (short python scripts in place of the fleetrl
commands): bounded restarts with a log directory per attempt, a rejoin measured from the ready file,
a dead learner reported with its cause, and an unreachable broker failing fast with the address."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from fleetrl.app.launch.supervisor import EXIT_BROKER_UNREACHABLE, Supervisor, wait_for_broker
from fleetrl.app.launch.world import Layout, world_map
from fleetrl.common.config import load_config


@pytest.fixture
def broker_port():
    """A listening socket standing in for the broker's port (the supervisor only probes it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield s.getsockname()[1]


def supervisor(tmp_path: Path, role: str, port: int, *overrides: str) -> Supervisor:
    cfg = load_config(None, ["cluster.rollout.servers_per_node=1", "cluster.broker_wait_s=1", *overrides])
    env = {"FLEETRL_BROKER_ADDRESS": f"tcp://127.0.0.1:{port}"}
    world = world_map(env, role, Layout.from_config(cfg, str(tmp_path)))
    return Supervisor(cfg, world, tmp_path, tmp_path / "config.yaml")


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "launch" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def script(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_crashing_rollout_is_restarted_a_bounded_number_of_times(tmp_path, broker_port):
    sup = supervisor(tmp_path, "rollout", broker_port, "cluster.rollout.max_restarts=2")
    child = sup.children[0]
    assert (
        child.name == "rollout-0" and "--server-index" in child.argv and f"tcp://127.0.0.1:{broker_port}" in child.argv
    )
    child.argv = script("import sys; print('attempt'); sys.exit(7)")
    assert sup.run() == 1  # every server gave up and the job is not done
    for attempt in range(3):
        assert "attempt" in (tmp_path / "logs" / "rollout-0" / f"attempt-{attempt}" / "output.log").read_text()
    assert not (tmp_path / "logs" / "rollout-0" / "attempt-3").exists()
    kinds = [e["event"] for e in events(tmp_path)]
    assert kinds.count("started") == 3 and kinds.count("died") == 3 and kinds[-1] == "gave_up"


def test_servers_that_finish_before_the_job_is_marked_done_end_the_step_cleanly(tmp_path, broker_port):
    """The broker's `done` reaches the servers (they exit 0) before the job driver writes RUN/launch/done: the step
    is a clean end, not a failure (an `--add-rollout` job is then COMPLETED, not FAILED)."""
    sup = supervisor(tmp_path, "rollout", broker_port, "cluster.rollout.max_restarts=2")
    sup.children[0].argv = script("print('stopped (done: training finished at step 9)')")
    assert sup.run() == 0
    assert not (tmp_path / "launch" / "done").exists()
    assert [e["why"] for e in events(tmp_path) if e["event"] == "gave_up"] == ["finished"]


def test_a_restarted_rollout_rejoins_and_the_time_is_measured(tmp_path, broker_port):
    sup = supervisor(tmp_path, "rollout", broker_port)
    ready, marker = tmp_path / "rollout-0.ready", tmp_path / "crashed-once"
    sup.children[0].argv = script(
        f"import pathlib, sys, time\nm = pathlib.Path({str(marker)!r})\n"
        f"if not m.exists():\n    m.touch(); sys.exit(9)\n"
        f"pathlib.Path({str(ready)!r}).write_text('{{}}'); time.sleep(60)"
    )
    thread = threading.Thread(target=lambda: setattr(sup, "code", sup.run()))
    thread.start()
    deadline = time.monotonic() + 30
    while not any(e["event"] == "rejoined" for e in events(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    sup.stop_signal = 10  # what SIGUSR1 sets: stop the servers, exit 0
    thread.join(30)
    rejoined = [e for e in events(tmp_path) if e["event"] == "rejoined"]
    assert rejoined and rejoined[0]["attempt"] == 1 and 0 < rejoined[0]["since_death_s"] < 15
    assert sup.code == 0 and sup.children[0].returncode is not None  # stopped, not left behind


def test_a_dead_learner_fails_the_node_with_its_cause(tmp_path, broker_port):
    sup = supervisor(tmp_path, "learner", broker_port)
    child = sup.children[0]
    assert child.name == "learner" and "checkpoint.resume=auto" in child.argv and child.env["RANK"] == "0"
    child.argv = script("import sys; print('CUDA out of memory, say'); sys.exit(5)")
    assert sup.run() == 1
    (failed,) = (tmp_path / "launch").glob("failed-learner-*.json")
    record = json.loads(failed.read_text())
    assert record["child"] == "learner" and record["code"] == 5 and "out of memory" in record["tail"]


def test_a_learner_that_finishes_ends_the_node_cleanly(tmp_path, broker_port):
    sup = supervisor(tmp_path, "learner", broker_port)
    sup.children[0].argv = script("pass")
    assert sup.run() == 0
    assert not list((tmp_path / "launch").glob("failed-*.json"))


def test_several_ranks_on_a_node_run_under_torchrun(tmp_path, broker_port):
    sup = supervisor(tmp_path, "learner", broker_port, "learner.num_ranks=4", "cluster.learner.ranks_per_node=4")
    argv = sup.children[0].argv
    assert argv[1:3] == ["-m", "torch.distributed.run"] and argv[argv.index("--nproc-per-node") + 1] == "4"
    assert "RANK" not in sup.children[0].env


def test_an_unreachable_broker_fails_fast_with_the_address_and_interface(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        start = time.monotonic()
        with pytest.raises(ConnectionError, match=rf"tcp://127.0.0.1:{port} is unreachable .*interface lo"):
            wait_for_broker(f"tcp://127.0.0.1:{port}", 0.5, None)
        assert time.monotonic() - start < 5
        sup = supervisor(tmp_path, "rollout", port)
        assert sup.run() == EXIT_BROKER_UNREACHABLE
    record = json.loads(next((tmp_path / "launch").glob("failed-rollout-*.json")).read_text())
    assert f"127.0.0.1:{port}" in record["message"] and "cluster.broker_wait_s" in record["message"]
    assert sup.children[0].proc is None  # nothing was started against a broker nobody can reach


def test_a_rollout_whose_rewards_are_hopeless_is_not_restarted_and_is_reported(tmp_path, broker_port):
    """Exit 4 (rollout.reward_stop_after samples in a row had no usable reward): a restart would score nothing
    again, so the server is not restarted and a failure report of that kind is written for the job driver."""
    sup = supervisor(tmp_path, "rollout", broker_port, "cluster.rollout.max_restarts=3")
    sup.children[0].argv = script("import sys; print('the rewards stopped working: ...'); sys.exit(4)")
    assert sup.run() == 1
    kinds = [e["event"] for e in events(tmp_path)]
    assert kinds.count("started") == 1 and "failed" in kinds, kinds
    report = json.loads((tmp_path / "launch" / f"failed-rollout-{sup.world.host}.json").read_text())
    assert report["kind"] == "rewards_hopeless" and report["code"] == 4 and report["child"] == "rollout-0"
    assert "the rewards stopped working" in report["tail"]
