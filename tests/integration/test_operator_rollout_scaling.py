"""Scaling in the middle of a coordinated rollout, against the emulator: the real operator
steps partitions while the StatefulSet controller (played here, as in
test_operator_rollout.py, plus what the real one does on a resize: new ordinals at or above
the partition start at the update revision, those below at the current one; scale-down
removes the highest ordinals first) moves pods. Replicas change mid-rollout; the rollout
must still finish with every pod at the new revision (no update lost, no new pod scaled
away for good) and end Complete."""

from __future__ import annotations

from typing import Any

import pytest

from disagg_operator import names
from tests.integration import operator_support as s
from tests.integration.test_operator_rollout import (
    NAME,
    NS,
    Controller,
    all_at_new_revision,
    doc,
    rollout_phase,
    settled,
)
from tests.k8s.server import EmulatorThread

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(240)]


class ResizingController(Controller):
    """`Controller` that also follows spec.replicas changes the way the real one does."""

    def resize(self, sts: dict[str, Any], pods: list[str]) -> None:
        n = sts["spec"].get("replicas", 1)
        if len(pods) == n:
            return
        partition = sts["spec"]["updateStrategy"]["rollingUpdate"]["partition"]
        update = self.revisions.get(sts["metadata"]["name"], "")
        current = pods[0]  # the lowest ordinal moves last: it holds the current revision
        del pods[n:]
        pods += [update if i >= partition else current for i in range(len(pods), n)]


def with_replicas(d: dict[str, Any], prefill: int, decode: int) -> dict[str, Any]:
    d["spec"]["roles"][0]["replicas"] = prefill
    d["spec"]["roles"][1]["replicas"] = decode
    return d


@pytest.mark.parametrize(("prefill", "decode"), [(6, 6), (2, 3)], ids=["up", "down"])
async def test_scaling_during_a_rollout_keeps_partitions_and_finishes(
    k8s_crd: EmulatorThread,
    prefill: int,
    decode: int,
) -> None:
    k8s = k8s_crd
    controller = ResizingController(k8s)
    async with s.running_operator(k8s), controller.running():
        await s.call(k8s.create, doc("ghcr.io/disagg/runtime:0.1.0"), NS)
        await settled(k8s, controller)
        old = controller.baseline = dict(controller.revisions)
        new = doc("ghcr.io/disagg/runtime:0.2.0")
        await s.call(k8s.patch, s.PIPELINES, NAME, {"spec": new["spec"]}, NS)
        await s.until(
            k8s,
            lambda: any(0 < f["prefill"] < 1 for f in controller.seen[-1:]),
            "the rollout under way",
            60,
        )
        resized = with_replicas(doc("ghcr.io/disagg/runtime:0.2.0"), prefill, decode)
        await s.call(k8s.patch, s.PIPELINES, NAME, {"spec": resized["spec"]}, NS)
        await s.until(
            k8s,
            lambda: (
                [len(controller.pods[f"{NAME}-{u}"]) for u in ("prefill", "decode")]
                == [prefill, decode]
            ),
            "the new sizes",
            60,
        )
        await s.until(k8s, lambda: all_at_new_revision(controller, old), "every pod updated", 120)
        await s.until(k8s, lambda: rollout_phase(k8s) == "Complete", "Complete", 30)
        for unit, n in (("prefill", prefill), ("decode", decode)):
            sts = k8s.get(s.STS, f"{NAME}-{unit}", NS) or {}
            assert sts["spec"]["replicas"] == n
            assert sts["spec"]["updateStrategy"]["rollingUpdate"]["partition"] == 0


def externally_scaled(d: dict[str, Any]) -> dict[str, Any]:
    """prefill's replicas belong to an external scaler (an HPA on its StatefulSet)."""
    d["metadata"]["annotations"] = {names.ANNOTATION_EXTERNAL_SCALING: "prefill"}
    return d


@pytest.mark.parametrize("replicas", [6, 2], ids=["up", "down"])
async def test_an_autoscaler_resizing_during_a_rollout_keeps_partitions_and_finishes(
    k8s_crd: EmulatorThread,
    replicas: int,
) -> None:
    """The autoscaler, not the spec, resizes prefill in the middle of the rollout: an HPA
    (external scaling) through the StatefulSet's scale subresource. The operator keeps
    stepping partitions over the new size, leaves the HPA's count alone, and the rollout
    finishes with every pod updated (none scaled away for good, none left behind)."""
    k8s = k8s_crd
    controller = ResizingController(k8s)
    prefill = f"{NAME}-prefill"
    async with s.running_operator(k8s), controller.running():
        await s.call(k8s.create, externally_scaled(doc("ghcr.io/disagg/runtime:0.1.0")), NS)
        scale = {"spec": {"replicas": 4}}
        await s.until(k8s, lambda: k8s.get(s.STS, prefill, NS) is not None, "prefill's sts", 60)
        await s.call(k8s.patch, s.STS, prefill, scale, NS, subresource="scale")
        await settled(k8s, controller)
        await s.until(k8s, lambda: len(controller.pods[prefill]) == 4, "the HPA's 4 pods", 60)
        old = controller.baseline = dict(controller.revisions)
        new = externally_scaled(doc("ghcr.io/disagg/runtime:0.2.0"))
        await s.call(k8s.patch, s.PIPELINES, NAME, {"spec": new["spec"]}, NS)
        await s.until(
            k8s,
            lambda: any(0 < f["prefill"] < 1 for f in controller.seen[-1:]),
            "the rollout under way",
            60,
        )
        scale = {"spec": {"replicas": replicas}}
        await s.call(k8s.patch, s.STS, prefill, scale, NS, subresource="scale")
        await s.until(
            k8s, lambda: len(controller.pods[prefill]) == replicas, "the HPA's new size", 60
        )
        await s.until(k8s, lambda: all_at_new_revision(controller, old), "every pod updated", 120)
        await s.until(k8s, lambda: rollout_phase(k8s) == "Complete", "Complete", 30)
        sts = k8s.get(s.STS, prefill, NS) or {}
        assert sts["spec"]["replicas"] == replicas, "the autoscaler's count, kept"
        assert sts["spec"]["updateStrategy"]["rollingUpdate"]["partition"] == 0
