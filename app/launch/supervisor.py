"""The per-node supervisor: runs one role's processes on one node of a cluster job.

    python -m fleetrl.app.launch.supervisor --role rollout --config RUN/config.yaml --run-dir RUN

A launcher (an `srun` step, a Kubernetes pod, ...) starts one supervisor per node and role. It asks the
world map where it is, then

- waits for the broker's port (rollout and learner roles), failing within ``cluster.broker_wait_s`` with
  the address and the local interface it tried instead of hanging;
- starts the role's processes: the broker; this node's rollout servers (one per GPU or tensor-parallel
  group, ``CUDA_VISIBLE_DEVICES`` sliced); this node's learner ranks (torchrun when a node runs several,
  else the rank itself with ``RANK``/``WORLD_SIZE`` from the world map);
- restarts a rollout server that crashed, at most ``cluster.rollout.max_restarts`` times (never one that exits
  4, rewards hopeless: it reports it, and the job driver ends the job), each attempt
  logging to ``RUN/logs/<name>/attempt-<k>/output.log``; a server that gives up leaves the others running;
- exits non-zero when the broker or a learner rank dies, after writing ``RUN/launch/failed-<role>-<host>.json``
  (who, exit code, log, its tail) for the job driver to name the cause;
- on SIGTERM, SIGINT or SIGUSR1 (Slurm's walltime warning) stops its processes — the learner first, which
  checkpoints — and exits 0.

Every start, ready, death and restart goes to ``RUN/launch/events.jsonl`` with the seconds since the
allocation started (``FLEETRL_ALLOC_START``), which is what docs/benchmarks.md's launch figures read.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from fleetrl.app.launch.run import EXIT_REWARDS_HOPELESS, Child, child_env
from fleetrl.app.launch.world import Layout, World, world_map
from fleetrl.common.config import load_config
from fleetrl.common.config.schema import JobConfig

POLL_S = 0.2
EXIT_BROKER_UNREACHABLE = 4
REWARDS_HOPELESS = "rewards_hopeless"  # a failure report's kind: a rollout exited 4; the job driver ends the job


def log_event(run_dir: Path, **event) -> None:
    """One line of RUN/launch/events.jsonl (append-only, shared by every node's supervisor)."""
    event = {"time": time.time(), **event}
    start = os.environ.get("FLEETRL_ALLOC_START")
    if start:
        event["since_alloc_s"] = round(event["time"] - float(start), 3)
    path = run_dir / "launch" / "events.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(event) + "\n")


def local_interface(host: str, port: int) -> tuple[str, str]:
    """(local address, interface name) this node would use to reach ``host`` ('?' when unknown)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            addr = s.getsockname()[0]
    except OSError:
        return "?", "?"
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == addr for a in addrs):
            return addr, name
    return addr, "?"


def wait_for_broker(address: str, timeout_s: float, interface: str | None) -> None:
    """Block until the broker's TCP port accepts; raise with the address and interface tried."""
    url = urlparse(address)
    host, port = url.hostname or "", url.port or 0
    deadline, error = time.monotonic() + timeout_s, "no attempt"
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout_s)):
                return
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
        time.sleep(0.25)
    local, ifname = local_interface(host, port)
    raise ConnectionError(
        f"the broker at {address} is unreachable from {socket.gethostname()} (local address {local}, interface "
        f"{ifname}{'' if not interface else f', cluster.interface={interface}'}) after {timeout_s:g} s: {error}; check "
        f"that the broker started (RUN/logs/broker), that {host} resolves to an address this node can reach, "
        f"and that port {port} is open between nodes (cluster.base_port), or raise cluster.broker_wait_s"
    )


