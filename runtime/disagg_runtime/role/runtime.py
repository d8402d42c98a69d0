"""One role process (`disagg role`): receive -> handler -> send on, with bounded concurrency.

    upstream roles ──relay──> Ingress (receive pool) ──dispatcher──> per-request work queues
                                                                         │  N workers
    client reply <── exit role output ──  handler(payload) ──> downstream roles / ref targets

- Messages of one request are handled one at a time, in arrival order (stream chunks stay
  ordered); different requests run concurrently on `concurrency` workers. What waits for a
  worker keeps its pool slot: that is the occupancy the autoscaler reads.
- Fan-in roles and consumers of tensor references join a request's inputs first; a join
  that is not complete by the request's deadline fails the request and frees its slots.
- A handler that raises fails only its request: the client gets the role, replica and
  exception, and downstream roles get an `abort` so their joins let go at once.
- The handler (handler.py: a function, or a class with setup/batch/close) is set up in
  `start()` before the role reports live or ready; `roles[].batching` sends requests through
  a `Batcher` whose timeouts and aborts still apply to each request alone.
- SIGTERM: readiness drops, in-flight work drains for the grace period, then the handler is
  closed and every slot, socket and the shared-memory pool is released. A role found
  through DNS (no peers file: a pod) keeps receiving for at least one re-resolution period
  (`peers.RESOLVE_EVERY` + 1 s) first: upstream roles still send to it until they
  re-resolve its Service name, and what they send to a closed ingress would be lost until
  the request's deadline. Then it says goodbye to every sender (relay `goodbye`: send
  nothing more here; one whose view of the replicas lags picks another) and serves what
  crossed that on the wire before it closes its ingress.
- Trust (relay/auth.py): the ingress serves only senders that prove the pipeline's peer
  key, and every relay this role opens (downstream or a client's reply endpoint) checks
  the same of the other end. Deadlines are clamped on receipt to the request timeout, so
  no sender can hold a worker longer. Requests waiting for a worker are bounded
  (`max_queue`): beyond it a new request fails at once as `overloaded`.
- Dispatch (routing/dispatch.py): the ingress advertises this role's load (requests waiting for a
  worker, being handled, workers, free pool bytes, draining) to its senders; this role
  sends each new request to the downstream replica its load reports favour, and the
  rest of the request after it. A downstream role that joins inputs (fan-in, tensor
  references) is chosen by hash, so that every sender of a request meets there.
"""

from __future__ import annotations

import collections
import inspect
import logging
import queue
import resource
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from disagg_core.compat import Compat, default_token
from disagg_core.contract import RoleConfig
from disagg_runtime.memory.pool import (
    Pool,
    PoolError,
    reclaim_stale,
    shm_name,
    shm_namespace,
    shm_prefix,
)
from disagg_runtime.relay import (
    Ingress,
    Message,
    RelayError,
)
from disagg_runtime.relay.auth import PeerKeyError, read_key
from disagg_runtime.relay.select import relay_kind
from disagg_runtime.role.batching import BatchCancelled, BatchTimeout
from disagg_runtime.role.handler import Handler as LoadedHandler
from disagg_runtime.role.handler import HandlerError, Runner, SetupContext, default_device, load
from disagg_runtime.role.health import HealthServer
from disagg_runtime.role.metrics import RoleMetrics, RoleSample
from disagg_runtime.role.spans import RoleSpans
from disagg_runtime.routing import dispatch, forward
from disagg_runtime.routing.forward import ReplyFailed
from disagg_runtime.routing.peers import (
    RESOLVE_EVERY,
    PeerSet,
    PeersFile,
    RelayCache,
    Resolver,
    resolve_dns,
)
from disagg_runtime.tracing import open_tracer
from disagg_runtime.wire import envelope
from disagg_runtime.wire.envelope import Meta

log = logging.getLogger(__name__)
Handler = Callable[[Any], Any]  # a function handler; classes are loaded by name (handler.py)
ABORT_MEMORY_S = 120.0
QUEUE_PER_WORKER = 16  # requests that may wait for each worker before new ones are refused
PROBES_PER_CHECK = 4  # downstream replicas asked their revision per readiness check
PROBE_S = 1.0  # how long asking one may take
CONTROL_BACKLOG = 4096  # aborts and refusals waiting to be sent on; more are dropped
LINGER_QUIET_S = 0.3  # after its goodbye a role serves until nothing came for this long
LINGER_MAX_S = 3.0  # ... or at most this long


