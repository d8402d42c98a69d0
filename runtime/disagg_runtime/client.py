"""Submit payloads to a pipeline's entry roles; get results or chunk streams back.

The client owns a small receive pool and an `Ingress`: exit roles send results (and any
role sends errors) straight to it, named in every request's envelope. Results are copied
out of the pool before the slot is released, so they stay valid for the caller.

    client = Client(entries=[Peer("encoder", ("127.0.0.1:7400",))], exits=["decoder"])
    video = client.submit({"prompt": tokens}, timeout=30)
    for frame in client.stream(payload): ...

A caller that makes a payload's bytes itself can write them straight into the entry
role's pool (shm entry relay, one entry role): `reserve(manifest)` holds a slot there,
the caller fills `Reserved.slot`, and `Reserved.start` submits it (`release` gives an
unused slot back). Over tcp it can stream them there as they come instead: `upload`
reserves a slot on a connection of the upload's own (peers.py `Dedicated`) and sends each
chunk once the caller says its bytes are in (`Upload.advance`); `Upload.start` submits
the request, `release` cuts the transfer, which frees the slot at once.

The client holds the pipeline's peer key (`key`, else the file DISAGG_PEER_KEY_FILE
names; relay/auth.py): roles serve it, and reply to its ingress, only because it proves
that key. There is no default key: without one the client does not start.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from disagg_core.contract import Peer
from disagg_runtime.memory.pool import Pool, shm_name, shm_namespace
from disagg_runtime.relay import (
    Ingress,
    Message,
    PeerLost,
    RelayError,
    ShmSender,
    TcpSender,
    Unanswered,
)
from disagg_runtime.relay.auth import check_key, key_from_env
from disagg_runtime.relay.backends.tcp import chunk_plan
from disagg_runtime.relay.errors import NeverFits
from disagg_runtime.relay.sender import Grant
from disagg_runtime.routing.peers import (
    Dedicated,
    PeerSet,
    PeersFile,
    RelayCache,
    Resolver,
    resolve_dns,
)
from disagg_runtime.wire import envelope
from disagg_runtime.wire.envelope import Meta, Reply
from disagg_runtime.wire.manifest import Manifest

_END = object()
EXPIRE_EVERY_S = 0.1  # how often requests past their deadline are failed
ABORT_BACKLOG = 4096  # aborts waiting for the control thread
log = logging.getLogger(__name__)


TOO_LARGE = "too_large"  # RequestFailed.error["reason"] of a payload no pool can hold


class RequestFailed(RuntimeError):
    """A role failed the request; `role` and `error` say where and why."""

    def __init__(self, message: str, *, role: str = "", error: dict[str, str] | None = None):
        super().__init__(message)
        self.role = role
        self.error = error or {}


def _failed(what: str, exc: BaseException) -> RequestFailed:
    """A request that a relay could not submit; one that can never fit says so (reason
    `too_large`: a gateway answers 413, not a retryable 503)."""
    error = {"reason": TOO_LARGE} if isinstance(exc, NeverFits) else None
    return RequestFailed(f"{what}: {exc}", error=error)


class RequestTimeout(RequestFailed, TimeoutError):
    """No complete result before the request's deadline; the request was aborted."""


class RequestOverloaded(RequestFailed):
    """A role refused the request at once: too many requests were waiting for its workers
    (a gateway answers 429 or 503; retrying later may succeed)."""


class UploadExpired(RequestFailed):
    """An upload's bytes were not all in, or its request not started, by its deadline: it
    was cut and its slot freed. The source was too slow (a gateway answers 408), whichever
    side noticed first: the caller's deadline for the bytes, or the upload thread's own."""


_FAILURES = {"timeout": RequestTimeout, "overloaded": RequestOverloaded}


@dataclass(frozen=True)
class Streamed:
    """The result of an exit role whose chunks went to `on_chunk`: how many there were."""

    count: int


