"""A pod sandbox and its containers as processes.

Sandbox = a network namespace on the node's bridge (`network.Bridge.attach`) plus a "pause"
process (`nsexec.py pause`) that holds the pod's IPC, mount and UTS namespaces, its
hostname and its memory emptyDirs (tmpfs). Container = `nsexec.py container`: it joins the
pause process's namespaces, takes a mount namespace of its own with the pod's volumes and
/etc/hosts, /etc/resolv.conf, /etc/hostname bound in, drops to the pod's user and execs the
command with stdout and stderr to `<pod dir>/logs/<container>/<restart>.log`.

Containers of one pod share network (peers on 127.0.0.1), IPC and /dev/shm (the same
tmpfs); pods share nothing but the bridge. Every process of a pod is found through its
network namespace (`processes_in`), so teardown also reaps what a container spawned.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .network import Bridge, processes_in

NSEXEC = str(Path(__file__).with_name("nsexec.py"))
CHECKOUT = str(Path(__file__).resolve().parents[3])  # tests/k8s/node/sandbox.py


def host_image(pythonpath: str) -> list[str]:
    """What a container needs of the host to run from its virtual environment (this node's
    image): the environment, its interpreter, the checkout (editable installs, the tests'
    handlers) and PYTHONPATH; nested paths left out (a bind of the parent carries them)."""
    paths = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, CHECKOUT)}
    paths |= {os.path.realpath(p) for p in pythonpath.split(os.pathsep) if os.path.isdir(p)}
    top = sorted(p for p in paths if p != "/")
    return [p for p in top if not any(p.startswith(q.rstrip("/") + "/") for q in top if q != p)]


CLUSTER_DOMAIN = "cluster.local"


@dataclass
class Sandbox:
    bridge: Bridge
    pod_dir: str
    netns: str
    hostname: str
    fqdn: str  # <hostname>.<subdomain>.<ns>.svc.cluster.local, or ""
    namespace: str
    ip: str = ""
    veth: str = ""
    pause: asyncio.subprocess.Process | None = None
    etc: dict[str, str] = field(default_factory=dict)

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.netns}"

    async def create(self, tmpfs: list[dict[str, object]]) -> None:
        os.makedirs(self.pod_dir, mode=0o755, exist_ok=True)
        self.ip, self.veth = await asyncio.to_thread(self.bridge.attach, self.netns)
        self._write_etc()
        spec = os.path.join(self.pod_dir, "pause.json")
        Path(spec).write_text(
            json.dumps({"netns": self.netns_path, "hostname": self.hostname, "tmpfs": tmpfs})
        )
        self.pause = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            NSEXEC,
            "pause",
            spec,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        assert self.pause.stdout is not None
        line = await asyncio.wait_for(self.pause.stdout.readline(), 10)
        if line.strip() != b"ready":
            err = await self.pause.stderr.read() if self.pause.stderr else b""
            raise RuntimeError(f"pod sandbox failed: {err.decode(errors='replace').strip()}")

    def _write_etc(self) -> None:
        etc = os.path.join(self.pod_dir, "etc")
        os.makedirs(etc, exist_ok=True)
        names = f"{self.fqdn} {self.hostname}" if self.fqdn else self.hostname
        files = {
            "hosts": (
                "# Kubernetes-managed hosts file (test node).\n127.0.0.1\tlocalhost\n"
                f"::1\tlocalhost ip6-localhost ip6-loopback\n{self.ip}\t{names}\n"
            ),
            "resolv.conf": (
                f"search {self.namespace}.svc.{CLUSTER_DOMAIN} svc.{CLUSTER_DOMAIN} "
                f"{CLUSTER_DOMAIN}\nnameserver {self.bridge.gateway}\noptions ndots:5\n"
            ),
            "hostname": self.hostname + "\n",
        }
        for name, text in files.items():
            path = os.path.join(etc, name)
            Path(path).write_text(text)
            os.chmod(path, 0o644)
            self.etc[f"/etc/{name}"] = path

    async def start_container(
        self,
        name: str,
        restart: int,
        *,
        argv: list[str],
        env: dict[str, str],
        mounts: list[dict[str, object]],
        uid: int | None,
        gid: int | None,
        groups: list[int],
        read_only_root: bool,
        working_dir: str,
        rootfs: str | None = None,
    ) -> asyncio.subprocess.Process:
        """`rootfs`: the image's root filesystem (else the host's, with its venv)."""
        if self.pause is None:
            raise RuntimeError("the sandbox is not running")
        cdir = os.path.join(self.pod_dir, "containers", f"{name}-{restart}")
        scratch = os.path.join(cdir, "scratch")
        os.makedirs(scratch, exist_ok=True)
        logs = os.path.join(self.pod_dir, "logs", name)
        os.makedirs(logs, exist_ok=True)
        etc = [{"source": src, "target": dst} for dst, src in sorted(self.etc.items())]
        host = {
            "reveal": sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}),
            "keep": host_image(env.get("PYTHONPATH", "")),
        }
        spec = {
            "pid": self.pause.pid,
            **({"rootfs": rootfs} if rootfs else host),
            "scratch": scratch,
            "mounts": etc + mounts,
            "uid": uid,
            "gid": gid,
            "groups": groups,
            "readOnlyRoot": read_only_root,
            "workingDir": working_dir,
            "argv": argv,
            "env": env,
        }
        spec_path = os.path.join(cdir, "spec.json")
        Path(spec_path).write_text(json.dumps(spec))
        with open(os.path.join(logs, f"{restart}.log"), "ab") as log:
            return await asyncio.create_subprocess_exec(
                sys.executable,
                "-I",
                NSEXEC,
                "container",
                spec_path,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )

    def log_path(self, name: str, restart: int) -> str:
        return os.path.join(self.pod_dir, "logs", name, f"{restart}.log")

    async def destroy(self) -> None:
        """Kill whatever still runs in the pod, then remove its network namespace."""
        if self.pause is not None and self.pause.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.pause.terminate()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.pause.wait(), 5)
        deadline = time.monotonic() + 5
        while self.ip and time.monotonic() < deadline:
            pids = processes_in(self.netns_path)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(0.05)
        if self.pause is not None and self.pause.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.pause.kill()
            await self.pause.wait()
        if self.ip:
            await asyncio.to_thread(self.bridge.detach, self.netns, self.veth, self.ip)
            self.ip = ""

    def remove_files(self) -> None:
        shutil.rmtree(self.pod_dir, ignore_errors=True)
