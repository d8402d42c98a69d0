"""A minimal OTLP/HTTP traces receiver on 127.0.0.1: what `bench pipeline --trace` (and
the trace tests) export to instead of a collector.

`POST /v1/traces` with an `ExportTraceServiceRequest` (protobuf; gzip or deflate as the
exporter's OTEL_EXPORTER_OTLP_COMPRESSION may send it), answered 200 with an empty
response, as a collector answers. Each span is kept as a flat `ReceivedSpan` (up to
`keep`; beyond that only counted), so a test can check ids and parents as they arrived.
Bodies are bounded (MAX_BODY): this is for loopback use, but it still refuses a huge one.
"""

from __future__ import annotations

import gzip
import threading
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

MAX_BODY = 64 << 20


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    service: str
    attributes: dict[str, Any] = field(default_factory=dict)
    status_code: int = 0


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def decode(body: bytes) -> list[ReceivedSpan]:
    request = trace_service_pb2.ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for rs in request.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append(
                    ReceivedSpan(
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        name=s.name,
                        kind=s.kind,
                        service=str(resource.get("service.name", "")),
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        status_code=s.status.code,
                    )
                )
    return spans


class OtlpSink:
    def __init__(self, keep: int = 100_000) -> None:
        self.spans: list[ReceivedSpan] = []
        self.count = 0
        self.keep = keep
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if self.path != "/v1/traces" or not 0 <= length <= MAX_BODY:
                    self.send_error(404 if self.path != "/v1/traces" else 413)
                    return
                body = self.rfile.read(length)
                encoding = self.headers.get("Content-Encoding", "")
                try:
                    if encoding == "gzip":
                        body = gzip.decompress(body)
                    elif encoding == "deflate":
                        body = zlib.decompress(body)
                    spans = decode(body)
                except Exception:
                    self.send_error(400)
                    return
                sink._add(spans)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _add(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self.count += len(spans)
            room = max(0, self.keep - len(self.spans))
            self.spans.extend(spans[:room])

    def received(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def __enter__(self) -> OtlpSink:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
