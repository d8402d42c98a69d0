"""The `cuda-ipc` relay: roles on one GPU hand tensors over without leaving it.

The receiver owns a CUDA receive pool (`Pool(device="cuda")`), exactly as the shm relay's
receiver owns a shared-memory pool, so flow control, slot leases and the occupancy the
autoscaler reads work the same way. The control messages are the relay protocol's
(`protocol.py`) with two additions:

    sender (CudaIpcSender)                       receiver (CudaIpcLanding, cuda pool)
    hello {relay: "cuda-ipc"}              -->
                                           <--   welcome {..., cuda: EXPORT}
                                                 (the pool exported once for this peer;
                                                  or cuda_unavailable: reason)
    map EXPORT once (cudaIpcOpenMemHandle)
    reserve {rid, xid, nbytes}             -->
                                           <--   grant {xid, offset, lease_s}
    copy stream waits for the producer's stream, copies the tensors into the slot,
    records the peer's interprocess event
    commit {rid, xid, offset, manifest, event}  -->   wait (poll) for the event, then
                                                       deliver views of the slot
                                           <--   ack {xid}   (send() returns)
    ... the receiving role releases the message: its stream is synchronized, the slot freed

EXPORT = {"v": 1, "device": int, "uuid": str, "handle": b64, "size": int, "offset": int,
"ref": b64, "ref_offset": int, "event": b64, "event_sync": bool, "token": str}: the fields of
`torch.UntypedStorage._share_cuda_()` (what torch.multiprocessing pickles; here JSON),
plus the GPU's UUID (device indexes differ between containers) and a per-process token (a
process cannot open its own IPC handle). The per-transfer `event` is the sender's one
interprocess event (64 bytes, base64), recorded anew for each transfer: a sender has one
transfer in flight at a time, and the receiver has seen it complete before it acks.

Payloads holding GPU tensors always take the pool path, however small (the receiver finds
them on the GPU whatever their size); host-only small payloads still go inline.

Every field is checked before use (`Export.from_json`, `parse_event_handle`); a malformed
one is a `ProtocolError`. If CUDA IPC is not possible for a peer (no CUDA pool there,
another GPU, the mapping fails), the sender falls back to the receiver's shared-memory pool,
when it has one, and logs why.
"""

from __future__ import annotations

import base64
import binascii
import logging
import re
import secrets
from dataclasses import dataclass
from typing import Any, cast

import torch

from disagg_runtime.memory.pool import Backing, cuda_unavailable_reason
from disagg_runtime.relay import protocol as proto

log = logging.getLogger(__name__)
EXPORT_VERSION = 1
EVENT_HANDLE_BYTES = 64  # CUDA_IPC_HANDLE_SIZE
MAX_MEM_HANDLE_BYTES = 4096  # torch's handle: a version, a kind, then cudaIpcMemHandle_t or more
REF_COUNTER_SLOTS = 10_000  # torch's CUDA_IPC_REF_COUNTER_FILE_SIZE
_MAX_INT = 1 << 62
_REF_NAME = re.compile(rb"/torch_[0-9A-Za-z_]{1,96}")
_EXPORT_KEYS = frozenset(
    {
        "v",
        "device",
        "uuid",
        "handle",
        "size",
        "offset",
        "ref",
        "ref_offset",
        "event",
        "event_sync",
        "token",
    }
)
PROCESS_TOKEN = secrets.token_hex(8)


def unavailable_reason() -> str | None:
    """Why this process cannot use CUDA IPC, or None when it can."""
    reason = cuda_unavailable_reason()
    if reason is not None:
        return reason
    if not hasattr(torch.UntypedStorage, "_share_cuda_"):
        return f"this torch ({torch.__version__}) cannot share CUDA memory between processes"
    return None


