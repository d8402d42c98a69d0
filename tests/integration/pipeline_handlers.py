"""Handlers for the integration-test pipelines (`pipeline_handlers:<name>` in a spec).

Role processes import this module by name, so tests put `tests/integration` on PYTHONPATH;
in-process roles take its functions from `tests.integration.pipeline_handlers`.

Payloads are dicts. Conventions every handler here follows:
    "x"      a tensor the handlers compute on (float32)
    "i"      the request number, carried through unchanged (to detect mix-ups)
    "sleep"  seconds `slow` (and `skip_ref`) sleep before answering
    "fail"   truthy: `maybe_fail` raises ValueError("boom <i>")
    "n"      chunks `stream` yields; "fail_after": raise after that many chunks
    "die"    truthy: `die_on` ends its process at once (os._exit(1)), as a crash would
             (`sample_input("forward", 5)` is the one request that carries it)

`sample_input(handler, i)` is what `disagg up` sends when the entry role runs `handler`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import torch

REF_PATH = "cond.emb"  # the tensor reference the ref pipelines mark on their first edge
BIG = 64 * 1024  # float32 elements: 256 KiB: staged in shm pools (tcp to host pools: inline)

Payload = dict[str, Any]


def identity(payload: Payload) -> Payload:
    return payload


def scale(payload: Payload) -> Payload:
    """`x` times `factor` (default 2), after `sleep` seconds if given; everything else
    passes through untouched."""
    time.sleep(float(payload.get("sleep", 0.0)))
    return {**payload, "x": payload["x"] * float(payload.get("factor", 2.0))}


def fail(payload: Payload) -> Payload:
    raise ValueError(f"boom {payload.get('i')}")


def maybe_fail(payload: Payload) -> Payload:
    if payload.get("fail"):
        raise ValueError(f"boom {payload.get('i')}")
    return payload


def slow(payload: Payload) -> Payload:
    time.sleep(float(payload.get("sleep", 0.0)))
    return payload


def stream(payload: Payload) -> Iterator[Payload]:
    """`n` chunks {"k": k, "x": x + k, "i": i}; raises after `fail_after` chunks if given;
    sleeps `chunk_sleep` seconds before each chunk (a slow decoder)."""
    fail_after = payload.get("fail_after")
    pause = float(payload.get("chunk_sleep", 0.0))
    for k in range(int(payload["n"])):
        if fail_after is not None and k == int(fail_after):
            raise ValueError(f"boom mid-stream after {k} chunks")
        time.sleep(pause)
        yield {"k": k, "x": payload["x"] + k, "i": payload["i"]}


def left(payload: Payload) -> Payload:
    """Fan-out branch: x + 1."""
    return {"x": payload["x"] + 1, "i": payload["i"]}


def right(payload: Payload) -> Payload:
    """Fan-out branch: x * 10."""
    return {"x": payload["x"] * 10, "i": payload["i"]}


def join(payload: Payload) -> Payload:
    """Fan-in of roles `left` and `right`: their outputs keyed by role name."""
    if set(payload) != {"left", "right"}:
        raise ValueError(f"join expected inputs from left and right, got {sorted(payload)}")
    a, b = payload["left"], payload["right"]
    if a["i"] != b["i"]:
        raise ValueError(f"join got inputs of different requests: {a['i']} and {b['i']}")
    return {"sum": a["x"] + b["x"], "i": a["i"]}


def skip_ref(payload: Payload) -> Payload:
    """The role a tensor reference skips: it must never see `cond.emb`."""
    cond = payload.get("cond")
    if not isinstance(cond, dict) or "emb" in cond:
        raise ValueError(f"tensor reference {REF_PATH} reached the middle role: {cond!r:.80}")
    time.sleep(float(payload.get("sleep", 0.0)))
    if payload.get("fail"):
        raise ValueError(f"boom {payload.get('i')}")
    return payload


def needs_ref(payload: Payload) -> Payload:
    """The consumer of the reference: `cond.emb` must be back at its path, as a tensor."""
    emb = payload.get("cond", {}).get("emb")
    if not isinstance(emb, torch.Tensor):
        raise ValueError(f"tensor reference {REF_PATH} did not arrive: {payload.get('cond')!r:.80}")
    return payload


def forward(payload: Payload) -> Payload:
    """Identity, as the entry role of the crash pipeline (its sample inputs carry `die`)."""
    return payload


def die_on(payload: Payload) -> Payload:
    """Crash the role process (no cleanup, like a segfault or the OOM killer) on `die`."""
    if payload.get("die"):
        os._exit(1)
    time.sleep(float(payload.get("sleep", 0.0)))
    return payload


def sample_input(handler: str, i: int) -> Payload:
    """Request `i` for a pipeline whose entry role runs `handler` (used by `disagg up`)."""
    x = torch.full((BIG,), float(i), dtype=torch.float32)
    payload: Payload = {"x": x, "i": i}
    if handler == "slow":
        payload["sleep"] = 0.05
    elif handler == "scale":
        payload["factor"] = 2.0
    elif handler == "stream":
        payload["n"] = 3
    elif handler == "forward":
        payload.update(die=i == 5, sleep=0.05)
    elif handler in ("skip_ref", "needs_ref"):
        payload["cond"] = {"emb": torch.arange(BIG, dtype=torch.float32)}
    return payload
