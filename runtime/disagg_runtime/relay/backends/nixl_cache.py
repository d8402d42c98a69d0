"""What a nixl sender sets up once and reuses (relay/backends/nixl.py): NIXL registrations
of the memory it writes from, and NIXL's prepared descriptor lists for both sides of a
WRITE. Registering a 1 MiB payload and building its descriptors cost ~25 us a transfer;
a stream of payloads from the same tensors (a KV cache, a bench loop) pays them once.

Registrations are of a tensor's own bytes (not its whole storage: that may be a large
mapping), kept with a weak reference to the storage: the cache never keeps memory
alive. An entry is used only while its storage is the same live object at the same
address and size as when it was registered; every `prepare` first deregisters
the entries whose storage died (or moved, `resize_`), before anything is looked up or
registered, so a registration never covers memory reused since: memory freed and
allocated again at the same address is registered afresh, under its new storage.

Prepared lists (`prep_xfer_dlist`) are keyed by the exact regions of a transfer: local
(this process's tensors) and far (the receiver's pool at a granted slot). A far list is
used only for the exact regions of the current grant, so a slot freed and granted again
is written only because that new grant says so; far lists name the receiver as this
sender's welcome described it and go when the sender closes (a reconnect is a new
sender, a new welcome, fresh lists). Local lists go with the registrations they lie in.
Both are bounded (least recently used first out).

One cache per sender, used under its lock (one transfer at a time).
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from disagg_runtime.relay.backends.nixl_agent import Agent

log = logging.getLogger(__name__)
MAX_REGIONS = 16  # registrations kept (a payload's tensors, over a few payloads)
MAX_LISTS = 16  # prepared (local, far) pairs kept: credit slots a stream alternates between

Region = tuple[int, int, int]  # (address, bytes, device), as NIXL describes memory


def _weak(storage: Any) -> Any:
    return StorageWeakRef(storage)  # type: ignore[no-untyped-call]


def _dead(ref: Any) -> bool:
    return bool(ref.expired())


@dataclass
class _Registration:
    ref: Any  # a StorageWeakRef (torch's, untyped)
    storage: tuple[int, int]  # its storage's (address, bytes) when registered
    descs: Any  # NIXL's registration, for deregister


RegKey = tuple[int, int, int]  # (the storage's C++ object, region address, region bytes)


@dataclass(frozen=True)
class _Lists:
    local: Any
    far: Any
    registrations: frozenset[RegKey]  # the ones the local list lies in


class SendCache:
    """One sender's registrations and prepared lists (see the module docstring)."""

    def __init__(self, agent: Agent, *, regions: int = MAX_REGIONS, lists: int = MAX_LISTS) -> None:
        self._agent = agent
        self._max_regions = regions
        self._max_lists = lists
        self._regs: collections.OrderedDict[RegKey, _Registration] = collections.OrderedDict()
        self._lists: collections.OrderedDict[tuple[Any, ...], _Lists] = collections.OrderedDict()
        self.registered = 0  # NIXL registrations made, and prepared pairs (for tests)
        self.prepared = 0

    def __len__(self) -> int:
        return len(self._regs)

    def prepare(
        self,
        tensors: list[torch.Tensor],
        local: list[Region],
        mem: str,
        far: list[Region],
        far_mem: str,
        remote: str,
    ) -> tuple[Any, Any]:
        """The prepared (local, far) lists for WRITEs of `tensors` (at `local`, all on
        `mem`) to `far` on agent `remote`: from the cache, or registered and prepared now."""
        self._sweep()
        used = frozenset(self._register(t, at, mem) for t, at in zip(tensors, local, strict=True))
        key = (mem, tuple(local), far_mem, tuple(far))
        hit = self._lists.get(key)
        if hit is not None:
            self._lists.move_to_end(key)
            return hit.local, hit.far
        agent = self._agent
        local_list = agent.prep(agent.LOCAL, local, mem)
        try:
            far_list = agent.prep(remote, far, far_mem)
        except BaseException:
            agent.release_list(local_list)
            raise
        self._lists[key] = _Lists(local_list, far_list, used)
        self.prepared += 1
        while len(self._lists) > self._max_lists:
            self._release(self._lists.popitem(last=False)[1])
        while len(self._regs) > self._max_regions:
            oldest = next((k for k in self._regs if k not in used), None)
            if oldest is None:
                break
            self._drop(oldest)
        return local_list, far_list

    def _register(self, t: torch.Tensor, region: Region, mem: str) -> RegKey:
        storage = t.untyped_storage()
        key = (storage._cdata, region[0], region[1])
        span = (storage.data_ptr(), storage.nbytes())
        entry = self._regs.get(key)
        if entry is not None:
            # the weak reference keeps `_cdata` from naming another storage while it lives
            if entry.storage == span and not _dead(entry.ref):
                self._regs.move_to_end(key)
                return key
            self._drop(key)
        descs = self._agent.register_region(*region, mem)
        self._regs[key] = _Registration(_weak(storage), span, descs)
        self.registered += 1
        return key

    def _sweep(self) -> None:
        """Deregister what dead (or moved) storages left registered."""
        for key in [k for k, e in self._regs.items() if _dead(e.ref)]:
            self._drop(key)

    def _drop(self, key: RegKey) -> None:
        entry = self._regs.pop(key)
        for pair in [k for k, lists in self._lists.items() if key in lists.registrations]:
            self._release(self._lists.pop(pair))
        try:
            self._agent.deregister(entry.descs)
        except Exception as exc:  # NIXL's own errors: nothing more to free here
            log.debug("nixl: deregistering a payload's memory: %s", exc)

    def _release(self, lists: _Lists) -> None:
        for handle in (lists.local, lists.far):
            try:
                self._agent.release_list(handle)
            except Exception as exc:
                log.debug("nixl: releasing a prepared list: %s", exc)

    def close(self) -> None:
        """Release every prepared list and registration (the sender is closing)."""
        while self._lists:
            self._release(self._lists.popitem()[1])
        while self._regs:
            self._drop(next(iter(self._regs)))
