"""The spans one role records per handled message (tracing/ does the OpenTelemetry part).

    <role> (consumer; parent: the sender's span in the envelope; from the message's
    │        arrival until its last output left)
    ├─ queue      arrival -> a worker took it (for a join: the last input's arrival)
    ├─ handler    the handler's call (a streaming handler: until its stream ended)
    └─ send <to>  one per output sent (relay, bytes), at most MAX_SENDS per message

Only messages whose envelope carries a sampled traceparent are traced, and only when the
role's tracer is on: otherwise `begin` returns None and the role does nothing more. A
message's spans are found again by the traceparent its outputs carry (its own span's),
so sends and failures deep in the role need no handle passed down to them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from disagg_runtime.relay import Message
from disagg_runtime.tracing import Attrs, Span, Tracer
from disagg_runtime.wire import tracecontext
from disagg_runtime.wire.envelope import Meta

MAX_SENDS = 64  # send spans per message: a long stream's chunks are counted, not each drawn


class MessageSpans:
    """One handled message's role span and the children it gathers."""

    def __init__(self, span: Span, started: float) -> None:
        self.span = span
        self.started = started
        self.sends = 0
        self._handled = False

    def handled(self, end: float) -> None:
        """The handler's span ends at `end` (the first call counts)."""
        if not self._handled:
            self._handled = True
            self.span.child("handler", self.started, end)

    def sent(self, target: str, start: float, relay: str, nbytes: int) -> None:
        self.sends += 1
        if self.sends <= MAX_SENDS:
            attrs: Attrs = {"disagg.relay": relay, "disagg.bytes": nbytes, "disagg.to": target}
            self.span.child(f"send {target}", start, time.monotonic(), attrs)

    def failed(self, reason: str, message: str) -> None:
        self.span.set("disagg.failure", reason)
        self.span.fail(message)

    def end(self) -> None:
        if self.sends > MAX_SENDS:
            self.span.set("disagg.sends", self.sends)
        self.span.end()


class RoleSpans:
    def __init__(self, tracer: Tracer, role: str, replica: int) -> None:
        self.tracer = tracer
        self.attrs: Attrs = {"disagg.role": role, "disagg.replica": replica}
        self.name = role
        self._open: dict[str, MessageSpans] = {}  # by their span's traceparent

    def sent(self, meta: Meta, target: str, start: float, relay: str, nbytes: int) -> None:
        spans = self._open.get(meta.trace)
        if spans is not None:
            spans.sent(target, start, relay, nbytes)

    def failed(self, meta: Meta, reason: str, message: str) -> None:
        spans = self._open.get(meta.trace)
        if spans is not None:
            spans.failed(reason, message)

    def end(self, spans: MessageSpans) -> None:
        self._open.pop(spans.span.traceparent, None)
        spans.end()

    def begin(self, meta: Meta, messages: Sequence[Message], started: float) -> MessageSpans | None:
        """The spans of a message a worker took at `started` (monotonic), or None."""
        if not self.tracer.enabled or not meta.trace or not tracecontext.sampled(meta.trace):
            return None  # its traceparent goes on unchanged in `meta`
        arrived = max((m.received_at for m in messages), default=started)
        attrs: Attrs = {
            **self.attrs,
            "disagg.request_id": meta.rid,
            "disagg.from": meta.source,
            "disagg.kind": meta.kind,
            "disagg.bytes": sum(m.nbytes for m in messages),
        }
        span = self.tracer.start(
            self.name, parent=meta.trace, at=arrived, kind="consumer", attrs=attrs
        )
        span.child("queue", arrived, started)
        spans = self._open[span.traceparent] = MessageSpans(span, started)
        return spans
