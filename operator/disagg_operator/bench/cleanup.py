"""Clean-up: everything the run created goes, also after a failure or ^C, and the report says
what is left. At a thousand pipelines deletion takes a while (the garbage collector removes
7,000 children), so the waits are long (`BenchConfig.cleanup_timeout`), print progress to
stderr, and a slow or failing delete request is tried again rather than given up on."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Final

from disagg_operator import names
from disagg_operator.bench.config import RETRY, BenchError, WaitTimeout
from disagg_operator.bench.observe import Observer
from disagg_operator.bench.workload import LABEL_RUN, Json
from disagg_operator.k8s import client as kube

CRD_PATH: Final = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{names.CRD_NAME}"
NAMESPACES_PATH: Final = "/api/v1/namespaces"
DELETE_TRIES: Final = 10
PROGRESS_EVERY: Final = 5.0  # seconds between progress lines


def progress(message: str) -> None:
    print(f"disagg bench operator: {message}", file=sys.stderr, flush=True)


async def delete_pipelines(
    api: kube.Api,
    observer: Observer | None,
    *,
    namespace: str,
    run: str,
    created: list[str],
    timeout: float,
    report: Json,
) -> None:
    """Delete the run's pipelines (one deletecollection by label) and wait until they and
    their children are gone, as the watches see it."""
    if not created:
        report["pipelines_left"] = report["children_left"] = 0
        return
    path = kube.collection_path(names.PIPELINE_API_VERSION, names.PIPELINE_KIND, namespace)
    body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
    params = {"labelSelector": f"{LABEL_RUN}={run}"}
    started = time.monotonic()
    await retried(lambda: api.request("DELETE", path, params=params, body=body), "delete")
    if observer is None or observer.failure is not None:
        return

    def show() -> None:
        pipelines, children = observer.left_of(created)
        waited = time.monotonic() - started
        progress(f"clean-up: {pipelines} pipelines, {children} children left ({waited:.0f} s)")

    with contextlib.suppress(WaitTimeout):
        await observer.until(
            lambda: observer.left_of(created) == (0, 0),
            timeout,
            "the pipelines and their children to be deleted",
            progress=show,
            every=PROGRESS_EVERY,
        )
    report["pipelines_left"], report["children_left"] = observer.left_of(created)
    report["seconds"] = round(time.monotonic() - started, 3)


async def delete_and_wait(api: kube.Api, path: str, timeout: float) -> bool:
    """Delete the object at `path`; whether it was gone before the timeout."""
    with contextlib.suppress(kube.ApiError):
        await api.request("DELETE", path)
    deadline = time.monotonic() + timeout
    next_progress = time.monotonic() + PROGRESS_EVERY
    while True:
        try:
            await api.request("GET", path)
        except kube.ApiError as error:
            if error.status == 404:
                return True
        now = time.monotonic()
        if now > deadline:
            return False
        if now >= next_progress:
            progress(f"clean-up: waiting for {path} to be deleted")
            next_progress = now + PROGRESS_EVERY
        await asyncio.sleep(RETRY * 5)


async def retried(request: Callable[[], Awaitable[Json]], what: str) -> Json:
    """A request tried again on failures without an answer, throttling and server errors
    (beyond the client's own retries: a slow delete of thousands of objects)."""
    for attempt in range(1, DELETE_TRIES + 1):
        try:
            return await request()
        except kube.ApiError as error:
            if not error.transient or attempt == DELETE_TRIES:
                raise BenchError(f"cannot {what}: {error}") from error
            progress(f"clean-up: {what} failed ({error}); trying again")
            await asyncio.sleep(RETRY * attempt)
    raise AssertionError("unreachable")  # pragma: no cover
