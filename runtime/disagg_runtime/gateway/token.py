"""The gateway's bearer token: fixed, or read from a file and read again when it changes.

Kubernetes updates a mounted Secret by writing the new files into a fresh directory and
swapping the `..data` symlink to it, so the token's path stays and what it resolves to
changes. The file's identity (device, inode, size, mtime, through the symlinks) is checked
at most once per CHECK_S on use; when it differs the file is read again. A file that is
missing or empty for a moment (mid-swap, or a bad edit) keeps the last good token, with a
warning, rather than locking every client out or letting every client in.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Final

from disagg_core.contract import ContractError

log = logging.getLogger(__name__)
CHECK_S: Final = 1.0


def read_token(path: str) -> str:
    try:
        with open(path) as f:
            token = f.read().strip()
    except OSError as exc:
        raise ContractError(f"cannot read the gateway token file {path}: {exc}") from None
    if not token:
        raise ContractError(f"the gateway token file {path} is empty")
    return token


def _identity(path: str) -> tuple[int, ...] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class BearerToken:
    """`current()` is the token to compare with ("" means no token: auth is off)."""

    def __init__(self, value: str = "", *, path: str = "") -> None:
        self.path = path
        self._value = value
        self._identity = _identity(path) if path else None
        self._checked = time.monotonic()
        self._lock = threading.Lock()

    @classmethod
    def from_file(cls, path: str) -> BearerToken:
        """Read now (ContractError if unreadable or empty: the gateway does not start)."""
        identity = _identity(path)
        token = cls(read_token(path), path=path)
        token._identity = identity
        return token

    def current(self) -> str:
        if self.path and time.monotonic() - self._checked >= CHECK_S:
            self._reload()
        return self._value

    def _reload(self) -> None:
        with self._lock:
            self._checked = time.monotonic()
            identity = _identity(self.path)
            if identity is None or identity == self._identity:
                return  # unchanged, or gone for a moment: keep the last good token
            try:
                value = read_token(self.path)
            except ContractError as exc:
                log.warning("keeping the previous gateway token: %s", exc)
                return
            self._identity = identity
            if value != self._value:
                log.info("gateway token reloaded from %s", self.path)
            self._value = value
