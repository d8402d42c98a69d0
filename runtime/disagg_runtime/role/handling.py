"""What a worker does with one message of a request: run the handler, send its output on,
and fail the request (telling the client and downstream roles) when that goes wrong.

- `data`: the handler runs; a generator streams (each item a `chunk`, then an `end`),
  else one `data` goes on. A `chunk` of an upstream stream runs the handler on it and its
  output goes on as a chunk; the upstream `end` closes ours.
- Fan-in roles and consumers of tensor references join a request's inputs first
  (requests.Requests.join); a join not complete by the request's deadline fails it.
- A handler that raises fails only its request: the client gets the role, replica and
  exception, and downstream roles get an `abort` so their joins let go at once.
- Outputs of an exit role go to the request's reply endpoint, others to every downstream
  role, tensor references split off first and sent straight to their consumer
  (routing/forward.py, with its failover).
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from typing import Any

from disagg_core.contract import RoleConfig
from disagg_runtime.relay import Message, RelayError
from disagg_runtime.role.batching import BatchCancelled, BatchTimeout
from disagg_runtime.role.handler import Runner
from disagg_runtime.role.metrics import RoleMetrics
from disagg_runtime.role.requests import Join, Requests
from disagg_runtime.role.spans import RoleSpans
from disagg_runtime.routing import forward, migration
from disagg_runtime.routing.forward import ReplyFailed
from disagg_runtime.wire import envelope
from disagg_runtime.wire.envelope import Meta

log = logging.getLogger(__name__)


class Handling:
    """The role's workers' side: handle, emit, fail (shared by all worker threads)."""

    def __init__(
        self,
        config: RoleConfig,
        requests: Requests,
        runner: Runner,
        metrics: RoleMetrics,
        forwarder: forward.Forwarder,
        spans: RoleSpans,
        *,
        stopping: threading.Event,
    ) -> None:
        self.config = config
        self.name = config.role
        self.me = config.me
        self.requests = requests
        self.runner = runner
        self.metrics = metrics
        self.forward = forwarder
        self.spans = spans  # a traced request's spans (spans.py)
        self._stopping = stopping
        self.service_s = 0.0  # moving average of handler seconds (dispatch.Load.service_s)

    def handle(self, meta: Meta, payload: Any, msg: Message) -> None:
        if self.requests.aborted(meta.rid):
            msg.release()
            return
        if meta.expired:
            msg.release()
            self.fail(meta, "timeout", f"request timed out before role {self.name} handled it")
            return
        if meta.kind == "end":  # the upstream stream is complete, and so is ours
            msg.release()
            try:
                self._emit(meta, "end", None)
            except RelayError as exc:
                self._fail_send(meta, exc)
                return
            self.metrics.request_done(
                max(0.0, time.time() - (meta.deadline - self.config.request_timeout))
            )
            return
        joins = self.me.joins
        if meta.kind == "chunk":
            if joins:
                msg.release()
                self.fail(meta, "other", f"role {self.name} joins inputs and cannot take a stream")
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
        refs = {r.path for r in self.me.refs_in}
        join = self.requests.join(meta, payload, msg, set(self.me.upstream), refs)
        if join is None:
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
        rid = meta.rid
        traced = self.spans.begin(meta, messages, started)  # None: not traced
        if traced is not None:  # what this role sends on hangs under its span
            meta = meta.with_(trace=traced.span.traceparent)
        try:
            result = self.runner.invoke(
                data,
                timeout=forward.remaining(meta),
                cancelled=lambda: self.requests.aborted(rid) or self._stopping.is_set(),
            )
            if traced is not None and not inspect.isgenerator(result):
                traced.handled(time.monotonic())  # the sends below are spans of their own
            if inspect.isgenerator(result):
                for chunk in result:
                    if self.requests.aborted(rid):  # the client left: stop generating
                        result.close()
                        break
                    self._emit(meta, "chunk", chunk)
                if not streaming_input:
                    self._emit(meta, "end", None)
            else:
                self._emit(meta, "chunk" if streaming_input else "data", result)
        except RelayError as exc:
            self._fail_send(meta, exc)
        except BatchTimeout as exc:
            self.fail(meta, "timeout", f"request timed out at role {self.name}: {exc}")
        except BatchCancelled as exc:
            if not self.requests.aborted(rid):
                self.fail(meta, "other", f"role {self.name}: {exc}")
        except Exception as exc:
            self.fail(meta, "handler", f"{type(exc).__name__}: {exc}", exc_type=type(exc).__name__)
        else:
            took = time.monotonic() - started
            if traced is not None:
                traced.handled(started + took)  # a stream: generating and sending
            self.metrics.handler_seconds(took)
            # recent seconds per call, advertised in the load (a plain float store)
            self.service_s = took if not self.service_s else 0.8 * self.service_s + 0.2 * took
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
        if self.requests.aborted(meta.rid):
            return
        if meta.expired:
            raise RelayError(f"request deadline passed at role {self.name}")
        if kind == "chunk":
            out = meta.with_(kind="chunk", source=self.name, seq=self.requests.next_seq(meta.rid))
        elif kind == "end":
            out = meta.with_(kind="end", source=self.name, count=self.requests.end_count(meta.rid))
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
    def _fail_send(self, meta: Meta, exc: RelayError) -> None:
        if isinstance(exc, forward.HandedBack):  # draining without a partner: elsewhere
            self.hand_on(meta, migration.HANDED_BACK, str(exc))
            self.abort(meta.with_(kind="abort", source=self.name))
            return
        message = f"role {self.name} could not send on: {exc}"
        self.fail(meta, "transport", message, reply_failed=isinstance(exc, ReplyFailed))

    def hand_on(self, meta: Meta, reason: str, message: str, *, role: str = "") -> None:
        """Give the request back to its first sender (the client or gateway), which moves
        it to a live replica unless output of it has reached it already (client.py):
        `reason` is migration.HANDED_BACK (this role is going) or LOST (`role`'s replica it
        went to is gone). Counted, and not a failure here."""
        self.metrics.handed_on(reason)
        error = {
            "role": role or self.name,
            "replica": str(self.config.replica) if not role else "",
            "reason": reason,
            "type": "",
            "message": message,
        }
        started = time.monotonic()
        try:
            self.forward.send_reply(meta.with_(kind="error", source=self.name, error=error), None)
        except Exception as exc:  # the client may be gone
            log.warning("role %s: could not hand %s back: %s", self.name, meta.rid, exc)
            return
        # said once sent, with how long that took (a report that comes late moves nothing)
        log.info(
            "role %s: request %s handed on (%s) in %.3f s: %s",
            self.name,
            meta.rid,
            reason,
            time.monotonic() - started,
            message,
        )

    def fail(
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
        self.abort(meta.with_(kind="abort", source=self.name))

    def abort(self, meta: Meta) -> None:
        """Drop everything of the request here and pass the abort on (once per request)."""
        if self.requests.drop(meta.rid):
            self.pass_abort(meta)

    def pass_abort(self, meta: Meta) -> None:
        targets = set(self.me.downstream) | {r.target for r in self.me.refs_out}
        for target in sorted(targets):
            try:
                self.forward.send_to(target, meta.with_(kind="abort", source=self.name), None)
            except (RelayError, OSError) as exc:
                log.debug("abort of %s not passed to %s: %s", meta.rid, target, exc)

    def expire_joins(self) -> None:
        for join in self.requests.expired_joins():
            self.fail(join.meta, "timeout", self._waiting_for(join))

    def _waiting_for(self, join: Join) -> str:
        missing = sorted(set(self.me.upstream) - set(join.inputs))
        missing += [f"ref {r.path}" for r in self.me.refs_in if r.path not in join.refs]
        return f"request timed out at role {self.name} waiting for {', '.join(missing)}"
