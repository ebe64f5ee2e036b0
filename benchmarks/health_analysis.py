"""What ``benchmarks/health.py`` computes from a run's files: pure functions on recorded rows, tested in
``tests/learner/test_health_bench.py``.

Inputs are the rows of a run directory: ``events.jsonl`` (health events; a rollback adds a line with
rule ``rollback``), ``metrics.jsonl`` (``eval/accuracy`` every ``run.eval_interval`` steps) and the
exit code of `fleetrl run` (3: the health monitor stopped the run).
"""

from __future__ import annotations

import math

ACTION_RANK = {"none": 0, "alert": 1, "quarantine": 1, "rollback": 2, "stop": 3}  # quarantine: one server, not the run
RECOVERY_POINTS = 0.03  # "back within 3 points of the pre-fault best"


def detection(events: list[dict], inject_at: int) -> dict:
    """The first health event at or after the injection step: detected?, delay in steps, the rule, and the
    strongest action the monitor took from then on (a rollback line counts as ``rollback``)."""
    after = [e for e in events if e["step"] >= inject_at]
    rules = [e for e in after if e["rule"] != "rollback"]
    if not rules:
        return {
            "detected": False,
            "delay_steps": None,
            "first_rule": None,
            "action": "none",
            "rules": [],
            "events_before_injection": sum(e["step"] < inject_at for e in events),
        }
    first = min(rules, key=lambda e: e["step"])
    action = max((e["action"] for e in after), key=ACTION_RANK.__getitem__)
    return {
        "detected": True,
        "delay_steps": first["step"] - inject_at,
        "first_rule": first["rule"],
        "action": action,
        "rules": sorted({e["rule"] for e in rules}),
        "events_before_injection": sum(e["step"] < inject_at for e in events),
    }


def eval_series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value of ``key``) of every metrics row where it is a finite number."""
    return [
        (int(r["step"]), float(r[key])) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
    ]


def eval_curve(rows: list[dict]) -> list[tuple[int, float]]:
    """(step, held-out accuracy) of every metrics row that has one."""
    return eval_series(rows, "eval/accuracy")


def recovery(
    curve: list[tuple[int, float]],
    inject_at: int,
    rollback_step: int | None,
    within: int,
    points: float = RECOVERY_POINTS,
) -> dict:
    """Did held-out accuracy come back within ``points`` of its pre-fault best (the best evaluation at a step
    <= ``inject_at``) at an evaluation in ``(rollback_step, rollback_step + within]``? Without a rollback:
    not recovered by rollback (``recovered`` False), though the curve may still be back (``back``)."""
    before = [a for s, a in curve if s <= inject_at]
    best = max(before, default=None)
    out = {
        "pre_fault_best": best,
        "rollback_step": rollback_step,
        "within_steps": within,
        "recovered": False,
        "steps_to_recover": None,
        "accuracy_after": None,
        "back": False,
    }
    if best is None:
        return out
    late = [(s, a) for s, a in curve if s > inject_at]
    out["min_accuracy_after_injection"] = min((a for _, a in late), default=None)
    out["back"] = any(a >= best - points for _, a in late[-2:]) if late else False
    if rollback_step is None:
        return out
    window = [(s, a) for s, a in curve if rollback_step < s <= rollback_step + within]
    out["accuracy_after"] = max((a for _, a in window), default=None)
    hit = next(((s, a) for s, a in window if a >= best - points), None)
    if hit is not None:
        out.update(recovered=True, steps_to_recover=hit[0] - rollback_step)
    return out


def last_rollback_step(events: list[dict], inject_at: int) -> int | None:
    """The step of the last rollback at or after the injection (the restored run is judged after it)."""
    steps = [e["step"] for e in events if e["rule"] == "rollback" and e["step"] >= inject_at]
    return max(steps, default=None)


def false_alarms(runs: list[dict]) -> dict:
    """Over healthy runs (each ``{"steps": n, "events": [...]}``): alerts and rollbacks per 1,000 steps, and
    the one-sided 95% upper bound on rollbacks per 10,000 steps when none was seen (rule of three: 3 / N)."""
    steps = sum(r["steps"] for r in runs)
    alerts = sum(1 for r in runs for e in r["events"] if e["action"] == "alert")
    rollbacks = sum(1 for r in runs for e in r["events"] if e["rule"] == "rollback")
    stops = sum(1 for r in runs for e in r["events"] if e["action"] == "stop")
    per_k = (lambda n: 1000.0 * n / steps) if steps else (lambda n: None)
    by_rule: dict[str, int] = {}
    for r in runs:
        for e in r["events"]:
            if e["rule"] != "rollback":
                by_rule[e["rule"]] = by_rule.get(e["rule"], 0) + 1
    return {
        "steps": steps,
        "alerts": alerts,
        "rollbacks": rollbacks,
        "stops": stops,
        "alerts_per_1000_steps": per_k(alerts),
        "rollbacks_per_1000_steps": per_k(rollbacks),
        "rollbacks_per_10000_steps_95pct_upper": (30000.0 / steps if rollbacks == 0 else None) if steps else None,
        "events_by_rule": by_rule,
    }


def targets(faults: dict[str, dict], healthy: dict) -> dict:
    """The issue's targets against the figures."""
    detected = all(f["detection"]["detected"] for f in faults.values())
    fast = {k: f["detection"]["delay_steps"] for k, f in faults.items() if k in ("divergence", "non_finite")}
    recovered = sum(1 for f in faults.values() if f["recovery"]["recovered"])
    bound = healthy.get("rollbacks_per_10000_steps_95pct_upper")
    return {
        "every_fault_detected": detected,
        "divergence_and_non_finite_within_20_steps": all(d is not None and d <= 20 for d in fast.values())
        and bool(fast),
        "false_alarms_at_most_1_rollback_per_10000_steps": (
            "met"
            if bound is not None and bound <= 1
            else f"not shown: {healthy.get('rollbacks', 0)} rollbacks in {healthy.get('steps', 0)} healthy steps"
            + (f" (95% upper bound {bound:.0f} per 10,000)" if bound is not None else "")
        ),
        "fault_kinds_recovered_by_rollback": f"{recovered} of {len(faults)} (target >= 4 of 5)",
    }


