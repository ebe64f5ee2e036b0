"""`fleetrl report RUN_DIR`: PNG plots of a run's metrics and a report.html that shows them."""

from __future__ import annotations

import html
import json
from pathlib import Path

PANELS = [
    ("reward", ["reward/mean"], "reward (batch mean)"),
    ("eval", ["eval/accuracy"], "held-out greedy accuracy"),
    ("kl", ["actor/kl", "off_policy/mismatch_kl"], "KL to reference / behaviour mismatch KL"),
    ("entropy", ["actor/entropy"], "policy entropy"),
    ("grad_norm", ["actor/grad_norm"], "grad norm"),
    ("clipfrac", ["actor/clipfrac"], "clip fraction"),
    ("staleness", ["off_policy/staleness_mean", "off_policy/staleness_max"], "policy lag of trained samples"),
    ("queue", ["broker/queue_depth", "broker/groups_in_flight"], "broker queue depth / in flight"),
    ("throughput", ["throughput/samples_per_s"], "learner samples/s"),
    ("timing", ["timing/wait_batch_s", "timing/forward_s", "timing/update_s", "timing/sync_s", "timing/eval_s"],
     "seconds per step"),
    ("length", ["response/length_mean"], "response length"),
]


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)):
            xs.append(row["step"])
            ys.append(value)
    return xs, ys


def plot(rows: list[dict], out_dir: Path, events: list[dict] = ()) -> list[tuple[str, Path]]:
    """One PNG per panel; health rollbacks (red) and stops (black) as dashed vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    for name, keys, title in PANELS:
        series = [(k, *_series(rows, k)) for k in keys]
        series = [s for s in series if s[1]]
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.2))
        for key, xs, ys in series:
            ax.plot(xs, ys, label=key, linewidth=1.2, marker="o" if len(xs) < 30 else None, markersize=3)
        for e in events:
            if e.get("rule") == "rollback" or e.get("action") == "stop":
                ax.axvline(e["step"], color="red" if e.get("rule") == "rollback" else "black", linestyle="--",
                           linewidth=0.8, alpha=0.7)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(series) > 1 or name == "timing":
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append((title, path))
    return made


def build_report(run_dir: Path) -> Path:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    if not rows:
        raise FileNotFoundError(f"{run_dir}/metrics.jsonl is missing or empty: is {run_dir} a fleetrl run directory?")
    plots_dir = run_dir / "plots"
    plots_dir.mkdir(exist_ok=True)
    events = read_jsonl(run_dir / "events.jsonl")
    made = plot(rows, plots_dir, events)
    last = rows[-1]
    summary = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.4g}</td></tr>" for k, v in sorted(last.items())
                      if isinstance(v, (int, float)) and k not in ("time",))
    figures = "".join(f'<figure><img src="plots/{p.name}"><figcaption>{html.escape(t)}</figcaption></figure>'
                      for t, p in made)
    event_rows = "".join(f"<li>{'<b>' if e.get('rule') == 'rollback' else ''}{html.escape(json.dumps(e))}"
                         f"{'</b>' if e.get('rule') == 'rollback' else ''}</li>" for e in events) or "<li>none</li>"
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>fleetrl report: {html.escape(run_dir.name)}</title>
<style>body{{font-family:sans-serif;margin:2em}}figure{{display:inline-block;margin:.5em}}img{{width:480px}}
table{{border-collapse:collapse;font-size:12px}}td{{border:1px solid #ccc;padding:2px 6px}}</style></head><body>
<h1>{html.escape(run_dir.name)}</h1><p>{len(rows)} steps; last step {last['step']}.</p>
{figures}<h2>Health events</h2><p>Rollbacks in bold, and as red dashed lines on the plots (stops: black).</p><ul>{event_rows}</ul><h2>Last step</h2><table>{summary}</table></body></html>"""
    out = run_dir / "report.html"
    out.write_text(page)
    return out


def main(args) -> int:
    out = build_report(Path(args.run_dir))
    print(f"wrote {out} ({len(list((out.parent / 'plots').glob('*.png')))} plots)")
    return 0
