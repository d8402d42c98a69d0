"""What `disagg bench transport` measures, in which order, and what each row is compared to:
pure logic, no I/O (tests/unit/runtime/test_bench_ratios.py).

A limit is the best a user could get for the same move on this machine, measured in the
same run; where several ways of doing it exist, the limit is the fastest of them at each
size (so no relay can pass a limit by the limit's own slowness):

    memcpy     = fastest of copy_torch (torch `copy_`), copy_memmove (glibc `memmove`
                 through ctypes, what the relay's copies use) and copy_numpy (`np.copyto`)
    tcp_limit  = faster of raw_tcp (one loopback stream) and raw_tcp_n (the payload cut
                 over N streams, each sent and received by its own thread)

Peers are what a user would otherwise run: bare NIXL (a WRITE with a notification between
two processes, UCX pinned to cma or to tcp on loopback), the origin systems' styles
(pyzmq pickle, SGLang's copy-and-clone ZMQ codec, sglang-omni's fresh shared-memory
segment per message) and the least-Python hand-off. Every disagg relay row carries its
rate over each limit's and peer's at its size: above 1, disagg is faster.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

COPIES = ("copy_torch", "copy_memmove", "copy_numpy")
TCP_RAW = ("raw_tcp", "raw_tcp_n")
DERIVED: dict[str, tuple[str, ...]] = {"memcpy": COPIES, "tcp_limit": TCP_RAW}
# measured first, in this order, so every later row has its ratios
LIMITS = (*COPIES, "memcpy", "d2d", "memcpy_large", "raw_unix", "py_unix", *TCP_RAW, "tcp_limit")
RELAYS = ("shm", "tcp", "nixl", "cuda_ipc")
NIXL_PEERS = ("nixl_cma", "nixl_tcp")
STYLES = ("pickle_zmq", "copy_clone_zmq", "fresh_shm")
# what each relay row is compared to, in the order the table prints them
REFERENCES = ("memcpy", "memcpy_large", "tcp_limit", "py_unix", *NIXL_PEERS, *STYLES)


def plan(requested: Iterable[str]) -> list[str]:
    """The methods to run, limits first: a derived limit brings the ways it is the best
    of (asking for `memcpy` runs the three copies), and each method runs once."""
    wanted: list[str] = []
    for method in requested:
        for part in (*DERIVED.get(method, ()), method):
            if part not in wanted:
                wanted.append(part)
    return [m for m in LIMITS if m in wanted] + [m for m in wanted if m not in LIMITS]


def is_derived(method: str) -> bool:
    """A limit made of other rows (no measurement of its own)."""
    return method in DERIVED


def best_of(method: str, rates: Mapping[str, float]) -> str | None:
    """The fastest measured part of derived limit `method` (by GB/s), or None if none ran."""
    parts = [p for p in DERIVED[method] if p in rates]
    return max(parts, key=lambda p: rates[p]) if parts else None


def ratios(method: str, gbps: float, rates: Mapping[str, float]) -> dict[str, float]:
    """A relay row's rate over each reference measured at its size (empty for others)."""
    if method not in RELAYS:
        return {}
    return {ref: gbps / rates[ref] for ref in REFERENCES if rates.get(ref)}
