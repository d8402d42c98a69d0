"""Send with failover, written once: run an operation (a send, a reservation) on the relay
a `Route` opens, and when the replica is lost before anything of it was delivered
(PeerLost: it restarted, its pod went away, its address now serves another role, or it
did not answer the handshake), drop that relay, let the route choose again, and try once
more within the same time. Any other relay error drops the relay and is raised.

    with_failover(route, operation, timeout)
        attempt 1: relay = route.open(first=True)  -> operation(relay, seconds left)
          PeerLost -> route.discard(relay); route.lost(exc)   (forget the pin, look again)
        attempt 2: relay = route.open(first=False) -> operation(relay, seconds left)
          PeerLost / RelayError -> raised

Routes: `Cached` (a RelayCache relay to an endpoint, `repick` naming the next one: the
client's submissions and reservations, a role's replies), `DedicatedTcp` (a connection of
the transfer's own: the client's uploads), and forward.Paired (a role's sends downstream,
whose choice also waits for a replica that pairs with its revision). Request migration
(a request lost with the replica that held it, resent whole by its first sender) sits
above this: see client.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

from disagg_runtime.relay import PeerLost, Relay, RelayError, TcpSender, Unanswered
from disagg_runtime.routing.relays import Dedicated, RelayCache

T = TypeVar("T")
R = TypeVar("R", bound=Relay)
R_co = TypeVar("R_co", bound=Relay, covariant=True)
log = logging.getLogger(__name__)
ATTEMPTS = 2  # the first choice and one more, chosen afresh


class Route(Protocol[R_co]):
    """Where an operation runs: which replica, reached how."""

    endpoint: str  # the replica last opened or tried (named in errors and logs)

    def open(self, *, first: bool, seconds: float) -> R_co:
        """The relay to the chosen replica (PeerLost when it cannot be had: try another)."""
        ...

    def discard(self, relay: Relay) -> None:
        """Forget a relay that failed, so the next use reconnects."""
        ...

    def keep(self, relay: Relay) -> None:
        """The operation failed, not the relay (a payload refused, say): it stays usable."""
        ...

    def lost(self, exc: PeerLost) -> None:
        """The replica was lost (nothing delivered): choose again for the next `open`."""
        ...


def left(deadline: float) -> float:
    """Seconds until `deadline` (monotonic), at least 50 ms: a last try is not refused."""
    return max(0.05, deadline - time.monotonic())


def with_failover(
    route: Route[R], operation: Callable[[R, float], T], *, timeout: float
) -> tuple[R, T]:
    """`operation(relay, seconds left)` on the relay `route` opens, once more on another
    replica when the first is lost (see the module docstring); the relay and the result."""
    deadline = time.monotonic() + timeout
    for attempt in range(1, ATTEMPTS + 1):
        relay: R | None = None
        try:
            relay = route.open(first=attempt == 1, seconds=left(deadline))
            return relay, operation(relay, left(deadline))
        except PeerLost as exc:
            if relay is not None:  # (one that failed to open, or WrongRole, is not kept)
                route.discard(relay)
            if attempt == ATTEMPTS:
                raise
            route.lost(exc)
            log.info("sending again, to %s: %s", route.endpoint, exc)
        except RelayError:
            if relay is not None:
                route.discard(relay)
            raise
        except BaseException:
            if relay is not None:
                route.keep(relay)
            raise
    raise AssertionError("unreachable")


class Cached:
    """A shared relay from `relays` to `endpoint`; after a loss, to the endpoint `repick`
    names (a fresh look at the replicas: one scaled away is no longer among them), else
    the same one. One that did not answer (Unanswered) is reported to `unanswered` first,
    so that `repick` skips it; the second try may take all the time left."""

    def __init__(
        self,
        relays: RelayCache,
        kind: str,
        endpoint: str,
        *,
        repick: Callable[[], str] | None = None,
        role: str | None = None,
        unanswered: Callable[[str], None] | None = None,
        gone: Callable[[str, str], None] | None = None,
    ) -> None:
        self.relays = relays
        self.kind = kind
        self.endpoint = endpoint
        self._repick = repick
        self._role = role
        self._unanswered = unanswered
        self._gone = gone  # told (kind, endpoint) of a receiver that went away or restarted
        self._was_gone = False

    def open(self, *, first: bool, seconds: float) -> Relay:
        return self.relays.get(
            self.kind, self.endpoint, timeout=seconds, role=self._role, bounded=first
        )

    def discard(self, relay: Relay) -> None:
        self._was_gone = relay.gone()
        self.relays.drop(self.kind, self.endpoint, relay)
        if self._was_gone and self._gone is not None:
            self._gone(self.kind, self.endpoint)

    def keep(self, relay: Relay) -> None:
        pass  # shared: it stays in the cache

    def lost(self, exc: PeerLost) -> None:
        """A replica that did not answer, or whose receiver went away, is skipped a while
        (`unanswered`), then another one is picked."""
        gone = isinstance(exc, Unanswered) or self._was_gone
        if gone and self._unanswered is not None:
            self._unanswered(self.endpoint)
        if self._repick is not None:
            self.endpoint = self._repick()


class DedicatedTcp:
    """A tcp connection of the transfer's own from `dedicated` (see relays.Dedicated); one
    that failed is handed back, which closes it unless it is in good order (a lost one
    never is). `choose(first)` names the replica."""

    def __init__(
        self,
        dedicated: Dedicated,
        choose: Callable[[bool], str],
        *,
        role: str | None = None,
        unanswered: Callable[[str], None] | None = None,
    ) -> None:
        self.dedicated = dedicated
        self._choose = choose
        self._role = role
        self._unanswered = unanswered
        self.endpoint = choose(True)
        self._rechoose = False

    def open(self, *, first: bool, seconds: float) -> TcpSender:
        if self._rechoose:
            self.endpoint = self._choose(False)
        return self.dedicated.take(self.endpoint, timeout=seconds, role=self._role, bounded=first)

    def discard(self, relay: Relay) -> None:
        assert isinstance(relay, TcpSender)
        self.dedicated.give(relay)

    keep = discard

    def lost(self, exc: PeerLost) -> None:
        if isinstance(exc, Unanswered) and self._unanswered is not None:
            self._unanswered(self.endpoint)
        self._rechoose = True


def send(
    relays: RelayCache,
    kind: str,
    endpoint: str,
    payload: Any,
    *,
    request_id: str,
    timeout: float,
    meta: Mapping[str, Any] | None = None,
    repick: Callable[[], str] | None = None,
    role: str | None = None,
    lost: Callable[[str], None] | None = None,
    gone: Callable[[str, str], None] | None = None,
) -> tuple[Relay, int]:
    """Send `payload` on the shared relay to `endpoint` with failover (`Cached`); the relay
    it went on and the bytes moved."""
    route = Cached(relays, kind, endpoint, repick=repick, role=role, unanswered=lost, gone=gone)
    return with_failover(
        route,
        lambda relay, remaining: relay.send(
            payload, request_id=request_id, timeout=remaining, meta=meta
        ),
        timeout=timeout,
    )


def on_relay(
    relays: RelayCache,
    kind: str,
    endpoint: str,
    operation: Callable[[Relay, float], T],
    *,
    timeout: float,
    repick: Callable[[], str] | None = None,
    role: str | None = None,
    lost: Callable[[str], None] | None = None,
) -> tuple[Relay, T]:
    """`operation(relay, seconds left)` on the shared relay to `endpoint`, with failover."""
    route = Cached(relays, kind, endpoint, repick=repick, role=role, unanswered=lost)
    return with_failover(route, operation, timeout=timeout)
