"""The API server's rules for CRD schemas (disagg_operator.gen.crdschema.structural), as `make
verify` applies them: the generated CRD passes; each rule's violation is refused in the real
server's words (k8s.io/apiextensions-apiserver), and `generate --check` fails on it."""

from __future__ import annotations

import copy
import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from disagg_operator.gen import crd, generate
from disagg_operator.gen.crdschema import structural

ROOT = "spec.validation.openAPIV3Schema"
Obj = dict[str, Any]


def _crd(schema: Obj) -> Obj:
    doc = crd.crd()
    doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"] = schema
    return doc


def _refusals(schema: Obj) -> list[str]:
    return [str(error) for error in structural.check(_crd(schema))]


def _obj(**properties: Obj) -> Obj:
    return {"type": "object", "properties": properties}


def test_the_generated_crd_is_accepted() -> None:
    assert structural.check(crd.crd()) == []


def _with(mutate: Callable[[Obj], None]) -> Obj:
    schema = copy.deepcopy(crd.open_api_schema())
    mutate(schema)
    return schema


CASES: list[tuple[str, Obj, str]] = [
    (
        "a description on metadata",
        _with(lambda s: s["properties"]["metadata"].update(description="Standard metadata.")),
        f"{ROOT}.properties[metadata]: Forbidden: must not specify anything other than name and "
        "generateName, but metadata is implicitly specified",
    ),
    (
        "metadata restricting labels",
        _obj(metadata={"type": "object", "properties": {"labels": {"type": "object"}}}),
        f"{ROOT}.properties[metadata]: Forbidden: must not specify anything other than name and "
        "generateName, but metadata is implicitly specified",
    ),
    (
        "a field without a type",
        _obj(spec={"description": "untyped"}),
        f"{ROOT}.properties[spec].type: Required value: must not be empty for specified object "
        "fields",
    ),
    (
        "array items without a type",
        _obj(spec={"type": "array", "items": {"description": "untyped"}}),
        f"{ROOT}.properties[spec].items.type: Required value: must not be empty for specified "
        "array items",
    ),
    (
        "an array without items",
        _obj(spec={"type": "array"}),
        f"{ROOT}.properties[spec].items: Required value: must be specified",
    ),
    (
        "a root that is not an object",
        {"type": "string"},
        f'{ROOT}.type: Invalid value: "string": must be object at the root',
    ),
    (
        "additionalProperties beside properties",
        _obj(
            spec={
                "type": "object",
                "properties": {"a": {"type": "string"}},
                "additionalProperties": {"type": "string"},
            }
        ),
        f"{ROOT}.properties[spec].additionalProperties: Forbidden: additionalProperties and "
        "properties are mutual exclusive",
    ),
    (
        "a type inside anyOf",
        _obj(spec={"type": "object", "anyOf": [{"type": "object"}, {"required": ["a"]}]}),
        f"{ROOT}.properties[spec].anyOf[0].type: Forbidden: must be empty to be structural",
    ),
    (
        "an invalid default",
        _obj(spec={"type": "integer", "minimum": 1, "default": 0}),
        f"{ROOT}.properties[spec].default: Invalid value: 0: {ROOT}.properties[spec].default in "
        "body should be greater than or equal to 1",
    ),
    (
        "a default of the wrong type",
        _obj(spec={"type": "integer", "default": "one"}),
        f'{ROOT}.properties[spec].default: Invalid value: "string": {ROOT}.properties[spec].'
        'default in body must be of type integer: "string"',
    ),
    (
        "a default with unknown fields",
        _obj(spec={"type": "object", "properties": {"a": {"type": "string"}}, "default": {"b": 1}}),
        f'{ROOT}.properties[spec].default: Invalid value: {{"b":1}}: must not have unknown fields',
    ),
    (
        "an unknown list type",
        _obj(spec={"type": "array", "items": {"type": "string"}, "x-kubernetes-list-type": "bag"}),
        f'{ROOT}.properties[spec].x-kubernetes-list-type: Unsupported value: "bag": supported '
        'values: "atomic", "set", "map"',
    ),
    (
        "a list type on an object",
        _obj(spec={"type": "object", "x-kubernetes-list-type": "atomic"}),
        f'{ROOT}.properties[spec].type: Invalid value: "object": must be array if '
        "x-kubernetes-list-type is specified",
    ),
    (
        "a map list without keys",
        _obj(
            spec={
                "type": "array",
                "items": _obj(name={"type": "string"}),
                "x-kubernetes-list-type": "map",
            }
        ),
        f"{ROOT}.properties[spec].x-kubernetes-list-map-keys: Required value: must not be empty "
        "if x-kubernetes-list-type is map",
    ),
    (
        "map keys on a list that is not a map",
        _obj(
            spec={
                "type": "array",
                "items": _obj(name={"type": "string"}),
                "x-kubernetes-list-map-keys": ["name"],
            }
        ),
        f"{ROOT}.properties[spec].x-kubernetes-list-map-keys: Forbidden: must be empty if "
        "x-kubernetes-list-type is not map",
    ),
    (
        "a map key that is no property",
        _obj(
            spec={
                "type": "array",
                "items": {**_obj(name={"type": "string"}), "required": ["name"]},
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["id"],
            }
        ),
        f'{ROOT}.properties[spec].x-kubernetes-list-map-keys: Invalid value: ["id"]: entries '
        "must all be names of item properties",
    ),
    (
        "a map key neither required nor defaulted",
        _obj(
            spec={
                "type": "array",
                "items": _obj(name={"type": "string"}),
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["name"],
            }
        ),
        f"{ROOT}.properties[spec].items.properties[name]: Required value: all map keys must be "
        "required or have a default value",
    ),
    (
        "a CEL rule that does not compile",
        _obj(
            spec={
                **_obj(a={"type": "string"}),
                "x-kubernetes-validations": [{"rule": "self.a ==", "message": "m"}],
            }
        ),
        f'{ROOT}.properties[spec].x-kubernetes-validations[0].rule: Invalid value: "self.a ==": '
        "compilation failed: ERROR: <input>: Syntax error:",
    ),
    (
        "a CEL rule naming an undeclared field",
        _obj(
            spec={
                **_obj(a={"type": "string"}),
                "x-kubernetes-validations": [{"rule": "self.b == 'x'"}],
            }
        ),
        f'{ROOT}.properties[spec].x-kubernetes-validations[0].rule: Invalid value: "self.b == '
        "'x'\": compilation failed: ERROR: <input>: undefined field 'b'",
    ),
    (
        "a CEL rule iterating unbounded lists",
        _obj(
            spec={
                **_obj(
                    xs={"type": "array", "items": {"type": "string"}},
                    ys={"type": "array", "items": {"type": "string"}},
                ),
                "x-kubernetes-validations": [
                    {"rule": "self.xs.all(x, self.ys.exists(y, y.contains(x)))"}
                ],
            }
        ),
        f"{ROOT}.properties[spec].x-kubernetes-validations[0].rule: Forbidden: estimated rule "
        "cost exceeds budget by factor of",
    ),
]


