"""Metric sinks: where the learner's monitor sends each step's flat metric dict (and sample completions).

``metrics.jsonl`` is always written; the console gets a short line per step; the ``telemetry``
section adds TensorBoard event files (``tensorboard: true``), a wandb run (``wandb_project`` or
``WANDB_PROJECT``; offline unless ``wandb_mode`` / ``WANDB_MODE`` say otherwise, off with
``WANDB_MODE=disabled``) and a Prometheus endpoint with OpenMetrics exemplars
(``prometheus_port`` on ``prometheus_host``, loopback by default). TensorBoard, wandb and
prometheus_client are the optional ``tracking`` extra (``pip install 'fleetrl[tracking]'``): each
is imported only when its sink is built, and a sink asked for without its library fails at start-up
with that install hint.

Sample completions (``learner/completions.py``) go to TensorBoard as a text table (tag
``completions``) and to wandb as a ``wandb.Table``; the other sinks ignore them.

wandb settings left null take wandb's own ``WANDB_*`` variables (WANDB_PROJECT, WANDB_ENTITY,
WANDB_RUN_GROUP, WANDB_TAGS, WANDB_NAME, WANDB_DIR, WANDB_MODE), read when the sink starts; a value set
in the config wins, as an argument to ``wandb.init`` wins over the environment.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Protocol

from fleetrl.common.config import ConfigError
from fleetrl.common.config.schema import JobConfig

log = logging.getLogger("fleetrl.learner")  # the monitor runs in the learner

INSTALL_HINT = "pip install 'fleetrl[tracking]'"


class Sink(Protocol):
    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def write_completions(self, step: int, rows: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


COMPLETION_COLUMNS = ("policy_version", "prompt", "response", "reward", "advantage", "finish_reason", "tokens")


def _need(module: str, setting: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(
            f"{setting} needs {module.split('.')[0]} ({e}); install the tracking extra: {INSTALL_HINT}, "
            "or turn the setting off"
        ) from None


class JsonlSink:
    """``metrics.jsonl``: one JSON object per step with ``step`` and ``time`` (non-finite values as strings)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", buffering=1)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, "time": time.time()}
        row.update({k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items()})
        self.file.write(json.dumps(row) + "\n")

    def write_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        pass  # the monitor writes completions.jsonl

    def close(self) -> None:
        self.file.close()


class ConsoleSink:
    """A short log line every ``every`` steps."""

    KEYS = (
        "reward/mean",
        "actor/loss",
        "actor/kl",
        "actor/entropy",
        "actor/grad_norm",
        "off_policy/staleness_mean",
        "throughput/samples_per_s",
        "resource/learner/cpu_percent",
        "resource/learner/rss_mb",
    )

    LABELS = {"reward/mean": "reward_mean"}  # a bare `mean=` does not say of what

    def __init__(self, every: int = 1):
        self.every = every

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if step % self.every == 0:
            shown = "  ".join(
                f"{self.LABELS.get(k, k.split('/')[-1])}={metrics[k]:.4g}" for k in self.KEYS if k in metrics
            )
            log.info("step %d  %s", step, shown)

    def write_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardSink:
    """Scalars into ``<run_dir>/tensorboard/`` (``tensorboard --logdir RUN_DIR/tensorboard``), no torch needed."""

    def __init__(self, log_dir: Path):
        writer = _need("tensorboard.summary.writer.event_file_writer", "telemetry.tensorboard=true")
        self._event = _need("tensorboard.compat.proto.event_pb2", "telemetry.tensorboard=true").Event
        self._proto = _need("tensorboard.compat.proto.summary_pb2", "telemetry.tensorboard=true")
        self._summary = self._proto.Summary
        log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = writer.EventFileWriter(str(log_dir))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        values = [self._summary.Value(tag=k, simple_value=float(v)) for k, v in metrics.items()]
        self.writer.add_event(self._event(step=step, wall_time=time.time(), summary=self._summary(value=values)))
        self.writer.flush()

    def write_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A Markdown table under the tag ``completions`` (TensorBoard's Text tab), as the text plugin stores it."""
        from tensorboard.compat.proto import tensor_pb2, types_pb2

        text = completions_markdown(rows)
        meta = self._proto.SummaryMetadata(plugin_data=self._proto.SummaryMetadata.PluginData(plugin_name="text"))
        tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[text.encode()])
        value = self._summary.Value(tag="completions", metadata=meta, tensor=tensor)
        self.writer.add_event(self._event(step=step, wall_time=time.time(), summary=self._summary(value=[value])))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One wandb run per training run; ``mode: offline`` writes ``<run_dir>/wandb/offline-run-*``
    (upload later with ``wandb sync``). Settings left null are wandb's own (``WANDB_*``)."""

    def __init__(self, tel: Any, run_dir: Path, config: dict[str, Any]):
        self.wandb = wandb = _need("wandb", "telemetry.wandb_project")
        env = os.environ.get
        tags = tel.wandb_tags if tel.wandb_tags is not None else [t for t in env("WANDB_TAGS", "").split(",") if t]
        chosen = {
            "entity": tel.wandb_entity or env("WANDB_ENTITY"),
            "group": tel.wandb_group or env("WANDB_RUN_GROUP"),
            "tags": tags or None,
            "project": wandb_project(tel),
            "mode": wandb_mode(tel),
        }
        name = tel.wandb_name or env("WANDB_NAME") or run_dir.name
        self.run = wandb.init(
            dir=env("WANDB_DIR") or str(run_dir),
            name=name,
            config=config,
            **{k: v for k, v in chosen.items() if v is not None},
        )

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def write_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        table = self.wandb.Table(
            columns=["step", *COMPLETION_COLUMNS],
            data=[[step, *(_cell(r.get(c)) for c in COMPLETION_COLUMNS)] for r in rows],
        )
        self.run.log({"completions": table}, step=step)

    def close(self) -> None:
        self.run.finish()


