"""The decode engine's worker side: an ingress the prefill engines send blocks to, and the
copy of each arrived transfer into the blocks vLLM allocated for its request.

A transfer and its request meet in either order: the payload can land (in the ingress's
pool, through the shm or tcp relay) before the gateway's decode request reaches the
scheduler, or after. `Loads.poll` (each engine step) pairs them, checks the payload
against this engine's `KvLayout` and the request's block count, copies the blocks in and
frees the pool slot. A request whose transfer does not come within the lease, or comes
malformed, is reported with its blocks as load errors: vLLM then recomputes the prompt
itself, and the refusal is logged with its reason. Arrivals nobody claims are freed after
the lease too, so an abandoned hand-off holds nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing import resource_tracker
from typing import Any

import torch

from disagg_runtime.engines.vllm.layout import KvLayout, LayoutError, mismatch, pair_runs, runs
from disagg_runtime.engines.vllm.params import LoadFrom
from disagg_runtime.engines.vllm.side import KvSide
from disagg_runtime.memory.pool import Pool, reclaim_stale, shm_name, shm_prefix
from disagg_runtime.relay import Ingress, Message

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Load:
    """One request's blocks to fill (scheduler -> worker metadata): the transfer's blocks
    `skip` onward go to `block_ids` (the first `skip` were cached here already)."""

    req_id: str
    order: LoadFrom
    block_ids: tuple[int, ...]
    skip: int


@dataclass
class LoadStats:
    loaded: int = 0
    refused: int = 0
    timed_out: int = 0
    aborted: int = 0
    blocks: int = 0
    bytes: int = 0


class Loads(KvSide):
    """The ingress at `endpoint` over an shm pool of `pool_bytes`, and the pending loads."""

    def __init__(
        self,
        caches: Mapping[str, torch.Tensor],
        layout: KvLayout,
        *,
        endpoint: str,
        key: bytes,
        pool_bytes: int,
        lease_s: float,
        pipeline: str = "vllm",
        role: str = "decode",
    ) -> None:
        super().__init__(caches, layout, lease_s)
        self._lock = threading.Lock()
        self._arrived: dict[str, tuple[Message, float]] = {}  # by transfer id
        self._pending: dict[str, tuple[Load, float]] = {}  # by request id
        self._errors: set[int] = set()
        self._gone: set[str] = set()  # aborted loads, reported done once (vLLM frees then)
        self.stats = LoadStats()
        reclaim_stale(shm_prefix(pipeline, role), why="a decode engine before this one died")
        self._pool = Pool.create(
            pool_bytes, device="shm", min_block=64 << 10, name=shm_name(pipeline, role)
        )
        self._tracked = _track(self._pool.name)
        try:
            self._ingress = Ingress(
                endpoint, self._pool, key=key, lease_s=lease_s, on_message=self._arrive, role=role
            )
        except BaseException:
            self._pool.close()
            raise
        self.endpoint = self._ingress.endpoint
        # unclaimed arrivals expire on their own, not only when the engine steps (an idle
        # engine does not, and would hold an abandoned transfer's slot until it did)
        self._closing = threading.Event()
        self._expirer = threading.Thread(target=self._expire_loop, name="disagg-kv-expire")
        self._expirer.daemon = True
        self._expirer.start()

    def _expire_loop(self) -> None:
        while not self._closing.wait(min(1.0, self.lease_s / 4)):
            self._expire(time.monotonic())

    def _arrive(self, msg: Message) -> None:  # the ingress's I/O thread
        with self._lock:
            old = self._arrived.pop(msg.request_id, None)
            self._arrived[msg.request_id] = (msg, time.monotonic() + self.lease_s)
        if old is not None:  # the same transfer twice: the newer wins
            old[0].release()

    def start(self, load: Load) -> None:
        self._pending[load.req_id] = (load, time.monotonic() + self.lease_s)

    def poll(self) -> set[str]:
        """Requests whose blocks are in (or failed: see `errors`) since the last call."""
        now = time.monotonic()
        done, self._gone = self._gone, set()
        for rid, (load, deadline) in list(self._pending.items()):
            with self._lock:
                found = self._arrived.pop(load.order.transfer, None)
            if found is not None:
                with found[0] as msg:
                    landed = self._land(load, msg)
                self.recorder.load(
                    time.monotonic() - (deadline - self.lease_s),
                    found[0].nbytes,
                    load.skip + len(load.block_ids),
                    landed,
                )
            elif now > deadline:
                self.stats.timed_out += 1
                self.recorder.load(self.lease_s, 0, 0, ok=False)
                log.warning(
                    "KV transfer %s for request %s did not arrive in %.0f s: recomputing",
                    load.order.transfer,
                    rid,
                    self.lease_s,
                )
                self._errors.update(load.block_ids)
            else:
                continue
            del self._pending[rid]
            done.add(rid)
        self._expire(now)
        return done

    def errors(self) -> set[int]:
        """Block ids whose load failed since the last call (vLLM recomputes them)."""
        out, self._errors = self._errors, set()
        return out

    def _land(self, load: Load, msg: Message) -> bool:
        """Copy the transfer into the request's blocks; False: refused (load errors)."""
        try:
            blocks = self._check(load, msg)
        except LayoutError as exc:
            self.stats.refused += 1
            log.error("KV transfer %s refused: %s", load.order.transfer, exc)
            self._errors.update(load.block_ids)
            return False
        plan = pair_runs(
            [int(t.shape[0]) for t in msg.payload["kv"][0]], load.skip, runs(load.block_ids)
        )
        for cache, parts in zip(self._caches, msg.payload["kv"], strict=True):
            for part, at, start, count in plan:
                cache[start : start + count].copy_(parts[part][at : at + count])
        self.stats.loaded += 1
        self.stats.blocks += blocks
        self.stats.bytes += msg.nbytes
        return True

    def _check(self, load: Load, msg: Message) -> int:
        """The payload's block count, after checking it against this engine's layout."""
        meta = msg.meta or {}
        theirs = KvLayout.from_json(meta.get("layout"), "transfer layout")
        why = mismatch(self.layout, theirs)
        if why is not None:
            raise LayoutError(why)
        kv = msg.payload.get("kv") if isinstance(msg.payload, dict) else None
        if not isinstance(kv, list) or len(kv) != len(self._caches):
            raise LayoutError(f"payload carries no per-layer blocks for {len(self._caches)} layers")
        block = tuple(self._caches[0].shape[1:])
        counts = set()
        for layer in kv:
            if not isinstance(layer, list) or not layer:
                raise LayoutError("a layer's blocks are not a non-empty list of tensors")
            for t in layer:
                if not isinstance(t, torch.Tensor) or tuple(t.shape[1:]) != block:
                    raise LayoutError(f"a block run is not shaped [n, {list(block)}]")
                if t.dtype != self._caches[0].dtype:
                    raise LayoutError(
                        f"a block run is {t.dtype}, this cache is {self._caches[0].dtype}"
                    )
            counts.add(sum(int(t.shape[0]) for t in layer))
        if len(counts) != 1:
            raise LayoutError("layers carry different numbers of blocks")
        sent = counts.pop()
        if sent != load.skip + len(load.block_ids):
            raise LayoutError(
                f"{sent} blocks arrived for a request that needs {load.skip + len(load.block_ids)}"
                f" ({load.order.tokens} tokens)"
            )
        return sent

    def _expire(self, now: float) -> None:
        with self._lock:
            old = [t for t, (_, at) in self._arrived.items() if at < now]
            stale = [self._arrived.pop(t)[0] for t in old]
        for msg in stale:
            log.warning("KV transfer %s was never claimed: freed", msg.request_id)
            msg.release()

    def abort(self, req_id: str) -> None:
        """Forget a pending load (its request was aborted); its transfer, if it comes, is
        freed unclaimed after the lease."""
        if self._pending.pop(req_id, None) is not None:
            self._gone.add(req_id)  # vLLM keeps its blocks until the load is reported done
            self.stats.aborted += 1
            log.info("KV load for request %s dropped: the request went", req_id)

    def close(self) -> None:
        self._closing.set()
        self._expirer.join(timeout=5)
        with self._lock:
            held, self._arrived = [m for m, _ in self._arrived.values()], {}
        for msg in held:
            msg.release()
        self._ingress.close()
        self._pool.close()
        if self._tracked is not None:
            with contextlib.suppress(Exception):
                resource_tracker.unregister(self._tracked, "shared_memory")

    @property
    def waiting(self) -> dict[str, Any]:
        return {"pending": len(self._pending), "arrived": len(self._arrived)}


def _track(name: str | None) -> str | None:
    """Have Python's resource tracker (a process of its own, which outlives this worker)
    unlink the pool's segment if the worker dies without `close` (vLLM kills its workers
    with SIGKILL at shutdown, and an engine can be killed): no /dev/shm segment outlives
    the engine."""
    if name is None:
        return None
    tracked = "/" + name
    resource_tracker.register(tracked, "shared_memory")
    return tracked
