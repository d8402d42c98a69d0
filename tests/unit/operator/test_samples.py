"""manifests/samples mirror examples/ and are valid custom resources. (What the operator may
import is an import-linter contract: `make lint`.)"""

from __future__ import annotations

import pathlib
from typing import Any

SAMPLES = ("fan-out.yaml", "llm-prefill-decode.yaml", "text-to-video.yaml")


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
