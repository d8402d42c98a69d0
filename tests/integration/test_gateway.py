"""The HTTP gateway against real role processes, driven by clients nobody here wrote:
httpx and curl for the native API, the `openai` package for the OpenAI-compatible one.

One pipeline (tests/integration/pipelines/gateway.yaml: `front` fails on request, `back`
streams) serves several gateways (the same `Client` setup `disagg up --serve` uses), each
on its own event loop thread and a free port. The LLM demo pipeline serves the OpenAI
tests. Every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import http.client
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from disagg_core.contract import Peer
from disagg_core.spec import load_pipeline_file
from disagg_runtime.client import Client
from disagg_runtime.gateway import native, upload
from disagg_runtime.gateway import token as token_mod
from disagg_runtime.gateway.app import GatewayApp, Settings
from disagg_runtime.gateway.server import Server, gateway_for
from disagg_runtime.gateway.token import BearerToken
from disagg_runtime.local.supervisor import LocalPipeline
from disagg_runtime.role.health import fetch, scrape
from tests import support
from tests.support import SecretVolume

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BIG = 64 * 1024  # float32 elements: 256 KiB, staged through the pools
WAIT = 20.0
wait_until = functools.partial(support.wait_until, timeout=WAIT)


class Served:
    """A gateway on its own event-loop thread."""

    def __init__(self, gateway: GatewayApp, unix: str | None = None) -> None:
        self.gateway = gateway
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = Server(gateway, "127.0.0.1", 0, unix)
        port = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)
        self.url = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@contextlib.contextmanager
def gateway_pipeline() -> Iterator[LocalPipeline]:
    """pipelines/gateway.yaml as local processes, with this folder's handlers importable."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), old]))
    pipeline = LocalPipeline(load_pipeline_file(HERE / "pipelines" / "gateway.yaml"), grace_s=5)
    try:
        pipeline.start()
        pipeline.wait_ready(timeout=60)
        yield pipeline
    finally:
        pipeline.stop()
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


@pytest.fixture(scope="module")
def local() -> Iterator[LocalPipeline]:
    with gateway_pipeline() as pipeline:
        yield pipeline


@pytest.fixture(scope="module")
def served(local: LocalPipeline) -> Iterator[Served]:
    client = local.client()
    server = Served(gateway_for(client, Settings(pipeline="itest-gateway", max_body=4 << 20)))
    yield server
    server.close()
    client.close()


def tensor_json(t: torch.Tensor) -> dict[str, Any]:
    data = base64.b64encode(t.contiguous().numpy().tobytes()).decode()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": data}


def from_json(obj: dict[str, Any]) -> torch.Tensor:
    raw = bytearray(base64.b64decode(obj["data"]))
    return torch.frombuffer(raw, dtype=getattr(torch, obj["dtype"])).view(obj["shape"])


def body(i: int, n: int = 3, **extra: Any) -> dict[str, Any]:
    x = torch.full((BIG,), float(i))
    return {"inputs": {"x": tensor_json(x), "i": i, "n": n, **extra}}


def sse_events(lines: Iterator[str]) -> Iterator[tuple[str, Any]]:
    event = "message"
    for line in lines:
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            yield event, json.loads(line[6:])
            event = "message"


def role_samples(local: LocalPipeline) -> dict[str, dict[str, float]]:
    out = {}
    for rp in local.processes:
        status, text = fetch(f"http://127.0.0.1:{rp.config.metrics_port}/metrics", 2.0)
        out[rp.config.role] = scrape(text) if status == 200 else {}
    return out


def pools_used(local: LocalPipeline) -> dict[str, float]:
    return {r: s.get("disagg_pool_bytes_used", -1) for r, s in role_samples(local).items()}


# ---- native API ---------------------------------------------------------------------------------
def test_json_request_and_answer_with_httpx(served: Served) -> None:
    r = httpx.post(f"{served.url}/v1/infer", json=body(7), timeout=WAIT)
    assert r.status_code == 200, r.text
    chunks = r.json()["outputs"]  # a streaming pipeline answers all its chunks
    assert [c["k"] for c in chunks] == [0, 1, 2] and {c["i"] for c in chunks} == {7}
    for c in chunks:
        assert torch.equal(from_json(c["x"]), torch.full((BIG,), 7.0 + c["k"]))


