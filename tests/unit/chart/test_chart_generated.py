"""Files made from other files stay equal to what their generators make now, and documents
that describe code cover all of it: manifests/install.yaml (the chart with its defaults),
the chart's crds/ (the repository's crds/), docs/reference.md (the CRD schema),
docs/contract.md (contract.py's docstring), docs/troubleshooting.md (every reason the
operator reports), the chart README's values table (values.yaml), and the Dockerfiles (the
chart's and the planner's commands, user and ports)."""

from __future__ import annotations

import ast
import filecmp
import json
import re
import tomllib
from typing import TYPE_CHECKING, Any

import kubernetes_validate
import pytest
import yaml

from disagg_core import contract
from disagg_operator import docgen, install, names, pods

if TYPE_CHECKING:
    from tests.unit.chart import chart_support as c
else:
    import chart_support as c

DOCS = c.REPO / "docs"
REGENERATE = "stale: regenerate it with `{}` (see README.md, Generated files)"
# Values documented as one row although they are maps.
VALUE_ROWS_WITHOUT_CHILDREN = {"resources", "probes.liveness", "probes.readiness"}


def test_the_chart_crds_are_the_repository_crds() -> None:
    top, chart = c.REPO / "crds", c.CHART / "crds"
    names_top = sorted(p.name for p in top.iterdir())
    assert names_top == sorted(p.name for p in chart.iterdir())
    _, mismatch, errors = filecmp.cmpfiles(top, chart, names_top, shallow=False)
    assert (mismatch, errors) == ([], []), "copy crds/ to charts/disagg-operator/crds/"


def test_install_yaml_is_the_chart_with_defaults() -> None:
    text = install.INSTALL_FILE.read_text()
    assert text == install.install_yaml(), REGENERATE.format(
        "python -m disagg_operator.install > manifests/install.yaml"
    )
    objects = [d for d in yaml.safe_load_all(text) if d]
    assert [o["kind"] for o in objects[:2]] == ["Namespace", "CustomResourceDefinition"]
    assert objects[2:] == install.render()
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    assert deployment["metadata"]["namespace"] == install.NAMESPACE
    for obj in objects:
        kubernetes_validate.validate(obj, kubernetes_validate.utils.latest_version(), strict=True)


def test_reference_is_generated_from_the_crd() -> None:
    text = (DOCS / "reference.md").read_text()
    assert text == docgen.reference(), REGENERATE.format(
        "python -m disagg_operator.docgen reference > docs/reference.md"
    )
    crd = yaml.safe_load((c.REPO / "crds" / "disagg.dev_disaggregatedpipelines.yaml").read_text())
    assert docgen.reference(crd) == text  # the checked-in CRD says the same


def test_reference_documents_every_field() -> None:
    text = (DOCS / "reference.md").read_text()
    root = install.crds()[0]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, schema in _objects("spec", root["properties"]["spec"]):
        assert f"### `{path}`" in text
        for field in schema.get("properties") or {}:
            assert re.search(rf"\| \[?`{re.escape(field)}`", text), f"{path}.{field}"


