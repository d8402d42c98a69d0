"""The operator's rollout series: each role's pods by state and the pipeline's phase, as
the status just built says; gone with the pipeline."""

from __future__ import annotations

from disagg_operator.reconcile.metrics import ROLLOUT_PHASES, Metrics


def test_role_replicas_and_one_phase_follow_the_status_and_go_with_the_pipeline() -> None:
    m = Metrics()
    roles = [
        {"name": "prefill", "desired": 4, "ready": 3, "updated": 2},
        {"name": "decode", "desired": 2, "ready": 2, "updated": 0},
    ]
    m.observed("ns", "p", roles, "Rolling")
    m.observed("ns", "other", roles[:1], "Complete")

    def replicas(pipeline: str, role: str, state: str) -> float | None:
        labels = {"pipeline_namespace": "ns", "pipeline": pipeline, "role": role, "state": state}
        return m.value("disagg_operator_role_replicas", labels)

    def phase(pipeline: str, name: str) -> float | None:
        labels = {"pipeline_namespace": "ns", "pipeline": pipeline, "phase": name}
        return m.value("disagg_operator_rollout_phase", labels)

    assert [replicas("p", "prefill", s) for s in ("desired", "ready", "updated")] == [4, 3, 2]
    assert replicas("p", "decode", "updated") == 0
    assert [phase("p", n) for n in ROLLOUT_PHASES] == [0, 1, 0, 0]
    m.observed("ns", "p", [{**roles[0], "updated": 4, "ready": 4}], "Complete")
    assert replicas("p", "prefill", "updated") == 4 and phase("p", "Complete") == 1
    assert phase("p", "Rolling") == 0
    m.forget("ns", "p")
    assert replicas("p", "prefill", "desired") is None and phase("p", "Complete") is None
    assert replicas("p", "decode", "desired") is None
    assert replicas("other", "prefill", "desired") == 4  # another pipeline's stay
    m.forget("ns", "never-seen")  # nothing to drop: no error
