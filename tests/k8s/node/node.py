"""A node beside the API emulator: controllers, kubelet and cluster DNS in one thread with its
own event loop, talking to the API over HTTP (watches), running pods as sandboxed
processes (see the package docstring).

    node = Node(k8s.url).start()      # needs root: network.can_create_namespaces()
    ...
    node.stop()                       # every pod terminated, bridge and netns gone
    assert not node.leftovers()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import os
import secrets
import shutil
import signal
import sys
import threading
import urllib.parse
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from . import apiserver, network, sandbox
from .api import Api, Obj
from .apiserver import Forwarder, InCluster
from .controllers import Controllers
from .dns import ClusterDns, ClusterResolver
from .images import ImageStore
from .informer import Informer, Key
from .kubelet import Config, Kubelet, PodWorker

log = logging.getLogger(__name__)
T = TypeVar("T")
RESOURCES = ("pods", "services", "endpoints", "endpointslices", "statefulsets", "deployments")
ROOT = "/run/disagg-node"
OWNER = "owner.pid"  # in <ROOT>/<tag>: the process running that node
KEEP_ENV = "DISAGG_TEST_NODE_KEEP"  # copy the pods' files (logs) here when the node stops


def leftovers(tag: str) -> list[str]:
    """Interfaces, network namespaces, processes in them, files of node `tag`."""
    found = network.leftovers(tag)
    for item in list(found):
        if item.startswith("netns "):
            pids = network.processes_in(f"/run/netns/{item.split()[1]}")
            found += [f"process {pid}" for pid in pids]
    if os.path.exists(f"{ROOT}/{tag}"):
        found.append(f"dir {ROOT}/{tag}")
    return found


def sweep_stale() -> list[str]:
    """Sweep every node whose process is gone (a run killed half-way, or a suite that left
    a node behind): its pods' processes, namespaces and bridge would otherwise outlive it,
    holding CPU, memory and addresses while a later run starts. Returns what was there."""
    found: list[str] = []
    with contextlib.suppress(OSError):
        for tag in os.listdir(ROOT):
            try:
                pid = int(Path(f"{ROOT}/{tag}/{OWNER}").read_text())
            except (OSError, ValueError):
                continue
            if not os.path.exists(f"/proc/{pid}"):
                found += sweep(tag)
    return found


def sweep(tag: str) -> list[str]:
    """Remove whatever node `tag` left (after a crash); returns what was there."""
    found = leftovers(tag)
    network.sweep(tag)
    shutil.rmtree(f"{ROOT}/{tag}", ignore_errors=True)
    return found


class Node:
    created: list[str] = []  # tags of every node of this process (the session sweep's list)

    def __init__(
        self,
        url: str,
        *,
        backoff: float = 10.0,
        pythonpath: str | None = None,
        extra_env: dict[str, str] | None = None,
        ca_pem: bytes | None = None,
        token: str | None = None,
        in_cluster: InCluster | None = None,
        images: bool = False,
    ) -> None:
        """`ca_pem`, `token`: the node's own credentials (an HTTPS emulator that
        authenticates); `in_cluster`: give pods the `kubernetes` Service (the bridge address,
        port 443, forwarded to the emulator), its env and service-account tokens. `images`:
        run a container from its image where the local engine (docker/podman) has it
        (`make images`), else from the host's virtual environment; `image_store` then says
        which engine, or `images_unavailable` why none."""
        self.tag = secrets.token_hex(2)
        Node.created.append(self.tag)
        self.root = f"{ROOT}/{self.tag}"
        self.url = url
        self.ca_pem, self.token = ca_pem, token
        self.in_cluster = in_cluster
        self.forwarder: Forwarder | None = None
        self.bridge = network.Bridge(self.tag)
        self.config = Config(
            venv_bin=os.path.dirname(sys.executable),
            pythonpath=os.environ.get("PYTHONPATH", "") if pythonpath is None else pythonpath,
            root=self.root,
            backoff=backoff,
            extra_env=dict(extra_env or {}),
        )
        self.images = images
        self.image_store: ImageStore | None = None
        self.images_unavailable = ""
        self._pods = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self.api: Api | None = None
        self.informers: dict[str, Informer] = {}
        self.kubelet: Kubelet | None = None
        self.dns: ClusterDns | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Node:
        os.makedirs(ROOT, mode=0o755, exist_ok=True)
        sweep_stale()
        os.makedirs(self.root, mode=0o755)
        os.chmod(ROOT, 0o755)
        Path(f"{self.root}/{OWNER}").write_text(str(os.getpid()))
        if self.images:
            found = ImageStore.find(self.root)
            if isinstance(found, str):
                self.images_unavailable = found
            else:
                self.image_store = self.config.images = found
        self.bridge.create()
        ready = threading.Event()

        def main() -> None:
            loop = self._loop = asyncio.new_event_loop()
            loop.call_soon(ready.set)
            try:
                loop.run_forever()
            finally:
                _close(loop)

        self._thread = threading.Thread(target=main, name=f"test-node-{self.tag}", daemon=True)
        self._thread.start()
        ready.wait(10)
        self.call(self._start())
        return self

    async def _start(self) -> None:
        self.api = Api(self.url, ca_pem=self.ca_pem, token=self.token)
        if self.in_cluster is not None:
            self.in_cluster = dataclasses.replace(self.in_cluster, host=self.bridge.gateway)
            self.config.in_cluster = self.in_cluster
            upstream = urllib.parse.urlsplit(self.url)
            assert upstream.hostname is not None and upstream.port is not None
            self.forwarder = Forwarder(
                self.bridge.gateway, self.in_cluster.port, (upstream.hostname, upstream.port)
            )
            await self.forwarder.start()
        self.informers = {r: Informer(self.api, r) for r in RESOURCES}
        controllers = Controllers(self.api, self.informers)
        self.kubelet = Kubelet(self.api, self.config, self._sandbox)
        self.informers["pods"].handlers.append(self._pod_event)
        for informer in self.informers.values():
            self._tasks.append(asyncio.create_task(informer.run()))
        for coro in controllers.tasks():
            self._tasks.append(asyncio.ensure_future(coro))
        await asyncio.gather(*(i.synced.wait() for i in self.informers.values()))
        static = {}
        if self.in_cluster is not None:  # kubernetes.default.svc.cluster.local: the bridge
            static[apiserver.NAMES[-1]] = [self.bridge.gateway]
        resolver = ClusterResolver(
            self.informers["services"], self.informers["endpointslices"], static=static
        )
        self.dns = ClusterDns(resolver, self.bridge.gateway)
        self.dns.start()

    def _sandbox(self, pod: Obj) -> sandbox.Sandbox:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        hostname = str(spec.get("hostname") or meta["name"])
        fqdn = ""
        if spec.get("subdomain"):
            fqdn = (
                f"{hostname}.{spec['subdomain']}.{meta['namespace']}.svc.{sandbox.CLUSTER_DOMAIN}"
            )
        n = next(self._pods)
        return sandbox.Sandbox(
            bridge=self.bridge,
            pod_dir=f"{self.root}/pods/{meta['namespace']}_{meta['name']}_{meta['uid']}",
            netns=f"{network.NAME_PREFIX}{self.tag}p{n}",
            hostname=hostname[:63],
            fqdn=fqdn,
            namespace=str(meta["namespace"]),
        )

    def _pod_event(self, key: Key) -> None:
        if self.kubelet is not None:
            self.kubelet.sync(self.informers["pods"].items())

    def stop(self) -> None:
        """Terminate every pod (grace periods honoured), stop DNS and the loop, remove the
        bridge and the node's files."""
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self.call(self._stop(), timeout=120)
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(10)
        if self.dns is not None:
            self.dns.stop()
        if self.image_store is not None:  # after every container stopped
            self.image_store.close()
        network.sweep(self.tag)
        self.bridge.delete()
        keep = os.environ.get(KEEP_ENV)
        if keep:  # the pods' files, their logs above all, for a look after the run
            with contextlib.suppress(OSError):
                shutil.copytree(
                    f"{self.root}/pods", keep, dirs_exist_ok=True, ignore_dangling_symlinks=True
                )
        shutil.rmtree(self.root, ignore_errors=True)

    async def _stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.kubelet is not None:
            await self.kubelet.shutdown()
        if self.forwarder is not None:
            await self.forwarder.stop()
        if self.api is not None:
            await self.api.close()

    @property
    def errors(self) -> list[str]:
        """Internal failures of the node (each one is a bug of the node, not of a pod)."""
        return list(self.kubelet.errors) if self.kubelet is not None else []

    def leftovers(self) -> list[str]:
        """What of this node still exists (empty after `stop`)."""
        return leftovers(self.tag)

    # ------------------------------------------------------------------ for tests

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        if self._loop is None:
            raise RuntimeError("the node is not running")
        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout)

    def worker(self, namespace: str, name: str) -> PodWorker:
        assert self.kubelet is not None
        worker = self.kubelet.worker(namespace, name)
        if worker is None:
            raise KeyError(f"no pod {namespace}/{name} on this node")
        return worker

    def logs(self, namespace: str, pod: str, container: str | None = None) -> str:
        """Every log of a container (all restarts, oldest first)."""
        worker = self.worker(namespace, pod)
        name = container or worker.containers[0].name
        c = next(c for c in worker.containers if c.name == name)
        out = []
        for restart in range(c.restarts + 1):
            with (
                contextlib.suppress(OSError),
                open(worker.sandbox.log_path(name, restart), errors="replace") as f,
            ):
                out.append(f.read())
        return "".join(out)

    def kill(self, namespace: str, pod: str, container: str, sig: int = signal.SIGKILL) -> int:
        """Signal a container's main process (e.g. kill -9); returns its pid."""
        worker = self.worker(namespace, pod)
        c = next(c for c in worker.containers if c.name == container)
        if c.process is None or c.process.returncode is not None:
            raise RuntimeError(f"container {container} of {pod} is not running")
        os.kill(c.process.pid, sig)
        return c.process.pid

    def cut(self, namespace: str, pod: str) -> None:
        network.cut(self.worker(namespace, pod).sandbox.netns)

    def restore(self, namespace: str, pod: str) -> None:
        network.restore(self.worker(namespace, pod).sandbox.netns)

    def pod_processes(self) -> list[int]:
        """Every process in any of this node's pod network namespaces."""
        pids = []
        for line in network.ip("netns", "list").stdout.splitlines():
            name = line.split()[0] if line.split() else ""
            if name.startswith(network.NAME_PREFIX + self.tag):
                pids.extend(network.processes_in(f"/run/netns/{name}"))
        return pids


def _close(loop: asyncio.AbstractEventLoop) -> None:
    """Close a stopped loop the way `asyncio.run` does: whatever task is still pending is
    cancelled and run to its end first. A task left pending would be closed later by the
    garbage collector, inside whatever the process does then, and its `finally` would find
    the loop closed."""
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in pending:
        task.cancel()
    with contextlib.suppress(Exception):
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()