def _objects(path: str, schema: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    found = [(path, schema)]
    for suffix, sub in docgen.children(schema):
        found += _objects(path + suffix, dict(sub))
    return found


def test_contract_doc_is_generated_from_the_contract() -> None:
    text = (DOCS / "contract.md").read_text()
    assert text == docgen.contract(), REGENERATE.format(
        "python -m disagg_operator.docgen contract > docs/contract.md"
    )
    assert (contract.__doc__ or "").strip() in text
    documented = set(re.findall(r"^\| `(DISAGG_[A-Z_]+)` \|", text, re.M))
    assert documented == {var.name for var in contract.ENV}


def _constants(prefixes: tuple[str, ...]) -> dict[str, str]:
    """Module-level string constants named PREFIX... in operator/disagg_operator/*.py."""
    found: dict[str, str] = {}
    for path in sorted((c.REPO / "operator" / "disagg_operator").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            target: ast.expr | None = None
            if isinstance(node, ast.AnnAssign):
                target = node.target
            elif isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
            value = getattr(node, "value", None)
            if (
                isinstance(target, ast.Name)
                and target.id.startswith(prefixes)
                and isinstance(value, ast.Constant)
                and isinstance(value.value, str)
            ):
                found[f"{path.stem}.{target.id}"] = value.value
    return found


def test_troubleshooting_covers_every_reason() -> None:
    text = (DOCS / "troubleshooting.md").read_text()
    reasons = _constants(("REASON_", "EVENT_"))
    assert set(names.REASONS) <= set(reasons.values())
    missing = {k: v for k, v in reasons.items() if f"`{v}`" not in text}
    assert missing == {}
    for reason in names.REASONS:
        assert f"### `{reason}`" in text
    for word in (*names.PHASES, *names.CONDITION_TYPES):
        assert f"| `{word}` |" in text


def _rows(values: Any, prefix: str = "") -> dict[str, Any]:
    if (
        isinstance(values, dict)
        and values
        and prefix.rstrip(".") not in VALUE_ROWS_WITHOUT_CHILDREN
    ):
        rows: dict[str, Any] = {}
        for key, value in values.items():
            rows.update(_rows(value, f"{prefix}{key}."))
        return rows
    return {prefix.rstrip("."): values}


def test_the_chart_readme_documents_every_value() -> None:
    readme = (c.CHART / "README.md").read_text()
    documented = {
        key: yaml.safe_load(default)
        for key, default in re.findall(r"^\| `([\w.]+)` \| `(.*?)` \|", readme, re.MULTILINE)
    }
    defaults = _rows(yaml.safe_load((c.CHART / "values.yaml").read_text()))
    assert documented == defaults


def test_the_dockerfiles_run_what_the_chart_and_planner_expect() -> None:
    operator = (c.REPO / "docker" / "operator.Dockerfile").read_text()
    runtime = (c.REPO / "docker" / "runtime.Dockerfile").read_text()
    entry = re.compile(r"^ENTRYPOINT (\[.*\])$", re.MULTILINE)
    deployment = c.only(c.render(), "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert json.loads(entry.findall(operator)[-1]) == container["command"]
    assert json.loads(entry.findall(runtime)[-1]) == list(pods.DEFAULT_COMMAND)
    uid = deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    assert uid == pods.NONROOT_ID
    for text in (operator, runtime):
        assert f"USER {uid}:{uid}" in text
        assert f"--uid {uid} --gid {uid}" in text
        assert len(re.findall(r"^FROM ", text, re.MULTILINE)) == 1  # one stage, small
    assert "EXPOSE 8080 9090" in operator
    assert f"EXPOSE {contract.DEFAULT_INGRESS_PORT} {contract.DEFAULT_METRICS_PORT}" in runtime
    assert '"/src[operator]"' in operator
    assert "torch" not in "".join(re.findall(r"^RUN .*$", operator, re.MULTILINE))
    assert '"/src[runtime]"' in runtime
    makefile = (c.REPO / "Makefile").read_text()
    pin = re.search(r"^TORCH := torch==(\S+)$", makefile, re.MULTILINE)
    assert pin and f"ARG TORCH_VERSION={pin.group(1)}" in runtime
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in runtime


def test_the_operator_extra_has_no_torch() -> None:
    project = tomllib.loads((c.REPO / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["operator"]]
    assert not [d for d in wanted if d.lower().startswith(("torch", "numpy"))]


@pytest.mark.parametrize("dockerfile", ["operator", "runtime"])
def test_the_build_context_holds_what_the_dockerfile_copies(dockerfile: str) -> None:
    text = (c.REPO / "docker" / f"{dockerfile}.Dockerfile").read_text()
    ignore = (c.REPO / "docker" / f"{dockerfile}.Dockerfile.dockerignore").read_text()
    allowed = {line[1:].rstrip("/") for line in ignore.splitlines() if line.startswith("!")}
    copied = {
        source
        for line in text.splitlines()
        if line.startswith("COPY ") and "--from" not in line
        for source in line.split()[1:-1]
    }
    assert copied == allowed
    assert all((c.REPO / source).exists() for source in copied)
