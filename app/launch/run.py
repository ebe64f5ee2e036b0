"""`fleetrl run`: a whole job on one machine — broker, rollout servers and learner as child processes.

The launcher knows the components only as command lines (`fleetrl broker|rollout|learner`) and reads
what they write into the run directory (ready files, metrics.jsonl). It

- starts the broker, ``rollout.num_servers`` rollout servers and the learner (under torchrun when
  ``learner.num_ranks > 1``) at once — the clients wait for the broker's ``broker.json`` themselves —
  and waits for each ready file, with a timeout that names the process and its log; then prints when
  each was ready (counted from the launcher's own start);
- shows one live status line (step, version, reward, eval accuracy, KL, staleness, queue, samples/s,
  ETA) until the learner finishes;
- on Ctrl-C / SIGTERM stops the learner first (it finishes its step and checkpoints while the broker
  is still up), then the rollouts, then the broker, all within ``run.stop_timeout_s``, and prints one
  line per process saying how it ended; a second Ctrl-C kills them at once. If any child dies
  unexpectedly it says which, shows the tail of its log, stops the others and exits non-zero.

Every child runs in a process group of its own, so a Ctrl-C in the terminal (a SIGINT to the
launcher's whole process group) reaches the launcher alone, which then stops the job in that order.
Children get PR_SET_PDEATHSIG too, so even a killed launcher leaves no orphan behind.

Before anything starts (and before the run directory exists) ``app/checks.py`` checks what
the config names: a mistake is one line naming the key, exit code 2. ``--resume RUN_DIR`` continues a
run from its newest checkpoint with the run's own config.yaml.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from fleetrl.app.checks import check_job, resume_problem
from fleetrl.common.config import ConfigError, load_config, save_resolved
from fleetrl.common.config.names import defaults_used
from fleetrl.common.config.schema import JobConfig
from fleetrl.common.net import free_port
from fleetrl.common.telemetry.startup import STARTUP

POLL_S = 0.25
READY_POLL_S = 0.02  # how often start-up looks for a ready file: a stat call, so the wait adds <= 20 ms
CPU_SAMPLE_S = 1.0  # the CPU meter's period: walking the process trees at every poll cost the launcher ~2% of a core
EXIT_REWARDS_HOPELESS = (
    4  # a rollout server's exit code when its rewards stopped giving usable scores (rollout/server.py)
)
DONE_GRACE_S = 20.0  # after the learner finished: how long rollouts get to exit on its `done` before SIGTERM
# (a vLLM rollout finishes its groups, then shuts its engine core down: ~6 s on a loaded 2-core box)
LOG_LINE = re.compile(
    r"^\d\d:\d\d:\d\d \w \S+ \S+: (.*)$"
)  # common/telemetry/logs.py's format: time, level, process, logger
FINAL_WORDS = re.compile(r"\b(stopped|done|left)\b")  # the last line each component logs says what it did


class LaunchError(RuntimeError):
    pass


def _die_with_parent() -> None:  # runs in the child between fork and exec
    # SIGUSR1 is Slurm's walltime warning for the launcher; srun delivers a forwarded signal to every process of
    # the step (proctrack), so a child ignores it (inherited across exec) and waits for its supervisor's SIGTERM
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class Child:
    name: str
    argv: list[str]
    log: Path
    env: dict[str, str]
    ready_file: Path | None = None
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    ready_at: float | None = None  # time.time() when the launcher saw its ready file
    log_handle: object = field(default=None, repr=False)

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.log_handle = self.log.open("ab")
        if self.ready_file is not None:
            self.ready_file.unlink(missing_ok=True)
        # process_group=0: a group of its own, so a terminal's Ctrl-C (SIGINT to the launcher's group) reaches
        # only the launcher, which stops the children in order (the broker last)
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self.log_handle,
            stderr=subprocess.STDOUT,
            env=self.env,
            preexec_fn=_die_with_parent,
            stdin=subprocess.DEVNULL,
            process_group=0,
        )
        self.started_at = time.monotonic()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def signal(self, sig: int) -> None:
        if self.alive:
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; always reaps the process."""
        if self.proc is None:
            return None
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
            if self.wait(timeout) is None:
                self.kill()
        self.close_log()
        return self.proc.returncode

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def close_log(self) -> None:
        if self.log_handle is not None:
            self.log_handle.close()
            self.log_handle = None

    def last_line_with(self, text: str) -> str:
        """The last line of its log that contains ``text`` (e.g. the reason a rollout server gave for stopping),
        or "" (lines logged after it, such as requests the closing engine failed, do not hide it)."""
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return next((line for line in reversed(lines) if text in line), "")

    def last_words(self) -> str:
        """The last line of its log that says how it ended (its final `stopped` / `done` line), without the prefix."""
        try:
            lines = self.log.read_text(errors="replace").splitlines()[-200:]
        except OSError:
            return ""
        for line in reversed(lines):
            m = LOG_LINE.match(line)
            if m and FINAL_WORDS.search(m.group(1)):
                return m.group(1)
        return ""


