"""The GPU paths on a machine without CUDA: what fails, how clearly, and that the cuda-ipc
wire messages (pool exports, event handles) are checked like every other control message.

Start-up failures are only asserted where CUDA is absent (tests/gpu covers the rest);
the validation and the CPU behaviour of the device-aware helpers are checked everywhere.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_core.contract import ContractError
from disagg_runtime.memory import intake
from disagg_runtime.memory.copies import Fence, to_device
from disagg_runtime.memory.intake import DeviceMemory
from disagg_runtime.memory.layout import (
    buffer_tensors,
    plan,
    read_payload,
    slot_image,
    write_tensors,
)
from disagg_runtime.memory.layout import plan as pool_plan
from disagg_runtime.memory.pool import (
    SHM_DIR,
    SHM_PREFIX,
    Backing,
    MiB,
    Pool,
    PoolError,
    create_backing,
    pinned_staging,
    shm_name,
)
from disagg_runtime.relay import Ingress, Relay, RelayError, auth, connect
from disagg_runtime.relay import protocol as proto
from disagg_runtime.relay.backends.cuda_ipc import handles, send
from disagg_runtime.relay.backends.cuda_ipc.handles import (
    EVENT_HANDLE_BYTES,
    PROCESS_TOKEN,
    Export,
    encode_event_handle,
    parse_event_handle,
    unavailable_reason,
)
from disagg_runtime.relay.backends.cuda_ipc.send import CudaIpcSender
from disagg_runtime.relay.select import relay_kind
from disagg_runtime.wire import codec
from disagg_runtime.wire.tree import unflatten
from tests.payload_checks import assert_bit_exact
from tests.relay_rig import KEY, a_to_b_config, handshake, recv_reply

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks machines without CUDA")
WAIT = 10.0


def _ours() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


# -- start-up without CUDA ---------------------------------------------------------------------


@no_cuda
@pytest.mark.parametrize("device", ["cuda", "cpu-pinned"])
def test_gpu_pools_fail_at_start_naming_cuda_and_leave_nothing(device: Any) -> None:
    before = _ours()
    with pytest.raises(PoolError, match=f"pool device '{device}' needs CUDA, and "):
        Pool.create(4 * MiB, device=device, name=shm_name("gputest", "rx"))
    with pytest.raises(PoolError, match="CUDA"):
        create_backing(device, MiB)
    assert _ours() <= before  # the pinned pool checks CUDA before making its segment


@no_cuda
def test_pinning_and_staging_fail_clearly_without_cuda() -> None:
    with pytest.raises(PoolError, match="pinned staging buffer needs CUDA"):
        pinned_staging(MiB)
    pool = Pool.create(MiB, device="shm", name=shm_name("gputest", "pin"))
    try:
        with pytest.raises(PoolError, match="pinning a pool needs CUDA"):
            pool.backing.pin()
        assert not pool.backing.pinned
    finally:
        pool.close()


@no_cuda
def test_cuda_ipc_relay_fails_at_start_naming_cuda() -> None:
    assert unavailable_reason() is not None
    started = time.monotonic()
    with pytest.raises(RelayError, match=r"relay cuda-ipc to tcp://127\.0\.0\.1:1 needs CUDA"):
        connect("cuda-ipc", "tcp://127.0.0.1:1", timeout=5.0)
    assert time.monotonic() - started < 2.0  # refused before any handshake wait


@no_cuda
def test_explicit_cuda_ipc_edge_is_a_start_up_error_naming_cuda() -> None:
    with pytest.raises(ContractError, match=r"edge a->b: relay cuda-ipc needs CUDA: "):
        relay_kind(a_to_b_config(same_gpu_peers=frozenset({"b"})), "b", "cuda-ipc")


@no_cuda
def test_same_gpu_peers_fall_back_to_shm_with_the_reason_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="disagg_runtime.relay.select")
    assert relay_kind(a_to_b_config(same_gpu_peers=frozenset({"b"})), "b", "auto") == "shm"
    (record,) = [r for r in caplog.records if "CUDA IPC is not possible" in r.getMessage()]
    assert "edge a->b" in record.getMessage() and "CUDA" in record.getMessage()


def test_relay_kind_leaves_other_edges_alone(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="disagg_runtime.relay.select")
    assert relay_kind(a_to_b_config(node_local=True), "b", "auto") == "shm"
    assert relay_kind(a_to_b_config(), "b", "auto") == "tcp"
    assert relay_kind(a_to_b_config(same_gpu_peers=frozenset({"b"})), "b", "tcp") == "tcp"
    assert relay_kind(a_to_b_config(), "b", "shm") == "shm"
    assert not [r for r in caplog.records if "CUDA" in r.getMessage()]


@no_cuda
def test_bench_transport_on_cuda_exits_2_naming_cuda() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "disagg_runtime.cli", "bench", "transport", "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--device cuda needs CUDA" in proc.stderr and proc.stdout == ""


# -- a host-pool ingress asked for CUDA IPC --------------------------------------------------------


@pytest.fixture
def shm_ingress() -> Iterator[Ingress]:
    pool = Pool.create(4 * MiB, device="shm", name=shm_name("gputest", "ingress"))
    folder = tempfile.mkdtemp(prefix="dgg")
    ingress = Ingress(f"ipc://{folder}/i.sock", pool, lease_s=5.0, key=KEY)
    try:
        yield ingress
    finally:
        ingress.close()
        pool.close()
        os.rmdir(folder) if not os.listdir(folder) else None


def test_host_pool_answers_cuda_ipc_hello_with_a_reason_not_an_export(
    shm_ingress: Ingress,
) -> None:
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, auth.routing_id())
    sock.connect(shm_ingress.endpoint)
    try:
        welcome = handshake(sock, relay="cuda-ipc")
        assert welcome["op"] == "welcome" and "cuda" not in welcome
        assert "is shm memory" in welcome["cuda_unavailable"]
        assert welcome["pool"] == shm_ingress.pool.name  # the fallback a sender takes
        plain = handshake(sock, relay="shm")
        assert "cuda_unavailable" not in plain
    finally:
        sock.close(linger=0)


# -- wire validation: pool exports ----------------------------------------------------------------


def _export() -> Export:
    return Export(
        device=0,
        uuid="GPU-6a1c2f6e-0000-1111-2222-333344445555",
        handle=bytes([1, 0]) + bytes(range(64)),
        size=256 * MiB,
        offset=4096,
        ref=b"/torch_1234_987654321_0",
        ref_offset=17,
        event=bytes(range(64)),
        event_sync=True,
        token=PROCESS_TOKEN,
    )


def test_export_round_trips_through_json() -> None:
    export = _export()
    wire = proto.unpack(proto.pack("welcome", cuda=export.to_json()), proto.OPS_TO_SENDER)
    assert Export.from_json(wire["cuda"]) == export
    assert replace(export, uuid="").to_json()["uuid"] == ""


BAD_FIELDS: list[tuple[str, Any]] = [
    ("v", 2),
    ("v", "1"),
    ("v", True),
    ("v", None),
    ("device", -1),
    ("device", True),
    ("device", "0"),
    ("device", 1 << 40),
    ("device", 0.0),
    ("uuid", 7),
    ("uuid", "x" * 129),
    ("handle", "not base64!"),
    ("handle", ""),
    ("handle", 12),
    ("handle", _b64(b"x" * 5000)),
    ("size", 0),
    ("size", -5),
    ("size", True),
    ("size", 1.5),
    ("size", 1 << 70),
    ("offset", -1),
    ("offset", "0"),
    ("ref", _b64(b"/etc/passwd")),
    ("ref", _b64(b"/torch_1/../../etc/passwd")),
    ("ref", _b64(b"torch_1_2_3")),
    ("ref", _b64(b"/torch_1_2_3\x00")),
    ("ref", "%%%"),
    ("ref_offset", 10_000),
    ("ref_offset", -1),
    ("ref_offset", None),
    ("event", _b64(bytes(63))),
    ("event", _b64(bytes(65))),
    ("event", "AAAA"),
    ("event", 64),
    ("event_sync", "true"),
    ("event_sync", 1),
    ("token", 5),
    ("token", "t" * 200),
    ("extra", 1),
]


@pytest.mark.parametrize(("key", "value"), BAD_FIELDS)
def test_malformed_exports_are_protocol_errors(key: str, value: Any) -> None:
    obj = _export().to_json()
    obj[key] = value
    with pytest.raises(proto.ProtocolError, match="cuda export"):
        Export.from_json(obj)


@pytest.mark.parametrize("key", sorted(_export().to_json()))
def test_exports_missing_a_field_are_protocol_errors(key: str) -> None:
    obj = _export().to_json()
    del obj[key]
    with pytest.raises(proto.ProtocolError, match="cuda export"):
        Export.from_json(obj)


@pytest.mark.parametrize("obj", [None, [], "export", 3, [("v", 1)]])
def test_exports_that_are_not_objects_are_protocol_errors(obj: Any) -> None:
    with pytest.raises(proto.ProtocolError, match="expected an object"):
        Export.from_json(obj)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(sorted(_export().to_json())), value=json_values)
def test_any_value_in_any_export_field_is_accepted_or_a_protocol_error(
    key: str, value: Any
) -> None:
    obj = _export().to_json()
    obj[key] = value
    with contextlib.suppress(proto.ProtocolError):
        Export.from_json(obj)


@settings(max_examples=200, deadline=None)
@given(obj=json_values)
def test_any_json_as_export_or_event_is_a_protocol_error_never_a_crash(obj: Any) -> None:
    for parse in (Export.from_json, parse_event_handle):
        with pytest.raises(proto.ProtocolError):
            parse(obj)


# -- wire validation: event handles in commits ----------------------------------------------------


def test_event_handles_round_trip() -> None:
    handle = bytes(range(EVENT_HANDLE_BYTES))
    assert parse_event_handle(encode_event_handle(handle)) == handle
    with pytest.raises(ValueError):
        encode_event_handle(b"short")


@pytest.mark.parametrize(
    "value",
    [
        None,
        64,
        b"x" * 64,
        "",
        "AAAA",
        _b64(bytes(63)),
        _b64(bytes(65)),
        _b64(bytes(64)) + "=",
        _b64(bytes(64))[:-1] + "*",
        "A" * 10_000,
        ["a"],
    ],
)
def test_malformed_event_handles_are_protocol_errors(value: Any) -> None:
    with pytest.raises(proto.ProtocolError, match="'event'"):
        parse_event_handle(value)


def test_a_cuda_ipc_commit_with_a_bad_manifest_is_nacked_like_any_other(
    shm_ingress: Ingress,
) -> None:
    """The slot manifest of a cuda-ipc commit goes through the same checks (here against
    a host pool: the ingress answers with a nack and frees the slot)."""
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, auth.routing_id())
    sock.connect(shm_ingress.endpoint)

    def reply() -> dict[str, Any]:
        return recv_reply(sock)  # `load` reports skipped

    try:
        handshake(sock, relay="cuda-ipc")
        sock.send(proto.pack("reserve", rid="r", xid=1, nbytes=MiB, wait_s=1.0))
        grant = reply()
        assert grant["op"] == "grant"
        manifest = {"v": 1, "tree": {"t": 0}, "nbytes": 64, "tensors": [{"offset": 0}]}
        event = _b64(bytes(EVENT_HANDLE_BYTES))
        sock.send(
            proto.pack(
                "commit", rid="r", xid=1, offset=grant["offset"], manifest=manifest, event=event
            )
        )
        nack = reply()
        assert nack["op"] == "nack" and nack["xid"] == 1 and "manifest" in nack["reason"]
        assert shm_ingress.stats().pool_used == 0
    finally:
        sock.close(linger=0)


# -- the device-aware helpers on host memory ------------------------------------------------------


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _payload() -> dict[str, Any]:
    return {
        "bf16": torch.randn(3, 5).bfloat16(),
        "fp8": torch.randn(16).to(torch.float8_e4m3fn),
        "e5m2": torch.randn(7).to(torch.float8_e5m2),
        "strided": torch.arange(40, dtype=torch.int32).reshape(5, 8)[:, ::3],
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "nested": [(1, "a", None), {"b": b"raw", "f": float("inf")}],
    }


def test_plan_matches_the_codec_and_the_slot_image_round_trips_on_host_payloads() -> None:
    payload = _payload()
    manifest, tensors = plan(payload)
    reference, ref_tensors = pool_plan(payload)
    assert manifest == reference
    for got, ref in zip(tensors, ref_tensors, strict=True):
        assert (got.dtype, got.shape) == (ref.dtype, ref.shape) and got.is_contiguous()
    assert tensors[0] is payload["bf16"]  # contiguous host tensors are not copied
    image = slot_image(manifest, tensors)
    assert len(image) == manifest.nbytes
    views = buffer_tensors(memoryview(image), manifest)
    assert_bit_exact(unflatten(manifest.tree, views), payload)
    for view, offset in zip(views, manifest.offsets, strict=True):
        if view.numel():  # each tensor views the image at its manifest offset
            assert view.data_ptr() == torch.frombuffer(image, dtype=torch.uint8).data_ptr() + offset


def test_relay_headers_keep_the_control_limit() -> None:
    manifest, _ = plan({"big": "x" * (proto.MAX_CONTROL_BYTES + 1)})
    with pytest.raises(codec.CodecError, match="header would be"):
        proto.pack("inline", rid="r", manifest=manifest.to_json())


def test_host_writes_are_done_on_return_and_to_device_cpu_keeps_tensors() -> None:
    pool = Pool.create(4 * MiB, device="cpu", min_block=64 * 1024)
    try:
        payload = _payload()
        manifest, tensors = plan(payload)
        slot = pool.allocate(manifest.nbytes)
        assert slot is not None
        fence = write_tensors(pool.backing, slot, manifest, tensors)
        assert fence == Fence() and fence.done()
        fence.wait()
        got = read_payload(pool.backing, slot, manifest, device="cpu")
        for key in ("bf16", "fp8", "e5m2", "strided", "scalar", "empty"):
            want = payload[key]
            assert got[key].dtype == want.dtype and got[key].shape == want.shape
            assert torch.equal(raw(got[key]), raw(want))
        assert to_device(got, "cpu")["bf16"] is got["bf16"]
        assert got["nested"] == [(1, "a", None), {"b": b"raw", "f": float("inf")}]
    finally:
        pool.close()


# -- the cuda-ipc control flow with CUDA simulated ------------------------------------------------
#
# The CUDA calls (export/map of the pool, streams, the peer's interprocess event) are
# replaced by fakes: the "GPU pool" is host memory both ends share in this process, and
# the event completes `delay` s after each record. What runs for real is everything else:
# an Ingress over a CUDA pool (DeviceMemory, CudaIpcLanding), the welcome export, the
# sender's handshake and commit,
# the receiver's wait for the copy (spin, deferral, lease, quarantine), validation, nacks,
# the tcp bounce path, and the fallbacks. tests/gpu runs the same paths on a GPU.


class FakeStream:
    def __init__(self, device: Any = None) -> None:
        self.device = torch.device("cpu")

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass


class FakeEvent:
    """A peer's interprocess event: complete `delay` s after each record."""

    def __init__(self) -> None:
        self.delay = 0.0
        self.done_at = 0.0

    def record(self, stream: Any = None) -> None:
        self.done_at = time.monotonic() + self.delay

    def query(self) -> bool:
        return time.monotonic() >= self.done_at

    def synchronize(self) -> None:
        pass

    def ipc_handle(self) -> bytes:
        return bytes(range(EVENT_HANDLE_BYTES))


