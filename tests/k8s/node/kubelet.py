"""The kubelet: one worker per pod (by uid) that builds the sandbox, lays out volumes, starts
containers, probes them, restarts them and writes the pod's status back through the
status subresource.

- Containers start in spec order; env = the container's env (value, $(VAR) references,
  valueFrom fieldRef / secretKeyRef / configMapKeyRef), envFrom, plus HOSTNAME, HOME and
  the image's env. With `Config.images`, a container whose image the local engine has runs
  from it (its root filesystem, entrypoint/cmd merged with command/args, USER, Env,
  WorkingDir; see images); any other runs from the local virtual environment (PATH with
  its bin first, PYTHONPATH carried from the node).
- securityContext (container over pod): runAsUser, runAsGroup, fsGroup and
  supplementalGroups (as groups), runAsNonRoot (refused when the uid is 0),
  readOnlyRootFilesystem (root remounted read-only in the container's mount namespace).
- Probes: startup until it succeeds, then liveness and readiness (see probes). A failed
  liveness or startup probe kills the container (SIGTERM, SIGKILL after the grace period).
- restartPolicy Always / OnFailure / Never; restarts after a back-off of 0 s, then
  `backoff` s doubling to 300 s (reset after 10 minutes running); restartCount and
  lastState as on a node.
- Deleting the pod: SIGTERM to every container, SIGKILL after
  `terminationGracePeriodSeconds` (default 30), then the sandbox goes. As on a node, the
  pod stays in the API (with its deletionTimestamp) until then: the kubelet holds every
  pod it runs with FINALIZER and lets go of it once its containers have stopped, so a
  StatefulSet's replacement pod (same name) starts only after the old one is gone.
- Status: phase, conditions PodScheduled / Initialized / ContainersReady / Ready, podIP(s),
  hostIP, startTime, containerStatuses (state, lastState, ready, started, restartCount).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from . import apiserver, volumes
from .api import Api, ApiError, Obj
from .images import Image, ImageStore
from .probes import Probe
from .sandbox import Sandbox

log = logging.getLogger(__name__)
TICK = 0.25
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MAX_BACKOFF = 300.0
RESET_BACKOFF_AFTER = 600.0
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion: defined variables are replaced, $$ escapes."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(sub, text)


@dataclass
class Container:
    spec: Obj
    restarts: int = 0
    process: asyncio.subprocess.Process | None = None
    started_at: str = ""
    started_mono: float = 0.0
    next_start: float = 0.0
    last_state: Obj = field(default_factory=dict)
    terminated: Obj | None = None  # final state (restartPolicy says no more restarts)
    waiting: str = "ContainerCreating"
    startup: Probe | None = None
    readiness: Probe | None = None
    liveness: Probe | None = None
    started: bool = False
    ready: bool = False
    image: Image | None = None  # None: the host's virtual environment

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None


@dataclass
class Config:
    venv_bin: str
    pythonpath: str
    root: str  # the node's directory: pods/<uid>/...
    backoff: float = 10.0
    node_name: str = "test-node"
    extra_env: dict[str, str] = field(default_factory=dict)
    in_cluster: apiserver.InCluster | None = None  # pods get the `kubernetes` Service
    images: ImageStore | None = None  # containers run from their images when stored there


class PodWorker:
    def __init__(
        self,
        api: Api,
        config: Config,
        pod: Obj,
        sandbox_factory: Callable[[Obj], Sandbox],
        fetch: volumes.Fetch,
    ) -> None:
        self.api = api
        self.config = config
        self.pod = pod
        self.uid = str(pod["metadata"]["uid"])
        self.sandbox = sandbox_factory(pod)
        self.fetch = fetch
        self.containers = [Container(c) for c in pod["spec"].get("containers") or []]
        self.stopping = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.phase = "Pending"
        self.start_time = ""
        self.message = ""
        self._written: Obj | None = None
        self.session: aiohttp.ClientSession | None = None
        self.errors: list[str] = []
        self.api_access = False

    @property
    def ns(self) -> str:
        return str(self.pod["metadata"]["namespace"])

    @property
    def name(self) -> str:
        return str(self.pod["metadata"]["name"])

    def start(self) -> None:
        self.task = asyncio.create_task(self.run(), name=f"pod {self.ns}/{self.name}")

    async def stop(self) -> None:
        self.stopping.set()
        if self.task is not None:
            await self.task

    # ------------------------------------------------------------------ main loop

    async def run(self) -> None:
        self.session = aiohttp.ClientSession()
        try:
            await self._run()
        except Exception as exc:
            log.exception("pod %s/%s: worker failed", self.ns, self.name)
            self.errors.append(f"pod {self.ns}/{self.name}: {type(exc).__name__}: {exc}")
        finally:
            await self._terminate()
            await self.session.close()

    async def _run(self) -> None:
        self.start_time = now_iso()
        vols: volumes.PodVolumes | None = None
        while vols is None and not self.stopping.is_set():
            try:
                vols = await volumes.prepare(self.pod, self.sandbox.pod_dir, self.fetch)
            except volumes.VolumeError as exc:
                self.message = str(exc)
                await self._write_status()
                await self._sleep(1.0)
        if vols is None:
            return
        self.api_access = await self._api_access(vols)
        await self._images()
        await self.sandbox.create(vols.tmpfs)
        self.vols = vols
        await self._write_status()
        refreshed = time.monotonic()
        while not self.stopping.is_set():
            for c in self.containers:
                await self._step(c)
            if time.monotonic() - refreshed > 1.0:
                refreshed = time.monotonic()
                await volumes.refresh(self.pod, self.sandbox.pod_dir, self.fetch)
            self._update_phase()
            await self._write_status()
            if self.phase in ("Succeeded", "Failed"):
                await self.sandbox.destroy()
                await self.stopping.wait()
                return
            await self._sleep(TICK)

    async def _api_access(self, vols: volumes.PodVolumes) -> bool:
        """The service-account volume (token, ca.crt, namespace) that a cluster's admission
        adds to every pod unless automountServiceAccountToken is false (on the pod, else on
        its ServiceAccount); laid out here by the kubelet instead, only with `in_cluster`."""
        access = self.config.in_cluster
        if access is None:
            return False
        spec = self.pod["spec"]
        account = str(spec.get("serviceAccountName") or spec.get("serviceAccount") or "default")
        automount = spec.get("automountServiceAccountToken")
        if automount is None:
            sa = await self.fetch("serviceaccounts", account)
            automount = (sa or {}).get("automountServiceAccountToken", True)
        if not automount:
            return False
        target = os.path.join(self.sandbox.pod_dir, "volumes", apiserver.VOLUME)
        files = {
            "token": access.token_for(self.ns, account).encode(),
            "ca.crt": access.ca_pem,
            "namespace": self.ns.encode(),
        }
        volumes.write_atomic(target, files, 0o644, volumes.fs_group(self.pod))
        vols.paths[apiserver.VOLUME] = target
        return True

    async def _images(self) -> None:
        """Each container's image from the node's store (mounted before the sandbox is
        made, so that its mount namespace has them); the host's venv where it is absent."""
        store = self.config.images
        if store is None:
            return
        for c in self.containers:
            ref = str(c.spec.get("image") or "")
            try:
                c.image = await asyncio.to_thread(store.get, ref)
            except (RuntimeError, OSError, ValueError) as exc:
                self.errors.append(f"pod {self.ns}/{self.name} image {ref}: {exc}")

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), seconds)

    async def _step(self, c: Container) -> None:
        if c.terminated is not None:
            return
        if c.process is not None and c.process.returncode is not None:
            self._exited(c)
            if c.terminated is not None:
                return  # restartPolicy says no restart: never start it again
        if c.process is None:
            if time.monotonic() >= c.next_start:
                await self._start(c)
            return
        assert self.session is not None
        if c.startup is not None and not c.started:
            result = await c.startup.run_once(self.session)
            if result is True:
                c.started = True
            elif result is False:
                await self._kill(c, "startup probe failed")
            return
        c.started = True
        if c.liveness is not None and await c.liveness.run_once(self.session) is False:
            await self._kill(c, f"liveness probe failed: {c.liveness.last_error}")
            return
        if c.readiness is not None:
            c.ready = bool(await c.readiness.run_once(self.session))
        else:
            c.ready = True

    def _exited(self, c: Container) -> None:
        assert c.process is not None
        code = c.process.returncode or 0
        if code < 0:
            code = 128 - code  # killed by a signal: 128 + signo, as a runtime reports it
        state = {
            "terminated": {
                "exitCode": code,
                "reason": "Completed" if code == 0 else "Error",
                "startedAt": c.started_at,
                "finishedAt": now_iso(),
            }
        }
        c.process, c.ready, c.started = None, False, False
        policy = self.pod["spec"].get("restartPolicy", "Always")
        if policy == "Never" or (policy == "OnFailure" and code == 0):
            c.terminated = state
            return
        c.last_state = state
        ran = time.monotonic() - c.started_mono
        if c.restarts == 0 or ran > RESET_BACKOFF_AFTER:
            delay = 0.0
        else:
            delay = min(self.config.backoff * 2 ** (c.restarts - 1), MAX_BACKOFF)
        c.restarts += 1
        c.next_start = time.monotonic() + delay
        c.waiting = "CrashLoopBackOff" if delay else "ContainerCreating"

    async def _kill(self, c: Container, why: str) -> None:
        log.info("pod %s/%s container %s: %s", self.ns, self.name, c.name, why)
        await self._signal_and_wait([c], self._grace())

    def _grace(self) -> float:
        return float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))

    async def _signal_and_wait(self, containers: list[Container], grace: float) -> None:
        live = [c.process for c in containers if c.running and c.process is not None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in live:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), max(0.0, deadline - time.monotonic()))
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()

    async def _terminate(self) -> None:
        await self._signal_and_wait(self.containers, self._grace())
        await self.sandbox.destroy()

    # ------------------------------------------------------------------ starting

    async def _start(self, c: Container) -> None:
        try:
            env = await self._env(c.spec, c.image)
            command = [expand(str(a), env) for a in c.spec.get("command") or []]
            args = [expand(str(a), env) for a in c.spec.get("args") or []]
            argv = c.image.argv(command, args) if c.image else [*command, *args]
            if not argv:
                raise ValueError("no command, and no image entrypoint")
            uid, gid, groups, ro = self._security(c.spec, c.image)
        except (ValueError, ApiError, volumes.VolumeError) as exc:
            c.waiting = "CreateContainerConfigError"
            self.message = f"container {c.name}: {exc}"
            c.next_start = time.monotonic() + 1.0
            return
        mounts = []
        for m in sorted(c.spec.get("volumeMounts") or [], key=lambda m: len(m["mountPath"])):
            source = self.vols.paths.get(m["name"])
            if source is None:
                c.waiting = "CreateContainerConfigError"
                self.message = f"container {c.name}: no volume {m['name']!r}"
                c.next_start = time.monotonic() + 1.0
                return
            if m.get("subPath"):
                source = os.path.join(source, m["subPath"])
            mounts.append(
                {"source": source, "target": m["mountPath"], "readOnly": bool(m.get("readOnly"))}
            )
        if self.api_access and apiserver.MOUNT not in {m["target"] for m in mounts}:
            source = self.vols.paths[apiserver.VOLUME]
            mounts.append({"source": source, "target": apiserver.MOUNT, "readOnly": True})
        c.process = await self.sandbox.start_container(
            c.name,
            c.restarts,
            argv=argv,
            env=env,
            mounts=mounts,
            uid=uid,
            gid=gid,
            groups=groups,
            read_only_root=ro,
            working_dir=str(
                c.spec.get("workingDir") or (c.image.working_dir if c.image else "") or "/"
            ),
            rootfs=c.image.rootfs if c.image else None,
        )
        c.started_at, c.started_mono = now_iso(), time.monotonic()
        c.waiting, c.started, c.ready = "", False, False
        ports = {
            str(p["name"]): int(p["containerPort"])
            for p in c.spec.get("ports") or []
            if p.get("name")
        }
        probe = lambda key: Probe(c.spec[key], self.sandbox.ip, ports) if key in c.spec else None  # noqa: E731
        c.startup, c.liveness, c.readiness = (
            probe("startupProbe"),
            probe("livenessProbe"),
            probe("readinessProbe"),
        )

    def _security(
        self, spec: Obj, image: Image | None = None
    ) -> tuple[int | None, int | None, list[int], bool]:
        """uid, gid, groups, read-only root: the securityContext (container over pod) over
        the image's USER."""
        pod_sc = self.pod["spec"].get("securityContext") or {}
        sc = {**pod_sc, **(spec.get("securityContext") or {})}
        uid, gid = sc.get("runAsUser"), sc.get("runAsGroup")
        if image is not None:
            image_uid, image_gid = image.ids()
            if uid is None:
                uid = image_uid
                gid = image_gid if gid is None else gid
        if sc.get("runAsNonRoot") and (uid is None or int(uid) == 0):
            raise ValueError("runAsNonRoot is set and the container would run as root")
        groups = [int(g) for g in pod_sc.get("supplementalGroups") or []]
        if pod_sc.get("fsGroup") is not None:
            groups.append(int(pod_sc["fsGroup"]))
        if uid is not None and gid is None:
            gid = 0
        return (
            None if uid is None else int(uid),
            None if gid is None else int(gid),
            groups,
            bool(sc.get("readOnlyRootFilesystem")),
        )

    async def _env(self, spec: Obj, image: Image | None = None) -> dict[str, str]:
        uid = (spec.get("securityContext") or {}).get(
            "runAsUser", (self.pod["spec"].get("securityContext") or {}).get("runAsUser")
        )
        if uid is None and image is not None:
            uid = image.ids()[0]
        host = {
            "PATH": f"{self.config.venv_bin}:{SYSTEM_PATH}",
            **({"PYTHONPATH": self.config.pythonpath} if self.config.pythonpath else {}),
        }
        env: dict[str, str] = {
            **({"PATH": SYSTEM_PATH, **image.env} if image is not None else host),
            "HOSTNAME": self.sandbox.hostname,
            "HOME": "/root" if int(uid or 0) == 0 else "/",
            **self.config.extra_env,
            **(self.config.in_cluster.env() if self.config.in_cluster else {}),
        }
        for source in spec.get("envFrom") or []:
            prefix = str(source.get("prefix", ""))
            if "configMapRef" in source:
                obj = await self._required("configmaps", source["configMapRef"])
                env.update({prefix + k: str(v) for k, v in ((obj or {}).get("data") or {}).items()})
            if "secretRef" in source:
                obj = await self._required("secrets", source["secretRef"])
                env.update(
                    {prefix + k: _b64(v) for k, v in ((obj or {}).get("data") or {}).items()}
                )
        for var in spec.get("env") or []:
            name = str(var["name"])
            if "valueFrom" not in var:
                env[name] = expand(str(var.get("value", "")), env)
                continue
            source = var["valueFrom"]
            if "fieldRef" in source:
                env[name] = volumes.field_value(
                    self._pod_with_ip(), source["fieldRef"]["fieldPath"]
                )
            elif "secretKeyRef" in source or "configMapKeyRef" in source:
                resource = "secrets" if "secretKeyRef" in source else "configmaps"
                ref = source.get("secretKeyRef") or source.get("configMapKeyRef")
                obj = await self._required(resource, ref)
                data = (obj or {}).get("data") or {}
                if ref["key"] not in data:
                    if ref.get("optional"):
                        continue
                    raise ValueError(
                        f"couldn't find key {ref['key']} in {resource[:-1]} {ref['name']}"
                    )
                env[name] = (
                    _b64(data[ref["key"]]) if resource == "secrets" else str(data[ref["key"]])
                )
            elif "resourceFieldRef" in source:
                env[name] = "0"
            else:
                raise ValueError(f"env {name}: unsupported valueFrom {sorted(source)}")
        return env

    async def _required(self, resource: str, ref: Obj) -> Obj | None:
        obj = await self.fetch(resource, ref["name"])
        if obj is None and not ref.get("optional"):
            raise ValueError(f'{resource[:-1]} "{ref["name"]}" not found')
        return obj

    def _pod_with_ip(self) -> Obj:
        return {
            **self.pod,
            "status": {"podIP": self.sandbox.ip, "hostIP": self.sandbox.bridge.gateway},
        }

    # ------------------------------------------------------------------ status

    def _update_phase(self) -> None:
        if self.containers and all(c.terminated is not None for c in self.containers):
            codes = [
                c.terminated["terminated"]["exitCode"] for c in self.containers if c.terminated
            ]
            self.phase = "Succeeded" if all(code == 0 for code in codes) else "Failed"
        elif any(c.running for c in self.containers):
            self.phase = "Running"

    def _container_status(self, c: Container) -> Obj:
        if c.terminated is not None:
            state: Obj = c.terminated
        elif c.running:
            state = {"running": {"startedAt": c.started_at}}
        else:
            state = {"waiting": {"reason": c.waiting or "ContainerCreating"}}
        status: Obj = {
            "name": c.name,
            "image": str(c.spec.get("image", "")),
            "imageID": f"sha256:{c.image.id}" if c.image else "",
            "containerID": f"node://{self.uid}/{c.name}/{c.restarts}",
            "ready": c.ready and c.running,
            "started": c.started and c.running,
            "restartCount": c.restarts,
            "state": state,
        }
        if c.last_state:
            status["lastState"] = c.last_state
        return status

    async def _write_status(self) -> None:
        ready = bool(self.containers) and all(c.ready and c.running for c in self.containers)

        def cond(kind: str, ok: bool) -> Obj:
            return {"type": kind, "status": "True" if ok else "False"}

        status: Obj = {
            "phase": self.phase,
            "hostIP": self.sandbox.bridge.gateway,
            "startTime": self.start_time,
            "conditions": [
                cond("PodScheduled", True),
                cond("Initialized", True),
                cond("ContainersReady", ready),
                cond("Ready", ready),
            ],
            "containerStatuses": [self._container_status(c) for c in self.containers],
        }
        if self.sandbox.ip:
            status["podIP"] = self.sandbox.ip
            status["podIPs"] = [{"ip": self.sandbox.ip}]
        if self.message:
            status["message"] = self.message
        if status == self._written:
            return
        stamped = {
            **status,
            "conditions": [{**c, "lastTransitionTime": now_iso()} for c in status["conditions"]],
        }
        try:
            await self.api.patch_status("pods", self.ns, self.name, stamped)
            self._written = status
        except ApiError as exc:
            if exc.status != 404:
                log.debug("pod %s/%s status: %s", self.ns, self.name, exc)


