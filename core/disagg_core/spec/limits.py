"""How many items a list of a pipeline may hold and how long its strings may be: the one
place for these numbers. The CRD's `maxItems`/`maxLength` (operator/disagg_operator/gen/crd.py)
and the spec's field readers (`fields.items`, `fields.text`) both read them, so `disagg
validate` refuses what the API server would, and `render` never sees more than the CRD
allows. A unit test walks the CRD for every bound and checks that the spec enforces it.

Paths are field paths with list indices written `[]` (`spec.roles[].env`). Bounds that the
spec checks elsewhere with their own message (names are DNS labels of at most 63
characters) are not repeated here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

from disagg_core import compat
from disagg_core.spec import model

MAX_ROLES: Final = 64
MAX_EDGES: Final = 256
MAX_TENSOR_REFS: Final = 16
MAX_GROUPS: Final = 16
MAX_GROUP_ROLES: Final = 8
MAX_ENV: Final = 128
MAX_PORTS: Final = 32
MAX_ARGS: Final = 256
MAX_IMAGE_LENGTH: Final = 1024
MAX_HANDLER_LENGTH: Final = 512
MAX_PATH_LENGTH: Final = 256
MAX_ENV_NAME_LENGTH: Final = 256
MAX_NETWORK_PEERS: Final = 32
# A replica of a role is a group of `nodes` pods of `ranks` processes each (issue 33): one
# rank per GPU, so 64 per pod is past any node; LeaderWorkerSet caps a group at a few
# hundred pods, and a world of 64 x 64 = 4096 ranks is past every tensor/sequence-parallel
# deployment. The CRD's `maximum`s and the spec's readers both read these.
MAX_RANKS: Final = 64
MAX_NODES: Final = 64
MAX_URL_LENGTH: Final = 2048
# A free-form mapping (podTemplate, handlerArgs) nests at most this deep (the API server
# stores at most 100 levels of JSON; a deeper one would only crash the renderers).
MAX_FREE_DEPTH: Final = 64

MAX_ITEMS: Final[Mapping[str, int]] = {
    "spec.roles": MAX_ROLES,
    "spec.roles[].command": MAX_ARGS,
    "spec.roles[].args": MAX_ARGS,
    "spec.roles[].env": MAX_ENV,
    "spec.roles[].ports": MAX_PORTS,
    "spec.roles[].compatibleWith": compat.MAX_ACCEPTS,
    "spec.edges": MAX_EDGES,
    "spec.edges[].tensorRefs": MAX_TENSOR_REFS,
    "spec.colocation": MAX_GROUPS,
    "spec.colocation[].roles": MAX_GROUP_ROLES,
    "spec.networkPolicy.clients": MAX_NETWORK_PEERS,
    "spec.networkPolicy.metricsFrom": MAX_NETWORK_PEERS,
    "spec.ratioLocks": MAX_ROLES,
    "spec.rollout.groups": MAX_ROLES,
    "spec.rollout.groups[]": MAX_ROLES,
}
MAX_LENGTH: Final[Mapping[str, int]] = {
    "spec.image": MAX_IMAGE_LENGTH,
    "spec.roles[].image": MAX_IMAGE_LENGTH,
    "spec.roles[].handler": MAX_HANDLER_LENGTH,
    "spec.roles[].engine.model": MAX_URL_LENGTH,
    "spec.roles[].env[].name": MAX_ENV_NAME_LENGTH,
    "spec.edges[].tensorRefs[].path": MAX_PATH_LENGTH,
    "spec.edges[].tensorRefs[].to": model.MAX_LABEL_LENGTH,
    "spec.monitoring.tracing.endpoint": MAX_URL_LENGTH,
}
_INDEX = re.compile(r"\[\d+\]")


def generic(path: str) -> str:
    """`spec.roles[3].env` -> `spec.roles[].env`."""
    return _INDEX.sub("[]", path)


def max_items(path: str) -> int | None:
    return MAX_ITEMS.get(generic(path))


def max_length(path: str) -> int | None:
    return MAX_LENGTH.get(generic(path))


def deeper_than(value: object, limit: int = MAX_FREE_DEPTH) -> tuple[str, ...] | None:
    """The keys/indices down to the first node deeper than `limit`, or None. Iterative
    (no recursion to exhaust), and it stops at the first such node."""
    stack: list[tuple[object, tuple[str, ...]]] = [(value, ())]
    while stack:
        node, where = stack.pop()
        if len(where) > limit:
            return where
        if isinstance(node, dict):
            stack.extend((item, (*where, str(key))) for key, item in node.items())
        elif isinstance(node, list):
            stack.extend((item, (*where, f"[{i}]")) for i, item in enumerate(node))
    return None
