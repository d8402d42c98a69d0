"""rollout_state.observe: a unit as its live StatefulSet shows it."""

from __future__ import annotations

from typing import Any

from disagg_operator import names
from disagg_operator.rollout import state as rollout_state


def sts(replicas: int | None, revision: str, **status: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"updateStrategy": {"rollingUpdate": {"partition": 0}}}
    if replicas is not None:
        spec["replicas"] = replicas
    return {
        "kind": "StatefulSet",
        "metadata": {
            "name": "p-prefill",
            "labels": {names.LABEL_ROLE: "prefill"},
            "annotations": {names.ANNOTATION_TEMPLATE_HASH: revision},
            "generation": 1,
        },
        "spec": spec,
        "status": status,
    }


def test_an_externally_scaled_unit_counts_its_live_replicas() -> None:
    """The plan of a unit an HPA scales has no replicas: the live count is the unit's size
    (taking the default of 1 made partitions negative once the HPA scaled it up)."""
    live = sts(6, "new", observedGeneration=1, updatedReplicas=2, readyReplicas=6)
    live["status"] |= {"currentRevision": "a", "updateRevision": "b"}
    unit = rollout_state.observe([sts(None, "new")], [live])["prefill"]
    assert unit.replicas == 6 and unit.target == 6


def test_a_planned_count_wins_over_the_live_one() -> None:
    live = sts(6, "new", observedGeneration=1, updatedReplicas=6, readyReplicas=6)
    assert rollout_state.observe([sts(4, "new")], [live])["prefill"].replicas == 4