class FakeCuda:
    def __init__(self) -> None:
        self.event = FakeEvent()
        self.map_fails = ""
        self.export: Any = None
        self.pool_memory: torch.Tensor | None = None


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()

    def export_pool(backing: Backing) -> Any:
        fake.pool_memory = backing.tensor
        if fake.export is not None:
            return fake.export
        handle = bytes([1, 0]) + bytes(64)
        ref = b"/torch_1_2_3"
        return Export(0, "GPU-fake", handle, backing.size, 0, ref, 0, bytes(64), False, "rx")

    def map_export(export: Export, stream: Any) -> Backing:
        if fake.map_fails:
            raise handles.CannotMap(fake.map_fails)
        assert fake.pool_memory is not None
        return Backing("cuda", fake.pool_memory, owner=False)

    def from_ipc_handle(device: Any, handle: bytes) -> FakeEvent:
        if handle == bytes(EVENT_HANDLE_BYTES):
            raise RuntimeError("CUDA error: invalid resource handle")
        return fake.event

    monkeypatch.setattr(handles, "unavailable_reason", lambda: None)
    monkeypatch.setattr(handles, "export_pool", export_pool)
    monkeypatch.setattr(handles, "map_export", map_export)
    monkeypatch.setattr(handles, "local_device", lambda export: 0)
    monkeypatch.setattr(send, "new_stream", FakeStream)
    monkeypatch.setattr(send, "new_event", lambda interprocess=False: fake.event)
    monkeypatch.setattr(intake, "new_stream", FakeStream)
    monkeypatch.setattr(intake, "pinned_buffer", lambda n: torch.empty(n, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda.Event, "from_ipc_handle", staticmethod(from_ipc_handle))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    return fake


class CudaRig:
    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="dgc")
        self.ingresses: list[Ingress] = []
        self.senders: list[Relay] = []

    def ingress(self, *, tcp: bool = False, lease_s: float = 1.0) -> Ingress:
        pool = Pool(Backing("cuda", torch.zeros(16 * MiB, dtype=torch.uint8)), min_block=MiB)
        endpoint = "tcp://127.0.0.1:0" if tcp else f"ipc://{self.dir}/{len(self.ingresses)}.sock"
        ingress = Ingress(endpoint, pool, lease_s=lease_s, key=KEY)
        self.ingresses.append(ingress)
        return ingress

    def sender(self, kind: str, ingress: Ingress, **options: Any) -> Relay:
        sender = connect(kind, ingress.endpoint, timeout=WAIT, key=KEY, **options)
        self.senders.append(sender)
        return sender

    def close(self) -> None:
        for sender in self.senders:
            sender.close()
        for ingress in self.ingresses:
            ingress.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def rig(fake_cuda: FakeCuda) -> Iterator[CudaRig]:
    made = CudaRig()
    try:
        yield made
    finally:
        made.close()


