"""The `kubernetes` Service of the node: how pods reach the API server.

On a cluster, kube-proxy maps the `kubernetes` Service's cluster IP (port 443) to the API
server, and the kubelet gives every container `KUBERNETES_SERVICE_HOST`/`PORT` for it. Here
pods reach only the bridge, so the node forwards the bridge address, port 443, to the
emulator's loopback port, byte for byte (TLS passes through: the emulator's certificate
names the bridge address). `InCluster` is what the kubelet needs to give pods in-cluster
credentials: the cluster CA and a token per service account.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

PORT = 443
MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
# the names of the `kubernetes` Service: the cluster DNS answers the last with the bridge
# address, and the API server's certificate names them all (as a cluster's does): clients
# that do not read KUBERNETES_SERVICE_HOST (kopf's own in-cluster login) use them
NAMES = (
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)
VOLUME = "kube-api-access"


@dataclass(frozen=True)
class InCluster:
    """`ca_pem`: the cluster CA (the pods' ca.crt); `token_for(namespace, account)`: the
    token the API server accepts for that service account (the kubelet's TokenRequest)."""

    ca_pem: bytes
    token_for: Callable[[str, str], str]
    host: str = ""  # the bridge address, set by the node
    port: int = PORT

    def env(self) -> dict[str, str]:
        """The variables the kubelet sets in every container for the `kubernetes` Service."""
        tcp = f"tcp://{self.host}:{self.port}"
        return {
            "KUBERNETES_SERVICE_HOST": self.host,
            "KUBERNETES_SERVICE_PORT": str(self.port),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(self.port),
            "KUBERNETES_PORT": tcp,
            f"KUBERNETES_PORT_{self.port}_TCP": tcp,
            f"KUBERNETES_PORT_{self.port}_TCP_PROTO": "tcp",
            f"KUBERNETES_PORT_{self.port}_TCP_PORT": str(self.port),
            f"KUBERNETES_PORT_{self.port}_TCP_ADDR": self.host,
        }


class Forwarder:
    """host:port -> upstream_host:upstream_port, one upstream connection per client."""

    def __init__(self, host: str, port: int, upstream: tuple[str, int]) -> None:
        self.host, self.port, self.upstream = host, port, upstream
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self._closing = False

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._connected, self.host, self.port)

    async def stop(self) -> None:
        """Close the port and end every connection. A connection the loop accepted before the
        close is made a turn or two later: `_connected` closes it then, so nothing outlives
        this (a handler left pending would be closed by the garbage collector after the loop,
        and its `finally` would raise there)."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The server's callback as each connection is made: its handler is registered here,
        synchronously, so `stop` sees it even before it first runs."""
        if self._closing:
            writer.close()
            return
        task = asyncio.get_running_loop().create_task(self._client(reader, writer))
        self._pipes.add(task)
        task.add_done_callback(self._pipes.discard)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()
