"""How rank 0 of a replica hands each request to the other ranks: one broadcast of a notice.

Rank 0 alone receives requests (the replica's ingress and pool are its own). Before its
handler runs a request, it broadcasts the request's inputs to every other rank over a gloo
group (CPU tensors; the handler's own group may be NCCL), and they call the same handler on
the same inputs, so that the handler's collectives (tensor-parallel all-reduces, a CFG
all-gather) meet. Every message starts with a fixed notice:

    notice   int64[4]: kind, header bytes, request sequence number, flags
    header   uint8[header bytes]: JSON {"tree": the inputs' tree (wire/tree.py), "tensors":
             their metas, "where": per tensor its byte offset in rank 0's shared pool, or -1}
    tensors  one broadcast per tensor whose "where" is -1, in order

Kinds: CALL (one payload), BATCH (a list of payloads), NEXT / END (advance or close the
generator the last CALL returned, so that a stream that rank 0's client abandons stops on
every rank at the same step), KEEPALIVE (nothing to do; sent when idle, so that a rank's
wait for the next notice can carry a timeout and a dead rank 0 is seen), STOP (close).

Two ways for the tensors (`mode`): `broadcast` sends every tensor (works across pods);
`shm` (ranks in one pod, rank 0's pool is POSIX shared memory) sends only the offset of each
tensor that lies in the pool, and the other ranks read it from their read-only mapping of
the pool (zero copy; tensors elsewhere are broadcast). `disagg bench ranks` measures both.
The inputs stay valid while the handler runs: rank 0 frees its slots only after its own
handler call has returned, which is after every collective of the call has completed.

A handler that writes its inputs in place (`writes_inputs = True`, docs/handlers.md) gets
`private` inputs: under `shm` the other ranks copy each pool tensor out of the mapping (a
memmove), and a barrier after the notice holds rank 0's handler until every rank holds its
copy, so rank 0's writes are never seen by the others. Without it a write on a rank > 0 hits
the read-only mapping (SIGSEGV: the rank dies, the replica restarts). Broadcast tensors are
the ranks' own anyway.

Every wait is a collective of the group, and the group has a timeout: a rank that dies makes
the others' next collective fail (or time out) instead of hanging.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import warnings
from dataclasses import dataclass
from typing import Any, Final, Literal

import torch
import torch.distributed as dist

from disagg_runtime.memory.pool import SHM_DIR, SHM_PREFIX, Pool
from disagg_runtime.wire import codec
from disagg_runtime.wire import tree as wire_tree

CALL: Final = 1
BATCH: Final = 2
NEXT: Final = 3
END: Final = 4
KEEPALIVE: Final = 5
STOP: Final = 6
HELLO: Final = 7
KINDS: Final = frozenset({CALL, BATCH, NEXT, END, KEEPALIVE, STOP, HELLO})
MAX_NOTICE_HEADER: Final = codec.MAX_HEADER_BYTES + 64 * 1024  # the wire's, plus "where"
Mode = Literal["broadcast", "shm"]
MODES: Final[tuple[Mode, ...]] = ("broadcast", "shm")


class FeedError(RuntimeError):
    """A notice that does not parse, or a pool a rank cannot map: the group is broken."""


@dataclass(frozen=True)
class Notice:
    kind: int
    seq: int
    payload: Any = None


class Feed:
    """One end of the feed. Rank 0 `send`s, the others `receive`; both sides in order."""

    def __init__(
        self, group: Any, *, rank: int, mode: Mode = "broadcast", private: bool = False
    ) -> None:
        self.group = group
        self.rank = rank
        self.mode: Mode = mode
        self.private = private  # rank 0 says so in its hello
        self.seq = 0
        self._pool: Pool | None = None
        self._base = 0
        self._size = 0
        self._view: torch.Tensor | None = None  # the other ranks' read-only pool mapping
        self._mapping: mmap.mmap | None = None

    def use_pool(self, pool: Pool) -> None:
        """Rank 0: send tensors that lie in `pool` (shared memory) as offsets (`shm`)."""
        if pool.backing.device != "shm" or pool.name is None:
            return
        self._pool = pool
        self._base = pool.backing.tensor.data_ptr()
        self._size = pool.backing.size
        self.mode = "shm"

    # ---- rank 0 --------------------------------------------------------------------------
    def hello(self) -> None:
        """Tell the others how inputs travel (and the pool's name for `shm`)."""
        name = self._pool.name if self._pool is not None and self.mode == "shm" else None
        self._send(HELLO, {"mode": self.mode, "pool": name, "private": self.private})

    def send(self, kind: int, payload: Any = None) -> None:
        self.seq += 1
        self._send(kind, payload)

    def _send(self, kind: int, payload: Any) -> None:
        tree, tensors = wire_tree.flatten(payload)
        where = [self._offset(t) for t in tensors]
        metas = [codec.TensorMeta.of(t).to_json() for t in tensors]
        raw = codec.encode_header(
            {"v": codec.FORMAT_VERSION, "tree": tree, "tensors": metas, "where": where}
        )
        if len(raw) > MAX_NOTICE_HEADER:
            raise codec.CodecError(
                f"rank feed: a header of {len(raw)} bytes, over {MAX_NOTICE_HEADER}; "
                "move large values into tensors"
            )
        notice = torch.tensor([kind, len(raw), self.seq, 0], dtype=torch.int64)
        dist.broadcast(notice, 0, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8), 0, group=self.group)
        for tensor, offset in zip(tensors, where, strict=True):
            if offset < 0 and tensor.numel():
                dist.broadcast(tensor, 0, group=self.group)
        if self._copied(where):
            dist.barrier(group=self.group)  # every rank copied its inputs: rank 0 may write

    def _copied(self, where: list[Any]) -> bool:
        """Whether the others copy pool tensors out of this notice (both sides agree)."""
        return self.private and self.mode == "shm" and any(o >= 0 for o in where)

    def _offset(self, t: torch.Tensor) -> int:
        if self.mode != "shm" or not t.numel():
            return -1
        start = t.data_ptr() - self._base
        if start >= 0 and start + t.numel() * t.element_size() <= self._size:
            return start
        return -1

    # ---- ranks > 0 -----------------------------------------------------------------------
    def receive(self) -> Notice:
        """The next notice; FeedError when it does not parse (the group is broken then)."""
        try:
            return self._receive()
        except codec.CodecError as exc:
            raise FeedError(f"rank feed: {exc}") from None

    def _receive(self) -> Notice:
        notice = torch.empty(4, dtype=torch.int64)
        dist.broadcast(notice, 0, group=self.group)
        kind, length, seq, _ = (int(v) for v in notice)
        if kind not in KINDS or not 0 < length <= MAX_NOTICE_HEADER:
            raise FeedError(f"rank feed: notice kind {kind}, header {length} B: not ours")
        raw = torch.empty(length, dtype=torch.uint8)
        dist.broadcast(raw, 0, group=self.group)
        header = codec.decode_header(raw.numpy().tobytes(), max_bytes=MAX_NOTICE_HEADER)
        where = header.pop("where", None)
        metas = [
            codec.TensorMeta.from_json(spec, where=f"tensors[{i}]")
            for i, spec in enumerate(header.get("tensors") or [])
        ]
        if not isinstance(where, list) or len(where) != len(metas):
            raise FeedError("rank feed: a notice without one place per tensor")
        tensors = [self._tensor(meta, offset) for meta, offset in zip(metas, where, strict=True)]
        if self._copied(where):
            dist.barrier(group=self.group)
        payload = wire_tree.unflatten(header.get("tree"), tensors)
        if kind == HELLO:
            self._attach(payload)
        self.seq = seq
        return Notice(kind, seq, payload)

    def _tensor(self, meta: codec.TensorMeta, offset: object) -> torch.Tensor:
        if type(offset) is not int:
            raise FeedError(f"rank feed: offset {offset!r} is not an integer")
        if offset < 0:
            tensor = torch.empty(meta.shape, dtype=meta.dtype)
            if tensor.numel():
                dist.broadcast(tensor, 0, group=self.group)
            return tensor
        if self._view is None or offset + meta.nbytes > self._view.numel():
            raise FeedError(f"rank feed: {meta.nbytes} B at offset {offset} is outside the pool")
        flat = self._view[offset : offset + meta.nbytes]
        if self.private:
            flat = flat.clone()  # the handler's own (writable) copy
        return flat.view(meta.dtype).view(meta.shape)

    def _attach(self, hello: Any) -> None:
        mode, name = (hello or {}).get("mode"), (hello or {}).get("pool")
        private = (hello or {}).get("private", False)
        if mode not in MODES:
            raise FeedError(f"rank feed: unknown mode {mode!r}")
        if not isinstance(private, bool):
            raise FeedError(f"rank feed: private {private!r} is not a boolean")
        self.mode = mode
        self.private = private
        if mode != "shm":
            return
        if not isinstance(name, str) or not name.startswith(SHM_PREFIX) or "/" in name:
            raise FeedError(f"rank feed: {name!r} is not a disagg pool name")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
        try:
            self._mapping = mmap.mmap(fd, 0, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        with warnings.catch_warnings():  # read-only on purpose: inputs are rank 0's
            warnings.simplefilter("ignore", UserWarning)
            self._view = torch.frombuffer(self._mapping, dtype=torch.uint8)

    def close(self) -> None:
        self._view = None
        if self._mapping is not None:
            with contextlib.suppress(BufferError):  # a tensor still views it: unmapped at exit
                self._mapping.close()
            self._mapping = None
