"""The rollout side of a trace: one trace per lease, one `prompt` span per prompt whose context its
group carries (rollout/tracing.py), filled in by `build_groups` through the `trace_context` hook."""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest

from fleetrl.common import messages as m
from fleetrl.common import telemetry
from fleetrl.common.config.schema import TelemetryConfig
from fleetrl.rollout.engines.base import Generation
from fleetrl.rollout.loop import Batch, build_groups
from fleetrl.rollout.rewards import RewardResult
from fleetrl.rollout.tracing import LeaseTrace


@pytest.fixture
def traced(tmp_path):
    telemetry.setup_tracing("rollout", TelemetryConfig(exporter="jsonl"), tmp_path)

    def spans() -> dict[str, list[dict]]:
        assert telemetry.flush_tracing()
        out: dict[str, list[dict]] = {}
        for s in telemetry.read_spans(tmp_path):
            out.setdefault(s["name"], []).append(s)
        return out

    yield spans
    telemetry.shutdown_tracing()


def _batch(trace: LeaseTrace | None, lease: m.PromptLease) -> Batch:
    samples = [[Generation(token_ids=[5, 6], logprobs=[-1.0, -1.0], finish_reason="stop", text="7")] * 2
               for _ in lease.prompts]
    return Batch(lease, [[1, 2, 3]] * len(lease.prompts), samples, 0, 0.1, Future(), trace=trace)


def test_each_group_carries_its_own_prompt_context_in_the_lease_trace(traced):
    lease = m.PromptLease(req_id=1, lease_id="L1", expires_in_s=60.0,
                          prompts=[m.Prompt(prompt_id=f"0:{i}", prompt="1+1=") for i in range(3)])
    trace = LeaseTrace.start(lease, "rollout-0-h-1", 4, time.time_ns())
    batch = _batch(trace, lease)
    trace.record("generate", time.monotonic() - 0.1, time.monotonic(), prompts=3)
    results = [RewardResult(float(i % 2), {}, False) for i in range(6)]
    results[4:] = [RewardResult(0.0, {}, False)] * 2  # the last prompt's group is dropped below
    groups, dropped, _ = build_groups(batch, results, "rollout-0-h-1", lambda res: all(r.reward == 0 for r in res))
    assert dropped == ["0:2"] and len(groups) == 2
    spans = traced()
    [root], [generate] = spans["prompt.lease"], spans["generate"]
    assert root["attributes"]["fleetrl.lease_id"] == "L1" and root["attributes"]["fleetrl.policy_version"] == 4
    assert generate["parent_id"] == root["span_id"] and generate["attributes"]["fleetrl.prompts"] == 3
    prompts = {s["attributes"]["fleetrl.prompt_id"]: s for s in spans["prompt"]}
    assert all(s["parent_id"] == root["span_id"] and s["trace_id"] == root["trace_id"] for s in prompts.values())
    for g in groups:
        _, trace_id, span_id, _ = g.trace["traceparent"].split("-")
        span = prompts[g.prompt_id]
        assert (trace_id, span_id) == (root["trace_id"], span["span_id"])
        assert span["attributes"]["fleetrl.group_id"] == g.group_id
    assert prompts["0:2"]["attributes"]["fleetrl.outcome"] == "dropped"


def test_without_tracing_groups_carry_no_context():
    lease = m.PromptLease(req_id=1, lease_id="L1", expires_in_s=60.0, prompts=[m.Prompt(prompt_id="0:0", prompt="x")])
    assert LeaseTrace.start(lease, "r", 0, time.time_ns()) is None
    groups, _, _ = build_groups(_batch(None, lease), [RewardResult(1.0, {}, False)] * 2, "r", lambda res: False)
    assert groups[0].trace == {}


def test_a_sampler_from_the_environment_marks_unsampled_groups(tmp_path, monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")  # keep no lease trace
    telemetry.setup_tracing("rollout", TelemetryConfig(exporter="jsonl"), tmp_path)
    try:
        lease = m.PromptLease(req_id=1, lease_id="L", expires_in_s=60.0, prompts=[m.Prompt(prompt_id="0:0", prompt="x")])
        batch = _batch(LeaseTrace.start(lease, "r", 0, time.time_ns()), lease)
        [group], _, _ = build_groups(batch, [RewardResult(1.0, {}, False)] * 2, "r", lambda res: False)
        assert group.trace["traceparent"].endswith("-00") and not telemetry.sampled(group.trace)
        assert telemetry.flush_tracing() and telemetry.read_spans(tmp_path) == []
    finally:
        telemetry.shutdown_tracing()