def make_run_dir(cfg: JobConfig, override: str | None) -> Path:
    if override or cfg.run.dir:
        run_dir = Path(override or cfg.run.dir)
    else:
        run_dir = Path(cfg.run.root) / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def thread_plan(cfg: JobConfig) -> tuple[int, int]:
    """(threads per learner rank, threads per rollout server): run.*_threads, else an even split of the cores.

    Each learner rank and each rollout server gets cores / (ranks + servers) threads, at least one, so the
    job's busy threads never outnumber the cores. Measured on a quiet 2-core box (docs/benchmarks.md,
    "Overlap", 2026-12-05): the demo at 1 + 1 threads trained 487 samples/s with 1.55 cores busy; at 2 + 2
    (every core to each side, the default for a day) it kept 1.78 cores busy but trained only 372 samples/s,
    the two sides' threads contending for the same cores. An earlier measurement that favoured 2 + 2 was
    taken on a VM short of CPU (others' share 11-34%).
    """
    cores = os.cpu_count() or 1
    per = max(1, cores // max(1, cfg.learner.num_ranks + cfg.rollout.num_servers))
    return cfg.run.learner_threads or per, cfg.run.rollout_threads or per


def child_env(threads: int, broker_wait_s: float = 0.0) -> dict[str, str]:
    """A child's environment; ``broker_wait_s``: how long a client waits for the broker's broker.json (it starts
    alongside the broker, broker/client/address.py)."""
    env = dict(os.environ)
    if broker_wait_s:
        env["FLEETRL_BROKER_WAIT_S"] = f"{broker_wait_s:g}"
    env.update(
        FLEETRL_CHILD="1",
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_DATASETS_DISABLE_PROGRESS_BARS="1",
        TQDM_DISABLE="1",  # children write log files: no bars
        PYTHONUNBUFFERED="1",
    )
    return env


def plan_children(cfg: JobConfig, run_dir: Path, config_path: Path) -> list[Child]:
    """The processes of one job, in start order."""
    py = [sys.executable, "-m", "fleetrl.app.cli"]
    job = ["--config", str(config_path), "--run-dir", str(run_dir)]
    logs = run_dir / "logs"
    learner_threads, rollout_threads = thread_plan(cfg)
    wait = cfg.run.ready_timeout_s  # clients start with the broker and wait this long for its broker.json
    children = []
    if cfg.needs_fleet:
        children.append(
            Child("broker", [*py, "broker", *job], logs / "broker.log", child_env(1), run_dir / "broker.json")
        )
        for i in range(cfg.rollout.num_servers):
            children.append(
                Child(
                    f"rollout-{i}",
                    [*py, "rollout", *job, "--server-index", str(i)],
                    logs / f"rollout-{i}.log",
                    child_env(rollout_threads, wait),
                    run_dir / f"rollout-{i}.ready",
                )
            )
    if cfg.learner.num_ranks > 1:
        learner = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(cfg.learner.num_ranks),
            "--master-port",
            str(free_port()),
            "-m",
            "fleetrl.app.learner",
            *job,
        ]
    else:
        learner = [*py, "learner", *job]
    children.append(
        Child("learner", learner, logs / "learner.log", child_env(learner_threads, wait), run_dir / "learner.ready")
    )
    return children