# The onset of reward hacking (the ``reward_hack`` fault pays 1 for an empty or one-character answer): read from
# what the policy does, not from when the bug appears. The measure is the held-out probe's greedy answers
# (``eval/response_len_mean``, tokens with the end-of-sequence one, over the same fixed problems every time):
# a paid answer is one character and the end token (2 tokens), so the share of held-out answers the bug would
# pay, over the pre-fault level, is the fall of the mean length from its pre-fault mean divided by
# (that mean - 2). Why not the training batch: its mean length moves with the prompt mix (2- or 3-digit sums,
# 16 prompts a step) and with dynamic sampling, which drops the groups a hack pays in full (every answer 1);
# on the unfaulted runs of 2026-12-06 its 5-step estimate reached a 0.16 share while the held-out one stayed
# under 0.04. The completions log holds 2 prompts every 20 steps: too few to date anything.
PAID_ANSWER_TOKENS = 2.0
ONSET_MARGIN = 0.05  # a share of held-out answers: over the largest excursion of the 9 unfaulted runs (0.037)


def eval_lengths(rows: list[dict]) -> list[tuple[int, float]]:
    """(step, held-out greedy mean answer length in tokens) of every metrics row that has one."""
    return eval_series(rows, "eval/response_len_mean")


def hack_onset(
    lengths: list[tuple[int, float]],
    inject_at: int,
    margin: float = ONSET_MARGIN,
    paid_tokens: float = PAID_ANSWER_TOKENS,
) -> dict:
    """When the policy began to give the answers the reward bug pays (see the note above ``ONSET_MARGIN``).

    ``seen_step`` is the first evaluation at or after ``inject_at`` whose paid share exceeds the pre-fault
    level (the evaluations before ``inject_at``, averaged) by more than ``margin``; ``onset_step`` is the first
    step after the last evaluation that did not (and not before ``inject_at``): the earliest step the change
    can have begun, so a delay counted from it is the longest it can be at this probe cadence."""
    before = [v for s, v in lengths if s < inject_at]
    out = {"onset_step": None, "seen_step": None, "share": None, "baseline_tokens": None, "margin": margin}
    if not before:
        return out
    base = sum(before) / len(before)
    out["baseline_tokens"] = base
    if base <= paid_tokens:
        return out  # answers already as short as the paid ones: no share to read
    clean = max(s for s, _ in lengths if s < inject_at)
    for step, value in sorted(lengths):
        if step < inject_at:
            continue
        share = (base - value) / (base - paid_tokens)
        if share > margin:
            return {**out, "onset_step": max(clean + 1, inject_at), "seen_step": step, "share": share}
        clean = step
    return out