def device_uuid(index: int) -> str:
    """A stable name of GPU `index` that another container can match ("" if unknown)."""
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    return str(uuid) if uuid is not None else ""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(msg: dict[str, Any], name: str, limit: int) -> bytes:
    text = msg.get(name)
    if not isinstance(text, str) or len(text) > 4 * ((limit + 2) // 3):
        raise proto.ProtocolError(f"cuda export: {name!r} must be base64 of at most {limit} B")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise proto.ProtocolError(f"cuda export: {name!r} is not valid base64") from None
    if not data:
        raise proto.ProtocolError(f"cuda export: {name!r} is empty")
    return data


def _int(msg: dict[str, Any], name: str, low: int, high: int) -> int:
    value = msg.get(name)
    if type(value) is not int or not low <= value < high:
        raise proto.ProtocolError(f"cuda export: {name!r} must be an integer in [{low}, {high})")
    return value


def _text(msg: dict[str, Any], name: str) -> str:
    value = msg.get(name)
    if not isinstance(value, str) or len(value) > 128:
        raise proto.ProtocolError(f"cuda export: {name!r} must be a string (<= 128 chars)")
    return value


def parse_event_handle(obj: object) -> bytes:
    """The commit's `event`: base64 of a cudaIpcEventHandle_t (exactly 64 bytes)."""
    if not isinstance(obj, str) or len(obj) > 128:
        raise proto.ProtocolError("commit: 'event' must be a base64 CUDA event handle")
    try:
        handle = base64.b64decode(obj, validate=True)
    except (binascii.Error, ValueError):
        raise proto.ProtocolError("commit: 'event' is not valid base64") from None
    if len(handle) != EVENT_HANDLE_BYTES:
        raise proto.ProtocolError(
            f"commit: 'event' holds {len(handle)} B, a CUDA event handle is {EVENT_HANDLE_BYTES}"
        )
    return handle


def encode_event_handle(handle: bytes) -> str:
    if len(handle) != EVENT_HANDLE_BYTES:
        raise ValueError(f"a CUDA event handle is {EVENT_HANDLE_BYTES} B, not {len(handle)}")
    return _b64(handle)


@dataclass(frozen=True)
class Export:
    """One pool's CUDA IPC export for one peer (see the module docstring)."""

    device: int
    uuid: str
    handle: bytes
    size: int
    offset: int
    ref: bytes
    ref_offset: int
    event: bytes
    event_sync: bool
    token: str

    def to_json(self) -> dict[str, Any]:
        return {
            "v": EXPORT_VERSION,
            "device": self.device,
            "uuid": self.uuid,
            "handle": _b64(self.handle),
            "size": self.size,
            "offset": self.offset,
            "ref": _b64(self.ref),
            "ref_offset": self.ref_offset,
            "event": _b64(self.event),
            "event_sync": self.event_sync,
            "token": self.token,
        }

    @classmethod
    def from_json(cls, obj: object) -> Export:
        """Parse and check an export that crossed a socket; ProtocolError if malformed."""
        if not isinstance(obj, dict):
            raise proto.ProtocolError("cuda export: expected an object")
        unknown = set(obj) - _EXPORT_KEYS
        if unknown:
            raise proto.ProtocolError(f"cuda export: unknown field(s) {sorted(unknown)[:5]}")
        if type(obj.get("v")) is not int or obj.get("v") != EXPORT_VERSION:
            raise proto.ProtocolError(f"cuda export: unsupported version {obj.get('v')!r:.20}")
        ref = _unb64(obj, "ref", 128)
        if not _REF_NAME.fullmatch(ref):
            raise proto.ProtocolError("cuda export: 'ref' is not a torch IPC ref-counter name")
        event = _unb64(obj, "event", EVENT_HANDLE_BYTES)
        if len(event) != EVENT_HANDLE_BYTES:
            raise proto.ProtocolError(f"cuda export: 'event' must be {EVENT_HANDLE_BYTES} B")
        event_sync = obj.get("event_sync")
        if not isinstance(event_sync, bool):
            raise proto.ProtocolError("cuda export: 'event_sync' must be a boolean")
        return cls(
            device=_int(obj, "device", 0, 1 << 16),
            uuid=_text(obj, "uuid"),
            handle=_unb64(obj, "handle", MAX_MEM_HANDLE_BYTES),
            size=_int(obj, "size", 1, _MAX_INT),
            offset=_int(obj, "offset", 0, _MAX_INT),
            ref=ref,
            ref_offset=_int(obj, "ref_offset", 0, REF_COUNTER_SLOTS),
            event=event,
            event_sync=event_sync,
            token=_text(obj, "token"),
        )


def export_pool(backing: Backing) -> Export:
    """Share a CUDA pool's memory with one more peer (torch keeps a ref count per export,
    so the memory outlives a peer that still maps it)."""
    storage = backing.tensor.untyped_storage()
    index = backing.tensor.device.index
    assert index is not None  # a cuda backing lives on one device
    with torch.cuda.device(index):
        fields = cast(Any, storage)._share_cuda_()
    device, handle, size, offset, ref, ref_offset, event, event_sync = fields
    if handle is None or size < backing.size:
        raise RuntimeError("the pool's storage cannot be shared (empty?)")
    return Export(
        device=int(device),
        uuid=device_uuid(index),
        handle=bytes(handle),
        size=backing.size,
        offset=int(offset),
        ref=bytes(ref),
        ref_offset=int(ref_offset),
        event=bytes(event),
        event_sync=bool(event_sync),
        token=PROCESS_TOKEN,
    )


class CannotMap(RuntimeError):
    """This process cannot map a peer's export (same process, another GPU, CUDA refused)."""


def local_device(export: Export) -> int:
    """The index, in this process, of the GPU the export lives on."""
    if not export.uuid:
        return export.device  # no UUID on the other side: same numbering assumed
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == export.uuid:
            return index
    raise CannotMap(f"its GPU {export.uuid} is not visible in this process")


def map_export(export: Export, stream: torch.cuda.Stream) -> Backing:
    """Open a peer's pool once; waits, on `stream`, for the exporter's pending work."""
    if export.token == PROCESS_TOKEN:
        raise CannotMap("the receiver is this very process")
    index = local_device(export)
    try:
        with torch.cuda.device(index), torch.cuda.stream(stream):
            storage = torch.UntypedStorage._new_shared_cuda(
                index,
                export.handle,
                export.size,
                export.offset,
                export.ref,
                export.ref_offset,
                export.event,
                export.event_sync,
            )
    except RuntimeError as exc:
        raise CannotMap(f"CUDA could not open the pool's IPC handle: {exc}") from None
    if storage.nbytes() < export.size:
        raise CannotMap(f"the mapped pool holds {storage.nbytes()} B, not {export.size}")
    tensor = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
    tensor.set_(storage, 0, (export.size,), (1,))
    return Backing("cuda", tensor, owner=False)
