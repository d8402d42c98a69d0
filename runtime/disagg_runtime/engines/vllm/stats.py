"""The connector's per-request transfer stats (pure, apart from a lock).

The worker halves record one observation per request (`Recorder.send` on the prefill
engine, `Recorder.load` on the decode engine); vLLM collects them each step through the
connector's `get_kv_connector_stats` (`Recorder.take`), ships them to its stats loggers
as a plain dict of lists (serializable), merges intervals (`merge`) and logs `summary`,
and feeds Prometheus (connector.py's `DisaggPromMetrics`: `vllm:disagg_kv_*`).
"""

from __future__ import annotations

import threading
from typing import Any

KEYS = (
    "send_seconds",  # per delivered send: the relay send, handshake included when there was one
    "send_bytes",
    "send_blocks",
    "send_failed",  # one 1 per failed send (lost peer, timeout, refusal)
    "load_seconds",  # per landed load: from the request's blocks allocated to the blocks in
    "load_bytes",
    "load_blocks",
    "load_failed",  # one 1 per load that failed (refused payload, not arrived in the lease)
)
MAX_KEPT = 4096  # observations kept between two collections (older ones are dropped)


def empty() -> dict[str, list[float]]:
    return {k: [] for k in KEYS}


def merge(into: dict[str, list[float]], other: dict[str, Any]) -> dict[str, list[float]]:
    """`other`'s observations appended to `into` (unknown keys ignored)."""
    for k in KEYS:
        values = other.get(k)
        if isinstance(values, list):
            into.setdefault(k, []).extend(float(v) for v in values)
    return into


def is_empty(data: dict[str, Any]) -> bool:
    return not any(data.get(k) for k in KEYS)


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def summary(data: dict[str, Any]) -> dict[str, int | float]:
    """One interval, reduced for vLLM's log line ("KV Transfer metrics: ...")."""
    out: dict[str, int | float] = {}
    for side in ("send", "load"):
        seconds = [float(v) for v in data.get(f"{side}_seconds", [])]
        out[f"{side}s"] = len(seconds)
        out[f"{side} failed"] = len(data.get(f"{side}_failed", []))
        if seconds:
            out[f"{side} avg ms"] = round(1e3 * sum(seconds) / len(seconds), 3)
            out[f"{side} p90 ms"] = round(1e3 * _p90(seconds), 3)
            out[f"{side} MiB"] = round(sum(data.get(f"{side}_bytes", [])) / 2**20, 3)
            out[f"{side} blocks"] = int(sum(data.get(f"{side}_blocks", [])))
    return out


class Recorder:
    """Observations since the last `take` (recorded from relay threads, taken by vLLM's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = empty()

    def _add(self, **values: float) -> None:
        with self._lock:
            for k, v in values.items():
                kept = self._data[k]
                kept.append(v)
                if len(kept) > MAX_KEPT:
                    del kept[0]

    def send(self, seconds: float, nbytes: int, blocks: int, ok: bool) -> None:
        if ok:
            self._add(send_seconds=seconds, send_bytes=nbytes, send_blocks=blocks)
        else:
            self._add(send_failed=1)

    def load(self, seconds: float, nbytes: int, blocks: int, ok: bool) -> None:
        if ok:
            self._add(load_seconds=seconds, load_bytes=nbytes, load_blocks=blocks)
        else:
            self._add(load_failed=1)

    def take(self) -> dict[str, list[float]] | None:
        """What was recorded since the last call (None: nothing)."""
        with self._lock:
            if is_empty(self._data):
                return None
            data, self._data = self._data, empty()
        return data
