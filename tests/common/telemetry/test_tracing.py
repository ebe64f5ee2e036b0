"""Tracing: the no-op fallback, the jsonl exporter, context propagation, span ids, `fleetrl trace`, and
one trace followed across the three processes of a tiny `fleetrl run`."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from argparse import Namespace
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from opentelemetry import trace

from fleetrl.app.trace_cli import Spans
from fleetrl.app.trace_cli import main as trace_main
from fleetrl.common.config import ConfigError
from fleetrl.common.config.schema import TelemetryConfig
from fleetrl.common.telemetry import tracing as telemetry  # `tracing` is this file's fixture
from tests.common.otlp_receiver import OtlpReceiver
from tests.helpers import make_group

ROOT = Path(__file__).resolve().parents[2]
JSONL = TelemetryConfig(exporter="jsonl")


@pytest.fixture
def tracing(tmp_path):
    """Tracing to ``tmp_path/traces`` for this test; yields a function returning the spans written so far."""
    telemetry.setup_tracing("learner", JSONL, tmp_path, {"service.instance.id": "learner-0", "fleetrl.rank": 0})

    def spans() -> list[dict]:
        assert telemetry.flush_tracing()
        return telemetry.read_spans(tmp_path)

    yield spans
    telemetry.shutdown_tracing()


def test_telemetry_modules_import_without_torch():
    from tests.common.test_imports import _loaded_after

    assert _loaded_after("import fleetrl.common.telemetry.tracing, fleetrl.learner.sinks, fleetrl.app.trace_cli") == []


def test_exporter_none_is_a_no_op(tmp_path):
    tracer = telemetry.setup_tracing("rollout", TelemetryConfig(), tmp_path)
    assert isinstance(tracer, trace.NoOpTracer) and not telemetry.enabled()
    with telemetry.span("generate", attributes={"fleetrl.x": 1}) as s:
        assert s is trace.INVALID_SPAN
        assert telemetry.inject() == {}
    assert telemetry.record_span("push", time.time_ns()) is None
    assert telemetry.group_links([make_group("0:1")]) == []
    from fleetrl.rollout.tracing import LeaseTrace

    assert LeaseTrace.start(None, "r0", 0, time.time_ns()) is None  # the rollout loop builds nothing either
    assert not (tmp_path / telemetry.TRACES_DIR).exists()


def test_jsonl_exporter_writes_one_parseable_record_per_span(tracing, tmp_path):
    with telemetry.span("learner.step", telemetry.ROOT, {"fleetrl.step": 1}) as step:
        with telemetry.span("weights.publish", attributes={"fleetrl.policy_version": 1}):
            pass
    telemetry.record_span("weights.load", time.time_ns() - 5_000_000, parent=telemetry.ROOT)
    spans = tracing()
    [path] = telemetry.trace_files(tmp_path)
    assert path.name == f"learner-{os.getpid()}.jsonl"
    assert all(json.loads(line) for line in path.read_text().splitlines())
    by_name = {s["name"]: s for s in spans}
    assert set(by_name) == {"learner.step", "weights.publish", "weights.load"}
    publish, root = by_name["weights.publish"], by_name["learner.step"]
    assert publish["parent_id"] == root["span_id"] and publish["trace_id"] == root["trace_id"]
    assert root["parent_id"] is None and root["attributes"] == {"fleetrl.step": 1}
    assert root["service"] == "fleetrl-learner" and root["instance"] == "learner-0"
    assert root["trace_id"] == f"{step.get_span_context().trace_id:032x}"
    load = by_name["weights.load"]
    assert load["trace_id"] != root["trace_id"] and load["end_ns"] - load["start_ns"] >= 5_000_000


def test_inject_extract_round_trip(tracing):
    with telemetry.span("prompt", telemetry.ROOT) as parent:
        carrier = telemetry.inject(parent)
        assert carrier == telemetry.inject()  # the current span by default
    ctx = parent.get_span_context()
    assert carrier == {"traceparent": f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-01"}
    remote = trace.get_current_span(telemetry.extract(carrier)).get_span_context()
    assert (remote.trace_id, remote.span_id, remote.is_remote) == (ctx.trace_id, ctx.span_id, True)
    child = telemetry.record_span("broker.ingest", time.time_ns(), parent=carrier)  # as the broker does
    assert child.parent.span_id == ctx.span_id and child.get_span_context().trace_id == ctx.trace_id
    link = telemetry.link_from(carrier, {"fleetrl.group_id": "g"})
    assert link.context.span_id == ctx.span_id and link.attributes["fleetrl.group_id"] == "g"
    assert telemetry.link_from({}) is None and telemetry.extract({}) is not None
    assert telemetry.sampled(carrier) and not telemetry.sampled({"traceparent": carrier["traceparent"][:-2] + "00"})
    assert not telemetry.sampled({}) and not telemetry.sampled(None) and not telemetry.sampled({"traceparent": "01"})
    with_state = {"traceparent": carrier["traceparent"], "tracestate": "vendor=abc"}
    assert telemetry.inject(trace.get_current_span(telemetry.extract(with_state))) == with_state


def test_setup_is_once_per_process_and_jsonl_needs_a_run_dir(tracing, tmp_path):
    first = telemetry.get_tracer()
    assert telemetry.setup_tracing("learner", JSONL, tmp_path / "elsewhere") is first
    telemetry.shutdown_tracing()
    assert not telemetry.enabled()
    with pytest.raises(ConfigError, match="--run-dir"):
        telemetry.setup_tracing("broker", JSONL, None)
    with pytest.raises(ValueError, match="unknown service"):
        telemetry.setup_tracing("trainer", JSONL, tmp_path)


def test_a_learner_step_links_every_group_it_trained_on(tracing):
    groups = []
    for i in range(3):
        with telemetry.span("prompt", telemetry.ROOT) as s:
            groups.append(make_group(f"0:{i}", gid=f"g{i}"))
            groups[-1].trace = telemetry.inject(s)
    untraced = make_group("0:9", gid="g9")  # a group from a server without tracing: no link, no error
    with telemetry.span("learner.step", telemetry.ROOT, links=telemetry.group_links([*groups, untraced])):
        pass
    [step] = [s for s in tracing() if s["name"] == "learner.step"]
    assert [(lk["trace_id"], lk["attributes"]["fleetrl.group_id"]) for lk in step["links"]] == [
        (g.trace["traceparent"].split("-")[1], g.group_id) for g in groups
    ]


def test_otlp_exporter_posts_spans_to_the_collector_over_http():
    received: list[tuple[str, bytes]] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the http.server API
            received.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        cfg = TelemetryConfig(exporter="otlp", otlp_endpoint=f"http://127.0.0.1:{server.server_port}")
        telemetry.setup_tracing("broker", cfg, None, {"service.instance.id": "broker"})
        telemetry.record_span("broker.batch_lease", time.time_ns(), parent=telemetry.ROOT)
        assert telemetry.flush_tracing()
    finally:
        telemetry.shutdown_tracing()
        server.shutdown()
        server.server_close()
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    [(path, body)] = received
    request = ExportTraceServiceRequest.FromString(body)
    [resource_spans] = request.resource_spans
    resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert path == "/v1/traces" and resource["service.name"] == "fleetrl-broker"
    assert [s.name for s in resource_spans.scope_spans[0].spans] == ["broker.batch_lease"]


SEEDED_CHILD = textwrap.dedent("""
    import random, sys
    from fleetrl.common.telemetry import tracing as telemetry  # the name the lines below use
    from fleetrl.common.config.schema import TelemetryConfig
    random.seed(0)
    telemetry.setup_tracing("rollout", TelemetryConfig(exporter="jsonl"), sys.argv[1])
    for _ in range(5):
        with telemetry.span("generate", telemetry.ROOT) as s:
            c = s.get_span_context()
            print(f"{c.trace_id:032x} {c.span_id:016x}")
