"""Trust between roles, the operator's half, against the emulator with the real CRD and kopf:
the peer key Secret (created once, kept across reconciles and restarts, recreated with a new
key when deleted, which rolls the role pods), the NetworkPolicy (present by default, pruned
when turned off, back when deleted by hand), and the policy on pods (a privileged podTemplate
is Invalid with its field path; with the opt-in annotation it renders, with a Warning)."""

from __future__ import annotations

import base64
import re
from typing import Any

import kubernetes_validate
import pytest

from disagg_operator import names
from disagg_operator.plan import manifests, model, pods
from disagg_operator.reconcile import events as reconcile_events
from tests.integration import operator_support as s
from tests.k8s.server import EmulatorThread

pytestmark = pytest.mark.asyncio
NAME = "text-to-video"
NS = s.NS
SECRETS = "v1/secrets"
POLICIES = "networking.k8s.io/v1/networkpolicies"
UNITS = ("encoder", "denoiser", "decoder")


def secret(k8s: EmulatorThread) -> dict[str, Any]:
    return k8s.get(SECRETS, f"{NAME}-peer-key", NS) or {}


def key_hashes(k8s: EmulatorThread) -> set[str]:
    """The peer-key-hash annotation of every role pod template."""
    found = set()
    for unit in UNITS:
        sts = k8s.get(s.STS, f"{NAME}-{unit}", NS) or {}
        annotations = sts["spec"]["template"]["metadata"]["annotations"]
        found.add(annotations.get(names.ANNOTATION_PEER_KEY_HASH, ""))
    return found


CHILDREN = s.planned_children(s.example())  # the NetworkPolicy is counted apart


async def started(k8s: EmulatorThread, doc: dict[str, Any] | None = None) -> dict[str, Any]:
    obj = await s.call(k8s.create, doc or s.example(), NS)
    await s.until(k8s, lambda: len(s.children(k8s, NAME)) == CHILDREN, "the children")
    return obj


async def test_the_peer_key_secret_is_made_once_and_rotated_by_deleting_it(
    k8s_crd: EmulatorThread,
):
    k8s = k8s_crd
    async with s.running_operator(k8s):
        pipeline = await started(k8s)
        stored = await s.until(k8s, lambda: secret(k8s), "the peer key Secret")
        assert stored["type"] == "Opaque"
        key = base64.b64decode(stored["data"][pods.PEER_KEY_KEY]).decode()
        assert re.fullmatch("[0-9a-f]{64}", key)  # 32 random bytes, hex
        assert stored["metadata"]["ownerReferences"] == [model.Owner.of(pipeline).reference()]
        assert key_hashes(k8s) == {manifests.peer_key_digest(key)}
        kubernetes_validate.validate(stored, kubernetes_validate.utils.latest_version(), True)

        # every role container mounts it read-only, and is told where
        for unit in UNITS:
            pod = (k8s.get(s.STS, f"{NAME}-{unit}", NS) or {})["spec"]["template"]["spec"]
            volume = next(v for v in pod["volumes"] if v["name"] == pods.PEER_KEY_VOLUME)
            assert volume["secret"]["secretName"] == f"{NAME}-peer-key"
            assert volume["secret"]["defaultMode"] == 0o440
            assert pod["securityContext"]["fsGroup"] == pods.NONROOT_ID
            (container,) = pod["containers"]
            mount = next(m for m in container["volumeMounts"] if m["name"] == "peer-key")
            assert (mount["mountPath"], mount["readOnly"]) == ("/etc/disagg-peer-key", True)
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["DISAGG_PEER_KEY_FILE"] == "/etc/disagg-peer-key/key"

        # an edit reconciles again: the key stays, untouched
        version = stored["metadata"]["resourceVersion"]
        patch = [{"op": "replace", "path": "/spec/roles/1/replicas", "value": 3}]
        await s.call(k8s.patch, s.PIPELINES, NAME, patch, NS, patch_type="json")
        await s.until(
            k8s,
            lambda: (k8s.get(s.STS, f"{NAME}-denoiser", NS) or {})["spec"]["replicas"] == 3,
            "three denoisers",
        )
        assert secret(k8s)["metadata"]["resourceVersion"] == version

    # a restarted operator resumes with the same key
    async with s.running_operator(k8s) as operator:
        await s.until(k8s, lambda: operator.reconciler.states, "the resume")
        await s.until(
            k8s, lambda: s.pipeline_status(k8s, NAME).get("observedGeneration") == 2, "resumed"
        )
        assert secret(k8s)["metadata"]["resourceVersion"] == version
        assert key_hashes(k8s) == {manifests.peer_key_digest(key)}

        # deleting the Secret rotates the key: a new one, and every role pod rolls onto it
        await s.call(k8s.delete, SECRETS, f"{NAME}-peer-key", NS)

        def renewed_secret() -> dict[str, Any] | None:
            current = secret(k8s)
            fresh = current.get("metadata", {}).get("resourceVersion") not in (None, version)
            return current if fresh else None

        renewed = await s.until(k8s, renewed_secret, "a new peer key Secret")
        assert renewed is not None
        new_key = base64.b64decode(renewed["data"][pods.PEER_KEY_KEY]).decode()
        assert new_key != key and re.fullmatch("[0-9a-f]{64}", new_key)
        await s.until(
            k8s,
            lambda: key_hashes(k8s) == {manifests.peer_key_digest(new_key)},
            "the role pods rolled onto the new key",
        )


