"""The live status line of `fleetrl run`, read from the learner's ``metrics.jsonl`` and, for reward failures
and unscored samples (which never reach the learner), the rollout servers' ``rollout-*.metrics.jsonl``."""

from __future__ import annotations

import json
import sys
import time
from collections import deque
from pathlib import Path

from fleetrl.common.config.schema import JobConfig


class MetricsTail:
    """Reads new lines of a JSONL file as it grows (tolerates a partly written last line)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.rows = path, 0, []

    def skip_existing(self) -> None:
        """Start after what the file holds now (a resumed run: only the new part counts)."""
        self.offset = self.path.stat().st_size if self.path.exists() else 0

    def poll(self) -> list[dict]:
        if not self.path.exists():
            return []
        with self.path.open() as f:
            f.seek(self.offset)
            data = f.read()
        complete = data[: data.rfind("\n") + 1]
        self.offset += len(complete.encode())
        new = []
        for line in complete.splitlines():
            try:
                row = json.loads(line) if line.strip() else None
            except ValueError:  # a line that is not JSON (cut by a crash): skipped, not fatal
                row = None
            if isinstance(row, dict):
                new.append(row)
        self.rows.extend(new)
        return new


def num(value: object, default: float = float("nan")) -> float:
    """Any metric value as a float: numbers, numeric strings ("inf", "nan", "1e3" — what JSON cannot hold
    arrives as text), else ``default``. The status line must survive every value a run can log."""
    if isinstance(value, bool):
        return float(value)
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return default


def fmt(value: object, spec: str) -> str:
    x = num(value)
    return spec.format(x) if x == x and abs(x) != float("inf") else str(x)


def describe_event(event: dict, cause: dict | None = None) -> str:
    """One event of events.jsonl, short: a health rule's action, a rollback naming the rule that asked for it
    (``cause``: the rule's own event, just before it), or the launcher restarting a child."""
    if event.get("event") == "restart":
        return f"restarted {event.get('child')} (exit {event.get('exit_code')}, restart {event.get('restart')})"
    if event.get("rule") == "rollback":
        why = f" ({cause.get('rule')} on {cause.get('metric')})" if cause and cause.get("rule") != "rollback" else ""
        return (
            f"rolled back @ {event.get('step')}{why}, rollback {fmt(event.get('value'), '{:.0f}')}"
            f"/{fmt(event.get('threshold'), '{:.0f}')}"
        )
    return f"{event.get('rule')} -> {event.get('action')} @ {event.get('step')}"


class StatusLine:
    def __init__(self, cfg: JobConfig, run_dir: Path, enabled: bool = True):
        self.cfg, self.total = cfg, cfg.learner.total_steps
        self.run_dir = Path(run_dir)
        self.tail = MetricsTail(self.run_dir / "metrics.jsonl")
        self.rollout_tails: dict[str, MetricsTail] = {}
        self.reward_totals: dict[str, dict[str, float]] = {}  # per rollout file: its latest reward/*_total
        self.event_tail = MetricsTail(Path(run_dir) / "events.jsonl")
        self.rewards: deque[float] = deque(maxlen=20)
        self.times: deque[tuple[float, int, float]] = deque(maxlen=20)  # (time, step, samples_total)
        self.last: dict = {}
        self.started: float | None = None  # time of the first metrics row: learner.max_minutes counts from about then
        self.eval_acc: float | None = None
        self.events: list[str] = []
        self.cause: dict | None = None  # the last event whose action was a rollback: what a rollback names
        self.tty = enabled and sys.stdout.isatty()
        self.enabled = enabled
        self.live = None
        self.last_print = 0.0

    def __enter__(self) -> StatusLine:
        if self.tty:
            from rich.live import Live

            self.live = Live("starting...", refresh_per_second=4, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    def update(self) -> None:
        for row in self.tail.poll():
            self.last = row
            if self.started is None:
                self.started = num(row.get("time"), time.time())
            if "reward/mean" in row and (r := num(row["reward/mean"])) == r:
                self.rewards.append(r)
            if "eval/accuracy" in row:
                self.eval_acc = num(row["eval/accuracy"])
            self.times.append(
                (num(row.get("time"), time.time()), num(row.get("step"), 0.0), num(row.get("batch/samples_total"), 0.0))
            )
        for event in self.event_tail.poll():
            self.events.append(describe_event(event, self.cause))
            self.cause = event if event.get("action") == "rollback" else self.cause
        self.poll_rollouts()
        text = self.render()
        if self.live is not None:
            self.live.update(text)
        elif self.enabled and time.monotonic() - self.last_print > 10 and self.last:
            print(text, flush=True)
            self.last_print = time.monotonic()

    def poll_rollouts(self) -> None:
        """The latest reward counters of each rollout server (they count since its start)."""
        for path in sorted(self.run_dir.glob("rollout-*.metrics.jsonl")):
            tail = self.rollout_tails.setdefault(path.name, MetricsTail(path))
            for row in tail.poll():
                if "reward/samples_total" in row:
                    self.reward_totals[path.name] = {
                        k: num(row.get(f"reward/{k}_total"), 0.0) for k in ("samples", "failed", "unscored")
                    }

    def reward_trouble(self) -> str:
        """``reward failed on 12/40 samples, unscored 3/40`` over all rollout servers, or "" when none."""
        total = {k: sum(t[k] for t in self.reward_totals.values()) for k in ("samples", "failed", "unscored")}
        n, said = total["samples"], []
        if total["failed"]:
            said.append(f"reward failed on {total['failed']:.0f}/{n:.0f} samples")
        if total["unscored"]:
            said.append(f"unscored {total['unscored']:.0f}/{n:.0f}")
        return ", ".join(said) + (" (see rollout-*.log)" if said else "")

    def rate(self) -> tuple[float, float]:
        """(steps/s, samples/s) over the recent window."""
        if len(self.times) < 2:
            return 0.0, 0.0
        (t0, s0, n0), (t1, s1, n1) = self.times[0], self.times[-1]
        dt = max(t1 - t0, 1e-9)
        return (s1 - s0) / dt, (n1 - n0) / dt

    def render(self) -> str:
        trouble = self.reward_trouble()
        if not self.last:
            return "waiting for the first step..." + (f" | ! {trouble}" if trouble else "")
        r = self.last
        steps_s, samples_s = self.rate()
        step = num(r.get("step"), 0.0)
        eta = (self.total - step) / steps_s if steps_s > 0 else float("nan")
        if self.cfg.learner.max_minutes and self.started is not None:  # the time budget ends the run first
            left = max(0.0, self.started + 60 * self.cfg.learner.max_minutes - num(r.get("time"), time.time()))
            eta = left if eta != eta else min(eta, left)
        parts = [
            f"step {fmt(step, '{:.0f}')}/{self.total}",
            f"v{fmt(r.get('policy/version', 0), '{:.0f}')}",
            f"reward {fmt(sum(self.rewards) / max(1, len(self.rewards)), '{:.3f}')}",
        ]
        if self.eval_acc is not None:
            parts.append(f"eval {fmt(100 * self.eval_acc, '{:.1f}')}%")
        for key, label, spec in (
            ("actor/kl", "kl", "{:.4f}"),
            ("off_policy/staleness_mean", "stale", "{:.2f}"),
            ("broker/queue_depth", "queue", "{:.0f}"),
        ):
            if key in r:
                parts.append(f"{label} {fmt(r[key], spec)}")
        parts.append(f"{fmt(samples_s, '{:.1f}')} samples/s")
        parts.append(f"ETA {eta:.0f} s" if eta == eta and abs(eta) != float("inf") else "ETA -")
        if trouble:
            parts.append(f"! {trouble}")
        if self.events:
            parts.append(f"! {self.events[-1]}")
        return " | ".join(parts)

    def summary(self, wall_s: float) -> str:
        rows = self.tail.rows  # this launch's rows only (a resumed run skips what came before)
        samples = sum(num(r.get("batch/samples"), 0.0) for r in rows)
        rate = samples / wall_s if wall_s > 0 else 0.0
        steps = sum(1 for r in rows if "batch/samples" in r)  # not the step-0 evaluation row
        return (
            f"fleetrl run: done — {steps} steps, {fmt(samples, '{:.0f}')} samples in {wall_s:.1f} s of RL "
            f"({fmt(rate, '{:.1f}')} samples/s); last: {self.render()}"
        )
