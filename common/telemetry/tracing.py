"""Tracing for every fleetrl process, set up in one place; a no-op until :func:`setup_tracing` runs.

Each process calls ``setup_tracing(service, cfg.telemetry, run_dir, attributes)`` once at start-up
(broker, rollout server, learner rank). With ``telemetry.exporter: none`` nothing is built: the
tracer is OpenTelemetry's no-op tracer and :func:`enabled` is False, so hot paths skip their span
code with one function call. The other exporters:

- ``console``: one JSON line per span on stdout (the process's log under ``fleetrl run``);
- ``jsonl``: ``<run_dir>/traces/<service>-<pid>.jsonl``, one file per process (several processes
  share a run directory), one ``span_record`` per line (``common/telemetry/trace_files.py``); ``fleetrl trace
  RUN_DIR`` reads them all;
- ``otlp``: OTLP over HTTP to ``telemetry.otlp_endpoint`` (an OpenTelemetry collector, Jaeger,
  Tempo...).

Trace context crosses processes as W3C ``traceparent`` / ``tracestate`` strings in a dict
(:func:`inject`, :func:`extract`); ``SampleGroup.trace`` carries it from the rollout server through
the broker to the learner, whose step span links to every group it consumed (:func:`group_links`).
The shape of a trace is described in docs/monitoring.md ("Traces").

Span and trace ids come from ``os.urandom`` (:class:`UrandomIdGenerator`): the SDK's default draws
them from ``random``, so processes that call ``random.seed(s)`` would emit identical ids.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from fleetrl.common.telemetry.trace_files import (  # noqa: F401 - re-exported: telemetry.read_spans, ...
    TRACES_DIR,
    JsonlSpanExporter,
    read_spans,
    span_record,
    trace_files,
)

if TYPE_CHECKING:
    from fleetrl.common.config.schema import TelemetryConfig
    from fleetrl.common.messages import SampleGroup

log = logging.getLogger("fleetrl.telemetry")

SERVICES = ("broker", "rollout", "learner")
ROOT = Context()  # pass as ``parent`` to start a new trace instead of a child of the current span
MAX_LINKS = 4096  # a learner step links to every group it trained on (the SDK's default limit is 128)
EXPORT_DELAY_MS = 1000  # spans reach the exporter within about this long

_propagator = TraceContextTextMapPropagator()
_NOOP = trace.NoOpTracer()
_lock = threading.Lock()
_active: _Tracing | None = None


class UrandomIdGenerator(IdGenerator):
    """Trace and span ids from ``os.urandom``: independent of ``random.seed`` in training code.

    The bytes are read 4 KiB at a time (one ``getrandom`` call costs ~100 us on some virtual machines,
    more than the rest of a span), and the pool is emptied in a forked child, so a parent and its
    child never hand out the same bytes.
    """

    POOL = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool, self._at = b"", 0
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._pool, self._at = b"", 0

    def _take(self, n: int) -> int:
        while True:
            with self._lock:
                if self._at + n > len(self._pool):
                    self._pool, self._at = os.urandom(self.POOL), 0
                value = int.from_bytes(self._pool[self._at : self._at + n], "little")
                self._at += n
            if value:  # 0 is the invalid id
                return value

    def generate_span_id(self) -> int:
        return self._take(8)

    def generate_trace_id(self) -> int:
        return self._take(16)


# ------------------------------------------------------------------------------------ set-up


class _Tracing:
    def __init__(self, service: str, provider: TracerProvider, path: Path | None):
        self.service, self.provider, self.path = service, provider, path
        self.tracer = provider.get_tracer("fleetrl")


def _exporter(service: str, cfg: TelemetryConfig, run_dir: str | Path | None) -> tuple[SpanExporter, Path | None]:
    if cfg.exporter == "jsonl":
        if run_dir is None:
            from fleetrl.common.config import ConfigError

            raise ConfigError(
                f"telemetry.exporter=jsonl writes spans into the run directory, but this {service} has "
                "none; pass --run-dir or choose telemetry.exporter=none|console|otlp"
            )
        path = Path(run_dir) / TRACES_DIR / f"{service}-{os.getpid()}.jsonl"
        return JsonlSpanExporter(path), path
    if cfg.exporter == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        one_line = lambda s: json.dumps(span_record(s), default=str) + "\n"  # noqa: E731
        return ConsoleSpanExporter(out=sys.stdout, formatter=one_line), None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    endpoint = cfg.otlp_endpoint.rstrip("/")
    return OTLPSpanExporter(endpoint=endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"), None


def setup_tracing(
    service: str, cfg: TelemetryConfig, run_dir: str | Path | None = None, attributes: Mapping[str, Any] | None = None
) -> trace.Tracer:
    """The tracer of this process (``service.name = fleetrl-<service>``), built on the first call.

    ``attributes`` become resource attributes of every span (``service.instance.id``, rank, server
    index...). Later calls return the same tracer whatever their arguments: one process, one
    tracer. With ``cfg.exporter == "none"`` nothing is built and the no-op tracer is returned.
    Spans still buffered are exported when the process exits (or at :func:`shutdown_tracing`).
    """
    global _active
    if service not in SERVICES:
        raise ValueError(f"unknown service {service!r}; expected one of {', '.join(SERVICES)}")
    with _lock:
        if _active is not None:
            if _active.service != service:
                log.debug("tracing is already set up for %s; %s spans use the same tracer", _active.service, service)
            return _active.tracer
        if cfg.exporter == "none":
            return _NOOP
        exporter, path = _exporter(service, cfg, run_dir)
        resource = Resource.create(
            {
                "service.name": f"fleetrl-{service}",
                "service.namespace": "fleetrl",
                "service.instance.id": f"{service}-{socket.gethostname()}-{os.getpid()}",
                "host.name": socket.gethostname(),
                "process.pid": os.getpid(),
                **dict(attributes or {}),
            }
        )
        provider = TracerProvider(
            resource=resource, id_generator=UrandomIdGenerator(), span_limits=SpanLimits(max_links=MAX_LINKS)
        )
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MS))
        _active = _Tracing(service, provider, path)
    log.info("tracing %s spans to %s", service, path or (cfg.otlp_endpoint if cfg.exporter == "otlp" else cfg.exporter))
    return _active.tracer


def shutdown_tracing() -> None:
    """Export what is buffered and go back to the no-op tracer (also runs at process exit)."""
    global _active, _exemplar
    with _lock:
        active, _active = _active, None
        _exemplar = {}
    if active is not None:
        active.provider.shutdown()


def flush_tracing(timeout_s: float = 10.0) -> bool:
    """Export every span ended so far (True when done in time, or when tracing is off)."""
    active = _active
    return active.provider.force_flush(int(timeout_s * 1000)) if active is not None else True


def enabled() -> bool:
    """True once tracing is set up with an exporter: hot paths check this before building spans."""
    return _active is not None


def get_tracer() -> trace.Tracer:
    """The process's tracer (the no-op tracer until :func:`setup_tracing`)."""
    active = _active
    return active.tracer if active is not None else _NOOP


