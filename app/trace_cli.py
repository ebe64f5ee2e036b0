"""`fleetrl trace RUN_DIR [--group ID]`: the timeline of one group from the run's jsonl spans.

Reads every ``<run_dir>/traces/*.jsonl`` (``telemetry.exporter: jsonl``). Each group has a trace of its
own (docs/monitoring.md, "Traces"), and the timeline is that trace: the rollout's lease, generation,
reward and push, the broker's ingest and batch lease, the learner's ``learner.train`` and
``learner.publish_weights``, and the rollout servers' ``rollout.load_weights`` of that version.
Without ``--group`` it lists the latest groups.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from fleetrl.common.telemetry.trace_files import TRACES_DIR, read_spans

GROUP = "fleetrl.group_id"
PROMPT = "fleetrl.prompt_id"
Span = dict[str, Any]


class Spans:
    """The spans of a run, indexed by group and trace."""

    def __init__(self, spans: list[Span]):
        self.spans = sorted(spans, key=lambda s: s["start_ns"])
        self.by_trace: dict[str, list[Span]] = defaultdict(list)
        self.groups: dict[str, list[Span]] = defaultdict(list)  # group id -> spans naming it
        for s in self.spans:
            self.by_trace[s["trace_id"]].append(s)
            if GROUP in s["attributes"]:
                self.groups[s["attributes"][GROUP]].append(s)

    def find_group(self, prefix: str) -> str:
        """The full id of the group whose id starts with ``prefix``; raises LookupError."""
        found = [g for g in self.groups if g.startswith(prefix)]
        if len(found) != 1:
            raise LookupError(f"{len(found)} groups match {prefix!r}" + (": give more of the id" if found else ""))
        return found[0]

    def timeline(self, group_id: str) -> list[Span]:
        """The spans of the group's trace that concern it (all of them, unless one names another group), in time order."""
        own = self.groups[group_id]
        trace_id = next((s["trace_id"] for s in own if s["name"] == "rollout.group"), own[0]["trace_id"])
        prompt_id = next((s["attributes"][PROMPT] for s in own if PROMPT in s["attributes"]), None)
        return [s for s in self.by_trace[trace_id] if _concerns(s, group_id, prompt_id)]

    def latest(self, n: int) -> list[tuple[str, list[Span]]]:
        """The ``n`` most recent groups (by their first span) with their timelines."""
        firsts = sorted(self.groups, key=lambda g: (self.groups[g][0]["start_ns"], g))[-n:]
        return [(g, self.timeline(g)) for g in firsts]


def _concerns(span: Span, group_id: str, prompt_id: str | None) -> bool:
    """A span of the group's trace is on its timeline unless it names another group or prompt."""
    attributes = span["attributes"]
    return attributes.get(GROUP, group_id) == group_id and attributes.get(PROMPT, prompt_id) == prompt_id


def _details(span: Span) -> str:
    skip = {GROUP, PROMPT}
    parts = [f"{k.removeprefix('fleetrl.')}={v}" for k, v in span["attributes"].items() if k not in skip]
    if span.get("links"):
        parts.append(f"links={len(span['links'])}")
    if span.get("status") == "ERROR":
        parts.append("ERROR")
    return " ".join(parts)


def format_timeline(group_id: str, spans: list[Span]) -> str:
    t0 = spans[0]["start_ns"]
    prompt = next((s["attributes"][PROMPT] for s in spans if PROMPT in s["attributes"]), "?")
    trace_ids = {s["trace_id"] for s in spans if s["attributes"].get(GROUP) == group_id}
    total = (max(s["end_ns"] for s in spans) - t0) / 1e9
    lines = [
        f"group {group_id}  prompt {prompt}  trace {', '.join(sorted(trace_ids))}  "
        f"{len(spans)} spans over {total:.3f} s",
        f"  {'offset':>10}  {'duration':>10}  {'process':<24}  {'span':<24}  details",
    ]
    for s in spans:
        who = s.get("instance") or s.get("service", "")
        lines.append(
            f"  {(s['start_ns'] - t0) / 1e9:>+9.3f}s  {(s['end_ns'] - s['start_ns']) / 1e9:>9.4f}s  "
            f"{who[:24]:<24}  {s['name']:<24}  {_details(s)}"
        )
    return "\n".join(lines)


def format_list(entries: list[tuple[str, list[Span]]]) -> str:
    lines = [f"{'group':<32}  {'prompt':<10}  {'spans':>5}  {'lease → last span':>17}  trained at step"]
    for gid, spans in entries:
        prompt = next((s["attributes"][PROMPT] for s in spans if PROMPT in s["attributes"]), "?")
        steps = [str(s["attributes"].get("fleetrl.step", "?")) for s in spans if s["name"] == "learner.train"]
        span_s = (max(s["end_ns"] for s in spans) - spans[0]["start_ns"]) / 1e9
        lines.append(f"{gid:<32}  {prompt:<10}  {len(spans):>5}  {span_s:>16.3f}s  {', '.join(steps) or '-'}")
    lines.append("show one with: fleetrl trace RUN_DIR --group ID (a unique prefix of the id is enough)")
    return "\n".join(lines)


def main(args) -> int:
    run_dir = Path(args.run_dir)
    spans = Spans(read_spans(run_dir))
    if not spans.spans:
        print(
            f"fleetrl trace: no spans under {run_dir / TRACES_DIR}; run with telemetry.exporter=jsonl", file=sys.stderr
        )
        return 1
    if not spans.groups:
        print(f"fleetrl trace: {len(spans.spans)} spans but none names a group ({GROUP})", file=sys.stderr)
        return 1
    if args.group is None:
        print(format_list(spans.latest(args.n)))
        return 0
    try:
        group_id = spans.find_group(args.group)
    except LookupError as e:
        print(f"fleetrl trace: {e}", file=sys.stderr)
        return 1
    print(format_timeline(group_id, spans.timeline(group_id)))
    return 0
