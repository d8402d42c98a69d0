"""One role process (`disagg role`): receive -> handler -> send on, with bounded concurrency.

    upstream roles ──relay──> Ingress (receive pool) ──dispatcher──> per-request work queues
                                                                         │  N workers
    client reply <── exit role output ──  handler(payload) ──> downstream roles / ref targets

- The request table (requests.py: work queues, joins, aborts) holds what arrived; the
  workers' side (handling.py: handler, emit, fail) runs it on `concurrency` workers.
  What waits for a worker keeps its pool slot: that is the occupancy the autoscaler reads.
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
- The ingress's I/O thread never waits on a peer: refusals, reports of requests lost with
  a downstream replica, and aborts to pass on go to threads of their own (control.py).
- Dispatch (routing/dispatch.py): the ingress advertises this role's load (requests waiting for a
  worker, being handled, workers, free pool bytes, draining) to its senders; this role
  sends each new request to the downstream replica its load reports favour, and the
  rest of the request after it. A downstream role that joins inputs (fan-in, tensor
  references) is chosen by hash, so that every sender of a request meets there.
"""

from __future__ import annotations

import logging
import resource
import signal
import threading
import time
from collections.abc import Callable
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
)
from disagg_runtime.relay.auth import PeerKeyError, read_key
from disagg_runtime.relay.select import relay_kind
from disagg_runtime.role.control import Control
from disagg_runtime.role.handler import Handler as LoadedHandler
from disagg_runtime.role.handler import HandlerError, Runner, SetupContext, default_device, load
from disagg_runtime.role.handling import Handling
from disagg_runtime.role.health import HealthServer
from disagg_runtime.role.metrics import RoleMetrics, RoleSample
from disagg_runtime.role.pairing import PairingCheck
from disagg_runtime.role.requests import Requests
from disagg_runtime.role.spans import RoleSpans
from disagg_runtime.routing import dispatch, forward, inflight, migration
from disagg_runtime.routing.peers import RESOLVE_EVERY, PeerSet, PeersFile, Resolver, resolve_dns
from disagg_runtime.routing.relays import RelayCache
from disagg_runtime.tracing import open_tracer
from disagg_runtime.wire import envelope

log = logging.getLogger(__name__)
Handler = Callable[[Any], Any]  # a function handler; classes are loaded by name (handler.py)
QUEUE_PER_WORKER = 16  # requests that may wait for each worker before new ones are refused
LINGER_QUIET_S = 0.3  # after its goodbye a role serves until nothing came for this long
LINGER_MAX_S = 3.0  # ... or at most this long


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
        self.requests = Requests(self.max_queue)
        self._typical = config.pool.min_block
        self._started = False
        self._stopping = threading.Event()
        self._draining = threading.Event()
        self._leaving = threading.Event()  # drained: requests waiting for a partner give up
        self._threads: list[threading.Thread] = []
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
            draining=self._draining,
            on_lost=self._lost,
        )
        self.handling = Handling(
            config,
            self.requests,
            self.runner,
            self.metrics,
            self.forward,
            self.spans,
            stopping=self._stopping,
        )
        # refusals, lost reports and aborts: network sends, off the I/O thread (control.py)
        self.control = Control(
            self.name,
            self.handling,
            self.forward,
            stopping=self._stopping,
            max_queue=self.max_queue,
        )
        self.pairing = PairingCheck(self.name, self.peers, self.relays)  # pairing.py
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
        for name, target in self.control.loops() + [
            (f"worker-{i}", self._worker) for i in range(self.config.concurrency)
        ]:
            thread = threading.Thread(target=target, name=f"disagg-{self.name}-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        self._started = True
        self.pairing.start()
        log.info("role %s/%d serving on %s", self.name, self.config.replica, self.ingress.endpoint)

    def idle(self) -> bool:
        """Nothing held: no work, no joins, nothing queued or reserved at the ingress."""
        busy = self.requests.busy() or not self.control.empty()
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
        for meta in self.requests.hand_back():  # what nothing started goes to another replica
            self.handling.hand_on(
                meta,
                migration.HANDED_BACK,
                f"role {self.name} replica {self.config.replica} drained before it could "
                "start this request",
            )
        if self._started and (grace_s is None or grace_s > 0):
            self._goodbye(deadline)
        self._stopping.set()
        self.requests.wake_all()
        self.runner.stop_batching()  # workers waiting for a batch let go
        for thread in self._threads:
            thread.join(timeout=5)
        if self._started:
            try:
                self.runner.close()
            except Exception:
                log.exception("role %s: handler close() failed", self.name)
        self.pairing.close()
        self.ingress.close()  # no more deliveries: what is queued now is all there is
        for msg in self.requests.clear():
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
        while time.monotonic() < finish_by and self.requests.busy():
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
        trouble = self.relays.trouble() or self.pairing.trouble()
        if trouble is not None:
            log.warning("role %s not ready: %s", self.name, trouble)
        return self._started and not self._draining.is_set() and trouble is None

    def _sample(self) -> RoleSample:
        stats = self.pool.stats()
        ingress = self.ingress.stats()
        _, queued, inflight = self.requests.counts()
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
        queued, _, active = self.requests.counts()
        capacity = self.pool.allocator.capacity
        return dispatch.Load(
            queued=queued,
            active=active,
            workers=self.config.concurrency,
            free_bytes=max(0, capacity - self.pool.allocator.stats().used),
            pool_bytes=capacity,
            service_s=self.handling.service_s,
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

    def _lost(self, sent: list[inflight.Sent]) -> None:
        """Requests passed on to a downstream replica now lost (forward.Forwarder's
        `on_lost`, made before `control`): their clients are told (control.py)."""
        self.control.lost(sent)

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
            if self.requests.drop(meta.rid):  # at once; telling downstream is a network send
                self.control.later("abort", meta)
            return
        if self.requests.aborted(meta.rid):
            msg.release()
            return
        if not self.requests.offer(meta, payload, msg):
            msg.release()  # told at once (by the control thread), so the client can back off
            self.control.later("overloaded", meta)

    def _worker(self) -> None:
        while (taken := self.requests.take(self._stopping)) is not None:
            rid, (meta, payload, msg) = taken
            self.metrics.queue_wait(time.monotonic() - msg.received_at)
            try:
                self.handling.handle(meta, payload, msg)
            except Exception:  # a bug here must not kill the worker
                log.exception("role %s: unexpected error on request %s", self.name, rid)
                msg.release()
            finally:
                self.requests.done(rid)


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
        if config.world_size > 1:  # several ranks per replica: rank 0 runs the role (ranks.py)
            from disagg_runtime.role import ranks

            return ranks.main(config)
        role = RoleRuntime(config)
        role.run()
    except (ContractError, HandlerError, PoolError, PeerKeyError) as exc:
        log.error("cannot start role: %s", exc)
        return 2
    return 0
