"""The test node runs a pod from its image (tests/k8s/node/images.py): the image's root
filesystem (not the host's), its entrypoint under the pod's command/args, its user and env,
with the pod's volumes and a read-only root; the image is unmounted when the node stops.
Needs root and an engine with the operator image built (`make images`); skipped otherwise,
saying why."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.images import engine
from tests.k8s.node import Node, can_create_namespaces
from tests.k8s.server import EmulatorThread

pytestmark = pytest.mark.timeout(180)
SCRIPT = (
    "id -u; id -g; echo PATH=$PATH; disagg --version; "
    "test -e /work && echo host-root || echo image-root; "
    "test -w / && echo rw-root || echo ro-root; "
    "touch /tmp/x && echo tmp-writable; cat /etc/cfg/a; echo"
)


def test_pod_runs_from_its_image(k8s: EmulatorThread) -> None:
    reason = can_create_namespaces()
    if reason is not None:
        pytest.skip(reason)
    found = engine.find()
    if isinstance(found, str):
        pytest.skip(found)
    image = engine.tag("operator")
    if not found.has(image):
        pytest.skip(f"{image} is not built (`make images`)")
    node = Node(k8s.url, backoff=0.5, images=True).start()
    try:
        k8s.create(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "cfg", "namespace": "default"},
                "data": {"a": "from-configmap"},
            }
        )
        k8s.create(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "img", "namespace": "default"},
                "spec": {
                    "restartPolicy": "Never",
                    "volumes": [
                        {"name": "tmp", "emptyDir": {}},
                        {"name": "cfg", "configMap": {"name": "cfg"}},
                    ],
                    "containers": [
                        {
                            "name": "main",
                            "image": image,
                            "command": ["sh", "-c", SCRIPT],
                            "securityContext": {"readOnlyRootFilesystem": True},
                            "volumeMounts": [
                                {"name": "tmp", "mountPath": "/tmp"},
                                {"name": "cfg", "mountPath": "/etc/cfg", "readOnly": True},
                            ],
                        }
                    ],
                },
            }
        )
        deadline = time.monotonic() + 60
        phase = ""
        while time.monotonic() < deadline and phase not in ("Succeeded", "Failed"):
            pod = k8s.get("v1/pods", "img", "default") or {}
            phase = (pod.get("status") or {}).get("phase", "")
            time.sleep(0.2)
        logs = node.logs("default", "img")
        assert phase == "Succeeded", logs
        lines = logs.split()
        assert lines[:2] == ["65532", "65532"], logs  # the image's USER
        assert f"disagg {engine.version()}" in logs
        assert "image-root" in lines and "ro-root" in lines and "tmp-writable" in lines, logs
        assert "from-configmap" in lines, logs
        status = pod["status"]["containerStatuses"][0]
        assert status["imageID"].startswith("sha256:")
        assert node.image_store is not None
    finally:
        node.stop()
    assert node.leftovers() == [] and node.errors == []
    mounts = subprocess.run(["mount"], capture_output=True, text=True).stdout
    assert status["imageID"].removeprefix("sha256:")[:12] not in mounts
