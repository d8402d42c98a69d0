"""The relay tests' rig: ingresses, senders and raw sockets that are closed after each
test, payloads to move, and waits with timeouts (nothing asserts durations)."""

from __future__ import annotations

import importlib.util
import itertools
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import zmq

from disagg_core.contract import Peer, RoleConfig, RoleTopology, Topology
from disagg_core.spec.model import PoolSettings
from disagg_runtime.memory.pool import MiB, Pool, shm_name
from disagg_runtime.relay import Ingress, Relay, auth, connect
from disagg_runtime.relay import protocol as proto
from tests.payload_checks import assert_bit_exact

KiB = 1 << 10
KINDS = ["shm", "tcp"]
# every relay test runs over nixl too where this machine has it (relay/backends/nixl.py)
# installed but unusable is a failure, not a skip; finding it loads nothing (no agent here)
NIXL_MISSING = None if importlib.util.find_spec("nixl") else "the nixl package is not installed"
NIXL = pytest.param(
    "nixl",
    marks=pytest.mark.skipif(NIXL_MISSING is not None, reason=f"no nixl here: {NIXL_MISSING}"),
)
RELAY_KINDS = [*KINDS, NIXL]
WAIT = 10.0  # generous upper bound for anything that should happen "soon"
KEY = auth.new_key()  # the peer key of every ingress and sender the rig makes


# -- rig -----------------------------------------------------------------------------------


class Rig:
    """Builds ingresses, senders and raw sockets for one test and closes them all after."""

    def __init__(self) -> None:
        # ipc paths must stay short (sun_path is ~107 bytes), so not pytest's tmp_path.
        self.dir = tempfile.mkdtemp(prefix="dgr")
        self.pools: list[Pool] = []
        self.ingresses: list[Ingress] = []
        self.senders: list[Relay] = []
        self.sockets: list[zmq.Socket[Any]] = []
        self._n = itertools.count()

    def ingress(
        self,
        kind: str,
        *,
        size: int = 16 * MiB,
        min_block: int = MiB,
        lease_s: float = 30.0,
        device: Any = None,
        endpoint: str | None = None,
        **options: Any,
    ) -> Ingress:
        """`options` go to the Ingress (on_message, lane_port); `endpoint`: bind there (e.g.
        where an ingress that was closed listened: a receiver restarted in place)."""
        device = device or ("shm" if kind == "shm" else "cpu")
        name = shm_name("relaytest", f"rx{kind}") if device == "shm" else None
        pool = Pool.create(size, device=device, min_block=min_block, name=name)
        self.pools.append(pool)
        if endpoint is None and kind == "shm":
            endpoint = f"ipc://{self.dir}/{next(self._n)}.sock"
        elif endpoint is None:
            endpoint = "tcp://127.0.0.1:0"
        options.setdefault("key", KEY)
        ingress = Ingress(endpoint, pool, lease_s=lease_s, **options)
        self.ingresses.append(ingress)
        return ingress

    def sender(self, kind: str, ingress: Ingress, **options: Any) -> Relay:
        options.setdefault("timeout", WAIT)
        options.setdefault("key", KEY)
        sender = connect(kind, ingress.endpoint, **options)
        self.senders.append(sender)
        return sender

    def raw(
        self, ingress: Ingress, *, authenticate: bool = True, relay: str = "raw"
    ) -> zmq.Socket[Any]:
        """A bare DEALER that speaks whatever the test sends; by default it has made the
        handshake (with the rig's key) first, as a sender does, saying it is of kind
        `relay` (a "tcp" one may send chunked commits: relay/backends/tcp/land.py)."""
        sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, auth.routing_id())
        sock.connect(ingress.endpoint)
        self.sockets.append(sock)
        if authenticate:
            handshake(sock, relay)
        return sock

    def close(self) -> None:
        for sender in self.senders:
            sender.close()
        for sock in self.sockets:
            sock.close(linger=0)
        for ingress in self.ingresses:
            ingress.close()
        for pool in self.pools:
            pool.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# -- helpers -------------------------------------------------------------------------------


def in_pool(t: torch.Tensor, pool: Pool) -> bool:
    base = pool.backing.tensor.data_ptr()
    start = t.data_ptr()
    return base <= start and start + t.numel() * t.element_size() <= base + pool.backing.size


