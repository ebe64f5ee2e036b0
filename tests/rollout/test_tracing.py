"""The rollout side of a trace: one trace per group, rooted in a `rollout.group` span whose context the
group carries (rollout/tracing.py, filled in by `build_groups` through the `trace_context` hook), the
engine's requests carrying the `rollout.generate` context, and version loads joining the announced traces."""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest

from fleetrl.common import messages as m
from fleetrl.common.config.schema import TelemetryConfig
from fleetrl.common.telemetry import tracing
from fleetrl.rollout.engines.params import SamplingParams
from fleetrl.rollout.engines.records import Generation, Request
from fleetrl.rollout.loop import Batch, build_groups
from fleetrl.rollout.rewards import RewardResult
from fleetrl.rollout.tracing import LeaseTrace, genai_attributes, trace_load


@pytest.fixture
def traced(tmp_path):
    tracing.setup_tracing("rollout", TelemetryConfig(exporter="jsonl"), tmp_path)

    def spans() -> dict[str, list[dict]]:
        assert tracing.flush_tracing()
        out: dict[str, list[dict]] = {}
        for s in tracing.read_spans(tmp_path):
            out.setdefault(s["name"], []).append(s)
        return out

    yield spans
    tracing.shutdown_tracing()


def _batch(trace: LeaseTrace | None, lease: m.PromptLease) -> Batch:
    samples = [
        [Generation(token_ids=[5, 6], logprobs=[-1.0, -1.0], finish_reason="stop", text="7")] * 2 for _ in lease.prompts
    ]
    return Batch(lease, [[1, 2, 3]] * len(lease.prompts), samples, 0, 0.1, Future(), trace=trace)


def test_each_prompt_of_a_lease_starts_its_own_trace_and_its_group_carries_it(traced):
    lease = m.PromptLease(
        req_id=1,
        lease_id="L1",
        expires_in_s=60.0,
        prompts=[m.Prompt(prompt_id=f"0:{i}", prompt="1+1=") for i in range(3)],
    )
    trace = LeaseTrace.start(lease, "rollout-0-h-1", 4, time.time_ns() - 2_000_000)
    engine_ctx = trace.carrier("0:0")  # what the engine's requests carry: the live generate span
    sample = Generation(token_ids=[5, 6], logprobs=[-1.0, -1.0], finish_reason="stop", text="7")
    params = SamplingParams(temperature=0.7, max_new_tokens=4)
    trace.generated("0:0", genai_attributes("tiny", params, [1, 2, 3], [sample, sample], 4))
    batch = _batch(trace, lease)
    results = [RewardResult(float(i % 2), {}, False) for i in range(6)]
    results[4:] = [RewardResult(0.0, {}, False)] * 2  # the last prompt's group is dropped below
    groups, dropped, _ = build_groups(batch, results, "rollout-0-h-1", lambda res: all(r.reward == 0 for r in res))
    trace.record("rollout.push", time.monotonic() - 0.01, time.monotonic(), [g.prompt_id for g in groups], groups=2)
    assert dropped == ["0:2"] and len(groups) == 2
    spans = traced()
    roots = {s["attributes"]["fleetrl.prompt_id"]: s for s in spans["rollout.group"]}
    assert len({s["trace_id"] for s in roots.values()}) == 3  # one trace per prompt (per group)
    assert all(s["parent_id"] is None and s["attributes"]["fleetrl.lease_id"] == "L1" for s in roots.values())
    for name in ("rollout.lease", "rollout.generate"):  # one of each under every root
        assert sorted(s["parent_id"] for s in spans[name]) == sorted(s["span_id"] for s in roots.values())
    lease_span = spans["rollout.lease"][0]
    assert (
        lease_span["end_ns"] - lease_span["start_ns"] >= 2_000_000 and lease_span["attributes"]["fleetrl.prompts"] == 3
    )
    [gen] = [s for s in spans["rollout.generate"] if s["parent_id"] == roots["0:0"]["span_id"]]
    assert engine_ctx["traceparent"].split("-")[2] == gen["span_id"]
    assert gen["attributes"]["gen_ai.request.model"] == "tiny" and gen["attributes"]["gen_ai.usage.output_tokens"] == 4
    assert (
        gen["attributes"]["gen_ai.usage.input_tokens"] == 6 and gen["attributes"]["gen_ai.request.temperature"] == 0.7
    )
    assert gen["attributes"]["gen_ai.response.finish_reasons"] == ["stop", "stop"]
    for g in groups:
        _, trace_id, span_id, _ = g.trace["traceparent"].split("-")
        root = roots[g.prompt_id]
        assert (trace_id, span_id) == (root["trace_id"], root["span_id"])
        assert root["attributes"]["fleetrl.group_id"] == g.group_id
        [push] = [s for s in spans["rollout.push"] if s["trace_id"] == trace_id]
        assert push["parent_id"] == span_id
    assert roots["0:2"]["attributes"]["fleetrl.outcome"] == "dropped"
    assert not [s for s in spans["rollout.push"] if s["trace_id"] == roots["0:2"]["trace_id"]]