def big_payload(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randint(0, 256, (3 * MiB + 5,), dtype=torch.uint8, generator=g),
        "bf16": torch.randn(300, 7, generator=g).bfloat16(),
        "fp8": torch.randn(999, generator=g).to(torch.float8_e4m3fn),
        "step": seed,
    }


def same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    tensors = [k for k, v in want.items() if isinstance(v, torch.Tensor)]
    return got.keys() == want.keys() and all(
        torch.equal(raw(got[k]), raw(want[k])) for k in tensors
    )


def test_sim_cuda_ipc_round_trip_holds_the_slot_until_release(rig: CudaRig) -> None:
    ingress = rig.ingress()
    assert isinstance(ingress.memory, DeviceMemory)
    sender = rig.sender("cuda-ipc", ingress)
    assert isinstance(sender, CudaIpcSender) and sender.mode == "cuda-ipc"
    payload = big_payload(1)
    sender.send(payload, request_id="r1")
    msg = ingress.recv(timeout=WAIT)
    assert msg.slot is not None and same(msg.payload, payload)
    assert ingress.stats().pool_used >= 3 * MiB
    msg.release()
    assert ingress.stats().pool_used == 0
    sender.send({"small": torch.ones(3)}, request_id="r2")  # host and small: inline
    small = ingress.recv(timeout=WAIT)
    assert small.slot is None and torch.equal(small.payload["small"], torch.ones(3))
    small.release()


