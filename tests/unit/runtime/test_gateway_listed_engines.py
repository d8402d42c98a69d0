"""The engine router over a listed table (the gateway on Kubernetes: every replica up to
the autoscaler's maximum, by pod DNS name), against fake engines on real sockets: replicas
that do not resolve or do not listen are skipped by the choice, never fail a request, and
are chosen once they answer; readiness names a role none of whose replicas answers."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

from disagg_core.contract import EngineEndpoint, EngineRoute
from disagg_runtime.gateway.engines import EngineRouter
from disagg_runtime.gateway.errors import HttpError

METRICS = "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0\n"
GONE = "pd-decode-2.pd-decode.default.svc.cluster.local"  # no such pod: it does not resolve


class FakeEngine:
    """Answers /metrics and /v1/completions as vLLM does, P/D style; counts its calls."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[dict[str, Any]] = []
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self, port: int = 0) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.complete)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=METRICS)

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls.append(body)
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            params = {"do_remote_prefill": True, "transfer": body["kv_transfer_params"]["transfer"]}
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": params})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"choices": [{"text": f"from {self.name}", "finish_reason": "stop"}]}
        await response.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
        return response


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest_asyncio.fixture
async def engines() -> AsyncIterator[tuple[FakeEngine, FakeEngine]]:
    prefill, decode = FakeEngine("prefill"), FakeEngine("decode/0")
    await prefill.start()
    await decode.start()
    yield prefill, decode
    await prefill.stop()
    await decode.stop()


def _router(prefill: FakeEngine, decodes: list[EngineEndpoint]) -> EngineRouter:
    table = {
        "prefill": (EngineEndpoint("prefill/0", f"http://127.0.0.1:{prefill.port}"),),
        "decode": tuple(decodes),
    }
    return EngineRouter(
        EngineRoute("prefill", "decode", "tcp"),
        lambda role: table[role],
        model="tiny",
        timeout=10.0,
        scrape_s=0.1,
        listed=True,
    )


async def _text(router: EngineRouter) -> str:
    return "".join([c["text"] async for c in router.stream({"prompt": "hi", "max_tokens": 2})])


@pytest.mark.asyncio
async def test_replicas_that_are_not_up_are_skipped(
    engines: tuple[FakeEngine, FakeEngine],
) -> None:
    prefill, decode = engines
    closed = _closed_port()
    router = _router(
        prefill,
        [
            EngineEndpoint("decode/0", f"http://127.0.0.1:{decode.port}", "tcp://d-0:7601"),
            EngineEndpoint("decode/1", f"http://127.0.0.1:{closed}", "tcp://d-1:7601"),
            EngineEndpoint("decode/2", f"http://{GONE}:8000", "tcp://d-2:7601"),
        ],
    )
    try:
        assert await router.unready() == ""
        answers = [await _text(router) for _ in range(6)]
        assert answers == ["from decode/0"] * 6
        assert len(decode.calls) == 6, "every request went to the one replica that is up"
        handed = [c["kv_transfer_params"]["decode"] for c in prefill.calls]
        assert handed == ["tcp://d-0:7601"] * 6, "the prefill engine was told decode/0's KV"
        assert router.up == {"prefill/0", "decode/0"}

        # decode/1 comes up (scaled up): it is chosen too once a scrape saw it
        second = FakeEngine("decode/1")
        await second.start(closed)
        try:
            for _ in range(100):
                if "decode/1" in router.up:
                    break
                await _text(router)
            assert "decode/1" in router.up
            before = len(second.calls)
            for _ in range(6):
                await _text(router)
            assert len(second.calls) - before == 3, "idle replicas take turns (round-robin)"
        finally:
            await second.stop()
    finally:
        await router.close()


@pytest.mark.asyncio
async def test_no_decode_replica_up_is_unready_and_a_503(
    engines: tuple[FakeEngine, FakeEngine],
) -> None:
    prefill, _ = engines
    router = _router(
        prefill,
        [EngineEndpoint("decode/0", f"http://{GONE}:8000", "tcp://d-0:7601")],
    )
    try:
        why = await router.unready()
        assert why == "engine role 'decode': none of its 1 replicas answers"
        with pytest.raises(HttpError) as raised:
            await _text(router)
        assert raised.value.status == 503 and "decode" in str(raised.value)
        assert prefill.calls == [], "nothing was prefilled for a decode that is not there"
    finally:
        await router.close()
