"""The spans of one prompt lease on a rollout server (docs/monitoring.md, "Traces").

One trace per group. A lease of N prompts starts N traces; each has the root ``rollout.group``
(from the lease until the prompt's group is built) whose context the group carries in
``SampleGroup.trace``, so that everything downstream — the broker's ``broker.ingest`` and
``broker.batch_lease``, the learner's ``learner.train`` and ``learner.publish_weights``, and the
``rollout.load_weights`` of every server that loads that version — lands in the same trace. Under
the root: ``rollout.lease`` (the LeasePrompts round trip, recorded in each of the lease's traces),
``rollout.generate`` (live while the engine generates; its context goes into the engine's requests,
so an engine that traces, like vLLM, nests its spans under it), ``rollout.reward`` and ``rollout.push``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace

from fleetrl.common import messages as m
from fleetrl.common.telemetry import tracing


class LeaseTrace:
    def __init__(self, lease: m.PromptLease, server_id: str, version: int, start_ns: int):
        tracer, now = tracing.get_tracer(), time.time_ns()
        lease_attrs = {
            "fleetrl.lease_id": lease.lease_id,
            "fleetrl.prompts": len(lease.prompts),
            "fleetrl.server_id": server_id,
            "fleetrl.policy_version": version,
        }
        self.roots: dict[str, trace.Span] = {}
        self.contexts: dict[str, Any] = {}  # prompt id -> context of its group's root (kept after it ends)
        self.generating: dict[str, trace.Span] = {}
        for p in lease.prompts:
            root = tracer.start_span(
                "rollout.group",
                context=tracing.ROOT,
                start_time=start_ns,
                attributes={
                    "fleetrl.prompt_id": p.prompt_id,
                    "fleetrl.lease_id": lease.lease_id,
                    "fleetrl.server_id": server_id,
                    "fleetrl.policy_version": version,
                },
            )
            ctx = self.contexts[p.prompt_id] = trace.set_span_in_context(root)
            self.roots[p.prompt_id] = root
            tracer.start_span("rollout.lease", context=ctx, start_time=start_ns, attributes=lease_attrs).end(now)
            self.generating[p.prompt_id] = tracer.start_span("rollout.generate", context=ctx, start_time=now)

    @classmethod
    def start(cls, lease: m.PromptLease, server_id: str, version: int, start_ns: int) -> LeaseTrace | None:
        """The lease's spans, or None when tracing is off (then nothing else here is called)."""
        return cls(lease, server_id, version, start_ns) if tracing.enabled() else None

    def generated(self, prompt_id: str, attributes: dict[str, Any]) -> None:
        """End the prompt's ``rollout.generate`` span (``attributes``: :func:`genai_attributes`)."""
        span = self.generating.pop(prompt_id, None)
        if span is not None:
            span.set_attributes(attributes)
            span.end()

    def record(
        self,
        name: str,
        start_s: float,
        end_s: float,
        prompt_ids: Sequence[str] | None = None,
        **attributes: int | float | str,
    ) -> None:
        """A span in the trace of each of ``prompt_ids`` (default: every prompt of the lease) from two
        ``time.monotonic()`` readings."""
        start_ns, end_ns = tracing.wall_ns(start_s), tracing.wall_ns(end_s)
        attrs = {f"fleetrl.{k}": v for k, v in attributes.items()}
        for pid in self.contexts if prompt_ids is None else prompt_ids:
            if pid in self.contexts:
                tracing.record_span(name, start_ns, end_ns, parent=self.contexts[pid], attributes=attrs)

    def group(self, prompt_id: str, group_id: str) -> dict[str, str]:
        """End the prompt's root span and return the context its group carries."""
        span = self.roots.pop(prompt_id, None)
        if span is None:
            return {}
        self.generated(prompt_id, {})
        span.set_attribute("fleetrl.group_id", group_id)
        span.end()
        return tracing.inject(span)

    def carrier(self, prompt_id: str) -> dict[str, str] | None:
        """The W3C context of the prompt's ``rollout.generate`` span: what the engine's requests carry."""
        span = self.generating.get(prompt_id) or self.roots.get(prompt_id)
        return tracing.inject(span) if span is not None else None

    def dropped(self, prompt_id: str) -> None:
        """End the spans of a prompt whose group is not pushed (its prompt goes back to the broker)."""
        self.generated(prompt_id, {})
        span = self.roots.pop(prompt_id, None)
        if span is not None:
            span.set_attribute("fleetrl.outcome", "dropped")
            span.end()


def genai_attributes(
    model: str, params: Any, prompt_ids: Sequence[int], samples: Sequence[Any], version: int
) -> dict[str, Any]:
    """The ``rollout.generate`` attributes: the OTel GenAI conventions (``gen_ai.*``) plus ours.

    ``params``: the ``SamplingParams``; ``samples``: the ``Generation`` of every request of the group.
    """
    return {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.request.model": model,
        "gen_ai.request.temperature": float(params.temperature),
        "gen_ai.request.top_p": float(params.top_p),
        "gen_ai.request.max_tokens": int(params.max_new_tokens),
        "gen_ai.request.choice.count": len(samples),
        "gen_ai.usage.input_tokens": len(prompt_ids) * len(samples),
        "gen_ai.usage.output_tokens": sum(len(s.token_ids) for s in samples),
        "gen_ai.response.finish_reasons": [s.finish_reason for s in samples],
        "fleetrl.policy_version": version,
    }


MAX_LOAD_TRACES = 16  # the learner announces at most 16 (learner/tracing.py); more are ignored here


def trace_load(start_ns: int, traces: Sequence[dict[str, str]], attributes: dict[str, Any]) -> None:
    """``rollout.load_weights``: one span under each publish span the version was announced with (the
    traces of groups it trained on, at most :data:`MAX_LOAD_TRACES`), or one root span when it came with none."""
    for parent in list(traces)[:MAX_LOAD_TRACES] or [tracing.ROOT]:
        tracing.record_span("rollout.load_weights", start_ns, parent=parent, attributes=attributes)
