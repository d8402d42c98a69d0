"""The CRD schema of `status`: phase, conditions, roles, rollout, the autoscaler's decisions."""

from __future__ import annotations

from typing import Final

from disagg_core import autoscale
from disagg_core.spec import limits
from disagg_operator import names
from disagg_operator.gen import crd_kit

MAX_CONDITIONS: Final = 8

MAX_SCALE_DECISIONS: Final = 50


def status_schema() -> crd_kit.Schema:
    count = {"minimum": 0, "format": "int32"}
    role = crd_kit.object_schema(
        "Replica counts of one role, from its StatefulSet.",
        {
            "name": crd_kit.string("Role name."),
            "workload": crd_kit.string("The StatefulSet that runs the role."),
            "desired": crd_kit.integer(
                "Replicas wanted (the StatefulSet's spec.replicas).", **count
            ),
            "current": crd_kit.integer("Replicas that exist.", **count),
            "ready": crd_kit.integer("Replicas that pass their readiness probe.", **count),
            "updated": crd_kit.integer("Replicas at the latest pod template.", **count),
        },
        required=("name",),
    )
    condition = crd_kit.object_schema(
        "A condition in the Kubernetes convention (metav1.Condition).",
        {
            "type": crd_kit.string(
                "Condition type: Ready, Progressing or Degraded.", maxLength=316
            ),
            "status": crd_kit.string("True, False or Unknown.", enum=["True", "False", "Unknown"]),
            "observedGeneration": crd_kit.integer(
                "The metadata.generation the condition was computed for.", minimum=0
            ),
            "lastTransitionTime": crd_kit.string(
                "When the status last changed.", format="date-time"
            ),
            "reason": crd_kit.string(
                "Why, in CamelCase: " + ", ".join(names.REASONS) + ".", maxLength=1024
            ),
            "message": crd_kit.string("Details for humans.", maxLength=32768),
        },
        required=("type", "status", "lastTransitionTime", "reason", "message"),
    )
    decision = crd_kit.object_schema(
        "One scaling decision of the autoscaler.",
        {
            "time": crd_kit.string("When it was made.", format="date-time"),
            "role": crd_kit.string("The role (or colocation group) scaled."),
            "fromReplicas": crd_kit.integer("Replicas before.", **count),
            "toReplicas": crd_kit.integer("Replicas after.", **count),
            "occupancy": crd_kit.number(
                "Mean pool occupancy (an engine role's KV cache usage) that led to it, in [0, 1]."
            ),
            "signal": crd_kit.string(
                "The signal that drove it: " + ", ".join(autoscale.SIGNALS) + ".",
                enum=list(autoscale.SIGNALS),
            ),
            "reason": crd_kit.string("Why, for humans."),
        },
        required=("time", "role", "fromReplicas", "toReplicas"),
    )
    return crd_kit.object_schema(
        "Observed state, written by the operator.",
        {
            "observedGeneration": crd_kit.integer(
                "The metadata.generation this status describes.", minimum=0
            ),
            "phase": crd_kit.string(
                "Summary: " + ", ".join(names.PHASES) + ".", enum=list(names.PHASES)
            ),
            "readyRoles": crd_kit.string(
                "Roles whose replicas are all ready, of all roles (e.g. 3/3); - when invalid."
            ),
            "roles": crd_kit.array(
                "Per role replica counts.",
                role,
                **{"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
            ),
            "gateway": crd_kit.object_schema(
                "The gateway's Deployment and where clients reach it.",
                {
                    "url": crd_kit.string(
                        "In-cluster URL: http://<pipeline>.<namespace>.svc:<port>."
                    ),
                    "desired": crd_kit.integer("Replicas wanted.", **count),
                    "ready": crd_kit.integer("Replicas that pass their readiness probe.", **count),
                    "warning": crd_kit.string(
                        "Set when the gateway takes requests without a token."
                    ),
                },
            ),
            "problems": crd_kit.array(
                "Why the spec is invalid ('<field path>: <reason>'); empty when valid.",
                {"type": "string", "description": "One problem."},
            ),
            "conditions": crd_kit.array(
                "Ready, Progressing and Degraded.",
                condition,
                maxItems=MAX_CONDITIONS,
                **{"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
            ),
            "scaleDecisions": crd_kit.array(
                "Recent scaling decisions, newest last.",
                decision,
                maxItems=MAX_SCALE_DECISIONS,
            ),
            "autoscaledReplicas": {
                "type": "object",
                "description": (
                    "Replicas the autoscaler set, by workload (role or colocation group): an "
                    "operator restart resumes from them instead of spec.roles[].replicas."
                ),
                "additionalProperties": crd_kit.integer("Replicas.", **count),
                "maxProperties": limits.MAX_ROLES,
            },
            "rollout": crd_kit.object_schema(
                "The coordinated rollout of a pod-template change (spec.rollout).",
                {
                    "phase": crd_kit.string(
                        "Rolling, Paused, Stalled (a step's pods not ready within "
                        "stepDeadlineSeconds) or Complete.",
                        enum=["Rolling", "Paused", "Stalled", "Complete"],
                    ),
                    "summary": crd_kit.string(
                        "Pods at the new revision, of the rolling workloads."
                    ),
                    "units": crd_kit.array(
                        "Per rolling workload (role or colocation group).",
                        crd_kit.object_schema(
                            "One workload's progress.",
                            {
                                "name": crd_kit.string("The role or colocation group."),
                                "replicas": crd_kit.integer("Its replicas.", **count),
                                "updated": crd_kit.integer("Pods at the new revision.", **count),
                                "ready": crd_kit.integer("Ready pods.", **count),
                                "target": crd_kit.integer(
                                    "Pods the current step lets run the new revision.", **count
                                ),
                            },
                        ),
                        maxItems=limits.MAX_ROLES,
                    ),
                    "stalled": crd_kit.array(
                        "Workloads whose step missed its deadline.",
                        crd_kit.string("A role or colocation group."),
                        maxItems=limits.MAX_ROLES,
                    ),
                },
            ),
        },
    )
