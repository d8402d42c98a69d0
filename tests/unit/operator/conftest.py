"""Shared fixtures: the repository's pipelines, and a checker that validates a custom resource
the way the API server would against the CRD: structural defaults, the OpenAPI schema
(converted to JSON Schema; unknown fields rejected, as with strict field validation),
list-map key uniqueness and the CEL rules (evaluated with cel-python)."""

from __future__ import annotations

import copy
import pathlib
from collections.abc import Callable
from typing import Any

import celpy
import jsonschema
import pytest
import yaml
from celpy.adapter import json_to_cel
from celpy.celtypes import BoolType
from celpy.evaluation import CELEvalError

from tests.support import REPO

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
CRD_FILE = REPO / "crds" / "disagg.dev_disaggregatedpipelines.yaml"
FULL_FILE = pathlib.Path(__file__).with_name("full-pipeline.yaml")
Schema = dict[str, Any]

_COPIED = (
    "type", "enum", "pattern", "minLength", "maxLength", "minItems", "maxItems", "minimum",
    "maximum", "required", "minProperties",
)  # fmt: skip


def to_json_schema(schema: Schema) -> Schema:
    """An OpenAPI v3 structural schema as JSON Schema (draft 2020-12)."""
    out: Schema = {key: schema[key] for key in _COPIED if key in schema}
    if schema.get("exclusiveMinimum"):
        out["exclusiveMinimum"] = out.pop("minimum")
    if schema.get("exclusiveMaximum"):
        out["exclusiveMaximum"] = out.pop("maximum")
    if "properties" in schema:
        out["properties"] = {k: to_json_schema(v) for k, v in schema["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = to_json_schema(schema["additionalProperties"])
    if "items" in schema:
        out["items"] = to_json_schema(schema["items"])
    if "anyOf" in schema:
        out["anyOf"] = [to_json_schema(branch) for branch in schema["anyOf"]]
    if schema.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    return out


def apply_defaults(schema: Schema, value: Any) -> Any:
    """`value` with the schema's defaults filled in, as the API server stores it."""
    if isinstance(value, dict):
        result = dict(value)
        properties = schema.get("properties", {})
        for key, sub in properties.items():
            if key not in result and "default" in sub:
                result[key] = copy.deepcopy(sub["default"])
        extra = schema.get("additionalProperties")
        for key in result:
            sub = properties.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                result[key] = apply_defaults(sub, result[key])
        return result
    if isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], item) for item in value]
    return value


class CrdChecker:
    """Validates custom resources against one CRD version's openAPIV3Schema."""

    def __init__(self, crd: Schema) -> None:
        self.crd = crd
        self.schema: Schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        converted = to_json_schema(self.schema)
        # The schema may restrict metadata.name; the other metadata fields are ObjectMeta's.
        converted["properties"]["metadata"].pop("additionalProperties", None)
        self.validator = jsonschema.Draft202012Validator(converted)
        self.cel = celpy.Environment()
        self._programs: dict[str, Any] = {}

    def defaulted(self, doc: Any) -> Any:
        return apply_defaults(self.schema, doc)

    def errors(self, doc: Any) -> list[str]:
        """Every reason the API server would reject `doc` (empty: accepted)."""
        doc = self.defaulted(doc)
        errors = [
            f"{_json_path(error.absolute_path)}: {error.message}"
            for error in self.validator.iter_errors(doc)
        ]
        if errors:
            return errors  # CEL runs on well-typed values only
        self._walk(self.schema, doc, "", errors)
        return errors

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
        if rule not in self._programs:
            self._programs[rule] = self.cel.program(self.cel.compile(rule))
        return self._programs[rule]

    def _walk(self, schema: Schema, value: Any, path: str, errors: list[str]) -> None:
        for rule in schema.get("x-kubernetes-validations", []):
            try:
                result = self.program(rule["rule"]).evaluate({"self": json_to_cel(value)})
            except CELEvalError as error:
                result = error
            if not (isinstance(result, BoolType) and bool(result)):
                errors.append(f"{path}{rule.get('fieldPath', '')}: {rule['message']}")
        if isinstance(value, dict):
            extra = schema.get("additionalProperties")
            for key, item in value.items():
                sub = schema.get("properties", {}).get(
                    key, extra if isinstance(extra, dict) else None
                )
                if sub is not None:
                    self._walk(sub, item, f"{path}.{key}" if path else key, errors)
        elif isinstance(value, list) and "items" in schema:
            if schema.get("x-kubernetes-list-type") == "map":
                keys = schema["x-kubernetes-list-map-keys"]
                seen = [tuple(item.get(k) for k in keys) for item in value]
                for index, key in enumerate(seen):
                    if key in seen[:index]:
                        duplicate = dict(zip(keys, key, strict=True))
                        errors.append(f"{path}[{index}]: Duplicate value: {duplicate}")
            for index, item in enumerate(value):
                self._walk(schema["items"], item, f"{path}[{index}]", errors)


def _json_path(parts: Any) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "<root>"


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