def test_sim_receiver_delivers_only_after_the_senders_copy(
    rig: CudaRig, fake_cuda: FakeCuda
) -> None:
    ingress = rig.ingress()
    sender = rig.sender("cuda-ipc", ingress)
    fake_cuda.event.delay = 0.3  # beyond the receiver's spin: the loop polls for it
    started = time.monotonic()
    sender.send(big_payload(2), request_id="slow")
    assert time.monotonic() - started >= 0.3
    msg = ingress.recv(timeout=WAIT)
    assert fake_cuda.event.query() and same(msg.payload, big_payload(2))
    msg.release()


def test_sim_copy_outlasting_the_lease_is_nacked_and_its_slot_quarantined(
    rig: CudaRig, fake_cuda: FakeCuda
) -> None:
    ingress = rig.ingress(lease_s=1.0)
    sender = rig.sender("cuda-ipc", ingress)
    fake_cuda.event.delay = 2.5
    with pytest.raises(RelayError, match="did not complete within the lease"):
        sender.send(big_payload(3), request_id="stuck", timeout=WAIT)
    assert ingress.stats().pool_used > 0  # the copy may still write there
    assert not fake_cuda.event.query()
    deadline = time.monotonic() + WAIT
    while ingress.stats().pool_used and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fake_cuda.event.query() and ingress.stats().pool_used == 0
    fake_cuda.event.delay = 0.0
    sender.send(big_payload(4), request_id="after")
    ingress.recv(timeout=WAIT).release()


