"""`fleetrl report RUN_DIR`: PNG plots of a run's metrics and a report.html that shows them.

Every curve is drawn twice: the raw per-step values faint, and an exponential moving average over
them solid (debiased, as TensorBoard smooths, with a span that grows with the run), so noisy
series — policy lag and queue depth jump by whole versions and groups every step — read as trends.
Health events and launcher restarts are marked on the step axis of every plot (alerts as ticks along
the top, stops, rollbacks and restarts as dashed lines), and listed grouped by rule. There is one plot per
reward function (``reward/<label>/mean``), and the page ends with the latest sample completions
(``completions.jsonl``) and the last step's metrics.

A resumed run logs the steps after its checkpoint again; the newest row of each step wins.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

PANELS = [
    ("reward", ["reward/mean"], "reward (batch mean)"),
    ("eval", ["eval/accuracy"], "held-out greedy accuracy"),
    (
        "kl",
        ["actor/kl", "off_policy/mismatch_kl", "off_policy/drift_kl"],
        "KL to reference / engine mismatch KL / policy drift KL",
    ),
    ("entropy", ["actor/entropy"], "policy entropy"),
    ("grad_norm", ["actor/grad_norm"], "grad norm"),
    ("clipfrac", ["actor/clipfrac"], "clip fraction"),
    (
        "staleness",
        ["off_policy/staleness_mean", "off_policy/staleness_max"],
        "policy lag of trained samples (versions)",
    ),
    ("queue", ["broker/queue_depth", "broker/groups_in_flight"], "broker queue depth / groups in flight"),
    ("throughput", ["throughput/samples_per_s"], "learner samples/s"),
    (
        "timing",
        ["timing/wait_batch_s", "timing/forward_s", "timing/update_s", "timing/sync_s", "timing/eval_s"],
        "seconds per step",
    ),
    ("length", ["response/length_mean"], "response length (tokens)"),
    ("truncated", ["response/truncated_frac"], "share of responses truncated at max_new_tokens"),
    ("reward_failed", ["reward/failed_frac"], "share of trained samples with a failed reward (see rollout-*.log)"),
]
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
STYLES = ["-", "--", "-.", ":", "-", "--"]  # a second series that overlaps the first still shows
COMPLETIONS_SHOWN = 24  # rows of completions.jsonl on the page (the latest)


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written while we read
                continue
    return rows


def latest_per_step(rows: list[dict]) -> list[dict]:
    """One row per step, the newest (a resumed run logs the steps after its checkpoint again), in step order."""
    by_step: dict[int, dict] = {}
    for row in rows:
        if isinstance(row.get("step"), int):
            by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            xs.append(row["step"])
            ys.append(float(value))
    return xs, ys


def smooth(ys: list[float], weight: float | None = None) -> list[float]:
    """Debiased exponential moving average (TensorBoard's smoothing); ``weight`` grows with the length."""
    if weight is None:
        weight = min(0.95, max(0.0, 1.0 - 8.0 / max(len(ys), 1)))
    out, last, norm = [], 0.0, 0.0
    for y in ys:
        last = weight * last + (1 - weight) * y
        norm = weight * norm + (1 - weight)
        out.append(last / norm if norm else y)
    return out


def event_marks(events: list[dict], rows: list[dict]) -> list[tuple[int, str]]:
    """(step, label) of each health event and restart; a restart (timed, not stepped) maps to the step logged then."""
    marks = []
    for e in events:
        step = e.get("step")
        if step is None and "time" in e and rows:
            before = [r["step"] for r in rows if r.get("time", 0) <= e["time"]]
            step = before[-1] if before else rows[0]["step"]
        if step is None:
            continue
        label = (
            f"restart {e.get('child')}"
            if e.get("event") == "restart"
            else f"{e.get('rule', e.get('event', 'event'))} -> {e.get('action', '')}".strip(" ->")
        )
        marks.append((int(step), label))
    return marks


def reward_panels(rows: list[dict]) -> list[tuple[str, list[str], str]]:
    """One panel per reward function: the ``reward/<label>/mean`` keys the learner logged."""
    labels = sorted(
        {
            k.split("/")[1]
            for r in rows
            for k in r
            if k.startswith("reward/") and k.endswith("/mean") and k.count("/") == 2
        }
    )
    return [
        (f"reward_{label}", [f"reward/{label}/mean"], f"reward function {label} (unweighted mean)") for label in labels
    ]


DENSE = 60  # above this many points the raw values are drawn as dots: lines between jumps would fill the plot


def _draw(ax, rows: list[dict], keys: list[str], marks: list[tuple[int, str]]) -> bool:
    drawn = 0
    for key in keys:
        xs, ys = series(rows, key)
        if not xs:
            continue
        color, style = COLORS[drawn % len(COLORS)], STYLES[drawn % len(STYLES)]  # by what is drawn, not listed
        drawn += 1
        if len(xs) > DENSE:
            ax.plot(xs, ys, ".", color=color, alpha=0.3, markersize=3.5, markeredgewidth=0)
        elif len(xs) > 1:
            ax.plot(xs, ys, color=color, alpha=0.3, linewidth=0.9)
        if len(xs) > 1:
            ax.plot(xs, smooth(ys), color=color, linestyle=style, linewidth=1.8, label=key)
        else:
            ax.plot(xs, ys, "o", color=color, label=key)
    alerts = [step for step, label in marks if label.endswith("-> alert")]
    for step, label in marks:
        if not label.endswith("-> alert"):  # stops, rollbacks, restarts: a line across the plot
            ax.axvline(step, color="#cc0000", linestyle="--", linewidth=1.0, alpha=0.8)
    if alerts:
        ax.scatter(
            alerts,
            [1.0] * len(alerts),
            transform=ax.get_xaxis_transform(),
            marker="v",
            s=16,
            color="#cc0000",
            alpha=0.8,
            clip_on=False,
            zorder=3,
        )
    return drawn > 0


def plot(rows: list[dict], out_dir: Path, marks: list[tuple[int, str]] | None = None) -> list[tuple[str, Path]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    marks = marks or []
    made = []
    for name, keys, title in [*PANELS[:1], *reward_panels(rows), *PANELS[1:]]:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        if not _draw(ax, rows, keys, marks):
            plt.close(fig)
            continue
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.spines[["top", "right"]].set_visible(False)
        if len(keys) > 1 or name == "timing":
            ax.legend(fontsize=7, frameon=False)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append((title, path))
    return made


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))


