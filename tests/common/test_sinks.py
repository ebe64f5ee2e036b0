"""Metric sinks: what `make_sinks` builds from the telemetry section, and each optional sink with its
library installed (skipped without it): TensorBoard event files, a wandb offline run, a Prometheus
endpoint."""

from __future__ import annotations

import json
import math
import re
import sys
import urllib.request

import pytest

from fleetrl.common.config import ConfigError, load_config
from fleetrl.learner.monitor import Monitor
from fleetrl.learner.sinks import ConsoleSink, JsonlSink, make_sinks, prometheus_name
from tests.conftest import free_port

METRICS = {"reward/mean": 0.5, "actor/kl": 0.01, "broker/queue_depth": 3.0}


def test_default_sinks_are_jsonl_and_console_on_rank_zero_only(tmp_path):
    sinks = make_sinks(None, tmp_path, 0)
    assert [type(s) for s in sinks] == [JsonlSink, ConsoleSink]
    assert make_sinks(load_config(None, ["telemetry.tensorboard=true"]), tmp_path, 1) == []
    monitor = Monitor(sinks)
    monitor.log(1, {**METRICS, "actor/loss": math.nan})
    monitor.close()
    [row] = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == 1 and row["reward/mean"] == 0.5 and row["actor/loss"] == "nan"


def test_the_console_line_says_what_each_figure_is(caplog):
    caplog.set_level("INFO", logger="fleetrl.learner")
    ConsoleSink().write(3, {"reward/mean": 0.25, "actor/loss": -0.5, "reward/exact/mean": 1.0})
    [line] = [r.getMessage() for r in caplog.records]
    assert line == "step 3  reward_mean=0.25  loss=-0.5"


def test_a_sink_without_its_library_fails_at_start_with_the_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    cfg = load_config(None, ["telemetry.wandb_project=fleetrl-test"])
    with pytest.raises(ConfigError, match=r"telemetry.wandb_project needs wandb .*fleetrl\[tracking\]"):
        Monitor.for_run(tmp_path, 0, cfg=cfg)


def test_tensorboard_sink_writes_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    monitor = Monitor.for_run(tmp_path, 0, cfg=load_config(None, ["telemetry.tensorboard=true"]))
    monitor.log(1, METRICS)
    monitor.log(2, {"reward/mean": 0.75})
    monitor.close()
    [events] = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    events = LegacyEventFileLoader(str(events)).Load()
    scalars = [(e.step, v.tag, v.simple_value) for e in events for v in e.summary.value]
    assert (1, "reward/mean", 0.5) in scalars and (2, "reward/mean", 0.75) in scalars
    resources = {"resource/learner/cpu_percent", "resource/learner/rss_mb"}  # the monitor adds them to every row
    assert {tag for _, tag, _ in scalars} == set(METRICS) | resources


def test_wandb_sink_writes_an_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    cfg = load_config(None, ["telemetry.wandb_project=fleetrl-test", "telemetry.wandb_mode=offline"])
    monitor = Monitor.for_run(tmp_path, 0, cfg=cfg)
    for step in (1, 2):
        monitor.log(step, METRICS)
    monitor.close()
    [run] = (tmp_path / "wandb").glob("offline-run-*")
    assert list(run.glob("run-*.wandb")), sorted(p.name for p in run.iterdir())


