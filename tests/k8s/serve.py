"""The emulator as a process of its own, for benchmarks (its CPU apart from the client's):

    python -m tests.k8s.serve --kubeconfig /tmp/emu.yaml [--port 0]
        [--latency 0.2 | 0.1:0.3] [--error-rate 0.05] [--user-agent disagg-operator ...]

Writes a kubeconfig for it, prints its URL, serves until SIGINT or SIGTERM. Long-run options:
no object history, no kmock request record; orphans are garbage-collected, as in a cluster
(see ``KubeEmulator``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from pathlib import Path

import yaml

from .emulator import KubeEmulator
from .faults import Faults
from .server import EmulatorServer, kubeconfig_for


async def serve(args: argparse.Namespace) -> None:
    faults = None
    if args.latency or args.error_rate:
        faults = Faults.parse(
            args.latency, args.error_rate, user_agents=tuple(args.user_agent or ())
        )
    emulator = KubeEmulator(keep_history=False, keep_requests=False, faults=faults)
    async with EmulatorServer(emulator, port=args.port) as server:
        Path(args.kubeconfig).write_text(yaml.safe_dump(kubeconfig_for(server.url)))
        print(server.url, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.k8s.serve", description=__doc__)
    parser.add_argument("--kubeconfig", required=True, help="where to write its kubeconfig")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency", default="", help="seconds per request: 0.2 or 0.1:0.3")
    parser.add_argument("--error-rate", type=float, default=0.0, help="share failed, 0..1")
    parser.add_argument("--user-agent", action="append", help="only these clients (prefix)")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