""")


def test_span_ids_differ_between_identically_seeded_processes(tmp_path):
    outs = [
        subprocess.run(
            [sys.executable, "-c", SEEDED_CHILD, str(tmp_path)], capture_output=True, text=True, check=True, cwd=ROOT
        ).stdout.split()
        for _ in range(2)
    ]
    assert len(outs[0]) == 10 and not set(outs[0]) & set(outs[1])
    assert len(telemetry.trace_files(tmp_path)) == 2  # one file per process
    # the SDK's default generator would have repeated them: it draws from `random`
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    ids = []
    for _ in range(2):
        random.seed(0)
        ids.append(RandomIdGenerator().generate_span_id())
    assert ids[0] == ids[1]


def test_ids_from_the_urandom_pool_differ_in_a_forked_child_and_are_never_zero():
    """The pool is emptied at fork: a child that inherits it draws fresh bytes, not its parent's."""
    gen = telemetry.UrandomIdGenerator()
    gen.generate_span_id()  # the pool is filled now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, then exit without running the parent's atexit
        os.write(write, json.dumps([gen.generate_span_id() for _ in range(8)]).encode())
        os._exit(0)
    os.close(write)
    child = json.loads(os.read(read, 65536))
    os.waitpid(pid, 0)
    parent = [gen.generate_span_id() for _ in range(8)]
    assert len(set(child) | set(parent)) == 16 and all(0 < i < 2**64 for i in child + parent)
    ids = [gen.generate_trace_id() for _ in range(1000)]  # several pool refills
    assert len(set(ids)) == 1000 and all(0 < i < 2**128 for i in ids)


