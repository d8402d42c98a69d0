"""`disagg gateway` started from what the operator rendered for it: the gateway Deployment's
container (its command and DISAGG_* environment) and the topology ConfigMap, on this host.

Pods' DNS names are mapped to 127.0.0.1 as the e2e-local node's pods would reach them
(`localize`: each `host:port` the plan names becomes a port on this host), the peer key
is the operator's Secret, and the mounted paths (topology, peer key) are files in `tmp`.
Everything else is the rendered configuration, unchanged."""

from __future__ import annotations

import base64
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from tests.k8s.server import EmulatorThread

Obj = dict[str, Any]
READY_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def localize(text: str, places: Mapping[str, str]) -> str:
    """`text` with every `host:port` of `places` replaced by its local address."""
    for name in sorted(places, key=len, reverse=True):  # a longer name first
        text = text.replace(name, places[name])
    return text


def peer_key(k8s: EmulatorThread, pipeline: str, namespace: str, tmp: pathlib.Path) -> str:
    """The operator's peer key Secret, written where a local process can read it."""
    secret = k8s.get("v1/secrets", f"{pipeline}-peer-key", namespace)
    assert secret is not None, "no peer key Secret"
    path = tmp / "peer-key"
    path.write_bytes(base64.b64decode(secret["data"]["key"]))
    path.chmod(0o600)
    return str(path)


def rendered_env(
    k8s: EmulatorThread,
    pipeline: str,
    namespace: str,
    tmp: pathlib.Path,
    places: Mapping[str, str],
    *,
    port: int,
    edit_topology: Callable[[Obj], None] | None = None,
) -> dict[str, str]:
    """The gateway container's DISAGG_* environment, its mounted files written in `tmp`
    (the topology localized, and `edit_topology`ed if given)."""
    tmp.mkdir(parents=True, exist_ok=True)
    deployment = k8s.get("apps/v1/deployments", f"{pipeline}-gateway", namespace)
    config_map = k8s.get("v1/configmaps", f"{pipeline}-topology", namespace)
    assert deployment is not None and config_map is not None
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["disagg", "gateway"]
    topology = json.loads(localize(config_map["data"]["topology.json"], places))
    if edit_topology is not None:
        edit_topology(topology)
    topology_file = tmp / "topology.json"
    topology_file.write_text(json.dumps(topology))
    rendered = {v["name"]: v.get("value") for v in container["env"]}
    env = {k: v for k, v in rendered.items() if v is not None}
    local = {  # the mounted files, and this host's address for the pod's
        "DISAGG_TOPOLOGY_FILE": str(topology_file),
        "DISAGG_BIND_HOST": "127.0.0.1",
        "DISAGG_GATEWAY_PORT": str(port),
    }
    if "DISAGG_PEER_KEY_FILE" in rendered:  # a peer of the roles (not in front of engines)
        local["DISAGG_PEER_KEY_FILE"] = peer_key(k8s, pipeline, namespace, tmp)
    if "DISAGG_POD_IP" in rendered:
        local["DISAGG_POD_IP"] = "127.0.0.1"
    return env | local


class RenderedGateway:
    """`disagg gateway` with the rendered container's environment, as a local process."""

    def __init__(self, env: Mapping[str, str], tmp: pathlib.Path) -> None:
        self.env = dict(env)
        self.url = f"http://127.0.0.1:{env['DISAGG_GATEWAY_PORT']}"
        self.log = tmp / "gateway.log"
        clean = {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "disagg_runtime.cli", "gateway"],
                env=clean | self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def readyz(self, timeout: float = READY_S, want: int = 200) -> httpx.Response:
        """/readyz once it answers `want` (else the last answer, or an AssertionError)."""
        deadline = time.monotonic() + timeout
        last: httpx.Response | None = None
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the gateway exited:\n{self.tail()}"
            try:
                last = httpx.get(self.url + "/readyz", timeout=5)
                if last.status_code == want:
                    return last
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        assert last is not None, f"the gateway never answered:\n{self.tail()}"
        return last

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        return int(self.proc.returncode)