def completions_html(rows: list[dict]) -> str:
    if not rows:
        return "<p>none logged (telemetry.log_completions_every=0, or no step reached it yet)</p>"
    cells = []
    for r in rows[-COMPLETIONS_SHOWN:]:
        adv = r.get("advantage")
        cells.append(
            f"<tr><td>{r.get('step')}</td><td>v{r.get('policy_version')}</td><td><pre>{html.escape(str(r.get('prompt')))}"
            f"</pre></td><td><pre>{html.escape(str(r.get('response')))}</pre></td><td>{_fmt(r.get('reward'))}</td>"
            f"<td>{'' if adv is None else _fmt(adv)}</td><td>{html.escape(str(r.get('finish_reason')))}, "
            f"{r.get('tokens')} tok</td></tr>"
        )
    return (
        "<table class=c><tr><th>step</th><th>policy</th><th>prompt (as the model saw it)</th><th>response</th>"
        "<th>reward</th><th>advantage</th><th>end</th></tr>" + "".join(cells) + "</table>"
    )


def events_html(events: list[dict], marks: list[tuple[int, str]]) -> str:
    """Events grouped by what fired (a rule that alerts every few steps is one line, not fifty)."""
    if not marks:
        return "<p>none</p>"
    grouped: dict[str, list[int]] = {}
    for step, label in marks:
        grouped.setdefault(label, []).append(step)
    messages = {f"{e.get('rule')} -> {e.get('action')}": e.get("message", "") for e in events if e.get("rule")}
    items = "".join(
        f"<li><b>{html.escape(label)}</b>: {len(steps)} time(s), step{'s' if len(steps) > 1 else ''} "
        f"{steps[0]}{f'–{steps[-1]}' if len(steps) > 1 else ''}"
        f"{'<br><span class=note>last: ' + html.escape(messages[label]) + '</span>' if messages.get(label) else ''}</li>"
        for label, steps in grouped.items()
    )
    return (
        f"<ul>{items}</ul><p class=note>On the plots: red ticks along the top mark alerts; dashed red lines mark "
        "stops, rollbacks and restarts.</p>"
    )


