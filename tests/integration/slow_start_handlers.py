"""A handler module that takes long to import, like a role loading a large model: the
role cannot answer /readyz until it is done."""

from __future__ import annotations

import time
from typing import Any

time.sleep(60.0)


def identity(payload: dict[str, Any]) -> dict[str, Any]:
    return payload