def test_server_sent_events_one_per_chunk_then_end(served: Served) -> None:
    with httpx.stream(
        "POST",
        f"{served.url}/v1/infer",
        json=body(3, n=4),
        headers={"Accept": "text/event-stream"},
        timeout=WAIT,
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r.iter_lines()))
    assert [e for e, _ in events] == ["chunk"] * 4 + ["end"]
    assert [d["k"] for _, d in events[:4]] == [0, 1, 2, 3] and events[-1][1] == {"chunks": 4}


def test_safetensors_body_and_answer_with_curl(served: Served, tmp_path: Path) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    x = torch.arange(BIG, dtype=torch.float32)
    request = tmp_path / "in.safetensors"
    request.write_bytes(st_save({"x": x}, metadata={"i": "5", "n": "2"}))
    answer = tmp_path / "out.safetensors"
    done = subprocess.run(
        [
            curl,
            "-sS",
            "-o",
            str(answer),
            "-w",
            "%{http_code}",
            "--data-binary",
            f"@{request}",
            "-H",
            "Content-Type: application/vnd.safetensors",
            "-H",
            "Accept: application/vnd.safetensors",
            f"{served.url}/v1/infer",
        ],
        capture_output=True,
        text=True,
        timeout=WAIT,
        check=True,
    )
    assert done.stdout == "200", answer.read_bytes()[:300]
    out = st_load(answer.read_bytes())
    assert sorted(out) == ["0.x", "1.x"]  # chunk k's tensors by dotted path
    assert torch.equal(out["1.x"], x + 1)
    with open(answer, "rb") as f:  # scalars are JSON text in the metadata
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert json.loads(header["__metadata__"]["0.i"]) == 5


def post_in_halves(url: str, content: bytes, between: Callable[[], None]) -> Any:
    """POST a safetensors body whose second half goes only after `between()` returned (so
    aiohttp cannot have it whole: the gateway reads it past aiohttp); the answer's
    Connection header and its tensors."""
    half = len(content) // 2

    def halves() -> Iterator[bytes]:
        yield content[:half]
        between()
        yield content[half:]

    headers = {
        "Content-Type": native.SAFETENSORS,
        "Accept": native.SAFETENSORS,
        "Content-Length": str(len(content)),
    }
    conn = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=WAIT)
    try:
        conn.request("POST", "/v1/infer", body=halves(), headers=headers)
        answer = conn.getresponse()
        data = answer.read()
        assert answer.status == 200, data[:300]
        return answer.getheader("Connection"), st_load(data)
    finally:
        conn.close()


def entry_pool_used(local: LocalPipeline) -> float:
    return pools_used(local)["front"]


def test_large_safetensors_body_lands_in_the_entry_roles_pool(
    served: Served, local: LocalPipeline
) -> None:
    """A body over upload.MIN_TAKEOVER is received straight into a slot of the entry
    role's pool reserved for it (the shm relay maps that pool in the gateway), not into the
    gateway's arena: the answer is right, the connection closes after it, and every pool is
    free again afterwards."""
    x = torch.arange(768 * 1024, dtype=torch.float32)  # 3 MiB
    content = st_save({"x": x}, metadata={"i": "7", "n": "1"})
    assert len(content) >= upload.MIN_TAKEOVER
    arena = served.gateway.arena.allocator

    def reserved() -> None:
        wait_until(lambda: entry_pool_used(local) > 0, what="a slot reserved in front's pool")
        assert arena.stats().used == 0

    connection, out = post_in_halves(served.url, content, reserved)
    assert connection == "close" and torch.equal(out["0.x"], x)
    wait_until(lambda: all(v == 0 for v in pools_used(local).values()), what="pools free")
    r = httpx.post(  # a whole body at once: either way of reading it gives the same answer
        f"{served.url}/v1/infer",
        content=content,
        headers={"Content-Type": native.SAFETENSORS, "Accept": native.SAFETENSORS},
        timeout=WAIT,
    )
    assert r.status_code == 200 and torch.equal(st_load(r.content)["0.x"], x)


def tcp_client(local: LocalPipeline, timeout: float = 20.0) -> Client:
    """A client that reaches the entry role over tcp, as a gateway in its own pod does."""
    configs = [rp.config for rp in local.processes]
    return Client(
        [Peer("front", tuple(f"127.0.0.1:{c.ingress_port}" for c in configs if c.role == "front"))],
        ["back"],
        pipeline=local.pipeline.name,
        entry_relay="tcp",
        reply_relay="tcp",
        peers_file=local.peers_file,
        key=local.key,
        timeout=timeout,
    )


