"""Running the emulator on a loopback port: in the current event loop, or in its own thread.

- ``async with EmulatorServer() as server:`` serves from the running loop (``server.url``).
- ``EmulatorThread().start()`` serves from a thread with its own loop; usable from sync tests
  and from async tests alike (clients talk to it over real sockets). Its helpers (``create``,
  ``get``, ``patch``, ``patch_status``, ``delete``, ...) run the emulator's direct operations
  inside the emulator's loop and wait for them; in an async test, call them through
  ``await asyncio.to_thread(...)`` so that the test's own loop (e.g. a kopf operator) keeps going.

Our own aiohttp server instead of ``kmock.Server``: the latter also patches aiohttp's resolver
globally, which breaks when two emulators stop out of order.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import socket
import ssl
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import aiohttp.web
import kmock
import yaml

from .. import support
from .emulator import JSON, ApiCall, KubeEmulator
from .tls import ServerTls

T = TypeVar("T")


class EmulatorServer:
    """The emulator behind an aiohttp server on ``host`` and a free port, in this loop."""

    def __init__(
        self,
        emulator: KubeEmulator | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.emulator = emulator if emulator is not None else KubeEmulator()
        self.host = host
        self._port = port
        self._ssl = ssl_context
        self._runner: aiohttp.web.ServerRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"{'https' if self._ssl else 'http'}://{self.host}:{self.port}"

    async def __aenter__(self) -> Self:
        await self.emulator.__aenter__()
        server = aiohttp.web.Server(self.emulator, handler_cancellation=True)
        self._runner = aiohttp.web.ServerRunner(server, handle_signals=False, shutdown_timeout=2.0)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self._port))
        self.port = sock.getsockname()[1]
        await aiohttp.web.SockSite(self._runner, sock, ssl_context=self._ssl).start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.emulator.close_watches()
        await asyncio.sleep(0)  # let the watch streams notice
        if self._runner is not None:
            await self._runner.cleanup()
        await self.emulator.__aexit__(exc_type, exc, tb)


class EmulatorThread:
    """An emulator served from a daemon thread with its own event loop (the ``k8s`` fixture).

    ``tls``: serve HTTPS with this certificate (``tls.ServerTls``); ``options`` go to
    ``KubeEmulator`` (e.g. ``auth=rbac.Authenticator()``). With ``auth``, ``token`` is an
    admin token (``system:masters``) that ``kubeconfig()`` and ``api_client()`` carry.
    """

    def __init__(self, tls: ServerTls | None = None, **options: Any) -> None:
        self._options = options
        self.tls = tls
        auth = options.get("auth")
        self.token: str | None = auth.admin_token() if auth is not None else None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="k8s-emulator", daemon=True)
        self._server: EmulatorServer | None = None
        self._failure: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 10.0) -> Self:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the Kubernetes emulator did not start")
        if self._failure is not None:
            raise RuntimeError("the Kubernetes emulator failed to start") from self._failure
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:  # reported by start()
            self._failure = e
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        context = self.tls.context if self.tls is not None else None
        async with EmulatorServer(KubeEmulator(**self._options), ssl_context=context) as server:
            self._server = server
            self._ready.set()
            await self._stop.wait()

    @property
    def server(self) -> EmulatorServer:
        if self._server is None:
            raise RuntimeError("the emulator is not running")
        return self._server

    @property
    def emulator(self) -> KubeEmulator:
        return self.server.emulator

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def host(self) -> str:
        return self.server.host

    @property
    def port(self) -> int:
        return self.server.port

    # ------------------------------------------------------------------ running in the loop

    def call(self, fn: Callable[..., T], *args: Any, timeout: float = 10.0, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` in the emulator's loop and return its result."""
        if self._loop is None:
            raise RuntimeError("the emulator is not running")
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:
                future.set_exception(e)

        self._loop.call_soon_threadsafe(run)
        return future.result(timeout)

    # ------------------------------------------------------------------ what tests look at

    @property
    def calls(self) -> list[ApiCall]:
        """Every request so far (a copy), in arrival order."""
        return self.call(lambda: list(self.emulator.calls))

    def rbac_calls(self) -> set[tuple[str | None, str | None, str]]:
        """``{(apiGroup, resource[/subresource], verb)}`` of every authorization of every
        resource request so far: each request's own verb, and ``create`` for a server-side
        apply that created its object (the API server authorizes both)."""
        return {a for c in self.calls if c.resource is not None for a in c.authorizations}

    def clear_calls(self) -> None:
        self.call(self.emulator.calls.clear)

    @property
    def objects(self) -> kmock.ObjectsArray:
        """kmock's ``ObjectsArray``: every object's versions, e.g. ``objects['v1/pods', ns, n]``."""
        return self.emulator.objects

    @property
    def errors(self) -> list[Exception]:
        """Unexpected exceptions inside the emulator (its bugs, not API errors)."""
        return self.call(lambda: list(self.emulator.errors))

    # ------------------------------------------------------------------ direct operations

    def create(self, body: Mapping[str, Any], namespace: str | None = None) -> JSON:
        return self.call(self.emulator.create_object, body, namespace)

    def apply(self, body: Mapping[str, Any], namespace: str | None = None) -> JSON:
        return self.call(self.emulator.apply_object, body, namespace)

    def apply_file(self, path: str | Path, namespace: str | None = None) -> list[JSON]:
        """Server-side apply every document of a YAML file (a CRD, an example, ...)."""
        docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
        return [self.apply(doc, namespace) for doc in docs]

    def get(self, ref: str, name: str, namespace: str | None = None) -> JSON | None:
        return self.call(self.emulator.get_object, ref, name, namespace)

    def list(
        self,
        ref: str,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[JSON]:
        return self.call(self.emulator.list_objects, ref, namespace, label_selector, field_selector)

    def patch(
        self,
        ref: str,
        name: str,
        patch: Any,
        namespace: str | None = None,
        *,
        subresource: str | None = None,
        patch_type: str = "merge",
    ) -> JSON:
        return self.call(
            self.emulator.patch_object,
            ref,
            name,
            patch,
            namespace,
            subresource=subresource,
            patch_type=patch_type,
        )

    def patch_status(
        self, ref: str, name: str, status: Mapping[str, Any], namespace: str | None = None
    ) -> JSON:
        """Merge ``status`` into the object's status (as a workload controller would)."""
        return self.patch(ref, name, {"status": dict(status)}, namespace, subresource="status")

    def delete(
        self, ref: str, name: str, namespace: str | None = None, propagation: str = "Background"
    ) -> JSON:
        return self.call(self.emulator.delete_object, ref, name, namespace, propagation)

    def wait_for(
        self,
        predicate: Callable[[], T],
        timeout: float = 10.0,
        interval: float = 0.02,
        message: str | Callable[[], str] = "condition",
    ) -> T:
        """Poll ``predicate`` until it returns something truthy; that value is returned (a
        callable `message` describes the state at the timeout)."""
        return support.wait_for(predicate, timeout, interval=interval, message=message)

    # ------------------------------------------------------------------ clients

    def kubeconfig(self, namespace: str = "default") -> JSON:
        """A kubeconfig (as a dict) pointing at this emulator (its CA and admin token, if any)."""
        ca = self.tls.ca_pem if self.tls is not None else None
        return kubeconfig_for(self.url, namespace, ca_pem=ca, token=self.token)

    def api_client(self) -> Any:
        """A ``kubernetes.client.ApiClient`` for this emulator, built explicitly: the client
        reads ``KUBECONFIG`` at import time, so the environment cannot redirect it later."""
        return api_client_for(
            self.url, self.tls.ca_pem if self.tls is not None else None, self.token
        )

    def connection_info(self, namespace: str = "default") -> Any:
        """A ``kopf.ConnectionInfo`` for this emulator (return it from an ``@kopf.on.login``)."""
        import kopf

        return kopf.ConnectionInfo(
            server=self.url,
            default_namespace=namespace,
            ca_data=self.tls.ca_pem if self.tls is not None else None,
            token=self.token,
        )


def kubeconfig_for(
    url: str, namespace: str = "default", *, ca_pem: bytes | None = None, token: str | None = None
) -> JSON:
    cluster: JSON = {"server": url}
    if ca_pem is not None:
        cluster["certificate-authority-data"] = base64.b64encode(ca_pem).decode()
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": cluster}],
        "users": [{"name": "emulator", "user": {} if token is None else {"token": token}}],
        "contexts": [
            {
                "name": "emulator",
                "context": {"cluster": "emulator", "user": "emulator", "namespace": namespace},
            }
        ],
        "current-context": "emulator",
        "preferences": {},
    }


def api_client_for(url: str, ca_pem: bytes | None = None, token: str | None = None) -> Any:
    import tempfile

    import kubernetes.client

    configuration = kubernetes.client.Configuration()
    configuration.host = url
    if ca_pem is not None:
        with tempfile.NamedTemporaryFile("wb", suffix=".crt", delete=False) as f:
            f.write(ca_pem)
        configuration.ssl_ca_cert = f.name
    if token is not None:
        configuration.api_key = {"authorization": f"Bearer {token}"}
    return kubernetes.client.ApiClient(configuration)


def write_yaml_docs(path: Path, docs: Iterable[Mapping[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump_all([dict(d) for d in docs], sort_keys=False))
    return path