def test_remote_context_reads_our_traceparent_like_the_propagator():
    from opentelemetry.trace import TraceFlags

    for flags in ("01", "00"):
        carrier = {"traceparent": f"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-{flags}"}
        fast, slow = (
            telemetry.remote_context(carrier),
            trace.get_current_span(telemetry.extract(carrier)).get_span_context(),
        )
        assert fast == slow and fast.is_remote and fast.trace_flags == TraceFlags(int(flags))
    for bad in (
        {},
        None,
        {"traceparent": "00-" + "0" * 32 + "-00f067aa0ba902b7-01"},
        {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e473X-00f067aa0ba902b7-01"},
        {"traceparent": "junk"},
    ):
        assert not telemetry.remote_context(bad).is_valid
    with_state = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "tracestate": "v=1"}
    assert telemetry.remote_context(with_state).trace_state.get("v") == "1"  # the propagator's path keeps it


# --------------------------------------------------------------------------------- fleetrl trace


def _span(name, trace_id, span_id, start_ms, dur_ms, instance, parent=None, links=(), **attributes):
    return {
        "name": name,
        "trace_id": trace_id,
        "span_id": span_id,
        "parent_id": parent,
        "service": f"fleetrl-{instance.split('-')[0]}",
        "instance": instance,
        "start_ns": 1_700_000_000_000_000_000 + start_ms * 1_000_000,
        "end_ns": 1_700_000_000_000_000_000 + (start_ms + dur_ms) * 1_000_000,
        "status": "UNSET",
        "attributes": attributes,
        "links": [{"trace_id": t, "span_id": s, "attributes": a} for t, s, a in links],
    }


def _synthetic_run(run_dir: Path) -> None:
    """Two groups of one lease, each with its own trace (gA: T1, gB: T2), both trained at step 7 and
    published as version 7, which rollout-0 loads; gC (T3) is not trained yet."""
    T1, T2, T3, T9 = "1" * 32, "2" * 32, "3" * 32, "9" * 32
    rollout = [
        _span("rollout.group", T1, "a0", 0, 305, "rollout-0", **{"fleetrl.prompt_id": "0:1", "fleetrl.group_id": "gA"}),
        _span("rollout.lease", T1, "a1", 1, 4, "rollout-0", "a0", **{"fleetrl.lease_id": "L1"}),
        _span("rollout.generate", T1, "a2", 6, 200, "rollout-0", "a0", **{"gen_ai.usage.output_tokens": 16}),
        _span("rollout.reward", T1, "a3", 206, 99, "rollout-0", "a0"),
        _span("rollout.push", T1, "a4", 306, 4, "rollout-0", "a0", **{"fleetrl.groups": 2}),
        _span("rollout.group", T2, "b0", 0, 305, "rollout-0", **{"fleetrl.prompt_id": "0:2", "fleetrl.group_id": "gB"}),
        _span("rollout.lease", T2, "b1", 0, 5, "rollout-0", "b0", **{"fleetrl.lease_id": "L1"}),
        _span(
            "rollout.group", T3, "e0", 400, 50, "rollout-0", **{"fleetrl.prompt_id": "0:3", "fleetrl.group_id": "gC"}
        ),
        _span("rollout.load_weights", T1, "a9", 1500, 30, "rollout-0", "d3", **{"fleetrl.policy_version": 7}),
    ]
    broker = [
        _span("broker.ingest", T1, "c1", 308, 1, "broker", "a0", **{"fleetrl.group_id": "gA"}),
        _span("broker.ingest", T2, "c2", 308, 1, "broker", "b0", **{"fleetrl.group_id": "gB"}),
        _span("broker.batch_lease", T1, "c3", 900, 0, "broker", "a0", **{"fleetrl.group_id": "gA"}),
    ]
    learner = [
        _span(
            "learner.step",
            T9,
            "d1",
            890,
            600,
            "learner-0",
            links=[(T1, "a0", {"fleetrl.group_id": "gA"}), (T2, "b0", {"fleetrl.group_id": "gB"})],
            **{"fleetrl.step": 7},
        ),
        _span(
            "learner.train",
            T1,
            "d2",
            890,
            500,
            "learner-0",
            "a0",
            links=[(T9, "d1", {})],
            **{"fleetrl.group_id": "gA", "fleetrl.step": 7},
        ),
        _span(
            "learner.publish_weights",
            T1,
            "d3",
            1400,
            80,
            "learner-0",
            "d2",
            **{"fleetrl.group_id": "gA", "fleetrl.policy_version": 7},
        ),
        _span("learner.train", T2, "f2", 890, 500, "learner-0", "b0", **{"fleetrl.group_id": "gB", "fleetrl.step": 7}),
    ]
    (run_dir / "traces").mkdir(parents=True)
    for name, spans in (("rollout-11", rollout), ("broker-12", broker), ("learner-13", learner)):
        lines = [json.dumps(s) for s in reversed(spans)]  # files are not in time order
        (run_dir / "traces" / f"{name}.jsonl").write_text("\n".join(lines) + "\n" + '{"name": "partly wri')


