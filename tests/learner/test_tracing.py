"""The learner's spans in each group's trace (learner/tracing.py): `learner.train` under every sampled
group's context linked to the step, `learner.publish_weights` under them at the next publish with the
contexts the announcement carries, and the step's metric exemplar."""

from __future__ import annotations

import pytest
from opentelemetry import trace

from fleetrl.common.config.schema import TelemetryConfig
from fleetrl.common.telemetry import tracing
from fleetrl.learner.tracing import ANNOUNCED_TRACES, StepTraces
from tests.helpers import make_group


@pytest.fixture
def traced(tmp_path):
    tracing.setup_tracing("learner", TelemetryConfig(exporter="jsonl"), tmp_path)

    def spans() -> list[dict]:
        assert tracing.flush_tracing()
        return tracing.read_spans(tmp_path)

    yield spans
    tracing.shutdown_tracing()


def _groups(n: int) -> list:
    groups = []
    for i in range(n):
        g = make_group(f"0:{i}", gid=f"g{i}")
        with tracing.span("rollout.group", tracing.ROOT) as s:  # each group's own trace, as a rollout starts it
            g.trace = tracing.inject(s)
        groups.append(g)
    return groups


def test_a_step_has_a_span_in_each_group_trace_and_the_publish_follows_them(traced):
    traces = StepTraces()
    groups = _groups(3)
    unsampled = make_group("0:8", gid="g8")
    unsampled.trace = {"traceparent": groups[0].trace["traceparent"][:-2] + "00"}
    for step, batch in ((1, groups[:2]), (2, [groups[2], unsampled])):
        with tracing.span("learner.step", tracing.ROOT, {"fleetrl.step": step}) as step_span:
            traces.trained(step_span, batch, step, 0, 1_000)
        assert tracing.exemplar() == {"trace_id": batch[0].trace["traceparent"][3:35], "group_id": batch[0].group_id}
    with traces.publishing(1, 2) as carried:
        assert len(carried) == 3 and all(tracing.sampled(c) for c in carried)
    with traces.publishing(2, 3) as carried_again:  # nothing trained since: nothing carried
        assert carried_again == []
    spans = traced()
    by_id = {s["span_id"]: s for s in spans}
    trains = [s for s in spans if s["name"] == "learner.train"]
    assert sorted(s["attributes"]["fleetrl.group_id"] for s in trains) == ["g0", "g1", "g2"]  # not the unsampled g8
    for g in groups:
        _, trace_id, span_id, _ = g.trace["traceparent"].split("-")
        [train] = [s for s in trains if s["attributes"]["fleetrl.group_id"] == g.group_id]
        assert (train["trace_id"], train["parent_id"], train["start_ns"]) == (trace_id, span_id, 1_000)
        assert by_id[train["links"][0]["span_id"]]["name"] == "learner.step"
        [publish] = [s for s in spans if s["name"] == "learner.publish_weights" and s["trace_id"] == trace_id]
        assert publish["parent_id"] == train["span_id"] and publish["attributes"]["fleetrl.policy_version"] == 1
    publishes = {s["span_id"] for s in spans if s["name"] == "learner.publish_weights"}
    assert {c["traceparent"].split("-")[2] for c in carried} == publishes


def test_the_announcement_carries_a_bounded_number_of_traces(traced):
    traces = StepTraces()
    traces.trained(trace.INVALID_SPAN, _groups(ANNOUNCED_TRACES + 4), 1, 0, 1_000)
    with traces.publishing(1, 1) as carried:
        assert len(carried) == ANNOUNCED_TRACES
    assert sum(s["name"] == "learner.publish_weights" for s in traced()) == ANNOUNCED_TRACES + 4  # every trace has one


def test_without_tracing_nothing_is_recorded():
    traces = StepTraces()
    traces.trained(trace.INVALID_SPAN, _groups(2), 1, 0, 1_000)
    with traces.publishing(1, 1) as carried:
        assert carried == []
    assert traces.pending == [] and tracing.exemplar() == {}