@dataclass
class _Join:
    """Inputs of one request gathered before the handler runs (fan-in, tensor refs)."""

    meta: Meta
    inputs: dict[str, Any] = field(default_factory=dict)
    refs: dict[str, Any] = field(default_factory=dict)
    messages: list[Message] = field(default_factory=list)


class RoleRuntime:
    """A running role. `start()` binds and serves; `stop()` drains and releases."""

    def __init__(
        self,
        config: RoleConfig,
        *,
        handler: Handler | LoadedHandler | None = None,
        resolver: Resolver = resolve_dns,
        grace_s: float = 30.0,
        max_queue: int | None = None,
        max_relays: int = 128,
    ) -> None:
        self.config = config
        self.name = config.role
        self.me = config.me
        self.key = read_key(config.peer_key_file)  # no key, no role: there is no default
        if handler is None:
            handler = load(config.handler)
        elif not isinstance(handler, LoadedHandler):
            handler = LoadedHandler(handler)
        self.handler = handler
        self.grace_s = grace_s
        self.max_queue = max_queue or QUEUE_PER_WORKER * config.concurrency
        # relay choices first: one that cannot work fails start-up before memory is taken
        peers_file = PeersFile(config.peers_file) if config.peers_file else None
        self.compat = Compat(
            config.compat or default_token(config.handler, None), config.compatible_with
        )
        self.peers = {
            p.role: PeerSet(
                p,
                relay_kind(config, p.role, p.relay),
                resolver=resolver,
                peers_file=peers_file,
                # inputs that meet at one replica: only a hash has every sender agree on it
                hashed=config.dispatch == "hash" or config.topology.roles[p.role].joins,
                pin_s=config.request_timeout,
                compat=self.compat,
            )
            for p in config.downstream
        }
        # the ingress hands messages to _on_message from its first one: state comes first
        self._cond = threading.Condition()
        self._work: dict[str, collections.deque[tuple[Meta, Any, Message]]] = {}
        self._runnable: collections.deque[str] = collections.deque()
        self._active: set[str] = set()
        self._joins: dict[str, _Join] = {}
        self._seq: dict[str, int] = collections.defaultdict(int)
        self._stream_started: dict[str, float] = {}
        self._aborted: dict[str, float] = {}
        self._typical = config.pool.min_block
        self._service_s = 0.0  # moving average of handler seconds (dispatch.Load.service_s)
        self._started = False
        self._stopping = threading.Event()
        self._draining = threading.Event()
        self._leaving = threading.Event()  # drained: requests waiting for a partner give up
        self._threads: list[threading.Thread] = []
        # aborts to pass on, requests to refuse as overloaded: network sends, off the I/O thread
        self._control: queue.Queue[tuple[str, Meta]] = queue.Queue(CONTROL_BACKLOG)
        self.metrics = RoleMetrics(
            pipeline=config.pipeline, role=config.role, replica=config.replica, sample=self._sample
        )
        resource = {"disagg.pipeline": config.pipeline, "disagg.role": config.role}
        tracer = open_tracer(f"{config.pipeline}/{config.role}", resource=resource)
        self.spans = RoleSpans(tracer, config.role, config.replica)  # spans.py
        self.runner = Runner(
            handler,
            max_batch_size=config.max_batch_size,
            max_batch_wait_ms=config.max_batch_wait_ms,
            on_call=self.metrics.handler_call,
        )
        device = "shm" if config.pool.device == "cpu" else config.pool.device
        me = f"{config.role}-{config.replica}"
        # a dead incarnation's pool (SIGKILL, OOM kill) stays in the pod's /dev/shm: free it
        reclaim_stale(shm_prefix(config.pipeline, me), why="a previous incarnation's, now dead")
        self.pool = Pool.create(
            config.pool.size,
            device=device,
            min_block=config.pool.min_block,
            name=shm_name(config.pipeline, me),
        )
        try:
            self.ingress = Ingress(
                f"tcp://{config.bind_host}:{config.ingress_port}",
                self.pool,
                lease_s=config.request_timeout,
                lane_port=config.lane_port,
                on_message=self._on_message,
                key=self.key,
                load=self._load,
                compat=self.compat,
                role=config.role,
            )
        except BaseException:
            self.pool.close()
            raise
        self.relays = RelayCache(
            timeout=config.request_timeout,
            key=self.key,
            pools=shm_namespace(config.pipeline),
            max_relays=max_relays,
        )
        self.forward = forward.Forwarder(
            self.name,
            config.replica,
            self.peers,
            self.relays,
            leaving=self._leaving,
            edge_sent=self.metrics.edge_sent,
        )
        self.health = HealthServer(
            self.metrics,
            host=config.bind_host,
            port=config.metrics_port,
            live=self._live,
            ready=self._ready,
        )

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Serve /healthz (503 until set up), set the handler up, then start the workers.
        A failing setup raises HandlerError; `stop()` still releases everything."""
        self.health.start()
        ctx = SetupContext(
            role=self.name,
            replica=self.config.replica,
            device=default_device(),
            args=self.config.handler_args,
            log=logging.getLogger(f"disagg.handler.{self.name}"),
        )
        seconds = self.runner.setup(ctx)
        self.metrics.setup_seconds(seconds)
        log.info("role %s/%d: handler set up in %.2f s", self.name, self.config.replica, seconds)
        for name, target in [("control", self._control_loop)] + [
            (f"worker-{i}", self._worker) for i in range(self.config.concurrency)
        ]:
            thread = threading.Thread(target=target, name=f"disagg-{self.name}-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        self._started = True
        log.info("role %s/%d serving on %s", self.name, self.config.replica, self.ingress.endpoint)

    def idle(self) -> bool:
        """Nothing held: no work, no joins, nothing queued or reserved at the ingress."""
        with self._cond:
            busy = bool(self._work or self._active or self._joins)
        busy = busy or not self._control.empty()
        stats = self.ingress.stats()
        return not busy and stats.queued == 0 and stats.pending_reservations == 0

    def stop(self, grace_s: float | None = None) -> None:
        """Drain (stop being ready, finish what is here) up to `grace_s`, then release all.
        Without `grace_s` and without a peers file, stay at least until upstream roles have
        re-resolved this role's name (see the module docstring)."""
        self._draining.set()
        started = time.monotonic()
        deadline = started + (self.grace_s if grace_s is None else grace_s)
        settle = RESOLVE_EVERY + 1.0 if grace_s is None and not self.config.peers_file else 0.0
        quiet_since: float | None = None
        # the goodbye's linger comes out of the grace period, not after it (then SIGKILL)
        drain_until = deadline - min(LINGER_MAX_S, (deadline - started) / 10)
        while time.monotonic() < drain_until:  # idle for 0.2 s: nothing is still on its way
            if time.monotonic() - started < settle or not self.idle():
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= 0.2:
                break
            time.sleep(0.05)
        self._leaving.set()  # what still waits for a partner fails now, telling its client
        if self._started and (grace_s is None or grace_s > 0):
            self._goodbye(deadline)
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        self.runner.stop_batching()  # workers waiting for a batch let go
        for thread in self._threads:
            thread.join(timeout=5)
        if self._started:
            try:
                self.runner.close()
            except Exception:
                log.exception("role %s: handler close() failed", self.name)
        self.ingress.close()  # no more deliveries: what is queued now is all there is
        with self._cond:
            leftovers = [m for q in self._work.values() for _, _, m in q]
            leftovers += [m for j in self._joins.values() for m in j.messages]
            self._work.clear()
            self._joins.clear()
        for msg in leftovers:
            msg.release()
        self.relays.close()
        self.health.close()
        self.pool.close()
        self.spans.tracer.shutdown()
        if self.config.metrics_dump:
            with open(self.config.metrics_dump, "wb") as f:
                f.write(self.metrics.render())

    def _goodbye(self, deadline: float) -> None:
        """Tell every sender this replica is going (relay `goodbye`: they send nothing more
        here), serve what crossed that on the wire until nothing has come for a moment,
        then close the ingress and finish what it handed over. Without it, a message from
        a sender that still routed here (its DNS view lagging: inline payloads have no
        receipt) was taken by the socket and lost with the process."""
        said = time.monotonic()
        before = self.ingress.stats().delivered
        self.ingress.goodbye(f"role {self.name} replica {self.config.replica} is shutting down")
        linger_until = min(said + LINGER_MAX_S, max(deadline, said + LINGER_QUIET_S))
        while time.monotonic() < linger_until:
            now = time.monotonic()
            if min(now - said, now - self.ingress.last_message_at) >= LINGER_QUIET_S:
                break
            time.sleep(0.05)
        crossed = self.ingress.stats().delivered - before
        self.ingress.close()  # nothing more is delivered: what was is all there is to do
        log.info(
            "role %s/%d: said goodbye to its senders; %d messages crossed it and are served",
            self.name,
            self.config.replica,
            crossed,
        )
        finish_by = max(deadline, time.monotonic() + LINGER_QUIET_S)
        while time.monotonic() < finish_by:
            with self._cond:
                if not (self._work or self._active or self._joins):
                    break
            time.sleep(0.05)

    def run(self) -> None:
        """Serve until SIGTERM/SIGINT, then drain and exit (what a pod runs)."""
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        try:
            self.start()
        except BaseException:
            self.stop(grace_s=0)
            raise
        while not stop.wait(0.5):
            pass
        log.info("role %s/%d draining", self.name, self.config.replica)
        self.stop()

    def _live(self) -> bool:
        """False while the handler sets up (the startup probe waits), then the threads."""
        alive = self._started and all(t.is_alive() for t in self._threads)
        return alive or self._stopping.is_set()

    def _ready(self) -> bool:
        """Serving, not draining, and able to send on (a role out of sockets, or whose
        sends all fail, is taken out of its Service rather than failing silently)."""
        trouble = self.relays.trouble() or self._pairing_trouble()
        if trouble is not None:
            log.warning("role %s not ready: %s", self.name, trouble)
        return self._started and not self._draining.is_set() and trouble is None

    def _pairing_trouble(self) -> str | None:
        """Ask replicas of downstream roles not asked lately which revision they run
        (a cached relay's welcome says it); a role none of whose replicas of some downstream
        role pairs with it is not ready, so upstream sends to ones that have a partner."""
        for peers in self.peers.values():
            if not peers.pairing:
                continue
            for endpoint in peers.unchecked()[:PROBES_PER_CHECK]:
                try:
                    relay = self.relays.get(
                        peers.kind, endpoint, timeout=PROBE_S, role=peers.peer.role
                    )
                except RelayError:
                    continue
                if not peers.admit(endpoint, relay.peer_compat):
                    self.relays.drop(peers.kind, endpoint)  # a later pod may reuse the address
            trouble = peers.trouble()
            if trouble is not None:
                return trouble
        return None

    def _sample(self) -> RoleSample:
        stats = self.pool.stats()
        ingress = self.ingress.stats()
        with self._cond:
            queued = sum(len(q) for q in self._work.values())
            inflight = len(self._active)
        return RoleSample(
            pool_used_bytes=stats.requested,  # payload bytes: the scaling signal
            pool_total_bytes=stats.total,
            pool_free_slots=self.pool.allocator.free_slots(self._typical),
            inflight=inflight,
            queue_depth=queued + ingress.queued,
            lanes=ingress.lanes,
            pool_fragmentation_bytes=stats.used - stats.requested,
            inline_used_bytes=ingress.inline_used,
            inline_budget_bytes=ingress.inline_budget,
            peer_rejected=ingress.refused + self.relays.refused,
            overloaded=ingress.overloaded,
        )

    def _load(self) -> dispatch.Load:
        """What the ingress advertises (on its I/O thread, per grant and ack: cheap reads)."""
        with self._cond:
            queued = len(self._runnable)
            active = len(self._active)
        capacity = self.pool.allocator.capacity
        return dispatch.Load(
            queued=queued,
            active=active,
            workers=self.config.concurrency,
            free_bytes=max(0, capacity - self.pool.allocator.stats().used),
            pool_bytes=capacity,
            service_s=self._service_s,
            draining=self._draining.is_set(),
        )

    # ---- receiving ---------------------------------------------------------------------------
    def _on_message(self, msg: Message) -> None:
        """Runs on the ingress's I/O thread: route the message to its request's queue and
        return (nothing here blocks; passing aborts on is left to the control thread)."""
        try:
            self._accept(msg)
        except Exception:
            log.exception("role %s: error accepting a message", self.name)
            msg.release()

    def _control_loop(self) -> None:
        """Expire joins that waited too long; pass aborts downstream (network sends)."""
        while not self._stopping.is_set():
            try:
                self._expire_joins()
                action, meta = self._control.get(timeout=0.1)
            except queue.Empty:
                continue
            except Exception:  # the loop must outlive any one request's failure
                log.exception("role %s: error while expiring requests", self.name)
                continue
            try:
                if action == "abort":
                    self._pass_abort(meta)
                else:
                    self._fail(
                        meta,
                        "overloaded",
                        f"role {self.name} is overloaded: {self.max_queue} requests are "
                        "waiting for a worker; try again later",
                    )
            except Exception:
                log.exception("role %s: error on %s of %s", self.name, action, meta.rid)

    def _later(self, action: str, meta: Meta) -> None:
        """Leave a network send to the control thread; dropped when its backlog is full
        (an abort is then not passed on: the request's deadline frees its slots)."""
        try:
            self._control.put_nowait((action, meta))
        except queue.Full:
            log.warning("role %s: backlog full; %s of %s dropped", self.name, action, meta.rid)

    def _accept(self, msg: Message) -> None:
        payload = msg.payload
        try:
            meta = envelope.parse(msg.meta).clamped(self.config.request_timeout)
        except envelope.EnvelopeError as exc:
            log.warning("role %s dropped a malformed message: %s", self.name, exc)
            msg.release()
            return
        if msg.slot is not None:
            self._typical = max(self.config.pool.min_block, msg.nbytes)
        self.metrics.edge_received(f"{meta.source}->{self.name}", msg.nbytes)
        if meta.kind == "abort":
            msg.release()
            if self._drop(meta):  # at once; telling downstream roles is a network send
                self._later("abort", meta)
            return
        if meta.rid in self._aborted:
            msg.release()
            return
        with self._cond:
            new = meta.rid not in self._work and meta.rid not in self._joins
            refuse = new and len(self._runnable) + len(self._joins) >= self.max_queue
            if not refuse:
                queue = self._work.setdefault(meta.rid, collections.deque())
                queue.append((meta, payload, msg))
                if meta.rid not in self._active and meta.rid not in self._runnable:
                    self._runnable.append(meta.rid)
                    self._cond.notify()
        if refuse:  # told at once (by the control thread), so the client can back off
            msg.release()
            self._later("overloaded", meta)

    def _worker(self) -> None:
        while True:
            with self._cond:
                while not self._runnable and not self._stopping.is_set():
                    self._cond.wait(0.5)
                if self._stopping.is_set():
                    return
                rid = self._runnable.popleft()
                self._active.add(rid)
                meta, payload, msg = self._work[rid].popleft()
            self.metrics.queue_wait(time.monotonic() - msg.received_at)
            try:
                self._handle(meta, payload, msg)
            except Exception:  # a bug here must not kill the worker
                log.exception("role %s: unexpected error on request %s", self.name, rid)
                msg.release()
            finally:
                with self._cond:
                    self._active.discard(rid)
                    if self._work.get(rid):
                        self._runnable.append(rid)
                        self._cond.notify()
                    else:
                        self._work.pop(rid, None)

    # ---- handling ----------------------------------------------------------------------------
    def _handle(self, meta: Meta, payload: Any, msg: Message) -> None:
        if meta.rid in self._aborted:
            msg.release()
            return
        if meta.expired:
            msg.release()
            self._fail(meta, "timeout", f"request timed out before role {self.name} handled it")
            return
        if meta.kind == "end":  # the upstream stream is complete, and so is ours
            msg.release()
            try:
                self._emit(meta, "end", None)
            except RelayError as exc:
                message = f"role {self.name} could not send on: {exc}"
                self._fail(meta, "transport", message, reply_failed=isinstance(exc, ReplyFailed))
                return
            self.metrics.request_done(
                max(0.0, time.time() - (meta.deadline - self.config.request_timeout))
            )
            return
        joins = self.me.joins
        if meta.kind == "chunk":
            if joins:
                msg.release()
                self._fail(meta, "other", f"role {self.name} joins inputs and cannot take a stream")
                return
            self._run(meta, payload, [msg], streaming_input=True)
            return
        if meta.kind in ("data", "ref") and joins:
            self._join(meta, payload, msg)
            return
        if meta.kind == "data":
            self._run(meta, payload, [msg])
            return
        msg.release()
        log.warning("role %s: unexpected %s message for %s", self.name, meta.kind, meta.rid)

    def _join(self, meta: Meta, payload: Any, msg: Message) -> None:
        with self._cond:
            join = self._joins.setdefault(meta.rid, _Join(meta=meta))
            join.messages.append(msg)
            if meta.kind == "ref":
                join.refs[meta.path] = payload
            else:
                join.inputs[meta.source] = payload
                join.meta = meta
            complete = set(join.inputs) >= set(self.me.upstream) and set(join.refs) >= {
                r.path for r in self.me.refs_in
            }
            if complete:
                del self._joins[meta.rid]
        if not complete:
            return
        data: Any = join.inputs if len(self.me.upstream) > 1 else join.inputs[self.me.upstream[0]]
        for path, value in join.refs.items():
            data = envelope.insert(data, path, value)
        self._run(join.meta.with_(kind="data"), data, join.messages)

    def _run(
        self, meta: Meta, data: Any, messages: list[Message], *, streaming_input: bool = False
    ) -> None:
        """Call the handler and send its output on. A generator streams: each item is a
        chunk, then `end` — unless the input is itself a chunk of a stream, whose own `end`
        closes ours. A request counts as done here when its last output has left."""
        started = time.monotonic()
        if streaming_input:
            self._stream_started.setdefault(meta.rid, started)
        traced = self.spans.begin(meta, messages, started)  # None: not traced
        if traced is not None:  # what this role sends on hangs under its span
            meta = meta.with_(trace=traced.span.traceparent)
        try:
            result = self.runner.invoke(
                data,
                timeout=forward.remaining(meta),
                cancelled=lambda: meta.rid in self._aborted or self._stopping.is_set(),
            )
            if traced is not None and not inspect.isgenerator(result):
                traced.handled(time.monotonic())  # the sends below are spans of their own
            if inspect.isgenerator(result):
                for chunk in result:
                    if meta.rid in self._aborted:  # the client left: stop generating
                        result.close()
                        break
                    self._emit(meta, "chunk", chunk)
                if not streaming_input:
                    self._emit(meta, "end", None)
            else:
                self._emit(meta, "chunk" if streaming_input else "data", result)
        except RelayError as exc:
            message = f"role {self.name} could not send on: {exc}"
            self._fail(meta, "transport", message, reply_failed=isinstance(exc, ReplyFailed))
        except BatchTimeout as exc:
            self._fail(meta, "timeout", f"request timed out at role {self.name}: {exc}")
        except BatchCancelled as exc:
            if meta.rid not in self._aborted:
                self._fail(meta, "other", f"role {self.name}: {exc}")
        except Exception as exc:
            self._fail(meta, "handler", f"{type(exc).__name__}: {exc}", exc_type=type(exc).__name__)
        else:
            took = time.monotonic() - started
            if traced is not None:
                traced.handled(started + took)  # a stream: generating and sending
            self.metrics.handler_seconds(took)
            # recent seconds per call, advertised in the load (a plain float store)
            self._service_s = took if not self._service_s else 0.8 * self._service_s + 0.2 * took
            if not streaming_input:
                self.metrics.request_done(time.monotonic() - started)
        finally:
            if traced is not None:
                self.spans.end(traced)
            for msg in messages:
                msg.release()

    def _emit(self, meta: Meta, kind: str, payload: Any) -> None:
        """Send an output on: to the client from an exit role, else to every downstream role
        (tensor references split off first and sent straight to their consumer)."""
        if meta.rid in self._aborted:
            return
        if meta.expired:
            raise RelayError(f"request deadline passed at role {self.name}")
        if kind == "chunk":
            out = meta.with_(kind="chunk", source=self.name, seq=self._seq[meta.rid])
            self._seq[meta.rid] += 1
        elif kind == "end":
            out = meta.with_(kind="end", source=self.name, count=self._seq.pop(meta.rid, 0))
        else:
            out = meta.with_(kind="data", source=self.name)
        if self.me.exit:
            self._send(None, out, payload)
            return
        if kind == "data":
            for ref in self.me.refs_out:
                payload, value = envelope.extract(payload, ref.path)
                self._send(ref.target, out.with_(kind="ref", path=ref.path), value)
        for target in self.me.downstream:
            self._send(target, out, payload)

    def _send(self, target: str | None, meta: Meta, payload: Any) -> None:
        """One output to `target` (None: the request's reply endpoint); a traced request's
        hand-off is a span (spans.py)."""
        started = time.monotonic()
        if target is None:
            relay, nbytes = self.forward.send_reply(meta, payload)
        else:
            relay, nbytes = self.forward.send_to(target, meta, payload)
        if meta.trace:
            self.spans.sent(meta, target or "client", started, relay, nbytes)

    # ---- failure -----------------------------------------------------------------------------
    def _fail(
        self,
        meta: Meta,
        reason: str,
        message: str,
        *,
        exc_type: str = "",
        reply_failed: bool = False,
    ) -> None:
        """Tell the client, tell downstream roles to let go, count it."""
        log.warning("role %s: request %s failed: %s", self.name, meta.rid, message)
        self.metrics.request_failed(reason)
        if meta.trace:
            self.spans.failed(meta, reason, message)
        error = {
            "role": self.name,
            "replica": str(self.config.replica),
            "reason": reason,
            "type": exc_type,
            "message": message,
        }
        if not reply_failed:  # else its reply endpoint just failed: do not wait on it twice
            try:
                self.forward.send_reply(
                    meta.with_(kind="error", source=self.name, error=error), None
                )
            except Exception as exc:  # the client may be gone; the abort must still happen
                log.warning("role %s: could not report failure of %s: %s", self.name, meta.rid, exc)
        self._abort(meta.with_(kind="abort", source=self.name))

    def _abort(self, meta: Meta) -> None:
        """Drop everything of the request here and pass the abort on (once per request)."""
        if self._drop(meta):
            self._pass_abort(meta)

    def _drop(self, meta: Meta) -> bool:
        """Free what the request holds here; False when it was aborted already."""
        with self._cond:
            if meta.rid in self._aborted:
                return False
            self._aborted[meta.rid] = time.monotonic() + ABORT_MEMORY_S
            queued = [m for _, _, m in self._work.pop(meta.rid, ())]
            join = self._joins.pop(meta.rid, None)
            if meta.rid in self._runnable:
                self._runnable.remove(meta.rid)
            self._seq.pop(meta.rid, None)
            self._stream_started.pop(meta.rid, None)
        for msg in queued + (join.messages if join else []):
            msg.release()
        return True

    def _pass_abort(self, meta: Meta) -> None:
        targets = set(self.me.downstream) | {r.target for r in self.me.refs_out}
        for target in sorted(targets):
            try:
                self.forward.send_to(target, meta.with_(kind="abort", source=self.name), None)
            except (RelayError, OSError) as exc:
                log.debug("abort of %s not passed to %s: %s", meta.rid, target, exc)

    def _expire_joins(self) -> None:
        now = time.monotonic()
        with self._cond:
            expired = [j for j in self._joins.values() if j.meta.expired]
            for rid, until in list(self._aborted.items()):
                if until < now:
                    del self._aborted[rid]
        for join in expired:
            missing = sorted(set(self.me.upstream) - set(join.inputs))
            missing += [f"ref {r.path}" for r in self.me.refs_in if r.path not in join.refs]
            self._fail(
                join.meta,
                "timeout",
                f"request timed out at role {self.name} waiting for {', '.join(missing)}",
            )


def raise_open_files_limit() -> None:
    """Lift the soft limit on open files to the hard one: relays, lanes and ingress
    connections are bounded by the runtime itself, not by a 1024 default."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.info("open-files limit stays at %d: %s", soft, exc)


def main() -> int:
    """`disagg role`: read the contract from the environment and serve."""
    from disagg_core.contract import ContractError, from_environ

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    raise_open_files_limit()
    try:
        config = from_environ()
        role = RoleRuntime(config)
        role.run()
    except (ContractError, HandlerError, PoolError, PeerKeyError) as exc:
        log.error("cannot start role: %s", exc)
        return 2
    return 0
