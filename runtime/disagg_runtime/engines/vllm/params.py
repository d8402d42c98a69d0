"""`kv_transfer_params` of the disagg connector, parsed and bounded (pure).

They arrive in OpenAI requests, so from the network: every field is checked before the
engine acts on it, and a malformed one is refused naming the field (`ParamsError`; the
connector then serves the request without a transfer and logs why).

To the prefill engine (from the gateway):

    {"do_remote_decode": true, "transfer": ID, "decode": ENDPOINT, "relay": "shm"|"tcp"}

From it (its response's `kv_transfer_params`), and as given to the decode engine:

    {"do_remote_prefill": true, "transfer": ID, "tokens": N, "engine": PREFILL_ENGINE_ID}

or, when the prefill engine refused to send (malformed params, a decode endpoint it may
not send to: peers.py), a request error for the gateway to return:

    {"do_remote_prefill": false, "error": WHY}
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

RELAYS = ("shm", "tcp")
MAX_TOKENS = 1 << 22
_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
ENDPOINT = re.compile(r"tcp://[A-Za-z0-9.:\[\]_-]{1,255}:[0-9]{1,5}")


class ParamsError(ValueError):
    """kv_transfer_params are malformed (the message names the field)."""


@dataclass(frozen=True)
class SendTo:
    """The prefill side's order: send the prompt's blocks as `transfer` to `decode`."""

    transfer: str
    decode: str  # the decode engine's KV ingress (tcp://HOST:PORT)
    relay: str


@dataclass(frozen=True)
class LoadFrom:
    """The decode side's order: the prompt's `tokens` tokens of KV arrive as `transfer`."""

    transfer: str
    tokens: int
    engine: str


def transfer_id(value: Any, where: str = "kv_transfer_params.transfer") -> str:
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise ParamsError(f"{where}: expected 1-128 characters of [A-Za-z0-9._:-], got {value!r}")
    return value


def send_to(params: Mapping[str, Any] | None) -> SendTo | None:
    """The send order in a prefill request's params (None: not a P/D request)."""
    if not params or params.get("do_remote_decode") is not True:
        return None
    decode = params.get("decode")
    if not isinstance(decode, str) or not ENDPOINT.fullmatch(decode):
        raise ParamsError(f"kv_transfer_params.decode: expected tcp://HOST:PORT, got {decode!r}")
    relay = params.get("relay", "tcp")
    if relay not in RELAYS:
        raise ParamsError(f"kv_transfer_params.relay: expected one of {RELAYS}, got {relay!r}")
    return SendTo(transfer_id(params.get("transfer")), decode, relay)


def load_from(params: Mapping[str, Any] | None) -> LoadFrom | None:
    """The load order in a decode request's params (None: not a P/D request)."""
    if not params or params.get("do_remote_prefill") is not True:
        return None
    tokens = params.get("tokens")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 < tokens <= MAX_TOKENS:
        raise ParamsError(f"kv_transfer_params.tokens: expected 1-{MAX_TOKENS}, got {tokens!r}")
    engine = transfer_id(params.get("engine", "unknown"), "kv_transfer_params.engine")
    return LoadFrom(transfer_id(params.get("transfer")), tokens, engine)


def decode_params(order: SendTo, tokens: int, engine: str) -> dict[str, Any]:
    """What the prefill engine's response carries to the decode request."""
    return {
        "do_remote_prefill": True,
        "transfer": order.transfer,
        "tokens": tokens,
        "engine": engine,
    }


def refused(why: str) -> dict[str, Any]:
    """The prefill response's params when it sends nothing: the request's error."""
    return {"do_remote_prefill": False, "error": why}
