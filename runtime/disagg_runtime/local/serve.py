"""`disagg up FILE --serve`: the local pipeline behind its HTTP gateway until Ctrl-C/SIGTERM.

The gateway runs in this process, on the `Client` that `disagg up` would drive requests
with, configured from `spec.gateway` (api, model) like the operator's gateway Deployment.
A role process that dies is started again after a back-off (local/restarts.py), as a
kubelet would: the requests it held move to a live replica (routing/migration.py), the
gateway stays up, and its /readyz says it is degraded while a role has no live replica.
With `restart` False (`--fail-fast`) a role that dies stops the serving instead
(requests in flight fail with the reason), as a dead role stops `disagg up`.
"""

from __future__ import annotations

import asyncio
import sys

from disagg_runtime.gateway.app import Settings
from disagg_runtime.gateway.server import gateway_for, serve_until
from disagg_runtime.local.supervisor import LocalPipeline, RoleProcess


def serve(
    local: LocalPipeline,
    *,
    host: str,
    port: int,
    token: str = "",
    timeout: float | None = None,
    unix: str | None = None,
) -> int:
    """Serve until a signal (exit 0) or a role's death (exit 1); on the Unix socket `unix`
    too, if given (local clients; large uploads faster than over loopback TCP)."""
    pipeline = local.pipeline
    client = local.client(timeout=timeout)
    settings = Settings(
        pipeline=pipeline.name,
        api=pipeline.gateway.api,
        model=pipeline.gateway.model or "",
        token=token,
        timeout=client.timeout,
        max_tokens=pipeline.gateway_max_tokens,
    )
    gateway = gateway_for(client, settings)
    entries_ready = gateway.ready

    async def ready() -> str:
        return local.degraded() or await entries_ready()

    gateway.ready = ready
    died: list[str] = []
    stopper = _Stopper()

    def on_death(rp: RoleProcess, code: int) -> None:
        if local.restart:
            print(f"disagg up: role {rp.label} died (exit code {code}); restarting", flush=True)
            return
        died.append(f"role {rp.label} died (exit code {code})")
        client.fail_all(died[-1], role=rp.config.role)
        stopper.stop()

    def listening(bound: int) -> None:
        url = f"http://{host}:{bound}"
        routes = "/v1/infer" + (
            ", /v1/completions, /v1/chat/completions" if settings.api == "openai" else ""
        )
        also = f" and unix:{unix}" if unix else ""
        print(f"serving {pipeline.name} at {url}{also} ({routes}); Ctrl-C to stop", flush=True)

    async def main() -> None:
        stop = stopper.bind(asyncio.get_running_loop())
        await serve_until(gateway, host, port, on_listening=listening, stop=stop, unix=unix)

    local.on_death = on_death
    try:
        asyncio.run(main())
    finally:
        client.close()
        gateway.tracer.shutdown()
    for line in died:
        print(f"disagg up: {line}", file=sys.stderr)
    for label, count in local.restarts.counts().items():
        print(f"disagg up: role {label} was restarted {count} time(s)", file=sys.stderr)
    print(f"disagg up: {client.migrations} request(s) moved to a live replica", file=sys.stderr)
    return 1 if died else 0


class _Stopper:
    """Sets the serving loop's stop event from another thread (the launcher's watcher)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> asyncio.Event:
        self._event = asyncio.Event()
        self._loop = loop
        return self._event

    def stop(self) -> None:
        if self._loop is not None and self._event is not None:
            self._loop.call_soon_threadsafe(self._event.set)
