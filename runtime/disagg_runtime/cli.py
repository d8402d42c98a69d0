"""`disagg` command line: thin argument parsing over the library; subcommands import lazily
so that `disagg validate` never loads torch and `disagg operator` never loads the runtime. The
operator's flags come from the operator package (`disagg_operator.app.flags`, which loads no kopf).
Nothing imports this module: it is the root above both halves (checked by `make lint`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from disagg_core.contract import DISPATCH_MODES
from disagg_operator.app import flags as operator_flags
from disagg_runtime.bench.vllm import flags as vllm_args


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("disagg")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="disagg", description="Disaggregated inference pipelines: runtime and tools."
    )
    parser.add_argument("--version", action="version", version=f"disagg {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    validate = sub.add_parser("validate", help="validate DisaggregatedPipeline files")
    validate.add_argument("files", nargs="+", help="pipeline YAML files")

    render = sub.add_parser("render", help="print the Kubernetes objects the operator creates")
    render.add_argument("file", help="pipeline YAML")
    render.add_argument("--namespace", help="target namespace (default: the file's, else default)")

    sub.add_parser("role", help="run one role process from the DISAGG_* environment")

    up = sub.add_parser("up", help="run a pipeline locally as processes and drive requests")
    up.add_argument("file", help="pipeline YAML")
    up.add_argument("--requests", type=int, default=50, help="requests to send (default 50)")
    up.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    up.add_argument("--duration", type=float, default=None, help="send for this many seconds")
    up.add_argument("--timeout", type=float, default=None, help="per-request timeout (s)")
    up.add_argument(
        "--ready-timeout",
        type=float,
        default=None,
        help="start-up limit (s); default: each role's startupSeconds, as its startup probe",
    )
    up.add_argument("--grace", type=float, default=10.0, help="drain time at stop (s)")
    up.add_argument("--json", action="store_true", help="print the summary as JSON")
    up.add_argument(
        "--report",
        metavar="FILE",
        help="write charts of the run to FILE.html (or .png): latency histogram, throughput "
        "and replicas over time, time split per role (needs the report extra: matplotlib)",
    )
    up.add_argument(
        "--trace",
        nargs="?",
        const="disagg-trace.jsonl",
        metavar="FILE",
        help="record every request's spans in FILE (JSON lines; default disagg-trace.jsonl) "
        "and print the slowest requests' timelines (needs the tracing extra: OpenTelemetry)",
    )
    up.add_argument(
        "--autoscale", action="store_true", help="scale roles by pool occupancy while running"
    )
    up.add_argument(
        "--autoscale-interval", type=float, default=1.0, help="seconds between decisions"
    )
    up.add_argument(
        "--cooldown",
        type=float,
        default=0.0,
        help="with --autoscale: keep deciding this many idle seconds after the load (scale-down)",
    )
    up.add_argument(
        "--dispatch",
        choices=DISPATCH_MODES,
        default="load",
        help="how senders pick a replica for a new request: by the load replicas advertise "
        "(default) or by hashing the request id (to compare)",
    )
    up.add_argument(
        "--serve", action="store_true", help="serve HTTP (the gateway) until Ctrl-C instead"
    )
    up.add_argument(
        "--fail-fast",
        action="store_true",
        help="--serve: stop when a role process dies (default: restart it with back-off)",
    )
    up.add_argument(
        "--restart",
        action="store_true",
        help="without --serve: restart a role process that dies instead of stopping the run",
    )
    up.add_argument("--port", type=int, default=8080, help="--serve: HTTP port (default 8080)")
    up.add_argument("--host", default="127.0.0.1", help="--serve: bind address (127.0.0.1)")
    up.add_argument("--token", default=None, help="--serve: require this bearer token")
    up.add_argument(
        "--unix", metavar="PATH", help="--serve: serve on this Unix socket too (local clients)"
    )
    up.add_argument(
        "--engine-python",
        metavar="PATH",
        help="the interpreter of engine roles (default: $DISAGG_VLLM_PYTHON, else "
        ".venv-vllm/bin/python)",
    )

    gateway = sub.add_parser(
        "gateway", help="the HTTP gateway of a pipeline, from the DISAGG_* environment"
    )
    gateway.add_argument(
        "--unix", metavar="PATH", help="serve on this Unix socket too (a sidecar, local clients)"
    )
    request = sub.add_parser("request", help="send one request to a gateway and print the answer")
    request.add_argument("url", help="gateway URL, e.g. http://127.0.0.1:8080")
    given = request.add_mutually_exclusive_group()
    given.add_argument("--input", metavar="FILE.json", help='native body {"inputs": ...}')
    given.add_argument(
        "--sample", type=int, metavar="N", help="the entry handler's sample input N (needs --file)"
    )
    request.add_argument("--file", help="pipeline YAML (for --sample)")
    request.add_argument("--stream", action="store_true", help="ask for server-sent events")
    request.add_argument("--output", metavar="FILE", help="write the answer here")
    request.add_argument("--token", help="bearer token")
    request.add_argument("--timeout", type=float, default=300.0, help="seconds (default 300)")

    operator = sub.add_parser("operator", help="run the Kubernetes operator (kopf)")
    operator_flags.add_operator_arguments(operator)

    models = sub.add_parser("models", help="Hugging Face model tools (the models extra)")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    tiny = models_sub.add_parser("tiny", help="save a random tiny model (no download)")
    tiny.add_argument(
        "kind",
        choices=("llm", "vllm", "t2v"),
        help="llm: Llama; vllm: a Llama vLLM's CPU engine loads (head_dim 64); t2v: Wan",
    )
    tiny.add_argument("--out", required=True, help="directory to write")

    bench = sub.add_parser("bench", help="measure transports")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    transport = bench_sub.add_parser("transport", help="relays vs their limits and naive baselines")
    transport.add_argument(
        "--sizes",
        default=None,
        help="comma list, e.g. 64MiB,256MiB (default 4KiB,64KiB,1MiB,16MiB,64MiB,256MiB; "
        "with --cpu-messages 4KiB)",
    )
    transport.add_argument("--repeats", type=int, default=0, help="repetitions (0 = by size)")
    transport.add_argument(
        "--methods",
        default=None,
        help="comma list of methods to run (default: all of the device's: the copies "
        "(copy_torch,copy_memmove,copy_numpy; memcpy is the fastest), memcpy_large, raw_unix, "
        "py_unix, raw_tcp,raw_tcp_n (tcp_limit is the faster), the relays shm,tcp, the styles "
        "pickle_zmq,copy_clone_zmq,fresh_shm, and where the nixl extra works the nixl relay "
        "and bare NIXL nixl_cma,nixl_tcp; with --device cuda: d2d,cuda_ipc,shm,tcp)",
    )
    transport.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where payloads live: cpu, or cuda (GPU relays against a device-to-device copy)",
    )
    transport.add_argument(
        "--cpu-messages",
        type=int,
        default=0,
        help="instead: the CPU (both processes, user + sys) of N streamed messages per size "
        "(default size 4KiB) for raw_unix, py_unix and the relays shm,tcp (and nixl where it "
        "works), e.g. 10000",
    )
    transport.add_argument("--json", action="store_true", help="print a JSON list")
    chain = bench_sub.add_parser("pipeline", help="per-hop runtime overhead vs the bare relay")
    chain.add_argument(
        "--size", default=None, help="payload size (default 64MiB; with --trace 64KiB)"
    )
    chain.add_argument("--hops", type=int, default=2, help="full-size hops (default 2)")
    chain.add_argument("--repeats", type=int, default=9, help="repetitions (default 9)")
    chain.add_argument("--json", action="store_true", help="print JSON")
    chain.add_argument("--url", help="drive the gateway at URL instead (see --requests)")
    chain.add_argument("--requests", type=int, default=100, help="--url: requests (100)")
    chain.add_argument("--concurrency", type=int, default=4, help="--url: in flight (4)")
    chain.add_argument("--input", metavar="FILE.json", help="--url: body (default 4 KiB tensor)")
    chain.add_argument("--stream", action="store_true", help="--url: server-sent events")
    chain.add_argument("--token", help="--url: bearer token")
    chain.add_argument(
        "--gateway",
        action="store_true",
        help="gateway against the in-process client, side by side (4 KiB and --size)",
    )
    chain.add_argument(
        "--trace",
        action="store_true",
        help="throughput with tracing on vs off, side by side (OTLP to a local receiver; "
        "--requests per round, --concurrency, --rounds; needs the tracing extra)",
    )
    chain.add_argument("--rounds", type=int, default=20, help="--trace: rounds per mode (20)")
    llm = bench_sub.add_parser("llm", help="KV-cache hand-off vs the bare relay; batched prefill")
    llm.add_argument("--model", help="tiny LLM directory (default: build one in a temp dir)")
    llm.add_argument("--large-kv", default="256MiB", help="KV of the larger random model")
    llm.add_argument("--repeats", type=int, default=5, help="repetitions per size (default 5)")
    llm.add_argument("--requests", type=int, default=64, help="prefill requests per run (64)")
    llm.add_argument("--concurrency", type=int, default=16, help="requests in flight (16)")
    llm.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    llm.add_argument("--skip-batching", action="store_true", help="only the hand-off part")
    llm.add_argument("--json", action="store_true", help="print JSON")
    ranks = bench_sub.add_parser("ranks", help="per-request cost of ranks > 1: the rank feed")
    ranks.add_argument("--sizes", default="4KiB,16MiB,64MiB", help="input sizes")
    ranks.add_argument("--repeats", type=int, default=20, help="requests per size (default 20)")
    ranks.add_argument("--skip-role", action="store_true", help="only the feed, no role processes")
    ranks.add_argument("--json", action="store_true", help="print JSON")
    faults = bench_sub.add_parser(
        "faults", help="requests lost per 1,000 across a kill, a scale-down and a rollout"
    )
    faults.add_argument("--phase-seconds", type=float, default=3.0, help="steady load per phase")
    faults.add_argument("--concurrency", type=int, default=8, help="requests in flight (8)")
    faults.add_argument(
        "--without-migration", action="store_true", help="the baseline: migrationAttempts 0"
    )
    faults.add_argument("--json", action="store_true", help="print JSON")
    bench_vllm = bench_sub.add_parser(
        "vllm", help="vLLM P/D: disagg vs vLLM's NixlConnector vs one engine (TTFT, ITL, KV)"
    )
    vllm_args.add_arguments(bench_vllm)
    bench_operator = bench_sub.add_parser(
        "operator", help="operator latency, throughput and memory against an API server"
    )
    operator_flags.add_bench_arguments(bench_operator)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "validate":
        from disagg_core import spec

        return spec.validate_cli(args.files, out=sys.stdout)
    if args.command == "render":
        from disagg_operator.plan import render

        return render.render_cli(
            args.file, namespace=args.namespace, out=sys.stdout, err=sys.stderr
        )
    if args.command == "operator":
        from disagg_operator.app import main as operator_main

        return operator_main.run_cli(args)
    if args.command == "role":
        from disagg_runtime.role import runtime

        return runtime.main()
    if args.command == "gateway":
        from disagg_runtime.gateway import server

        return server.main(unix=args.unix)
    if args.command == "request":
        from disagg_runtime.gateway import request

        return request.run_cli(args)
    if args.command == "up":
        from disagg_runtime.local import up

        return up.run_cli(args)
    if args.command == "bench" and args.bench_command == "transport":
        from disagg_runtime.bench import transport

        return transport.run_cli(args)
    if args.command == "bench" and args.bench_command == "pipeline":
        args.size = args.size or ("64KiB" if args.trace else "64MiB")
    if args.command == "bench" and args.bench_command == "pipeline" and args.trace:
        from disagg_runtime.bench import tracing
        from disagg_runtime.bench.sizes import parse_size

        return tracing.run_cli(args, parse_size(args.size))
    if args.command == "bench" and args.bench_command == "pipeline" and args.url:
        from disagg_runtime.bench import http

        return http.run_cli(args)
    if args.command == "bench" and args.bench_command == "pipeline" and args.gateway:
        from disagg_runtime.bench import gateway

        return gateway.run_cli(args)
    if args.command == "bench" and args.bench_command == "pipeline":
        from disagg_runtime.bench import pipeline

        return pipeline.run_cli(args)
    if args.command == "models":
        from disagg_runtime.models import tiny

        makers = {"llm": tiny.llm, "vllm": tiny.vllm_llm, "t2v": tiny.t2v}
        print(makers[args.kind](args.out))
        return 0
    if args.command == "bench" and args.bench_command == "faults":
        from disagg_runtime.bench import faults

        return faults.run_cli(args)
    if args.command == "bench" and args.bench_command == "llm":
        from disagg_runtime.bench import llm

        return llm.run_cli(args)
    if args.command == "bench" and args.bench_command == "ranks":
        from disagg_runtime.bench import ranks as ranks_bench

        return ranks_bench.run_cli(args)
    if args.command == "bench" and args.bench_command == "vllm":
        from disagg_runtime.bench.vllm import run as vllm_bench

        return vllm_bench.run_cli(args)
    if args.command == "bench" and args.bench_command == "operator":
        from disagg_operator.bench import run as operator_bench

        return operator_bench.run_cli(args)
    raise AssertionError(f"unhandled command {args.command}")  # argparse enforces choices


if __name__ == "__main__":
    sys.exit(main())