def test_prometheus_sink_serves_the_latest_metrics_over_http(tmp_path):
    pytest.importorskip("prometheus_client")
    port = free_port()
    monitor = Monitor.for_run(tmp_path, 0, cfg=load_config(None, [f"telemetry.prometheus_port={port}"]))
    try:
        monitor.log(1, METRICS)
        monitor.log(2, {**METRICS, "reward/mean": 0.25, "actor/loss": math.inf})
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        monitor.close()
    values = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(fleetrl_\w+)(?:\{[^}]*\})? (\S+)$", body, re.M)}
    assert values[prometheus_name("reward/mean")] == 0.25 and values["fleetrl_step"] == 2.0
    assert values["fleetrl_broker_queue_depth"] == 3.0 and "fleetrl_actor_loss" not in values  # inf is skipped
    assert values["fleetrl_resource_learner_rss_mb"] > 10 and "fleetrl_resource_learner_cpu_percent" in values
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(row["resource/learner/rss_mb"] > 10 for row in rows)  # the same row in metrics.jsonl
    with pytest.raises(OSError):  # closed: the port is free again and nothing answers
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_prometheus_step_metrics_carry_the_trace_of_a_trained_group_as_an_exemplar(tmp_path):
    """OpenMetrics exemplars: scraped with the OpenMetrics Accept header, the step counters and the
    step-time histogram carry the trace id of a group the step trained (tracing.note_exemplar,
    called by learner/tracing.py); the plain text format has none."""
    pytest.importorskip("prometheus_client")
    from fleetrl.common.telemetry import tracing

    port = free_port()
    monitor = Monitor.for_run(tmp_path, 0, cfg=load_config(None, [f"telemetry.prometheus_port={port}"]))
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    try:
        tracing.note_exemplar({"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}, "g1")
        monitor.log(1, {**METRICS, "batch/samples": 8.0, "timing/step_total_s": 0.7})
        tracing.note_exemplar({"traceparent": f"00-{'0' * 31}1-00f067aa0ba902b7-00"}, "g2")  # unsampled: ignored
        url = f"http://127.0.0.1:{port}/metrics"
        request = urllib.request.Request(url, headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        with urllib.request.urlopen(request, timeout=10) as reply:
            body, kind = reply.read().decode(), reply.headers["Content-Type"]
        plain = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        monitor.close()
        tracing.shutdown_tracing()  # clears the exemplar
    assert kind.startswith("application/openmetrics-text") and body.rstrip().endswith("# EOF")
    exemplar = f'# {{group_id="g1",trace_id="{trace_id}"}}'
    lines = {line.split(" ")[0]: line for line in body.splitlines() if not line.startswith("#")}
    assert lines["fleetrl_learner_steps_total"].startswith("fleetrl_learner_steps_total 1.0 " + exemplar)
    assert lines["fleetrl_learner_samples_total"].startswith("fleetrl_learner_samples_total 8.0 " + exemplar)
    assert exemplar + " 0.7" in lines['fleetrl_learner_step_seconds_bucket{le="1.0"}']  # the bucket 0.7 fell in
    assert "trace_id" not in lines['fleetrl_learner_step_seconds_bucket{le="0.5"}']
    assert "fleetrl_reward_mean 0.5" in body and "trace_id" not in plain
    assert tracing.exemplar() == {}


ROWS = [
    {
        "step": 4,
        "policy_version": 3,
        "group": "g1",
        "prompt": "<|user|>1+2=<eos><|assistant|>",
        "response": "3",
        "reward": 1.0,
        "parts": {"exact": 1.0},
        "advantage": 0.5,
        "finish_reason": "stop",
        "tokens": 2,
    },
    {
        "step": 4,
        "policy_version": 3,
        "group": "g1",
        "prompt": "<|user|>1+2=<eos><|assistant|>",
        "response": "4|x",
        "reward": 0.0,
        "parts": {"exact": 0.0},
        "advantage": -0.5,
        "finish_reason": "length",
        "tokens": 5,
    },
]


def test_completions_reach_the_jsonl_file_and_tensorboard_text(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monitor = Monitor.for_run(tmp_path, 0, cfg=load_config(None, ["telemetry.tensorboard=true"]))
    monitor.log(4, METRICS)
    monitor.log_completions(4, ROWS)
    monitor.close()
    lines = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert lines == ROWS
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    [event] = acc.Tensors("completions")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 4 and "| policy_version | prompt | response |" in text
    assert "<\\|user\\|>1+2=<eos><\\|assistant\\|>" in text and "| 4\\|x |" in text  # pipes escaped: the table holds


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for key in (
        "WANDB_MODE",
        "WANDB_PROJECT",
        "WANDB_ENTITY",
        "WANDB_RUN_GROUP",
        "WANDB_TAGS",
        "WANDB_NAME",
        "WANDB_DIR",
        "WANDB_DISABLED",
    ):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    return monkeypatch


def test_wandb_takes_entity_group_tags_name_and_logs_a_completions_table(tmp_path, wandb_env):
    from fleetrl.learner.sinks import WandbSink

    cfg = load_config(
        None,
        [
            "telemetry.wandb_project=fleetrl-test",
            "telemetry.wandb_group=sweep-1",
            "telemetry.wandb_tags=[grpo, cpu]",
            "telemetry.wandb_name=trial-3",
        ],
    )
    monitor = Monitor.for_run(tmp_path, 0, cfg=cfg)
    [sink] = [s for s in monitor.sinks if isinstance(s, WandbSink)]
    assert (sink.run.group, list(sink.run.tags), sink.run.name) == ("sweep-1", ["grpo", "cpu"], "trial-3")
    assert sink.run.settings.mode == "offline"  # nothing set: offline
    monitor.log(4, METRICS)
    monitor.log_completions(4, ROWS)
    monitor.close()
    [run] = (tmp_path / "wandb").glob("offline-run-*")
    [table] = run.glob("files/media/table/completions_*.table.json")
    data = json.loads(table.read_text())
    assert data["columns"][:4] == ["step", "policy_version", "prompt", "response"] and len(data["data"]) == 2


def test_wandb_variables_are_respected(tmp_path, wandb_env):
    from fleetrl.learner.sinks import WandbSink

    wandb_env.setenv("WANDB_MODE", "disabled")  # honoured: no wandb sink at all
    cfg = load_config(None, ["telemetry.wandb_project=fleetrl-test"])
    assert not [s for s in make_sinks(cfg, tmp_path, 0) if isinstance(s, WandbSink)]
    wandb_env.setenv("WANDB_MODE", "offline")
    wandb_env.setenv("WANDB_PROJECT", "from-env")  # a project from the environment turns it on
    wandb_env.setenv("WANDB_RUN_GROUP", "env-group")
    wandb_env.setenv("WANDB_NAME", "env-name")
    sinks = make_sinks(load_config(None, []), tmp_path, 0)
    try:
        [sink] = [s for s in sinks if isinstance(s, WandbSink)]
        assert (sink.run.project, sink.run.group, sink.run.name) == ("from-env", "env-group", "env-name")
    finally:
        for s in sinks:
            s.close()


def test_prometheus_binds_loopback_by_default(tmp_path):
    pytest.importorskip("prometheus_client")
    from fleetrl.learner.sinks import PrometheusSink

    assert load_config(None, []).telemetry.prometheus_host == "127.0.0.1"
    sinks = make_sinks(load_config(None, ["telemetry.prometheus_port=0"]), tmp_path, 0)
    try:
        [sink] = [s for s in sinks if isinstance(s, PrometheusSink)]
        assert sink.server.server_address[0] == "127.0.0.1"
    finally:
        for s in sinks:
            s.close()
