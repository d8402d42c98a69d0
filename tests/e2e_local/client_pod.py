"""The client pod's program: submit demo requests to a pipeline's entry roles through
`disagg_runtime.client.Client` (the exit roles reply to this pod's IP) and print one JSON
line of results. Run inside a pod by the test node:

    python client_pod.py --entry encoder=text-to-video-encoder:7400 --handler encode_text \
        --exit decoder --requests 4 --concurrency 2 --timeout 60
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from concurrent.futures import Future

from disagg_core.contract import Peer
from disagg_runtime import demo
from disagg_runtime.client import Client


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--entry", action="append", required=True, help="role=host:port")
    parser.add_argument("--exit", action="append", required=True)
    parser.add_argument("--handler", required=True, help="the entry handler (demo inputs)")
    parser.add_argument("--pipeline", default="pipeline")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--pause", type=float, default=0.0, help="seconds between requests")
    args = parser.parse_args()
    # the client's own notes (a replica re-picked, one that did not answer) land in the pod
    # log, kept with DISAGG_TEST_NODE_KEEP for diagnosis
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # and every report of a lost request, also those that came after it ended or moved
    logging.getLogger("disagg_runtime.client").setLevel(logging.DEBUG)
    entries = [Peer(e.split("=", 1)[0], (e.split("=", 1)[1],)) for e in args.entry]
    client = Client(
        entries,
        args.exit,
        pipeline=args.pipeline,
        bind_host="0.0.0.0",
        advertise_host=os.environ["POD_IP"],
        pool_size=64 << 20,
        timeout=args.timeout,
    )
    ok, failed = 0, 0
    errors: list[str] = []
    latencies: list[float] = []
    started = time.monotonic()
    try:
        pending: list[tuple[float, Future[object]]] = []
        for i in range(args.requests):
            while len(pending) >= args.concurrency:
                t0, future = pending.pop(0)
                ok, failed = _collect(t0, future, ok, failed, errors, latencies)
            t0 = time.monotonic()
            future = client.submit_async(demo.sample_input(args.handler, i))
            future.add_done_callback(_stamp)  # runs at once when it is done already
            pending.append((t0, future))
            if args.pause:
                time.sleep(args.pause)
        for t0, future in pending:
            ok, failed = _collect(t0, future, ok, failed, errors, latencies)
    finally:
        client.close()
    result = {
        "ok": ok,
        "failed": failed,
        "errors": errors[:5],
        "seconds": round(time.monotonic() - started, 2),
        "p50_s": round(sorted(latencies)[len(latencies) // 2], 3) if latencies else None,
        "max_s": round(max(latencies), 3) if latencies else None,
    }
    print("RESULT " + json.dumps(result), flush=True)


def _collect(
    t0: float,
    future: Future[object],
    ok: int,
    failed: int,
    errors: list[str],
    latencies: list[float],
) -> tuple[int, int]:
    """Count `future` (submitted at `t0`); its latency runs to when it finished, not to
    when it is collected here (after the requests before it)."""
    try:
        future.result()
        latencies.append(_finished_at(future) - t0)
        return ok + 1, failed
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}"[:300])
        latencies.append(_finished_at(future) - t0)
        return ok, failed + 1


def _finished_at(future: Future[object]) -> float:
    done = getattr(future, "finished_at", None)
    return float(done) if done is not None else time.monotonic()


def _stamp(future: Future[object]) -> None:
    future.finished_at = time.monotonic()  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
