"""`disagg render`: the planner's objects as YAML, valid for Kubernetes 1.33 and the newest
schemas kubernetes-validate ships; invalid input reported like `disagg validate`."""

from __future__ import annotations

import io
import pathlib
from typing import Any

import kubernetes_validate
import pytest
import yaml

from disagg_core import spec
from disagg_operator.plan import model, planner, render
from disagg_runtime import cli

NEWEST = kubernetes_validate.utils.latest_version()
# resource.k8s.io/v1 (DRA GA) arrived in 1.34; 1.33 serves v1beta2 with the same shape.
VERSIONS = [
    ("1.33", model.PlanOptions(dra_api_version="resource.k8s.io/v1beta2")),
    (NEWEST, model.PlanOptions()),
]


def _render(path: pathlib.Path, *args: str, capsys: pytest.CaptureFixture[str]) -> Any:
    code = cli.main(["render", str(path), *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_render_prints_the_plan(
    example_files: list[pathlib.Path], capsys: pytest.CaptureFixture[str]
) -> None:
    for path in example_files:
        code, out, err = _render(path, "--namespace", "ml", capsys=capsys)
        assert (code, err) == (0, "")
        objects = list(yaml.safe_load_all(out))
        pipeline = spec.load_pipeline_file(path)
        assert objects == planner.plan(pipeline, namespace="ml")
        assert all("ownerReferences" not in o["metadata"] for o in objects)
        assert out.startswith("---\n") and "&id" not in out
        assert "topology.json: |" in out  # readable, not an escaped one-liner


def test_render_namespace_defaults(
    tmp_path: pathlib.Path, full_doc_text: str, capsys: pytest.CaptureFixture[str], repo: Any
) -> None:
    code, out, _ = _render(repo / "examples" / "fan-out.yaml", capsys=capsys)
    assert code == 0
    assert {o["metadata"]["namespace"] for o in yaml.safe_load_all(out)} == {"default"}
    path = tmp_path / "full.yaml"
    path.write_text(full_doc_text)
    code, out, _ = _render(path, capsys=capsys)
    assert {o["metadata"]["namespace"] for o in yaml.safe_load_all(out)} == {"media"}


@pytest.mark.parametrize(("version", "options"), VERSIONS, ids=[v for v, _ in VERSIONS])
def test_every_object_is_valid_kubernetes(
    example_files: list[pathlib.Path],
    full_doc: dict[str, Any],
    version: str,
    options: model.PlanOptions,
) -> None:
    pipelines = [spec.load_pipeline_file(path) for path in example_files]
    pipelines.append(spec.parse_pipeline(full_doc))
    seen_kinds = set()
    for pipeline in pipelines:
        owner = model.Owner(name=pipeline.name, uid="0b1e6f1c-0000-4000-8000-000000000000")
        for obj in planner.plan(pipeline, namespace="ml", owner=owner, options=options):
            kubernetes_validate.validate(obj, version, strict=True)
            seen_kinds.add(obj["kind"])
    assert seen_kinds == {
        "ConfigMap",
        "Service",
        "StatefulSet",
        "ResourceClaimTemplate",
        "NetworkPolicy",
        "Deployment",
    }


@pytest.mark.parametrize("mode", ["device-plugin", "none"])
def test_other_gpu_modes_are_valid_kubernetes(
    full_doc: dict[str, Any], mode: str, repo: Any
) -> None:
    full_doc["metadata"]["annotations"]["disagg.dev/gpu-mode"] = mode
    for obj in planner.plan(spec.parse_pipeline(full_doc), namespace="ml"):
        kubernetes_validate.validate(obj, NEWEST, strict=True)


def test_invalid_input_reports_like_validate(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "apiVersion: disagg.dev/v1alpha1\nkind: DisaggregatedPipeline\nmetadata: {name: p}\n"
        "spec:\n  roles:\n    - {name: a, handler: 'm:f', image: i}\n"
        "  edges:\n    - {from: a, to: b}\n"
    )
    code, out, err = _render(path, capsys=capsys)
    assert code == 1 and out == ""
    validate_out = io.StringIO()
    assert spec.validate_cli([str(path)], out=validate_out) == 1
    assert err == validate_out.getvalue()
    assert err == f"{path}: spec.edges[0].to: unknown role 'b'\n"


def test_planner_problems_are_reported_the_same_way(
    tmp_path: pathlib.Path, full_doc_text: str
) -> None:
    path = tmp_path / "ports.yaml"
    path.write_text(full_doc_text.replace("name: debug", "name: ingress"))
    out, err = io.StringIO(), io.StringIO()
    assert render.render_cli(str(path), namespace=None, out=out, err=err) == 1
    assert out.getvalue() == ""
    assert err.getvalue() == (
        f"{path}: spec.roles[0].ports[0].name: 'ingress' is reserved for the runtime's own port\n"
    )


def test_missing_file(capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path) -> None:
    code, out, err = _render(tmp_path / "nope.yaml", capsys=capsys)
    assert code == 1 and out == ""
    assert "cannot read the file" in err