# ------------------------------------------------------------------------------ spans, context


def inject(span: trace.Span | None = None) -> dict[str, str]:
    """The W3C context of ``span`` (default: the current span) as ``{traceparent[, tracestate]}``;
    ``{}`` for a no-op or invalid span."""
    ctx = trace.set_span_in_context(span) if span is not None else None
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=ctx)
    return carrier


def sampled(carrier: Mapping[str, str] | None) -> bool:
    """The carrier names a span that is recorded (W3C ``sampled`` flag): a string test, no parsing.

    With ``OTEL_TRACES_SAMPLER=parentbased_traceidratio`` the rollout servers keep a fraction of
    their lease traces; the broker skips its spans for groups of the others.
    """
    parent = carrier.get("traceparent", "") if carrier else ""
    return len(parent) == 55 and parent[-1] in "13579bdf"


_HEX = frozenset("0123456789abcdef")


def remote_context(carrier: Mapping[str, str] | None) -> trace.SpanContext:
    """The span context ``carrier`` names (invalid for ``{}`` or a malformed one).

    A ``traceparent`` of our own shape (version 00, no ``tracestate``) is read by slicing, several
    times cheaper than the propagator's regular expression (the learner reads two per group a step);
    anything else goes through the propagator.
    """
    tp = carrier.get("traceparent", "") if carrier else ""
    if (
        carrier
        and len(tp) == 55
        and tp.startswith("00-")
        and "tracestate" not in carrier
        and tp[35] == tp[52] == "-"
        and _HEX.issuperset(tp[3:35])
        and _HEX.issuperset(tp[36:52])
        and _HEX.issuperset(tp[53:])
    ):
        trace_id, span_id = int(tp[3:35], 16), int(tp[36:52], 16)
        if trace_id and span_id:
            return trace.SpanContext(trace_id, span_id, is_remote=True, trace_flags=trace.TraceFlags(int(tp[53:], 16)))
    return trace.get_current_span(extract(carrier)).get_span_context()