def detach(value: Any) -> Any:
    """Deep-copy tensors out of pool memory (containers rebuilt, scalars kept)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: detach(v) for k, v in value.items()}
    if isinstance(value, list):
        return [detach(v) for v in value]
    if isinstance(value, tuple):
        return tuple(detach(v) for v in value)
    return value


@dataclass
class _Pending:
    exits: frozenset[str]
    deadline: float
    future: Future[Any] = field(default_factory=Future)
    chunks: queue.Queue[Any] = field(default_factory=queue.Queue)
    results: dict[str, Any] = field(default_factory=dict)
    streamed: dict[str, list[Any]] = field(default_factory=dict)
    next_seq: dict[str, int] = field(default_factory=dict)
    ended: set[str] = field(default_factory=set)
    on_chunk: Callable[[Any], None] | None = None


class Reserved:
    """A slot held in the entry role's pool for one request: fill `slot` with the tensors at
    their manifest offsets, then `start` the request (or `release` the slot unused).
    `release` after `start` does nothing: call it in any case once done."""

    def __init__(
        self, client: Client, peers: PeerSet, relay: ShmSender, grant: Grant, deadline: float
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
        """Commit the filled slot: the request starts, as `Client.start` would start it."""
        client, rid = self._client, self.grant.rid
        if not self._use():
            raise RequestFailed(f"request {rid}: its slot was already released")
        pending = _Pending(client.exits, self.deadline, on_chunk=on_chunk)
        with client._lock:
            client._pending[rid] = pending
        remaining = max(0.0, self.deadline - time.monotonic())
        meta = Meta(rid, "data", "client", time.time() + remaining, client.reply, trace=trace)
        try:
            self._relay.commit(self.grant, meta=meta.to_json(), timeout=remaining)
        except (RelayError, OSError) as exc:
            client._finish(rid, exc=_failed(f"request {rid} could not be submitted", exc))
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
        client: Client,
        peers: PeerSet,
        manifest: Manifest,
        data: memoryview,
        starts: Sequence[int],
        timeout: float,
        on_done: Callable[[], None],
        trace: str = "",
    ) -> None:
        self._client = client
        self.trace = trace
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
        pending = _Pending(client.exits, self.deadline, on_chunk=on_chunk)
        with self._cond:
            if self._state != "filling":
                if self._expired is not None:
                    raise self._expiry()
                raise RequestFailed(f"request {rid}: its upload was already cut")
            with client._lock:
                client._pending[rid] = pending
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
        """A slot on a dedicated connection, reconnecting once (elsewhere) on PeerLost, as
        RelayCache.on_relay does (a replica that did not answer is skipped for a while)."""
        peers, dedicated = self._peers, self._client.uploads
        endpoint = peers.endpoint_for(self.rid, self._client.relays.viewer(peers.kind))
        for attempt in (1, 2):
            remaining = max(0.05, self._reserve_by - time.monotonic())
            try:
                relay = dedicated.take(
                    endpoint, timeout=remaining, role=peers.peer.role, bounded=attempt == 1
                )
            except PeerLost as exc:  # WrongRole, Unanswered: nothing of it was opened
                if attempt == 2:
                    raise
                if isinstance(exc, Unanswered):
                    peers.lost(endpoint)
                endpoint = peers.reroute(self.rid, self._client.relays.viewer(peers.kind))
                continue
            try:
                remaining = max(0.05, self._reserve_by - time.monotonic())
                return relay, relay.reserve(self.rid, self.manifest, timeout=remaining)
            except PeerLost:
                relay.close()
                if attempt == 2:
                    raise
                endpoint = peers.reroute(self.rid, self._client.relays.viewer(peers.kind))
            except BaseException:
                dedicated.give(relay)
                raise
        raise AssertionError("unreachable")

    def _run(self) -> None:
        relay: TcpSender | None = None
        try:
            try:
                relay, grant = self._reserve()
            except (RelayError, OSError) as exc:
                self.granted.set_exception(
                    _failed(f"request {self.rid}: no slot in the entry role's pool", exc)
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


class Client:
    def __init__(
        self,
        entries: Sequence[Peer],
        exits: Sequence[str],
        *,
        pipeline: str = "pipeline",
        entry_relay: str = "tcp",
        reply_relay: str = "tcp",
        bind_host: str = "127.0.0.1",
        bind_port: int = 0,
        advertise_host: str | None = None,
        pool_size: int = 256 << 20,
        timeout: float = 30.0,
        resolver: Resolver = resolve_dns,
        peers_file: str = "",
        key: bytes | None = None,
        dispatch: str = "load",
        hashed_roles: Collection[str] = (),
    ) -> None:
        """`dispatch` "load" sends each request to the entry replica whose advertised load
        is lowest of two (routing/dispatch.py), "hash" by its id; entry roles in `hashed_roles`
        (those that join inputs) are always chosen by hash."""
        key = check_key(key) if key is not None else key_from_env()
        self.key = key  # the pipeline's peer key (the gateway's readiness probe proves it)
        self.exits = frozenset(exits)
        self.timeout = timeout
        self.reply_relay = reply_relay
        if reply_relay == "shm":
            self.pool = Pool.create(pool_size, device="shm", name=shm_name(pipeline, "client"))
        else:
            self.pool = Pool.create(pool_size, device="cpu")
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._aborts: queue.Queue[str] = queue.Queue(ABORT_BACKLOG)
        try:  # results are handled on its I/O thread: one wake-up per message, not two
            self.ingress = Ingress(
                f"tcp://{bind_host}:{bind_port}",
                self.pool,
                lease_s=timeout,
                key=key,
                on_message=self._on_delivered,
            )
        except BaseException:
            self.pool.close()
            raise
        port = self.ingress.endpoint.rsplit(":", 1)[1]
        self.reply = Reply(f"tcp://{advertise_host or bind_host}:{port}", reply_relay)
        listed = PeersFile(peers_file) if peers_file else None
        self.entries = [
            PeerSet(
                p,
                entry_relay,
                resolver=resolver,
                peers_file=listed,
                hashed=dispatch == "hash" or p.role in hashed_roles,
                pin_s=timeout,
            )
            for p in entries
        ]
        self.relays = RelayCache(timeout=timeout, key=key, pools=shm_namespace(pipeline))
        self.uploads = Dedicated(timeout=timeout, key=key)
        self._thread = threading.Thread(target=self._control, name="disagg-client", daemon=True)
        self._thread.start()

    # ---- API -----------------------------------------------------------------------------------
    def submit_async(
        self, payload: Any, *, timeout: float | None = None, trace: str = ""
    ) -> Future[Any]:
        """Start a request; the future holds the exit role's payload (a dict by exit role when
        there are several; the list of chunks when the pipeline streams). `trace`: the
        W3C traceparent of the caller's span, carried to every role."""
        return self._start(payload, timeout, trace=trace)[1].future

    def start(
        self,
        payload: Any,
        *,
        timeout: float | None = None,
        on_chunk: Callable[[Any], None] | None = None,
        trace: str = "",
    ) -> tuple[str, Future[Any]]:
        """Start a request; its id (for `cancel`) and its future. With `on_chunk`, each
        chunk of a stream goes to it, in order, on the thread that receives the client's
        messages (it must not block), and the future's result then holds `Streamed(count)`
        instead of the chunks. The future is completed on that thread too."""
        rid, pending = self._start(payload, timeout, on_chunk, trace=trace)
        return rid, pending.future

    def reserve(self, manifest: Manifest, *, timeout: float | None = None) -> Reserved | None:
        """A slot for a payload laid out as `manifest`, in the pool of the entry role that
        would get the request, waiting up to `timeout` s for room there; None when the
        payload cannot be written in place (not exactly one entry role, or its relay is not
        shm): submit it instead. RequestFailed when no slot could be had."""
        if len(self.entries) != 1 or self.entries[0].kind != "shm":
            return None
        if self._closed.is_set():
            raise RequestFailed("client is closed")
        peers = self.entries[0]
        seconds = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + seconds
        rid = uuid.uuid4().hex

        def reserve(relay: Any, remaining: float) -> Grant:
            if not isinstance(relay, ShmSender):
                raise RelayError(f"relay to {relay.endpoint} cannot be written in place")
            return relay.reserve(rid, manifest, timeout=remaining)

        try:
            endpoint = peers.endpoint_for(rid, self.relays.viewer(peers.kind))
            relay, grant = self.relays.on_relay(
                peers.kind,
                endpoint,
                reserve,
                timeout=seconds,
                repick=lambda: peers.reroute(rid, self.relays.viewer(peers.kind)),
                role=peers.peer.role,
                lost=peers.lost,
            )
        except (RelayError, OSError) as exc:
            peers.unpin(rid)
            raise _failed(f"request {rid}: no slot in the entry role's pool", exc) from None
        assert isinstance(relay, ShmSender)
        return Reserved(self, peers, relay, grant, deadline)

    def upload(
        self,
        manifest: Manifest,
        data: memoryview,
        starts: Sequence[int],
        *,
        timeout: float | None = None,
        on_done: Callable[[], None],
        trace: str = "",
    ) -> Upload | None:
        """Stream a payload laid out as `manifest` to the entry role over tcp while its
        bytes arrive in `data` (tensor i at `starts[i]`; see `Upload`), reserving its slot
        within `timeout` s; None when there is not exactly one entry role, reached over
        tcp (then `on_done` is not called: submit the payload instead)."""
        if len(self.entries) != 1 or self.entries[0].kind != "tcp" or not manifest.nbytes:
            return None
        if self._closed.is_set():
            raise RequestFailed("client is closed")
        seconds = self.timeout if timeout is None else timeout
        return Upload(self, self.entries[0], manifest, data, starts, seconds, on_done, trace)

    def submit(self, payload: Any, *, timeout: float | None = None) -> Any:
        future = self.submit_async(payload, timeout=timeout)
        return future.result()

    def stream(self, payload: Any, *, timeout: float | None = None) -> Iterator[Any]:
        """Chunks of a streaming pipeline, in order, as they arrive."""
        rid, pending = self._start(payload, timeout)
        while True:
            remaining = pending.deadline - time.monotonic()
            try:
                item = pending.chunks.get(timeout=max(0.0, remaining) + 0.5)
            except queue.Empty:
                self._finish(rid, exc=self._timeout_error(rid))
                item = None
            if item is _END:
                pending.future.result()  # raise the failure, if the stream ended by one
                return
            if item is not None:
                yield item

    def cancel(self, rid: str, reason: str = "cancelled by the client") -> None:
        self._finish(rid, exc=RequestFailed(f"request {rid} {reason}"))

    def fail_all(self, message: str, *, role: str = "") -> int:
        """Fail every request in flight (e.g. a role process died)."""
        with self._lock:
            rids = list(self._pending)
        for rid in rids:
            self._finish(rid, exc=RequestFailed(f"request {rid} failed: {message}", role=role))
        return len(rids)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self.fail_all("client closed")
        self._closed.set()
        self._thread.join(timeout=5)
        self.relays.close()
        self.uploads.close()
        self.ingress.close()
        self.pool.close()

    # ---- internals -----------------------------------------------------------------------------
    def _start(
        self,
        payload: Any,
        timeout: float | None,
        on_chunk: Callable[[Any], None] | None = None,
        *,
        trace: str = "",
    ) -> tuple[str, _Pending]:
        if self._closed.is_set():
            raise RequestFailed("client is closed")
        seconds = self.timeout if timeout is None else timeout
        rid = uuid.uuid4().hex
        pending = _Pending(self.exits, time.monotonic() + seconds, on_chunk=on_chunk)
        with self._lock:
            self._pending[rid] = pending
        meta = Meta(rid, "data", "client", time.time() + seconds, self.reply, trace=trace)
        try:
            for peers in self.entries:
                self._send(peers, meta, payload)
        except (RelayError, OSError) as exc:
            self._finish(rid, exc=_failed(f"request {rid} could not be submitted", exc))
        except BaseException:  # e.g. a payload the codec refuses: the caller gets the error
            self._finish(rid, exc=RequestFailed(f"request {rid} was not submitted"))
            raise
        return rid, pending

    def _send(self, peers: PeerSet, meta: Meta, payload: Any) -> None:
        new = meta.kind != "abort"  # an abort follows its request; it never chooses
        endpoint = peers.endpoint_for(meta.rid, self.relays.viewer(peers.kind), new=new)
        self.relays.send(
            peers.kind,
            endpoint,
            payload,
            request_id=meta.rid,
            timeout=self.timeout,
            meta=meta.to_json(),
            repick=lambda: peers.reroute(meta.rid, self.relays.viewer(peers.kind), new=new),
            role=peers.peer.role,
            lost=peers.lost,
        )

    def _later_abort(self, rid: str) -> None:
        """Leave the abort (network sends) to the control thread: `_finish` runs on the
        receiving thread too, which must never wait on a peer. Dropped when the backlog is
        full (the request's deadline then frees what the roles hold of it)."""
        try:
            self._aborts.put_nowait(rid)
        except queue.Full:
            log.warning("client: abort backlog full; abort of %s dropped", rid)

    def _abort(self, rid: str) -> None:
        meta = Meta(rid, "abort", "client", time.time() + 5, self.reply)
        for peers in self.entries:
            # an entry role that is gone holds nothing of the request any more
            with contextlib.suppress(RelayError, OSError):
                self._send(peers, meta, None)

    def _timeout_error(self, rid: str) -> RequestTimeout:
        return RequestTimeout(f"request {rid} timed out after {self.timeout} s")

    def _finish(self, rid: str, *, result: Any = None, exc: BaseException | None = None) -> None:
        with self._lock:
            pending = self._pending.pop(rid, None)
        if pending is None:
            return
        if exc is not None:
            self._later_abort(rid)  # let every role drop what it holds of the request
            pending.future.set_exception(exc)
        else:
            pending.future.set_result(result)
        for peers in self.entries:
            peers.unpin(rid)
        pending.chunks.put(_END)

    def _control(self) -> None:
        """Expire requests past their deadline and send the aborts `_finish` left; until
        closed, then the aborts still queued (those of `close`'s `fail_all`)."""
        while not self._closed.is_set() or not self._aborts.empty():
            try:
                if not self._closed.is_set():
                    self._expire()
                rid = self._aborts.get(timeout=EXPIRE_EVERY_S)
            except queue.Empty:
                continue
            try:
                self._abort(rid)
            except Exception:  # the loop must outlive any one abort's failure
                log.exception("client: abort of %s failed", rid)

    def _on_delivered(self, msg: Message) -> None:
        """On the ingress's I/O thread: copy the payload out of the pool (the slot is freed
        at once), then hand it to its request (nothing here waits on a peer)."""
        try:
            meta = envelope.parse(msg.meta)
            payload = detach(msg.payload)
        except envelope.EnvelopeError:
            return
        finally:
            msg.release()
        self._on_message(meta, payload)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [rid for rid, p in self._pending.items() if p.deadline < now]
        for rid in late:
            self._finish(rid, exc=self._timeout_error(rid))

    def _on_message(self, meta: Meta, payload: Any) -> None:
        with self._lock:
            pending = self._pending.get(meta.rid)
        if pending is None:
            return  # finished already (timed out, failed, cancelled)
        if meta.kind == "error":
            error = dict(meta.error)
            where = f"role {error.get('role', meta.source)} (replica {error.get('replica', '?')})"
            message = f"request {meta.rid} failed at {where}: {error.get('message', '')}"
            kind = _FAILURES.get(error.get("reason", ""), RequestFailed)
            self._finish(meta.rid, exc=kind(message, role=meta.source, error=error))
        elif meta.kind == "data":
            pending.results[meta.source] = payload
        elif meta.kind == "chunk":
            expected = pending.next_seq.get(meta.source, 0)
            if meta.seq != expected:
                self._finish(
                    meta.rid,
                    exc=RequestFailed(
                        f"stream from {meta.source}: chunk {meta.seq}, expected {expected}"
                    ),
                )
                return
            pending.next_seq[meta.source] = expected + 1
            if pending.on_chunk is not None:
                pending.on_chunk(payload)
                return
            pending.streamed.setdefault(meta.source, []).append(payload)
            pending.chunks.put(payload)
        elif meta.kind == "end":
            got = pending.next_seq.get(meta.source, 0)
            if meta.count != got:
                self._finish(
                    meta.rid,
                    exc=RequestFailed(f"stream from {meta.source}: {got} of {meta.count} chunks"),
                )
                return
            pending.ended.add(meta.source)
            if pending.on_chunk is not None:
                pending.results[meta.source] = Streamed(got)
            pending.streamed.setdefault(meta.source, [])  # a stream of no chunks is []
        if set(pending.results) | pending.ended >= pending.exits:
            outputs: dict[str, Any] = {**pending.streamed, **pending.results}
            result = outputs if len(self.exits) > 1 else next(iter(outputs.values()), None)
            self._finish(meta.rid, result=result)
