"""What travels between roles beside each payload: the request's metadata.

    {"rid": "...", "kind": "data", "from": "encoder", "deadline": 1.7e9,
     "reply": {"endpoint": "tcp://10.0.0.5:41234", "relay": "tcp"}, ...}

It rides in the relay's JSON control header (`Relay.send(meta=...)`, `Message.meta`), not
in the payload's codec tree, so routing costs no tensor-tree walk.

kinds: `data` (one whole payload), `chunk` (one of a stream, `seq` numbered per emitting
role), `end` (stream finished; `count` chunks were sent), `ref` (a tensor reference parked
at its consumer; `path` says where it goes back), `error` (to the client: `error` names
role, replica, exception), `abort` (free everything of `rid`, pass it on).
`trace` (optional): the W3C traceparent of the span that sent it (tracecontext.py); one
that does not parse is dropped, as the recommendation says, never an error.
Pure: parsing checks every field, since it crossed a socket.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from disagg_core.spec import PathStep, parse_payload_path
from disagg_runtime.wire import tracecontext

Kind = Literal["data", "chunk", "end", "ref", "error", "abort"]
KINDS: tuple[Kind, ...] = ("data", "chunk", "end", "ref", "error", "abort")
REPLY_RELAYS = ("shm", "tcp")


class EnvelopeError(ValueError):
    """An envelope is malformed."""


@dataclass(frozen=True)
class Reply:
    endpoint: str
    relay: str = "tcp"


@dataclass(frozen=True)
class Meta:
    rid: str
    kind: Kind
    source: str
    deadline: float
    reply: Reply
    seq: int = 0
    count: int = 0
    path: str = ""
    error: Mapping[str, str] = field(default_factory=dict)
    trace: str = ""  # a valid version-00 traceparent, or "" (not traced)

    def with_(self, **changes: Any) -> Meta:
        fields = {**self.__dict__, **changes}
        return Meta(**fields)

    @property
    def expired(self) -> bool:
        return time.time() > self.deadline

    def clamped(self, limit_s: float) -> Meta:
        """This envelope with a deadline at most `limit_s` from now: whoever sent it, a
        request holds a role no longer than the role's own request timeout."""
        latest = time.time() + limit_s
        return self if self.deadline <= latest else self.with_(deadline=latest)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "rid": self.rid,
            "kind": self.kind,
            "from": self.source,
            "deadline": self.deadline,
            "reply": {"endpoint": self.reply.endpoint, "relay": self.reply.relay},
        }
        if self.kind in ("chunk",):
            out["seq"] = self.seq
        if self.kind == "end":
            out["count"] = self.count
        if self.kind == "ref":
            out["path"] = self.path
        if self.kind == "error":
            out["error"] = dict(self.error)
        if self.trace:
            out["trace"] = self.trace
        return out


def _get(obj: Mapping[str, Any], key: str, kind: type, where: str = "meta") -> Any:
    value = obj.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise EnvelopeError(f"{where}.{key}: expected {kind.__name__}, got {value!r:.60}")
    return value


def parse(m: object) -> Meta:
    """Check metadata that arrived with a message (`Message.meta`)."""
    if not isinstance(m, dict):
        raise EnvelopeError("meta: expected an object")
    kind = _get(m, "kind", str)
    if kind not in KINDS:
        raise EnvelopeError(f"meta.kind: unknown {kind!r}")
    reply = _get(m, "reply", dict)
    relay = _get(reply, "relay", str, "meta.reply")
    if relay not in REPLY_RELAYS:
        raise EnvelopeError(f"meta.reply.relay: unknown {relay!r}")
    deadline = m.get("deadline")
    if not isinstance(deadline, (int, float)) or isinstance(deadline, bool):
        raise EnvelopeError("meta.deadline: expected a number")
    try:
        deadline = float(deadline)  # a huge JSON integer does not fit: OverflowError
    except OverflowError:
        deadline = math.inf
    if not math.isfinite(deadline):
        raise EnvelopeError("meta.deadline: expected a finite number")
    error = m.get("error", {})
    if not isinstance(error, dict) or not all(isinstance(v, str) for v in error.values()):
        raise EnvelopeError("meta.error: expected an object of strings")
    meta = Meta(
        rid=_get(m, "rid", str),
        kind=kind,
        source=_get(m, "from", str),
        deadline=float(deadline),
        reply=Reply(_get(reply, "endpoint", str, "meta.reply"), relay),
        seq=m.get("seq", 0) if isinstance(m.get("seq", 0), int) else 0,
        count=m.get("count", 0) if isinstance(m.get("count", 0), int) else 0,
        path=m.get("path", "") if isinstance(m.get("path", ""), str) else "",
        error=error,
        trace=tracecontext.valid(m["trace"]) if "trace" in m else "",
    )
    return meta


def extract(payload: Any, path: str) -> tuple[Any, Any]:
    """Remove the value at `path` from `payload`; return (payload without it, value).
    The payload's containers on the path are shallow-copied, never mutated."""
    steps = parse_payload_path(path)
    return _extract(payload, steps, path)


def _extract(node: Any, steps: tuple[PathStep, ...], path: str) -> tuple[Any, Any]:
    step, rest = steps[0], steps[1:]
    if isinstance(step, str) and isinstance(node, dict) and step in node:
        copy = dict(node)
        if not rest:
            return copy, copy.pop(step)
        copy[step], value = _extract(node[step], rest, path)
        return copy, value
    if isinstance(step, int) and isinstance(node, (list, tuple)) and step < len(node):
        items = list(node)
        if not rest:
            value = items[step]
            items[step] = None  # keep the other indexes stable
        else:
            items[step], value = _extract(node[step], rest, path)
        return (tuple(items) if isinstance(node, tuple) else items), value
    raise KeyError(f"tensor reference path {path!r} is not in the payload")


def insert(payload: Any, path: str, value: Any) -> Any:
    """Put `value` back at `path` (inverse of `extract`), creating dicts for missing keys."""
    return _insert(payload, parse_payload_path(path), value, path)


def _insert(node: Any, steps: tuple[PathStep, ...], value: Any, path: str) -> Any:
    step, rest = steps[0], steps[1:]
    if isinstance(step, str):
        if node is None:
            node = {}
        if not isinstance(node, dict):
            raise KeyError(f"cannot put tensor reference {path!r}: {type(node).__name__} on path")
        copy = dict(node)
        copy[step] = value if not rest else _insert(node.get(step), rest, value, path)
        return copy
    if not isinstance(node, (list, tuple)) or step >= len(node):
        raise KeyError(f"cannot put tensor reference {path!r}: index {step} not on path")
    items = list(node)
    items[step] = value if not rest else _insert(node[step], rest, value, path)
    return tuple(items) if isinstance(node, tuple) else items
