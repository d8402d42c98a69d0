"""A receiving process for the GPU tests, and the payloads both sides agree on.

Run as a script (`python tests/gpu/gpu_peer.py`), it prints one JSON line
`{"control": endpoint}` and then answers JSON commands on a REP socket (no pickle):

    {"op": "ingress", "pool": "cuda", "size": N, "endpoint": "ipc"|"tcp", "lease": s}
        -> {"id": k, "endpoint": ...}   a pool and an Ingress (DeviceMemory for cuda)
    {"op": "check", "id": k, "expect": {...}, "timeout": s, "hold": false}
        -> receive one message, compare it bit for bit with `expected(expect)` on the GPU
           (`{"seed": n, "big": bytes}` or `{"fill": v, "n": bytes}`); release it unless held
    {"op": "drain", "id": k, "count": n, "timeout": s}  receive and release n messages
    {"op": "release"}  release held messages
    {"op": "stats", "id": k}  pool use, torch.cuda.memory_allocated, counters
    {"op": "stop"}

In the tests, `Peer` starts one and wraps the commands.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import torch
import zmq

from disagg_runtime.memory.pool import Pool, shm_name
from disagg_runtime.relay import Ingress, Message

# -- payloads ------------------------------------------------------------------------------------


def make_payload(seed: int, device: str, big: int = 0) -> dict[str, Any]:
    """Every allowed dtype family, odd shapes, a 0-dim, an empty and a strided tensor."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(64, 33, generator=g)
    host: dict[str, Any] = {
        "bf16": torch.randn(257, 3, generator=g).bfloat16(),
        "fp16": torch.randn(100, generator=g).half(),
        "fp32": torch.randn(1000, generator=g),
        "fp64": torch.randn(9, generator=g).double(),
        "e4m3": (torch.randn(4096, generator=g) * 8).to(torch.float8_e4m3fn),
        "e5m2": (torch.randn(333, generator=g) * 8).to(torch.float8_e5m2),
        "bool": torch.rand(999, generator=g) > 0.5,
        "i64": torch.randint(-(2**40), 2**40, (77,), generator=g),
        "i8": torch.randint(-128, 128, (31,), generator=g, dtype=torch.int8),
        "c64": torch.randn(33, dtype=torch.complex64, generator=g),
        "scalar": torch.tensor(seed * 1.5),
        "empty": torch.empty(0, 3, dtype=torch.bfloat16),
        "tuple": (torch.arange(5, dtype=torch.int32), "x", None),
        "meta": {"seed": seed, "tags": ["a", 1, 2.5]},
    }
    if big:
        host["big"] = torch.randint(0, 256, (big,), dtype=torch.uint8, generator=g)
    payload: dict[str, Any] = _to(host, device)
    payload["strided"] = base.to(device)[:, ::2]  # not contiguous on either side
    return payload


def expected(expect: dict[str, Any], device: str) -> dict[str, Any]:
    if "fill" in expect:
        return {"x": torch.full((int(expect["n"]),), int(expect["fill"]), dtype=torch.uint8)}
    return make_payload(int(expect["seed"]), device, int(expect.get("big", 0)))


def _to(obj: Any, device: str) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_to(v, device) for v in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    return obj


