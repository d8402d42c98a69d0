"""Spans as JSON lines in a file: traces without a collector (`disagg up --trace`).

    {"trace_id": "4bf9...", "span_id": "00f0...", "parent_id": "" | "...", "name": "encoder",
     "service": "t2v/encoder", "kind": "consumer", "start_ns": ..., "end_ns": ...,
     "status": "ok" | "error: ...", "attributes": {...}}

Every process of a run appends to the same file: each batch is one `write()` on a file
opened with O_APPEND, so lines from different processes never interleave (Linux holds
the inode's lock across a regular file's write). timeline.py reads it back.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import StatusCode


def span_record(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.context
    parent = span.parent
    status = span.status
    return {
        "trace_id": f"{ctx.trace_id:032x}" if ctx else "",
        "span_id": f"{ctx.span_id:016x}" if ctx else "",
        "parent_id": f"{parent.span_id:016x}" if parent else "",
        "name": span.name,
        "service": str(span.resource.attributes.get("service.name", "")),
        "kind": span.kind.name.lower(),
        "start_ns": span.start_time or 0,
        "end_ns": span.end_time or 0,
        "status": "ok"
        if status.status_code != StatusCode.ERROR
        else f"error: {status.description or ''}",
        "attributes": dict(span.attributes or {}),
    }


class SpanFileExporter(SpanExporter):
    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(span_record(s), default=str) + "\n" for s in spans)
        with self._lock:
            if self._fd < 0:
                return SpanExportResult.FAILURE
            try:
                os.write(self._fd, data.encode())
            except OSError:
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
