"""`disagg bench llm`: the KV-cache hand-off against the bare relay, and batched prefill.

Hand-off. A receiver process (an shm pool and an Ingress, as a role has) answers every
message with a few bytes. Bare relay: one uint8 tensor of the KV's size is sent and
answered at once. Hand-off: the prefill side flattens its `DynamicCache` to per-layer
tensors (`hf_llm.flatten_cache`) and sends them with the first token; the receiver
rebuilds the model's `DynamicCache` (`hf_llm.rebuild_cache`) and then answers. Both are
timed from the sender's start to the answer, alternating, in one run; the ratio is the
figure (target <= 1.5). Two caches: the tiny LLM's after a real prefill, and a larger
random model's (32 layers, 8 KV heads of 128, bf16: 128 KiB per token) filled with random
tensors of exactly the shapes its prefill would produce (running a model of that size on a
CPU would measure the model, not the hand-off).

Both sides copy on one thread, as in `bench transport` (with several intra-op threads each
tensor's copy pays a thread fork/join, which on a loaded machine costs milliseconds: a
32-layer cache is 64 tensors).

Batching. The prefill role alone (the client receives its output), `concurrency` requests
in flight, with `maxBatchSize` 1 and with `maxBatchSize` = concurrency, both with one
intra-op thread (`handlerArgs.threads`): both pipelines run side by side, driven in
alternating rounds; requests/s (median of the rounds) and the handler calls each made.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import struct
import sys
import tempfile
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

import torch
import zmq

from disagg_core.spec import parse_pipeline
from disagg_runtime.bench.sizes import format_size, parse_size
from disagg_runtime.bench.transport import pool_size_for
from disagg_runtime.local.supervisor import LocalPipeline
from disagg_runtime.memory.pool import Pool, shm_name
from disagg_runtime.relay import Ingress, Message, auth, connect

LARGE_LAYERS, LARGE_KV_HEADS, LARGE_HEAD_DIM, LARGE_DTYPE = 32, 8, 128, torch.bfloat16


def _receiver(control: Connection, pool_size: int, config: dict[str, Any], key: bytes) -> None:
    """Answer each message; a KV payload is rebuilt into a DynamicCache first."""
    from transformers import LlamaConfig

    from disagg_runtime.models.hf_llm import rebuild_cache

    torch.set_num_threads(1)
    model_config = LlamaConfig(**config)
    ctx = zmq.Context()
    reply = ctx.socket(zmq.PUSH)
    reply.connect(control.recv())
    pool = Pool.create(pool_size, device="shm", name=shm_name("bench", "kv"))

    def on_message(msg: Message) -> None:
        payload = msg.payload
        if "keys" in payload:
            dtype = payload["keys"][0].dtype
            cache = rebuild_cache(model_config, payload["keys"], payload["values"], dtype)
            assert cache.get_seq_length() == payload["keys"][0].shape[2]
        reply.send(struct.pack("d", time.perf_counter()))
        msg.release()

    ingress = Ingress("tcp://127.0.0.1:0", pool, context=ctx, on_message=on_message, key=key)
    try:
        control.send(ingress.endpoint)
        control.recv()  # "stop"
    finally:
        ingress.close()
        pool.close()
        reply.close(linger=0)
        ctx.term()


def _large_cache(kv_bytes: int) -> tuple[Any, dict[str, Any]]:
    from transformers import DynamicCache

    per_token = 2 * LARGE_LAYERS * LARGE_KV_HEADS * LARGE_HEAD_DIM * 2
    tokens = max(1, kv_bytes // per_token)
    config = {
        "num_hidden_layers": LARGE_LAYERS,
        "num_attention_heads": 32,
        "num_key_value_heads": LARGE_KV_HEADS,
        "hidden_size": 32 * LARGE_HEAD_DIM,
        "vocab_size": 32000,
    }
    shape = (1, LARGE_KV_HEADS, tokens, LARGE_HEAD_DIM)
    data = [
        (torch.randn(shape, dtype=LARGE_DTYPE), torch.randn(shape, dtype=LARGE_DTYPE))
        for _ in range(LARGE_LAYERS)
    ]
    return DynamicCache(ddp_cache_data=data), config


def _tiny_cache(model_dir: str, tokens: int) -> tuple[Any, dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.randint(4, model.config.vocab_size, (1, tokens))
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    keep = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size")
    config = {k: getattr(model.config, k) for k in keep} | {"vocab_size": model.config.vocab_size}
    return cache, config


def handoff(cache: Any, config: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Median hand-off and bare-relay times for `cache`, alternating, one receiver."""
    from disagg_runtime.models.hf_llm import flatten_cache

    kv_bytes = sum(
        t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
    )
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    pool = pool_size_for(kv_bytes + 2**20)
    key = auth.new_key()  # the relay authenticates as a pipeline's roles do
    proc = spawn.Process(target=_receiver, args=(child, pool, config, key), daemon=True)
    ctx = zmq.Context()
    replies = ctx.socket(zmq.PULL)
    replies.bind("tcp://127.0.0.1:0")
    proc.start()
    relay = None
    bare_payload = {"x": torch.ones(kv_bytes, dtype=torch.uint8)}
    times: dict[str, list[float]] = {"bare": [], "kv": []}
    try:
        parent.send(replies.getsockopt_string(zmq.LAST_ENDPOINT))
        if not parent.poll(120):
            raise RuntimeError("the receiver did not start")
        relay = connect("shm", parent.recv(), context=ctx, timeout=60.0, key=key)
        for i in range(repeats + 1):
            for kind in ("bare", "kv"):
                t0 = time.perf_counter()
                if kind == "kv":
                    payload = flatten_cache(cache, 0, 0, cache.layers[0].keys.dtype)
                    payload["first_token"] = 1
                else:
                    payload = bare_payload
                relay.send(payload, request_id=f"{kind}-{i}")
                if not replies.poll(120_000):
                    raise RuntimeError("no answer from the receiver within 120 s")
                replies.recv()
                if i:  # the first round warms pools and pages
                    times[kind].append(time.perf_counter() - t0)
    finally:
        if relay is not None:
            relay.close()
        parent.send("stop")
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
        replies.close(linger=0)
        ctx.term()
    bare, kv = statistics.median(times["bare"]), statistics.median(times["kv"])
    return {
        "kv_bytes": kv_bytes,
        "layers": len(cache.layers),
        "tokens": int(cache.layers[0].keys.shape[2]),
        "dtype": str(cache.layers[0].keys.dtype).removeprefix("torch."),
        "bare_ms": bare * 1e3,
        "handoff_ms": kv * 1e3,
        "ratio": kv / bare,
        "handoff_GBps": kv_bytes / kv / 1e9,
    }


