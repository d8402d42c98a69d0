"""Handlers for `disagg bench pipeline`: no compute, so what is measured is the runtime."""

from __future__ import annotations

import time
from typing import Any


def identity(payload: Any) -> Any:
    return payload


def summarize(payload: dict[str, Any]) -> dict[str, Any]:
    """End of the chain: answer small, so the reply hop costs what the bare relay's does."""
    return {"nbytes": int(payload["x"].numel() * payload["x"].element_size())}


def answer(payload: dict[str, Any]) -> dict[str, Any]:
    """`disagg bench pipeline --gateway`'s one role: echo when asked (small round trips),
    else answer the byte count (large uploads: what is timed is the way in)."""
    return payload if payload.get("echo") else summarize(payload)


def hold(payload: dict[str, Any]) -> dict[str, Any]:
    """`disagg bench faults`' middle role: holds each request `hold` seconds (so that a
    replica that dies, drains or goes has some), then passes it on."""
    time.sleep(float(payload.get("hold", 0.0)))
    return payload
