"""Which decode ingresses a prefill engine may open a connection to.

A request names its decode engine (`kv_transfer_params.decode`), and requests come from
the network: without a bound, a prefill engine would open a tcp connection to any host
and port a client names (mutual authentication keeps the KV away from a non-peer, but
the connection, and its handshake, would still go out). So a prefill engine sends only to
the endpoints it was configured with, from `kv_connector_extra_config`:

    "decodes": ["tcp://decode-0:7600", ...]   # a fixed list
    "decodes_file": PATH                        # endpoints one a line (# comments), re-read
                                                # when it changes (replicas come and go)
    "decodes": "any"                            # explicitly open: any peer-key holder

both lists together allow their union; with neither, every send is refused, saying how to
configure it. A refused endpoint is a request error (the prefill response's
`kv_transfer_params.error`), never a connection.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from disagg_runtime.engines.vllm.params import ENDPOINT, ParamsError

ANY = "any"
MAX_PEERS = 4096
MAX_FILE_BYTES = 1 << 20


def parse_endpoints(values: Any, where: str) -> frozenset[str]:
    """A list of decode endpoints, each checked (ParamsError naming `where[i]`)."""
    if not isinstance(values, (list, tuple)) or len(values) > MAX_PEERS:
        raise ParamsError(f"{where}: expected a list of at most {MAX_PEERS} tcp://HOST:PORT")
    out = set()
    for i, value in enumerate(values):
        if not isinstance(value, str) or not ENDPOINT.fullmatch(value):
            raise ParamsError(f"{where}[{i}]: expected tcp://HOST:PORT, got {value!r}")
        out.add(value)
    return frozenset(out)


def parse_peers_file(text: str, where: str) -> frozenset[str]:
    """A peers file: one endpoint a line; blank lines and `#` comments are skipped."""
    lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    return parse_endpoints([line for line in lines if line], where)


@dataclass(frozen=True)
class Allowed:
    """The decision for one endpoint: `reason` says why not (None: allowed)."""

    reason: str | None

    @property
    def ok(self) -> bool:
        return self.reason is None


class DecodePeers:
    """The allow-list of a prefill engine (thread-safe; the file is re-read on change)."""

    def __init__(
        self, endpoints: frozenset[str] = frozenset(), path: str | None = None, *, open_: bool
    ) -> None:
        self.open = open_
        self._fixed = endpoints
        self._path = path
        self._lock = threading.Lock()
        self._seen: tuple[float, int] | None = None  # (mtime, size) of the file last read
        self._from_file: frozenset[str] = frozenset()
        self._file_error: str | None = None

    @classmethod
    def from_config(cls, extra: Mapping[str, Any]) -> DecodePeers:
        """From kv_connector_extra_config (ParamsError naming the key when malformed)."""
        decodes = extra.get("decodes")
        path = extra.get("decodes_file")
        if path is not None and (not isinstance(path, str) or not path):
            raise ParamsError(
                f"kv_connector_extra_config.decodes_file: expected a path, got {path!r}"
            )
        if decodes == ANY:
            return cls(path=path, open_=True)
        fixed = (
            frozenset()
            if decodes is None
            else parse_endpoints(decodes, "kv_connector_extra_config.decodes")
        )
        peers = cls(fixed, path, open_=False)
        peers.endpoints()  # a missing or malformed file is said at start too (logged later)
        return peers

    def endpoints(self) -> frozenset[str]:
        """The endpoints allowed now (the file re-read if it changed)."""
        if self._path is None:
            return self._fixed
        with self._lock:
            try:
                st = os.stat(self._path)
                stamp = (st.st_mtime, st.st_size)
                if stamp != self._seen:
                    if st.st_size > MAX_FILE_BYTES:
                        raise ParamsError(f"larger than {MAX_FILE_BYTES} bytes")
                    with open(self._path, encoding="utf-8") as f:
                        text = f.read(MAX_FILE_BYTES + 1)
                    self._from_file = parse_peers_file(text, self._path)
                    self._seen = stamp
                    self._file_error = None
            except (OSError, ParamsError, UnicodeDecodeError) as exc:
                self._from_file, self._seen = frozenset(), None
                self._file_error = f"kv_connector_extra_config.decodes_file {self._path}: {exc}"
            return self._fixed | self._from_file

    def check(self, endpoint: str) -> Allowed:
        if self.open:
            return Allowed(None)
        allowed = self.endpoints()
        if endpoint in allowed:
            return Allowed(None)
        if not allowed:
            why = self._file_error or (
                "this prefill engine has no decode engines configured "
                "(kv_connector_extra_config.decodes: [tcp://HOST:PORT, ...], decodes_file, "
                'or decodes: "any" to send to any peer-key holder)'
            )
            return Allowed(f"kv_transfer_params.decode {endpoint} refused: {why}")
        return Allowed(
            f"kv_transfer_params.decode {endpoint} is not one of this prefill engine's "
            f"{len(allowed)} decode engines (kv_connector_extra_config.decodes/decodes_file)"
        )
