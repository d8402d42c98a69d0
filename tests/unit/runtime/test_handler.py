"""Handler loading and lifecycle: functions, classes with setup/batch/close, bad handlers."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from disagg_runtime.role.handler import Handler, HandlerError, Runner, SetupContext, load


class Model:
    def __init__(self) -> None:
        self.events: list[str] = []
        self.scale = 0

    def setup(self, ctx: SetupContext) -> None:
        self.scale = int(ctx.args["scale"])
        ctx.state["weights"] = [self.scale]
        self.events.append(f"setup {ctx.role}/{ctx.replica} on {ctx.device}")

    def __call__(self, payload: int) -> int:
        return payload * self.scale

    def batch(self, payloads: list[int]) -> list[Any]:
        return [p * self.scale for p in payloads]

    def close(self) -> None:
        self.events.append("close")


class BatchOnly:
    def batch(self, payloads: list[int]) -> list[int]:
        return payloads


class Broken:
    def setup(self, ctx: SetupContext) -> None:
        raise FileNotFoundError("no such model directory: /models/x")

    def __call__(self, payload: Any) -> Any:
        return payload


def _ctx(**args: Any) -> SetupContext:
    return SetupContext(role="r", replica=1, device="cpu", args=args, log=logging.getLogger("t"))


def test_function_handlers_work_as_before() -> None:
    handler = load("json:dumps")
    assert handler([1]) == "[1]" and not handler.can_batch
    handler.setup(_ctx())  # no lifecycle: nothing happens
    handler.close()


def test_class_lifecycle_in_order() -> None:
    handler = load(f"{__name__}:Model")
    model = handler.target
    assert isinstance(model, Model)
    runner = Runner(handler, max_batch_size=4, max_batch_wait_ms=1)
    ctx = _ctx(scale=3)
    assert runner.setup(ctx) >= 0
    assert ctx.state == {"weights": [3]}
    assert runner.invoke(2, timeout=5) == 6
    runner.close()
    assert model.events == ["setup r/1 on cpu", "close"]


def test_batch_only_class_serves_single_requests_through_batch() -> None:
    handler = Handler(BatchOnly)
    assert handler(7) == 7 and handler.can_batch


def test_direct_calls_are_counted_one_request_each() -> None:
    calls: list[int] = []
    runner = Runner(Handler(Model), on_call=calls.append)
    runner.setup(_ctx(scale=2))
    assert [runner.invoke(i, timeout=1) for i in range(3)] == [0, 2, 4]
    assert calls == [1, 1, 1]


def test_bad_handlers_are_named() -> None:
    with pytest.raises(HandlerError, match="cannot import"):
        load("no_such_module_xyz:f")
    with pytest.raises(HandlerError, match="no callable 'nope'"):
        load("json:nope")
    with pytest.raises(HandlerError, match="no batch"):
        Runner(load("json:dumps"), max_batch_size=8)
    with pytest.raises(HandlerError, match=r"setup failed: FileNotFoundError: no such model"):
        Runner(Handler(Broken)).setup(_ctx())
    with pytest.raises(HandlerError, match="2 outputs for 1"):
        Handler(type("Two", (), {"batch": lambda self, p: [1, 2]})).batch([0])