@pytest.mark.parametrize(
    "event",
    [
        _b64(bytes(EVENT_HANDLE_BYTES)),  # well-formed, but CUDA cannot open it
        "AAAA",
        12345,
        None,
        _b64(bytes(EVENT_HANDLE_BYTES + 1)),
    ],
)
def test_sim_malformed_events_are_nacked_and_their_slots_come_back(
    rig: CudaRig, event: Any
) -> None:
    ingress = rig.ingress(lease_s=0.5)
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, auth.routing_id())
    sock.connect(ingress.endpoint)

    def reply() -> dict[str, Any]:
        return recv_reply(sock)  # `load` reports skipped

    manifest = {
        "v": 1,
        "tree": {"t": 0},
        "nbytes": 16,
        "tensors": [{"dtype": "uint8", "shape": [16], "offset": 0}],
    }
    try:
        assert Export.from_json(handshake(sock, relay="cuda-ipc")["cuda"]).size == 16 * MiB
        sock.send(proto.pack("reserve", rid="bad", xid=1, nbytes=MiB, wait_s=2.0))
        grant = reply()
        fields = {"rid": "bad", "xid": 1, "offset": grant["offset"], "manifest": manifest}
        sock.send(proto.pack("commit", **fields, event=event))
        nack = reply()
        assert nack["op"] == "nack" and "event" in nack["reason"]
        sock.send(proto.pack("reserve", rid="mixed", xid=2, nbytes=MiB, wait_s=2.0))
        grant = reply()
        fields = {"rid": "mixed", "xid": 2, "offset": grant["offset"], "manifest": manifest}
        sock.send(proto.pack("commit", **fields, event=_b64(bytes(range(64))), chunk=4096))
        assert reply()["op"] == "nack"
    finally:
        sock.close(linger=0)
    deadline = time.monotonic() + WAIT
    while ingress.stats().pool_used and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ingress.stats().pool_used == 0 and ingress.stats().rejected == 2
    sender = rig.sender("cuda-ipc", ingress)  # still serving
    sender.send(big_payload(5), request_id="fine")
    ingress.recv(timeout=WAIT).release()


