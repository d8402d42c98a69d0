"""Status writes for a pipeline deleted meanwhile are dropped, not logged as errors."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from disagg_operator.k8s.client import ApiError
from disagg_operator.reconcile import apply

PIPELINE = {"metadata": {"name": "p", "namespace": "ns", "uid": "u1"}, "status": {}}


class FakeApi:
    def __init__(self, error: ApiError | None) -> None:
        self.error = error
        self.calls: list[Any] = []

    async def patch_status(self, ref: Any, status: Any, *, uid: str) -> dict[str, Any]:
        self.calls.append((ref, status, uid))
        if self.error is not None:
            raise self.error
        return {}


def write(api: FakeApi) -> bool:
    return asyncio.run(apply.write_status(api, PIPELINE, {"phase": "Ready"}))  # type: ignore[arg-type]


def test_status_is_written_when_it_differs() -> None:
    api = FakeApi(None)
    assert write(api) is True
    assert api.calls[0][2] == "u1"


def test_a_pipeline_gone_meanwhile_is_not_an_error() -> None:
    api = FakeApi(ApiError(404, "NotFound", "gone"))
    assert write(api) is False


def test_other_errors_still_raise() -> None:
    with pytest.raises(ApiError):
        write(FakeApi(ApiError(409, "Conflict", "uid precondition failed")))