def _b64(value: str) -> str:
    import base64

    return base64.b64decode(value).decode()


FINALIZER = "node.disagg.test/containers"  # a deleted pod stays until its containers stopped


class Kubelet:
    def __init__(self, api: Api, config: Config, sandbox_factory: Callable[[Obj], Sandbox]) -> None:
        self.api = api
        self.config = config
        self.sandbox_factory = sandbox_factory
        self.workers: dict[str, PodWorker] = {}
        self.stopped: list[asyncio.Task[None]] = []
        self.errors: list[str] = []  # failures of pod workers (a node bug, not a pod's)
        self._releasing: set[str] = set()  # deleted pods whose finalizer is being removed

    def sync(self, pods: list[Obj]) -> None:
        """Start workers for new pods (holding each in the API with FINALIZER), stop those
        whose pod is gone or being deleted (by uid), and let a deleted pod go from the API
        once its containers have stopped."""
        live = {
            str(p["metadata"]["uid"]): p for p in pods if not p["metadata"].get("deletionTimestamp")
        }
        deleted = {
            str(p["metadata"]["uid"]): p for p in pods if p["metadata"].get("deletionTimestamp")
        }
        for uid, pod in live.items():
            if uid not in self.workers:
                ns = str(pod["metadata"]["namespace"])

                async def fetch(resource: str, name: str, ns: str = ns) -> Obj | None:
                    return await self.api.get(resource, ns, name)

                worker = PodWorker(self.api, self.config, pod, self.sandbox_factory, fetch)
                worker.errors = self.errors
                self.workers[uid] = worker
                worker.start()
                self.stopped.append(asyncio.create_task(self._finalizer(pod, hold=True)))
            else:
                self.workers[uid].pod = {**pod, "status": self.workers[uid].pod.get("status")}
        for uid in [u for u in self.workers if u not in live]:
            worker = self.workers.pop(uid)
            if uid in deleted:
                self._releasing.add(uid)  # by _stop, once its containers have stopped
            self.stopped.append(asyncio.create_task(self._stop(worker, deleted.get(uid))))
        for uid, pod in deleted.items():  # deleted before its worker started, or a leftover
            held = FINALIZER in (pod["metadata"].get("finalizers") or [])
            if held and uid not in self.workers and uid not in self._releasing:
                self._releasing.add(uid)
                self.stopped.append(asyncio.create_task(self._finalizer(pod, hold=False)))

    async def _stop(self, worker: PodWorker, pod: Obj | None) -> None:
        """Stop a pod's containers (SIGTERM, SIGKILL after the grace period); a pod that is
        still in the API, being deleted, goes from it then."""
        await worker.stop()
        if pod is not None:
            await self._finalizer(pod, hold=False)

    async def _finalizer(self, pod: Obj, *, hold: bool) -> None:
        """Add (hold) or remove FINALIZER on `pod`; a pod gone already is left alone."""
        meta = pod["metadata"]
        others = [f for f in meta.get("finalizers") or [] if f != FINALIZER]
        body = {"metadata": {"finalizers": [*others, FINALIZER] if hold else others}}
        try:
            await self.api.patch("pods", str(meta["namespace"]), str(meta["name"]), body)
        except ApiError as exc:
            if exc.status not in (404, 409, 422):
                self.errors.append(f"pod {meta['namespace']}/{meta['name']} finalizer: {exc}")

    def worker(self, namespace: str, name: str) -> PodWorker | None:
        for w in self.workers.values():
            if w.ns == namespace and w.name == name:
                return w
        return None

    async def shutdown(self) -> None:
        workers, self.workers = list(self.workers.values()), {}
        await asyncio.gather(*(w.stop() for w in workers), *self.stopped, return_exceptions=True)
