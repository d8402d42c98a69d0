"""Resident-set readings from /proc (Linux): current RSS and the peak since `reset_peak`."""

from __future__ import annotations


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    return _status_kib("VmHWM") * 1024


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (writing 5 to clear_refs, Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not permitted: the peak then covers the whole process lifetime