def gateway_client(local: LocalPipeline, relay: str, timeout: float = 20.0) -> Client:
    return local.client(timeout=timeout) if relay == "shm" else tcp_client(local, timeout)


@pytest.fixture(scope="module")
def served_tcp(local: LocalPipeline) -> Iterator[Served]:
    """A gateway that reaches the entry role over tcp (its own pod's view)."""
    client = tcp_client(local)
    server = Served(gateway_for(client, Settings(pipeline="itest-gateway", max_body=4 << 20)))
    yield server
    server.close()
    client.close()


def test_large_safetensors_body_over_tcp_is_streamed_to_the_entry_role(
    served_tcp: Served, local: LocalPipeline
) -> None:
    """Where the entry role's pool is not mapped here (tcp relay), the body is received into
    the gateway's arena and each piece sent on to a slot reserved in the entry role's pool
    as it comes: while the second half is held back both are taken; the answer is right,
    and the arena slot and every pool are free afterwards."""
    x = torch.arange(768 * 1024, dtype=torch.float32)  # 3 MiB: three chunks
    content = st_save({"x": x}, metadata={"i": "7", "n": "1"})
    arena = served_tcp.gateway.arena.allocator

    def holding() -> None:
        wait_until(lambda: arena.stats().used > 0, what="the arena slot taken")
        wait_until(lambda: entry_pool_used(local) > 0, what="a slot reserved in front's pool")

    connection, out = post_in_halves(served_tcp.url, content, holding)
    assert connection == "close" and torch.equal(out["0.x"], x)
    wait_until(lambda: arena.stats().used == 0, what="the arena slot freed")
    wait_until(lambda: all(v == 0 for v in pools_used(local).values()), what="pools free")


def test_a_slow_tcp_upload_does_not_hold_up_other_requests(
    served_tcp: Served, local: LocalPipeline
) -> None:
    """An upload whose client pauses mid-body streams on a connection of its own: requests
    that share the gateway's relay to the same entry replica are served meanwhile."""
    x = torch.arange(768 * 1024, dtype=torch.float32)
    content = st_save({"x": x}, metadata={"i": "8", "n": "1"})
    go = threading.Event()
    result: dict[str, Any] = {}

    def held_back() -> None:
        assert go.wait(WAIT)

    def upload() -> None:
        result["answer"] = post_in_halves(served_tcp.url, content, held_back)

    thread = threading.Thread(target=upload, daemon=True)
    thread.start()
    try:
        wait_until(lambda: entry_pool_used(local) > 0, what="the upload's slot reserved")
        for i in range(3):  # 256 KiB each: staged through front's pool on the shared relay
            r = httpx.post(f"{served_tcp.url}/v1/infer", json=body(i, n=1), timeout=5)
            assert r.status_code == 200, r.text
        assert thread.is_alive()  # still held back
    finally:
        go.set()
        thread.join(WAIT)
    connection, out = result["answer"]
    assert connection == "close" and torch.equal(out["0.x"], x)
    wait_until(lambda: all(v == 0 for v in pools_used(local).values()), what="pools free")


def test_a_unix_socket_serves_the_same_api(local: LocalPipeline, tmp_path: Path) -> None:
    """`--unix PATH`: the gateway serves on a Unix socket beside its TCP port; a large
    safetensors body read past aiohttp there lands as over TCP."""
    client = local.client()
    path = str(tmp_path / "gateway.sock")
    server = Served(gateway_for(client, Settings(pipeline="itest-gateway", max_body=8 << 20)), path)
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=path), timeout=WAIT) as http:
            r = http.post("http://gateway/v1/infer", json=body(6, n=1))
            assert r.status_code == 200 and r.json()["outputs"][0]["i"] == 6
            x = torch.arange(768 * 1024, dtype=torch.float32)
            r = http.post(
                "http://gateway/v1/infer",
                content=st_save({"x": x}, metadata={"i": "7", "n": "1"}),
                headers={"Content-Type": native.SAFETENSORS, "Accept": native.SAFETENSORS},
            )
            assert r.status_code == 200 and torch.equal(st_load(r.content)["0.x"], x)
        assert httpx.get(f"{server.url}/healthz", timeout=WAIT).status_code == 200
    finally:
        server.close()
        client.close()
    wait_until(lambda: all(v == 0 for v in pools_used(local).values()), what="pools free")