def wandb_mode(tel: Any) -> str:
    """telemetry.wandb_mode, else WANDB_MODE (WANDB_DISABLED=true: disabled), else offline."""
    if tel.wandb_mode:
        return tel.wandb_mode
    if os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):
        return "disabled"
    return os.environ.get("WANDB_MODE") or "offline"


def wandb_project(tel: Any) -> str | None:
    return tel.wandb_project or os.environ.get("WANDB_PROJECT") or None


def _cell(value: Any) -> Any:
    return json.dumps(value) if isinstance(value, (dict, list)) else value


def completions_markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table (pipes and newlines escaped)."""

    def esc(x: Any) -> str:
        text = f"{x:.4g}" if isinstance(x, float) else str(x)
        return text.replace("|", "\\|").replace("\n", "\\n")

    head = "| " + " | ".join(COMPLETION_COLUMNS) + " |\n|" + "---|" * len(COMPLETION_COLUMNS) + "\n"
    return head + "".join("| " + " | ".join(esc(r.get(c)) for c in COMPLETION_COLUMNS) + " |\n" for r in rows)


def prometheus_name(key: str) -> str:
    """``reward/mean`` -> ``fleetrl_reward_mean`` (Prometheus names allow [a-zA-Z0-9_:] only)."""
    return "fleetrl_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


class _LatestGauges:
    """A prometheus_client collector: the latest value of every metric, one gauge each."""

    def __init__(self, family: Any):
        self.family, self.values = family, {}  # prometheus name -> (key, value)

    def collect(self):
        for name, (key, value) in list(self.values.items()):
            yield self.family(name, key, value=value)


class PrometheusSink:
    """``http://HOST:PORT/metrics``: the latest value of every metric as a gauge, and exemplars.

    Gauges: ``fleetrl_<key>`` (``/`` and other characters as ``_``) and ``fleetrl_step``. Beside them
    ``fleetrl_learner_steps_total`` and ``fleetrl_learner_samples_total`` (counters) and
    ``fleetrl_learner_step_seconds`` (a histogram of ``timing/step_total_s``) carry an OpenMetrics
    exemplar per step, ``{trace_id, group_id}`` of a group that step trained (``tracing.exemplar()``,
    set by ``learner/tracing.py``), shown to scrapers that ask for ``application/openmetrics-text``
    (Prometheus with exemplar storage on, Grafana): a point on a dashboard links to the trace.
    Served by ``prometheus_client``'s HTTP server on a registry of its own.
    """

    STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

    def __init__(self, port: int, service: str = "learner", addr: str = "127.0.0.1"):
        prometheus = _need("prometheus_client", "telemetry.prometheus_port")
        from prometheus_client.core import GaugeMetricFamily

        self.registry = prometheus.CollectorRegistry()
        self.gauges = _LatestGauges(GaugeMetricFamily)
        self.registry.register(self.gauges)
        self.steps = prometheus.Counter("fleetrl_learner_steps", "learner steps", registry=self.registry)
        self.samples = prometheus.Counter("fleetrl_learner_samples", "samples trained on", registry=self.registry)
        self.step_s = prometheus.Histogram(
            "fleetrl_learner_step_seconds", "timing/step_total_s", buckets=self.STEP_BUCKETS, registry=self.registry
        )
        try:
            self.server, self.thread = prometheus.start_http_server(port, addr=addr, registry=self.registry)
        except OSError as e:
            raise ConfigError(
                f"telemetry.prometheus_port={port}: cannot serve metrics on {addr}:{port} ({e}); "
                "choose a free port (or null), or check telemetry.prometheus_host"
            ) from None
        self.port = self.server.server_port
        log.info("serving Prometheus metrics on http://%s:%d/metrics", addr, self.port)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        from fleetrl.common.telemetry import tracing

        values = {
            prometheus_name(k): (k, float(v)) for k, v in {"step": float(step), **metrics}.items() if math.isfinite(v)
        }
        self.gauges.values = {**self.gauges.values, **values}
        exemplar = tracing.exemplar() or None
        if "batch/samples" not in metrics and "timing/step_total_s" not in metrics:
            return  # not a training step (e.g. the step-0 evaluation)
        self.steps.inc(1, exemplar=exemplar)
        samples = metrics.get("batch/samples", 0.0)
        if math.isfinite(samples) and samples > 0:
            self.samples.inc(samples, exemplar=exemplar)
        seconds = metrics.get("timing/step_total_s")
        if seconds is not None and math.isfinite(seconds):
            self.step_s.observe(seconds, exemplar=exemplar)

    def write_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        pass

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def make_sinks(cfg: JobConfig | None, run_dir: str | Path, rank: int, console_every: int = 1) -> list[Sink]:
    """The sinks of one learner rank: all of them on rank 0 (``metrics.jsonl``, console, then those
    ``cfg.telemetry`` turns on), none on the other ranks (their metrics are averaged into rank 0's)."""
    if rank != 0:
        return []
    run_dir = Path(run_dir)
    tel = (cfg or JobConfig()).telemetry
    sinks: list[Sink] = [JsonlSink(run_dir / "metrics.jsonl"), ConsoleSink(console_every)]
    try:
        if tel.tensorboard:
            sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        if wandb_project(tel) and wandb_mode(tel) != "disabled":
            import msgspec

            sinks.append(WandbSink(tel, run_dir, msgspec.to_builtins(cfg or JobConfig())))
        if tel.prometheus_port is not None:
            sinks.append(PrometheusSink(tel.prometheus_port, addr=tel.prometheus_host))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks
