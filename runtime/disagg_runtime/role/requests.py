"""The request table of one role: per-request work queues, fan-in joins and aborts.

    ingress thread ──offer──> work[rid] (deque, arrival order) ──take──> a worker
                                  │                                        │ done(rid)
                                  └─ runnable: rids with work and no worker ┘
    joins[rid]: inputs gathered until every upstream role and tensor ref has come
    aborted[rid]: until when messages of an aborted request are dropped on sight

- Messages of one request are handled one at a time, in arrival order (stream chunks
  stay ordered): a request is `runnable` only while no worker holds it.
- New requests (neither queued nor joining) beyond `max_queue` are refused: the caller
  tells the client `overloaded` at once rather than letting it wait.
- Everything a dropped request held here (queued messages, a join's messages) is
  released: its pool slots are free again.
- `hand_back()` takes out what no worker has started (queued requests, joins still
  waiting): a draining role hands those on instead of failing them.
One lock (a Condition, which the workers wait on) guards it all; nothing here does I/O.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from disagg_runtime.relay import Message
from disagg_runtime.wire.envelope import Meta

ABORT_MEMORY_S = 120.0  # how long an aborted request's late messages are dropped on sight
Work = tuple[Meta, Any, Message]


@dataclass
class Join:
    """Inputs of one request gathered before the handler runs (fan-in, tensor refs)."""

    meta: Meta
    inputs: dict[str, Any] = field(default_factory=dict)
    refs: dict[str, Any] = field(default_factory=dict)
    messages: list[Message] = field(default_factory=list)


class Requests:
    """The requests a role holds, between the ingress and its workers (thread-safe)."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self.cond = threading.Condition()
        self._work: dict[str, collections.deque[Work]] = {}
        self._runnable: collections.deque[str] = collections.deque()
        self._active: set[str] = set()
        self._joins: dict[str, Join] = {}
        self._seq: dict[str, int] = collections.defaultdict(int)
        self._aborted: dict[str, float] = {}

    # ---- arrivals -----------------------------------------------------------------------------
    def aborted(self, rid: str) -> bool:
        return rid in self._aborted  # a dict read: safe without the lock

    def offer(self, meta: Meta, payload: Any, msg: Message) -> bool:
        """Queue a message for its request; False when it is a new request and
        `max_queue` are waiting already (refused: the caller releases `msg`)."""
        with self.cond:
            rid = meta.rid
            new = rid not in self._work and rid not in self._joins
            if new and len(self._runnable) + len(self._joins) >= self.max_queue:
                return False
            self._work.setdefault(rid, collections.deque()).append((meta, payload, msg))
            if rid not in self._active and rid not in self._runnable:
                self._runnable.append(rid)
                self.cond.notify()
        return True

    def join(
        self, meta: Meta, payload: Any, msg: Message, upstream: set[str], refs: set[str]
    ) -> Join | None:
        """Add one input of a joining request; the Join once every `upstream` role and
        tensor-ref path has come (then it is out of the table), else None."""
        with self.cond:
            join = self._joins.setdefault(meta.rid, Join(meta=meta))
            join.messages.append(msg)
            if meta.kind == "ref":
                join.refs[meta.path] = payload
            else:
                join.inputs[meta.source] = payload
                join.meta = meta
            if set(join.inputs) >= upstream and set(join.refs) >= refs:
                del self._joins[meta.rid]
                return join
        return None

    # ---- workers ------------------------------------------------------------------------------
    def take(self, stopping: threading.Event) -> tuple[str, Work] | None:
        """The next message of a request no worker holds (the worker holds it now); None
        once `stopping` is set."""
        with self.cond:
            while not self._runnable and not stopping.is_set():
                self.cond.wait(0.5)
            if stopping.is_set():
                return None
            rid = self._runnable.popleft()
            self._active.add(rid)
            return rid, self._work[rid].popleft()

    def done(self, rid: str) -> None:
        """A worker finished a message of `rid`: its next one, if any, is runnable."""
        with self.cond:
            self._active.discard(rid)
            if self._work.get(rid):
                self._runnable.append(rid)
                self.cond.notify()
            else:
                self._work.pop(rid, None)

    def wake_all(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def next_seq(self, rid: str) -> int:
        """The sequence number of the request's next output chunk from this role."""
        with self.cond:
            seq = self._seq[rid]
            self._seq[rid] = seq + 1
        return seq

    def end_count(self, rid: str) -> int:
        """How many chunks the request's output stream had (and forget it)."""
        with self.cond:
            return self._seq.pop(rid, 0)

    # ---- leaving ------------------------------------------------------------------------------
    def drop(self, rid: str) -> bool:
        """Free what the request holds here and drop its later messages for a while;
        False when it was aborted already."""
        with self.cond:
            if rid in self._aborted:
                return False
            self._aborted[rid] = time.monotonic() + ABORT_MEMORY_S
            queued = [m for _, _, m in self._work.pop(rid, ())]
            join = self._joins.pop(rid, None)
            if rid in self._runnable:
                self._runnable.remove(rid)
            self._seq.pop(rid, None)
        for msg in queued + (join.messages if join else []):
            msg.release()
        return True

    def expired_joins(self) -> list[Join]:
        """Joins past their request's deadline (still in the table: fail, then drop them);
        aborts remembered long enough are forgotten on the way."""
        now = time.monotonic()
        with self.cond:
            for rid, until in list(self._aborted.items()):
                if until < now:
                    del self._aborted[rid]
            return [j for j in self._joins.values() if j.meta.expired]

    def hand_back(self) -> list[Meta]:
        """Take out every request no worker has started: queued ones (nothing of them
        handled here yet) and joins still waiting. Their messages are released and the
        requests remembered as aborted here; the caller hands them on (see runtime.py)."""
        with self.cond:
            unstarted = [
                rid
                for rid, work in self._work.items()
                if rid not in self._active and work and work[0][0].kind == "data"
            ]
            metas = [self._work[rid][0][0] for rid in unstarted] + [
                j.meta for j in self._joins.values()
            ]
        for meta in metas:
            self.drop(meta.rid)
        return metas

    def clear(self) -> list[Message]:
        """Empty the table (the ingress is closed); the messages it held, to release."""
        with self.cond:
            held = [m for q in self._work.values() for _, _, m in q]
            held += [m for j in self._joins.values() for m in j.messages]
            self._work.clear()
            self._joins.clear()
            self._runnable.clear()
        return held

    # ---- reading ------------------------------------------------------------------------------
    def busy(self) -> bool:
        """Anything queued, being handled or joining."""
        with self.cond:
            return bool(self._work or self._active or self._joins)

    def counts(self) -> tuple[int, int, int]:
        """(requests waiting for a worker, messages queued, requests being handled)."""
        with self.cond:
            return (
                len(self._runnable),
                sum(len(q) for q in self._work.values()),
                len(self._active),
            )
