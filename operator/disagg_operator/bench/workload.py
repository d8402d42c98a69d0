"""What the bench creates: the pipeline documents (by default the text-to-video example) and
the children the operator should make for each (from the planner itself)."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any, Final

import yaml

from disagg_core import spec
from disagg_operator import names
from disagg_operator.plan import planner

Json = dict[str, Any]
Key = tuple[str, str]  # (kind, name) of a child
LABEL_RUN: Final = f"{names.GROUP}/bench-run"

# The spec of examples/text-to-video.yaml (the package does not ship examples/; the bench's
# integration test keeps the two equal).
TEXT_TO_VIDEO_SPEC: Final = """
image: ghcr.io/disagg/runtime:0.1.0
transport: {relay: auto, poolSize: 256Mi, minBlock: 1Mi, poolDevice: cpu, requestTimeoutSeconds: 60}
roles:
  - name: encoder
    handler: disagg_runtime.demo:encode_text
    replicas: 1
    concurrency: 4
    resources: {requests: {cpu: "1", memory: 2Gi}, limits: {memory: 4Gi}}
  - name: denoiser
    handler: disagg_runtime.demo:denoise
    replicas: 2
    concurrency: 2
    transport: {poolSize: 512Mi}
    autoscaling:
      minReplicas: 1
      maxReplicas: 4
      targetPoolOccupancy: 0.6
      scaleUpStabilizationSeconds: 0
      scaleDownStabilizationSeconds: 120
      tolerance: 0.1
    resources: {requests: {cpu: "2", memory: 4Gi}, limits: {memory: 8Gi}}
  - name: decoder
    handler: disagg_runtime.demo:decode_video
    replicas: 1
    concurrency: 4
    resources: {requests: {cpu: "1", memory: 2Gi}, limits: {memory: 4Gi}}
edges:
  - from: encoder
    to: denoiser
    tensorRefs: [{path: text_embedding, to: decoder}]
  - {from: denoiser, to: decoder}
ratioLocks:
  - {leader: denoiser, follower: decoder, leaderShare: 4, followerShare: 1, tolerance: 0.5}
"""


def text_to_video_spec() -> Json:
    """A fresh copy of the default pipeline's spec."""
    return dict(yaml.safe_load(TEXT_TO_VIDEO_SPEC))


def pipeline_doc(name: str, namespace: str, run: str, pipeline_spec: Mapping[str, Any]) -> Json:
    return {
        "apiVersion": names.PIPELINE_API_VERSION,
        "kind": names.PIPELINE_KIND,
        "metadata": {"name": name, "namespace": namespace, "labels": {LABEL_RUN: run}},
        "spec": copy.deepcopy(dict(pipeline_spec)),
    }


def expected_children(doc: Mapping[str, Any], namespace: str) -> frozenset[Key]:
    """(kind, name) of every object the operator plans for `doc` (raises SpecError)."""
    pipeline = spec.parse_pipeline(copy.deepcopy(dict(doc)))
    objects = planner.plan(pipeline, namespace=namespace)
    return frozenset((o["kind"], o["metadata"]["name"]) for o in objects)


def child_kinds(expected: Iterable[Key]) -> list[tuple[str, str]]:
    """(apiVersion, kind) to watch: the planner's kinds that the plan uses."""
    used = {kind for kind, _ in expected}
    return [(version, kind) for version, kind in planner.child_kinds() if kind in used]
