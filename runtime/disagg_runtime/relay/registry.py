"""Relay backends: each kind is one module that defines `BACKEND`, found here by name.

A backend module names its kind, its sending side (a `Relay` factory), the landing its
receivers make for senders of that kind (relay/landing.py; None: the plain shm/tcp
paths), and why this process cannot use it (`unavailable`: no CUDA, no package...).
Modules are imported on first use only, so an optional backend's library (CUDA
bindings, NIXL) is not imported by roles that never use it (vLLM's connector factory
works the same way). The kinds and what they mean are declared in disagg_core.relays
(the spec, CRD and docs read them there, without the runtime); a test checks both agree.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from disagg_core import relays
from disagg_core.compat import Compat
from disagg_runtime.relay.errors import RelayError
from disagg_runtime.relay.landing import Host, Landing
from disagg_runtime.wire.load import View


class Relay(Protocol):
    """What a role needs from a connection to one downstream peer."""

    @property
    def kind(self) -> str: ...

    @property
    def endpoint(self) -> str: ...

    @property
    def peer_compat(self) -> Compat | None: ...  # the receiver's advertised revision

    @property
    def peer_role(self) -> str | None: ...  # the role the receiver serves (None: not a role)

    def send(
        self,
        payload: Any,
        *,
        request_id: str,
        timeout: float | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> int: ...

    def abort(self, request_id: str) -> None: ...

    def view(self) -> View | None: ...

    def gone(self) -> bool: ...  # the receiver went away or restarted (not a goodbye)

    def close(self) -> None: ...


def _always() -> str | None:
    return None


@dataclass(frozen=True)
class Backend:
    """One relay kind's implementation (see the module docstring)."""

    kind: str
    sender: Callable[..., Relay]  # (endpoint, **options) -> an authenticated connection
    landing: Callable[[Host], Landing] | None = None
    unavailable: Callable[[], str | None] = _always  # why not here, or None
    needs: str = "nothing more"  # what `unavailable` checks for, in a few words

    @property
    def info(self) -> relays.RelayInfo:
        return relays.BY_NAME[self.kind]


_MODULES: dict[str, str] = {
    "shm": "disagg_runtime.relay.backends.shm",
    "tcp": "disagg_runtime.relay.backends.tcp",
    "cuda-ipc": "disagg_runtime.relay.backends.cuda_ipc",
    "nixl": "disagg_runtime.relay.backends.nixl",  # optional: imports nixl only when used
}
_loaded: dict[str, Backend] = {}


def register(kind: str, module: str) -> None:
    """Make `kind` the backend defined by `module` (imported on first use)."""
    if kind not in relays.BY_NAME:
        raise RelayError(f"relay {kind!r} is not declared in disagg_core.relays")
    _MODULES[kind] = module
    _loaded.pop(kind, None)


def kinds() -> tuple[str, ...]:
    """The registered kinds (without importing any backend)."""
    return tuple(_MODULES)


def find(kind: str) -> Backend | None:
    """The backend of `kind`, importing its module now; None if no such kind is registered."""
    backend = _loaded.get(kind)
    if backend is not None:
        return backend
    module = _MODULES.get(kind)
    if module is None:
        return None
    backend = importlib.import_module(module).BACKEND
    if not isinstance(backend, Backend) or backend.kind != kind:
        raise RelayError(f"{module}.BACKEND is not the backend of relay {kind!r}")
    _loaded[kind] = backend
    return backend


def backend(kind: str) -> Backend:
    """Like `find`, but an unknown kind is an error naming the known ones."""
    found = find(kind)
    if found is None:
        raise RelayError(f"unknown relay {kind!r}; expected one of {', '.join(kinds())}")
    return found
