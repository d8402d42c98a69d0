"""Peer authentication: every relay connection proves, both ways, that it holds the
pipeline's peer key before it is given anything.

The mechanism is an HMAC-SHA256 challenge-response (stdlib `hmac`, `secrets`; compared with
`hmac.compare_digest`), run once per connection inside the relay handshake:

    sender                                      ingress
    hello {relay, nonce: Ns}              -->   (nothing allocated but a challenge entry)
                                          <--   challenge {nonce: Ni}
    auth {mac: H(K, "sender", Ns, Ni)}    -->   checked; the ROUTER identity is now a peer
                                          <--   welcome {..., mac: H(K, "welcome", Ns, Ni, body)}

The sender checks the welcome's mac over its own fresh nonce and the welcome's fields, so
a pool name, grant or lane offer from anyone without the key is never trusted (and never
a replay of an old welcome). The ingress binds the result to the connection's ZMQ
identity, which the sender picks at random (`routing_id()`): a later connection cannot
guess it, and libzmq refuses a second connection under an identity that is connected.
The lane (relay/lane.py) opens with the one-time id of an authenticated welcome plus
`H(K, "lane", id)`. After the handshake messages carry no MAC: authentication costs
one extra round trip per connection and nothing per message. What it does not give:
confidentiality or integrity against someone on the path (see docs/security-runtime-notes.md).

ZMQ CURVE was the alternative: it would cover the ZMQ socket only (the lane is a plain
socket) and encrypts every message, a per-byte cost on the tcp data path.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Mapping
from typing import Any

KEY_ENV = "DISAGG_PEER_KEY_FILE"
KEY_MIN_BYTES = 32
NONCE_BYTES = 16
ROUTING_ID_BYTES = 16  # ingresses take hellos only from identities of this length


class PeerKeyError(ValueError):
    """The peer key is missing, unreadable or too short."""


def read_key(path: str) -> bytes:
    """The key in file `path`: its bytes with surrounding whitespace stripped."""
    if not path:
        raise PeerKeyError(
            f"{KEY_ENV} is required: the path of the pipeline's peer key "
            f"(at least {KEY_MIN_BYTES} bytes); roles refuse to run without one"
        )
    try:
        with open(path, "rb") as f:
            key = f.read().strip()
    except OSError as exc:
        raise PeerKeyError(f"{KEY_ENV}={path}: cannot read the peer key: {exc}") from None
    return check_key(key, f"{KEY_ENV}={path}")


def check_key(key: bytes, where: str = "peer key") -> bytes:
    if not isinstance(key, bytes) or len(key) < KEY_MIN_BYTES:
        got = len(key) if isinstance(key, bytes) else type(key).__name__
        raise PeerKeyError(f"{where}: a peer key must be at least {KEY_MIN_BYTES} bytes, not {got}")
    return key


def key_from_env(environ: Mapping[str, str] = os.environ) -> bytes:
    return read_key(environ.get(KEY_ENV, ""))


def new_key() -> bytes:
    """A fresh random key (hex text, so it can live in a file or a Secret as is)."""
    return secrets.token_hex(32).encode()


def nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def routing_id() -> bytes:
    return secrets.token_bytes(ROUTING_ID_BYTES)


def mac(key: bytes, label: str, *parts: str) -> str:
    """HMAC-SHA256 over the label and parts, each length-prefixed (no two lists of parts
    make the same message)."""
    message = b"".join(len(b).to_bytes(4, "big") + b for b in (p.encode() for p in (label, *parts)))
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def verify(key: bytes, given: object, label: str, *parts: str) -> bool:
    return isinstance(given, str) and hmac.compare_digest(given, mac(key, label, *parts))


def body(fields: Mapping[str, Any]) -> str:
    """A message's fields as canonical JSON, the MAC's own field left out."""
    return json.dumps(
        {k: v for k, v in fields.items() if k != "mac"}, sort_keys=True, separators=(",", ":")
    )


class Refusals:
    """Counts refused peers and logs them at a bounded rate (one line per `every_s`, with
    how many were refused since), so a flood cannot flood the log too."""

    def __init__(self, log: logging.Logger, where: str, every_s: float = 10.0) -> None:
        self._log = log
        self._where = where
        self._every = every_s
        self._lock = threading.Lock()
        self._last = float("-inf")
        self._since = 0
        self.count = 0

    def refuse(self, reason: str) -> None:
        with self._lock:
            self.count += 1
            self._since += 1
            now = time.monotonic()
            if now - self._last < self._every:
                return
            since, self._since, self._last = self._since, 0, now
        self._log.warning(
            "%s refused an unauthenticated peer (%d since the last report): %s",
            self._where,
            since,
            reason,
        )