def test_sim_tcp_chunks_land_in_a_cuda_pool_through_the_bounce_buffer(rig: CudaRig) -> None:
    ingress = rig.ingress(tcp=True)
    sender = rig.sender("tcp", ingress)
    sender.send(big_payload(6), request_id="tcp")
    msg = ingress.recv(timeout=WAIT)
    assert same(msg.payload, big_payload(6))
    msg.release()
    assert ingress.stats().pool_used == 0


def test_sim_no_fallback_without_a_shared_pool(rig: CudaRig, fake_cuda: FakeCuda) -> None:
    fake_cuda.map_fails = "its GPU GPU-fake is not visible in this process"
    with pytest.raises(RelayError, match=r"not visible.*no shared-memory pool to fall back on"):
        rig.sender("cuda-ipc", rig.ingress())


def test_sim_a_malformed_export_is_a_relay_error(rig: CudaRig, fake_cuda: FakeCuda) -> None:
    class Bad:
        def to_json(self) -> dict[str, Any]:
            obj = _export().to_json()
            obj["ref_offset"] = 10**9  # torch would decrement a counter out of bounds
            return obj

    fake_cuda.export = Bad()
    with pytest.raises(RelayError, match=r"bad cuda-ipc welcome.*ref_offset"):
        rig.sender("cuda-ipc", rig.ingress())


