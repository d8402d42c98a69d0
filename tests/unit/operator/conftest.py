"""Shared fixtures: the repository's pipelines, and a checker that validates a custom resource
the way the API server would against the CRD (the emulator's admission: structural defaults,
the OpenAPI schema, unknown fields rejected as with strict field validation, list-map key
uniqueness and the CEL rules, evaluated with cel-python)."""

from __future__ import annotations

import copy
import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from disagg_operator.gen.crdschema import cel, values
from tests.k8s import admission
from tests.support import REPO

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
CRD_FILE = REPO / "crds" / "disagg.dev_disaggregatedpipelines.yaml"
FULL_FILE = pathlib.Path(__file__).with_name("full-pipeline.yaml")
ENGINE_FILE = pathlib.Path(__file__).with_name("full-engine-pipeline.yaml")
Schema = dict[str, Any]


class CrdChecker:
    """Validates custom resources against one CRD version's openAPIV3Schema, as the API
    server admits them (the emulator's admission: disagg_operator.gen.crdschema with Strict field
    validation, defaults, the OpenAPI schema, list-type uniqueness, the CEL rules)."""

    def __init__(self, crd: Schema) -> None:
        self.crd = crd
        self.schema: Schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]

    def defaulted(self, doc: Any) -> Any:
        return values.apply_defaults(copy.deepcopy(doc), self.schema)

    def errors(self, doc: Any) -> list[str]:
        """Every reason the API server would reject `doc` (empty: accepted)."""
        doc = copy.deepcopy(doc)
        unknown = values.prune(doc, self.schema, root=True)
        found = [f'{path}: unknown field "{path}"' for path in unknown]
        values.apply_defaults(doc, self.schema)
        meta = doc.get("metadata") or {}
        view = {**doc, "metadata": {k: meta[k] for k in ("name", "generateName") if k in meta}}
        found += [str(error) for error in values.validate(view, self.schema)]
        if found:
            return found  # CEL runs on well-typed values only
        return [str(error) for error in admission.rule_errors(view, self.schema)]

    def rules(self) -> list[tuple[str, str]]:
        """(location, rule) of every CEL rule in the schema."""
        found: list[tuple[str, str]] = []

        def visit(schema: Schema, where: str) -> None:
            found.extend(
                (where, rule["rule"]) for rule in schema.get("x-kubernetes-validations", [])
            )
            for key, sub in schema.get("properties", {}).items():
                visit(sub, f"{where}.{key}")
            if "items" in schema:
                visit(schema["items"], f"{where}[]")

        visit(self.schema, "")
        return found

    def program(self, rule: str) -> Any:
        return cel.compile_rule({"rule": rule}, None).program


def load(path: pathlib.Path) -> Any:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="session")
def crd_checker() -> CrdChecker:
    return CrdChecker(load(CRD_FILE))


@pytest.fixture(scope="session")
def full_doc_text() -> str:
    return FULL_FILE.read_text()


@pytest.fixture
def full_doc() -> dict[str, Any]:
    doc = load(FULL_FILE)
    assert isinstance(doc, dict)
    return doc


@pytest.fixture
def engine_doc() -> dict[str, Any]:
    """Every engine-role field (a pipeline runs engines or handlers, so not in full_doc)."""
    doc = load(ENGINE_FILE)
    assert isinstance(doc, dict)
    return doc


@pytest.fixture(scope="session")
def example_files() -> list[pathlib.Path]:
    return EXAMPLES


@pytest.fixture(scope="session")
def repo() -> pathlib.Path:
    return REPO


Loader = Callable[[pathlib.Path], Any]


@pytest.fixture(scope="session")
def load_yaml() -> Loader:
    return load