def _prefill_only(model_dir: str, batch: int, concurrency: int) -> Any:
    role: dict[str, Any] = {
        "name": "prefill",
        "handler": "disagg_runtime.models.hf_llm:Prefill",
        "handlerArgs": {"model": model_dir, "threads": 1},
        "concurrency": concurrency,
    }
    if batch > 1:
        role["batching"] = {"maxBatchSize": batch, "maxWaitMilliseconds": 5}
    return parse_pipeline(
        {
            "apiVersion": "disagg.dev/v1alpha1",
            "kind": "DisaggregatedPipeline",
            "metadata": {"name": f"bench-prefill-{batch}"},
            "spec": {
                "image": "local",
                "transport": {"poolSize": "64Mi", "minBlock": "64Ki", "requestTimeoutSeconds": 120},
                "roles": [role],
            },
        }
    )


def batching(model_dir: str, requests: int, concurrency: int, rounds: int) -> list[dict[str, Any]]:
    """Prefill throughput with maxBatchSize 1 and = concurrency: both pipelines run side by
    side and are driven in alternating rounds (this machine's load drifts), median of rounds."""
    import contextlib

    from disagg_runtime.models.hf_llm import sample_input

    sizes = (1, concurrency)
    with contextlib.ExitStack() as stack:
        locals_ = [
            stack.enter_context(
                LocalPipeline(_prefill_only(model_dir, size, concurrency), grace_s=5)
            )
            for size in sizes
        ]
        clients = []
        for local in locals_:
            local.wait_ready(timeout=300)
            client = local.client(timeout=120)
            stack.callback(client.close)
            clients.append(client)
        rates: dict[int, list[float]] = {size: [] for size in sizes}
        for _ in range(rounds):
            for size, client in zip(sizes, clients, strict=True):
                rates[size].append(_drive(client, requests, concurrency, sample_input))
        rows = []
        for size, local in zip(sizes, locals_, strict=True):
            metrics = local.metrics()["prefill/0"]
            rows.append(
                {
                    "max_batch_size": size,
                    "requests": requests,
                    "concurrency": concurrency,
                    "rounds": rounds,
                    "requests_per_s": statistics.median(rates[size]),
                    "requests_per_s_rounds": rates[size],
                    "handler_calls": int(metrics["disagg_handler_calls_total"]),
                    "handled": int(metrics['disagg_requests_total{outcome="done"}']),
                }
            )
    return rows


