"""The HTTP side of a role's metrics: ``/metrics``, ``/healthz`` and ``/readyz``, and the
client side that reads them back.

``/healthz`` answers 200 while ``live()`` is true, ``/readyz`` 200 while ``ready()`` is true,
503 otherwise (also when the callable raises); every other path is 404.

:func:`scrape` turns an exposition text back into ``{key: value}`` with keys like
``disagg_pool_occupancy`` or ``disagg_requests_total{outcome="done"}`` (labels other than the
constant three, sorted by name); :func:`fetch` is the tiny HTTP GET the launcher and the
autoscaler use to get that text.
"""

from __future__ import annotations

import http.server
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, Final

from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from disagg_runtime.role.metrics import CONST_LABELS, RoleMetrics

logger = logging.getLogger(__name__)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    metrics: RoleMetrics
    live: Callable[[], bool]
    ready: Callable[[], bool]


_TEXT: Final = "text/plain; charset=utf-8"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    timeout = 10  # a stuck client must not pin a thread forever

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            try:
                body = self.server.metrics.render()
            except Exception as exc:  # never expected; answer instead of dropping the socket
                logger.exception("rendering metrics failed")
                self._reply(500, f"render failed: {exc}\n".encode())
                return
            self._reply(200, body, CONTENT_TYPE_LATEST)
        elif path == "/healthz":
            self._probe(self.server.live, b"live\n", b"not live\n")
        elif path == "/readyz":
            self._probe(self.server.ready, b"ready\n", b"not ready\n")
        else:
            self._reply(404, b"not found\n")

    def _probe(self, check: Callable[[], bool], ok: bytes, bad: bytes) -> None:
        try:
            good = bool(check())
        except Exception as exc:
            self._reply(503, bad.rstrip(b"\n") + f": {exc}\n".encode())
            return
        self._reply(200 if good else 503, ok if good else bad)

    def _reply(self, status: int, body: bytes, content_type: str = _TEXT) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # probes every few seconds would flood stderr


class HealthServer:
    """HTTP on host:port serving /metrics, /healthz (200 while live() is true, else 503),
    /readyz (200 while ready() is true, else 503); other paths 404.

    ThreadingHTTPServer in a daemon thread; no request logging to stderr. The socket is bound
    in :meth:`start`; ``port=0`` picks a free port, readable from :attr:`port` afterwards.
    """

    def __init__(
        self,
        metrics: RoleMetrics,
        *,
        host: str = "0.0.0.0",
        port: int = 0,
        live: Callable[[], bool],
        ready: Callable[[], bool],
    ) -> None:
        self.metrics = metrics
        self.host = host
        self.port = port
        self._live = live
        self._ready = ready
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> None:
        with self._lock:
            if self._closed or self._server is not None:
                raise RuntimeError("HealthServer.start() called twice or after close()")
            server = _Server((self.host, self.port), _Handler)
            server.metrics = self.metrics
            server.live = self._live
            server.ready = self._ready
            self.port = int(server.server_address[1])
            self._server = server
            self._thread = threading.Thread(
                target=server.serve_forever,
                kwargs={"poll_interval": 0.1},
                name=f"disagg-health:{self.port}",
                daemon=True,
            )
            self._thread.start()

    def close(self) -> None:
        """Stop serving and release the port; idempotent, also before :meth:`start`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            server, thread = self._server, self._thread
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5.0)

    def __enter__(self) -> HealthServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- clients ---------------------------------------------------------------------------------


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def scrape(text: str) -> dict[str, float]:
    """Parse an exposition text into ``{key: value}``.

    The key is the sample name plus its labels other than pipeline/role/replica, sorted by
    name, in Prometheus form: ``disagg_pool_occupancy``,
    ``disagg_requests_total{outcome="done"}``, ``disagg_edge_seconds_bucket{edge="a",le="0.001"}``.
    If the text holds several series with the same key
    (several roles in one text), the last one wins. Malformed text raises ``ValueError``.
    """
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            extra = sorted((k, v) for k, v in sample.labels.items() if k not in CONST_LABELS)
            key = sample.name
            if extra:
                key += "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in extra) + "}"
            out[key] = float(sample.value)
    return out


def fetch(url: str, timeout: float = 2.0) -> tuple[int, str]:
    """GET ``url`` and return ``(status, body)``, for 4xx/5xx answers as well.

    Raises ``OSError`` (``URLError``, ``TimeoutError``, ``ConnectionError``) when no HTTP answer
    comes back.
    """
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status), resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as err:
        with err:
            return int(err.code), err.read().decode("utf-8", "replace")