async def test_the_network_policy_follows_the_spec(k8s_crd: EmulatorThread):
    k8s = k8s_crd
    async with s.running_operator(k8s):
        await started(k8s)
        policy = await s.until(k8s, lambda: k8s.get(POLICIES, f"{NAME}-network", NS), "policy")
        assert policy is not None
        kubernetes_validate.validate(policy, kubernetes_validate.utils.latest_version(), True)
        assert policy["spec"]["podSelector"] == manifests.role_selector(NAME)
        runtime, metrics = policy["spec"]["ingress"]
        assert {p["port"] for p in runtime["ports"]} == {7400, 7500}
        assert {p["port"] for p in metrics["ports"]} == {9400}
        gateway = {"podSelector": manifests.gateway_selector(NAME)}
        assert gateway in runtime["from"]

        # turned off: pruned; on again: back
        off = [{"op": "add", "path": "/spec/networkPolicy", "value": {"enabled": False}}]
        await s.call(k8s.patch, s.PIPELINES, NAME, off, NS, patch_type="json")
        await s.until(k8s, lambda: not s.guards(k8s, NAME, "NetworkPolicy"), "policy pruned")
        assert len(s.children(k8s, NAME)) == CHILDREN  # nothing else moved
        on = [{"op": "replace", "path": "/spec/networkPolicy/enabled", "value": True}]
        await s.call(k8s.patch, s.PIPELINES, NAME, on, NS, patch_type="json")
        await s.until(k8s, lambda: s.guards(k8s, NAME, "NetworkPolicy"), "policy back")

        # deleted by hand: it comes back (the ports must not stay open)
        await s.call(k8s.delete, POLICIES, f"{NAME}-network", NS)
        await s.until(k8s, lambda: s.guards(k8s, NAME, "NetworkPolicy"), "policy restored")


def _privileged(doc: dict[str, Any]) -> dict[str, Any]:
    doc["spec"]["roles"][1]["podTemplate"] = {
        "spec": {
            "hostNetwork": True,
            "containers": [{"name": "denoiser", "securityContext": {"privileged": True}}],
        }
    }
    return doc


async def test_a_privileged_pod_template_needs_the_opt_in(k8s_crd: EmulatorThread):
    k8s = k8s_crd
    events: list[tuple[str, str, str]] = []
    async with s.running_operator(k8s, events=events):
        await s.call(k8s.create, _privileged(s.example()), NS)
        await s.until(
            k8s, lambda: s.pipeline_status(k8s, NAME).get("phase") == "Invalid", "Invalid"
        )
        problems = s.pipeline_status(k8s, NAME)["problems"]
        assert any(p.startswith("spec.roles[1].podTemplate.spec.hostNetwork:") for p in problems)
        path = "spec.roles[1].podTemplate.spec.containers[0].securityContext.privileged:"
        assert any(p.startswith(path) for p in problems)
        assert s.children(k8s, NAME) == {} and not secret(k8s)  # nothing made

        opt_in = [
            {
                "op": "add",
                "path": "/metadata/annotations",
                "value": {names.ANNOTATION_ALLOW_PRIVILEGED_PODS: "true"},
            }
        ]
        await s.call(k8s.patch, s.PIPELINES, NAME, opt_in, NS, patch_type="json")
        await s.until(k8s, lambda: len(s.children(k8s, NAME)) == CHILDREN, "rendered")
        sts = k8s.get(s.STS, f"{NAME}-denoiser", NS) or {}
        pod = sts["spec"]["template"]["spec"]
        assert pod["hostNetwork"] is True
        assert pod["containers"][0]["securityContext"]["privileged"] is True
        await s.until(
            k8s,
            lambda: [e for e in events if e[1] == reconcile_events.EVENT_PRIVILEGED],
            "a Warning",
        )
        warnings = [e for e in events if e[1] == reconcile_events.EVENT_PRIVILEGED]
        assert len(warnings) == 1 and warnings[0][0] == "Warning"
        assert "spec.roles[1].podTemplate.spec.hostNetwork" in warnings[0][2]