def large_payload(seed: int = 0) -> dict[str, Any]:
    """About 3 MiB of tensors (well above the 64 KiB inline limit) in a nested tree."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "latents": torch.randn(1024, 1536, generator=gen).to(torch.bfloat16),  # 3 MiB
        "aux": [
            {"f8": torch.randn(4096, generator=gen).to(torch.float8_e4m3fn)},
            (torch.rand(999, generator=gen) > 0.5, "frame", 7),
        ],
        "ids": torch.randint(-(2**40), 2**40, (33,), generator=gen),
        "scale": torch.tensor(0.125, dtype=torch.float32),
        "empty": torch.empty(0, 8, dtype=torch.float16),
        "meta": {"step": seed, "done": False, "note": None},
    }


def small_payload(seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "emb": torch.randn(16, 32, generator=gen).to(torch.bfloat16),
        "tok": [torch.arange(5, dtype=torch.int64) + seed, {"mask": torch.tensor([True, False])}],
        "z": torch.randn(3, dtype=torch.complex64, generator=gen),
        "scalar": torch.tensor(seed, dtype=torch.int32),
        "info": ("small", 1.5),
    }


def filled(nbytes: int, value: int = 1) -> dict[str, Any]:
    return {"x": torch.full((nbytes,), value, dtype=torch.uint8)}


def call_in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run `fn` in a daemon thread; the dict gets "ok" or "error" when it ends."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            fn()
            result["ok"] = True
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def handshake(sock: zmq.Socket[Any], relay: str = "raw", key: bytes = KEY) -> dict[str, Any]:
    """Authenticate a bare DEALER the way a sender does (relay/auth.py); the welcome, its
    mac checked. With a wrong key the ingress's answer (a refusal) is returned instead."""
    ours = auth.nonce()
    sock.send(proto.pack("hello", relay=relay, nonce=ours))
    challenge = recv_reply(sock)
    assert challenge["op"] == "challenge", challenge
    sock.send(proto.pack("auth", mac=auth.mac(key, "sender", ours, challenge["nonce"])))
    welcome = recv_reply(sock)
    if welcome["op"] == "welcome":
        body = auth.body({k: v for k, v in welcome.items() if k not in ("v", "pv", "op")})
        assert auth.verify(key, welcome["mac"], "welcome", ours, challenge["nonce"], body)
    return welcome


def write_key(folder: str, key: bytes = KEY) -> str:
    """The key in a 0600 file under `folder`, as `disagg up` and the operator provide it;
    the path for DISAGG_PEER_KEY_FILE / `RoleConfig.peer_key_file`."""
    path = os.path.join(folder, "peer-key")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(key + b"\n")  # whitespace around the key is not part of it
    return path


def lane_hello(welcome: dict[str, Any], *, control: bool = False, key: bytes = KEY) -> bytes:
    """The first frame of a lane, as a sender writes it."""
    token = welcome["lane_id"]
    return proto.pack("lane", id=token, control=control, mac=auth.mac(key, "lane", token))


def recv_reply(
    sock: zmq.Socket[Any], timeout: float = WAIT, *, loads: bool = False
) -> dict[str, Any]:
    """The ingress's next reply; its unsolicited `load` reports are skipped unless `loads`."""
    deadline = time.monotonic() + timeout
    while True:
        left = max(0.0, deadline - time.monotonic())
        assert sock.poll(int(left * 1000)), "no reply from the ingress"
        msg = proto.unpack(sock.recv(), proto.OPS_TO_SENDER)
        if loads or msg["op"] != "load":
            return msg


def assert_still_serves(rig: Rig, ingress: Ingress, kind: str) -> None:
    """The ingress is alive: a fresh sender can deliver a large and a small payload."""
    sender = rig.sender(kind, ingress)
    for rid, payload in (("after-large", large_payload(9)), ("after-small", small_payload(9))):
        sender.send(payload, request_id=rid)
        with ingress.recv(timeout=WAIT) as msg:
            assert msg.request_id == rid
            assert_bit_exact(msg.payload, payload)
    assert ingress.pool.stats().used == 0


def a_to_b_config(**fields: Any) -> RoleConfig:
    """Role `a` of a two-role pipeline a -> b, with `b` at b:7400 (relay choice tests);
    `fields` set the rest (same_gpu_peers, rdma_peers, node_local, ...)."""
    roles = {
        "a": RoleTopology("a", upstream=(), downstream=("b",)),
        "b": RoleTopology("b", upstream=("a",), downstream=()),
    }
    return RoleConfig(
        pipeline="p",
        namespace="",
        role="a",
        replica=0,
        handler="m:f",
        pool=PoolSettings(),
        topology=Topology("p", "", roles),
        downstream=(Peer("b", ("b:7400",)),),
        **fields,
    )
