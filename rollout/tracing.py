"""The spans of one prompt lease on a rollout server (docs/monitoring.md, "Traces").

One trace per lease. Its root ``prompt.lease`` covers the LeasePrompts round trip. Under it, one
``prompt`` span per leased prompt runs from the lease until the prompt's group is built (generation
and reward); its context is what the group carries in ``SampleGroup.trace`` (and what the engine's
requests carry), so the broker's ``broker.ingest`` span nests under it and the learner step links
to it. The ``generate``, ``reward`` and ``push`` spans of each group (tagged with its prompt id)
hang under the root.
"""

from __future__ import annotations

from opentelemetry import trace

from fleetrl.common import messages as m
from fleetrl.common import telemetry


class LeaseTrace:
    def __init__(self, lease: m.PromptLease, server_id: str, version: int, start_ns: int):
        tracer = telemetry.get_tracer()
        root = tracer.start_span("prompt.lease", context=telemetry.ROOT, start_time=start_ns, attributes={
            "fleetrl.lease_id": lease.lease_id, "fleetrl.prompts": len(lease.prompts), "fleetrl.server_id": server_id,
            "fleetrl.policy_version": version})
        root.end()
        self.context = trace.set_span_in_context(root)
        self.prompts = {p.prompt_id: tracer.start_span("prompt", context=self.context,
                                                       attributes={"fleetrl.prompt_id": p.prompt_id})
                        for p in lease.prompts}

    @classmethod
    def start(cls, lease: m.PromptLease, server_id: str, version: int, start_ns: int) -> "LeaseTrace | None":
        """The lease's spans, or None when tracing is off (then nothing else here is called)."""
        return cls(lease, server_id, version, start_ns) if telemetry.enabled() else None

    def record(self, name: str, start_s: float, end_s: float, **attributes: int | float | str) -> None:
        """A batch-level span under the lease from two ``time.monotonic()`` readings."""
        telemetry.record_span(name, telemetry.wall_ns(start_s), telemetry.wall_ns(end_s), parent=self.context,
                              attributes={f"fleetrl.{k}": v for k, v in attributes.items()})

    def group(self, prompt_id: str, group_id: str) -> dict[str, str]:
        """End the prompt's span and return the context its group carries."""
        span = self.prompts.pop(prompt_id, None)
        if span is None:
            return {}
        span.set_attribute("fleetrl.group_id", group_id)
        span.end()
        return telemetry.inject(span)

    def carrier(self, prompt_id: str) -> dict[str, str] | None:
        """The W3C context of the prompt's span (what the engine's requests carry), without ending it."""
        span = self.prompts.get(prompt_id)
        return telemetry.inject(span) if span is not None else None

    def dropped(self, prompt_id: str) -> None:
        """End the span of a prompt whose group is not pushed (its prompt goes back to the broker)."""
        span = self.prompts.pop(prompt_id, None)
        if span is not None:
            span.set_attribute("fleetrl.outcome", "dropped")
            span.end()
