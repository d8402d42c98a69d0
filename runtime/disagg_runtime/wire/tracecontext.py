"""W3C Trace Context's `traceparent`: the one trace field that crosses sockets.

    traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01
                 ^^ ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^ ^^^^^^^^^^^^^^^^ ^^
                 version   trace-id (16 bytes)      parent-id (8)   flags (bit 0: sampled)

It enters at the gateway (an HTTP header) and rides in every envelope (`Meta.trace`).
Parsing follows the recommendation's rules (www.w3.org/TR/trace-context/#traceparent-header):
lower-case hex only, an all-zero trace-id or parent-id is invalid, version `ff` is invalid,
a higher version is read by its first four fields. Whatever fails is ignored (treated as
absent, so a new trace starts), never an error: a bad header must not fail a request.
Pure, and bounded: nothing longer than `MAX_LEN` is looked at.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_LEN = 256  # a future version may append fields; more than this is not a traceparent
_V00 = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_V00_WHOLE = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16
SAMPLED = 0x01


@dataclass(frozen=True)
class TraceParent:
    trace_id: int
    span_id: int  # the parent-id: the span that sent this request
    flags: int = SAMPLED

    @property
    def sampled(self) -> bool:
        return bool(self.flags & SAMPLED)

    def header(self) -> str:
        """The version-00 header value (a higher version's extra fields are dropped, as
        the recommendation says a version-00 participant does)."""
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{self.flags & 0xFF:02x}"


def parse(value: object) -> TraceParent | None:
    """The traceparent in `value`, or None when it is absent or malformed."""
    if not isinstance(value, str) or not value or len(value) > MAX_LEN:
        return None
    value = value.strip(" \t")  # optional whitespace around an HTTP header's value
    match = _V00.match(value)
    if match is None:
        return None
    version, trace_id, span_id, flags = match.groups()
    if version == "ff" or trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    if version == "00" and len(value) != 55:
        return None  # version 00 has exactly four fields
    if version != "00" and len(value) > 55 and value[55] != "-":
        return None  # a later version appends fields after a dash
    return TraceParent(int(trace_id, 16), int(span_id, 16), int(flags, 16))


def valid(value: object) -> str:
    """`value` as a version-00 traceparent, or "" (what an envelope carries). Every hop
    checks its envelope's: a valid version-00 value is returned as it is, unparsed."""
    if isinstance(value, str) and len(value) == 55 and _V00_WHOLE.fullmatch(value):
        if value[3:35] != _ZERO_TRACE and value[36:52] != _ZERO_SPAN:
            return value
        return ""
    parsed = parse(value)
    return parsed.header() if parsed is not None else ""


def sampled(header: str) -> bool:
    """Whether a valid traceparent (`valid`'s) has its sampled flag set."""
    return bool(int(header[-1], 16) & SAMPLED)
