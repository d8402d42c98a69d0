"""`disagg up --trace FILE`: every request's spans in one JSON lines file, no collector.

The launcher names the file in DISAGG_TRACE_FILE before it starts the roles (they inherit
it, and append their spans: tracing/spanfile.py), opens a root span per request it sends
(`request`, the parent of the entry role's), and after the run, once every role has
flushed its spans at stop, reads the file back for the summary: how many requests were
traced, and the slowest ones' timelines (observe/timeline.py). Every request is traced
(OTEL_TRACES_SAMPLER=parentbased_always_on) unless a sampler is named; OTEL_* variables
still apply (an OTLP endpoint too), since the roles read them as in a pod.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any

from disagg_runtime.observe import timeline
from disagg_runtime.tracing import Span, open_tracer
from disagg_runtime.tracing.config import SAMPLER, TRACE_FILE

SLOWEST = 3


class RunTrace:
    def __init__(self, path: str, pipeline: str) -> None:
        """TracingUnavailable without the tracing extra; OSError if `path` cannot be written."""
        self.path = os.path.abspath(path)
        with open(self.path, "w"):  # this run's spans only
            pass
        self._before = {k: os.environ.get(k) for k in (TRACE_FILE, SAMPLER)}
        os.environ[TRACE_FILE] = self.path
        os.environ.setdefault(SAMPLER, "parentbased_always_on")
        try:
            resource = {"disagg.pipeline": pipeline, "disagg.role": "client"}
            self.tracer = open_tracer(f"{pipeline}/client", resource=resource, strict=True)
        except BaseException:
            self._restore()
            raise

    def request(self, index: int) -> Span:
        return self.tracer.start("request", kind="client", attrs={"disagg.request": index})

    @staticmethod
    def ender(span: Span) -> Any:
        def done(future: Future[Any]) -> None:
            if future.exception() is not None:
                span.fail(str(future.exception()))
            span.end()

        return done

    def close(self) -> None:
        self.tracer.shutdown()
        self._restore()

    def _restore(self) -> None:
        for name, value in self._before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    def summary(self) -> dict[str, Any]:
        """Read after the roles stopped: they flush their spans on the way out."""
        spans = timeline.load(self.path)
        lines = timeline.timelines(spans)
        return {
            "file": self.path,
            "spans": len(spans),
            "requests": len(lines),
            "slowest": timeline.render(lines, slowest=SLOWEST),
        }
