"""The test node's `kubernetes` Service forwarder (tests/k8s/node/apiserver.py): bytes pass
both ways, and `stop` leaves no connection handler behind, even one accepted just before it.

A handler left pending outlives the node's loop; when the garbage collector closes it later
its `finally` touches the closed loop, and that exception, raised inside whatever the
process was doing then (an `ast.parse` in CI), failed a whole test run.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from tests.k8s.node.apiserver import Forwarder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


def _handlers() -> list[asyncio.Task[object]]:
    return [
        t
        for t in asyncio.all_tasks()
        if not t.done() and t.get_coro().__qualname__ == "Forwarder._client"  # type: ignore[union-attr]
    ]


def test_bytes_pass_both_ways_and_stop_leaves_no_handler() -> None:
    async def scenario() -> None:
        upstream = await asyncio.start_server(_echo, "127.0.0.1", 0)
        forwarder = Forwarder("127.0.0.1", _free_port(), upstream.sockets[0].getsockname()[:2])
        await forwarder.start()
        reader, writer = await asyncio.open_connection(forwarder.host, forwarder.port)
        writer.write(b"ping")
        await writer.drain()
        assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
        await forwarder.stop()
        assert _handlers() == []
        assert await asyncio.wait_for(reader.read(), 5) == b""  # the forwarder hung up
        writer.close()
        upstream.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("turns", range(6))
def test_clients_accepted_just_before_stop_leave_no_handler(turns: int) -> None:
    """`turns` loop iterations between the connects and `stop`: the accept, the transport and
    the handler task each take one, so some of these stop between them."""

    async def scenario() -> None:
        upstream = await asyncio.start_server(_echo, "127.0.0.1", 0)
        forwarder = Forwarder("127.0.0.1", _free_port(), upstream.sockets[0].getsockname()[:2])
        await forwarder.start()
        clients = []
        for _ in range(8):  # connected, but their handlers have not run yet
            clients.append(socket.create_connection((forwarder.host, forwarder.port), timeout=5))
        for _ in range(turns):
            await asyncio.sleep(0)
        await forwarder.stop()
        for _ in range(20):  # whatever the loop still had to do for them
            await asyncio.sleep(0)
        assert _handlers() == []
        for client in clients:
            client.close()
        upstream.close()

    asyncio.run(scenario())
