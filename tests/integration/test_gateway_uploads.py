"""Large uploads cannot hold the entry role's pool (issue 30, item 7): a body that stops
after its safetensors header reserves nothing, one that stalls midway is cut after
`upload_stall` seconds, and staged uploads at once are capped in total and per client.
Real role processes (tests/integration/pipelines/gateway.yaml: a 16 MiB entry pool)."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
from safetensors.torch import load as st_load

from disagg_runtime.gateway import native
from disagg_runtime.gateway.app import Settings
from disagg_runtime.gateway.server import gateway_for
from disagg_runtime.local.supervisor import LocalPipeline
from tests.integration.test_gateway import (
    WAIT,
    Served,
    gateway_pipeline,
    large_head,
    pools_used,
    wait_until,
)


@pytest.fixture(scope="module")
def local() -> Iterator[LocalPipeline]:
    with gateway_pipeline() as pipeline:
        yield pipeline


def serve(local: LocalPipeline, **overrides: object) -> tuple[Served, object]:
    client = local.client()
    settings = Settings(pipeline="itest-gateway", **overrides)  # type: ignore[arg-type]
    return Served(gateway_for(client, settings)), client


def good_upload(url: str) -> int:
    x = torch.arange(768 * 1024, dtype=torch.float32)  # 3 MiB
    from safetensors.torch import save as st_save

    content = st_save({"x": x}, metadata={"i": "7", "n": "1"})
    headers = {"Content-Type": native.SAFETENSORS, "Accept": native.SAFETENSORS}
    answer = httpx.post(f"{url}/v1/infer", content=content, headers=headers, timeout=WAIT)
    if answer.status_code == 200:
        assert torch.equal(st_load(answer.content)["0.x"], x)
    return answer.status_code


def header_only(port: int, size: int) -> socket.socket:
    head, content = large_head(size)
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
    prefix = int.from_bytes(content[:8], "little")
    sock.sendall(head + content[: 8 + prefix])  # the safetensors header, then nothing
    return sock


def test_uploads_that_stop_after_their_header_reserve_nothing(local: LocalPipeline) -> None:
    server, client = serve(local, max_uploads_per_client=16, upload_stall=30.0)
    port = int(server.url.rsplit(":", 1)[1])
    stalled = [header_only(port, 3 << 20) for _ in range(8)]  # 24 MiB > the 16 MiB pool
    try:
        time.sleep(1.0)
        assert pools_used(local)["front"] == 0
        started = time.monotonic()
        assert good_upload(server.url) == 200
        assert time.monotonic() - started < 5
    finally:
        for sock in stalled:
            sock.close()
        server.close()
        client.close()  # type: ignore[attr-defined]
    wait_until(lambda: all(v == 0 for v in pools_used(local).values()), what="pools free")


def test_an_upload_that_stalls_midway_is_408_and_frees_its_slot(local: LocalPipeline) -> None:
    server, client = serve(local, upload_stall=1.0)
    port = int(server.url.rsplit(":", 1)[1])
    head, content = large_head(3 << 20)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
            started = time.monotonic()
            sock.sendall(head + content[: 1 << 20])
            wait_until(lambda: pools_used(local)["front"] > 0, what="a slot reserved")
            answer = http.client.HTTPResponse(sock)
            answer.begin()
            error = json.loads(answer.read())["error"]
        assert answer.status == 408 and "stalled" in error["message"], error
        assert time.monotonic() - started < 5  # the stall, not the 30 s request timeout
        wait_until(lambda: pools_used(local)["front"] == 0, timeout=5, what="slot freed")
    finally:
        server.close()
        client.close()  # type: ignore[attr-defined]


def test_staged_uploads_are_capped_per_client(local: LocalPipeline) -> None:
    server, client = serve(local, max_uploads_per_client=2, upload_stall=30.0)
    port = int(server.url.rsplit(":", 1)[1])
    held = [header_only(port, 3 << 20) for _ in range(2)]
    try:
        time.sleep(0.5)
        _, content = large_head(3 << 20)
        answer = httpx.post(
            f"{server.url}/v1/infer",
            content=content,
            headers={"Content-Type": native.SAFETENSORS},
            timeout=WAIT,
        )
        assert answer.status_code == 429 and answer.headers["Retry-After"], answer.text
        for sock in held:
            sock.close()
        wait_until(lambda: server.gateway.uploads.active == 0, what="uploads gone")
        assert good_upload(server.url) == 200
    finally:
        for sock in held:
            sock.close()
        server.close()
        client.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize("relay", ["shm", "tcp"])
def test_a_payload_that_can_never_fit_the_entry_pool_is_413(
    local: LocalPipeline, relay: str
) -> None:
    """Issue 30, item 11: 20 MiB for a 16 MiB entry pool is a 413 at once, not a
    retryable 503."""
    from tests.integration.test_gateway import gateway_client

    client = gateway_client(local, relay)
    server = Served(gateway_for(client, Settings(pipeline="itest-gateway")))
    try:
        _, content = large_head(20 << 20)
        started = time.monotonic()
        answer = httpx.post(
            f"{server.url}/v1/infer",
            content=content,
            headers={"Content-Type": native.SAFETENSORS},
            timeout=WAIT,
        )
        assert answer.status_code == 413, answer.text
        assert "never fit" in answer.json()["error"]["message"]
        assert time.monotonic() - started < 10
    finally:
        server.close()
        client.close()
    wait_until(lambda: all(v == 0 for v in pools_used(local).values()), what="pools free")