class Launcher:
    def __init__(self, cfg: JobConfig, run_dir: Path, status: bool = True, resumed: bool = False):
        self.cfg, self.run_dir, self.show_status, self.resumed = cfg, run_dir, status, resumed
        self.config_path = save_resolved(cfg, run_dir)  # local paths absolute: --resume works from any directory
        self.children = plan_children(cfg, run_dir, self.config_path)
        self.stop_requested = False
        self.force = False  # a second Ctrl-C while stopping: kill what is left now
        self.started = time.monotonic()

    def _on_signal(self, signum, frame) -> None:
        if self.stop_requested and not self.force:
            self.force = True
            print("\nfleetrl run: second interrupt: killing what is left", flush=True)
        self.stop_requested = True

    def wait_ready(self, child: Child) -> None:
        deadline = time.monotonic() + self.cfg.run.ready_timeout_s
        while not (child.ready_file and child.ready_file.exists()):
            if not child.alive:
                raise LaunchError(
                    f"{child.name} exited with code {child.returncode} while starting; "
                    f"its log ({child.log}) ends with:\n{child.tail()}"
                )
            if self.stop_requested:
                raise KeyboardInterrupt
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"{child.name} did not report ready within run.ready_timeout_s="
                    f"{self.cfg.run.ready_timeout_s:g} s; see its log {child.log}:\n{child.tail()}"
                )
            time.sleep(READY_POLL_S)
        child.ready_at = time.time()

    def start_all(self) -> None:
        """Start every child at once, the broker first (its start removes a previous run's broker.json before a
        client looks for it); the clients wait for the new one themselves (FLEETRL_BROKER_WAIT_S), so their imports
        and model loading overlap the broker's start. Then wait for each to report ready."""
        for child in self.children:
            child.start()
        for child in self.children:
            self.wait_ready(child)

    def supervise(self, learner: Child) -> None:
        """Restart children that died (run.restart_policy: on-failure), or fail the job naming the dead one."""
        for child in self.children:
            code = child.returncode
            if child.alive or code in (0, None) or (child is learner and code == 0):
                continue
            if code == EXIT_REWARDS_HOPELESS:  # the rewards cannot score this data: a restart scores nothing again
                raise LaunchError(
                    f"{child.name} stopped: its rewards gave no usable score for "
                    f"rollout.reward_stop_after={self.cfg.rollout.reward_stop_after} samples in a row; "
                    f"its log ({child.log}) says:\n{child.last_line_with('stopping: ') or child.tail(6)}"
                )
            if self.cfg.run.restart_policy == "on-failure" and child.restarts < self.cfg.run.max_restarts:
                self.restart(child, code)
            else:
                raise LaunchError(
                    f"{child.name} died with exit code {code}; its log ({child.log}) ends with:\n{child.tail()}"
                )

    def ready_line(self) -> str:
        """``3 processes ready in 4.9 s (checks done at 1.0 s; broker ready at 1.6, ...)``, every time counted
        from this launcher's exec (each child's log has its own phases on its ``start-up: ready`` line)."""
        t0 = STARTUP.start
        ready = ", ".join(f"{c.name} at {c.ready_at - t0:.1f}" for c in self.children if c.ready_at is not None)
        return (
            f"{len(self.children)} processes ready in {time.time() - t0:.1f} s (checks done at "
            f"{STARTUP.last - t0:.1f} s; ready: {ready} s)"
        )

    def broker_address(self) -> str:
        """The address the broker bound (its ``broker.json``), or "?" when it wrote none."""
        try:
            return json.loads((self.run_dir / "broker.json").read_text())["address"]
        except (OSError, ValueError, KeyError):
            return "?"

    def restart(self, child: Child, code: int) -> None:
        """Start a dead child again: the broker on its old ports (clients reconnect to them) and from its
        spool, the learner from its newest checkpoint."""
        child.restarts += 1
        child.close_log()
        if child.name == "broker" and not any(a.startswith("broker.port=") for a in child.argv):
            endpoint = json.loads((self.run_dir / "broker.json").read_text())
            port, pub_port = (endpoint[k].rsplit(":", 1)[1] for k in ("address", "pub_address"))
            child.argv = [*child.argv, f"broker.port={port}", f"broker.pub_port={pub_port}"]
        if child.name == "learner" and "checkpoint.resume=auto" not in child.argv:
            child.argv = [*child.argv, "checkpoint.resume=auto"]
        event = {
            "time": time.time(),
            "event": "restart",
            "child": child.name,
            "exit_code": code,
            "restart": child.restarts,
        }
        with (self.run_dir / "events.jsonl").open("a") as f:
            f.write(json.dumps(event) + "\n")
        print(
            f"fleetrl run: {child.name} died (exit code {code}); restarting it "
            f"({child.restarts}/{self.cfg.run.max_restarts})",
            flush=True,
        )
        child.start()

    # ------------------------------------------------------------------------------ stopping

    def stages(self) -> list[list[Child]]:
        """Stop order: the learner (it checkpoints and still needs the broker), the rollouts, the broker."""
        rank = lambda c: {"learner": 0, "broker": 2}.get(c.name, 1)  # noqa: E731
        return [[c for c in self.children if rank(c) == r] for r in range(3)]

    def shutdown(self, learner_done: bool = False) -> None:
        """Stop every child within run.stop_timeout_s, in stage order, and say how each one ended.

        The learner gets all but a reserve of the budget (min(30 s, a quarter)); the rollouts and the
        broker share the reserve. With ``learner_done`` the rollouts first get DONE_GRACE_S to exit on
        the learner's `done` by themselves. A child still running at its stage's deadline is killed."""
        budget = self.cfg.run.stop_timeout_s
        t0 = time.monotonic()
        reserve = min(30.0, budget / 4)
        deadlines = [t0 + budget - reserve, t0 + budget - reserve / 3, t0 + budget]
        for stage, deadline in zip(self.stages(), deadlines):
            if learner_done and stage and stage[0].name.startswith("rollout"):
                self._wait_all(stage, min(deadline, time.monotonic() + DONE_GRACE_S))
            started = time.monotonic()
            for child in stage:
                child.signal(signal.SIGTERM)
            self._wait_all(stage, deadline)
            for child in stage:
                killed = child.alive
                child.kill()
                child.close_log()
                self.report(child, time.monotonic() - started, killed)

    def _wait_all(self, stage: list[Child], deadline: float) -> None:
        while any(c.alive for c in stage) and time.monotonic() < deadline and not self.force:
            time.sleep(0.05)

    def report(self, child: Child, seconds: float, killed: bool) -> None:
        if child.proc is None:
            return
        if killed:
            how = (
                f"killed after {seconds:.1f} s (second interrupt)"
                if self.force
                else f"killed: still running {seconds:.1f} s after SIGTERM (run.stop_timeout_s={self.cfg.run.stop_timeout_s:g})"
            )
        else:
            how = f"exit {child.returncode}"
        words = child.last_words()
        print(f"fleetrl run: {child.name:<10} {how}{': ' + words if words else ''}", flush=True)

    # ------------------------------------------------------------------------------- the run

    def _pids(self) -> dict[str, int]:
        return {c.name: c.proc.pid for c in self.children if c.proc is not None and c.alive}

    def run(self) -> int:
        from fleetrl.app.launch.cpu import CpuMeter
        from fleetrl.app.launch.status import StatusLine

        old = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        learner = next(c for c in self.children if c.name == "learner")
        line = StatusLine(self.cfg, self.run_dir, enabled=self.show_status)
        if self.resumed:  # rates and counts of this part of the run only
            line.tail.skip_existing()
            line.event_tail.skip_existing()
        try:
            self.start_all()
            print(f"fleetrl run: {self.ready_line()}; run directory {self.run_dir}", flush=True)
            if any(c.name == "broker" for c in self.children):
                print(
                    f"fleetrl run: broker at {self.broker_address()}; watch it with `fleetrl status --broker "
                    f"{self.run_dir}`",
                    flush=True,
                )
            rl_start = time.monotonic()
            cpu = CpuMeter()
            cpu.begin(self._pids())
            next_cpu = rl_start + CPU_SAMPLE_S
            with line:
                while not self.stop_requested:
                    self.supervise(learner)
                    if not learner.alive:
                        break
                    line.update()
                    if time.monotonic() >= next_cpu:  # walking the process trees costs: not at every poll
                        cpu.sample(self._pids())
                        next_cpu += CPU_SAMPLE_S
                    time.sleep(POLL_S)
                line.update()
            if self.stop_requested:
                print(
                    f"fleetrl run: stopping: the learner finishes its step and checkpoints, then the rollouts and "
                    f"the broker stop (within run.stop_timeout_s={self.cfg.run.stop_timeout_s:g}; Ctrl-C again "
                    "kills them)",
                    flush=True,
                )
                self.shutdown()
                return 130
            code = learner.returncode
            if code != 0:
                raise LaunchError(
                    f"learner exited with code {code}; its log ({learner.log}) ends with:\n{learner.tail()}"
                )
            summary = line.summary(time.monotonic() - rl_start)
            cpu.sample(self._pids())  # the children still running, up to now (a short run may have had no sample)
            used = cpu.result()
            cpu.save(used, self.run_dir)
            self.shutdown(learner_done=True)
            print(summary, flush=True)
            print(cpu.line(used), flush=True)
            return 0
        except LaunchError as e:
            print(f"fleetrl run: {e}", file=sys.stderr, flush=True)
            self.shutdown()
            return 1
        except KeyboardInterrupt:
            self.shutdown()
            return 130
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)


