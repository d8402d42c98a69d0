"""manifests/samples mirror examples/; the operator's pure modules never import torch and
take from the runtime only its torch-free spec, quantity and contract modules."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from typing import Any

SAMPLES = ("fan-out.yaml", "llm-prefill-decode.yaml", "text-to-video.yaml")
OPERATOR_MODULES = ("crd", "merge", "names", "planner", "pods", "render", "status")
ALLOWED_RUNTIME = {"disagg_runtime", "disagg_core.contract", "disagg_core.quantity"}


def test_samples_are_the_examples(repo: pathlib.Path) -> None:
    samples = repo / "manifests" / "samples"
    assert {p.name for p in samples.glob("*.yaml")} >= set(SAMPLES)
    for sample in samples.glob("*.yaml"):
        assert sample.read_text() == (repo / "examples" / sample.name).read_text(), sample.name


def test_samples_are_valid_custom_resources(repo: pathlib.Path, crd_checker: Any) -> None:
    for sample in (repo / "manifests" / "samples").glob("*.yaml"):
        doc = yaml_load(sample)
        assert crd_checker.errors(doc) == [], sample.name


def yaml_load(path: pathlib.Path) -> Any:
    import yaml

    return yaml.safe_load(path.read_text())


def test_operator_modules_do_not_import_torch() -> None:
    imports = "; ".join(f"import disagg_operator.{name}" for name in OPERATOR_MODULES)
    code = (
        f"import sys, json; {imports}; "
        "print(json.dumps(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('torch', 'numpy', 'zmq', 'disagg_runtime', 'kopf'))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    loaded = json.loads(result.stdout)
    assert not [m for m in loaded if m.split(".")[0] in ("torch", "numpy", "zmq", "kopf")]
    runtime = {m for m in loaded if m.startswith("disagg_runtime")}
    outside = {m for m in runtime - ALLOWED_RUNTIME if not m.startswith("disagg_core.spec")}
    assert outside == set(), outside
