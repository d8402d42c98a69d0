"""Handlers of the rollout scenario (test_rollout.py): prefill stamps the compat token of its
own revision on what it sends; decode refuses a payload from another revision, so a request
that crossed revisions fails (and is counted) instead of passing unseen."""

from __future__ import annotations

import os
import time
from typing import Any

Payload = dict[str, Any]


def _token() -> str:
    """The revision this pod runs: its REVISION variable (roles[].env), else its compat."""
    return os.environ.get("REVISION") or os.environ.get("DISAGG_COMPAT", "")


def prefill(payload: Payload) -> Payload:
    return {"ids": payload["input_ids"], "prefill": _token()}


def decode(payload: Payload) -> Payload:
    mine = _token()
    if payload["prefill"] != mine:
        raise ValueError(f"crossed revisions: prefill {payload['prefill']} -> decode {mine}")
    time.sleep(0.02)
    return {"ids": payload["ids"], "prefill": payload["prefill"], "decode": mine}


def middle(payload: Payload) -> Payload:
    """The middle role of the kill scenario: passes the request on after a little work."""
    time.sleep(0.05)
    return payload
