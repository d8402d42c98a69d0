"""The prefill engine's worker side: send finished prompts' blocks to decode engines.

The scheduler hands each finished P/D request's block ids over (`Send`); `Sends.start`
puts it on a sending thread, which reads the blocks straight out of the KV cache (views,
no staging copy: whole blocks, one tensor per run of consecutive ids per layer) and
`send`s them through the relay to the decode engine's ingress, where they land in its
pool. The sending thread asks the allow-list (peers.py) again before it connects: an
endpoint taken out of `decodes_file` between the scheduler's check and the send (a decode
replica scaled away, its name about to be another's) is refused then, without a
connection, and the request's blocks are freed as for a failed send. vLLM keeps the
blocks allocated meanwhile (`request_finished` delayed their free);
`Sends.finished` reports each request once its send returned (delivered, or failed, or
past its lease: a decode engine that never takes them cannot hold them), so vLLM frees
them then.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from disagg_runtime import relay as relays
from disagg_runtime.engines.vllm.layout import KvLayout, runs
from disagg_runtime.engines.vllm.params import SendTo
from disagg_runtime.engines.vllm.peers import DecodePeers
from disagg_runtime.engines.vllm.side import KvSide

log = logging.getLogger(__name__)
HANDSHAKE_S = 2.0  # one handshake's wait before it is tried again


@dataclass(frozen=True)
class Send:
    """One request's blocks to send (scheduler -> worker metadata)."""

    req_id: str
    order: SendTo
    block_ids: tuple[int, ...]
    tokens: int


@dataclass
class SendStats:
    """What the sends moved (exported by the connector)."""

    requests: int = 0
    failed: int = 0
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    refused: int = 0  # by the allow-list at send time (counted in `failed` too)
    last: dict[str, Any] = field(default_factory=dict)


class Refused(Exception):
    """The decode endpoint is no longer allowed (peers.py): nothing was sent."""


class Sends(KvSide):
    """Sending threads over one relay per decode endpoint (authenticated with `key`), to
    the endpoints `peers` allows at send time (None: the scheduler's check alone)."""

    def __init__(
        self,
        caches: Mapping[str, torch.Tensor],
        layout: KvLayout,
        *,
        key: bytes,
        lease_s: float,
        threads: int = 2,
        peers: DecodePeers | None = None,
    ) -> None:
        super().__init__(caches, layout, lease_s)
        self._key = key
        self._peers = peers
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="disagg-kv-send")
        self._relays: dict[tuple[str, str], relays.Relay] = {}
        self._lock = threading.Lock()
        self._done: set[str] = set()
        self._futures: dict[str, Future[None]] = {}
        self.stats = SendStats()

    def start(self, send: Send) -> None:
        self._futures[send.req_id] = self._pool.submit(self._send, send)

    def finished(self) -> set[str]:
        """Requests whose send returned since the last call (their blocks may be freed)."""
        with self._lock:
            done, self._done = self._done, set()
        for rid in done:
            self._futures.pop(rid, None)
        return done

    @property
    def pending(self) -> int:
        return len(self._futures)

    def payload(self, block_ids: tuple[int, ...]) -> dict[str, Any]:
        """The blocks as views of the caches: per layer, one slice per run of ids."""
        spans = runs(block_ids)
        return {"kv": [[c[s : s + n] for s, n in spans] for c in self._caches]}

    def _relay(self, order: SendTo, deadline: float) -> relays.Relay:
        """The relay to `order.decode`, connected on first use. A handshake is retried with
        short timeouts until `deadline`: a first hello to an engine's ingress was seen
        unanswered now and then (cause not found), and a retry is answered."""
        key = (order.relay, order.decode)
        with self._lock:
            found = self._relays.get(key)
        while found is None:
            left = deadline - time.monotonic()
            try:
                found = relays.connect(
                    order.relay,
                    order.decode,
                    key=self._key,
                    timeout=self.lease_s,
                    handshake_timeout=min(HANDSHAKE_S, max(0.1, left)),
                )
            except relays.RelayTimeout:
                if left <= HANDSHAKE_S:
                    raise
                log.info("handshake with %s unanswered: retrying", order.decode)
                continue
            with self._lock:
                self._relays[key] = found
        return found

    def _send(self, send: Send) -> None:
        started = time.perf_counter()
        ok = refused = False
        nbytes = 0
        try:
            allowed = self._peers.check(send.order.decode) if self._peers is not None else None
            if allowed is not None and allowed.reason is not None:
                refused = True
                raise Refused(allowed.reason)
            meta = {
                "transfer": send.order.transfer,
                "tokens": send.tokens,
                "blocks": len(send.block_ids),
                "layout": self.layout.to_json(),
            }
            deadline = time.monotonic() + self.lease_s
            for attempt in (1, 2):  # a decode engine restarted since: once more, reconnected
                try:
                    nbytes = self._relay(send.order, deadline).send(
                        self.payload(send.block_ids),
                        request_id=send.order.transfer,
                        timeout=max(0.1, deadline - time.monotonic()),
                        meta=meta,
                    )
                    break
                except relays.PeerLost:
                    self._drop(send.order)
                    if attempt == 2:
                        raise
            ok = True
        except Exception as exc:  # the decode side times out and recomputes; we free
            log.warning(
                "KV transfer %s to %s failed: %s", send.order.transfer, send.order.decode, exc
            )
            self._drop(send.order)
        finally:
            elapsed = time.perf_counter() - started
            with self._lock:
                s = self.stats
                s.requests += 1
                s.failed += 0 if ok else 1
                s.refused += 1 if refused else 0
                s.blocks += len(send.block_ids) if ok else 0
                s.bytes += nbytes
                s.seconds += elapsed
                s.last = {"transfer": send.order.transfer, "bytes": nbytes, "seconds": elapsed}
                self._done.add(send.req_id)
            self.recorder.send(elapsed, nbytes, len(send.block_ids), ok)
            log.debug(
                "KV transfer %s: %d blocks, %d B in %.2f ms over %s",
                send.order.transfer,
                len(send.block_ids),
                nbytes,
                elapsed * 1e3,
                send.order.relay,
            )

    def _drop(self, order: SendTo) -> None:
        """Forget a relay that failed (the next send reconnects)."""
        with self._lock:
            found = self._relays.pop((order.relay, order.decode), None)
        if found is not None:
            found.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            found, self._relays = list(self._relays.values()), {}
        for r in found:
            r.close()