def resolve(args, notes: list[str] | None = None) -> tuple[JobConfig, Path | None, bool]:
    """The job's config, its run directory when known (--resume, --run-dir) and whether it resumes; the notes on
    the names it read go to ``notes``."""
    if args.resume:
        run_dir = Path(args.resume)
        problem = resume_problem(run_dir, None)
        if problem:
            raise ConfigError(problem)
        if args.config:
            raise ConfigError("--resume takes the run's own config.yaml; drop --config (overrides still apply)")
        cfg = load_config(run_dir / "config.yaml", [*args.overrides, "checkpoint.resume=auto"], notes)
        problem = resume_problem(run_dir, cfg)
        if problem:
            raise ConfigError(problem)
        return cfg, run_dir, True
    if not args.config:
        raise ConfigError("pass --config FILE (a job YAML, see configs/), or --resume RUN_DIR to continue a run")
    return load_config(args.config, [*args.overrides], notes), None, False


def main(args) -> int:
    STARTUP.mark("python+imports")
    notes: list[str] = []  # printed here, once: the children read the resolved config.yaml, which needs none
    cfg, run_dir, resumed = resolve(args, notes)
    if cfg.broker.address is None and cfg.broker.host in ("127.0.0.1", "localhost"):
        cfg = _free_ports(cfg)  # one machine: free ports
    STARTUP.mark("config")
    problems = check_job(cfg)
    STARTUP.mark("checks")
    if problems:  # before the run directory exists: a job that cannot start leaves nothing behind
        for problem in problems:
            print(f"fleetrl run: {problem}", file=sys.stderr)
        return 2
    for note in notes + ([] if resumed else defaults_used(cfg, args.config, args.overrides)):
        print(f"fleetrl run: note: {note}", file=sys.stderr)
    run_dir = run_dir or make_run_dir(cfg, args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"fleetrl run: {cfg.run.name} -> {run_dir}{' (resuming from its newest checkpoint)' if resumed else ''}",
        flush=True,
    )
    (run_dir / "launch.json").write_text(json.dumps({"pid": os.getpid(), "argv": sys.argv}))
    return Launcher(cfg, run_dir, status=not args.no_status, resumed=resumed).run()


def _free_ports(cfg: JobConfig) -> JobConfig:
    import msgspec

    return msgspec.structs.replace(cfg, broker=msgspec.structs.replace(cfg.broker, port=0, pub_port=0))