def test_cuda_ipc_to_a_host_pool_falls_back_to_its_shared_memory(
    shm_ingress: Ingress, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(handles, "unavailable_reason", lambda: None)  # as if CUDA were here
    with caplog.at_level(logging.WARNING, logger="disagg_runtime.relay.backends.cuda_ipc.send"):
        sender = connect("cuda-ipc", shm_ingress.endpoint, timeout=WAIT, key=KEY)
    try:
        assert isinstance(sender, CudaIpcSender) and sender.mode == "shm"
        assert any("is shm memory" in r.getMessage() for r in caplog.records)
        sender.send(big_payload(7), request_id="fallback")
        msg = shm_ingress.recv(timeout=WAIT)
        assert msg.slot is not None and same(msg.payload, big_payload(7))
        msg.release()
    finally:
        sender.close()


@pytest.mark.parametrize(
    "manifest",
    [
        {"v": 1, "tree": {"t": 0}, "nbytes": 64, "tensors": [{"offset": 0}]},
        {"v": 1, "tree": {"t": 0}, "nbytes": 2 * MiB, "tensors": []},  # over the slot
        {
            "v": 1,
            "tree": {"t": 0},
            "nbytes": 16,
            "tensors": [{"dtype": "uint8", "shape": [16], "offset": 8}],
        },  # misaligned
        "not a manifest",
    ],
)
def test_sim_cuda_ipc_slot_manifests_are_checked_like_any_other(
    rig: CudaRig, manifest: Any
) -> None:
    ingress = rig.ingress()
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, auth.routing_id())
    sock.connect(ingress.endpoint)

    def reply() -> dict[str, Any]:
        return recv_reply(sock)  # `load` reports skipped

    try:
        handshake(sock, relay="cuda-ipc")
        sock.send(proto.pack("reserve", rid="m", xid=1, nbytes=MiB, wait_s=2.0))
        grant = reply()
        event = _b64(bytes(range(EVENT_HANDLE_BYTES)))  # opens: the copy is "done"
        fields = {"rid": "m", "xid": 1, "offset": grant["offset"], "manifest": manifest}
        sock.send(proto.pack("commit", **fields, event=event))
        nack = reply()
        assert nack["op"] == "nack" and "manifest" in nack["reason"]
        assert ingress.stats().pool_used == 0  # the copy was complete: freed at once
    finally:
        sock.close(linger=0)
