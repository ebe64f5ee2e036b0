"""Weight sync over gloo: one publisher, two receiver processes, large buckets against small ones.

The publisher (this process) broadcasts ~100 MB of float32 weights, as 100 tensors of 1 MB, through
`WeightPublisher`; two `WeightReceiver` processes take each version and apply it to an engine that
drops it. Each configuration runs one warm-up round (it forms the group) and then ``--rounds`` timed
rounds over the reused group. Configurations differ only in ``sync.bucket_mb``:

- ``256``: the whole model travels as one flat 100 MB tensor (one broadcast a round);
- ``1``: every 1 MB tensor is its own bucket (100 broadcasts a round), as a per-parameter sender does.

Reported per configuration (medians over the timed rounds): ``mb_per_s`` over the broadcast phase
(``sync/mb_per_s``: packing + broadcast), ``round_mb_per_s`` over the whole publish call (announce,
join, plan, broadcast), and the round's seconds. 1 MB = 2**20 bytes.

    python benchmarks/weight_sync.py [--mb 100] [--tensors 100] [--rounds 7] [--buckets 256,32,1]

Figures go to stdout and benchmarks/results/weight_sync.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class NullEngine:
    """Takes weights and drops them: the benchmark measures the transport, not a model's copy."""

    def update_weights(self, named) -> None:
        for _ in named:
            pass

    def load_weights_from_dir(self, path: str) -> None:
        pass


def receiver(cfg, specs, client_id: str, cmd_q, out_q) -> None:
    import torch

    from fleetrl.common.messages import decode_announcement
    from fleetrl.common.weightsync.receiver.receiver import WeightReceiver

    torch.set_num_threads(1)
    recv = WeightReceiver(cfg, specs, "cpu", client_id)
    engine = NullEngine()
    out_q.put(("ready", os.getpid()))
    while True:
        try:
            cmd = cmd_q.get(timeout=0.005)
        except queue.Empty:
            cmd = None
        if cmd == "stop":
            break
        if cmd is not None:
            ann = decode_announcement(cmd)
            recv.on_version(ann.version, ann.weights)
        recv.apply(engine)  # between "generation batches": here, every 5 ms
    out_q.put(("stats", recv.stats()))
    recv.close()


def synthetic(n_tensors: int, total_mb: float):
    import torch

    numel = int(total_mb * (1 << 20) / 4 / n_tensors)
    g = torch.Generator().manual_seed(0)
    return [(f"layers.{i}.weight", torch.randn(numel, generator=g)) for i in range(n_tensors)]


def run_config(bucket_mb: float, params, kids, rounds: int, first_version: int, run_dir: Path) -> dict:
    from fleetrl.common import messages as m
    from fleetrl.common import weightsync as ws
    from fleetrl.common.config.schema import JobConfig, SyncConfig
    from fleetrl.common.weightsync.sender.publisher import WeightPublisher

    cfg = JobConfig(sync=SyncConfig(transport="gloo", bucket_mb=bucket_mb, timeout_s=60))
    pub = WeightPublisher(cfg, run_dir, 0, [ws.make_spec(n, t.shape, t.dtype) for n, t in params])
    rows = []
    for i in range(rounds + 1):
        version = first_version + i

        def announce(info, version=version):
            frame = m.encode(m.VersionAnnouncement(version=version, step=version, weights=info))
            for cmd_q, _ in kids:
                cmd_q.put(frame)

        metrics = pub.publish(version, version, iter(params), announce, len(kids))
        if metrics["sync/receivers"] != len(kids):
            raise RuntimeError(f"round {version} reached {metrics['sync/receivers']:.0f} of {len(kids)} receivers")
        if i:  # round 0 forms the group
            rows.append(metrics)
    pub.close()
    return {
        "bucket_mb": bucket_mb,
        "buckets": len(pub.plan),
        "mb": rows[0]["sync/mb"],
        "mb_per_s": round(statistics.median(r["sync/mb_per_s"] for r in rows), 1),
        "round_mb_per_s": round(statistics.median(r["sync/mb"] / r["timing/sync_s"] for r in rows), 1),
        "round_s": [round(r["timing/sync_s"], 4) for r in rows],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=100.0, help="total weight size in MB")
    ap.add_argument("--tensors", type=int, default=100, help="number of tensors the weights are cut into")
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds per configuration")
    ap.add_argument("--buckets", default="256,32,1", help="sync.bucket_mb values to compare")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "weight_sync.json"))
    args = ap.parse_args()

    import torch

    from fleetrl.common.config.schema import JobConfig, SyncConfig

    torch.set_num_threads(1)
    params = synthetic(args.tensors, args.mb)
    specs = [(n, tuple(t.shape), t.dtype) for n, t in params]
    ctx = mp.get_context("spawn")
    cfg = JobConfig(sync=SyncConfig(transport="gloo", timeout_s=60))
    kids, procs = [], []
    try:
        for r in range(args.receivers):
            cmd_q, out_q = ctx.Queue(), ctx.Queue()
            proc = ctx.Process(target=receiver, args=(cfg, specs, f"bench-{r}", cmd_q, out_q), daemon=True)
            proc.start()
            kids.append((cmd_q, out_q))
            procs.append(proc)
        for _, out_q in kids:
            out_q.get(timeout=120)
        results, version = [], 1
        with tempfile.TemporaryDirectory() as run_dir:
            for bucket_mb in [float(b) for b in args.buckets.split(",")]:
                row = run_config(bucket_mb, params, kids, args.rounds, version, Path(run_dir))
                version += args.rounds + 1
                results.append(row)
                print(
                    f"bucket_mb={row['bucket_mb']:>6g}  buckets={row['buckets']:>4}  {row['mb']:.0f} MB -> "
                    f"{args.receivers} receivers: broadcast {row['mb_per_s']:7.1f} MB/s, whole round "
                    f"{row['round_mb_per_s']:7.1f} MB/s",
                    flush=True,
                )
    finally:
        for (cmd_q, _), _proc in zip(kids, procs):
            cmd_q.put("stop")
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    out = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "workload": {
            "mb": args.mb,
            "tensors": args.tensors,
            "receivers": args.receivers,
            "rounds": args.rounds,
            "transport": "gloo",
            "host": "127.0.0.1",
        },
        "results": results,
    }
    if len(results) >= 2:
        out["small_buckets_vs_large"] = round(results[-1]["mb_per_s"] / results[0]["mb_per_s"], 3)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
