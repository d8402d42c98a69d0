"""What a role runs on each request, and its lifecycle (docs/handlers.md).

The spec names a handler `module:attr`. `attr` is either

- a function `fn(payload) -> output`, or a generator function yielding chunks: stateless,
  called once per request; or
- a class, instantiated once per role process without arguments:

      setup(ctx)          optional; once, before the role reports ready (load weights here)
      __call__(payload)   one request -> output, or a generator of chunks
      batch(payloads)     optional; requests -> outputs, same length and order. An output
                          that is an Exception fails only its own request.
      close()             optional; once, on drain, after the last request

`roles[].batching` needs `batch`; a class without `__call__` is only ever batched. Streaming
works as before: an output that is a generator (from `__call__`, or an element of `batch`'s
list) is sent on chunk by chunk.

`writes_inputs = True` (a class attribute, or an attribute of the function) says the handler
writes its input tensors in place: a replica of several ranks then hands every rank a
private copy (role/rankfeed.py); otherwise the ranks above 0 read rank 0's inputs from a
read-only mapping.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from disagg_core.spec import Pipeline
from disagg_runtime.role.batching import Batcher


class HandlerError(ValueError):
    """The handler string does not name a usable function or class, or its setup failed."""


@dataclass
class SetupContext:
    """What `setup(ctx)` gets: who it is, where to compute, its `roles[].handlerArgs`."""

    role: str
    replica: int
    device: str  # "cuda" when this process sees a GPU, else "cpu"
    args: Mapping[str, Any]
    log: logging.Logger
    state: dict[str, Any] = field(default_factory=dict)  # big state (models) owned by the role
    # a replica of several ranks (roles[].ranks/nodes, role/ranks.py): this process's rank,
    # the world's size and its torch.distributed process group (gloo on CPU, NCCL on GPU);
    # every rank's setup and calls see the same inputs, rank 0's output is what is sent on
    rank: int = 0
    world_size: int = 1
    group: Any = None


class Handler:
    """A loaded handler: a function or an instance of a handler class, one interface."""

    def __init__(self, target: Any, name: str = "") -> None:
        self.name = name or getattr(target, "__qualname__", repr(target))
        self.target = target() if inspect.isclass(target) else target
        self._call: Callable[[Any], Any] | None = self.target if callable(self.target) else None
        self._batch: Callable[[list[Any]], Any] | None = _method(self.target, "batch")
        if self._call is None and self._batch is None:
            raise HandlerError(f"handler {self.name!r} has neither __call__ nor batch()")

    @property
    def can_batch(self) -> bool:
        return self._batch is not None

    @property
    def writes_inputs(self) -> bool:
        return getattr(self.target, "writes_inputs", False) is True

    def setup(self, ctx: SetupContext) -> None:
        setup = _method(self.target, "setup")
        if setup is not None:
            setup(ctx)

    def __call__(self, payload: Any) -> Any:
        if self._call is not None:
            return self._call(payload)
        return self.batch([payload])[0]

    def batch(self, payloads: list[Any]) -> list[Any]:
        """`batch(payloads)` checked for its length (one output per request)."""
        if self._batch is None:
            raise HandlerError(f"handler {self.name!r} has no batch()")
        outputs = list(self._batch(payloads))
        if len(outputs) != len(payloads):
            raise HandlerError(
                f"handler {self.name!r}: batch() returned {len(outputs)} outputs "
                f"for {len(payloads)} requests"
            )
        return outputs

    def close(self) -> None:
        close = _method(self.target, "close")
        if close is not None:
            close()


def _method(target: Any, name: str) -> Callable[..., Any] | None:
    if inspect.isfunction(target):  # a plain function's attributes are not a lifecycle
        return None
    method = getattr(target, name, None)
    return method if callable(method) else None


def load(spec: str) -> Handler:
    """Import `module:attr` and wrap it (a class is instantiated here, set up later)."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise HandlerError(f"handler {spec!r}: cannot import {module_name!r}: {exc}") from None
    target = getattr(module, attr, None)
    if not callable(target):
        raise HandlerError(f"handler {spec!r}: {module_name} has no callable {attr!r}")
    try:
        return Handler(target, spec)
    except HandlerError:
        raise
    except Exception as exc:  # the class's constructor failed
        raise HandlerError(f"handler {spec!r}: {type(exc).__name__}: {exc}") from exc


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class Runner:
    """The handler as a role drives it: setup timed and wrapped, each request called
    directly or through a `Batcher`, close once. `on_call(n)` sees every handler call with
    the number of requests it carried (1 when not batched)."""

    def __init__(
        self,
        handler: Handler,
        *,
        max_batch_size: int = 1,
        max_batch_wait_ms: float = 0.0,
        on_call: Callable[[int], None] = lambda n: None,
    ) -> None:
        if max_batch_size > 1 and not handler.can_batch:
            raise HandlerError(
                f"handler {handler.name!r}: batching is configured (maxBatchSize "
                f"{max_batch_size}) but it has no batch(payloads) method"
            )
        self.handler = handler
        self.max_batch_size = max_batch_size
        self.max_batch_wait_ms = max_batch_wait_ms
        self._on_call = on_call
        self.batcher: Batcher | None = None

    def setup(self, ctx: SetupContext) -> float:
        """Run the handler's setup; seconds it took. A failure is a HandlerError."""
        started = time.monotonic()
        try:
            self.handler.setup(ctx)
        except Exception as exc:
            raise HandlerError(
                f"handler {self.handler.name!r}: setup failed: {type(exc).__name__}: {exc}"
            ) from exc
        if self.max_batch_size > 1:
            self.batcher = Batcher(
                self._batch,
                max_size=self.max_batch_size,
                max_wait_s=self.max_batch_wait_ms / 1000.0,
                name=f"disagg-{ctx.role}-batcher",
            )
        return time.monotonic() - started

    def invoke(
        self, payload: Any, *, timeout: float, cancelled: Callable[[], bool] = lambda: False
    ) -> Any:
        """One request's output (maybe a generator). Batched: waits up to `timeout` and
        raises BatchTimeout / BatchCancelled for this request alone."""
        if self.batcher is not None:
            return self.batcher.submit(payload, timeout=timeout, cancelled=cancelled)
        self._on_call(1)
        return self.handler(payload)

    def _batch(self, payloads: list[Any]) -> list[Any]:
        self._on_call(len(payloads))
        return self.handler.batch(payloads)

    def stop_batching(self) -> None:
        """Fail what still waits for a batch (the role is stopping); a running batch ends."""
        if self.batcher is not None:
            self.batcher.close()

    def close(self) -> None:
        self.stop_batching()
        self.handler.close()


def input_factory(pipeline: Pipeline) -> Callable[[int], Any]:
    """Synthetic request i for the pipeline's (first) entry role."""
    entry = pipeline.role(pipeline.entry_roles[0])
    module = importlib.import_module(entry.handler_module)
    sample = getattr(module, "sample_input", None)
    if callable(sample):
        return lambda i: sample(entry.handler_attr, i)
    return lambda i: {"x": torch.full((1024,), float(i)), "i": i}
