"""Span files: the JSON record of one span, the exporter that appends them to one file per process
(``telemetry.exporter: jsonl``), and the readers ``fleetrl trace`` uses. Set up by ``common/telemetry/tracing.py``."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

TRACES_DIR = "traces"  # <run_dir>/traces/<service>-<pid>.jsonl


def _hex_span(span_id: int) -> str:
    return f"{span_id:016x}"


def _hex_trace(trace_id: int) -> str:
    return f"{trace_id:032x}"


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """One finished span as the JSON object the jsonl exporter writes (and ``fleetrl trace`` reads).

    Keys: name, trace_id (32 hex), span_id and parent_id (16 hex; parent_id null for a root),
    service (``fleetrl-<service>``), instance (``service.instance.id``), start_ns / end_ns (Unix
    nanoseconds), status, attributes, links ([{trace_id, span_id, attributes}]) and, when there are
    any, events.
    """
    ctx, res = span.context, span.resource.attributes if span.resource else {}
    out: dict[str, Any] = {
        "name": span.name,
        "trace_id": _hex_trace(ctx.trace_id),
        "span_id": _hex_span(ctx.span_id),
        "parent_id": _hex_span(span.parent.span_id) if span.parent is not None else None,
        "service": res.get("service.name", ""),
        "instance": res.get("service.instance.id", ""),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "links": [
            {
                "trace_id": _hex_trace(link.context.trace_id),
                "span_id": _hex_span(link.context.span_id),
                "attributes": dict(link.attributes or {}),
            }
            for link in span.links
        ],
    }
    if span.events:
        out["events"] = [
            {"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})} for e in span.events
        ]
    return out


class JsonlSpanExporter(SpanExporter):
    """Appends one JSON object per span to ``path`` (one file per process: no interleaving)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        text = "".join(json.dumps(span_record(s), default=str) + "\n" for s in spans)
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            self._file.write(text)
            self._file.flush()
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()


def trace_files(run_dir: str | Path) -> list[Path]:
    """Every process's span file of a run directory."""
    return sorted((Path(run_dir) / TRACES_DIR).glob("*.jsonl"))


def read_spans(run_dir: str | Path) -> list[dict[str, Any]]:
    """All span records of a run directory (a partly written last line is skipped)."""
    spans = []
    for path in trace_files(run_dir):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                spans.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return spans
