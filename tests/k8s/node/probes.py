"""Container probes, as the kubelet runs them: httpGet (to the pod IP unless `host` is set;
2xx/3xx is success) or tcpSocket, every `periodSeconds` after `initialDelaySeconds`, each
attempt bounded by `timeoutSeconds`; the result flips after `successThreshold` /
`failureThreshold` consecutive outcomes. Named ports resolve through the container's ports.
exec probes are not supported by this node (they fail, saying so)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

Obj = dict[str, Any]


@dataclass
class Probe:
    spec: Obj
    host: str
    ports: dict[str, int]
    started: float = field(default_factory=time.monotonic)
    successes: int = 0
    failures: int = 0
    result: bool | None = None  # None until the first threshold is met
    last_error: str = ""
    next_at: float = 0.0

    def __post_init__(self) -> None:
        self.next_at = self.started + float(self.spec.get("initialDelaySeconds", 0))

    @property
    def period(self) -> float:
        return float(self.spec.get("periodSeconds", 10))

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def _port(self, raw: Any) -> int:
        if isinstance(raw, int):
            return raw
        if str(raw).isdigit():
            return int(raw)
        if str(raw) in self.ports:
            return self.ports[str(raw)]
        raise ValueError(f"probe port {raw!r} is not a container port")

    async def attempt(self, session: aiohttp.ClientSession) -> bool:
        timeout = float(self.spec.get("timeoutSeconds", 1))
        try:
            if "httpGet" in self.spec:
                get = self.spec["httpGet"]
                scheme = str(get.get("scheme", "HTTP")).lower()
                url = f"{scheme}://{get.get('host') or self.host}:{self._port(get['port'])}"
                headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
                async with session.get(
                    url + str(get.get("path", "/")),
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=timeout),
                    allow_redirects=False,
                    ssl=False,
                ) as resp:
                    await resp.read()
                    if 200 <= resp.status < 400:
                        return True
                    self.last_error = f"HTTP probe failed with statuscode: {resp.status}"
                    return False
            if "tcpSocket" in self.spec:
                port = self._port(self.spec["tcpSocket"]["port"])
                _r, writer = await asyncio.wait_for(
                    asyncio.open_connection(self.spec["tcpSocket"].get("host") or self.host, port),
                    timeout,
                )
                writer.close()
                return True
            self.last_error = "this node supports httpGet and tcpSocket probes only"
            return False
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            self.last_error = f"probe failed: {type(exc).__name__}: {exc}"
            return False

    async def run_once(self, session: aiohttp.ClientSession) -> bool | None:
        """One attempt (when due); returns the (possibly changed) result."""
        now = time.monotonic()
        if not self.due(now):
            return self.result
        self.next_at = now + self.period
        if await self.attempt(session):
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= int(self.spec.get("successThreshold", 1)):
                self.result = True
        else:
            self.failures, self.successes = self.failures + 1, 0
            if self.failures >= int(self.spec.get("failureThreshold", 3)):
                self.result = False
        return self.result
