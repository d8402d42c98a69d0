"""The baseline's router: vLLM's own P/D proxy protocol, for `disagg bench vllm` only.

This is a port (aiohttp server, httpx client) of the protocol of vLLM's
tests/v1/kv_connector/nixl_integration/toy_proxy_server.py, the proxy vLLM ships for its
NixlConnector; it is not disagg's gateway and carries none of its checks. For each
/v1/completions or /v1/chat/completions request:

1. the prefill server gets it with `max_tokens: 1` (and `max_completion_tokens`), not
   streamed, no `stream_options`, and `kv_transfer_params: {do_remote_decode: true,
   do_remote_prefill: false, remote_engine_id/block_ids/host/port: null}`;
2. the decode server gets the original request with the prefill response's
   `kv_transfer_params` (engine id, block ids, host, port), and its response (streamed or
   not) is passed back byte for byte.

Both calls carry one X-Request-Id. Run as `python -m disagg_runtime.bench.vllm.proxy
--prefill URL --decode URL --port N`; it prints `proxy listening on PORT` when ready.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import sys
import uuid
from typing import Any

ROUTES = ("/v1/completions", "/v1/chat/completions")
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill stage's body: one token, not streamed, asked to keep its KV for decode."""
    out = copy.deepcopy(body)
    out["kv_transfer_params"] = dict(PREFILL_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    return out


def decode_request(body: dict[str, Any], prefill_answer: Any) -> dict[str, Any]:
    """The decode stage's body: the original request with the prefill answer's params."""
    out = copy.deepcopy(body)
    params = prefill_answer.get("kv_transfer_params") if isinstance(prefill_answer, dict) else None
    if params:
        out["kv_transfer_params"] = params
    return out


def _serve(prefill: str, decode: str, host: str, port: int) -> None:
    import httpx
    from aiohttp import web

    client = httpx.AsyncClient(
        timeout=None,  # as vLLM's toy proxy: a busy engine is waited for, not failed
        limits=httpx.Limits(max_connections=256, max_keepalive_connections=256),
    )

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        headers = {"X-Request-Id": str(uuid.uuid4())}
        pre = await client.post(prefill + request.path, json=prefill_request(body), headers=headers)
        if pre.status_code != 200:
            return web.Response(status=pre.status_code, body=pre.content)
        forward = decode_request(body, pre.json())
        async with client.stream(
            "POST", decode + request.path, json=forward, headers=headers
        ) as answer:
            out = web.StreamResponse(
                status=answer.status_code,
                headers={"Content-Type": answer.headers.get("content-type", "application/json")},
            )
            await out.prepare(request)
            async for chunk in answer.aiter_raw():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def close(_: web.Application) -> None:
        await client.aclose()

    app = web.Application()
    for route in ROUTES:
        app.router.add_post(route, handle)
    app.on_cleanup.append(close)

    async def main() -> None:
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        print(f"proxy listening on {port}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", required=True, help="prefill server, http://HOST:PORT")
    parser.add_argument("--decode", required=True, help="decode server, http://HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        _serve(args.prefill.rstrip("/"), args.decode.rstrip("/"), args.host, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
