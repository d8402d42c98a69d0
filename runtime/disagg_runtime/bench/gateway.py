"""`disagg bench pipeline --gateway`: what the HTTP gateway adds over the in-process `Client`.

One run, one local pipeline (a single `disagg role` running `bench.handlers:answer`) and
one `disagg gateway` process (started from the contract's environment, as in a pod):

- small: 4 KiB in and 4 KiB out (`echo`), one request at a time, alternating between the
  in-process `Client.submit` and an HTTP POST (keep-alive `http.client`, JSON body
  encoded once) so that both see the same machine noise; p50 of each and the difference.
- large: a `--size` (default 64 MiB) safetensors body POSTed to the gateway, answered with
  its byte count: the time for the body to reach the entry role and a tiny answer to come
  back, against one single-threaded memcpy of the same size (`bench transport`'s limit),
  the in-process client sending the same tensor, and raw loopback TCP (one process's
  `sendall` into another's `recv_into`, no HTTP, no Python per chunk): the floor for any
  HTTP upload on this machine at this moment. Twice: through a gateway that reaches the
  entry role over shm (as `disagg up --serve` runs it: the body lands in the role's pool)
  and through one that reaches it over tcp (a gateway in its own pod: the body is streamed
  on as it arrives), beside the in-process client over each relay; and through the shm
  gateway's Unix socket (`disagg gateway --unix`, as a sidecar would reach it), against raw
  Unix-socket streaming between two processes. Requests alternate between them so that all
  see the same machine noise.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import save as st_save

from disagg_core.contract import GatewayConfig, Peer, render_gateway_env
from disagg_core.spec import Pipeline, parse_pipeline
from disagg_runtime.bench.limits import measure_best_copy
from disagg_runtime.bench.sizes import format_size, parse_size
from disagg_runtime.client import Client
from disagg_runtime.gateway import native
from disagg_runtime.local.ports import HOST, free_ports
from disagg_runtime.local.supervisor import LocalPipeline
from disagg_runtime.role.health import fetch

SMALL = 4096
UNIX_SNDBUF = 4 << 20


def one_role(pool_bytes: int) -> Pipeline:
    return parse_pipeline(
        {
            "apiVersion": "disagg.dev/v1alpha1",
            "kind": "DisaggregatedPipeline",
            "metadata": {"name": "bench-gateway"},
            "spec": {
                "image": "local",
                "transport": {"poolSize": pool_bytes, "requestTimeoutSeconds": 60},
                "roles": [{"name": "entry", "handler": "disagg_runtime.bench.handlers:answer"}],
            },
        }
    )


def start_gateway(
    local: LocalPipeline, max_body: int, *, node_local: bool = True, unix: str | None = None
) -> tuple[subprocess.Popen[bytes], int]:
    """`disagg gateway` for `local`, configured by the environment a pod would get
    (`node_local`: it reaches the roles over shm, else over tcp; `unix`: it serves on that
    Unix socket too)."""
    ports = free_ports()
    port = next(ports)
    config = GatewayConfig(
        pipeline=local.pipeline.name,
        namespace="",
        topology=local.processes[0].config.topology,
        entries=(
            Peer("entry", tuple(f"{HOST}:{rp.config.ingress_port}" for rp in local.processes)),
        ),
        bind_host=HOST,
        port=port,
        reply_port=next(ports),
        advertise_host=HOST,
        max_body=max_body,
        pool_size=max_body + (64 << 20),
        request_timeout=60,
        node_local=node_local,
        peers_file=local.peers_file,
        topology_file=local.topology_file,
        peer_key_file=local.key_file,  # the gateway authenticates to the roles like a role
    )
    env = {**os.environ, **render_gateway_env(config)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "disagg_runtime.cli",
            "gateway",
            *(["--unix", unix] if unix else []),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"gateway exited: {proc.stderr.read().decode() if proc.stderr else ''}"
            )
        with contextlib.suppress(OSError):
            if fetch(f"http://{HOST}:{port}/readyz", 1.0)[0] == 200:
                return proc, port
        time.sleep(0.1)
    proc.kill()
    raise TimeoutError("gateway not ready within 60 s")


def raw_tcp_seconds(size: int, repeats: int, *, unix: str | None = None) -> list[float]:
    """Loopback TCP transfers of `size` bytes into a pre-faulted buffer of another process
    (`sink`), as an HTTP client's body goes to the gateway: each from the first `sendall`
    until the receiver's one-byte answer (its start is not counted). With `unix` (a path),
    over a Unix socket there instead."""
    data = bytes(size)
    code = f"from {__name__} import sink; sink()"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(size), *([unix] if unix else [])],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        times = []
        for _ in range(repeats):
            with _connect(port, unix) as out:
                t0 = time.perf_counter()
                out.sendall(data)
                if out.recv(1) != b"k":
                    raise RuntimeError("the raw sink did not receive everything")
                times.append(time.perf_counter() - t0)
        return times
    finally:
        proc.kill()
        proc.wait()


def _connect(port: int, unix: str | None) -> socket.socket:
    if unix is None:
        return socket.create_connection((HOST, port))
    sock = unix_socket()
    sock.connect(unix)
    return sock


def unix_socket() -> socket.socket:
    """A Unix stream socket for sending large bodies: its send buffer (which bounds what
    is queued at the receiver: a Unix socket has no receive buffer of its own) raised to
    UNIX_SNDBUF, as loopback TCP's grows by itself; with the default ~200 KiB the receiver
    is woken for every 200 KiB, which costs an event loop 2-3x the time."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SNDBUF)
    return sock


