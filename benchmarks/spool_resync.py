"""Spool recovery through crafted candidate headers (issue 31): the CPU time to find the next valid record.

    python benchmarks/spool_resync.py [--out benchmarks/results/spool_resync.json]

A segment holds record A, a record of S bytes whose body is candidate headers every D bytes (each claims
the rest of the segment and carries a wrong CRC) with its own header damaged, then records B and C; the
reader must skip the damaged record and keep A, B and C (tests/broker/server/test_spool_resync.py builds the
same segment). Reported for each (S, D): process CPU seconds of ``spool.scan`` now, and of the reader
before issue 31 (one CRC per candidate over the length it claims: quadratic) where it ends in reasonable
time. Others' CPU share during the run is recorded: figures from a busy box are not quiet figures.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleetrl.broker.server import resync  # noqa: E402
from fleetrl.broker.server import spool as sp  # noqa: E402
from tests.broker.server.test_spool_resync import crafted_segment  # noqa: E402

MIB = 1 << 20
_ARRAY = re.compile(rb"[\x91-\x9f]")


def scan_before(data: bytes):
    """The reader before issue 31: after damage, record_at at every offset whose body opens with an array."""
    records, damaged, off = [], [], 0
    while off < len(data):
        rec, end = sp.record_at(data, off)
        if rec is not None:
            records.append(rec)
            off = end
            continue
        nxt = len(data)
        for m in _ARRAY.finditer(data, off + 1 + sp.HEADER.size):
            if sp.record_at(data, m.start() - sp.HEADER.size)[0] is not None:
                nxt = m.start() - sp.HEADER.size
                break
        damaged.append((off, nxt))
        off = nxt
    return records, damaged


def timed(scan, data: bytes) -> tuple[float, list[str]]:
    t0 = time.process_time()
    records, _ = scan(data)
    return round(time.process_time() - t0, 3), [r.group.group_id for r in records]


def others_cpu_share(seconds_of_mine: float, busy0, wall0: float) -> float:
    """The CPU the rest of the machine used meanwhile, as a share of all its cores."""
    busy = sum(psutil.cpu_times()[:3]) - busy0
    wall = time.monotonic() - wall0
    return round(max(0.0, busy - seconds_of_mine) / (wall * psutil.cpu_count()), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "spool_resync.json"))
    args = ap.parse_args()
    t0 = time.process_time()
    resync.shift_tables()
    rows = [{"what": "shift tables (once per process)", "cpu_s": round(time.process_time() - t0, 3)}]
    busy0, wall0, mine0 = sum(psutil.cpu_times()[:3]), time.monotonic(), time.process_time()
    for size, every, before in (
        (MIB // 4, 32, True),
        (MIB // 2, 32, True),
        (MIB, 32, True),
        (2 * MIB, 32, False),
        (8 * MIB, 32, False),
        (64 * MIB, 32, False),
        (8 * MIB, 10, False),
        (64 * MIB, 10, False),
    ):
        data, names = crafted_segment(size, every)
        now_s, got = timed(sp.scan, data)
        row = {
            "record_mib": size / MIB,
            "candidate_every_bytes": every,
            "candidates": size // every,
            "cpu_s": now_s,
            "kept": got == names,
        }
        if before:
            row["cpu_s_before"], got_before = timed(scan_before, data)
            row["kept_before"] = got_before == names
        rows.append(row)
        print(json.dumps(row), flush=True)
    share = others_cpu_share(time.process_time() - mine0, busy0, wall0)
    out = {
        "rows": rows,
        "others_cpu_share": share,
        "quiet": share < 0.10,
        "cpus": psutil.cpu_count(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({"others_cpu_share": share, "quiet": out["quiet"], "saved": args.out}))


if __name__ == "__main__":
    main()
