"""A job's life as a user meets it, with real processes: Ctrl-C in a terminal, kill and resume over gloo, and a
rollout server that leaves. Each test stops only the processes it started (by PID)."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from tests.e2e.conftest import RunProcess, job_args, read_jsonl, wait_for

CLI = [sys.executable, "-m", "fleetrl.app.cli"]


class TerminalRun:
    """`fleetrl run` on a pseudo-terminal: the session leader with the terminal as its controlling tty, so that
    writing ^C to the terminal makes the kernel send SIGINT to its foreground process group — a real Ctrl-C."""

    def __init__(self, argv: list[str]):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: becomes `fleetrl run`
            os.execv(sys.executable, argv)
        self.output = bytearray()
        self.status: int | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                ready, _, _ = select.select([self.fd], [], [], 0.2)
                if ready:
                    data = os.read(self.fd, 65536)
                    if not data:
                        return
                    self.output.extend(data)
            except OSError:  # the terminal closed: the process exited
                return

    def ctrl_c(self) -> None:
        os.write(self.fd, b"\x03")

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
                self._reader.join(5)
                return self.status
            time.sleep(0.1)
        return None

    def kill(self) -> None:
        if self.status is None:
            for child in psutil.Process(self.pid).children(recursive=True):
                child.kill()
            os.kill(self.pid, signal.SIGKILL)
            self.wait(10)
        os.close(self.fd)

    def text(self) -> str:
        return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", self.output.decode(errors="replace"))


def log_time(path: Path, pattern: str) -> str:
    """The HH:MM:SS of the last line of a component's log matching ``pattern``."""
    [*_, line] = [line for line in path.read_text().splitlines() if re.search(pattern, line)]
    return line[:8]


