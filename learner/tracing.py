"""The learner's spans in each group's trace (docs/monitoring.md, "Traces").

A step trains many groups, each with a trace of its own (``SampleGroup.trace``, started by the
rollout server). The step is recorded twice over: once as ``learner.step``, the root of a trace of
its own (linked to every group; ``learner.publish_weights`` of a sync step is its child), and once
as a ``learner.train`` span in **each** group's trace, a child of the group's context with a link
back to ``learner.step``. A span has one parent, and a viewer (Jaeger, Tempo) shows a trace's own
spans, not its links' targets; so a span per group is what makes a group's trace hold its whole path.

The next weight publish then records ``learner.publish_weights`` under each ``learner.train`` span
since the previous publish (the weights that carry that group's update), and the version's
announcement carries the contexts of up to :data:`ANNOUNCED_TRACES` of them in
``WeightsInfo.traces``: each rollout server that loads the version records ``rollout.load_weights``
under each. With several learner ranks every rank traces its own groups, and the announcement
(sent by rank 0) carries rank 0's.

Cost: one span per sampled group per step and per publish, tens of microseconds each; nothing with
``telemetry.exporter: none``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from opentelemetry import trace

from fleetrl.common import messages as m
from fleetrl.common.telemetry import tracing

ANNOUNCED_TRACES = 16  # group traces a version announcement carries (each rollout load adds a span to each)


class StepTraces:
    def __init__(self) -> None:
        self.pending: list[trace.Span] = []  # learner.train spans since the last publish

    def trained(
        self, step_span: trace.Span, groups: Sequence[m.SampleGroup], step: int, version: int, start_ns: int
    ) -> None:
        """A ``learner.train`` span in each sampled group's trace, from ``start_ns`` to now; the first
        becomes the metric exemplar of this step."""
        if not tracing.enabled():
            return
        link = [trace.Link(step_span.get_span_context())] if step_span.get_span_context().is_valid else []
        end_ns = time.time_ns()
        for g in groups:
            if not tracing.sampled(g.trace):
                continue
            span = tracing.record_span(
                "learner.train",
                start_ns,
                end_ns,
                parent=g.trace,
                links=link,
                attributes={"fleetrl.group_id": g.group_id, "fleetrl.step": step, "fleetrl.policy_version": version},
            )
            if span is not None:
                self.pending.append(span)
        if groups:
            sampled = [g for g in groups if tracing.sampled(g.trace)]
            if sampled:
                tracing.note_exemplar(sampled[0].trace, sampled[0].group_id)

    @contextmanager
    def publishing(self, version: int, step: int) -> Iterator[list[dict[str, str]]]:
        """Around one weight publish: a ``learner.publish_weights`` span under each pending
        ``learner.train``; yields the contexts the announcement carries (``[]`` when tracing is off)."""
        if not tracing.enabled() or not self.pending:
            self.pending.clear()
            yield []
            return
        tracer, attrs = tracing.get_tracer(), {"fleetrl.policy_version": version, "fleetrl.step": step}
        spans = [
            tracer.start_span("learner.publish_weights", context=trace.set_span_in_context(parent), attributes=attrs)
            for parent in self.pending
        ]
        self.pending = []
        try:
            yield [tracing.inject(s) for s in spans[:ANNOUNCED_TRACES]]
        finally:
            for s in spans:
                s.end()
