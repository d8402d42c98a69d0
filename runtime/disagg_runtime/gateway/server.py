"""`disagg gateway`: the contract's environment -> a `Client` and the HTTP server.

The gateway is the pipeline's client inside the cluster: its `Client` binds the reply
ingress (DISAGG_INGRESS_PORT, advertised at DISAGG_POD_IP) that exit roles send results
to, and submits to the entry roles of DISAGG_DOWNSTREAM. `disagg up --serve` builds the
same objects around its local pipeline. A topology with `engines` (the operator's, for
engine roles) gets no `Client`: the engine router, over HTTP (`engine_gateway_for`).
SIGTERM: stop taking connections, let requests in flight finish for the grace period,
then close the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from disagg_core.contract import ContractError, GatewayConfig, parse_gateway_env
from disagg_runtime.client import Client
from disagg_runtime.gateway import limits
from disagg_runtime.gateway.app import READY_CACHE_S, GatewayApp, Settings
from disagg_runtime.gateway.bridge import Bridge
from disagg_runtime.gateway.engines import EngineRouter
from disagg_runtime.gateway.token import BearerToken
from disagg_runtime.memory.pool import PoolError
from disagg_runtime.relay import NotAPeer, RelayError, TcpSender
from disagg_runtime.relay.auth import PeerKeyError, read_key
from disagg_runtime.routing import migration
from disagg_runtime.routing.peers import PeerSet
from disagg_runtime.tracing import open_tracer

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 1.0
PROBE_REPLICAS = 3
READ_BUFSIZE = 4 << 20  # bytes a connection may buffer before reading pauses (aiohttp: 64 KiB)


def client_for(config: GatewayConfig) -> Client:
    """The gateway's client: it authenticates to the roles with the pipeline's peer key."""
    relay = "shm" if config.node_local else "tcp"
    return Client(
        config.entries,
        config.topology.exit_roles,
        pipeline=config.pipeline,
        entry_relay=relay,
        reply_relay=relay,
        bind_host=config.bind_host,
        bind_port=config.reply_port,
        advertise_host=config.advertise_host,
        pool_size=config.pool_size,
        timeout=config.request_timeout,
        peers_file=config.peers_file,
        key=read_key(config.peer_key_file),
        hashed_roles=[r for r in config.topology.entry_roles if config.topology.roles[r].joins],
        migrate=migration.Policy.of(config.topology),
    )


def entries_ready(client: Client) -> Callable[[], Awaitable[str]]:
    """Readiness: for every entry role, one replica (of the first PROBE_REPLICAS listed)
    completes the peer handshake within CONNECT_TIMEOUT_S: it is reachable, proves the
    pipeline's key, and accepts ours. A fresh handshake each time, not a cached relay,
    which could be to a replica that has gone since. "" when ready, else why not; checked
    at most once per READY_CACHE_S."""
    last: list[Any] = [float("-inf"), "not checked yet"]

    async def check() -> str:
        if time.monotonic() - float(last[0]) < READY_CACHE_S:
            return str(last[1])
        problems = await asyncio.to_thread(_probe_all, client)
        last[:] = [time.monotonic(), "; ".join(problems)]
        return str(last[1])

    return check


def _probe_all(client: Client) -> list[str]:
    problems = []
    for peers in client.entries:
        problem = _probe(peers, client.key)
        if problem:
            problems.append(f"entry role {peers.peer.role}: {problem}")
    return problems


def _probe(peers: PeerSet, key: bytes) -> str:
    """Empty if one replica of `peers` completes the handshake, else the last failure."""
    endpoints = peers.endpoints(refresh=True)
    if not endpoints:
        return "no replica listed"
    problem = ""
    for endpoint in endpoints[:PROBE_REPLICAS]:
        try:
            TcpSender(
                endpoint,
                key=key,
                timeout=CONNECT_TIMEOUT_S,
                lane=False,
                inline_max=0,
            ).close()
            return ""
        except NotAPeer as exc:
            problem = f"{endpoint} failed authentication: {exc}"
        except (RelayError, OSError) as exc:
            problem = f"{endpoint} not reachable: {exc}"
    return problem


def gateway_for(client: Client, settings: Settings) -> GatewayApp:
    tracer = open_tracer(
        f"{settings.pipeline}/gateway",
        resource={"disagg.pipeline": settings.pipeline, "disagg.role": "gateway"},
    )
    return GatewayApp(
        settings=settings, pipeline=Bridge(client), ready=entries_ready(client), tracer=tracer
    )


def engine_gateway_for(config: GatewayConfig, settings: Settings) -> GatewayApp:
    """The gateway in front of engine roles (the topology's `engines`: every replica up to
    the autoscalers' maxima): OpenAI requests routed P/D by the same router `disagg up`
    uses, over the replicas whose /metrics answers; ready once every role has one."""
    table = config.topology.engines
    assert table is not None
    table.check()
    router = EngineRouter(
        table.route,
        lambda role: table.replicas.get(role, ()),
        model=config.model,
        timeout=config.request_timeout,
        listed=True,
    )
    tracer = open_tracer(
        f"{settings.pipeline}/gateway",
        resource={"disagg.pipeline": settings.pipeline, "disagg.role": "gateway"},
    )
    return GatewayApp(
        settings=settings, pipeline=None, ready=router.unready, tracer=tracer, engines=router
    )


class Server:
    """An aiohttp server for one `GatewayApp` on the running loop; with `unix`, on that Unix
    socket too (a sidecar or a local client: no TCP stack between them)."""

    def __init__(self, gateway: GatewayApp, host: str, port: int, unix: str | None = None) -> None:
        self.gateway = gateway
        self.host = host
        self.port = port
        self.unix = unix
        settings = gateway.settings
        self._runner = limits.Runner(
            gateway.app(),
            max_connections=settings.max_connections,
            keepalive_timeout=settings.idle_timeout,
            handler_cancellation=True,
            access_log=None,
            read_bufsize=READ_BUFSIZE,
        )

    async def start(self) -> int:
        """Listen; returns the bound port (the one asked for, or a free one for 0)."""
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        if self.unix:
            await web.UnixSite(self._runner, self.unix).start()
        for address in self._runner.addresses:
            self.port = int(address[1])
            break
        return self.port

    async def stop(self, grace_s: float = 10.0) -> None:
        await self._runner.shutdown()
        await self._runner.cleanup()


async def serve_until(
    gateway: GatewayApp,
    host: str,
    port: int,
    *,
    on_listening: Callable[[int], None] = lambda port: None,
    stop: asyncio.Event | None = None,
    unix: str | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT (or `stop`); on the Unix socket `unix` too, if given."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    server = Server(gateway, host, port, unix)
    on_listening(await server.start())
    try:
        await stop.wait()
    finally:
        await server.stop()


def settings_for(config: GatewayConfig) -> Settings:
    return Settings(
        pipeline=config.pipeline,
        api=config.api,
        model=config.model,
        token=BearerToken.from_file(config.token_file) if config.token_file else BearerToken(),
        max_body=config.max_body,
        timeout=config.request_timeout,
        idle_timeout=config.idle_timeout,
        max_connections=config.max_connections,
        max_json=config.max_json,
        max_tokens=config.max_tokens,
    )


def main(unix: str | None = None) -> int:
    """`disagg gateway`: read the contract from the environment and serve (on the Unix
    socket `unix` too, if given)."""
    import os

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    client: Client | None = None
    try:
        config = parse_gateway_env(os.environ)
        settings = settings_for(config)
        if config.topology.engines is not None:
            gateway = engine_gateway_for(config, settings)
        else:
            client = client_for(config)
            gateway = gateway_for(client, settings)
    except (ContractError, PeerKeyError, PoolError, OSError) as exc:
        log.error("cannot start the gateway: %s", exc)
        return 2
    try:
        asyncio.run(
            serve_until(
                gateway,
                config.bind_host,
                config.port,
                on_listening=lambda port: log.info(
                    "gateway of %s serving on %s:%d%s",
                    config.pipeline,
                    config.bind_host,
                    port,
                    f" and {unix}" if unix else "",
                ),
                unix=unix,
            )
        )
    finally:
        if client is not None:
            gateway.bridge.close()
            client.close()
        gateway.tracer.shutdown()
    return 0
