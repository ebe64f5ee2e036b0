"""CPU the broker spends per group on its hot path, without sockets: a frame's pre-decode checks, its decode and
the state machine (push, then lease and ack), for PushGroups frames of 8 groups of 8 x 512 tokens (~33 KB a
group, as benchmarks/broker_throughput.py). Process CPU time, so a busy box slows it less than wall time;
still, compare two trees only back to back on the same box (issue 31 added byte budgets, plausibility checks
and per-key fairness to this path):

    python benchmarks/broker_hotpath.py [--groups 20000] [--trials 5] [--label branch] [--out FILE]
    /other/tree/.venv/bin/python benchmarks/broker_hotpath.py --label main --out ...   # the same script, another tree

Prints and saves µs per group (median and each trial) and others' CPU share during the run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]


def frames(n_groups: int, per_push: int) -> list[bytes]:
    from fleetrl.common import messages as m

    rng = np.random.default_rng(0)
    tokens = rng.integers(5, 200, 8 * 512, dtype=np.int32).tobytes()
    logprobs = (-rng.random(8 * 512, dtype=np.float32) - 0.01).tobytes()
    out = []
    for start in range(0, n_groups, per_push):
        groups = [
            m.SampleGroup(
                group_id=uuid.uuid4().hex,
                prompt_id=f"0:{i % 1000}",
                policy_version=0,
                prompt_tokens=tokens[:64],
                lengths=[512] * 8,
                tokens=tokens,
                logprobs=logprobs,
                rewards=[1.0, 0.0] * 4,
            )
            for i in range(start, start + per_push)
        ]
        out.append(m.encode(m.PushGroups(req_id=start + 1, client_id="r0", groups=groups)))
    return out


def trial(payloads: list[bytes]) -> float:
    """CPU seconds for every frame: pre-decode checks (where the tree has them), decode, ingest; then leases+acks."""
    from fleetrl.broker.server.prompts import PromptSource, rows_to_prompts
    from fleetrl.broker.server.state import BrokerState
    from fleetrl.common import messages as m
    from fleetrl.common.config import load_config

    try:
        from fleetrl.broker.security.precheck import precheck
    except ImportError:  # a tree before issue 31: its checks were a header peek in the server
        precheck = None
    cfg = load_config(
        None,
        [
            "broker.accept_unleased=true",
            "broker.queue_capacity=1000000",
            "broker.max_held_groups=1000000",
            "broker.max_staleness=1000",
        ],
    )
    rows = [{"prompt": f"{i}+1=", "answer": "1"} for i in range(1000)]
    state = BrokerState(cfg, PromptSource(rows_to_prompts(rows, "prompt", "answer", "b"), False, 0, 1), vocab_size=263)
    if hasattr(state, "admission"):  # the budget lives in Admission since the re-floor (issue 25)
        state.admission.max_held_bytes = 1 << 62
    elif hasattr(state, "max_held_bytes"):
        state.max_held_bytes = 1 << 62
    t0 = time.process_time()
    for i, buf in enumerate(payloads):
        view = memoryview(buf)
        if precheck is not None:
            precheck(view, m.peek_header(view), i, cfg.broker)
        else:
            m.peek_push_count(view)
        state.handle(m.decode_request(view), 0.0)
        if i % 8 == 7:
            lease = state.handle(m.LeaseBatch(req_id=1, client_id="l0", n=64), 0.0)
            state.handle(m.AckBatch(req_id=2, client_id="l0", lease_id=lease.lease_id), 0.0)
    return time.process_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=20000)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "broker_hotpath.json"))
    args = ap.parse_args()
    payloads = frames(args.groups, 8)
    busy0, wall0, mine0 = sum(psutil.cpu_times()[:3]), time.monotonic(), time.process_time()
    us = [round(1e6 * trial(payloads) / args.groups, 2) for _ in range(args.trials)]
    mine = time.process_time() - mine0
    others = max(0.0, sum(psutil.cpu_times()[:3]) - busy0 - mine) / ((time.monotonic() - wall0) * psutil.cpu_count())
    import fleetrl.broker.server.state as tree

    out = {
        "label": args.label,
        "tree": str(Path(tree.__file__).resolve().parents[2]),
        "us_per_group_median": statistics.median(us),
        "us_per_group": us,
        "groups": args.groups,
        "others_cpu_share": round(others, 3),
        "quiet": others < 0.10,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(json.dumps(out))
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
