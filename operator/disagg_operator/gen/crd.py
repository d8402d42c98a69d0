"""The DisaggregatedPipeline CustomResourceDefinition, built from the spec module's names,
enums and defaults. The checked-in YAML (crds/ and the chart's copy) is generated from here
by `make generate`; `make verify` fails when it is stale (see `generate`).

What the schema checks: types, enums, formats (names, quantities, payload paths), ranges,
uniqueness (list-map keys: role names, env names, port names, edge from/to pairs; set:
a group's roles) and, through CEL rules, what relates fields: autoscaling min <= max, edges
and tensor references and groups naming declared roles, no self-loop, an entry role, a role
in at most one group, derived names within 52 characters, cuda-ipc only inside a group.
What only the operator's validator (`disagg_core.spec`) checks, reported in the status:
cycles, tensor references that do not lead downstream or overlap, pool size vs minimum block,
requests vs limits, equal replicas/autoscaling/ports inside a group, handler keywords.

Defaults are the spec module's; where the parser's default depends on other fields (a role's
`replicas` follows `autoscaling.minReplicas`, a group's `name` its first role) there is none,
so that the stored object means the same as the one written. List sizes and string lengths
are bounded (`MAX_*`) so that the API server can bound the cost of the CEL rules.
"""

from __future__ import annotations

from typing import Final

import yaml

from disagg_core.spec import model as m
from disagg_operator import names
from disagg_operator.gen import crd_kit, crd_spec, crd_status


def open_api_schema() -> crd_kit.Schema:
    """The openAPIV3Schema of the v1alpha1 version."""
    return crd_kit.object_schema(
        "A disaggregated inference pipeline: roles that pass tensors along edges, each role "
        "run by the operator as a StatefulSet with a headless Service.",
        {
            "apiVersion": crd_kit.string("API version of this object: " + m.API_VERSION + "."),
            "kind": crd_kit.string("Kind of this object: " + m.KIND + "."),
            # no description: the API server allows only name and generateName restricted here
            "metadata": {
                "type": "object",
                "properties": {
                    "name": crd_kit.string(
                        "Pipeline name: a DNS-1035 label of at most "
                        f"{m.MAX_PIPELINE_NAME_LENGTH} characters (role and group names are "
                        "appended to it).",
                        pattern=crd_kit.DNS_1035_LABEL,
                        maxLength=m.MAX_PIPELINE_NAME_LENGTH,
                    )
                },
            },
            "spec": crd_spec.spec_schema(),
            "status": crd_status.status_schema(),
        },
        required=("spec",),
        **{"x-kubernetes-validations": crd_spec.root_rules()},
    )


def printer_columns() -> list[crd_kit.Schema]:
    return [
        {
            "name": "Ready",
            "type": "string",
            "description": "Roles with all replicas ready, of all roles.",
            "jsonPath": ".status.readyRoles",
        },
        {
            "name": "Phase",
            "type": "string",
            "description": "Pending, Progressing, Ready, Degraded or Invalid.",
            "jsonPath": ".status.phase",
        },
        {
            "name": "Rollout",
            "type": "string",
            "description": "Rollout progress: phase and pods at the new revision.",
            "jsonPath": ".status.rollout.summary",
        },
        {
            "name": "URL",
            "type": "string",
            "description": "The gateway's in-cluster URL.",
            "jsonPath": ".status.gateway.url",
        },
        {
            "name": "Reason",
            "type": "string",
            "description": "Reason of the Ready condition.",
            "jsonPath": '.status.conditions[?(@.type=="Ready")].reason',
            "priority": 1,
        },
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def crd() -> crd_kit.Schema:
    """The CustomResourceDefinition object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": names.CRD_NAME,
            "labels": {names.LABEL_NAME: names.APP_NAME, names.LABEL_COMPONENT: "crd"},
        },
        "spec": {
            "group": names.GROUP,
            "names": {
                "kind": names.PIPELINE_KIND,
                "listKind": names.PIPELINE_KIND + "List",
                "plural": names.PLURAL,
                "singular": names.SINGULAR,
                "shortNames": list(names.SHORT_NAMES),
                "categories": list(names.CATEGORIES),
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": names.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": open_api_schema()},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": printer_columns(),
                }
            ],
        },
    }


HEADER: Final = (
    "# Generated by `make generate` from operator/disagg_operator/gen/crd.py; do not edit\n"
    "# (`make verify` fails when it is stale).\n"
)


def render() -> str:
    """The CRD file's text."""
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=100, allow_unicode=True)
