"""Broker telemetry: `broker.ingest` and `broker.batch_lease` spans under each group's context (one
trace per group), and the fleet aggregates the learner's monitor records."""

from __future__ import annotations

import pytest

from fleetrl.broker.client.metrics import status_metrics
from fleetrl.broker.server.service import trace_batch_lease, trace_ingest
from fleetrl.common import messages as m
from fleetrl.common.config.schema import TelemetryConfig
from fleetrl.common.telemetry import tracing
from tests.broker.conftest import make_state
from tests.helpers import make_group


@pytest.fixture
def traced(tmp_path):
    tracing.setup_tracing("broker", TelemetryConfig(exporter="jsonl"), tmp_path)

    def spans() -> list[dict]:
        assert tracing.flush_tracing()
        return tracing.read_spans(tmp_path)

    yield spans
    tracing.shutdown_tracing()


def _traced_group(prompt_id: str, token: int = 5) -> m.SampleGroup:
    g = make_group(prompt_id, token=token)
    with tracing.span("prompt", tracing.ROOT) as s:
        g.trace = tracing.inject(s)
    return g


def test_ingest_spans_are_children_of_each_group_context(traced):
    state = make_state()
    lease = state.handle(m.LeasePrompts(req_id=1, client_id="r0", n=4), 0.0)
    good, bad = _traced_group(lease.prompts[0].prompt_id), _traced_group(lease.prompts[1].prompt_id, token=10_000)
    untraced, unsampled = make_group(lease.prompts[2].prompt_id), _traced_group(lease.prompts[3].prompt_id)
    unsampled.trace = {"traceparent": unsampled.trace["traceparent"][:-2] + "00"}  # a rollout's sampler said no
    req = m.PushGroups(req_id=2, client_id="r0", groups=[good, bad, untraced, unsampled])
    trace_ingest(req, state.handle(req, 0.0), 123)
    batch = state.handle(m.LeaseBatch(req_id=3, client_id="l0", n=4), 0.0)
    trace_batch_lease(batch)
    spans = traced()
    ingest = {s["attributes"]["fleetrl.group_id"]: s for s in spans if s["name"] == "broker.ingest"}
    assert set(ingest) == {good.group_id, bad.group_id}  # the untraced and unsampled groups cost no span
    for g, status in ((good, "accepted"), (bad, "rejected")):
        _, trace_id, span_id, _ = g.trace["traceparent"].split("-")
        s = ingest[g.group_id]
        assert (s["trace_id"], s["parent_id"], s["attributes"]["fleetrl.status"]) == (trace_id, span_id, status)
        assert s["start_ns"] == 123 and s["service"] == "fleetrl-broker"
    # one batch_lease span in the trace of each sampled group handed out (bad was rejected; the others untraced)
    [lease_span] = [s for s in spans if s["name"] == "broker.batch_lease"]
    _, trace_id, span_id, _ = good.trace["traceparent"].split("-")
    assert (lease_span["trace_id"], lease_span["parent_id"]) == (trace_id, span_id)
    assert (
        lease_span["attributes"]["fleetrl.groups"] == 3
        and lease_span["attributes"]["fleetrl.group_id"] == good.group_id
    )
    assert lease_span["attributes"]["fleetrl.lease_id"] == batch.lease_id and lease_span["links"] == []


def test_status_metrics_aggregate_the_rollout_fleet():
    stats = [
        {
            "rollout/tokens_per_s": 100.0,
            "reward/mean": 0.5,
            "rollout/groups_pushed": 10.0,
            "rollout/policy_version": 3.0,
            "weights/load_s": 0.2,
        },
        {
            "rollout/tokens_per_s": 50.0,
            "reward/mean": 0.25,
            "rollout/groups_pushed": 4.0,
            "rollout/policy_version": 1.0,
        },
    ]
    clients = [m.ClientInfo(client_id=f"r{i}", role="rollout", stats=s) for i, s in enumerate(stats)]
    clients += [
        m.ClientInfo(client_id="dead", role="rollout", alive=False, stats={"rollout/tokens_per_s": 1e9}),
        m.ClientInfo(client_id="learner-0", role="learner"),
    ]
    status = m.Status(
        req_id=0,
        broker_id="b",
        uptime_s=1.0,
        policy_version=4,
        queue_depth=0,
        groups_in_flight=0,
        prompts_leased=0,
        groups_in=0,
        groups_out=0,
        groups_in_per_s=0.0,
        groups_out_per_s=0.0,
        dropped_stale=0,
        duplicates=0,
        clients=clients,
    )
    out = status_metrics(status)
    assert out["fleet/servers"] == 2 and out["fleet/tokens_per_s"] == 150.0  # 100 + 50; the dead one is left out
    assert out["fleet/reward_mean"] == 0.375 and out["fleet/groups_pushed"] == 14.0  # (0.5 + 0.25) / 2; 10 + 4
    assert out["fleet/version_lag_max"] == 3.0 and out["fleet/weights_load_s_max"] == 0.2  # 4 - 1
