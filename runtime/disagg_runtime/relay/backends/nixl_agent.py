"""This process's NIXL agent (relay/backends/nixl.py): made once, shared by every nixl
sender and landing in it, with the UCX backend, no progress thread of NIXL's own (a
receiving agent's worker is progressed here; a WRITE while its sender checks it).
Nothing imports `nixl` until an agent is made.
"""

from __future__ import annotations

import importlib
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any

import torch

from disagg_runtime.relay.backends import nixl_libs
from disagg_runtime.relay.errors import RelayError

log = logging.getLogger(__name__)
NEEDS = "the nixl package with its UCX plugin (pip install 'disagg[nixl]')"
UCX = "UCX"
POLL_S = 50e-6  # between checks of a running WRITE, once past SPIN_S
SPIN_S = 1e-3  # a WRITE is checked back to back (yielding the core) this long first
PROGRESS_S = 0.002  # a receiving agent's worker is progressed this often

_lock = threading.Lock()
_agent: Agent | None = None
_failure: str | None = None


def unavailable_reason() -> str | None:
    """Why this process cannot use the nixl relay, or None (makes the process's agent)."""
    try:
        process_agent()
    except RelayError as exc:
        return str(exc)
    return None


def process_agent() -> Agent:
    """This process's NIXL agent, made once (an agent per process: UCX contexts are heavy)."""
    global _agent, _failure
    with _lock:
        if _agent is not None:
            return _agent
        if _failure is not None:
            raise RelayError(_failure)
        try:
            _agent = Agent(f"disagg-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")
        except RelayError as exc:
            _failure = str(exc)
            raise
        return _agent


class Agent:
    """A NIXL agent with the UCX backend, shared by this process's threads (strict sync)."""

    def __init__(self, name: str) -> None:
        nixl_libs.isolate_system_libnl()  # before NIXL loads UCX's RDMA transports
        try:
            api = importlib.import_module("nixl._api")
        except ImportError as exc:
            raise RelayError(f"nixl is not installed ({exc})") from None
        except Exception as exc:  # its loader probes CUDA and shared libraries
            raise RelayError(f"nixl cannot be loaded: {type(exc).__name__}: {exc}") from None
        if "NIXL_LOG_LEVEL" not in os.environ:  # its INFO lines go to stdout: keep it quiet
            logging.getLogger("nixl").setLevel(logging.WARNING)
        config = api.nixl_agent_config(
            # no NIXL progress thread: measured here it costs a quarter of a core when idle
            # and cut 64 MiB WRITEs from ~4 GB/s to ~0.5 GB/s on 2 cores; a WRITE progresses
            # while its sender polls it, a receiver's worker through `_progress`
            enable_prog_thread=False,
            backends=[UCX],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        try:
            self.api: Any = api.nixl_agent(name, config)
        except Exception as exc:
            raise RelayError(f"cannot start a NIXL agent: {type(exc).__name__}: {exc}") from None
        if UCX not in self.api.backends:
            plugins = ", ".join(self.api.get_plugin_list()) or "none"
            raise RelayError(f"NIXL has no {UCX} backend here (plugins: {plugins})")
        self.name = name
        self._remotes: dict[str, int] = {}  # remote agent -> senders using it
        self._lock = threading.Lock()
        self._receivers = 0  # landings that need the worker progressed
        self._progress: threading.Thread | None = None

    def hold_progress(self) -> None:
        """A landing receives through this agent: progress its worker (connection set-up
        and UCX's own messages need the target to progress; one-sided data does not)."""
        with self._lock:
            self._receivers += 1
            if self._progress is None:
                self._progress = threading.Thread(
                    target=self._progress_loop, name="disagg-nixl-progress", daemon=True
                )
                self._progress.start()

    def release_progress(self) -> None:
        with self._lock:
            self._receivers -= 1

    def _progress_loop(self) -> None:
        while True:
            with self._lock:
                if self._receivers <= 0:
                    self._progress = None
                    return
            try:
                self.api.get_new_notifs()  # progresses the UCX worker
            except Exception as exc:  # a peer's failure must not stop the others
                log.debug("nixl: progress: %s", exc)
            time.sleep(PROGRESS_S)

    def metadata(self) -> bytes:
        return bytes(self.api.get_agent_metadata())

    def register(self, tensors: list[torch.Tensor]) -> Any:
        """Register contiguous tensors (DRAM or VRAM by their device) with UCX."""
        return self.api.register_memory(tensors if len(tensors) > 1 else tensors[0])

    def deregister(self, descs: Any) -> None:
        self.api.deregister_memory(descs)

    def add_remote(self, metadata: bytes, name: str) -> str:
        """Load a peer's metadata (once per peer, counted); our own name: loopback."""
        if name == self.name:
            return name
        with self._lock:
            if name not in self._remotes:
                loaded = self.api.add_remote_agent(metadata)
                loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
                if loaded != name:
                    self.api.remove_remote_agent(loaded)
                    raise RelayError(f"NIXL metadata names agent {loaded!r}, not {name!r}")
                self._remotes[name] = 0
            self._remotes[name] += 1
        return name

    def drop_remote(self, name: str) -> None:
        if name == self.name:
            return
        with self._lock:
            count = self._remotes.get(name, 0) - 1
            if count > 0:
                self._remotes[name] = count
                return
            self._remotes.pop(name, None)
            try:
                self.api.remove_remote_agent(name)
            except Exception as exc:  # already gone with its peer: nothing to free
                log.debug("nixl: removing agent %s: %s", name, exc)

    LOCAL = "NIXL_INIT_AGENT"  # `prep`'s agent for this process's side of a transfer

    def register_region(self, ptr: int, nbytes: int, device: int, mem: str) -> Any:
        """Register one contiguous region (DRAM or VRAM) with UCX."""
        return self.api.register_memory([(ptr, nbytes, device, "")], mem)

    def prep(self, agent: str, regions: list[tuple[int, int, int]], mem: str) -> Any:
        """A prepared descriptor list of `regions` on `agent` (LOCAL: ours; our own name:
        loopback), for `write_prepped`; released with `release_list`."""
        return self.api.prep_xfer_dlist(agent, regions, mem)

    def release_list(self, handle: Any) -> None:
        self.api.release_dlist_handle(handle)

    def write_prepped(self, local: Any, far: Any, count: int, deadline: float) -> str | None:
        """WRITE every region of the prepared list `local` to its peer in `far`: "DONE",
        "ERR: ..." or None (still running at `deadline`: released, which cancels it)."""
        indices = list(range(count))
        handle = self.api.make_prepped_xfer("WRITE", local, indices, far, indices)
        return self._run(handle, deadline)

    def _run(self, handle: Any, deadline: float) -> str | None:
        """Post a transfer and poll it to its end (or `deadline`), then release it."""
        api = self.api
        try:
            state = api.transfer(handle)
            # a medium WRITE is done in tens of us, and a sleep costs ~60 us more than asked:
            # check back to back first (as bare NIXL does), then sleep between checks
            spin_until = time.monotonic() + SPIN_S
            while state == "PROC":
                now = time.monotonic()
                if now > deadline:
                    return None
                if now < spin_until:
                    os.sched_yield()
                else:
                    time.sleep(POLL_S)
                state = api.check_xfer_state(handle)
            return "DONE" if state == "DONE" else f"ERR: transfer state {state}"
        finally:
            try:
                api.release_xfer_handle(handle)
            except Exception as exc:  # a failed transfer's handle may already be gone
                log.debug("nixl: releasing a transfer: %s", exc)