def test_trace_cli_prints_the_timeline_of_one_group(tmp_path, capsys):
    _synthetic_run(tmp_path)
    assert trace_main(Namespace(run_dir=str(tmp_path), group="gA", n=10)) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("group gA  prompt 0:1  trace " + "1" * 32) and "10 spans over 1.530 s" in out[0]
    rows = [line.split() for line in out[2:]]
    assert [r[3] for r in rows] == [
        "rollout.group",
        "rollout.lease",
        "rollout.generate",
        "rollout.reward",
        "rollout.push",
        "broker.ingest",
        "learner.train",
        "broker.batch_lease",
        "learner.publish_weights",
        "rollout.load_weights",
    ]
    assert [r[0] for r in rows][:3] == ["+0.000s", "+0.001s", "+0.006s"]
    assert rows[2][1] == "0.2000s" and rows[2][2] == "rollout-0" and "gen_ai.usage.output_tokens=16" in out[4]
    assert rows[6][2] == "learner-0" and "step=7" in out[8]
    assert not any("0:2" in line or "gB" in line for line in out)  # gB's trace stays out


def test_trace_cli_lists_the_latest_groups_and_explains_what_is_missing(tmp_path, capsys):
    _synthetic_run(tmp_path)
    assert trace_main(Namespace(run_dir=str(tmp_path), group=None, n=2)) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out[1:3]] == ["gB", "gC"]
    assert out[1].split()[-1] == "7" and out[2].split()[-1] == "-"  # trained at step 7 / not trained
    assert trace_main(Namespace(run_dir=str(tmp_path), group="g", n=10)) == 1
    assert "3 groups match 'g'" in capsys.readouterr().err
    assert trace_main(Namespace(run_dir=str(tmp_path / "none"), group=None, n=10)) == 1
    assert "telemetry.exporter=jsonl" in capsys.readouterr().err
    assert Spans(telemetry.read_spans(tmp_path)).find_group("gC") == "gC"


# ------------------------------------------------------------------------------ across processes


