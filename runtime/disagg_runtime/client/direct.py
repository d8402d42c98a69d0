"""Requests whose payload the caller writes into the entry role's pool itself, with no copy
in between (the gateway reading an HTTP body off its socket):

- `Reserved` (shm entry relay): a slot held in the entry role's pool; the caller fills
  `slot`, then `start`s the request (or `release`s the slot unused).
- `Upload` (tcp entry relay): a slot reserved on a connection of the upload's own
  (routing/relays.py `Dedicated`), each chunk sent once the caller's buffer holds it
  (`advance`); `start` submits the request, `release` cuts the transfer, which frees the
  slot at once.

Both are made by `Client.reserve` / `Client.upload` (client/submit.py) and register their
request with it (`Requests`) only when started.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from disagg_runtime.client.errors import RequestFailed, UploadExpired, failed
from disagg_runtime.client.pending import Pending, Requests
from disagg_runtime.relay import RelayError, ShmSender, TcpSender
from disagg_runtime.relay.backends.tcp import chunk_plan
from disagg_runtime.relay.sender import Grant
from disagg_runtime.routing import failover
from disagg_runtime.routing.peers import PeerSet
from disagg_runtime.wire.envelope import Meta
from disagg_runtime.wire.manifest import Manifest


class Reserved:
    """A slot held in the entry role's pool for one request: fill `slot` with the tensors at
    their manifest offsets, then `start` the request (or `release` the slot unused).
    `release` after `start` does nothing: call it in any case once done."""

    def __init__(
        self, client: Requests, peers: PeerSet, relay: ShmSender, grant: Grant, deadline: float
    ) -> None:
        self._client = client
        self._peers = peers
        self._relay = relay
        self.grant = grant
        self.deadline = deadline
        self.slot = relay.slot(grant)
        self._used = False
        self._lock = threading.Lock()

    @property
    def rid(self) -> str:
        return self.grant.rid

    def _use(self) -> bool:
        with self._lock:
            used, self._used = self._used, True
        return not used

    def start(
        self, *, on_chunk: Callable[[Any], None] | None = None, trace: str = ""
    ) -> tuple[str, Future[Any]]:
        """Commit the filled slot: the request starts, as `Client.start` would start it
        (`trace`: the caller's traceparent, carried to every role)."""
        client, rid = self._client, self.grant.rid
        if not self._use():
            raise RequestFailed(f"request {rid}: its slot was already released")
        pending = Pending(client.exits, self.deadline, on_chunk=on_chunk)
        client._track(rid, pending)
        remaining = max(0.0, self.deadline - time.monotonic())
        meta = Meta(rid, "data", "client", time.time() + remaining, client.reply, trace=trace)
        try:
            self._relay.commit(self.grant, meta=meta.to_json(), timeout=remaining)
        except (RelayError, OSError) as exc:
            client._finish(rid, exc=failed(f"request {rid} could not be submitted", exc))
        return rid, pending.future

    def release(self) -> None:
        """Give the slot back, unless the request started (idempotent; may block briefly)."""
        if self._use():
            self._relay.cancel(self.grant)
            self._peers.unpin(self.grant.rid)


def chunk_sources(manifest: Manifest, chunk: int, starts: Sequence[int]) -> list[tuple[int, int]]:
    """[begin, end) in the caller's buffer of every chunk of a tcp transfer, in the order
    they are sent, where manifest tensor i starts at `starts[i]` there."""
    return [(starts[i] + at, starts[i] + at + n) for i, at, n in chunk_plan(manifest, chunk)]


class _Cut(Exception):
    """The upload ends unsent: released, or its source stalled past the deadline."""


class Upload:
    """A payload streamed to the entry role over tcp while its bytes arrive: a slot is
    reserved there on a connection of its own, and a thread sends each chunk once the
    caller's buffer holds it (`advance`: its first n bytes are in). The last chunk waits
    for `start`, which registers the request first (its answer may come at once). `release`
    (or the deadline passing with the bytes short) cuts the transfer: the slot is freed at
    once. `on_done` runs once the buffer is no longer read. `granted` resolves when the
    slot is reserved (RequestFailed if none could be had); `write_by` is then the time by
    which the bytes must all be in."""

    def __init__(
        self,
        client: Requests,
        peers: PeerSet,
        manifest: Manifest,
        data: memoryview,
        starts: Sequence[int],
        timeout: float,
        on_done: Callable[[], None],
        trace: str = "",
    ) -> None:
        self._client = client
        self.trace = trace  # the envelope leaves with the first chunk, under this trace
        self._peers = peers
        self.manifest = manifest
        self._data = data
        self._starts = list(starts)
        self.rid = uuid.uuid4().hex
        self.deadline = time.monotonic() + client.timeout
        self._reserve_by = time.monotonic() + timeout
        self._on_done = on_done
        self.write_by = self.deadline  # for the caller's bytes (the grant's half lease)
        self._cut_by = self.deadline  # for the thread, a little later: start() may be late
        self.granted: Future[None] = Future()
        self._acked: Future[None] = Future()
        self._filled = 0
        self._state = "filling"  # -> "started" | "cut"
        self._expired: int | None = None  # cut by its own deadline with this many bytes in
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="disagg-upload", daemon=True)
        self._thread.start()

    def advance(self, filled: int) -> None:
        """The caller's buffer now holds its first `filled` bytes."""
        with self._cond:
            self._filled = filled
            self._cond.notify()

    def start(
        self, *, on_chunk: Callable[[Any], None] | None = None, trace: str = ""
    ) -> tuple[str, Future[Any]]:
        """Submit: the request is registered and its last chunk sent; returns once the
        entry role holds the payload (or failed to take it: the future says so). `trace`
        is unused: the upload's envelope left with its first chunk, under the trace given
        to `Client.upload`."""
        client, rid = self._client, self.rid
        pending = Pending(client.exits, self.deadline, on_chunk=on_chunk)
        with self._cond:
            if self._state != "filling":
                if self._expired is not None:
                    raise self._expiry()
                raise RequestFailed(f"request {rid}: its upload was already cut")
            client._track(rid, pending)
            self._state = "started"
            self._cond.notify()
        try:
            self._acked.result(timeout=max(0.0, self.deadline - time.monotonic()) + 1.0)
        except Exception as exc:
            with self._cond:
                failure = self._expiry() if self._expired is not None else None
            client._finish(
                rid,
                exc=failure or RequestFailed(f"request {rid} could not be submitted: {exc}"),
            )
        return rid, pending.future

    def _expiry(self) -> UploadExpired:
        """The failure of an upload its thread cut at the deadline (call with _cond held)."""
        return UploadExpired(
            f"request {self.rid}: the request body was not received in time: its upload was "
            f"cut at the deadline with {self._expired} of {len(self._data)} bytes of its "
            "tensors in"
        )

    def release(self) -> None:
        """Cut the transfer unless the request started (idempotent; does not wait)."""
        with self._cond:
            if self._state == "filling":
                self._state = "cut"
                self._cond.notify()

    def _wait(self, filled: int, *, last: bool) -> None:
        """Until the buffer holds `filled` bytes (and, for the `last` chunk, the request
        started); _Cut when released, or when they are not in a little after `write_by`."""
        with self._cond:
            while True:
                if self._state == "cut":
                    raise _Cut("released")
                if self._filled >= filled and (not last or self._state == "started"):
                    return
                remaining = self._cut_by - time.monotonic()
                if remaining <= 0:
                    self._state = "cut"
                    self._expired = self._filled
                    raise _Cut("the bytes did not come in time")
                self._cond.wait(remaining)

    def _reserve(self) -> tuple[TcpSender, Grant]:
        """A slot on a dedicated connection, with failover (failover.DedicatedTcp: once more,
        elsewhere, on PeerLost; a replica that did not answer is skipped for a while)."""
        peers, viewer = self._peers, self._client.relays.viewer(self._peers.kind)
        route = failover.DedicatedTcp(
            self._client.uploads,
            lambda first: (
                peers.endpoint_for(self.rid, viewer) if first else peers.reroute(self.rid, viewer)
            ),
            role=peers.peer.role,
            unanswered=peers.unanswered,
        )
        return failover.with_failover(
            route,
            lambda relay, seconds: relay.reserve(self.rid, self.manifest, timeout=seconds),
            timeout=max(0.05, self._reserve_by - time.monotonic()),
        )

    def _run(self) -> None:
        relay: TcpSender | None = None
        try:
            try:
                relay, grant = self._reserve()
            except (RelayError, OSError) as exc:
                self.granted.set_exception(
                    failed(f"request {self.rid}: no slot in the entry role's pool", exc)
                )
                return
            self.write_by = min(self.deadline, grant.write_by)
            # the receiver drops a transfer a whole lease after its commit: past half of it
            self._cut_by = min(self.deadline, grant.write_by + relay.lease_s / 4)
            self.granted.set_result(None)
            try:
                self._send(relay, grant)
            except BaseException as exc:
                self._acked.set_exception(exc)
            else:
                self._acked.set_result(None)
        finally:
            if relay is not None:
                self._client.uploads.give(relay)
            if self._state != "started":
                self._peers.unpin(self.rid)
            self._on_done()

    def _send(self, relay: TcpSender, grant: Grant) -> None:
        remaining = max(0.0, self.deadline - time.monotonic())
        reply = self._client.reply
        meta = Meta(self.rid, "data", "client", time.time() + remaining, reply, trace=self.trace)
        sources = chunk_sources(self.manifest, relay.chunk_bytes, self._starts)
        data = self._data
        with relay.stream(grant, meta=meta.to_json(), timeout=remaining) as out:
            for n, (begin, end) in enumerate(sources):
                self._wait(end, last=n == len(sources) - 1)
                out.send(data[begin:end])
            out.finish()