def _drive(client: Any, requests: int, concurrency: int, make: Any) -> float:
    """Requests/s of `requests` requests with at most `concurrency` in flight."""
    import threading

    slots = threading.Semaphore(concurrency)
    futures: list[Future[Any]] = []

    def release(_: Future[Any]) -> None:
        slots.release()

    t0 = time.perf_counter()
    for i in range(requests):
        slots.acquire()
        future = client.submit_async(make("", i))
        future.add_done_callback(release)
        futures.append(future)
    for future in futures:
        future.result(timeout=120)
    return requests / (time.perf_counter() - t0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from disagg_runtime.models import tiny

    torch.set_num_threads(1)  # as the relay benchmarks: the sender copies on one thread
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(tiny.llm(f"{tmp}/llm"))
        result: dict[str, Any] = {"handoff": []}
        cache, config = _tiny_cache(model_dir, tokens=512)
        result["handoff"].append({"model": "tiny", **handoff(cache, config, args.repeats)})
        cache, config = _large_cache(parse_size(args.large_kv))
        result["handoff"].append({"model": "large", **handoff(cache, config, args.repeats)})
        del cache
        if not args.skip_batching:
            result["batching"] = batching(model_dir, args.requests, args.concurrency, args.rounds)
    return result


def render(result: dict[str, Any]) -> str:
    lines = ["KV-cache hand-off vs the bare shm relay (same bytes, median):"]
    lines.append(f"{'model':8} {'KV':>10} {'layers':>6} {'tokens':>6} {'bare ms':>9} "
                 f"{'hand-off ms':>11} {'ratio':>6} {'GB/s':>6}")  # fmt: skip
    for h in result["handoff"]:
        lines.append(
            f"{h['model']:8} {format_size(h['kv_bytes']):>10} {h['layers']:>6} {h['tokens']:>6} "
            f"{h['bare_ms']:>9.2f} {h['handoff_ms']:>11.2f} {h['ratio']:>6.2f} "
            f"{h['handoff_GBps']:>6.2f}"
        )
    if "batching" in result:
        lines.append("Prefill throughput (tiny LLM, one replica):")
        for b in result["batching"]:
            lines.append(
                f"  maxBatchSize {b['max_batch_size']:>3}: {b['requests_per_s']:7.1f} req/s "
                f"(median of {b['rounds']} rounds of {b['requests']} requests at concurrency "
                f"{b['concurrency']}; "
                f"{b['handler_calls']} handler calls for {b['handled']} requests)"
            )
        one, many = result["batching"][0], result["batching"][-1]
        lines.append(f"  gain: {many['requests_per_s'] / one['requests_per_s']:.2f}x")
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    result = run(args)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        print(render(result))
    return 0