def test_ctrl_c_in_a_terminal_checkpoints_and_stops_everything_in_order(
    tmp_path, tiny_model_dir, arith_data, empty_config
):
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "fleetrl.app.cli",
        "run",
        "--config",
        empty_config,
        "--run-dir",
        str(run_dir),
        *job_args(
            tiny_model_dir,
            arith_data,
            "learner.total_steps=100000",
            "checkpoint.interval=0",
            "sync.transport=gloo",
            "run.stop_timeout_s=90",
        ),
    ]
    run = TerminalRun(argv)
    try:
        wait_for(lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= 3, 300, "three learner steps")
        children = [c.pid for c in psutil.Process(run.pid).children(recursive=True)]
        assert len(children) >= 3
        t0 = time.monotonic()
        run.ctrl_c()  # the terminal sends SIGINT to the whole foreground process group
        assert run.wait(90 + 30) == 130, run.text()
        stop_s = time.monotonic() - t0
    finally:
        run.kill()
    out = run.text()
    assert stop_s < 90, out  # within run.stop_timeout_s
    assert not [p for p in children if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    [meta] = [json.loads(p.read_text()) for p in sorted((run_dir / "checkpoints").glob("step-*/meta.json"))[-1:]]
    assert meta["step"] == steps[-1] >= 3  # the final checkpoint holds the last step trained
    # one line per process, saying how it ended
    learner = re.search(
        r"fleetrl run: learner +exit 0: learner stopped \(SIGTERM\) at step (\d+) .*final checkpoint "
        r"step-\d+",
        out,
    )
    assert learner and int(learner.group(1)) == meta["step"], out
    assert re.search(r"fleetrl run: rollout-0 +exit 0: stopped \(stop requested\)", out), out
    broker = re.search(
        r"fleetrl run: broker +exit 0: broker stopped: (\d+) groups in, (\d+) consumed by learners, (\d+) still "
        r"queued, (\d+) dropped stale",
        out,
    )
    assert broker, out
    into, consumed, queued, stale = map(int, broker.groups())
    assert into == consumed + queued + stale > 0, out  # every group accounted for once (given-back ones too)
    # the broker stayed up until the learner was done with it
    logs = run_dir / "logs"
    assert log_time(logs / "broker.log", "broker stopped") >= log_time(logs / "learner.log", "learner stopped")
    assert "BrokerUnavailable" not in (logs / "learner.log").read_text()


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher and everything under it, children first (no graceful stop anywhere)."""
    for child in psutil.Process(proc.pid).children(recursive=True):
        child.kill()
    proc.kill()
    proc.wait(30)


def newest_checkpoint(run_dir: Path) -> int:
    return max(json.loads(p.read_text())["step"] for p in (run_dir / "checkpoints").glob("step-*/meta.json"))


def test_kill_and_resume_a_gloo_run_with_a_rollout_that_joins_late(tmp_path, tiny_model_dir, arith_data, empty_config):
    """The resumed learner's first round closes before the rollout (started by hand, after it) joins: the
    catch-up round reaches it, training goes on from the checkpoint, and the rollout exits when it is done."""
    run_dir = tmp_path / "run"
    first = RunProcess(
        run_dir,
        empty_config,
        job_args(
            tiny_model_dir, arith_data, "learner.total_steps=100000", "checkpoint.interval=2", "sync.transport=gloo"
        ),
    )
    try:
        wait_for(
            lambda: (
                (run_dir / "checkpoints").is_dir()
                and any((run_dir / "checkpoints").glob("step-*/meta.json"))
                and len(read_jsonl(run_dir / "metrics.jsonl")) >= 3
            ),
            300,
            "a checkpoint and three steps",
        )
        kill_tree(first.proc)
    finally:
        first.stop()
    resumed_from = newest_checkpoint(run_dir)
    target = resumed_from + 3
    killed_pid = json.loads((run_dir / "learner.ready").read_text())["pid"]

    def resumed_learner_ready() -> bool:
        try:
            return json.loads((run_dir / "learner.ready").read_text())["pid"] != killed_pid
        except (OSError, ValueError):
            return False

    before = len(read_jsonl(run_dir / "metrics.jsonl"))
    out = (tmp_path / "resume.out").open("w")
    resume = subprocess.Popen(
        [
            *CLI,
            "run",
            "--resume",
            str(run_dir),
            "--no-status",
            "rollout.num_servers=0",
            f"learner.total_steps={target}",
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    rollout = None
    try:
        wait_for(resumed_learner_ready, 300, "the resumed learner")
        time.sleep(1.0)  # its first round (of the resumed weights) has closed: nobody had joined
        rollout_log = (tmp_path / "rollout.log").open("w")
        rollout = subprocess.Popen(
            [
                *CLI,
                "rollout",
                "--config",
                str(run_dir / "config.yaml"),
                "--run-dir",
                str(run_dir),
                "--server-index",
                "0",
            ],
            stdout=rollout_log,
            stderr=subprocess.STDOUT,
        )
        assert resume.wait(300) == 0, (tmp_path / "resume.out").read_text()
        assert rollout.wait(60) == 0  # a rollout started by hand exits when the learner is done
    finally:
        for proc in (resume, rollout):
            if proc is not None and proc.poll() is None:
                kill_tree(proc)
        out.close()
    rows = read_jsonl(run_dir / "metrics.jsonl")[before:]
    assert [r["step"] for r in rows] == list(range(resumed_from + 1, target + 1))  # steps continue from the checkpoint
    summary = (tmp_path / "resume.out").read_text()
    assert "done — 3 steps" in summary, summary  # the resumed part only
    rollout_text = (tmp_path / "rollout.log").read_text()
    assert "closed before this server joined" in rollout_text  # it really came too late for the first round
    assert re.search(r"stopped \(done: training finished at step \d+\)", rollout_text)
    assert "asking the learner for a catch-up round" in rollout_text
    assert re.search(
        r"catch-up round \d+ sent version \d+ to 1 receiver", (run_dir / "logs" / "learner.log").read_text()
    )


def test_a_rollout_that_stops_leaves_the_fleet_and_the_rounds_at_once(
    tmp_path, tiny_model_dir, arith_data, empty_config
):
    run_dir = tmp_path / "run"
    run = RunProcess(
        run_dir,
        empty_config,
        job_args(
            tiny_model_dir,
            arith_data,
            "learner.total_steps=100000",
            "checkpoint.interval=0",
            "sync.transport=gloo",
            "rollout.num_servers=2",
            "broker.client_timeout_s=60",
        ),
    )
    try:
        wait_for(
            lambda: any(r.get("sync/receivers") == 2 for r in read_jsonl(run_dir / "metrics.jsonl")),
            300,
            "rounds with both rollouts",
        )
        pid = json.loads((run_dir / "rollout-1.ready").read_text())["pid"]
        os.kill(pid, signal.SIGTERM)  # as an operator would stop it
        psutil.Process(pid).wait(60)
        stopped_at = len(read_jsonl(run_dir / "metrics.jsonl"))
        wait_for(lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= stopped_at + 8, 60, "eight more steps")
        after = read_jsonl(run_dir / "metrics.jsonl")[stopped_at + 2 :]
    finally:
        run.stop()
    assert all(r["fleet/servers"] == 1 and r["sync/receivers"] == 1 for r in after), after
    # no step waits for the server that left (the round waits up to 5 s for every receiver it expects)
    assert max(r["timing/sync_s"] for r in after) < 2.0
    assert re.search(r"rollout rollout-1-\S+ left \(stop requested\)", (run_dir / "logs" / "broker.log").read_text())
