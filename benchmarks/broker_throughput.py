"""Broker throughput against a bare pyzmq PUSH/PULL pair, same payload, same machine, same run.

One process pushes groups of 8 responses x 512 tokens (token ids + behaviour log-probs: ~33 KB a
group) through the broker with a window of requests in flight; another leases and acks them in
batches. The bare pair moves the same encoded frames from PUSH to PULL. A third reference, the
*bare relay* (PUSH -> a process that only forwards frames -> PULL), is the ceiling of any broker in
the middle on the same machine: every byte crosses loopback twice. Reported: groups/s, MB/s, the
ratios, and the broker process's CPU use (so groups/s per broker core can be read off).

    python benchmarks/broker_throughput.py [--groups 20000] [--trials 3]

Figures go to stdout and benchmarks/results/broker_throughput.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleetrl.common import net as _net  # noqa: E402 - after the path is set


def payload_group(prompt_id: str, gid: str, tokens: bytes, logprobs: bytes):
    from fleetrl.common import messages as m

    return m.SampleGroup(
        group_id=gid,
        prompt_id=prompt_id,
        policy_version=0,
        prompt_tokens=tokens[:64],
        lengths=[512] * 8,
        tokens=tokens,
        logprobs=logprobs,
        rewards=[1.0] * 8,
    )


def arrays():
    from fleetrl.common import messages as m

    rng = np.random.default_rng(0)
    return m.pack_tokens(rng.integers(0, 250, 8 * 512)), m.pack_logprobs(-rng.random(8 * 512))


# ------------------------------------------------------------------------------ bare pair


def bare_pull(address: str, n: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind(address)
    sock.recv()  # first message starts the clock
    t0 = time.perf_counter()
    nbytes = 0
    for _ in range(n - 1):
        nbytes += len(sock.recv(copy=False))
    print(json.dumps({"seconds": time.perf_counter() - t0, "messages": n - 1, "bytes": nbytes}), flush=True)


def bare_push(address: str, n: int) -> None:
    from fleetrl.common import messages as m

    tokens, logprobs = arrays()
    frames = [
        m.encode(m.PushGroup(req_id=i, client_id="bench", group=payload_group(f"0:{i}", f"g{i}", tokens, logprobs)))
        for i in range(256)
    ]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(address)
    for i in range(n):
        sock.send(frames[i % 256], copy=False)
    sock.close(linger=-1)
    ctx.term()


def bare_relay(in_address: str, out_address: str, n: int) -> None:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(in_address)
    push.bind(out_address)
    for _ in range(n):
        push.send(pull.recv(copy=False), copy=False)
    pull.close()
    push.close(linger=-1)
    ctx.term()


def bare_relay_pull(address: str, n: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.connect(address)
    sock.recv()
    t0 = time.perf_counter()
    nbytes = sum(len(sock.recv(copy=False)) for _ in range(n - 1))
    print(json.dumps({"seconds": time.perf_counter() - t0, "messages": n - 1, "bytes": nbytes}), flush=True)


# ------------------------------------------------------------------------- broker path


async def broker_produce(address: str, n: int, window: int, per_push: int) -> None:
    from fleetrl.broker.client.aio import AsyncBrokerClient
    from fleetrl.common import messages as m

    tokens, logprobs = arrays()
    client = AsyncBrokerClient(address, "bench-rollout", "rollout", timeout_s=60)
    await client.connect()
    sem = asyncio.Semaphore(max(1, window // per_push))
    pending: set[asyncio.Task] = set()
    sent = 0

    async def push(groups: list) -> None:
        try:
            if len(groups) == 1:
                await client.push_group(groups[0])
            else:
                await client.push_groups(groups)
        finally:
            sem.release()

    while sent < n:
        lease = await client.lease_prompts(min(1024, n - sent), 0)
        if not isinstance(lease, m.PromptLease):
            await asyncio.sleep(0.01)
            continue
        for i in range(0, len(lease.prompts), per_push):
            groups = [
                payload_group(p.prompt_id, f"g-{p.prompt_id}", tokens, logprobs)
                for p in lease.prompts[i : i + per_push]
            ]
            await sem.acquire()
            task = asyncio.create_task(push(groups))
            pending.add(task)
            task.add_done_callback(pending.discard)
            sent += len(groups)
    await asyncio.gather(*pending)
    await client.close()


async def broker_consume(address: str, n: int, batch: int) -> None:
    from fleetrl.broker.client.aio import AsyncBrokerClient
    from fleetrl.common import messages as m

    client = AsyncBrokerClient(address, "bench-learner", "learner", timeout_s=60)
    await client.connect()
    got, nbytes, t0 = 0, 0, None
    while got < n:
        lease = await client.lease_batch(batch, wait_s=5.0, min_groups=min(batch, n - got))
        if not isinstance(lease, m.BatchLease):
            continue
        if t0 is None:
            t0 = time.perf_counter()
            got_first = len(lease.groups)
        got += len(lease.groups)
        nbytes += sum(len(g.tokens) + len(g.logprobs) for g in lease.groups)
        await client.ack_batch(lease.lease_id, [g.group_id for g in lease.groups], 0)
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "messages": got - got_first, "bytes": nbytes}), flush=True)
    await client.close()


# ---------------------------------------------------------------------------------- driver


def run_child(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True)


def result_of(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=600)
    if proc.returncode:
        raise RuntimeError(f"child failed with {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def bare_trial(n: int) -> dict:
    address = f"tcp://127.0.0.1:{_net.free_port()}"
    pull = run_child("--role", "bare-pull", "--address", address, "--groups", str(n))
    time.sleep(0.5)
    push = run_child("--role", "bare-push", "--address", address, "--groups", str(n))
    push.wait()
    return result_of(pull)


def relay_trial(n: int) -> dict:
    a, b = f"tcp://127.0.0.1:{_net.free_port()}", f"tcp://127.0.0.1:{_net.free_port()}"
    relay = run_child("--role", "relay", "--address", a, "--address2", b, "--groups", str(n))
    time.sleep(0.5)
    pull = run_child("--role", "relay-pull", "--address", b, "--groups", str(n))
    time.sleep(0.3)
    push = run_child("--role", "bare-push", "--address", a, "--groups", str(n))
    push.wait()
    result = result_of(pull)
    relay.wait(timeout=60)
    return result


def broker_trial(n: int, workdir: Path, window: int, batch: int, per_push: int) -> dict:
    from fleetrl.common.data.tasks import init_data

    data = workdir / "prompts.jsonl"
    if not data.exists():
        init_data("arithmetic", str(data), max(n, 1000), 10, 0, 99)
    run_dir = workdir / f"run-{time.time_ns()}"
    run_dir.mkdir()
    job = workdir / "job.yaml"
    job.write_text("{}\n")
    broker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fleetrl.app.cli",
            "broker",
            "--run-dir",
            str(run_dir),
            "--config",
            str(job),
            f"data.train={data}",
            "broker.port=0",
            "broker.pub_port=0",
            f"broker.queue_capacity={n * 2}",
            "broker.max_staleness=1000",
            "telemetry.log_level=WARNING",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        ep = run_dir / "broker.json"
        while not ep.exists():
            time.sleep(0.05)
        address = json.loads(ep.read_text())["address"]
        import psutil

        proc = psutil.Process(broker.pid)
        cpu0 = sum(proc.cpu_times()[:2])
        wall0 = time.perf_counter()
        consumer = run_child("--role", "consume", "--address", address, "--groups", str(n), "--batch", str(batch))
        producer = run_child(
            "--role",
            "produce",
            "--address",
            address,
            "--groups",
            str(n),
            "--window",
            str(window),
            "--per-push",
            str(per_push),
        )
        producer.wait()
        result = result_of(consumer)
        result["broker_cpu_share"] = (sum(proc.cpu_times()[:2]) - cpu0) / (time.perf_counter() - wall0)
        return result
    finally:
        broker.terminate()
        broker.wait(timeout=30)


def summarize(results: list[dict]) -> dict:
    rates = [r["messages"] / r["seconds"] for r in results]
    mbs = [r["bytes"] / r["seconds"] / 1e6 for r in results]
    out = {"groups_per_s": statistics.median(rates), "mb_per_s": statistics.median(mbs), "trials": results}
    if "broker_cpu_share" in results[0]:
        out["broker_cpu_share"] = statistics.median(r["broker_cpu_share"] for r in results)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", default="driver")
    ap.add_argument("--address")
    ap.add_argument("--address2")
    ap.add_argument("--groups", type=int, default=20000)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--window", type=int, default=128, help="pushes in flight")
    ap.add_argument("--batch", type=int, default=64, help="groups per learner lease")
    ap.add_argument("--per-push", type=int, default=8, help="groups per rollout push (PushGroups); 1 = PushGroup")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "broker_throughput.json"))
    args = ap.parse_args()
    if args.role == "bare-pull":
        return bare_pull(args.address, args.groups)
    if args.role == "bare-push":
        return bare_push(args.address, args.groups)
    if args.role == "relay":
        return bare_relay(args.address, args.address2, args.groups)
    if args.role == "relay-pull":
        return bare_relay_pull(args.address, args.groups)
    if args.role == "produce":
        return asyncio.run(broker_produce(args.address, args.groups, args.window, args.per_push))
    if args.role == "consume":
        return asyncio.run(broker_consume(args.address, args.groups, args.batch))

    with tempfile.TemporaryDirectory() as tmp:
        bare = summarize([bare_trial(args.groups) for _ in range(args.trials)])
        relay = summarize([relay_trial(args.groups) for _ in range(args.trials)])
        broker = summarize(
            [broker_trial(args.groups, Path(tmp), args.window, args.batch, args.per_push) for _ in range(args.trials)]
        )
    ratio = broker["mb_per_s"] / bare["mb_per_s"]
    per_core = broker["groups_per_s"] / max(broker["broker_cpu_share"], 1e-9)
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "payload": "8 responses x 512 tokens (int32 ids + float32 log-probs) per group",
        "groups": args.groups,
        "window": args.window,
        "learner_batch": args.batch,
        "groups_per_push": args.per_push,
        "bare_push_pull": bare,
        "bare_relay": relay,
        "broker": broker,
        "broker_over_bare": ratio,
        "broker_over_relay": broker["mb_per_s"] / relay["mb_per_s"],
        "broker_groups_per_s_per_core": per_core,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"bare PUSH/PULL : {bare['groups_per_s']:8.0f} groups/s  {bare['mb_per_s']:7.1f} MB/s")
    print(
        f"bare relay     : {relay['groups_per_s']:8.0f} groups/s  {relay['mb_per_s']:7.1f} MB/s  (ceiling of any middle process)"
    )
    print(
        f"broker path    : {broker['groups_per_s']:8.0f} groups/s  {broker['mb_per_s']:7.1f} MB/s  "
        f"(broker process busy {broker['broker_cpu_share']:.0%} of a core -> {per_core:.0f} groups/s per core)"
    )
    print(
        f"broker / bare  : {ratio:.0%}   broker / relay: {broker['mb_per_s'] / relay['mb_per_s']:.0%}   (saved to {args.out})"
    )


if __name__ == "__main__":
    main()
