"""The gateway's bounds before and around authentication (issue 30: items 2, 6, 8, 10, 12),
against a real aiohttp server on loopback driven by raw sockets and httpx. The pipeline is
a stand-in (`Scripted`): these bounds are the gateway's own, before any role is involved."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import Any

import httpx
import pytest

from disagg_runtime.gateway import limits, openai
from disagg_runtime.gateway.app import GatewayApp, Settings
from disagg_runtime.gateway.server import Server

MODEL = "m"
TOKEN = "s3cret"


class Scripted:
    """A pipeline that streams `chunks` text pieces of `piece` (for stop sequences)."""

    def __init__(self, piece: str = "a" * 64, chunks: int = 400) -> None:
        self.piece = piece
        self.chunks = chunks

    async def stream(self, payload: Any, **_: Any) -> AsyncGenerator[Any, None]:
        for _chunk in range(self.chunks):
            yield {"text": self.piece, "token_ids": [1]}
            await asyncio.sleep(0)
        yield {"text": "", "finish_reason": "length"}

    async def call(self, payload: Any, **_: Any) -> Any:
        return payload

    def close(self) -> None:
        pass


async def always_ready() -> str:
    return ""


class Served:
    def __init__(self, settings: Settings, pipeline: Scripted | None = None) -> None:
        scripted = pipeline or Scripted()
        gateway = GatewayApp(settings=settings, pipeline=scripted, ready=always_ready)  # type: ignore[arg-type]
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = Server(gateway, "127.0.0.1", 0)
        self.port = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def settings(**overrides: Any) -> Settings:
    return Settings(pipeline="bounds", api="openai", model=MODEL, token=TOKEN, **overrides)


@pytest.fixture
def serve() -> Iterator[Callable[..., Served]]:
    """Start a gateway with these Settings overrides (stopped after the test)."""
    started: list[Served] = []

    def start(**overrides: Any) -> Served:
        started.append(Served(settings(**overrides)))
        return started[-1]

    yield start
    for server in started:
        server.close()


@pytest.fixture
def served(serve: Callable[..., Served]) -> Served:
    return serve()


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def healthz_latency(url: str, until: threading.Event) -> list[float]:
    took = []
    with httpx.Client(timeout=10) as http:
        while not until.is_set():
            started = time.monotonic()
            assert http.get(f"{url}/healthz").status_code == 200
            took.append(time.monotonic() - started)
            time.sleep(0.01)
    return took


# ---- item 2: stop sequences -------------------------------------------------------------------
def test_a_stop_longer_than_the_cap_is_refused_at_once(served: Served) -> None:
    body = {"model": MODEL, "prompt": "x", "stop": ["a" * 60_000 + "b"], "stream": True}
    started = time.monotonic()
    answer = httpx.post(f"{served.url}/v1/completions", json=body, headers=AUTH, timeout=5)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "$.stop[0]"
    assert time.monotonic() - started < 2
    many = {"model": MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}
    assert httpx.post(f"{served.url}/v1/completions", json=many, headers=AUTH).status_code == 400


def test_healthz_stays_responsive_under_the_most_hostile_stops_allowed(served: Served) -> None:
    """Four stops of the longest length allowed, each almost matching every chunk's end:
    the hold-back is linear, so a long stream of such chunks never stalls the loop."""
    stops = ["a" * (openai.MAX_STOP_CHARS - 1) + c for c in "bcde"]
    body = {"model": MODEL, "prompt": "x", "stop": stops, "stream": True, "max_tokens": 10}
    done = threading.Event()
    latencies: list[float] = []
    probe = threading.Thread(target=lambda: latencies.extend(healthz_latency(served.url, done)))
    probe.start()
    try:
        for _ in range(3):
            with httpx.stream(
                "POST", f"{served.url}/v1/completions", json=body, headers=AUTH, timeout=30
            ) as answer:
                assert answer.status_code == 200
                text = "".join(
                    json.loads(line[6:])["choices"][0]["text"]
                    for line in answer.iter_lines()
                    if line.startswith("data: {") and json.loads(line[6:])["choices"]
                )
        assert text == "a" * 64 * 400
    finally:
        done.set()
        probe.join(30)
    assert latencies and max(latencies) < 0.5, max(latencies)


def test_the_hold_back_matches_the_quadratic_definition() -> None:
    import random

    rng = random.Random(7)
    for _ in range(2000):
        stop = "".join(rng.choice("ab") for _ in range(rng.randint(1, 8)))
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        if stop in text:
            continue
        naive = max((k for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
        assert openai._overlap(text, stop) == naive, (text, stop)


# ---- item 6: connections before authentication ------------------------------------------------
def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    return s


def closed_by_server(s: socket.socket, within: float) -> bool:
    s.settimeout(within)
    try:
        while True:
            data = s.recv(4096)
            if not data:
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_slow_headers_and_idle_connections_are_closed(serve: Callable[..., Served]) -> None:
    served = serve(idle_timeout=1.0)
    idle = [connect(served.port) for _ in range(20)]
    slow = [connect(served.port) for _ in range(20)]
    try:
        for s in slow:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        for _ in range(3):  # keep trickling header lines: never completing them
            time.sleep(0.4)
            for s in slow:
                s.sendall(b"X-Slow: 1\r\n")
        started = time.monotonic()
        assert all(closed_by_server(s, within=5) for s in idle + slow)
        assert time.monotonic() - started < 5
        assert httpx.get(f"{served.url}/healthz").status_code == 200
    finally:
        for s in idle + slow:
            s.close()


def test_connections_over_the_cap_are_turned_away_with_503(serve: Callable[..., Served]) -> None:
    served = serve(max_connections=8)
    held = [connect(served.port) for _ in range(8)]
    try:
        time.sleep(0.2)
        extra = connect(served.port)
        extra.settimeout(5)
        assert extra.recv(4096).startswith(b"HTTP/1.1 503")
        extra.close()
        held.pop().close()
        time.sleep(0.2)
        assert httpx.get(f"{served.url}/healthz").status_code == 200
    finally:
        for s in held:
            s.close()


# ---- item 8: JSON bodies ----------------------------------------------------------------------
def test_a_json_body_over_the_json_limit_is_413_before_it_is_read(served: Served) -> None:
    limit = Settings(pipeline="x").json_limit
    assert limit <= 16 * 2**20
    big = b'{"inputs": "' + b"a" * limit + b'"}'
    answer = httpx.post(
        f"{served.url}/v1/infer",
        content=big,
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=30,
    )
    assert answer.status_code == 413 and "safetensors" in answer.text


def test_json_bytes_in_flight_are_bounded(serve: Callable[..., Served]) -> None:
    """Two bodies that stall halfway hold the JSON budget: a third is 429 at once; when
    they go, the budget is whole again."""
    served = serve(json_in_flight=2 * 2**20)
    size = 1 << 20
    stalled = []
    for _ in range(2):
        s = connect(served.port)
        head = (
            f"POST /v1/infer HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
        )
        s.sendall(head.encode() + b'{"inputs": "' + b"a" * 1000)
        stalled.append(s)
    time.sleep(0.3)
    body = b'{"inputs": "' + b"a" * (size - 15) + b'"}'
    headers = {**AUTH, "Content-Type": "application/json"}
    answer = httpx.post(f"{served.url}/v1/infer", content=body, headers=headers, timeout=10)
    assert answer.status_code == 429 and answer.headers["Retry-After"]
    for s in stalled:
        s.close()
    time.sleep(0.3)
    answer = httpx.post(f"{served.url}/v1/infer", content=body, headers=headers, timeout=10)
    assert answer.status_code == 200, answer.text


# ---- items 10 and 12: clear errors, bounded echoes --------------------------------------------
def raw_request(port: int, head: bytes, body: bytes = b"") -> bytes:
    with connect(port) as s:
        s.sendall(head + body)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize(
    "body",
    [b"[" * 100_000 + b"]" * 100_000, b'{"inputs": ' + b"9" * 5000 + b"}"],
    ids=["deep", "long integer"],
)
def test_hostile_json_is_400_not_500(served: Served, body: bytes) -> None:
    headers = {**AUTH, "Content-Type": "application/json"}
    answer = httpx.post(f"{served.url}/v1/infer", content=body, headers=headers, timeout=10)
    assert answer.status_code == 400, answer.text
    assert len(answer.content) < 2000


def test_non_ascii_authorization_is_401(served: Served) -> None:
    head = (
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Authorization: Bearer \xff\xfe\xc3\xa9\r\n\r\n"
    )
    assert raw_request(served.port, head).startswith(b"HTTP/1.1 401")


def test_errors_echo_bounded_input(served: Served) -> None:
    name = ".".join(["a"] * 50_000)
    body = json.dumps({"inputs": {name: {"dtype": "int4", "shape": [1], "data": ""}}})
    headers = {**AUTH, "Content-Type": "application/json"}
    answer = httpx.post(f"{served.url}/v1/infer", content=body, headers=headers, timeout=10)
    assert answer.status_code == 400
    assert len(answer.content) < 4000, len(answer.content)


def test_the_budget_gives_back_what_it_took() -> None:
    budget = limits.Budget(10)
    assert budget.take(6) and not budget.take(5) and budget.take(4)
    budget.give(10)
    assert budget.used == 0 and budget.take(10)