STYLE = """body{font-family:system-ui,sans-serif;margin:1.5em 2em;color:#222}h1{margin-bottom:.2em}
.sub{color:#666;margin-top:0}.grid{display:flex;flex-wrap:wrap;gap:.6em}figure{margin:0;border:1px solid #e4e4e4;
border-radius:6px;padding:.3em;background:#fff}img{width:480px;display:block}figcaption{font-size:12px;color:#555;
text-align:center}table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ddd;padding:3px 6px;
vertical-align:top;text-align:left}table.c pre{white-space:pre-wrap;max-width:520px;margin:0;font-size:11px}
.warn{color:#a00}.kpi{display:inline-block;margin-right:1.6em}.kpi b{font-size:20px;display:block}.note{color:#777;font-size:12px}"""

HEADLINE = [
    ("reward/mean", "reward"),
    ("eval/accuracy", "eval accuracy"),
    ("actor/kl", "KL"),
    ("off_policy/staleness_mean", "policy lag"),
    ("throughput/samples_per_s", "samples/s"),
    ("reward/failed_frac", "reward failed (share)"),
]


def rollout_reward_note(run_dir: Path) -> str:
    """A warning paragraph when the rollout servers' rewards failed or left samples unscored (those samples
    never reach the learner's metrics), from each ``rollout-*.metrics.jsonl``'s last counters; else ""."""
    total = {"samples": 0.0, "failed": 0.0, "unscored": 0.0}
    for path in sorted(run_dir.glob("rollout-*.metrics.jsonl")):
        last = next((r for r in reversed(read_jsonl(path)) if "reward/samples_total" in r), None)
        for k in total:
            total[k] += float(last.get(f"reward/{k}_total", 0.0)) if last else 0.0
    if not (total["failed"] or total["unscored"]):
        return ""
    return (
        f"<p class=warn><b>Rewards:</b> {total['failed']:.0f} of {total['samples']:.0f} scored samples had a "
        f"failed reward, {total['unscored']:.0f} got no score (None) and were not trained on; "
        "see rollout-*.log for the first errors.</p>"
    )


def build_report(run_dir: Path) -> Path:
    rows = latest_per_step(read_jsonl(run_dir / "metrics.jsonl"))
    if not rows:
        raise FileNotFoundError(f"{run_dir}/metrics.jsonl is missing or empty: is {run_dir} a fleetrl run directory?")
    plots_dir = run_dir / "plots"
    plots_dir.mkdir(exist_ok=True)
    events = read_jsonl(run_dir / "events.jsonl")
    marks = event_marks(events, rows)
    made = plot(rows, plots_dir, marks)
    last = rows[-1]
    kpis = "".join(
        f"<span class=kpi><b>{_fmt(last[k])}</b>{label}</span>"
        for k, label in HEADLINE
        if isinstance(last.get(k), (int, float))
    )
    evals = [r for r in rows if isinstance(r.get("eval/accuracy"), (int, float))]
    if evals:
        kpis += f"<span class=kpi><b>{evals[0]['eval/accuracy']:.3f} → {evals[-1]['eval/accuracy']:.3f}</b>eval accuracy, first → last</span>"
    minutes = (last.get("time", 0) - rows[0].get("time", 0)) / 60
    summary = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{v:.4g}</td></tr>"
        for k, v in sorted(last.items())
        if isinstance(v, (int, float)) and k not in ("time",)
    )
    figures = "".join(
        f'<figure><img src="plots/{p.name}"><figcaption>{html.escape(t)}</figcaption></figure>' for t, p in made
    )
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>fleetrl report: {html.escape(run_dir.name)}</title>
<style>{STYLE}</style></head><body>
<h1>{html.escape(run_dir.name)}</h1><p class=sub>{len(rows)} steps, last step {last["step"]}, {minutes:.1f} min of training
(faint: raw per-step values; solid: smoothed)</p><p>{kpis}</p>{rollout_reward_note(run_dir)}
<div class=grid>{figures}</div>
<h2>Health events</h2>{events_html(events, marks)}
<h2>Sample completions</h2>{completions_html(read_jsonl(run_dir / "completions.jsonl"))}
<details><summary><h2 style="display:inline">Last step's metrics</h2></summary><table>{summary}</table></details>
</body></html>"""
    out = run_dir / "report.html"
    out.write_text(page)
    return out


def main(args) -> int:
    out = build_report(Path(args.run_dir))
    print(f"wrote {out} ({len(list((out.parent / 'plots').glob('*.png')))} plots)")
    return 0
