"""The image tests build both images once per run (docker/build.sh: cached layers, seconds
when `make images` or `.ci/run` built them already) and report their sizes against the
budgets in the terminal summary. Skipped, saying why, without a container engine or
without the base image (pulled by `make images` where a registry is reachable, made by
docker/local-base.sh where none is)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.images import engine

_built: list[engine.Built] = []


@pytest.fixture(scope="session")
def built() -> Iterator[engine.Built]:
    found = engine.find()
    if isinstance(found, str):
        pytest.skip(found)
    if not found.has(engine.BASE_IMAGE):
        pytest.skip(
            f"the base image {engine.BASE_IMAGE} is not in {found.name}'s storage: "
            "`make images` pulls it (docker/local-base.sh makes it where no registry is reachable)"
        )
    result = engine.build()
    _built.append(result)
    yield result


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for result in _built:
        terminalreporter.section("image sizes")
        for image, budget in engine.BUDGETS_MB.items():
            size = result.sizes_mb[image]
            verdict = "within budget" if size <= budget else "OVER BUDGET"
            terminalreporter.write_line(
                f"{engine.tag(image)}: {size} MB (budget {budget} MB, {verdict}; "
                f"{result.engine.name})"
            )
        terminalreporter.write_line(f"docker/build.sh (both images) took {result.seconds:.0f} s")
