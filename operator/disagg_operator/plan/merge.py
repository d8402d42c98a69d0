"""Deep merge of a role's `podTemplate` into the pod template the planner built.

Rules (a small, predictable subset of Kubernetes strategic merge):

- mappings merge recursively; the overlay's value wins for scalars;
- an overlay value of `null` (None) removes the key (e.g. `readOnlyRootFilesystem: null`);
- lists whose items are named objects merge item by item on their merge key, overlay items
  that match nothing are appended: `containers`, `initContainers`, `ephemeralContainers`,
  `volumes`, `env`, `resourceClaims`, `imagePullSecrets` by `name`, `volumeMounts` by
  `mountPath`. So a podTemplate can add a sidecar, a volume or a variable without repeating
  the planner's;
- every other list (`args`, `command`, `tolerations`, `ports`, ...) is replaced whole.

Inputs are never modified; the result shares no mutable object with them.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

MERGE_KEYS: dict[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "env": "name",
    "resourceClaims": "name",
    "imagePullSecrets": "name",
    "volumeMounts": "mountPath",
}


def deep_merge(base: Mapping[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    """`overlay` merged into a copy of `base` by the rules above."""
    result = copy.deepcopy(dict(base))
    for key, value in overlay.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(result.get(key), Mapping):
            result[key] = deep_merge(result[key], value)
        elif key in MERGE_KEYS and isinstance(value, list) and isinstance(result.get(key), list):
            result[key] = _merge_list(result[key], value, MERGE_KEYS[key])
        else:
            result[key] = copy.deepcopy(value)
    return result


def _merge_list(base: list[Any], overlay: list[Any], key: str) -> list[Any]:
    """Items merged on `key`; either side without keyed mappings is replaced whole."""
    if not (_keyed(base, key) and _keyed(overlay, key)):
        return copy.deepcopy(overlay)
    result = copy.deepcopy(base)
    position = {item[key]: index for index, item in enumerate(result)}
    for item in overlay:
        index = position.get(item[key])
        if index is None:
            position[item[key]] = len(result)
            result.append(copy.deepcopy(item))
        else:
            result[index] = deep_merge(result[index], item)
    return result


def _keyed(items: list[Any], key: str) -> bool:
    return all(isinstance(item, Mapping) and key in item for item in items)