def sink() -> None:
    """`raw_tcp_seconds`'s receiver: prints its port (0 on a Unix socket), then takes `size`
    bytes per connection into one pre-faulted buffer (`recv_into`, no copies) and answers
    b"k"."""
    size = int(sys.argv[1])
    buffer = bytearray(size)
    buffer[:] = bytes(size)  # faulted in before the first transfer, as the gateway's pool is
    view = memoryview(buffer)
    if len(sys.argv) > 2:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(sys.argv[2])
        server.listen()
    else:
        server = socket.create_server((HOST, 0))
    with server:
        print(server.getsockname()[1] if len(sys.argv) <= 2 else 0, flush=True)
        while True:
            conn, _ = server.accept()
            with conn:
                got = 0
                while got < size and (n := conn.recv_into(view[got:])):
                    got += n
                conn.sendall(b"k" if got == size else b"-")


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a Unix socket (the gateway's `--unix`)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        sock = unix_socket()
        sock.settimeout(self.timeout)
        sock.connect(self.unix_path)
        self.sock = sock


def _post(conn: http.client.HTTPConnection, body: bytes, ctype: str) -> bytes:
    conn.request("POST", "/v1/infer", body=body, headers={"Content-Type": ctype})
    resp = conn.getresponse()
    data = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"gateway answered {resp.status}: {data[:300]!r}")
    return data


def tcp_client(local: LocalPipeline) -> Client:
    """The in-process client, reaching the entry role over tcp (as the tcp gateway does)."""
    return Client(
        [Peer("entry", tuple(f"{HOST}:{rp.config.ingress_port}" for rp in local.processes))],
        [local.processes[0].config.role],
        pipeline=local.pipeline.name,
        entry_relay="tcp",
        reply_relay="tcp",
        timeout=60,
        peers_file=local.peers_file,
        key=local.key,
    )


