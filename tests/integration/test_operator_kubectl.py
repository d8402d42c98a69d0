"""The user's path with the real kubectl and the real operator (in this loop): apply the CRD
and an example, wait for it, read the printer columns, delete it."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration import operator_support as s
from tests.k8s.fixtures import Kubectl
from tests.k8s.server import EmulatorThread

pytestmark = pytest.mark.asyncio
NAME = "text-to-video"


async def test_kubectl_apply_wait_get_delete(k8s: EmulatorThread, kubectl: Kubectl):
    await s.call(kubectl, "apply", "-f", str(s.CRD))
    async with s.running_operator(k8s):
        out = await s.call(kubectl, "apply", "-f", str(s.EXAMPLE))
        assert f"disaggregatedpipeline.disagg.dev/{NAME} created" in out.stdout
        await s.until(k8s, lambda: len(k8s.list(s.STS, s.NS)) == 3, "the StatefulSets")
        await s.until(k8s, lambda: s.pipeline_status(k8s, NAME).get("phase"), "a status")

        table = (await s.call(kubectl, "get", "dpipe")).stdout.splitlines()
        assert table[0].split() == ["NAME", "READY", "PHASE", "ROLLOUT", "URL", "AGE"]
        assert table[1].split()[:3] == [NAME, "0/3", "Progressing"]

        phase = "--for=jsonpath={.status.phase}=Ready"
        waiter = kubectl.popen("wait", phase, f"dpipe/{NAME}", "--timeout=20s")
        condition = kubectl.popen("wait", "--for=condition=Ready", f"dpipe/{NAME}", "--timeout=20s")
        try:
            await asyncio.sleep(0.3)  # both are watching now
            await s.call(s.mark_ready, k8s, NAME)
            for process in (waiter, condition):
                stdout, stderr = await s.call(process.communicate, timeout=25)
                assert process.returncode == 0, stderr
                assert f"disaggregatedpipeline.disagg.dev/{NAME} condition met" in stdout
        finally:
            for process in (waiter, condition):
                if process.poll() is None:
                    process.kill()
                    process.wait(timeout=5)

        table = (await s.call(kubectl, "get", "disaggregatedpipelines")).stdout.splitlines()
        assert table[1].split()[:3] == [NAME, "3/3", "Ready"]
        wide = (await s.call(kubectl, "get", "dpipe", "-o", "wide")).stdout.splitlines()
        assert wide[0].split() == ["NAME", "READY", "PHASE", "ROLLOUT", "URL", "REASON", "AGE"]
        url = f"http://{NAME}.{s.NS}.svc:8080"
        assert wide[1].split()[:6] == [NAME, "3/3", "Ready", "-", url, "AllRolesReady"]
        listed = await s.call(kubectl.json, "get", "disagg")  # the category
        assert [i["metadata"]["name"] for i in listed["items"]] == [NAME]
        selector = f"--field-selector=involvedObject.name={NAME}"
        events = await s.call(kubectl.json, "get", "events", selector)
        assert {"Created", "PipelineReady"} <= {e["reason"] for e in events["items"]}

        out = await s.call(kubectl, "delete", "-f", str(s.EXAMPLE), "--wait=false")
        assert "deleted" in out.stdout
        await s.until(k8s, lambda: not s.children(k8s, NAME), "every child deleted")
        gone = await s.call(kubectl, "get", "dpipe", check=False)
        assert NAME not in gone.stdout
