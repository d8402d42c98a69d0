"""The sending side of `cuda-ipc`: an shm sender whose payloads go GPU to GPU.

It maps the receiver's pool once from the export in its welcome (handles.py), copies each
payload into its slot on its own stream and commits with an interprocess event the
receiver waits on (land.py); to a host pool (or with no CUDA here) it stays an shm sender.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Literal, cast

import torch

from disagg_runtime.memory.copies import new_event, new_stream
from disagg_runtime.memory.layout import write_tensors
from disagg_runtime.memory.pool import Backing
from disagg_runtime.relay import protocol as proto
from disagg_runtime.relay.backends.cuda_ipc import handles
from disagg_runtime.relay.backends.shm import ShmSender
from disagg_runtime.relay.errors import RelayError
from disagg_runtime.relay.sender import Transfer

log = logging.getLogger(__name__)


class CudaIpcSender(ShmSender):
    """Copies tensors (GPU or host) straight into the receiver's CUDA pool, mapped once.

    `mode` is "cuda-ipc", or "shm" when CUDA IPC is not possible with this receiver and
    its shared-memory pool is used instead (the reason is logged).
    """

    kind: ClassVar[str] = "cuda-ipc"
    binary_commit: ClassVar[bool] = False  # its commits carry the CUDA event (JSON)

    def __init__(self, endpoint: str, **kwargs: Any) -> None:
        reason = handles.unavailable_reason()
        if reason is not None:
            raise RelayError(f"relay cuda-ipc to {endpoint} needs CUDA, and {reason}")
        self.mode: Literal["cuda-ipc", "shm"] = "cuda-ipc"
        self._mapped: Backing | None = None
        self._stream: torch.cuda.Stream | None = None
        self._event: torch.cuda.Event | None = None
        self._event_b64 = ""
        super().__init__(endpoint, **kwargs)

    def _on_welcome(self, welcome: dict[str, Any]) -> None:
        exported = welcome.get("cuda")
        if exported is None:
            reason = str(welcome.get("cuda_unavailable") or "the receiver offers no CUDA pool")
            self._fall_back(welcome, reason[:300])
            return
        try:
            export = handles.Export.from_json(exported)
            if export.size < proto.nonneg_int(welcome, "pool_size"):
                raise proto.ProtocolError("cuda export: smaller than the welcome's pool_size")
        except proto.ProtocolError as exc:
            raise RelayError(f"bad cuda-ipc welcome from {self.endpoint}: {exc}") from None
        try:
            index = handles.local_device(export)
            self._stream = new_stream(torch.device("cuda", index))
            self._mapped = handles.map_export(export, self._stream)
            with torch.cuda.device(index):
                self._event = new_event(interprocess=True)
                self._event_b64 = handles.encode_event_handle(
                    bytes(cast(Any, self._event).ipc_handle())
                )
        except (handles.CannotMap, RuntimeError, ValueError) as exc:  # CUDA refused: not a bug here
            self._release_mapping()
            self._fall_back(welcome, str(exc))

    def _fall_back(self, welcome: dict[str, Any], reason: str) -> None:
        if not isinstance(welcome.get("pool"), str):
            raise RelayError(
                f"cuda-ipc to {self.endpoint} is not possible ({reason}), and the receiver has "
                "no shared-memory pool to fall back on; use the tcp relay"
            )
        log.warning(
            "cuda-ipc relay to %s: CUDA IPC is not possible (%s); using its shared memory",
            self.endpoint,
            reason,
        )
        self.mode = "shm"
        super()._on_welcome(welcome)

    def _inline(self, tensors: list[torch.Tensor], nbytes: int) -> bool:
        """Payloads holding GPU tensors always go through the CUDA pool, however small, so
        the receiver finds them on the GPU whatever their size."""
        on_gpu = self._mapped is not None and any(t.is_cuda for t in tensors)
        return not on_gpu and super()._inline(tensors, nbytes)

    def _commit_fields(self) -> dict[str, Any]:
        return {"event": self._event_b64} if self._mapped is not None else {}

    def _spare_limit(self) -> int:
        """No spares into a CUDA pool: its commits wait on a CUDA event first (kept apart
        from the shared-memory path, whose spares are measured)."""
        return 0 if self._mapped is not None else super()._spare_limit()

    def _transfer(self, transfer: Transfer) -> None:
        commit, xid, offset = transfer.commit, transfer.xid, transfer.offset
        manifest, tensors, write_by = transfer.manifest, transfer.tensors, transfer.write_by
        if self._mapped is None or self._stream is None or self._event is None:
            super()._transfer(transfer)
            return
        if offset + manifest.nbytes > self._mapped.size:
            raise RelayError(f"receiver at {self.endpoint} granted a slot outside its pool")
        self._check_lease(xid, write_by)
        write_tensors(self._mapped, offset, manifest, tensors, stream=self._stream)
        self._event.record(self._stream)  # the receiver waits on this before delivering
        self._control(commit)  # where the reservation went, and where the ack will come

    def _release_mapping(self) -> None:
        mapped, self._mapped = self._mapped, None
        if mapped is not None and self._stream is not None:
            # torch's IPC deleter synchronizes the current stream (our copies) first
            with torch.cuda.stream(self._stream):
                mapped.close()
        self._event = None

    def _on_close(self) -> None:
        self._release_mapping()
        super()._on_close()
