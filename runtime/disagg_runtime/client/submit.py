"""`Client`: submit payloads to a pipeline's entry roles; get results or chunk streams back.

The client owns a small receive pool and an `Ingress`: exit roles send results (and any
role sends errors) straight to it, named in every request's envelope. Results are copied
out of the pool before the slot is released, so they stay valid for the caller; how a
request's messages add up to its result is client/pending.py's, and requests whose
payload the caller writes into the entry role's pool itself client/direct.py's.

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
from typing import Any

from disagg_core.contract import Peer
from disagg_runtime.client.direct import Reserved, Upload
from disagg_runtime.client.errors import RequestFailed, RequestTimeout, failed
from disagg_runtime.client.moves import Moves
from disagg_runtime.client.pending import END, Pending, detach
from disagg_runtime.memory.pool import Pool, shm_name, shm_namespace
from disagg_runtime.relay import Ingress, Message, RelayError, ShmSender
from disagg_runtime.relay.auth import check_key, key_from_env
from disagg_runtime.relay.sender import Grant
from disagg_runtime.routing import failover, migration
from disagg_runtime.routing.peers import PeerSet, PeersFile, Resolver, resolve_dns
from disagg_runtime.routing.relays import Dedicated, RelayCache
from disagg_runtime.wire import envelope
from disagg_runtime.wire.envelope import Meta, Reply
from disagg_runtime.wire.manifest import Manifest

EXPIRE_EVERY_S = 0.1  # how often requests past their deadline are failed
ABORT_BACKLOG = 4096  # aborts waiting for the control thread
log = logging.getLogger(__name__)


class Client:
    """Requests to a pipeline's entry roles, their replies at the client's own ingress."""

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
        migrate: migration.Policy | None = None,
    ) -> None:
        """`dispatch` "load" sends each request to the entry replica whose advertised load
        is lowest of two (routing/dispatch.py), "hash" by its id; entry roles in `hashed_roles`
        (those that join inputs) are always chosen by hash. `migrate`: how requests that a
        role reports lost move to a live replica (client/moves.py; the default policy when
        None, `Policy(max_attempts=0)` never)."""
        key = check_key(key) if key is not None else key_from_env()
        self.key = key  # the pipeline's peer key (the gateway's readiness probe proves it)
        self.exits = frozenset(exits)
        self.timeout = timeout
        self.reply_relay = reply_relay
        if reply_relay == "shm":
            self.pool = Pool.create(pool_size, device="shm", name=shm_name(pipeline, "client"))
        else:
            self.pool = Pool.create(pool_size, device="cpu")
        self._pending: dict[str, Pending] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._aborts: queue.Queue[str] = queue.Queue(ABORT_BACKLOG)
        self.moves = Moves(self, migrate or migration.Policy())
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
            relay, grant = failover.on_relay(
                self.relays,
                peers.kind,
                endpoint,
                reserve,
                timeout=seconds,
                repick=lambda: peers.reroute(rid, self.relays.viewer(peers.kind)),
                role=peers.peer.role,
                lost=peers.unanswered,
            )
        except (RelayError, OSError) as exc:
            peers.unpin(rid)
            raise failed(f"request {rid}: no slot in the entry role's pool", exc) from None
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
            if item is END:
                pending.future.result()  # raise the failure, if the stream ended by one
                return
            if item is not None:
                yield item

    def cancel(self, rid: str, reason: str = "cancelled by the client") -> None:
        self._finish(self.moves.current(rid), exc=RequestFailed(f"request {rid} {reason}"))

    @property
    def migrations(self) -> int:
        """Requests moved to a live replica so far (client/moves.py)."""
        return self.moves.count

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
    ) -> tuple[str, Pending]:
        if self._closed.is_set():
            raise RequestFailed("client is closed")
        seconds = self.timeout if timeout is None else timeout
        rid = uuid.uuid4().hex
        pending = Pending(
            self.exits,
            time.monotonic() + seconds,
            on_chunk=on_chunk,
            payload=payload,
            kept=self.moves.policy.max_attempts > 0,
            first=rid,
        )
        self._track(rid, pending)
        log.debug("client: request %s submitted", rid)
        meta = Meta(rid, "data", "client", time.time() + seconds, self.reply, trace=trace)
        try:
            for peers in self.entries:
                self._send(peers, meta, payload)
        except (RelayError, OSError) as exc:
            self._finish(rid, exc=failed(f"request {rid} could not be submitted", exc))
        except BaseException:  # e.g. a payload the codec refuses: the caller gets the error
            self._finish(rid, exc=RequestFailed(f"request {rid} was not submitted"))
            raise
        return rid, pending

    def _send(self, peers: PeerSet, meta: Meta, payload: Any) -> None:
        new = meta.kind != "abort"  # an abort follows its request; it never chooses
        endpoint = peers.endpoint_for(meta.rid, self.relays.viewer(peers.kind), new=new)
        relay, _ = failover.send(
            self.relays,
            peers.kind,
            endpoint,
            payload,
            request_id=meta.rid,
            timeout=self.timeout,
            meta=meta.to_json(),
            repick=lambda: peers.reroute(meta.rid, self.relays.viewer(peers.kind), new=new),
            role=peers.peer.role,
            lost=peers.unanswered,
            gone=self.moves.entry_gone,
        )
        if new:
            self.moves.sent(peers, meta, relay.endpoint)

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
        """Named by the id the caller knows; a request that moved names its attempts too."""
        with self._lock:
            pending = self._pending.get(rid)
        if pending is None or not pending.moved:
            return RequestTimeout(f"request {rid} timed out after {self.timeout} s")
        return RequestTimeout(
            f"request {pending.first} timed out after {self.timeout} s; it moved "
            f"{pending.moved} times, its last attempt {rid}"
        )

    def _track(self, rid: str, pending: Pending) -> None:
        """`rid` is in flight: its replies go to `pending` (client/pending.py `Requests`)."""
        with self._lock:
            self._pending[rid] = pending

    def _finish(self, rid: str, *, result: Any = None, exc: BaseException | None = None) -> None:
        with self._lock:
            pending = self._pending.pop(rid, None)
            if pending is not None:
                self.moves.finished(rid, pending)
        if pending is None:
            return
        log.debug("client: request %s ended: %s", rid, "ok" if exc is None else exc)
        if exc is not None:
            self._later_abort(rid)  # let every role drop what it holds of the request
            pending.future.set_exception(exc)
        else:
            pending.future.set_result(result)
        for peers in self.entries:
            peers.unpin(rid)
        pending.chunks.put(END)

    def _control(self) -> None:
        """Expire requests past their deadline and send the aborts `_finish` left; until
        closed, then the aborts still queued (those of `close`'s `fail_all`)."""
        while not self._closed.is_set() or not self._aborts.empty():
            try:
                if not self._closed.is_set():
                    self._expire()
                    self.moves.run()
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
        except envelope.EnvelopeError as exc:  # said: a report dropped here is not moved
            log.warning("client: a malformed reply dropped (request %s): %s", msg.request_id, exc)
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
        moving = meta.kind == "error" and meta.error.get("reason") in migration.MIGRATE_REASONS
        if pending is None:  # finished already (timed out, failed, cancelled), or moved
            if moving:  # (a replica's loss reports all that went there: most are done)
                log.debug("client: request %s: a report of it came after it ended", meta.rid)
            return
        if moving:
            self.moves.report(meta.rid, dict(meta.error))  # (resending: not on this thread)
            return
        outcome = pending.take(meta, payload)
        if outcome is not None:
            self._finish(meta.rid, result=outcome.result, exc=outcome.failure)
