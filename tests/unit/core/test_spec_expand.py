"""`${NAME:-default}` in pipeline files (spec/expand.py), as `disagg up` and validate read them."""

from __future__ import annotations

import pytest

from disagg_core import spec
from tests.support import EXAMPLES

TEXT = """
apiVersion: disagg.dev/v1alpha1
kind: DisaggregatedPipeline
metadata: {name: x}
spec:
  image: "${IMAGE:-registry.example/disagg:1}"
  roles:
    - name: a
      handler: pkg.mod:fn
      handlerArgs: {model: "${MODEL}", note: "$${MODEL} stays", both: "${A:-1}-${B:-2}"}
"""


def test_references_expand_from_the_environment_with_defaults() -> None:
    pipeline = spec.load_pipeline_text(TEXT, environ={"MODEL": "/m", "B": "9"})
    role = pipeline.role("a")
    assert dict(role.handler_args) == {"model": "/m", "note": "${MODEL} stays", "both": "1-9"}
    assert pipeline.image == "registry.example/disagg:1"


def test_an_empty_variable_takes_the_default() -> None:
    pipeline = spec.load_pipeline_text(TEXT, environ={"MODEL": "/m", "IMAGE": ""})
    assert pipeline.image == "registry.example/disagg:1"


def test_an_unset_variable_without_default_names_the_field() -> None:
    with pytest.raises(spec.SpecError) as caught:
        spec.load_pipeline_text(TEXT, environ={})
    [problem] = caught.value.problems
    assert problem.path == "spec.roles[0].handlerArgs.model"
    assert "${MODEL} is not set" in problem.reason


def test_a_value_is_one_string_never_yaml() -> None:
    pipeline = spec.load_pipeline_text(TEXT, environ={"MODEL": "{a: 1}\n- b"})
    assert pipeline.role("a").handler_args["model"] == "{a: 1}\n- b"


def test_without_environ_nothing_expands() -> None:
    pipeline = spec.load_pipeline_text(TEXT)
    assert pipeline.role("a").handler_args["model"] == "${MODEL}"


def test_the_examples_model_paths_follow_the_environment() -> None:
    llm = spec.load_pipeline_file(EXAMPLES / "hf-llm.yaml", environ={"DISAGG_TINY_LLM": "/x"})
    assert {r.handler_args["model"] for r in llm.roles} == {"/x"}
    default = spec.load_pipeline_file(EXAMPLES / "hf-llm.yaml", environ={})
    assert {r.handler_args["model"] for r in default.roles} == {"/tmp/disagg-tiny-llm"}
    pd = spec.load_pipeline_file(EXAMPLES / "vllm-pd.yaml", environ={"DISAGG_TINY_VLLM": "/v"})
    assert {r.engine.model for r in pd.roles if r.engine} == {"/v"}