def large_head(size: int) -> tuple[bytes, bytes]:
    """The HTTP head of a safetensors POST of about `size` bytes, and its body."""
    content = st_save({"x": torch.zeros(size // 4, dtype=torch.float32)})
    head = (
        f"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Type: {native.SAFETENSORS}\r\n"
        f"Content-Length: {len(content)}\r\n\r\n"
    ).encode()
    return head, content


@pytest.mark.parametrize("relay", ["shm", "tcp"])
def test_disconnect_mid_body_frees_the_reservation(
    relay: str, request: pytest.FixtureRequest, local: LocalPipeline
) -> None:
    """A client that sends part of a large body and goes away: the slot reserved in the
    entry role's pool is given back at once (well before its lease of 20 s would end; over
    tcp the transfer streaming into it is cut), and the gateway goes on serving."""
    served: Served = request.getfixturevalue("served" if relay == "shm" else "served_tcp")
    head, content = large_head(3 << 20)
    port = int(served.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        sock.sendall(head + content[: len(content) // 2])
        wait_until(lambda: entry_pool_used(local) > 0, what="a slot reserved")
    wait_until(
        lambda: all(v == 0 for v in pools_used(local).values()), timeout=5, what="the slot freed"
    )
    assert served.gateway.arena.allocator.stats().used == 0
    r = httpx.post(f"{served.url}/v1/infer", json=body(3, n=1), timeout=WAIT)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("relay", ["shm", "tcp"])
def test_a_stalled_upload_is_408_and_frees_its_reservation(
    relay: str, local: LocalPipeline
) -> None:
    """A client that sends the headers and part of the body, then nothing: once the request
    timeout has passed the answer is 408 Request Timeout, saying how much came, and the slot
    reserved for the body is free. A stalled JSON body is 408 too."""
    client = gateway_client(local, relay, timeout=1.0)
    server = Served(gateway_for(client, Settings(pipeline="itest-gateway", timeout=1.0)))
    try:
        head, content = large_head(3 << 20)
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
            sock.sendall(head + content[:4096])
            wait_until(lambda: entry_pool_used(local) > 0, what="a slot reserved")
            answer = http.client.HTTPResponse(sock)
            answer.begin()
            error = json.loads(answer.read())["error"]
        assert answer.status == 408, error
        assert error["type"] == "request_timeout"
        assert f"4096 of {len(content)} bytes" in error["message"]
        wait_until(
            lambda: all(v == 0 for v in pools_used(local).values()), timeout=5, what="slot freed"
        )
        wait_until(lambda: server.gateway.arena.allocator.stats().used == 0, what="arena freed")
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
            sock.sendall(
                b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"inputs": '
            )
            answer = http.client.HTTPResponse(sock)
            answer.begin()
            assert answer.status == 408, answer.read()
    finally:
        server.close()
        client.close()


@pytest.mark.parametrize(
    ("content", "ctype", "status", "param"),
    [
        (b'{"inputs": {"x": 1', "application/json", 400, "$"),
        (
            b'{"inputs": {"x": {"dtype": "float128", "shape": [1], "data": ""}}}',
            "application/json",
            400,
            "$.inputs.x.dtype",
        ),
        (
            b'{"inputs": {"x": {"dtype": "float32", "shape": [3], "data": "AAAA"}}}',
            "application/json",
            400,
            "$.inputs.x.data",
        ),
        (b'{"input": {}}', "application/json", 400, "$.input"),
        (b"not safetensors", "application/vnd.safetensors", 400, "$"),
        (b"<xml/>", "application/xml", 415, None),
        (b"x" * (5 << 20), "application/json", 413, None),
    ],
)
def test_malformed_and_oversized_bodies(
    served: Served, content: bytes, ctype: str, status: int, param: str | None
) -> None:
    r = httpx.post(
        f"{served.url}/v1/infer", content=content, headers={"Content-Type": ctype}, timeout=WAIT
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]


def test_role_failure_is_502_naming_role_and_exception(served: Served) -> None:
    r = httpx.post(f"{served.url}/v1/infer", json=body(9, fail=True), timeout=WAIT)
    assert r.status_code == 502
    error = r.json()["error"]
    assert (error["role"], error["exception"]) == ("front", "ValueError")
    assert "boom 9" in error["message"]


def test_failure_mid_stream_is_an_error_event(served: Served) -> None:
    with httpx.stream(
        "POST",
        f"{served.url}/v1/infer",
        json=body(4, n=5, fail_after=2),
        headers={"Accept": "text/event-stream"},
        timeout=WAIT,
    ) as r:
        events = list(sse_events(r.iter_lines()))
    assert [e for e, _ in events] == ["chunk", "chunk", "error"]
    assert events[-1][1]["status"] == 502 and events[-1][1]["error"]["role"] == "back"


def test_disconnect_mid_stream_frees_every_role_slot(served: Served, local: LocalPipeline) -> None:
    wait_until(lambda: set(pools_used(local).values()) == {0.0}, what="pools idle first")
    client = served.gateway.bridge.client
    with httpx.stream(
        "POST",
        f"{served.url}/v1/infer",
        json=body(1, n=200, chunk_sleep=0.1),
        headers={"Accept": "text/event-stream"},
        timeout=WAIT,
    ) as r:
        lines = r.iter_lines()
        assert next(sse_events(lines))[0] == "chunk"
        assert pools_used(local)["back"] > 0  # the streaming role holds its input's slot
        assert client.in_flight == 1
    # 200 chunks at 0.1 s would take 20 s: the abort, not the end, frees the slots
    started = time.monotonic()
    wait_until(lambda: client.in_flight == 0, timeout=5, what="gateway request cancelled")
    wait_until(
        lambda: set(pools_used(local).values()) == {0.0}, timeout=5, what=str(pools_used(local))
    )
    assert time.monotonic() - started < 5


def test_metrics_count_routes_codes_and_first_chunks(served: Served) -> None:
    """Self-contained (the fixture is shared): one plain request and one stream of its own,
    so the counters asserted do not depend on which tests ran before."""
    httpx.post(f"{served.url}/v1/infer", json=body(2, n=1), timeout=WAIT)
    stream = {"Accept": "text/event-stream"}
    with httpx.stream(
        "POST", f"{served.url}/v1/infer", json=body(2, n=2), headers=stream, timeout=WAIT
    ) as r:
        assert r.status_code == 200 and [e for e, _ in sse_events(r.iter_lines())][-1] == "end"
    text = httpx.get(f"{served.url}/metrics", timeout=WAIT).text
    samples = scrape(text)
    key = 'disagg_gateway_requests_total{code="200",route="/v1/infer"}'
    assert samples[key] >= 1
    assert samples['disagg_gateway_bytes_total{direction="in"}'] > BIG
    assert samples["disagg_gateway_inflight_requests"] == 1  # this scrape itself
    assert 'disagg_gateway_first_chunk_seconds_count{route="/v1/infer"}' in samples
    assert httpx.get(f"{served.url}/readyz", timeout=WAIT).status_code == 200
    spec = httpx.get(f"{served.url}/openapi.json", timeout=WAIT).json()
    assert "/v1/infer" in spec["paths"] and spec["openapi"].startswith("3.")


def test_bearer_token(local: LocalPipeline) -> None:
    client = local.client()
    server = Served(gateway_for(client, Settings(pipeline="itest-gateway", token="s3cret")))
    try:
        url = f"{server.url}/v1/infer"
        assert httpx.post(url, json=body(1, n=1), timeout=WAIT).status_code == 401
        wrong = {"Authorization": "Bearer s3cres"}
        r = httpx.post(url, json=body(1, n=1), headers=wrong, timeout=WAIT)
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        right = {"Authorization": "Bearer s3cret"}
        assert httpx.post(url, json=body(1, n=1), headers=right, timeout=WAIT).status_code == 200
        assert httpx.get(f"{server.url}/healthz", timeout=WAIT).status_code == 200  # probes
    finally:
        server.close()
        client.close()


def test_timeout_is_504(local: LocalPipeline) -> None:
    client = local.client(timeout=1.0)
    server = Served(gateway_for(client, Settings(pipeline="itest-gateway", timeout=1.0)))
    try:
        r = httpx.post(f"{server.url}/v1/infer", json=body(1, n=2, chunk_sleep=3), timeout=WAIT)
        assert r.status_code == 504, r.text
        assert r.json()["error"]["type"] == "timeout"
    finally:
        server.close()
        client.close()


def test_unreachable_entry_role_is_503_and_not_ready(local: LocalPipeline) -> None:
    with __import__("socket").socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = Client([Peer("front", (f"127.0.0.1:{port}",))], ["back"], timeout=1.0, key=local.key)
    server = Served(gateway_for(client, Settings(pipeline="itest-gateway", timeout=1.0)))
    try:
        assert httpx.get(f"{server.url}/readyz", timeout=WAIT).status_code == 503
        r = httpx.post(f"{server.url}/v1/infer", json=body(1, n=1), timeout=WAIT)
        assert r.status_code in (503, 504), r.text
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1"
    finally:
        server.close()
        client.close()


def test_readiness_needs_the_handshake_not_just_a_connection(local: LocalPipeline) -> None:
    """The entry role is up and accepts TCP connections, but this gateway holds another
    key: the handshake fails, so the gateway is not ready, and says why."""
    fronts = tuple(
        f"127.0.0.1:{rp.config.ingress_port}" for rp in local.processes if rp.config.role == "front"
    )
    client = Client([Peer("front", fronts[:1])], ["back"], timeout=2.0, key=b"k" * 32)
    server = Served(gateway_for(client, Settings(pipeline="itest-gateway", timeout=2.0)))
    try:
        r = httpx.get(f"{server.url}/readyz", timeout=WAIT)
        assert r.status_code == 503 and "front" in r.text and "authentication" in r.text, r.text
    finally:
        server.close()
        client.close()


def test_a_rotated_token_file_takes_effect_without_a_restart(
    local: LocalPipeline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(token_mod, "CHECK_S", 0.0)
    volume = SecretVolume(tmp_path)
    volume.write("old-token")
    client = local.client()
    settings = Settings(pipeline="itest-gateway", token=BearerToken.from_file(volume.path))
    server = Served(gateway_for(client, settings))

    def status(token: str) -> int:
        headers = {"Authorization": f"Bearer {token}"}
        url = f"{server.url}/v1/infer"
        return httpx.post(url, json=body(1, n=1), headers=headers, timeout=WAIT).status_code

    try:
        assert (status("old-token"), status("new-token")) == (200, 401)
        volume.write("new-token\n")
        assert (status("old-token"), status("new-token")) == (401, 200)
    finally:
        server.close()
        client.close()


# ---- OpenAI API ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm() -> Iterator[Served]:
    old = os.environ.get("DISAGG_DEMO_SCALE")
    os.environ["DISAGG_DEMO_SCALE"] = "0.05"
    pipeline = load_pipeline_file(REPO / "examples" / "llm-prefill-decode.yaml")
    assert (pipeline.gateway.api, pipeline.gateway.model) == ("openai", "demo-llm")
    local = LocalPipeline(pipeline, grace_s=5)
    client = None
    server = None
    try:
        local.start()
        local.wait_ready(timeout=60)
        client = local.client()
        settings = Settings(
            pipeline=pipeline.name,
            api="openai",
            model="demo-llm",
            token="t0k",
            max_tokens=pipeline.gateway_max_tokens,  # as `disagg up --serve` and the operator
        )
        server = Served(gateway_for(client, settings))
        yield server
    finally:
        if server is not None:
            server.close()
        if client is not None:
            client.close()
        local.stop()
        if old is None:
            os.environ.pop("DISAGG_DEMO_SCALE", None)
        else:
            os.environ["DISAGG_DEMO_SCALE"] = old


def oa(served: Served, key: str = "t0k") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0, timeout=WAIT)


def test_openai_models_and_completion(llm: Served) -> None:
    api = oa(llm)
    assert [m.id for m in api.models.list()] == ["demo-llm"]
    done = api.completions.create(model="demo-llm", prompt="hello", max_tokens=5, temperature=0)
    assert done.choices[0].finish_reason == "length" and done.choices[0].text.strip()
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len("hello") + 1, 5)
    again = api.completions.create(model="demo-llm", prompt="hello", max_tokens=5, temperature=0)
    assert again.choices[0].text == done.choices[0].text  # greedy is deterministic


def test_openai_chat_streaming_matches_whole_answer(llm: Served) -> None:
    api = oa(llm)
    messages: Any = [{"role": "user", "content": "tell me"}]
    whole = api.chat.completions.create(
        model="demo-llm", messages=messages, max_tokens=6, seed=11, temperature=0.8, top_p=0.9
    )
    stream = api.chat.completions.create(
        model="demo-llm",
        messages=messages,
        max_tokens=6,
        seed=11,
        temperature=0.8,
        top_p=0.9,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    assert finish == "length" and usage is not None and usage.completion_tokens == 6


def test_openai_stop_sequence_cuts_the_answer(llm: Served) -> None:
    api = oa(llm)
    full = api.completions.create(model="demo-llm", prompt="abc", max_tokens=8, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = api.completions.create(
        model="demo-llm", prompt="abc", max_tokens=8, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


def test_openai_errors(llm: Served) -> None:
    with pytest.raises(openai.AuthenticationError):
        oa(llm, key="wrong").models.list()
    with pytest.raises(openai.NotFoundError):
        oa(llm).completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError) as info:
        oa(llm).completions.create(model="demo-llm", prompt="x", max_tokens=0)
    assert "max_tokens" in str(info.value)


def test_openai_max_tokens_over_the_models_limit_is_400_naming_max_tokens(llm: Served) -> None:
    """Not the decode role's 502 naming its own `max_new_tokens` (issue 30, item 17): the
    example pipeline says its model's limit (disagg.dev/gateway-max-tokens)."""
    for create in (
        lambda: oa(llm).completions.create(model="demo-llm", prompt="x", max_tokens=5000),
        lambda: oa(llm).chat.completions.create(
            model="demo-llm", messages=[{"role": "user", "content": "x"}], max_tokens=5000
        ),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            create()
        body: Any = info.value.body
        assert body["param"] == "$.max_tokens" and "max_new_tokens" not in body["message"]
        assert "1024" in body["message"]


# ---- the command line ---------------------------------------------------------------------------
def test_up_serve_request_and_bench_from_the_command_line(tmp_path: Path) -> None:
    """`disagg up --serve` prints its URL and serves until SIGINT; `disagg request` and
    `disagg bench pipeline --url` talk to it, and curl to its `--unix` socket."""
    import signal
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "DISAGG_DEMO_SCALE": "0.05"}
    cli = [sys.executable, "-m", "disagg_runtime.cli"]
    example = str(REPO / "examples" / "llm-prefill-decode.yaml")
    sock = tmp_path / "gateway.sock"
    up = subprocess.Popen(
        [*cli, "up", example, "--serve", "--port", str(port), "--unix", str(sock)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert up.stdout is not None
        line = up.stdout.readline()
        assert f"http://127.0.0.1:{port} and unix:{sock}" in line, line
        url = f"http://127.0.0.1:{port}"
        if shutil.which("curl"):
            models = subprocess.run(
                ["curl", "-sf", "--unix-socket", str(sock), "http://gateway/v1/models"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert models.returncode == 0, models.stderr
            assert [m["id"] for m in json.loads(models.stdout)["data"]] == ["demo-llm"]
        answer = subprocess.run(
            [*cli, "request", url, "--sample", "0", "--file", example, "--stream"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert answer.returncode == 0, answer.stderr
        events = list(sse_events(iter(answer.stdout.splitlines())))
        assert [e for e, _ in events][-1] == "end" and events[0][1]["text"]
        body = tmp_path / "chat.json"
        body.write_text(json.dumps({"model": "demo-llm", "prompt": "hi", "max_tokens": 4}))
        bench = subprocess.run(
            [
                *cli,
                "bench",
                "pipeline",
                "--url",
                f"{url}/v1/completions",
                "--input",
                str(body),
                "--requests",
                "6",
                "--concurrency",
                "2",
                "--stream",
                "--json",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert bench.returncode == 0, bench.stdout + bench.stderr
        summary = json.loads(bench.stdout)
        keys = {"requests", "completed", "failed", "p50_ms", "p99_ms", "throughput_rps"}
        assert keys | {"bytes_moved", "ttfc_p50_ms"} <= set(summary)
        assert (summary["completed"], summary["failed"]) == (6, 0)
        assert 0 < summary["ttfc_p50_ms"] <= summary["p50_ms"]
    finally:
        up.send_signal(signal.SIGINT)
        code = up.wait(timeout=60)
    assert code == 0