def run(size: int, repeats: int, *, unix: bool = True) -> dict[str, Any]:
    torch.set_num_threads(1)
    memcpy = statistics.median(measure_best_copy(size, max(3, repeats)))
    raw_tcp = statistics.median(raw_tcp_seconds(size, max(3, repeats)))
    folder = tempfile.mkdtemp(prefix="disagg-bench-")
    raw_unix = 0.0
    if unix:
        path = os.path.join(folder, "raw.sock")
        raw_unix = statistics.median(raw_tcp_seconds(size, max(3, repeats), unix=path))
    socket_path = os.path.join(folder, "gateway.sock") if unix else None
    pool = 4 * size + (64 << 20)
    with LocalPipeline(one_role(pool)) as local:
        local.wait_ready()
        proc, port = start_gateway(local, size + (1 << 20), unix=socket_path)
        tcp_proc, tcp_port = start_gateway(local, size + (1 << 20), node_local=False)
        client = local.client(timeout=60)
        over_tcp = tcp_client(local)
        conn = http.client.HTTPConnection(HOST, port, timeout=60)
        tcp_conn = http.client.HTTPConnection(HOST, tcp_port, timeout=60)
        unix_conn = UnixHTTPConnection(socket_path, timeout=60) if socket_path else None
        try:
            small = {"x": torch.zeros(SMALL // 4, dtype=torch.float32), "echo": True}
            body = native.dumps({"inputs": native.to_json(small)})
            direct, gateway = [], []
            for _ in range(20):  # warm up both paths (connections, lanes, caches)
                client.submit(small)
                _post(conn, body, "application/json")
            for _ in range(max(50, repeats * 20)):
                t0 = time.perf_counter()
                client.submit(small)
                t1 = time.perf_counter()
                _post(conn, body, "application/json")
                t2 = time.perf_counter()
                direct.append(t1 - t0)
                gateway.append(t2 - t1)
            big = {"x": torch.ones(size, dtype=torch.uint8)}
            upload = st_save(big)

            def posted(to: http.client.HTTPConnection) -> Any:
                return json.loads(_post(to, upload, native.SAFETENSORS))["outputs"]

            steps: list[tuple[str, Callable[[], Any]]] = [
                ("client", lambda: client.submit(big)),
                ("gw", lambda: posted(conn)),
                ("client_tcp", lambda: over_tcp.submit(big)),
                ("gw_tcp", lambda: posted(tcp_conn)),
            ]
            if unix_conn is not None:
                steps.append(("gw_unix", lambda: posted(unix_conn)))
            large: dict[str, list[float]] = {name: [] for name, _ in steps}
            for _ in range(repeats + 1):
                for name, step in steps:
                    t0 = time.perf_counter()
                    result = step()
                    large[name].append(time.perf_counter() - t0)
                    if result != {"nbytes": size}:
                        raise RuntimeError(f"unexpected answer {result!r} ({name})")
        finally:
            conn.close()
            tcp_conn.close()
            if unix_conn is not None:
                unix_conn.close()
            client.close()
            over_tcp.close()
            for p in (proc, tcp_proc):
                p.terminate()
                p.wait(timeout=30)
            shutil.rmtree(folder, ignore_errors=True)
    client_p50, gateway_p50 = statistics.median(direct), statistics.median(gateway)
    med = {name: statistics.median(times[1:]) for name, times in large.items()}
    return {
        "small_bytes": SMALL,
        "client_p50_ms": round(client_p50 * 1e3, 3),
        "gateway_p50_ms": round(gateway_p50 * 1e3, 3),
        "gateway_added_p50_ms": round((gateway_p50 - client_p50) * 1e3, 3),
        "large_bytes": size,
        "memcpy_ms": round(memcpy * 1e3, 3),
        "client_large_ms": round(med["client"] * 1e3, 3),
        "gateway_large_ms": round(med["gw"] * 1e3, 3),
        "gateway_large_vs_memcpy": round(memcpy / med["gw"], 3),
        "raw_tcp_ms": round(raw_tcp * 1e3, 3),
        "raw_tcp_vs_memcpy": round(memcpy / raw_tcp, 3),
        "gateway_large_vs_raw_tcp": round(raw_tcp / med["gw"], 3),
        "client_large_vs_memcpy": round(memcpy / med["client"], 3),
        "client_tcp_large_ms": round(med["client_tcp"] * 1e3, 3),
        "gateway_tcp_large_ms": round(med["gw_tcp"] * 1e3, 3),
        "gateway_tcp_large_vs_memcpy": round(memcpy / med["gw_tcp"], 3),
        "gateway_tcp_large_vs_raw_tcp": round(raw_tcp / med["gw_tcp"], 3),
        "client_tcp_large_vs_memcpy": round(memcpy / med["client_tcp"], 3),
        **(
            {
                "raw_unix_ms": round(raw_unix * 1e3, 3),
                "raw_unix_vs_memcpy": round(memcpy / raw_unix, 3),
                "gateway_unix_large_ms": round(med["gw_unix"] * 1e3, 3),
                "gateway_unix_large_vs_memcpy": round(memcpy / med["gw_unix"], 3),
                "gateway_unix_large_vs_raw_unix": round(raw_unix / med["gw_unix"], 3),
            }
            if unix
            else {}
        ),
        "repeats": repeats,
    }


def run_cli(args: argparse.Namespace) -> int:
    try:
        size = parse_size(args.size)
    except ValueError as exc:
        print(f"disagg bench pipeline: {exc}", file=sys.stderr)
        return 2
    result = run(size, args.repeats)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"4 KiB in/out: client p50 {result['client_p50_ms']:.3f} ms, through the gateway "
            f"{result['gateway_p50_ms']:.3f} ms (+{result['gateway_added_p50_ms']:.3f} ms)\n"
            f"{format_size(size)} safetensors upload: {result['gateway_large_ms']:.1f} ms "
            f"({result['gateway_large_vs_memcpy']:.2f}x memcpy of {result['memcpy_ms']:.1f} ms); "
            f"in-process client {result['client_large_ms']:.1f} ms "
            f"({result['client_large_vs_memcpy']:.2f}x); raw loopback TCP "
            f"{result['raw_tcp_ms']:.1f} ms ({result['raw_tcp_vs_memcpy']:.2f}x; the gateway "
            f"reaches {result['gateway_large_vs_raw_tcp']:.2f}x of it)\n"
            f"the same upload through a gateway on the tcp relay: "
            f"{result['gateway_tcp_large_ms']:.1f} ms "
            f"({result['gateway_tcp_large_vs_memcpy']:.2f}x memcpy, "
            f"{result['gateway_tcp_large_vs_raw_tcp']:.2f}x raw TCP); in-process client over "
            f"tcp {result['client_tcp_large_ms']:.1f} ms "
            f"({result['client_tcp_large_vs_memcpy']:.2f}x)\n"
            f"through the shm gateway's Unix socket: {result['gateway_unix_large_ms']:.1f} ms "
            f"({result['gateway_unix_large_vs_memcpy']:.2f}x memcpy); raw Unix socket "
            f"{result['raw_unix_ms']:.1f} ms ({result['raw_unix_vs_memcpy']:.2f}x; the gateway "
            f"reaches {result['gateway_unix_large_vs_raw_unix']:.2f}x of it)"
        )
    return 0