def mismatch(got: Any, want: Any, path: str = "payload") -> str:
    """'' when `got` equals `want` bit for bit (tensors compared on `got`'s device)."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{path}: {type(got).__name__}, expected a tensor"
        if (got.dtype, tuple(got.shape)) != (want.dtype, tuple(want.shape)):
            return f"{path}: {got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)}"
        a = got.contiguous().reshape(-1).view(torch.uint8)
        b = want.to(got.device).contiguous().reshape(-1).view(torch.uint8)
        return "" if torch.equal(a, b) else f"{path}: bytes differ"
    if isinstance(want, dict):
        if not isinstance(got, dict) or got.keys() != want.keys():
            return f"{path}: keys {sorted(got) if isinstance(got, dict) else got!r:.80}"
        return next((m for k in want if (m := mismatch(got[k], want[k], f"{path}[{k!r}]"))), "")
    if isinstance(want, (list, tuple)):
        if type(got) is not type(want) or len(got) != len(want):
            return f"{path}: {type(got).__name__} of {len(got)}"
        pairs = zip(got, want, strict=True)
        return next(
            (m for i, (g, w) in enumerate(pairs) if (m := mismatch(g, w, f"{path}[{i}]"))), ""
        )
    return "" if got == want else f"{path}: {got!r:.40} != {want!r:.40}"


def devices(obj: Any) -> list[str]:
    if isinstance(obj, torch.Tensor):
        return [obj.device.type]
    if isinstance(obj, dict):
        return [d for v in obj.values() for d in devices(v)]
    if isinstance(obj, (list, tuple)):
        return [d for v in obj for d in devices(v)]
    return []


# -- the receiving process ----------------------------------------------------------------------


class _Server:
    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="dgp")
        self.rigs: list[tuple[Pool, Ingress]] = []
        self.held: list[Message] = []

    def ingress(self, cmd: dict[str, Any]) -> dict[str, Any]:
        device = cmd["pool"]
        name = shm_name("gputest", "peer") if device in ("shm", "cpu-pinned") else None
        pool = Pool.create(int(cmd["size"]), device=device, name=name)
        n = len(self.rigs)
        endpoint = f"ipc://{self.dir}/{n}.sock" if cmd["endpoint"] == "ipc" else "tcp://127.0.0.1:0"
        key = str(cmd["key"]).encode()  # the test's peer key (relay/auth.py)
        ingress = Ingress(endpoint, pool, lease_s=float(cmd.get("lease", 30.0)), key=key)
        self.rigs.append((pool, ingress))
        return {"id": n, "endpoint": ingress.endpoint, "kind": type(ingress.memory).__name__}

    def check(self, cmd: dict[str, Any]) -> dict[str, Any]:
        pool, ingress = self.rigs[cmd["id"]]
        msg = ingress.recv(timeout=float(cmd.get("timeout", 30.0)))
        want = expected(cmd["expect"], "cpu")
        found = mismatch(msg.payload, want)
        report = {"rid": msg.request_id, "mismatch": found, "devices": devices(msg.payload)}
        report["pool_used"] = pool.stats().used
        if cmd.get("hold"):
            self.held.append(msg)
        else:
            msg.release()
        return report

    def drain(self, cmd: dict[str, Any]) -> dict[str, Any]:
        _, ingress = self.rigs[cmd["id"]]
        for _ in range(int(cmd["count"])):
            ingress.recv(timeout=float(cmd.get("timeout", 30.0))).release()
        return {"drained": int(cmd["count"])}

    def stats(self, cmd: dict[str, Any]) -> dict[str, Any]:
        pool, ingress = self.rigs[cmd["id"]]
        s = ingress.stats()
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
        return {
            "pool_used": pool.stats().used,
            "delivered": s.delivered,
            "rejected": s.rejected,
            "memory_allocated": torch.cuda.memory_allocated() if cuda else 0,
            "held": len(self.held),
        }

    def release(self, cmd: dict[str, Any]) -> dict[str, Any]:
        held, self.held = self.held, []
        for msg in held:
            msg.release()
        return {"released": len(held)}

    def close(self) -> None:
        self.release({})
        for pool, ingress in self.rigs:
            ingress.close()
            pool.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def serve() -> None:
    parent = os.getppid()
    if torch.cuda.is_available():  # (the harness itself also runs without, for host pools)
        torch.cuda.init()
    server = _Server()
    ctx: zmq.Context[Any] = zmq.Context.instance()
    rep = ctx.socket(zmq.REP)
    rep.setsockopt(zmq.LINGER, 0)
    rep.bind("tcp://127.0.0.1:0")
    print(json.dumps({"control": rep.getsockopt_string(zmq.LAST_ENDPOINT)}), flush=True)
    try:
        while os.getppid() == parent:  # the test process went away: stop too
            if not rep.poll(1000):
                continue
            cmd = json.loads(rep.recv())
            try:
                out = getattr(server, cmd["op"])(cmd) if cmd["op"] != "stop" else {}
            except Exception as exc:  # reported to the test, which fails with it
                out = {"error": f"{type(exc).__name__}: {exc}"}
            rep.send(json.dumps(out).encode())
            if cmd["op"] == "stop":
                break
    finally:
        server.close()
        rep.close(linger=0)


# -- the test side -------------------------------------------------------------------------------


class Peer:
    """A `gpu_peer.py` process and a REQ socket to command it."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, __file__], stdout=subprocess.PIPE, env=env, text=True
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            raise RuntimeError("gpu_peer did not start (see its stderr above)")
        self.sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.REQ_RELAXED, 1)
        self.sock.setsockopt(zmq.REQ_CORRELATE, 1)
        self.sock.connect(json.loads(line)["control"])

    def ask(self, op: str, **fields: Any) -> None:
        self.sock.send(json.dumps({"op": op, **fields}).encode())

    def answer(self, timeout: float = 60.0) -> dict[str, Any]:
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"gpu_peer did not answer in {timeout} s")
        out: dict[str, Any] = json.loads(self.sock.recv())
        if "error" in out:
            raise RuntimeError(f"gpu_peer: {out['error']}")
        return out

    def call(self, op: str, timeout: float = 60.0, **fields: Any) -> dict[str, Any]:
        self.ask(op, **fields)
        return self.answer(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("stop", timeout=30)
                self.proc.wait(timeout=30)
            except (TimeoutError, RuntimeError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.sock.close(linger=0)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc.wait(timeout=30)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__).parse_args()
    serve()
