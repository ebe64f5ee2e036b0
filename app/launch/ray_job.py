"""`fleetrl launch ray`: one job as Ray actors, on an existing cluster or a fresh local one.

    fleetrl launch ray --config job.yaml [--address auto|HOST:6379|ray://HOST:10001]
    fleetrl launch ray --add-rollout N --run RUN_DIR --address HOST:6379
    ray job submit --address http://HEAD:8265 --working-dir . -- fleetrl launch ray --config job.yaml --address auto

Each actor owns one fleetrl process (a child with PR_SET_PDEATHSIG, so it dies with its actor):

- the **broker** actor (``num_cpus=1``) binds free ports and reports ``tcp://<its node's IP>:<port>``;
- the **rollout** actors (``num_gpus`` = GPUs per server) are the only ones with ``max_restarts``
  (``cluster.rollout.max_restarts``): when a server crashes its actor exits, Ray starts it again and the
  new server registers with the broker;
- the **learner** ranks sit in one ``PACK`` placement group; rank 0 picks ``MASTER_ADDR/PORT`` on its
  node, then every rank starts with ``RANK``/``WORLD_SIZE`` from the world map.

The launcher waits on every actor, names a death by role (a dead broker or learner rank fails the job),
and stops everything when the learner finishes. ``--add-rollout N`` joins a running job from another
driver: N more rollout actors (restarted like the others), server indices after those in use (reserved in
``RUN/launch/rollout-index.json``, as Slurm's ``--add-rollout`` does), the broker of ``RUN/launch/world.json``;
that driver stays while they run (they exit 0 when the job's learner finishes; Ctrl-C takes them out).
Ray is an optional extra (``pip install 'fleetrl[ray]'``), imported only here, only when the command runs.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from fleetrl.app.launch.run import EXIT_REWARDS_HOPELESS, Child, child_env
from fleetrl.app.launch.slurm import next_rollout_indices, prepare, resolve_run_dir
from fleetrl.app.launch.supervisor import log_event
from fleetrl.app.launch.world import Layout, world_map
from fleetrl.common.config import ConfigError, load_config
from fleetrl.common.net import free_port

READY_TIMEOUT_S = 600.0


def import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "`fleetrl launch ray` needs Ray: pip install 'fleetrl[ray]' (or pip install ray) on this "
            "machine and on every node of the cluster"
        ) from None
    return ray


class ProcessActor:
    """One fleetrl process inside a Ray actor. Decorated with ``ray.remote`` by the launcher."""

    def __init__(self, role: str, name: str, plan: dict, ctx: dict, autostart: bool):
        import ray

        if plan.get("cwd") and os.path.isdir(plan["cwd"]):
            os.chdir(plan["cwd"])
        self.role, self.name, self.plan, self.ctx = role, name, plan, dict(ctx)
        self.run_dir = Path(plan["run_dir"])
        self.node_ip = ray.util.get_node_ip_address()
        self.ctx.setdefault("node_ip", self.node_ip)
        self.child: Child | None = None
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if self.restarted and role == "rollout":  # Ray re-ran the constructor only: start from the record
            world = json.loads((self.run_dir / "launch" / "world.json").read_text())
            self.ctx["broker_address"] = world["broker_address"]
            autostart = True
        if autostart:
            self.start(self.ctx)

    def pick_master(self) -> tuple[str, int]:
        """Rank 0: this node's IP and a free port for the learner rendezvous."""
        return self.node_ip, free_port("")

    def start(self, ctx: dict) -> int:
        self.ctx.update(ctx)
        layout = Layout(**self.plan["layout"])
        world = world_map(os.environ, self.role, layout, ray=self.ctx)
        cli = [sys.executable, "-m", "fleetrl.app.cli"]
        job = ["--config", self.plan["config"], "--run-dir", str(self.run_dir)]
        env = {**child_env(int(self.plan["threads"][self.role])), **world.env()}
        if self.role == "broker":
            argv, ready = (
                [
                    *cli,
                    "broker",
                    *job,
                    "broker.host=0.0.0.0",
                    "broker.insecure_bind=true",  # see World.overrides
                    "broker.port=0",
                    "broker.pub_port=0",
                ],
                "broker.json",
            )
        elif self.role == "rollout":
            index = world.rollout_indices[0]
            argv = [
                *cli,
                "rollout",
                *job,
                "--server-index",
                str(index),
                "--broker",
                world.broker_address,
                f"broker.address={world.broker_address}",
            ]
            ready = f"rollout-{index}.ready"
        else:
            argv = [
                *cli,
                "learner",
                *job,
                f"broker.address={world.broker_address}",
                f"sync.master_addr={world.sync_addr}",
                "sync.master_port=0",
                "checkpoint.resume=auto",
            ]
            ready = "learner.ready" if world.rank == 0 else None
        logs = self.run_dir / "logs" / self.name
        attempt = len(list(logs.glob("attempt-*"))) if logs.exists() else 0
        self.child = Child(
            self.name, argv, logs / f"attempt-{attempt}" / "output.log", env, self.run_dir / ready if ready else None
        )
        self.child.start()
        log_event(
            self.run_dir,
            host=self.node_ip,
            role=self.role,
            child=self.name,
            event="started",
            attempt=attempt,
            pid=self.child.proc.pid,
            actor_pid=os.getpid(),
            restarted=self.restarted,
        )
        threading.Thread(target=self._watch, daemon=True).start()
        return self.child.proc.pid

    def _watch(self) -> None:
        """Ready -> an event; a crash -> the actor exits, so Ray restarts it (rollouts) or reports it (others)."""
        child, logged = self.child, False
        while child.returncode is None:
            if not logged and child.ready_file is not None and child.ready_file.exists():
                logged = True
                log_event(
                    self.run_dir,
                    host=self.node_ip,
                    role=self.role,
                    child=self.name,
                    event="rejoined" if self.restarted else "ready",
                    start_s=round(time.monotonic() - child.started_at, 3),
                )
            time.sleep(0.2)
        code = child.returncode
        if self.role == "rollout" and code == EXIT_REWARDS_HOPELESS:
            return  # not a crash to restart from: `wait` returns the code and the launcher ends the job
        if code != 0 and not getattr(self, "stopping", False):
            log_event(self.run_dir, host=self.node_ip, role=self.role, child=self.name, event="died", code=code)
            print(
                f"fleetrl {self.name}: exited with code {code}; its log {child.log} ends with:\n{child.tail()}",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)

    def info(self) -> dict:
        out = {
            "node_ip": self.node_ip,
            "actor_pid": os.getpid(),
            "pid": self.child.proc.pid if self.child and self.child.proc else None,
        }
        endpoint = self.run_dir / "broker.json"
        if self.role == "broker" and endpoint.exists():
            address = json.loads(endpoint.read_text())["address"]
            out["address"] = f"tcp://{self.node_ip}:{address.rsplit(':', 1)[1]}"
        return out

    def wait_ready(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while self.child.ready_file is not None and not self.child.ready_file.exists():
            if self.child.returncode is not None:
                raise RuntimeError(
                    f"{self.name} exited with code {self.child.returncode} while starting; its log "
                    f"{self.child.log} ends with:\n{self.child.tail()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not report ready in {timeout_s:g} s; see {self.child.log}")
            time.sleep(0.2)
        return self.info()

    def wait(self) -> int:
        while self.child is None or self.child.returncode is None:
            time.sleep(0.5)
        return self.child.returncode

    def stop(self, timeout_s: float = 60.0) -> int | None:
        self.stopping = True
        return self.child.stop(timeout_s) if self.child is not None else None


class RayJob:
    def __init__(self, ray, cfg, run_dir: Path, config_path: Path):
        from fleetrl.common.config.cluster import rollout_gpus_per_server

        self.ray, self.cfg, self.run_dir = ray, cfg, run_dir
        self.layout = Layout.from_config(cfg, str(run_dir))
        c = cfg.cluster
        self.plan = {
            "run_dir": str(run_dir),
            "config": str(config_path),
            "cwd": os.getcwd(),
            "layout": asdict(self.layout),
            "threads": {"broker": 1, "rollout": max(1, c.rollout.cpus_per_server), "learner": c.learner.cpus_per_rank},
        }
        self.remote = ray.remote(max_concurrency=8)(ProcessActor)
        self.gpus_per_server = rollout_gpus_per_server(cfg)
        self.actors: dict[str, object] = {}
        self.alloc_start = time.time()
        os.environ["FLEETRL_ALLOC_START"] = str(self.alloc_start)
        self.stop_requested = False
        self.pg = None
        self.ready = [
            run_dir / "learner.ready",
            run_dir / "broker.json",
            *(run_dir / f"rollout-{i}.ready" for i in range(self.layout.num_servers)),
        ]
        self.adding = False  # --add-rollout: only rollout actors, joining a job another driver runs

    def opts(self, name: str, **kw) -> dict:
        return {
            "name": f"{self.layout.name}-{name}",
            "namespace": self.cfg.cluster.ray.namespace,
            "runtime_env": {"env_vars": {"FLEETRL_ALLOC_START": str(self.alloc_start)}},
            **kw,
        }

    def create_actors(self) -> None:
        """Every actor at once, so that Ray starts their worker processes in parallel with the broker's
        start-up; only the broker starts its process now, the others once they know its address."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        run = {"run_dir": str(self.run_dir)}
        if self.cfg.needs_fleet:
            self.actors["broker"] = self.remote.options(**self.opts("broker", num_cpus=1, max_restarts=0)).remote(
                "broker", "broker", self.plan, run, True
            )
        self.create_rollouts(range(self.layout.num_servers if self.cfg.needs_fleet else 0))
        c, world = self.cfg.cluster.learner, self.layout.world_size
        bundle = {"CPU": c.cpus_per_rank, **({"GPU": 1} if c.gpus_per_node else {})}
        self.pg = placement_group(
            [dict(bundle) for _ in range(world)], strategy="PACK", name=f"{self.layout.name}-learner"
        )
        for rank in range(world):
            strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank)
            name = "learner" if rank == 0 else f"learner-{rank}"
            self.actors[name] = self.remote.options(
                **self.opts(
                    f"learner-{rank}",
                    num_cpus=c.cpus_per_rank,
                    num_gpus=1 if c.gpus_per_node else 0,
                    max_restarts=0,
                    scheduling_strategy=strategy,
                )
            ).remote("learner", name, self.plan, {**run, "rank": rank}, False)

    def create_rollouts(self, indices) -> None:
        r, run = self.cfg.cluster.rollout, {"run_dir": str(self.run_dir)}
        for i in indices:
            name = f"rollout-{i}"
            self.actors[name] = self.remote.options(
                **self.opts(
                    name, num_cpus=r.cpus_per_server, num_gpus=self.gpus_per_server, max_restarts=r.max_restarts
                )
            ).remote("rollout", name, self.plan, {**run, "server_index": i, "rank": i}, False)

    def add_rollouts(self, count: int) -> int:
        """``--add-rollout``: ``count`` more servers for the job in ``run_dir``; runs until they have all ended."""
        world = json.loads((self.run_dir / "launch" / "world.json").read_text())
        first = next_rollout_indices(self.run_dir, count, self.layout.num_servers)
        self.adding, self.ready = True, [self.run_dir / f"rollout-{i}.ready" for i in range(first, first + count)]
        old = {
            s: signal.signal(s, lambda *a: setattr(self, "stop_requested", True))
            for s in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            self.create_rollouts(range(first, first + count))
            print(
                f"fleetrl launch ray: adding rollout-{first}..rollout-{first + count - 1} to the fleet of "
                f"{world['broker_address']}",
                flush=True,
            )
            self.ray.get([a.start.remote({"broker_address": world["broker_address"]}) for a in self.actors.values()])
            return self.watch()
        finally:
            self.shutdown()
            for s, h in old.items():
                signal.signal(s, h)

    def broker_address(self) -> str:
        """Wait for the broker actor's process; record its address for restarted rollout actors."""
        if "broker" not in self.actors:
            return ""
        address = self.ray.get(self.actors["broker"].wait_ready.remote(READY_TIMEOUT_S))["address"]
        (self.run_dir / "launch" / "world.json").write_text(json.dumps({"broker_address": address}))
        return address

    def start_rest(self, broker: str) -> None:
        """Rollout servers with the broker's address; learner ranks with rank 0's MASTER_ADDR/PORT."""
        rollouts = [
            a.start.remote({"broker_address": broker}) for n, a in self.actors.items() if n.startswith("rollout")
        ]
        ranks = [self.actors["learner" if r == 0 else f"learner-{r}"] for r in range(self.layout.world_size)]
        self.ray.get(self.pg.ready(), timeout=READY_TIMEOUT_S)
        master_addr, master_port = self.ray.get(ranks[0].pick_master.remote())
        ctx = {
            "broker_address": broker,
            "world_size": len(ranks),
            "master_addr": master_addr,
            "master_port": master_port,
        }
        self.ray.get([a.start.remote({**ctx, "rank": r}) for r, a in enumerate(ranks)] + rollouts)

    def run(self) -> int:
        old = {
            s: signal.signal(s, lambda *a: setattr(self, "stop_requested", True))
            for s in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            self.create_actors()
            broker = self.broker_address()
            print(f"fleetrl launch ray: broker at {broker}", flush=True)
            self.start_rest(broker)
            return self.watch()
        except ConfigError:
            raise
        except Exception as e:  # an actor failed to start: say which, then clean up
            print(f"fleetrl launch ray: the job failed while starting: {e}", file=sys.stderr, flush=True)
            return 1
        finally:
            self.shutdown()
            for s, h in old.items():
                signal.signal(s, h)

    def watch(self) -> int:
        waits = {a.wait.remote(): name for name, a in self.actors.items()}
        self.restarts = {name: 0 for name in self.actors}
        self.reviving: set[str] = set()  # rollout actors Ray is restarting
        ready_logged = False
        while not self.stop_requested:
            if not ready_logged and self.all_ready():
                ready_logged = True
                log_event(
                    self.run_dir,
                    event="all_ready",
                    kind="ray-add-rollout" if self.adding else "ray",
                    processes=len(self.actors),
                )
                print(
                    f"fleetrl launch ray: all {len(self.actors)} processes registered "
                    f"{time.time() - self.alloc_start:.1f} s after the launcher started",
                    flush=True,
                )
            self.revive(waits)
            done, _ = self.ray.wait(list(waits), timeout=0.5)
            for ref in done:
                code = self.ended(waits.pop(ref), ref)
                if code is not None:
                    return code
            if self.adding and not waits and not self.reviving:  # --add-rollout: every added server ended (or gave up)
                print("fleetrl launch ray: the added rollout servers have all ended", flush=True)
                return 0
        print("fleetrl launch ray: stopping (the learner checkpoints)", flush=True)
        return 130

    def ended(self, name: str, ref) -> int | None:
        """An actor's `wait` returned or failed: the job's exit code, or None when the job goes on."""
        from ray.exceptions import RayActorError

        try:
            code, why = self.ray.get(ref), None
        except RayActorError as e:
            code, why = None, str(e).splitlines()[0]
        if name.startswith("rollout") and code != EXIT_REWARDS_HOPELESS:
            if code is None:  # its process died: Ray restarts the actor (max_restarts), `revive` watches for it
                self.restarts[name] += 1
                log_event(self.run_dir, role="rollout", child=name, event="died", why=why, restart=self.restarts[name])
                print(
                    f"fleetrl launch ray: {name} died ({why}); Ray restarts it ({self.restarts[name]}/"
                    f"{self.cfg.cluster.rollout.max_restarts})",
                    flush=True,
                )
                self.reviving.add(name)
            return None  # else finished (the job is done, or the broker said the data is exhausted)
        if name == "learner" and code == 0:
            print("fleetrl launch ray: the learner finished", flush=True)
            return 0
        cause = f"exited with code {code}" if code is not None else f"died ({why})"
        if code == EXIT_REWARDS_HOPELESS and name.startswith("rollout"):
            cause += ": its rewards gave no usable score (not restarted; see its log for the reward and its error)"
        role = "learner rank" if name.startswith("learner") else name
        print(
            f"fleetrl launch ray: FAILED: {role} {name} {cause}; see {self.run_dir}/logs/{name}/",
            file=sys.stderr,
            flush=True,
        )
        (self.run_dir / "launch" / "result.json").write_text(
            json.dumps({"state": "failed", "cause": f"{name} {cause}", "role": name.split("-")[0]})
        )
        return 1

    def revive(self, waits: dict) -> None:
        """Rollout actors that Ray is restarting: wait on the new incarnation once it answers; one Ray reports dead
        for good (out of restarts) leaves the fleet. (A call made while the actor restarts fails with "The actor is
        restarting": it is no second death.)"""
        from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

        for name in list(self.reviving):
            try:
                self.ray.get(self.actors[name].info.remote(), timeout=1.0)
            except ActorDiedError:
                self.reviving.discard(name)
                print(f"fleetrl launch ray: {name} is out of restarts; the fleet goes on", flush=True)
                continue
            except (RayActorError, GetTimeoutError):
                continue  # still restarting: unavailable, or its constructor (which starts the server) still runs
            self.reviving.discard(name)
            waits[self.actors[name].wait.remote()] = name

    def all_ready(self) -> bool:
        return all(f.exists() for f in self.ready)

    def shutdown(self) -> None:
        if not self.adding:  # the job's own end, not that of a few added servers
            (self.run_dir / "launch" / "done").touch()
        order = sorted(
            self.actors.items(), key=lambda kv: 0 if kv[0].startswith("learner") else 2 if kv[0] == "broker" else 1
        )
        for name, actor in order:
            try:
                self.ray.get(actor.stop.remote(180 if name.startswith("learner") else 30), timeout=240)
            except Exception:  # already dead: nothing to stop
                pass
            self.ray.kill(actor, no_restart=True)
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)


def main(args) -> int:
    if getattr(args, "add_rollout", None) is not None:
        return add_rollout_main(args)
    if not args.config:
        raise ConfigError("fleetrl launch ray needs --config JOB.yaml (or --add-rollout N --run RUN_DIR)")
    cfg = load_config(args.config, list(args.overrides))
    run_dir = resolve_run_dir(cfg, args.run_dir)
    config_path, _ = prepare(cfg, run_dir)
    if args.dry_run:
        print(
            f"# dry run: resolved config in {config_path}; the job would start 1 broker, "
            f"{Layout.from_config(cfg, str(run_dir)).num_servers} rollout actor(s) and {cfg.learner.num_ranks} learner "
            f"rank(s) in a PACK placement group; nothing started",
            flush=True,
        )
        return 0
    ray = import_ray()
    address = args.address or cfg.cluster.ray.address
    init = (
        {"address": address}
        if address
        else {"address": "local", "num_cpus": cfg.cluster.ray.num_cpus, "include_dashboard": False}
    )  # "local": a new cluster, always
    for stale in [
        run_dir / "learner.ready",
        run_dir / "broker.json",
        *run_dir.glob("rollout-*.ready"),
        run_dir / "launch" / "rollout-index.json",
    ]:
        stale.unlink(missing_ok=True)  # a previous run's signals must not count
    ray.init(namespace=cfg.cluster.ray.namespace, log_to_driver=False, **init)
    print(
        f"fleetrl launch ray: {cfg.run.name} -> {run_dir} on {'Ray at ' + address if address else 'a local Ray'}",
        flush=True,
    )
    try:
        return RayJob(ray, cfg, run_dir, config_path).run()
    finally:
        ray.shutdown()


def add_rollout_main(args) -> int:
    """``--add-rollout N --run RUN_DIR``: more rollout actors for a job running on a Ray cluster."""
    if not args.run or args.add_rollout < 1:
        raise ConfigError("--add-rollout N needs N >= 1 and --run RUN_DIR (the run directory of the running job)")
    run_dir = Path(args.run).resolve()
    if not (run_dir / "launch" / "world.json").exists():
        raise ConfigError(
            f"{run_dir} has no running job (no launch/world.json yet): start it with `fleetrl launch "
            "ray --config JOB`, and add rollouts once its broker is up"
        )
    cfg = load_config(run_dir / "config.yaml", list(args.overrides))
    address = args.address or cfg.cluster.ray.address
    if not address:
        raise ConfigError(
            "--add-rollout joins the Ray cluster the job runs on: give --address HOST:6379 (or cluster.ray.address)"
        )
    ray = import_ray()
    ray.init(address=address, namespace=cfg.cluster.ray.namespace, log_to_driver=False)
    try:
        return RayJob(ray, cfg, run_dir, run_dir / "config.yaml").add_rollouts(args.add_rollout)
    finally:
        ray.shutdown()