@pytest.mark.parametrize(("schema", "refusal"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_rule_is_refused_in_the_servers_words(schema: Obj, refusal: str) -> None:
    found = _refusals(schema)
    assert any(text.startswith(refusal) for text in found), found


def test_bounded_lists_bring_the_cost_within_the_budget() -> None:
    bounded = {"type": "array", "maxItems": 64, "items": {"type": "string", "maxLength": 63}}
    schema = _obj(
        spec={
            **_obj(xs=bounded, ys=bounded),
            "x-kubernetes-validations": [
                {"rule": "self.xs.all(x, self.ys.exists(y, y.contains(x)))"}
            ],
        }
    )
    assert _refusals(schema) == []


def test_the_message_is_the_servers_422() -> None:
    doc = _crd(CASES[0][1])
    text = structural.message(doc, structural.check(doc))
    assert text == (
        'CustomResourceDefinition.apiextensions.k8s.io "disaggregatedpipelines.disagg.dev" is '
        f"invalid: {CASES[0][2]}"
    )


def test_make_verify_fails_on_a_crd_with_a_description_on_metadata(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """generate --check (make verify) on a tree whose generator puts a description on
    metadata: the CRD files are refused in the server's words, and the check fails."""
    real = crd.open_api_schema

    def described() -> Obj:
        schema = real()
        schema["properties"]["metadata"]["description"] = "Standard object metadata."
        return schema

    monkeypatch.setattr(crd, "open_api_schema", described)
    files = dict(generate.FILES)
    for name in ("crds/" + generate.CRD_FILE, f"{generate.CHART}/crds/{generate.CRD_FILE}"):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(files[name](tmp_path))
    assert generate.refused(tmp_path)
    monkeypatch.setattr(generate, "stale", lambda root: {})  # only the CRD rules here
    assert generate.main(["--check", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "the API server refuses it" in err
    assert "properties[metadata]: Forbidden: must not specify anything other than name" in err
    assert yaml.safe_load((tmp_path / "crds" / generate.CRD_FILE).read_text())
