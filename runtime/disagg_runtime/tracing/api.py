"""What the runtime asks of a tracer, and the tracer of a process that does not trace.

A `Tracer` starts spans under a W3C traceparent (the envelope's `trace`) at a time on
the monotonic clock (`time.monotonic()`, which `Message.received_at` uses too): roles
record a span after the fact, from instants they noted anyway, so the hot path notes
times and nothing else. `Span.traceparent` is what goes on in the next envelope.

`NOOP` is the tracer when tracing is off (the default): `enabled` is False, and callers
test it before anything else, so an untraced request costs one attribute read per
message. Its spans pass the parent's traceparent through unchanged (W3C: a participant
that does not trace forwards the header as it came).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, Protocol

AttrValue = str | int | float | bool
Attrs = Mapping[str, AttrValue]
SpanKind = Literal["internal", "server", "client", "producer", "consumer"]


class Span(Protocol):
    @property
    def traceparent(self) -> str:
        """This span as the parent of what it sends on ("" when there is none)."""
        ...

    @property
    def recording(self) -> bool: ...

    def child(self, name: str, start: float, end: float, attrs: Attrs | None = None) -> None:
        """A finished child span from `start` to `end` (monotonic seconds)."""
        ...

    def set(self, key: str, value: AttrValue) -> None: ...

    def fail(self, message: str) -> None:
        """Mark the span's status as an error."""
        ...

    def end(self, at: float | None = None) -> None: ...


class Tracer(Protocol):
    @property
    def enabled(self) -> bool: ...

    def start(
        self,
        name: str,
        *,
        parent: str = "",
        at: float | None = None,
        kind: SpanKind = "internal",
        attrs: Attrs | None = None,
    ) -> Span:
        """A span under `parent` (a traceparent; "" or malformed: a new trace), started at
        `at` (monotonic seconds; now when None)."""
        ...

    def shutdown(self) -> None:
        """Export what is buffered and stop (waits a few seconds at most)."""
        ...


class NoopSpan:
    def __init__(self, parent: str = "") -> None:
        self._parent = parent

    @property
    def traceparent(self) -> str:
        return self._parent

    @property
    def recording(self) -> bool:
        return False

    def child(self, name: str, start: float, end: float, attrs: Attrs | None = None) -> None:
        pass

    def set(self, key: str, value: AttrValue) -> None:
        pass

    def fail(self, message: str) -> None:
        pass

    def end(self, at: float | None = None) -> None:
        pass


class NoopTracer:
    @property
    def enabled(self) -> bool:
        return False

    def start(
        self,
        name: str,
        *,
        parent: str = "",
        at: float | None = None,
        kind: SpanKind = "internal",
        attrs: Attrs | None = None,
    ) -> Span:
        return NoopSpan(parent)

    def shutdown(self) -> None:
        pass


NOOP: Tracer = NoopTracer()