def test_a_version_load_joins_the_traces_it_was_announced_with(traced):
    parents = []
    for _ in range(2):
        with tracing.span("learner.publish_weights", tracing.ROOT) as s:
            parents.append(tracing.inject(s))
    trace_load(time.time_ns(), parents, {"fleetrl.policy_version": 3})
    trace_load(time.time_ns(), [], {"fleetrl.policy_version": 4})  # announced without traces: a root
    loads = traced()["rollout.load_weights"]
    under = sorted((s["trace_id"], s["parent_id"]) for s in loads if s["attributes"]["fleetrl.policy_version"] == 3)
    assert under == sorted(tuple(c["traceparent"].split("-")[1:3]) for c in parents)
    assert [s["parent_id"] for s in loads if s["attributes"]["fleetrl.policy_version"] == 4] == [None]


def test_the_vllm_engine_passes_the_trace_context_to_its_requests(monkeypatch):
    """vLLM's AsyncLLM.generate takes ``trace_headers``; a fake AsyncLLM stands in for vLLM, which only
    the GPU lane installs (there, vLLM's own request spans nest under rollout.generate)."""
    import asyncio

    from fleetrl.rollout.engines import vllm
    from fleetrl.rollout.engines.vllm import VllmEngine

    monkeypatch.setattr(vllm, "to_vllm_params", lambda params, stream=False: params)

    seen = []

    class FakeLLM:
        async def generate(self, prompt, params, request_id, **kwargs):
            seen.append(kwargs)
            if False:
                yield None

    engine = VllmEngine.__new__(VllmEngine)
    engine._llm, engine.mode, engine.version = FakeLLM(), "processed_logprobs", 0
    carrier = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    for trace in (carrier, None):
        with pytest.raises(RuntimeError, match="returned nothing"):
            asyncio.run(engine.generate(Request([1, 2], SamplingParams(), request_id="r", trace=trace)))
    assert seen == [{"trace_headers": carrier}, {}]


def test_without_tracing_groups_carry_no_context():
    lease = m.PromptLease(req_id=1, lease_id="L1", expires_in_s=60.0, prompts=[m.Prompt(prompt_id="0:0", prompt="x")])
    assert LeaseTrace.start(lease, "r", 0, time.time_ns()) is None
    groups, _, _ = build_groups(_batch(None, lease), [RewardResult(1.0, {}, False)] * 2, "r", lambda res: False)
    assert groups[0].trace == {}


def test_a_sampler_from_the_environment_marks_unsampled_groups(tmp_path, monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")  # keep no lease trace
    tracing.setup_tracing("rollout", TelemetryConfig(exporter="jsonl"), tmp_path)
    try:
        lease = m.PromptLease(
            req_id=1, lease_id="L", expires_in_s=60.0, prompts=[m.Prompt(prompt_id="0:0", prompt="x")]
        )
        batch = _batch(LeaseTrace.start(lease, "r", 0, time.time_ns()), lease)
        [group], _, _ = build_groups(batch, [RewardResult(1.0, {}, False)] * 2, "r", lambda res: False)
        assert group.trace["traceparent"].endswith("-00") and not tracing.sampled(group.trace)
        assert tracing.flush_tracing() and tracing.read_spans(tmp_path) == []
    finally:
        tracing.shutdown_tracing()