def test_one_trace_per_group_reaches_a_real_otlp_receiver_from_every_process(tmp_path, tiny_model_dir, arith_data):
    """A real `fleetrl run` (broker, rollout and learner processes) with telemetry.exporter=otlp, sending to
    an OTLP/HTTP receiver in this test: one trace id holds the rollout's, the broker's and the learner's
    spans of one group, chained parent to child, on to the weight publish and the rollout's load of it."""
    run_dir = tmp_path / "run"
    job = tmp_path / "job.yaml"
    with OtlpReceiver() as rx:
        job.write_text(
            json.dumps(
                {  # JSON is YAML
                    "model": {"path": tiny_model_dir},
                    "data": {"train": arith_data},
                    "rollout": {"max_new_tokens": 4, "group_size": 2, "prompts_per_batch": 2, "device": "cpu"},
                    "learner": {"total_steps": 3, "groups_per_step": 2},
                    "broker": {"max_staleness": 1},
                    "sync": {"transport": "filesystem"},
                    "telemetry": {"exporter": "otlp", "otlp_endpoint": rx.endpoint},
                }
            )
        )
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "fleetrl.app.cli",
                "run",
                "--config",
                str(job),
                "--run-dir",
                str(run_dir),
                "--no-status",
            ],
            capture_output=True,
            text=True,
            timeout=240,
            cwd=ROOT,
        )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert rx.requests > 0 and not rx.bad
    pids = {(s["service"], s["pid"]) for s in rx.spans}
    assert {svc for svc, _ in pids} == {"fleetrl-broker", "fleetrl-rollout", "fleetrl-learner"} and len(pids) == 3
    assert len({s["span_id"] for s in rx.spans}) == len(rx.spans)  # os.urandom ids: no repeats across processes
    spans = Spans(rx.spans)
    steps = [s for s in spans.spans if s["name"] == "learner.step"]
    assert len(steps) == 3 and all(len(s["links"]) == 2 for s in steps)
    trains = [s for s in spans.spans if s["name"] == "learner.train"]
    assert len(trains) == 6 and all(
        len({s["trace_id"] for s in trains if s["attributes"]["fleetrl.step"] == k}) == 2 for k in (1, 2, 3)
    )  # two groups a step, each in a trace of its own
    loaded = [t for t in trains if any(s["name"] == "rollout.load_weights" for s in spans.by_trace[t["trace_id"]])]
    assert loaded, "no trained group's trace holds the rollout's load of the version that carried it"
    train = loaded[0]
    group_id, trace = train["attributes"]["fleetrl.group_id"], spans.by_trace[train["trace_id"]]
    one = lambda name: [s for s in trace if s["name"] == name]  # noqa: E731
    [root], [lease], [gen], [ingest], [batch_lease] = (
        one(n) for n in ("rollout.group", "rollout.lease", "rollout.generate", "broker.ingest", "broker.batch_lease")
    )
    [publish], loads = one("learner.publish_weights"), one("rollout.load_weights")
    assert root["parent_id"] is None and root["service"] == "fleetrl-rollout" and root["instance"] == "rollout-0"
    assert {
        root["attributes"]["fleetrl.group_id"],
        ingest["attributes"]["fleetrl.group_id"],
        batch_lease["attributes"]["fleetrl.group_id"],
    } == {group_id}
    for child in (lease, gen, ingest, batch_lease, train, *one("rollout.reward"), *one("rollout.push")):
        assert child["parent_id"] == root["span_id"], child["name"]  # every hop hangs under the group's root
    assert (ingest["service"], batch_lease["service"], train["service"]) == (
        "fleetrl-broker",
        "fleetrl-broker",
        "fleetrl-learner",
    )
    assert (
        gen["attributes"]["gen_ai.operation.name"] == "text_completion"
        and gen["attributes"]["gen_ai.usage.output_tokens"] > 0
    )
    assert publish["parent_id"] == train["span_id"] and publish["service"] == "fleetrl-learner"
    version = publish["attributes"]["fleetrl.policy_version"]
    assert all(
        s["parent_id"] == publish["span_id"]
        and s["service"] == "fleetrl-rollout"
        and s["attributes"]["fleetrl.policy_version"] == version
        for s in loads
    )
    [step] = [s for s in steps if s["span_id"] == train["links"][0]["span_id"]]  # the step's own trace, linked
    assert step["attributes"]["fleetrl.step"] == train["attributes"]["fleetrl.step"]
    assert any(s["name"] == "learner.publish_weights" and s["parent_id"] == step["span_id"] for s in spans.spans)
    assert (
        root["start_ns"] <= ingest["start_ns"] <= batch_lease["start_ns"] <= publish["start_ns"] <= loads[0]["start_ns"]
    )
    # what arrived is also what `fleetrl trace` reads: the group's whole path, one trace
    rx.write_jsonl(run_dir / "traces" / "otlp.jsonl")
    cli = subprocess.run(
        [sys.executable, "-m", "fleetrl.app.cli", "trace", str(run_dir), "--group", group_id[:8]],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert cli.returncode == 0, cli.stderr
    assert f"trace {train['trace_id']} " in cli.stdout.splitlines()[0]
    for name in (
        "rollout.generate",
        "broker.batch_lease",
        "learner.train",
        "learner.publish_weights",
        "rollout.load_weights",
    ):
        assert name in cli.stdout, cli.stdout
