"""The `tcp` relay: across nodes; after the grant the sender streams the slot's bytes as
chunk messages that the receiver `recv_into`s at their place in the slot (relay/landing.py
`Chunked`, through the pool's `Memory`).
"""

from __future__ import annotations

from typing import Any

import torch

from disagg_runtime import codec
from disagg_runtime.copies import copy_async
from disagg_runtime.layout import slot_views
from disagg_runtime.manifest import Manifest
from disagg_runtime.pool import Backing, PoolError, pinned_staging
from disagg_runtime.relay.errors import RelayError
from disagg_runtime.relay.registry import Backend
from disagg_runtime.relay.sender import CHUNK_BYTES, ZERO_COPY_MIN, Sender


class TcpSender(Sender):
    """Streams tensors as zero-copy chunk frames that land in the receiver's pool. With a
    lane, reservations, grants and acknowledgements travel there (one thread wake-up each
    instead of three); the commit and its chunks stay on ZMQ, in order."""

    kind = "tcp"
    control_on_lane = True

    def __init__(self, endpoint: str, *, chunk_bytes: int = CHUNK_BYTES, **kwargs: Any) -> None:
        self.chunk_bytes = chunk_bytes
        self._staging: Backing | None = None
        super().__init__(endpoint, **kwargs)

    def _commit_fields(self) -> dict[str, Any]:
        return {"chunk": self.chunk_bytes}

    def _transfer(
        self,
        commit: bytes,
        xid: int,
        offset: int,
        manifest: Manifest,
        tensors: list[torch.Tensor],
        write_by: float,
    ) -> None:
        self._check_lease(xid, write_by)
        chunks: list[memoryview] = []
        for tensor in self._host_tensors(manifest, tensors):
            raw = codec.tensor_bytes(tensor)
            chunks.extend(
                raw[i : i + self.chunk_bytes] for i in range(0, len(raw), self.chunk_bytes)
            )
        self._sock.send(commit)
        for chunk in chunks:  # one message each: libzmq buffers a multipart message whole
            self._sock.send(chunk, copy=len(chunk) < ZERO_COPY_MIN)

    def _host_tensors(self, manifest: Manifest, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """GPU tensors are copied once, on the copy stream, into a private pinned staging
        buffer (grown to the largest payload, then reused) and sent from there. Reuse is
        safe: the previous transfer was acknowledged, so the receiver has all its chunks."""
        if not any(t.is_cuda for t in tensors):
            return tensors
        if self._staging is None or self._staging.size < manifest.nbytes:
            if self._staging is not None:
                self._staging.close()
                self._staging = None
            try:
                self._staging = pinned_staging(manifest.nbytes)
            except PoolError as exc:
                raise RelayError(f"tcp relay to {self.endpoint}: {exc}") from None
        views = slot_views(self._staging, 0, manifest)
        copy_async([(v, t) for v, t in zip(views, tensors, strict=True) if t.is_cuda]).wait()
        return [v if t.is_cuda else t for v, t in zip(views, tensors, strict=True)]

    def _on_close(self) -> None:
        if self._staging is not None:
            self._staging.close()
            self._staging = None


BACKEND = Backend("tcp", sender=TcpSender)
