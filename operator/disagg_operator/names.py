"""Names shared by the CRD, the planner and the status builder: API coordinates, labels,
annotations, phases, condition types and reasons. One place, so that they cannot drift."""

from __future__ import annotations

from typing import Final

from disagg_core.spec import ANNOTATION_ALLOW_PRIVILEGED, API_VERSION, KIND

GROUP: Final = "disagg.dev"
VERSION: Final = "v1alpha1"
PLURAL: Final = "disaggregatedpipelines"
SINGULAR: Final = "disaggregatedpipeline"
SHORT_NAMES: Final = ("dpipe",)
CATEGORIES: Final = ("disagg",)
CRD_NAME: Final = f"{PLURAL}.{GROUP}"
PIPELINE_API_VERSION: Final = API_VERSION
PIPELINE_KIND: Final = KIND

# Labels on every child object.
LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_INSTANCE: Final = "app.kubernetes.io/instance"
LABEL_COMPONENT: Final = "app.kubernetes.io/component"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
LABEL_PIPELINE: Final = f"{GROUP}/pipeline"
LABEL_ROLE: Final = f"{GROUP}/role"
LABEL_GROUP: Final = f"{GROUP}/group"
LABEL_NODE_RANK: Final = f"{GROUP}/node-rank"  # a member's place in its group (roles[].nodes)
# Well-known namespace label (set by the API server on every namespace since 1.21).
LABEL_NAMESPACE_NAME: Final = "kubernetes.io/metadata.name"
# The component label of a pipeline's gateway pods (issue "Front door"); the NetworkPolicy
# admits them with LABEL_PIPELINE.
COMPONENT_GATEWAY: Final = "gateway"
APP_NAME: Final = "disagg"
MANAGER: Final = "disagg-operator"

# Annotations. On the pipeline: how a colocation group gets its GPU (see planner).
ANNOTATION_GPU_MODE: Final = f"{GROUP}/gpu-mode"
ANNOTATION_GPU_DEVICE_CLASS: Final = f"{GROUP}/gpu-device-class"
# On pod templates: a hash of what the pods read from outside their template.
ANNOTATION_SPEC_HASH: Final = f"{GROUP}/spec-hash"
ANNOTATION_TEMPLATE_HASH: Final = f"{GROUP}/template-hash"  # on StatefulSets (rollout.py)
# On the pipeline: roles (or colocation groups) whose StatefulSet replicas someone else owns
# (an HPA, KEDA), comma-separated; the planner leaves their spec.replicas out.
ANNOTATION_EXTERNAL_SCALING: Final = f"{GROUP}/external-scaling"
# On the pipeline: "true" lets role podTemplates weaken the pods (disagg_core.spec.podpolicy).
ANNOTATION_ALLOW_PRIVILEGED_PODS: Final = ANNOTATION_ALLOW_PRIVILEGED
# On pod templates: a hash of the peer key, so a rotated key (a recreated Secret) rolls them.
ANNOTATION_PEER_KEY_HASH: Final = f"{GROUP}/peer-key-hash"

# Status.
PHASE_PENDING: Final = "Pending"
PHASE_PROGRESSING: Final = "Progressing"
PHASE_READY: Final = "Ready"
PHASE_DEGRADED: Final = "Degraded"
PHASE_INVALID: Final = "Invalid"
PHASES: Final = (PHASE_PENDING, PHASE_PROGRESSING, PHASE_READY, PHASE_DEGRADED, PHASE_INVALID)

CONDITION_READY: Final = "Ready"
CONDITION_PROGRESSING: Final = "Progressing"
CONDITION_DEGRADED: Final = "Degraded"
CONDITION_TYPES: Final = (CONDITION_READY, CONDITION_PROGRESSING, CONDITION_DEGRADED)

REASON_ALL_ROLES_READY: Final = "AllRolesReady"
REASON_ROLES_NOT_READY: Final = "RolesNotReady"
REASON_ROLLOUT_IN_PROGRESS: Final = "RolloutInProgress"
REASON_ROLLOUT_COMPLETE: Final = "RolloutComplete"
REASON_CHILD_MISSING: Final = "ChildMissing"
REASON_INVALID_SPEC: Final = "InvalidSpec"
REASON_PROGRESS_DEADLINE: Final = "ProgressDeadlineExceeded"
REASONS: Final = (
    REASON_ALL_ROLES_READY,
    REASON_ROLES_NOT_READY,
    REASON_ROLLOUT_IN_PROGRESS,
    REASON_ROLLOUT_COMPLETE,
    REASON_CHILD_MISSING,
    REASON_INVALID_SPEC,
    REASON_PROGRESS_DEADLINE,
)
