"""The images, built and run (not read): both build with docker/build.sh; `disagg --version`
runs in each as the image's own user with a read-only root; the operator image has no
torch; the runtime image runs a pipeline's roles that serve requests (`disagg up` of a
sample, read-only root, /tmp and /dev/shm as a pod gets them). Sizes go to the terminal
summary against the budgets (conftest). Skipped, saying why, without an engine or a base."""

from __future__ import annotations

import json
import secrets

import pytest

from tests.images import engine

pytestmark = pytest.mark.timeout(900)
IMAGES = sorted(engine.BUDGETS_MB)


def run(built: engine.Built, image: str, *args: str, timeout: float = 120) -> str:
    name = f"disagg-test-{secrets.token_hex(3)}"
    try:
        return built.engine.run(
            "run", "--rm", "--name", name, "--read-only", *args, timeout=timeout
        )
    finally:
        built.engine.run("rm", "-f", "-i", name, check=False, timeout=60)


@pytest.mark.parametrize("image", IMAGES)
def test_image_built_with_its_tag_user_and_entrypoint(built: engine.Built, image: str) -> None:
    config = built.engine.inspect(engine.tag(image))["Config"]
    assert config["User"] == "65532:65532"
    assert config["Entrypoint"] == ["disagg", "operator" if image == "operator" else "role"]
    assert built.sizes_mb[image] > 0


@pytest.mark.parametrize("image", IMAGES)
def test_version_runs_as_the_image_user_with_a_read_only_root(
    built: engine.Built, image: str
) -> None:
    tag = engine.tag(image)
    out = run(built, image, "--entrypoint", "disagg", tag, "--version")
    assert out.strip() == f"disagg {engine.version()}"
    ids = run(built, image, "--entrypoint", "id", tag, "-u")
    assert ids.strip() == "65532"


def test_operator_image_has_no_torch(built: engine.Built) -> None:
    probe = "import importlib.util as u; print(*(not u.find_spec(m) for m in ('torch', 'kopf')))"
    out = run(built, "operator", "--entrypoint", "python", engine.tag("operator"), "-c", probe)
    assert out.split() == ["True", "False"]
    helped = run(built, "operator", engine.tag("operator"), "--help")
    assert "--namespace" in helped or "usage" in helped


def test_runtime_image_roles_serve_requests(built: engine.Built) -> None:
    examples = engine.REPO / "examples"
    out = run(
        built,
        "runtime",
        "--tmpfs",
        "/tmp:rw,mode=1777",
        "--shm-size",
        "1g",
        "-v",
        f"{examples}:/examples:ro",
        "--entrypoint",
        "disagg",
        engine.tag("runtime"),
        "up",
        "/examples/fan-out.yaml",
        "--requests",
        "8",
        "--json",
        timeout=600,
    )
    summary = json.loads(out[out.index("{") :])
    assert summary["completed"] == 8 and summary["failed"] == 0, summary
