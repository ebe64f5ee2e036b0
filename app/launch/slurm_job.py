"""The job driver: what an sbatch script rendered by `fleetrl launch slurm` runs inside its allocation.

    python -m fleetrl.app.launch.slurm_job RUN/launch/job.plan.json

It splits the allocation's nodes by role (the world map's layout), writes ``RUN/launch/world.json``
(the broker and weight-store addresses, for `--add-rollout` jobs), starts one ``srun`` step per role —
the per-node supervisor on each of the role's nodes — and then watches them:

- the learner step exits 0: the job is done; the driver marks ``RUN/launch/done``, stops the other steps
  and exits 0;
- the broker or learner step fails, or its supervisor reports a failure (``failed-<role>-<host>.json``,
  read as soon as it appears: a step with a task on a node that is cut off does not end until the node is
  back): the driver names the cause (which process, on which node, its exit code and its last log line —
  a learner rank that lost a peer names that rank and host there) in the job's output and
  ``RUN/launch/result.json``, stops the rest and exits 1, so Slurm records FAILED — or, with
  ``cluster.slurm.requeue_on_failure`` left, requeues the job, which resumes from the last checkpoint;
- a rollout step ends: the fleet goes on (its supervisors already restarted what they could);
- SIGUSR1 (``--signal=B:USR1@N``, the walltime warning): every step is asked to stop — the learner
  checkpoints and exits 0 — then the job requeues itself (``cluster.slurm.requeue``); the requeued run
  resumes from that checkpoint (the learner always starts with ``checkpoint.resume=auto``).

It also writes when every process of the job has registered (``all_ready`` in ``RUN/launch/events.jsonl``,
seconds since the allocation started) — the launch figure of docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from fleetrl.app.launch.supervisor import REWARDS_HOPELESS, log_event
from fleetrl.app.launch.world import Layout, slurm_nodes

POLL_S = 0.25
STOP_WAIT_S = 240.0
REQUEUE_WAIT_S = 30.0  # after `scontrol requeue`, Slurm ends this batch step itself


@dataclass
class Step:
    role: str
    argv: list[str]
    proc: subprocess.Popen | None = None

    def start(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(self.argv, env=env, stdin=subprocess.DEVNULL)

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()


class Driver:
    def __init__(self, plan: dict, env: dict[str, str]):
        self.plan, self.run_dir = plan, Path(plan["run_dir"])
        self.layout = Layout(**plan["layout"])
        self.env = {**env, **plan["env"], "FLEETRL_ALLOC_START": env.get("FLEETRL_ALLOC_START", str(time.time()))}
        self.alloc_start = float(self.env["FLEETRL_ALLOC_START"])
        os.environ["FLEETRL_ALLOC_START"] = self.env["FLEETRL_ALLOC_START"]  # this process's own events too
        self.job_id = env.get("SLURM_JOB_ID", "")
        self.nodes = slurm_nodes(env)  # a het job's components joined in order
        self.restart_count = int(env.get("SLURM_RESTART_COUNT", 0) or 0)
        self.failed_role = self.failure = ""
        self.walltime = self.cancel = False
        self.steps = [Step(s["role"], self.srun_argv(s)) for s in plan["steps"]]

    def role_nodes(self) -> dict[str, list[str]]:
        if self.plan["kind"] == "add-rollout":
            return {"rollout": self.nodes}
        return self.layout.split(self.nodes)

    def srun_argv(self, step: dict) -> list[str]:
        nodes = self.role_nodes()[step["role"]][: step["nodes"]]
        het = [f"--het-group={step['het_group']}"] if "het_group" in step else []
        return [
            *self.plan["srun"],
            *het,
            *step.get("options", []),
            f"--nodes={len(nodes)}",
            f"--ntasks={len(nodes)}",
            f"--nodelist={','.join(nodes)}",
            f"--job-name=fleetrl-{step['role']}",
            self.plan["python"],
            "-m",
            "fleetrl.app.launch.supervisor",
            "--role",
            step["role"],
            "--config",
            self.plan["config"],
            "--run-dir",
            str(self.run_dir),
        ]

    def write_world(self) -> None:
        roles = self.role_nodes()
        p = self.layout.base_port
        world = {
            "job_id": self.job_id,
            "nodes": roles,
            "broker_address": f"tcp://{roles['broker'][0]}:{p}",
            "sync_address": f"{roles['learner'][0]}:{p + 3}",
            "alloc_start": self.alloc_start,
            "restart_count": self.restart_count,
        }
        path = self.run_dir / "launch" / "world.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "launch" / "done").unlink(missing_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(world))
        tmp.replace(path)

    def ready_files(self) -> list[Path]:
        if self.plan["kind"] == "add-rollout":
            first = int(self.env["FLEETRL_ROLLOUT_OFFSET"])
            return [
                self.run_dir / f"rollout-{i}.ready"
                for i in range(first, first + int(self.env["FLEETRL_ROLLOUT_SERVERS"]))
            ]
        files = [self.run_dir / "learner.ready"]
        if any(s.role == "broker" for s in self.steps):
            files += [self.run_dir / "broker.json"]
            files += [self.run_dir / f"rollout-{i}.ready" for i in range(self.layout.num_servers)]
        return files

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGUSR1:
            self.walltime = True
        else:
            self.cancel = True

    def run(self) -> int:
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        if self.plan["kind"] == "job":
            self.write_world()
            for f in [*self.ready_files(), *(self.run_dir / "launch").glob("failed-*.json")]:
                f.unlink(missing_ok=True)
        log_event(
            self.run_dir,
            event="job_start",
            kind=self.plan["kind"],
            job_id=self.job_id,
            nodes=self.nodes,
            restart_count=self.env.get("SLURM_RESTART_COUNT", "0"),
        )
        for step in self.steps:
            print(f"fleetrl job: starting {step.role}: {' '.join(step.argv)}", flush=True)
            step.start(self.env)
        try:
            code = self.watch()
        finally:
            self.stop_steps()
        return self.finish(code)

    def watch(self) -> int:
        pending = self.ready_files()
        while not (self.walltime or self.cancel):
            pending = None if pending is None else [f for f in pending if not f.exists()]
            if pending == []:
                log_event(
                    self.run_dir,
                    event="all_ready",
                    kind=self.plan["kind"],
                    job_id=self.job_id,
                    processes=len(self.ready_files()),
                )
                print(
                    f"fleetrl job: all {len(self.ready_files())} processes registered "
                    f"{time.time() - self.alloc_start:.1f} s after the allocation started",
                    flush=True,
                )
                pending = None
            reported = self.reported_failure()
            if reported is not None:  # a supervisor named a dead broker / learner rank; its srun step may hang on
                return self.fail(reported, None)  # a node that is cut off, so do not wait for the step to end
            for step in list(self.steps):
                code = step.poll()
                if code is None:
                    continue
                if step.role == "rollout":
                    print(f"fleetrl job: the rollout step ended (exit code {code}); the fleet goes on", flush=True)
                    self.steps.remove(step)
                    if self.plan["kind"] == "add-rollout":
                        return code
                    continue
                if step.role == "learner" and code == 0:
                    print("fleetrl job: the learner finished", flush=True)
                    return 0
                return self.fail(step, code)
            time.sleep(POLL_S)
        print(
            f"fleetrl job: {'walltime warning (SIGUSR1)' if self.walltime else 'cancelled'}: "
            "stopping the learner (it checkpoints), then the rest",
            flush=True,
        )
        return 0

    def reported_failure(self) -> Step | None:
        """The broker or learner step whose supervisor reported a failure (``failed-<role>-<host>.json``), or a
        rollout step that reported a server whose rewards are hopeless (exit 4)."""
        if self.plan["kind"] != "job":
            return None
        for step in self.steps:
            if step.role != "rollout" and any((self.run_dir / "launch").glob(f"failed-{step.role}-*.json")):
                return step
        for step in self.steps:  # a rollout server whose rewards gave no usable score: every server shares them
            if step.role == "rollout" and any(c.get("kind") == REWARDS_HOPELESS for c in self.causes("rollout")):
                return step
        return None

    def causes(self, role: str) -> list[dict]:
        """The supervisors' failure reports of ``role``, oldest first."""
        rows = []
        for path in (self.run_dir / "launch").glob(f"failed-{role}-*.json"):
            try:
                rows.append(json.loads(path.read_text()))
            except (OSError, json.JSONDecodeError):
                pass  # being written: the next look reads it
        return sorted(rows, key=lambda c: c.get("time", 0.0))

    def fail(self, step: Step, code: int | None) -> int:
        time.sleep(1.0)  # the supervisor writes its failed-*.json before its step ends; let it land (and others)
        causes = self.causes(step.role)
        if causes:
            cause = "; ".join(
                f"{c['child']} on {c['host']} exited with code {c['code']}"
                + (f": {last_line(c['tail'])}" if last_line(c.get("tail", "")) else "")
                for c in causes
            )
            detail = "".join(
                f"\n{c['child']}'s log {c['log']} ends with:\n{c['tail']}"
                if c.get("log")
                else f"\n{c['child']}: {c['message']}"
                for c in causes
            )
        else:
            cause, detail = (
                f"the {step.role} step exited with code {code}",
                " (no supervisor report; see the step output above)",
            )
        print(f"fleetrl job: FAILED: {cause}{detail}", file=sys.stderr, flush=True)
        self.failed_role, self.failure = step.role, cause
        self.write_result("failed", cause, step.role)
        return 1

    def write_result(self, state: str, cause: str = "", role: str = "") -> None:
        path = self.run_dir / "launch" / ("result.json" if self.plan["kind"] == "job" else f"result-{self.job_id}.json")
        path.write_text(
            json.dumps({"state": state, "cause": cause, "role": role, "job_id": self.job_id, "time": time.time()})
        )

    def stop_steps(self) -> None:
        """Ask every running step to stop (SIGUSR1 reaches each supervisor), the learner first; force after a wait."""
        if self.plan["kind"] == "job":
            (self.run_dir / "launch" / "done").touch()
        order = sorted(
            (s for s in self.steps if s.poll() is None), key=lambda s: {"learner": 0, "rollout": 1}.get(s.role, 2)
        )
        for step in order:
            step.proc.send_signal(signal.SIGUSR1)
            deadline = time.monotonic() + (STOP_WAIT_S if step.role == "learner" else 60)
            while step.poll() is None and time.monotonic() < deadline:
                time.sleep(POLL_S)
            if step.poll() is None:
                step.proc.terminate()  # srun: cancel the step (Slurm kills what is left after KillWait)
                try:
                    step.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    step.proc.kill()
                    step.proc.wait()

    def finish(self, code: int) -> int:
        if self.walltime and code == 0 and self.plan.get("requeue") and self.job_id:
            self.write_result("requeued", "walltime warning: checkpointed and requeued")
            return self.requeue("checkpoint written")
        limit = int(self.plan.get("requeue_on_failure", 0))
        requeue = self.failed_role not in ("", "rollout")  # a rollout's hopeless rewards fail again after a requeue
        if code != 0 and requeue and self.job_id and self.restart_count < limit and not self.cancel:
            self.write_result("requeued", self.failure, self.failed_role)
            return self.requeue(
                f"the {self.failed_role} failed; requeue {self.restart_count + 1} of {limit} "
                "(cluster.slurm.requeue_on_failure), resuming from the last checkpoint"
            )
        if code == 0 and self.plan["kind"] == "job":
            self.write_result("completed" if not (self.walltime or self.cancel) else "stopped")
        return code

    def requeue(self, why: str) -> int:
        log_event(self.run_dir, event="requeue", job_id=self.job_id, why=why)
        print(f"fleetrl job: {why}; requeueing job {self.job_id}", flush=True)
        out = subprocess.run(["scontrol", "requeue", self.job_id], capture_output=True, text=True)
        if out.returncode != 0:
            print(f"fleetrl job: scontrol requeue failed: {out.stderr.strip()}", file=sys.stderr, flush=True)
            return 1
        time.sleep(REQUEUE_WAIT_S)  # Slurm ends this batch step as part of the requeue
        return 0


def last_line(text: str) -> str:
    """The last non-empty line of a log tail (a failing process's own last word, e.g. its exception)."""
    return next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m fleetrl.app.launch.slurm_job RUN/launch/job.plan.json", file=sys.stderr)
        return 2
    plan = json.loads(Path(argv[0]).read_text())
    return Driver(plan, dict(os.environ)).run()


if __name__ == "__main__":
    sys.exit(main())
