"""The relay kinds an edge may name: one table, read by the spec, the CRD and the docs.

Core holds only the names and what they mean (it must stay torch-free and never import the
runtime); each kind's implementation registers itself in the runtime
(disagg_runtime/relay/registry.py), and a test checks that both sides list the same kinds.
Adding a relay is: a row here, its module in the runtime, its tests.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, get_args

RelayKind = Literal["auto", "shm", "tcp", "cuda-ipc", "nixl"]
AUTO: RelayKind = "auto"


@dataclass(frozen=True)
class RelayInfo:
    """What a relay kind is for, as the docs and the CRD say it."""

    name: RelayKind
    summary: str  # one phrase: when to use it
    same_node: bool = False  # both roles must share a node (shared memory)
    same_gpu: bool = False  # both roles must share a GPU (one colocation group)
    package: str | None = None  # the optional Python package its roles' images need
    extra: str | None = None  # the disagg extra that installs it


KINDS: tuple[RelayInfo, ...] = (
    RelayInfo("shm", "shared memory within a node", same_node=True),
    RelayInfo("tcp", "TCP streams across nodes"),
    RelayInfo("cuda-ipc", "roles on one GPU, i.e. one colocation group", same_gpu=True),
    RelayInfo(
        "nixl",
        "one-sided NIXL writes, RDMA where the node has it; needs the nixl extra",
        package="nixl",
        extra="nixl",
    ),
)
BY_NAME: dict[str, RelayInfo] = {info.name: info for info in KINDS}
RELAYS: tuple[RelayKind, ...] = get_args(RelayKind)  # `auto` first, then KINDS in order
CONCRETE: tuple[RelayKind, ...] = tuple(info.name for info in KINDS)  # what `auto` picks from


RDMA_MARK = "rdma"  # a pod resource whose name has it is an RDMA device (rdma/hca_shared_...)


def requests_rdma(resource_names: Iterable[str]) -> bool:
    """Whether a container's requested or limited resources include an RDMA device, the way
    the RDMA device plugins name them (`rdma/hca_shared_devices_a`, `rdma/rdma_shared_device_a`,
    `nvidia.com/rdma...`): `auto` then prefers nixl towards peers that have one too."""
    return any(RDMA_MARK in name.lower() for name in resource_names)


def missing_here(kind: str) -> str | None:
    """What a relay kind's roles need that this Python environment lacks (without importing
    it), or None: `disagg validate` notes it, since the roles' images are not checked."""
    info = BY_NAME.get(kind)
    if info is None or info.package is None or importlib.util.find_spec(info.package):
        return None
    return (
        f"relay {kind} needs the {info.package} package in the roles' images "
        f"(pip install 'disagg[{info.extra}]'); it is not installed where this runs"
    )


def describe() -> str:
    """`shm (shared memory within a node), tcp (...), ...`: for field descriptions."""
    return ", ".join(f"{info.name} ({info.summary})" for info in KINDS)