def extract(carrier: Mapping[str, str] | None) -> Context:
    """A context whose parent is the span ``carrier`` names (an empty context for ``{}``)."""
    return _propagator.extract(carrier or {}, context=Context())


def _parent(parent: Context | Mapping[str, str] | trace.Span | None) -> Context | None:
    if parent is None or isinstance(parent, Context):
        return parent
    if isinstance(parent, trace.Span):
        return trace.set_span_in_context(parent)
    ctx = remote_context(parent)
    return trace.set_span_in_context(trace.NonRecordingSpan(ctx)) if ctx.is_valid else Context()


def link_from(carrier: Mapping[str, str] | None, attributes: Mapping[str, Any] | None = None) -> trace.Link | None:
    """A span link to the span ``carrier`` names, or None when it names none."""
    ctx = trace.get_current_span(extract(carrier)).get_span_context()
    return trace.Link(ctx, dict(attributes or {})) if ctx.is_valid else None


def group_links(groups: Iterable[SampleGroup]) -> list[trace.Link]:
    """Links to the trace of every sampled group (``fleetrl.group_id`` on each link); ``[]`` when tracing is off."""
    if not enabled():
        return []
    return [trace.Link(remote_context(g.trace), {"fleetrl.group_id": g.group_id}) for g in groups if sampled(g.trace)]


@contextmanager
def span(
    name: str,
    parent: Context | Mapping[str, str] | trace.Span | None = None,
    attributes: Mapping[str, Any] | None = None,
    links: Sequence[trace.Link] = (),
    start_ns: int | None = None,
) -> Iterator[trace.Span]:
    """A span around a block, current inside it (children nest under it).

    ``parent``: None = the current span, :data:`ROOT` = a new trace, a carrier dict or a span.
    Yields the invalid span and does nothing else when tracing is off.
    """
    if not enabled():
        yield trace.INVALID_SPAN
        return
    with get_tracer().start_as_current_span(
        name, context=_parent(parent), attributes=dict(attributes or {}), links=links, start_time=start_ns
    ) as s:
        yield s


def record_span(
    name: str,
    start_ns: int,
    end_ns: int | None = None,
    parent: Context | Mapping[str, str] | trace.Span | None = None,
    attributes: Mapping[str, Any] | None = None,
    links: Sequence[trace.Link] = (),
) -> trace.Span | None:
    """A finished span from timestamps taken earlier (work done in another thread, or only worth a
    span once it succeeded). ``end_ns`` defaults to now; None when tracing is off."""
    if not enabled():
        return None
    s = get_tracer().start_span(
        name, context=_parent(parent), attributes=dict(attributes or {}), links=links, start_time=start_ns
    )
    s.end(end_time=end_ns if end_ns is not None else time.time_ns())
    return s


# ------------------------------------------------------------------------------------ exemplars

_exemplar: dict[str, str] = {}


def note_exemplar(carrier: Mapping[str, str] | None, group_id: str) -> None:
    """Remember a sampled group's trace as this process's metric exemplar (the learner, once per step).

    The Prometheus sink attaches it to the step's counters and histogram (OpenMetrics exemplars:
    ``trace_id``, ``group_id``), so a dashboard point jumps to the trace of a group that step trained.
    An unsampled or empty carrier changes nothing.
    """
    global _exemplar
    if carrier and sampled(carrier):
        _exemplar = {"trace_id": carrier["traceparent"][3:35], "group_id": group_id}


def exemplar() -> dict[str, str]:
    """The latest :func:`note_exemplar` (``{}`` before the first, and whenever tracing is off)."""
    return dict(_exemplar)


def wall_ns(monotonic_s: float) -> int:
    """Unix time in ns of an earlier ``time.monotonic()`` reading (spans carry wall-clock times)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)
