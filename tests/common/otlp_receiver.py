"""A real OTLP/HTTP trace receiver for tests and benchmarks: an HTTP server on 127.0.0.1 that decodes
each ``POST /v1/traces`` body as an ``ExportTraceServiceRequest`` (the collector protocol, with the
``opentelemetry-proto`` messages) and keeps every span as a record shaped like
``fleetrl.common.telemetry.tracing.span_record`` (so ``fleetrl trace``'s ``Spans`` reads them too)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


def any_value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


def records(request: ExportTraceServiceRequest) -> list[dict[str, Any]]:
    """Every span of one export request as a span record (trace and span ids in hex)."""
    out = []
    for rs in request.resource_spans:
        resource = attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    {
                        "name": s.name,
                        "trace_id": s.trace_id.hex(),
                        "span_id": s.span_id.hex(),
                        "parent_id": s.parent_span_id.hex() or None,
                        "service": resource.get("service.name", ""),
                        "instance": resource.get("service.instance.id", ""),
                        "pid": resource.get("process.pid"),
                        "start_ns": s.start_time_unix_nano,
                        "end_ns": s.end_time_unix_nano,
                        "status": s.status.code,
                        "attributes": attributes(s.attributes),
                        "links": [
                            {
                                "trace_id": lk.trace_id.hex(),
                                "span_id": lk.span_id.hex(),
                                "attributes": attributes(lk.attributes),
                            }
                            for lk in s.links
                        ],
                    }
                )
    return out


class OtlpReceiver:
    """``with OtlpReceiver() as rx:`` serves ``rx.endpoint``; ``rx.spans`` holds what arrived."""

    def __init__(self, decode: bool = True) -> None:
        """``decode=False`` keeps the bodies and decodes them in :meth:`decode_all` (a benchmark's receiver
        then costs the machine little while it measures)."""
        self.spans: list[dict[str, Any]] = []
        self.bodies: list[bytes] = []
        self.decode = decode
        self.requests = 0
        self.bad: list[str] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the http.server API
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    receiver.bad.append(f"{self.path} {self.headers.get('Content-Type')}")
                    self.send_response(404)
                    self.end_headers()
                    return
                spans = records(ExportTraceServiceRequest.FromString(body)) if receiver.decode else []
                with receiver._lock:
                    receiver.spans.extend(spans)
                    receiver.requests += 1
                    if not receiver.decode:
                        receiver.bodies.append(body)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join()

    def decode_all(self) -> list[dict[str, Any]]:
        """Decode the bodies kept with ``decode=False`` (each is still a full ExportTraceServiceRequest)."""
        with self._lock:
            bodies, self.bodies = self.bodies, []
        for body in bodies:
            self.spans.extend(records(ExportTraceServiceRequest.FromString(body)))
        return self.spans

    def write_jsonl(self, path: Path) -> None:
        """The spans received, one record a line (what ``fleetrl trace`` reads from ``<run_dir>/traces``)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            path.write_text("".join(json.dumps(s) + "\n" for s in self.spans))
