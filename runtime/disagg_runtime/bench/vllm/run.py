"""`disagg bench vllm`: disagg's P/D (`disagg up FILE --serve`, its gateway and
DisaggConnector) against vLLM's own P/D (NixlConnector behind vLLM's toy proxy protocol)
and one engine without disaggregation, on the same prompts, in one run.

Each setup (bench/vllm/setups.py) is started once, then: a warm-up at concurrency 1 (on
the single engine every prompt once: its greedy texts are the answers; on the P/D setups
two requests, so their first hand-offs' connecting is not measured), then each level
(`--requests` streamed requests, prompts in turn), the engines' /metrics scraped before and
after it for the connector's hand-off histograms. Setups run one after another, never
together. The answers of disagg and NIXL must equal the single engine's, at every level,
for every request: any difference fails the run (exit 1) and is printed; a benchmark of
wrong answers is worthless.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

from disagg_core.spec import load_pipeline_file
from disagg_runtime.bench.vllm import load, setups
from disagg_runtime.bench.vllm.flags import SETUPS
from disagg_runtime.bench.vllm.stats import (
    EMPTY,
    Histogram,
    Timing,
    histograms,
    level_summary,
    mismatches,
    table,
    with_ratios,
)
from disagg_runtime.local.engines import SOURCE_ROOT, engine_python

# 1 to ~5 KV blocks of 32 tokens, most with a partly filled last block
# Also tests/vllm's prompts: lengths 3-291 tokens (the tiny model's tokenizer), most longer
# than one 32-token block and most with a partly filled last block.
PROMPTS = (
    "hello",
    "The quick brown fox jumps over the lazy dog.",
    "0123456789 " * 3,
    "roles: prefill runs the prompt, decode streams tokens " * 2,
    "hello world " * 7,
    "Tensors move through shared memory, TCP or CUDA IPC. (){}[]<>.,;:?!'\"-_+=*/ " * 3,
    "a disaggregated pipeline splits a model into roles " * 6,
    "hello world " * 40,
    "x9 y8 z7 " * 30,
    "prefill and decode engines exchange KV blocks " * 12,
)
BASELINE = "single"
WARM_UP = 2  # requests before the levels of a P/D setup (its first hand-offs connect)
SETTLE_S = 15.0  # for an engine's stats of a level to reach its /metrics


def _scrape(setup: setups.Setup) -> dict[str, Histogram]:
    names = (*setup.metrics, *([setups.BYTES_METRICS[setup.name]] if setup.metrics else []))
    total: dict[str, Histogram] = {}
    for engine in setup.engines:
        text = httpx.get(engine + "/metrics", timeout=10).text
        for name, h in histograms(text, names).items():
            prior = total.get(name, EMPTY)
            merged = dict(prior.buckets)
            for le, n in h.buckets:
                merged[le] = merged.get(le, 0.0) + n
            total[name] = Histogram(
                tuple(sorted(merged.items())), prior.count + h.count, prior.total + h.total
            )
    return total


def _handoffs(setup: setups.Setup, before: dict[str, Histogram], requests: int) -> dict[str, Any]:
    """The level's hand-off histograms (after minus before), once the first one counts
    every request or SETTLE_S passed (vLLM logs its stats a little after each step)."""
    if not setup.metrics:
        return {}
    deadline = time.monotonic() + SETTLE_S
    while True:
        after = _scrape(setup)
        first = after[setup.metrics[0]].minus(before[setup.metrics[0]])
        if first.count >= requests or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    out: dict[str, Any] = {n: after[n].minus(before[n]).report() for n in setup.metrics}
    sent = after[setups.BYTES_METRICS[setup.name]].minus(before[setups.BYTES_METRICS[setup.name]])
    out["bytes_per_transfer"] = round(sent.total / sent.count) if sent.count else None
    return out


def measure(setup: setups.Setup, args: argparse.Namespace, model: str) -> dict[str, Any]:
    prompts = list(PROMPTS)
    warm, _ = asyncio.run(
        load.drive(
            setup.url,
            model,
            prompts,
            requests=len(prompts) if setup.name == BASELINE else WARM_UP,
            concurrency=1,
            max_tokens=args.max_tokens,
        )
    )
    answers = {t.prompt: t.text for t in warm}
    levels = []
    failed = ""
    timings: list[Timing] = list(warm)
    for concurrency, requests in zip(args.concurrency, args.requests, strict=True):
        before = _scrape(setup) if setup.metrics else {}
        try:
            got, wall = asyncio.run(
                load.drive(
                    setup.url,
                    model,
                    prompts,
                    requests=requests,
                    concurrency=concurrency,
                    max_tokens=args.max_tokens,
                )
            )
        except (RuntimeError, httpx.HTTPError) as exc:  # kept: the levels before it count
            failed = f"c={concurrency}: {type(exc).__name__}: {str(exc)[:300]}"
            print(f"  {setup.name} {failed}", file=sys.stderr)
            break
        setup.check()
        row = {"setup": setup.name, **level_summary(got, concurrency, wall)}
        handoff = _handoffs(setup, before, requests)
        if handoff:
            primary = handoff[setup.metrics[0]]
            row |= {
                "handoff_mean_ms": primary["mean"],
                "handoff_p50_ms": primary["p50_est"],
                "handoff_p99_ms": primary["p99_est"],
                "handoff": handoff,
            }
        row["load_avg"] = round(os.getloadavg()[0], 1)
        levels.append(row)
        timings += got
        print(
            f"  {setup.name} c={concurrency}: {row['tokens_per_s']} tok/s, TTFT p50 "
            f"{row['ttft_p50_ms']} ms, ITL p50 {row['itl_p50_ms']} ms, hand-off mean "
            f"{row.get('handoff_mean_ms')} ms, load avg {row['load_avg']}",
            file=sys.stderr,
        )
    if setup.metrics and not failed:  # the decode engine alone: the engine, not the hops
        got, wall = asyncio.run(
            load.drive(
                setup.engines[-1] + "/v1",
                model,
                prompts,
                requests=args.requests[0],
                concurrency=1,
                max_tokens=args.max_tokens,
            )
        )
        row = {"setup": f"{setup.name}-decode-only", **level_summary(got, 1, wall)}
        row["load_avg"] = round(os.getloadavg()[0], 1)
        levels.append(row)
        timings += got
        print(
            f"  {row['setup']} c=1: {row['tokens_per_s']} tok/s, ITL p50 {row['itl_p50_ms']} ms",
            file=sys.stderr,
        )
    return {"answers": answers, "levels": levels, "timings": timings, "failed": failed}


def _tiny_model(python: str, out: str) -> str:
    subprocess.run(
        [python, "-m", "disagg_runtime.cli", "models", "tiny", "vllm", "--out", out],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    python = engine_python(args.engine_python or "")
    workdir = tempfile.mkdtemp(prefix="disagg-bench-vllm-")
    try:
        model_dir = args.model or _tiny_model(python, os.path.join(workdir, "model"))
        environ = {"DISAGG_TINY_VLLM": model_dir}
        file = args.file or str(SOURCE_ROOT / "examples" / "vllm-pd.yaml")
        pipeline = load_pipeline_file(file, environ=os.environ | environ)
        model = pipeline.gateway.model or model_dir
        results: dict[str, dict[str, Any]] = {}
        for name in args.setups:
            print(f"bench vllm: starting {name}", file=sys.stderr)
            started = time.monotonic()
            if name == "single":
                setup = setups.single(pipeline, python, workdir)
            elif name == "nixl":
                setup = setups.nixl(pipeline, python, workdir)
            else:
                setup = setups.disagg(file, python, workdir, environ)
            try:
                print(f"  ready in {time.monotonic() - started:.0f} s", file=sys.stderr)
                results[name] = measure(setup, args, model)
            except BaseException:
                for p in setup.procs:
                    print(f"--- {p.label} ({p.log}):\n{p.tail(20)}", file=sys.stderr)
                raise
            finally:
                setup.stop()
    except BaseException:
        print(f"bench vllm: logs kept in {workdir}", file=sys.stderr)
        raise
    shutil.rmtree(workdir, ignore_errors=True)
    return report(results, model_dir, args)


def report(
    results: dict[str, dict[str, Any]], model_dir: str, args: argparse.Namespace
) -> dict[str, Any]:
    """Rows with ratios to the single engine, and every answer that differs from its."""
    rows = with_ratios([row for r in results.values() for row in r["levels"]], BASELINE)
    differ: dict[str, list[str]] = {}
    if BASELINE in results:
        reference = results[BASELINE]["answers"]
        for name, r in results.items():
            bad = mismatches(reference, r["timings"], PROMPTS)
            if bad:
                differ[name] = bad
    return {
        "model": model_dir,
        "max_tokens": args.max_tokens,
        "prompts": len(PROMPTS),
        "rows": rows,
        "outputs_equal": not differ and BASELINE in results,
        "mismatches": differ,
        "failed": {name: r["failed"] for name, r in results.items() if r["failed"]},
    }


def run_cli(args: argparse.Namespace) -> int:
    args.setups = [s for s in str(args.setups).split(",") if s]
    unknown = [s for s in args.setups if s not in SETUPS]
    if unknown:
        print(
            f"bench vllm: --setups: unknown {', '.join(unknown)} (known: {', '.join(SETUPS)})",
            file=sys.stderr,
        )
        return 2
    if len(args.requests) != len(args.concurrency):
        print("bench vllm: --requests needs one count per --concurrency level", file=sys.stderr)
        return 2

    def stop(signum: int, _: object) -> None:
        raise SystemExit(128 + signum)  # so every setup's processes are stopped

    signal.signal(signal.SIGTERM, stop)
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
    out = sys.stderr if args.json else sys.stdout  # the table always, JSON on stdout
    print(table(result["rows"]), file=out)
    print(
        f"hand-off: disagg {setups.DISAGG_METRICS[0]}, nixl {setups.NIXL_METRICS[0]} "
        "(mean exact; p50~/p99~ estimated from the histograms' buckets)",
        file=out,
    )
    for name, bad in result["mismatches"].items():
        print(f"bench vllm: {name}: {len(bad)} answers differ from one engine's:", file=sys.stderr)
        for line in bad[:10]:
            print(f"    {line}", file=sys.stderr)
    for name, why in result["failed"].items():
        print(f"bench vllm: FAILED: {name} {why}", file=sys.stderr)
    if result["failed"]:
        return 1
    if not result["outputs_equal"]:
        print(
            "bench vllm: FAILED: outputs differ (or no single engine to compare with)",
            file=sys.stderr,
        )
        return 1
    return 0
