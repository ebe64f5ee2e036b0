"""A simulated fleet against one broker: how many rollout servers, and how many groups/s, one broker carries.

Simulated rollout servers (no model) run as asyncio tasks, many to an OS process, each with its own
``AsyncBrokerClient`` (its own DEALER socket and client id), doing what ``fleetrl rollout`` does on the
wire: register, heartbeat every ``broker.heartbeat_s``, lease ``prompts_per_batch`` (8) prompts, "generate"
for as long as the configured rate says, push the batch's pre-built groups in one ``PushGroups`` frame
(as the rollout finisher does; ``--per-push 1`` pushes one group a frame), obey throttles. Two learner
processes lease batches of 64 and ack them at once. The broker is a real ``fleetrl broker`` child.

Each fleet size runs a schedule of steps: first idle (connected, heartbeating only), then rising total
offered rates (groups/s across the fleet). Per step, after a warm-up: groups/s in and out of the broker
(its own counters), request latency p50/p99 as the clients see it (request -> reply), the broker's CPU
(% of one core) and RSS, the load generators' CPU, and whether the step saturated (achieved < 90% of
offered, or p99 of pushes over 1 s).

Rate assumption: a GPU generating ~50k tokens/s (the design's figure) fills 50,000 / (8 x 512) ~ 12
groups/s of 8 responses x 512 tokens (~33 KB each); 1,000 GPUs are ~12,000 groups/s (~400 MB/s).

    python benchmarks/fleet_sim.py [--servers 10,100,1000] [--rates 250,500,1000,2000,4000,8000] [--step-s 10]

Figures go to stdout and benchmarks/results/fleet_sim.json. Admission control is opened wide
(broker.queue_capacity) so that the figures are the broker's, not the throttle's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOKENS, GROUP_SIZE, PROMPTS_PER_BATCH, LEARNER_BATCH = 512, 8, 8, 64
GPU_TOKENS_PER_S = 50_000
PAPER_GROUPS_PER_S_PER_GPU = GPU_TOKENS_PER_S / (GROUP_SIZE * TOKENS)
HEARTBEAT_S = 2.0


# --------------------------------------------------------------------------------- load generators


class Recorder:
    """Request latencies and counts, by kind and by schedule step (assigned by the request's start time)."""

    def __init__(self, edges: list[float]):
        self.edges = edges  # [start of step 0 measurement, end of step 0, start of step 1 measurement, ...]
        self.lat: dict[str, list[list[float]]] = {}
        self.counts: dict[str, list[int]] = {}

    def step_of(self, t: float) -> int | None:
        for i in range(0, len(self.edges), 2):
            if self.edges[i] <= t < self.edges[i + 1]:
                return i // 2
        return None

    def latency(self, kind: str, t_wall: float, seconds: float) -> None:
        step = self.step_of(t_wall)
        if step is not None:
            self.lat.setdefault(kind, [[] for _ in range(len(self.edges) // 2)])[step].append(round(seconds * 1e3, 3))

    def count(self, kind: str, t_wall: float, n: int = 1) -> None:
        step = self.step_of(t_wall)
        if step is not None:
            self.counts.setdefault(kind, [0] * (len(self.edges) // 2))[step] += n


async def timed(rec: Recorder, kind: str, coro):
    t_wall, t0 = time.time(), time.perf_counter()
    try:
        return await coro
    finally:
        rec.latency(kind, t_wall, time.perf_counter() - t0)


def payload():
    from fleetrl.common import messages as m

    rng = np.random.default_rng(0)
    n = GROUP_SIZE * TOKENS
    return (
        m.pack_tokens(rng.integers(0, 250, n)),
        m.pack_logprobs(-rng.random(n)),
        m.pack_tokens(rng.integers(0, 250, 64)),
    )


async def rollout_server(client, rec: Recorder, schedule: list[dict], per_push: int, seed: int) -> None:
    """One simulated server: lease 8 prompts, wait the time 8 groups take at the step's rate, push them."""
    from fleetrl.broker.client.errors import BrokerError, BrokerUnavailable
    from fleetrl.common import messages as m

    tokens, logprobs, prompt = payload()
    rnd = random.Random(seed)
    end = schedule[-1]["end"]
    pushes: set[asyncio.Task] = set()
    sent = 0

    async def heartbeat() -> None:
        await asyncio.sleep(rnd.random() * HEARTBEAT_S)
        while time.time() < end:
            try:
                await timed(rec, "heartbeat", client.heartbeat(0, {"tokens_per_s": 1.0}))
            except (BrokerUnavailable, BrokerError):
                rec.count("errors", time.time())
            await asyncio.sleep(HEARTBEAT_S)

    async def push(groups: list) -> None:
        t_wall = time.time()
        try:
            frames = [groups[i : i + per_push] for i in range(0, len(groups), per_push)]
            acks = []
            for chunk in frames:
                if per_push == 1:
                    ack = await timed(rec, "push", client.push_group(chunk[0]))
                    acks.append("accepted" if ack.count else "duplicate" if ack.duplicate else "stale")
                else:
                    acks += [a.status for a in await timed(rec, "push", client.push_groups(chunk))]
            rec.count("groups_acked", t_wall, sum(s == "accepted" for s in acks))
            rec.count("groups_not_accepted", t_wall, sum(s != "accepted" for s in acks))
        except (BrokerUnavailable, BrokerError):
            rec.count("errors", time.time())

    hb = asyncio.create_task(heartbeat())
    progress = rnd.random()  # of the batch in "generation": random phases keep the fleet's arrivals steady

    def step_at(t: float) -> dict | None:
        return next((s for s in schedule if t < s["end"]), None)

    while (step := step_at(time.time())) is not None:
        if step["per_server"] <= 0:  # idle step: heartbeats only
            await asyncio.sleep(max(0.0, min(0.5, step["end"] - time.time())))
            continue
        try:
            lease = await timed(rec, "lease", client.lease_prompts(PROMPTS_PER_BATCH, 0))
        except (BrokerUnavailable, BrokerError):
            rec.count("errors", time.time())
            continue
        if isinstance(lease, m.Throttle):
            rec.count("throttled", time.time())
            await asyncio.sleep(lease.retry_after_s)
            continue
        # "generation": the batch completes at the step's rate; a new step's rate applies from its start
        while progress < 1.0 and (step := step_at(time.time())) is not None:
            if step["per_server"] <= 0:
                await asyncio.sleep(max(0.0, min(0.5, step["end"] - time.time())))
                continue
            period = len(lease.prompts) / step["per_server"]
            t = time.time()
            await asyncio.sleep(max(0.0, min((1.0 - progress) * period, step["end"] - t)))
            progress += (time.time() - t) / period
        if progress < 1.0:
            break
        progress -= 1.0 if progress < 2.0 else progress  # a server that fell behind does not catch up in a burst
        groups = []
        for p in lease.prompts:
            sent += 1
            groups.append(
                m.SampleGroup(
                    group_id=f"{client.client_id}-{sent}",
                    prompt_id=p.prompt_id,
                    policy_version=0,
                    prompt_tokens=prompt,
                    lengths=[TOKENS] * GROUP_SIZE,
                    tokens=tokens,
                    logprobs=logprobs,
                    rewards=[1.0] * GROUP_SIZE,
                    lease_id=lease.lease_id,
                    server_id=client.client_id,
                )
            )
        while len(pushes) >= 2:  # the rollout finisher holds one batch while the next generates
            await asyncio.wait(pushes, return_when=asyncio.FIRST_COMPLETED)
        task = asyncio.create_task(push(groups))
        pushes.add(task)
        task.add_done_callback(pushes.discard)
    if pushes:
        await asyncio.wait(pushes)
    hb.cancel()


async def run_rollouts(address: str, first: int, count: int, schedule: list[dict], per_push: int, out: str) -> None:
    import zmq

    from fleetrl.broker.client.aio import AsyncBrokerClient

    ctx = zmq.Context()
    ctx.setsockopt(zmq.MAX_SOCKETS, 4 * count + 64)
    edges = [x for s in schedule for x in (s["measure"], s["end"])]
    rec = Recorder(edges)
    clients = [
        AsyncBrokerClient(address, f"sim-{first + i:05d}", "rollout", timeout_s=30.0, ctx=ctx) for i in range(count)
    ]
    t0 = time.time()
    for i in range(0, count, 50):  # register in waves, as a fleet that comes up would
        await asyncio.gather(*(c.connect() for c in clients[i : i + 50]))
    connect_s = time.time() - t0
    await asyncio.sleep(max(0.0, schedule[0]["start"] - time.time()))
    await asyncio.gather(*(rollout_server(c, rec, schedule, per_push, first + i) for i, c in enumerate(clients)))
    for c in clients:
        await c.close()
    ctx.term()
    Path(out).write_text(
        json.dumps(
            {
                "lat": rec.lat,
                "counts": rec.counts,
                "connect_s": connect_s,
                "late": max(0.0, t0 + connect_s - schedule[0]["start"]),
            }
        )
    )


async def run_learner(address: str, rank: int, schedule: list[dict], out: str) -> None:
    from fleetrl.broker.client.aio import AsyncBrokerClient
    from fleetrl.common import messages as m

    edges = [x for s in schedule for x in (s["measure"], s["end"])]
    rec = Recorder(edges)
    client = AsyncBrokerClient(address, f"learner-{rank}", "learner", rank=rank, timeout_s=30.0)
    await client.connect()
    end = schedule[-1]["end"] + 2.0
    while time.time() < end:
        lease = await timed(
            rec, "lease_batch", client.lease_batch(LEARNER_BATCH, wait_s=0.25, min_groups=LEARNER_BATCH)
        )
        if not isinstance(lease, m.BatchLease):
            continue
        t_wall = time.time()
        await timed(rec, "ack", client.ack_batch(lease.lease_id, [g.group_id for g in lease.groups], 1))
        rec.count("groups_trained", t_wall, len(lease.groups))
    await client.close()
    Path(out).write_text(json.dumps({"lat": rec.lat, "counts": rec.counts}))


# ------------------------------------------------------------------------------------------ driver


def start_broker(workdir: Path, spool: bool) -> tuple[subprocess.Popen, str]:
    from fleetrl.common.data.tasks import init_data

    data = workdir / "prompts.jsonl"
    if not data.exists():
        init_data("arithmetic", str(data), 20_000, 10, 0, 99)
    run_dir = workdir / f"run-{time.time_ns()}"
    run_dir.mkdir()
    job = workdir / "job.yaml"
    job.write_text("{}\n")
    overrides = [
        f"data.train={data}",
        "broker.port=0",
        "broker.pub_port=0",
        "broker.queue_capacity=10000000",
        f"broker.heartbeat_s={HEARTBEAT_S}",
        "broker.client_timeout_s=60",
        "telemetry.log_level=WARNING",
    ]
    if spool:
        overrides += [f"broker.spool_dir={run_dir / 'spool'}", "broker.fsync=interval"]
    log = open(run_dir / "broker.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fleetrl.app.cli",
            "broker",
            "--run-dir",
            str(run_dir),
            "--config",
            str(job),
            *overrides,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    ep = run_dir / "broker.json"
    deadline = time.monotonic() + 60
    while not ep.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"broker did not start: {(run_dir / 'broker.log').read_text()[-2000:]}")
        time.sleep(0.05)
    return proc, json.loads(ep.read_text())["address"]


def make_schedule(
    start: float, rates: list[float], servers: int, step_s: float, warm_s: float, idle_s: float
) -> list[dict]:
    steps, t = [], start
    for total in [0.0] + rates:
        length = idle_s if total == 0 else step_s
        steps.append(
            {
                "offered": total,
                "per_server": total / servers,
                "start": t,
                "measure": t + min(warm_s, length / 2),
                "end": t + length,
            }
        )
        t += length
    return steps


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def cpu_s(procs) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except Exception:  # noqa: BLE001 - a generator that already exited counts as idle
            pass
    return total


def run_fleet(servers: int, rates: list[float], args, workdir: Path) -> dict:
    import psutil

    from fleetrl.broker.client.sync import ZmqBrokerClient
    from fleetrl.common.telemetry.cpu import machine_busy_s

    broker, address = start_broker(workdir, args.spool)
    bproc = psutil.Process(broker.pid)
    time.sleep(0.5)
    idle_rss = bproc.memory_info().rss
    procs_n = max(1, min(args.max_procs, -(-servers // args.servers_per_proc)))
    connect_budget = 3.0 + servers / 150
    schedule = make_schedule(time.time() + connect_budget, rates, servers, args.step_s, args.warm_s, args.idle_s)
    sched_file = workdir / f"schedule-{servers}.json"
    sched_file.write_text(json.dumps(schedule))
    children, outs = [], []
    share = [servers // procs_n + (1 if i < servers % procs_n else 0) for i in range(procs_n)]
    first = 0
    for i, count in enumerate(share):
        out = workdir / f"rollout-{servers}-{i}.json"
        outs.append(out)
        children.append(
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--role",
                    "rollouts",
                    "--address",
                    address,
                    "--first",
                    str(first),
                    "--count",
                    str(count),
                    "--schedule",
                    str(sched_file),
                    "--out",
                    str(out),
                    "--per-push",
                    str(args.per_push),
                ]
            )
        )
        first += count
    learner_outs = []
    for rank in range(args.learners):
        out = workdir / f"learner-{servers}-{rank}.json"
        learner_outs.append(out)
        children.append(
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--role",
                    "learner",
                    "--address",
                    address,
                    "--rank",
                    str(rank),
                    "--schedule",
                    str(sched_file),
                    "--out",
                    str(out),
                ]
            )
        )
    gen_procs = [psutil.Process(c.pid) for c in children]
    monitor = ZmqBrokerClient(address, "fleet-sim-monitor", "monitor", timeout_s=60.0)
    monitor.connect()
    samples = []
    try:
        for s in schedule:
            for edge in ("measure", "end"):
                time.sleep(max(0.0, s[edge] - time.time()))
                st = monitor.status()
                samples.append(
                    {
                        "t": time.time(),
                        "groups_in": st.groups_in,
                        "groups_out": st.groups_out,
                        "throttled": st.throttled,
                        "clients": sum(c.alive for c in st.clients) - 1,
                        "broker_cpu_s": cpu_s([bproc]),
                        "gen_cpu_s": cpu_s(gen_procs),
                        "sys_busy_s": machine_busy_s(),
                        "rss": bproc.memory_info().rss,
                        "load": os.getloadavg()[0],
                    }
                )
        for c in children:
            c.wait(timeout=120)
    finally:
        monitor.close()
        for c in children:
            if c.poll() is None:
                c.kill()
        broker.terminate()
        broker.wait(timeout=30)
    results = [json.loads(o.read_text()) for o in outs]
    learners = [json.loads(o.read_text()) for o in learner_outs]
    return summarize(servers, schedule, samples, results, learners, idle_rss)


def merged(results: list[dict], key: str, kind: str, step: int) -> list:
    out = []
    for r in results:
        series = r[key].get(kind)
        if series:
            out += series[step] if key == "lat" else [series[step]]
    return out


def summarize(
    servers: int, schedule: list[dict], samples: list[dict], results: list[dict], learners: list[dict], idle_rss: int
) -> dict:
    steps = []
    for i, s in enumerate(schedule):
        a, b = samples[2 * i], samples[2 * i + 1]
        dt = b["t"] - a["t"]
        push = merged(results, "lat", "push", i)
        lease = merged(results, "lat", "lease", i)
        hb = merged(results, "lat", "heartbeat", i)
        allreq = push + lease + hb
        groups_in = (b["groups_in"] - a["groups_in"]) / dt
        step = {
            "offered_groups_per_s": s["offered"],
            "per_server_groups_per_s": s["per_server"],
            "groups_in_per_s": groups_in,
            "groups_out_per_s": (b["groups_out"] - a["groups_out"]) / dt,
            "mb_in_per_s": groups_in * (GROUP_SIZE * TOKENS * 8 + 300) / 1e6,
            "requests_per_s": len(allreq) / dt
            + sum(len(merged(learners, "lat", k, i)) for k in ("lease_batch", "ack")) / dt,
            "push_ms": {"p50": percentile(push, 50), "p99": percentile(push, 99), "n": len(push)},
            "lease_ms": {"p50": percentile(lease, 50), "p99": percentile(lease, 99), "n": len(lease)},
            "heartbeat_ms": {"p50": percentile(hb, 50), "p99": percentile(hb, 99), "n": len(hb)},
            "all_rollout_requests_ms": {"p50": percentile(allreq, 50), "p99": percentile(allreq, 99)},
            "ack_ms": {
                "p50": percentile(merged(learners, "lat", "ack", i), 50),
                "p99": percentile(merged(learners, "lat", "ack", i), 99),
            },
            "broker_cpu_pct": 100 * (b["broker_cpu_s"] - a["broker_cpu_s"]) / dt,
            "generators_cpu_pct": 100 * (b["gen_cpu_s"] - a["gen_cpu_s"]) / dt,
            "machine_busy_pct": 100 * (b["sys_busy_s"] - a["sys_busy_s"]) / dt,  # all cores, other tenants included
            "load_avg": b["load"],
            "broker_rss_mb": b["rss"] / 2**20,
            "clients_alive": b["clients"],
            "throttled": b["throttled"] - a["throttled"],
            "errors": sum(merged(results, "counts", "errors", i)),
        }
        step["broker_cpu_ms_per_1k_groups"] = (
            (1e3 * step["broker_cpu_pct"] / 100 / groups_in * 1e3) if groups_in > 1 else None
        )
        p99 = step["push_ms"]["p99"]
        step["saturated"] = bool(s["offered"] and (groups_in < 0.9 * s["offered"] or (p99 is not None and p99 > 1000)))
        steps.append(step)
    idle = steps[0]
    sustained = [st for st in steps[1:] if not st["saturated"]]
    return {
        "servers": servers,
        "steps": steps,
        "connect_s": max(r["connect_s"] for r in results),
        "idle_broker_cpu_pct_per_1k_servers": idle["broker_cpu_pct"] * 1000 / servers,
        "broker_rss_mb_idle_before_connect": idle_rss / 2**20,
        "broker_rss_mb_per_1k_servers": (samples[1]["rss"] - idle_rss) / 2**20 * 1000 / servers,
        "max_sustained_groups_per_s": max((st["groups_in_per_s"] for st in sustained), default=0.0),
        "max_achieved_groups_per_s": max(st["groups_in_per_s"] for st in steps),
        "first_saturated_offered": next((st["offered_groups_per_s"] for st in steps[1:] if st["saturated"]), None),
    }


def fmt(x, spec=".0f", none="-") -> str:
    return none if x is None else format(x, spec)


def print_table(fleets: list[dict]) -> None:
    print(
        f"{'servers':>7} {'offered':>7} {'in g/s':>7} {'out g/s':>7} {'MB/s':>5} {'push p50/p99 ms':>16} "
        f"{'all req p50/p99 ms':>18} {'broker CPU':>10} {'gen CPU':>7} {'RSS MB':>6} {'load':>4}  sat"
    )
    for f in fleets:
        for st in f["steps"]:
            print(
                f"{f['servers']:>7} {st['offered_groups_per_s']:>7.0f} {st['groups_in_per_s']:>7.0f} {st['groups_out_per_s']:>7.0f} "
                f"{st['mb_in_per_s']:>5.0f} {fmt(st['push_ms']['p50'], '.1f'):>7}/{fmt(st['push_ms']['p99'], '.1f'):<8} "
                f"{fmt(st['all_rollout_requests_ms']['p50'], '.1f'):>9}/{fmt(st['all_rollout_requests_ms']['p99'], '.1f'):<8} "
                f"{st['broker_cpu_pct']:>9.0f}% {st['generators_cpu_pct']:>6.0f}% {st['broker_rss_mb']:>6.0f} {st['load_avg']:>4.1f}  "
                f"{'yes' if st['saturated'] else ''}"
            )
        print(
            f"        -> {f['servers']} servers: idle broker CPU {f['idle_broker_cpu_pct_per_1k_servers']:.1f}% of a core per 1,000 "
            f"servers, RSS +{f['broker_rss_mb_per_1k_servers']:.1f} MB per 1,000 connected servers; max sustained "
            f"{f['max_sustained_groups_per_s']:.0f} groups/s, first saturated at {fmt(f['first_saturated_offered'])} offered"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", default="driver")
    ap.add_argument("--address")
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--count", type=int, default=0)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--schedule")
    ap.add_argument("--out")
    ap.add_argument("--servers", default="10,100,1000", help="fleet sizes to simulate")
    ap.add_argument("--rates", default="250,500,1000,2000,4000,8000", help="total offered groups/s, one step each")
    ap.add_argument(
        "--step-s", type=float, default=10.0, help="seconds per rate step (the first --warm-s not measured)"
    )
    ap.add_argument("--warm-s", type=float, default=3.0)
    ap.add_argument("--idle-s", type=float, default=8.0, help="seconds of the idle (heartbeat-only) step")
    ap.add_argument(
        "--per-push", type=int, default=8, help="groups per push frame (8 = a whole batch, as the rollout server does)"
    )
    ap.add_argument("--servers-per-proc", type=int, default=250)
    ap.add_argument("--max-procs", type=int, default=4, help="most simulator processes (2 cores here)")
    ap.add_argument("--learners", type=int, default=2)
    ap.add_argument("--spool", action="store_true", help="give the broker an on-disk spool (fsync every second)")
    ap.add_argument("--out-json", default=str(ROOT / "benchmarks" / "results" / "fleet_sim.json"))
    args = ap.parse_args()
    try:
        import uvloop

        run = uvloop.run
    except ImportError:  # pragma: no cover
        run = asyncio.run
    if args.role == "rollouts":
        return run(
            run_rollouts(
                args.address,
                args.first,
                args.count,
                json.loads(Path(args.schedule).read_text()),
                args.per_push,
                args.out,
            )
        )
    if args.role == "learner":
        return run(run_learner(args.address, args.rank, json.loads(Path(args.schedule).read_text()), args.out))

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # 1,000 servers: a socket + a TCP connection each
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    rates = [float(r) for r in args.rates.split(",")]
    fleets = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in args.servers.split(",")]:
            fleets.append(run_fleet(n, rates, args, Path(tmp)))
            print_table(fleets[-1:])
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "load_avg_before": load_before,
        "command": "python benchmarks/fleet_sim.py " + " ".join(sys.argv[1:]),
        "payload": f"{GROUP_SIZE} responses x {TOKENS} tokens (int32 ids + float32 log-probs, ~33 KB) per group",
        "assumption": f"a GPU makes ~{GPU_TOKENS_PER_S} tokens/s = {PAPER_GROUPS_PER_S_PER_GPU:.1f} groups/s; "
        f"1,000 GPUs = {1000 * PAPER_GROUPS_PER_S_PER_GPU:.0f} groups/s",
        "rollout": {
            "prompts_per_batch": PROMPTS_PER_BATCH,
            "groups_per_push": args.per_push,
            "heartbeat_s": HEARTBEAT_S,
        },
        "learners": {"processes": args.learners, "batch": LEARNER_BATCH},
        "broker": {"queue_capacity": 10_000_000, "spool": args.spool},
        "step_s": args.step_s,
        "warm_s": args.warm_s,
        "fleets": fleets,
    }
    Path(args.out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out_json).write_text(json.dumps(report, indent=2))
    print(f"saved to {args.out_json}")


if __name__ == "__main__":
    main()
