"""The gateway in front of engine roles: OpenAI requests to a prefill replica, then with its
`kv_transfer_params` to a decode replica, streamed back (pd.py says what is sent).

Upstream calls go through one `httpx.AsyncClient` (a bounded pool of keep-alive
connections, bounded timeouts) on the gateway's event loop: every request is a coroutine,
so concurrent requests reach an engine concurrently and its continuous batching is kept.
Replicas are chosen by free capacity (capacity.py) from each engine's own /metrics,
scraped every `scrape_s` in the background, and the requests this gateway has at each.
With `listed` (Kubernetes: every replica up to the autoscaler's maximum, by pod DNS name)
a replica counts as up only while its last scrape answered: one that does not resolve or
is not listening (scaled below the maximum, restarting) is skipped when choosing, and a
request that cannot connect to one marks it down until a scrape answers again.
Leaving the stream early (the client went away, a stop sequence matched) closes the
decode engine's stream, which aborts the request there.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import httpx

from disagg_core.contract import EngineEndpoint
from disagg_runtime.gateway import capacity, pd
from disagg_runtime.gateway.errors import RETRY_AFTER_S, HttpError

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 256  # to all engines together; further requests wait for one
MAX_EVENT_BYTES = 1 << 20  # one SSE line of an engine's stream


EngineReplica = EngineEndpoint  # one replica: key ("decode/0"), HTTP URL, KV endpoint
Replicas = Callable[[str], Sequence[EngineReplica]]  # a role's ready replicas, now


class EngineRouter:
    """Route OpenAI requests over `route`'s engine roles; `replicas` says which are up."""

    def __init__(
        self,
        route: pd.EngineRoute,
        replicas: Replicas,
        *,
        model: str,
        timeout: float,
        scrape_s: float = capacity.SCRAPE_S,
        stale_s: float = capacity.STALE_S,
        max_connections: int = MAX_CONNECTIONS,
        listed: bool = False,
    ) -> None:
        self.route = route
        self.replicas = replicas
        self.model = model
        self.timeout = timeout
        self.scrape_s = scrape_s
        self.stale_s = stale_s
        self._max_connections = max_connections
        self._http: httpx.AsyncClient | None = None
        self._scraper: asyncio.Task[None] | None = None
        self.loads: dict[str, capacity.Load] = {}
        self.inflight: collections.Counter[str] = collections.Counter()
        self._turns: dict[str, itertools.count[int]] = {}  # per role: a request picks from two
        self.prefill_s: collections.deque[float] = collections.deque(maxlen=1024)  # stage 1
        self.listed = listed
        self.up: set[str] = set()  # listed: the replicas whose last scrape answered
        self._scraped: asyncio.Event | None = None  # set once the first scrape is done

    @property
    def roles(self) -> tuple[str, ...]:
        return self.route.roles

    def _client(self) -> httpx.AsyncClient:
        """The upstream client, made on the running loop at first use; the scraper too."""
        if self._http is None:
            self._http = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout, connect=CONNECT_TIMEOUT_S),
                limits=httpx.Limits(
                    max_connections=self._max_connections,
                    max_keepalive_connections=self._max_connections,
                ),
                trust_env=False,  # engines are local or in-cluster: no proxy
            )
            self._scraped = asyncio.Event()
            self._scraper = asyncio.get_running_loop().create_task(self._scrape_forever())
        return self._http

    async def close(self) -> None:
        if self._scraper is not None:
            self._scraper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._scraper
        if self._http is not None:
            await self._http.aclose()

    # ---- load -----------------------------------------------------------------------------
    async def _scrape_forever(self) -> None:
        while True:
            await self.scrape()
            if self._scraped is not None:
                self._scraped.set()
            await asyncio.sleep(self.scrape_s)

    async def started(self) -> None:
        """Return once the first scrape is done (`listed`: which replicas are up is known)."""
        self._client()
        assert self._scraped is not None
        await self._scraped.wait()

    async def unready(self) -> str:
        """Why the router cannot route now ("": it can): a role none of whose replicas is
        up (`listed`) or ready."""
        await self.started()
        problems = []
        for role in self.roles:
            replicas = self._ready(role)
            if not replicas:
                listed = len(self.replicas(role))
                problems.append(f"engine role {role!r}: none of its {listed} replicas answers")
        return "; ".join(problems)

    def _ready(self, role: str) -> list[EngineReplica]:
        replicas = list(self.replicas(role))
        return [r for r in replicas if r.key in self.up] if self.listed else replicas

    async def scrape(self) -> None:
        """Every ready replica's load, at once; one that does not answer keeps its last
        (which goes stale: capacity.py then relies on the in-flight count)."""
        replicas = [r for role in self.roles for r in self.replicas(role)]
        await asyncio.gather(*(self._scrape(r) for r in replicas))
        live = {r.key for r in replicas}
        for key in [k for k in self.loads if k not in live]:
            del self.loads[key]
        self.up &= live

    async def _scrape(self, replica: EngineReplica) -> None:
        http = self._client()
        try:
            r = await http.get(replica.url + "/metrics", timeout=min(2.0, self.stale_s))
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # no such pod, not listening
            self.up.discard(replica.key)
            log.debug("scraping %s: %s", replica.url, exc)
            return
        except httpx.HTTPError as exc:  # a busy engine's slow answer: it stays up
            log.debug("scraping %s: %s", replica.url, exc)
            return
        if r.status_code != 200:
            self.up.discard(replica.key)
            return
        self.up.add(replica.key)
        if len(r.content) > capacity.MAX_METRICS_BYTES:
            return
        try:
            self.loads[replica.key] = capacity.parse_load(r.text, time.monotonic())
        except ValueError as exc:
            log.debug("scraping %s: %s", replica.url, exc)

    def _pick(self, role: str, paired_with: EngineReplica | None = None) -> EngineReplica:
        ready = self._ready(role)
        if paired_with is not None:  # the prefill replica in the decode replica's pod
            index = paired_with.key.rsplit("/", 1)[1]
            ready = [r for r in ready if r.key.rsplit("/", 1)[1] == index]
        if not ready:
            raise HttpError(
                503,
                f"no ready replica of engine role {role!r}"
                + (f" beside {paired_with.key}" if paired_with is not None else ""),
                kind="unavailable",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        by_key = {r.key: r for r in ready}
        key = capacity.choose(
            [r.key for r in ready],
            self.loads,
            self.inflight,
            now=time.monotonic(),
            turn=next(self._turns.setdefault(role, itertools.count())),
            stale_s=self.stale_s,
        )
        return by_key[key]

    # ---- requests -------------------------------------------------------------------------
    async def stream(self, payload: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """The answer's chunks (gateway/openai.py's shape) for one parsed request."""
        http = self._client()
        if self.listed:
            await self.started()
        body = pd.engine_body(payload, self.model)
        path = "/v1/chat/completions" if pd.is_chat(payload) else "/v1/completions"
        params = None
        role = self.route.entry
        if self.route.decode is not None:
            decode = self._pick(self.route.decode)
            params = await self._prefill(http, path, body, decode)
            target, role = decode, self.route.decode
        else:
            target = self._pick(role)
        self.inflight[target.key] += 1
        try:
            async for chunk in self._answer(http, target, role, path, pd.decode_body(body, params)):
                yield chunk
        finally:
            self.inflight[target.key] -= 1

    async def _prefill(
        self, http: httpx.AsyncClient, path: str, body: dict[str, Any], decode: EngineReplica
    ) -> dict[str, Any]:
        role = self.route.entry
        prefill = self._pick(role, decode if self.route.paired else None)
        sent = pd.prefill_body(
            body, transfer=uuid.uuid4().hex, decode=decode.kv_endpoint, relay=self.route.relay
        )
        started = time.monotonic()
        self.inflight[prefill.key] += 1
        try:
            r = await http.post(prefill.url + path, json=sent)
        except httpx.HTTPError as exc:
            raise self._unreachable(role, prefill, exc) from None
        finally:
            self.inflight[prefill.key] -= 1
        if r.status_code != 200:
            raise pd.engine_error(role, r.status_code, pd.parse_error_body(r.content))
        try:
            answer = r.json()
        except ValueError:
            raise HttpError(
                502, f"engine role {role!r} answered non-JSON", kind="role_failed"
            ) from None
        self.prefill_s.append(time.monotonic() - started)
        return pd.handed_off(answer, role)

    async def _answer(
        self,
        http: httpx.AsyncClient,
        target: EngineReplica,
        role: str,
        path: str,
        body: dict[str, Any],
    ) -> AsyncGenerator[dict[str, Any], None]:
        try:
            async with http.stream("POST", target.url + path, json=body) as r:
                if r.status_code != 200:
                    raw = b""
                    async for piece in r.aiter_bytes():
                        raw += piece
                        if len(raw) >= pd.MAX_ERROR_BYTES:
                            break
                    raise pd.engine_error(role, r.status_code, pd.parse_error_body(raw))
                async for line in r.aiter_lines():
                    if len(line) > MAX_EVENT_BYTES:
                        raise HttpError(
                            502,
                            f"engine role {role!r} streamed an oversized event",
                            kind="role_failed",
                        )
                    if not line.startswith("data:"):
                        continue
                    chunk = pd.chunk_of(line[5:], role)
                    if chunk is None:
                        return
                    yield chunk
        except httpx.HTTPError as exc:
            raise self._unreachable(role, target, exc) from None

    def _unreachable(self, role: str, replica: EngineReplica, exc: httpx.HTTPError) -> HttpError:
        """The client's error; a replica that could not be connected to is down until a
        scrape answers again (`listed`: the next request chooses among the others)."""
        if isinstance(exc, httpx.ConnectError):
            self.up.discard(replica.key)
        return _unreachable(role, replica, exc)


def _unreachable(role: str, replica: EngineReplica, exc: httpx.HTTPError) -> HttpError:
    """A connection that failed or timed out: 504 for a timeout, else 502/503."""
    if isinstance(exc, httpx.TimeoutException):
        return HttpError(
            504, f"engine role {role!r} ({replica.key}) timed out: {exc}", kind="timeout"
        )
    if isinstance(exc, httpx.ConnectError):
        return HttpError(
            503,
            f"engine role {role!r} ({replica.key}) is not reachable: {exc}",
            kind="unavailable",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    return HttpError(
        502, f"engine role {role!r} ({replica.key}) failed: {exc}", kind="role_failed", role=role
    )
