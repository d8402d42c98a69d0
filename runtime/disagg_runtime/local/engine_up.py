"""`disagg up FILE` for a pipeline of engine roles (spec/engines.py).

The engines run as local processes (local/engines.py). `--serve`: the gateway serves the
OpenAI API in this process until Ctrl-C/SIGTERM, routing each request to a prefill
replica and on to a decode replica (gateway/engines.py); an engine that dies is started
again after a back-off unless `--fail-fast`, and /readyz says the gateway is degraded
meanwhile. Without `--serve`: `--requests` completions of sample prompts go through the
same router, at most `--concurrency` at once, and the run is summarized (latency, time to
the first token, tokens per second).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from typing import Any

from disagg_core.spec import Pipeline
from disagg_runtime.gateway import pd
from disagg_runtime.gateway.app import GatewayApp, Settings
from disagg_runtime.gateway.engines import EngineRouter
from disagg_runtime.gateway.server import serve_until
from disagg_runtime.local.engines import EngineProcess, LocalEngines, engine_python
from disagg_runtime.local.supervisor import dump_json

SAMPLE_PROMPTS = (
    "The capital of France is",
    "a disaggregated pipeline splits a model into roles " * 4,
    "Tensors move through shared memory, TCP or CUDA IPC.",
    "hello world " * 20,
)
SAMPLE_TOKENS = 16


def router_for(local: LocalEngines, *, timeout: float) -> EngineRouter:
    pipeline = local.pipeline
    return EngineRouter(
        pd.route_of(pipeline, node_local=True),
        local.replicas,
        model=pipeline.gateway.model or "",
        timeout=timeout,
    )


def run(pipeline: Pipeline, args: argparse.Namespace) -> int:
    try:
        python = engine_python(getattr(args, "engine_python", None) or "")
    except RuntimeError as exc:
        print(f"disagg up: {exc}", file=sys.stderr)
        return 2
    serving = getattr(args, "serve", False)
    restart = not getattr(args, "fail_fast", False) if serving else False
    local = LocalEngines(pipeline, python, grace_s=max(args.grace, 10.0), restart=restart)
    timeout = args.timeout or pipeline.transport.request_timeout_seconds
    try:
        local.start()
        ready_s = local.wait_ready(timeout=args.ready_timeout)
        print(f"engines ready in {ready_s:.1f} s (logs in {local.workdir})", file=sys.stderr)
        if serving:
            return _serve(local, args, timeout)
        summary = asyncio.run(_drive(local, args, timeout))
        summary["ready_s"] = round(ready_s, 3)
    except KeyboardInterrupt:
        return 130
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"disagg up: {exc}", file=sys.stderr)
        return 1
    finally:
        local.stop()
    if args.json:
        dump_json(summary, sys.stdout)
    else:
        print(_render(summary))
    return 0 if summary["failed"] == 0 and not summary["died"] else 1


def _serve(local: LocalEngines, args: argparse.Namespace, timeout: float) -> int:
    pipeline = local.pipeline
    settings = Settings(
        pipeline=pipeline.name,
        api="openai",
        model=pipeline.gateway.model or "",
        token=args.token or "",
        timeout=timeout,
        max_tokens=pipeline.gateway_max_tokens,
    )
    died: list[str] = []

    async def ready() -> str:
        return local.degraded()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_death(p: EngineProcess, code: int) -> None:
            if local.restart:
                print(f"disagg up: engine {p.label} died (exit code {code}); restarting")
                return
            died.append(f"engine {p.label} died (exit code {code})")
            loop.call_soon_threadsafe(stop.set)

        local.on_death = on_death
        gateway = GatewayApp(
            settings=settings,
            pipeline=None,
            ready=ready,
            engines=router_for(local, timeout=timeout),
        )

        def listening(bound: int) -> None:
            print(
                f"serving {pipeline.name} at http://{args.host}:{bound} (/v1/completions, "
                "/v1/chat/completions); Ctrl-C to stop",
                flush=True,
            )

        await serve_until(
            gateway, args.host, args.port, on_listening=listening, stop=stop, unix=args.unix
        )

    asyncio.run(main())
    for line in died:
        print(f"disagg up: {line}", file=sys.stderr)
    for label, count in local.restarts.counts().items():
        print(f"disagg up: engine {label} was restarted {count} time(s)", file=sys.stderr)
    return 1 if died else 0


async def _drive(local: LocalEngines, args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    router = router_for(local, timeout=timeout)
    slots = asyncio.Semaphore(max(1, args.concurrency))
    latencies: list[float] = []
    first: list[float] = []
    tokens = [0]
    errors: list[str] = []

    async def one(i: int) -> None:
        payload = {"prompt": SAMPLE_PROMPTS[i % len(SAMPLE_PROMPTS)], "max_tokens": SAMPLE_TOKENS}
        async with slots:
            started = time.monotonic()
            answered = False
            try:
                async for chunk in router.stream(payload):
                    tokens[0] += len(chunk.get("token_ids") or ())
                    if chunk.get("text") and not answered:
                        answered = True
                        first.append(time.monotonic() - started)
                latencies.append(time.monotonic() - started)
            except Exception as exc:  # an HttpError or a bug: counted and shown, not raised
                errors.append(str(exc))

    started = time.monotonic()
    try:
        await asyncio.gather(*(one(i) for i in range(args.requests)))
    finally:
        await router.close()
    elapsed = time.monotonic() - started
    return {
        "pipeline": local.pipeline.name,
        "requests": args.requests,
        "completed": len(latencies),
        "failed": len(errors),
        "p50_ms": round(1000 * statistics.median(latencies), 3) if latencies else 0.0,
        "ttft_p50_ms": round(1000 * statistics.median(first), 3) if first else 0.0,
        "tokens_per_s": round(tokens[0] / elapsed, 1) if elapsed else 0.0,
        "elapsed_s": round(elapsed, 3),
        "died": list(local.deaths),
        "logs": local.workdir if local.deaths else None,
        "errors": errors[:5],
    }


def _render(summary: dict[str, Any]) -> str:
    lines = [
        f"pipeline {summary['pipeline']}: {summary['completed']}/{summary['requests']} "
        f"completed, {summary['failed']} failed in {summary['elapsed_s']:.1f} s "
        f"(ready in {summary['ready_s']:.1f} s)",
        f"latency p50 {summary['p50_ms']:.1f} ms, first token p50 "
        f"{summary['ttft_p50_ms']:.1f} ms, {summary['tokens_per_s']:.1f} tokens/s",
    ]
    lines += [f"died: {d}" for d in summary["died"]]
    if summary.get("logs"):
        lines.append(f"engine logs kept in {summary['logs']}")
    lines += [f"error: {e}" for e in summary["errors"]]
    return "\n".join(lines)
