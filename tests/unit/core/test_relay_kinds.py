"""The relay kinds' table in core: what `disagg validate` says about a relay whose package
is missing where it runs (it cannot see the roles' images, so it is a note, not an error)."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import pytest

from disagg_core import relays, spec

DOC = """\
apiVersion: disagg.dev/v1alpha1
kind: DisaggregatedPipeline
metadata: {name: p}
spec:
  image: img
  roles: [{name: a, handler: "m:f"}, {name: b, handler: "m:f"}]
  edges: [{from: a, to: b, relay: nixl}]
"""


def test_rdma_devices_are_recognised_by_name() -> None:
    assert relays.requests_rdma(["cpu", "rdma/hca_shared_devices_a"])
    assert relays.requests_rdma(["nvidia.com/RDMA_shared"])
    assert not relays.requests_rdma(["cpu", "memory", "nvidia.com/gpu"])


def test_validate_notes_a_relay_package_missing_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(DOC)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "nixl" else real(name)
    )
    out = io.StringIO()
    assert spec.validate_cli([str(path)], out=out) == 0  # valid: the images may have it
    assert out.getvalue().splitlines() == [
        f"{path}: ok",
        f"{path}: note: spec.edges[0].relay: relay nixl needs the nixl package in the roles' "
        "images (pip install 'disagg[nixl]'); it is not installed where this runs",
    ]


def test_validate_says_nothing_more_when_the_package_is_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(DOC)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    out = io.StringIO()
    assert spec.validate_cli([str(path)], out=out) == 0
    assert out.getvalue() == f"{path}: ok\n"