class Supervisor:
    def __init__(self, cfg: JobConfig, world: World, run_dir: Path, config_path: Path, python: str = sys.executable):
        self.cfg, self.world, self.run_dir, self.config_path = cfg, world, run_dir, config_path
        self.python = python
        self.children = self.plan()
        self.attempts = {c.name: 0 for c in self.children}
        self.died_at: dict[str, float] = {}
        self.given_up: set[str] = set()
        self.crashed: set[str] = set()  # rollout servers given up after their restarts (not those that finished)
        self.stop_signal: int | None = None

    # ---------------------------------------------------------------------------- planning

    def _job(self) -> list[str]:
        return ["--config", str(self.config_path), "--run-dir", str(self.run_dir)]

    def plan(self) -> list[Child]:
        w, cli = self.world, [self.python, "-m", "fleetrl.app.cli"]
        env = {**child_env(1), **w.env()}
        if w.role == "broker":
            return [
                Child(
                    "broker", [*cli, "broker", *self._job(), *w.overrides()], Path(), env, self.run_dir / "broker.json"
                )
            ]
        if w.role == "rollout":
            threads = max(1, self.cfg.cluster.rollout.cpus_per_server)
            children = []
            for index, gpus in zip(w.rollout_indices, w.rollout_gpus):
                child_env_i = {**child_env(threads), **w.env()}
                if gpus:
                    child_env_i["CUDA_VISIBLE_DEVICES"] = gpus
                argv = [
                    *cli,
                    "rollout",
                    *self._job(),
                    "--server-index",
                    str(index),
                    "--broker",
                    w.broker_address,
                    *w.overrides(),
                ]
                children.append(
                    Child(f"rollout-{index}", argv, Path(), child_env_i, self.run_dir / f"rollout-{index}.ready")
                )
            return children
        return [self._learner(env)]

    def _learner(self, env: dict[str, str]) -> Child:
        w = self.world
        env.update(child_env(max(1, self.cfg.cluster.learner.cpus_per_rank)), **{k: v for k, v in w.env().items()})
        args = [*self._job(), *w.overrides(), "checkpoint.resume=auto"]
        if w.nproc_per_node == 1:  # one rank on this node: it is the process, no launcher needed
            env.update(RANK=str(w.node_rank if w.rank is None else w.rank), LOCAL_RANK="0")
            argv = [self.python, "-m", "fleetrl.app.cli", "learner", *args]
        else:
            for key in ("RANK", "LOCAL_RANK"):
                env.pop(key, None)
            argv = [
                self.python,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                str(w.nnodes),
                "--node-rank",
                str(w.node_rank),
                "--nproc-per-node",
                str(w.nproc_per_node),
                "--master-addr",
                w.master_addr,
                "--master-port",
                str(w.master_port),
                "-m",
                "fleetrl.app.learner",
                *args,
            ]
        name = "learner" if w.node_rank == 0 else f"learner-node{w.node_rank}"
        ready = self.run_dir / "learner.ready" if w.node_rank == 0 else None
        return Child(name, argv, Path(), env, ready)

    # ----------------------------------------------------------------------------- running

    def start(self, child: Child) -> None:
        attempt = self.attempts[child.name]
        child.log = self.run_dir / "logs" / child.name / f"attempt-{attempt}" / "output.log"
        child.start()
        log_event(
            self.run_dir,
            host=self.world.host,
            role=self.world.role,
            child=child.name,
            event="started",
            attempt=attempt,
            pid=child.proc.pid,
        )

    def _on_signal(self, signum, frame) -> None:
        self.stop_signal = signum

    def run(self) -> int:
        handled = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
        main = threading.current_thread() is threading.main_thread()  # signals can be caught only there
        old = {sig: signal.signal(sig, self._on_signal) for sig in handled} if main else {}
        try:
            if self.world.role != "broker":
                wait_for_broker(self.world.broker_address, self.cfg.cluster.broker_wait_s, self.world.interface)
            for child in self.children:
                self.start(child)
            return self.loop()
        except ConnectionError as e:
            print(f"fleetrl supervisor ({self.world.role} on {self.world.host}): {e}", file=sys.stderr, flush=True)
            self.fail(self.world.role, EXIT_BROKER_UNREACHABLE, str(e), None)
            return EXIT_BROKER_UNREACHABLE
        finally:
            self.stop_all()
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def loop(self) -> int:
        waiting = {c.name for c in self.children if c.ready_file is not None}
        while self.stop_signal is None:
            for child in self.children:
                if child.name in waiting and child.ready_file.exists():
                    waiting.discard(child.name)
                    self.on_ready(child)
                code = child.returncode
                if code is None or child.name in self.given_up:
                    continue
                if self.world.role != "rollout":
                    return self.on_critical_exit(child, code)
                if self.on_rollout_exit(child, code):
                    waiting.add(child.name)
            if self.world.role == "rollout" and all(c.name in self.given_up for c in self.children):
                # every server finished (exit 0: the broker said `done`, maybe before the job driver marked it) or
                # the job is over: a clean end; servers that crashed out of their restarts: a failed step
                return 1 if self.crashed and not self.job_done() else 0
            time.sleep(POLL_S)
        log_event(
            self.run_dir,
            host=self.world.host,
            role=self.world.role,
            event="stopping",
            signal=signal.Signals(self.stop_signal).name,
        )
        return 0

    def on_ready(self, child: Child) -> None:
        event = {
            "host": self.world.host,
            "role": self.world.role,
            "child": child.name,
            "event": "ready",
            "attempt": self.attempts[child.name],
            "start_s": round(time.monotonic() - child.started_at, 3),
        }
        if child.name in self.died_at:
            event.update(event="rejoined", since_death_s=round(time.time() - self.died_at.pop(child.name), 3))
            print(
                f"fleetrl supervisor: {child.name} is back in the fleet {event['since_death_s']:.1f} s after it died",
                flush=True,
            )
        log_event(self.run_dir, **event)

    def on_critical_exit(self, child: Child, code: int) -> int:
        """The broker or a learner rank exited: 0 is the end of the job, anything else fails it."""
        if code == 0:
            log_event(self.run_dir, host=self.world.host, role=self.world.role, child=child.name, event="finished")
            return 0
        self.fail(child.name, code, f"{child.name} on {self.world.host} exited with code {code}", child)
        return 1

    def on_rollout_exit(self, child: Child, code: int) -> bool:
        """Restart a crashed rollout server (bounded); True when it was restarted."""
        now = time.time()
        log_event(
            self.run_dir,
            host=self.world.host,
            role="rollout",
            child=child.name,
            event="died",
            code=code,
            attempt=self.attempts[child.name],
        )
        limit = self.cfg.cluster.rollout.max_restarts
        if code == EXIT_REWARDS_HOPELESS and not self.job_done():
            # its rewards gave no usable score: a restart scores nothing again, and the other servers share the
            # rewards, so the job driver ends the job on this report (as `fleetrl run` does)
            self.given_up.add(child.name)
            self.crashed.add(child.name)
            log_event(
                self.run_dir,
                host=self.world.host,
                role="rollout",
                child=child.name,
                event="gave_up",
                why="rewards hopeless",
            )
            self.fail(
                child.name,
                code,
                f"{child.name} on {self.world.host} stopped: its rewards gave no usable "
                "score (not restarted: a restart would score nothing again)",
                child,
                kind=REWARDS_HOPELESS,
            )
            return False
        if code == 0 or self.job_done() or self.attempts[child.name] >= limit:
            self.given_up.add(child.name)
            why = "finished" if code == 0 or self.job_done() else f"gave up after {limit} restart(s)"
            log_event(self.run_dir, host=self.world.host, role="rollout", child=child.name, event="gave_up", why=why)
            if why != "finished":
                self.crashed.add(child.name)
                print(
                    f"fleetrl supervisor: {child.name} died with exit code {code}; {why}; its log {child.log} ends "
                    f"with:\n{child.tail()}",
                    file=sys.stderr,
                    flush=True,
                )
            return False
        if child.log_handle is not None:
            child.log_handle.close()
        self.attempts[child.name] += 1
        self.died_at[child.name] = now
        print(
            f"fleetrl supervisor: {child.name} died with exit code {code}; restarting it "
            f"({self.attempts[child.name]}/{limit})",
            flush=True,
        )
        self.start(child)
        return True

    def job_done(self) -> bool:
        return (self.run_dir / "launch" / "done").exists()

    def fail(self, who: str, code: int, message: str, child: Child | None, kind: str = "") -> None:
        record = {
            "kind": kind,  # "rewards_hopeless": a rollout server whose rewards gave no usable score
            "time": time.time(),
            "role": self.world.role,
            "child": who,
            "host": self.world.host,
            "code": code,
            "message": message,
            "log": str(child.log) if child else None,
            "tail": child.tail() if child else "",
        }
        path = self.run_dir / "launch" / f"failed-{self.world.role}-{self.world.host}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))
        log_event(self.run_dir, host=self.world.host, role=self.world.role, child=who, event="failed", code=code)
        if child is not None:
            print(
                f"fleetrl supervisor: {message}; its log {child.log} ends with:\n{child.tail()}",
                file=sys.stderr,
                flush=True,
            )

    def stop_all(self) -> None:
        order = sorted(self.children, key=lambda c: 0 if c.name.startswith("learner") else 1)
        for child in order:
            child.stop(timeout=180 if child.name.startswith("learner") else 30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fleetrl.app.launch.supervisor", description=__doc__.split("\n")[0])
    p.add_argument("--role", required=True, choices=["broker", "rollout", "learner"])
    p.add_argument("--config", required=True, help="the job's resolved config (RUN/config.yaml)")
    p.add_argument("--run-dir", required=True, help="the run directory on shared storage")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    run_dir = Path(args.run_dir)
    world = world_map(os.environ, args.role, Layout.from_config(cfg, str(run_dir)))
    python = cfg.cluster.python or sys.executable
    return Supervisor(cfg, world, run_dir, Path(args.config), python).run()


if __name__ == "__main__":
    sys.exit(main())
