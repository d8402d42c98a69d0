"""Every generated file of the repository and how it is made: `make generate` writes them
all, `make verify` (part of `make test`) fails naming each one that is stale.

    python -m disagg_operator.gen.generate [--root DIR]          # write them under DIR
    python -m disagg_operator.gen.generate --check [--root DIR]  # exit 1 when one is stale, or
                                                            # a CRD the API server refuses

This is the one list of generated files (`FILES`). The generators (`crd`, `install`,
`docgen`) are given what they read from the repository (the chart, the example pipeline), so
that none depends on where its own source lies; only this module knows the repository's
layout, relative to --root (default: the current directory). Files are made in `FILES`
order: the chart's copy of the CRD is written before manifests/install.yaml renders the chart.
--check also holds every CRD file (as checked in, and as generated) to the API server's rules
for CRD schemas (`crdschema.structural`: structural schema, metadata, list types, defaults,
CEL compilation and cost) and names each refusal in the server's words.

A development tool: it needs the `test` extra (helm-python-sdk, through `install`).
"""

from __future__ import annotations

import argparse
import difflib
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Final

import yaml

from disagg_operator.gen import crd, docgen, install
from disagg_operator.gen.crdschema import structural

CHART: Final = "charts/disagg-operator"
EXAMPLE: Final = "examples/text-to-video.yaml"  # the example docs/contract.md shows
CRD_FILE: Final = "disagg.dev_disaggregatedpipelines.yaml"
DIFF_LINES: Final = 40  # of each stale file's diff shown by --check
Generator = Callable[[pathlib.Path], str]


def _crd(root: pathlib.Path) -> str:
    return crd.render()


def _install(root: pathlib.Path) -> str:
    return install.install_yaml(root / CHART)


def _reference(root: pathlib.Path) -> str:
    return docgen.reference()


def _contract(root: pathlib.Path) -> str:
    return docgen.contract(root / EXAMPLE, shown_as=EXAMPLE)


FILES: Final[tuple[tuple[str, Generator], ...]] = (
    (f"crds/{CRD_FILE}", _crd),
    (f"{CHART}/crds/{CRD_FILE}", _crd),
    ("manifests/install.yaml", _install),
    ("docs/reference.md", _reference),
    ("docs/contract.md", _contract),
)


def _read(path: pathlib.Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def generate(root: pathlib.Path) -> list[str]:
    """Writes every generated file under `root` whose text changed; returns their paths."""
    written: list[str] = []
    for name, make in FILES:
        path = root / name
        text = make(root)
        if _read(path) != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            written.append(name)
    return written


def stale(root: pathlib.Path) -> dict[str, str]:
    """The generated files under `root` that differ from what `generate` makes now, each with
    a unified diff (checked-in -> generated)."""
    found: dict[str, str] = {}
    for name, make in FILES:
        current, wanted = _read(root / name), make(root)
        if current != wanted:
            diff = difflib.unified_diff(
                (current or "").splitlines(keepends=True),
                wanted.splitlines(keepends=True),
                f"{name} (checked in)" if current is not None else f"{name} (missing)",
                f"{name} (generated)",
            )
            found[name] = "".join(diff)
    return found


def refused(root: pathlib.Path) -> dict[str, str]:
    """The CRD files under `root` (as checked in, else as generated) that the API server would
    refuse, each with its message (`CustomResourceDefinition.apiextensions.k8s.io "..." is
    invalid: ...`)."""
    found: dict[str, str] = {}
    for name, make in FILES:
        if not name.endswith(CRD_FILE):
            continue
        for text in dict.fromkeys((_read(root / name), make(root))):
            if text is None:
                continue
            doc = yaml.safe_load(text)
            problems = structural.check(doc) if isinstance(doc, dict) else []
            if problems:
                found.setdefault(name, structural.message(doc, problems))
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m disagg_operator.gen.generate", description="write every generated file"
    )
    parser.add_argument("--root", type=pathlib.Path, default=pathlib.Path("."), help="repository")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    if not args.check:
        for name in generate(args.root):
            print(f"wrote {name}")
        return 0
    found = stale(args.root)
    for diff in found.values():
        lines = diff.splitlines(keepends=True)
        more = f"... ({len(lines) - DIFF_LINES} more lines)\n" if len(lines) > DIFF_LINES else ""
        sys.stderr.write("".join(lines[:DIFF_LINES]) + more)
    if found:
        sys.stderr.write(f"stale generated files: {', '.join(found)}; run `make generate`\n")
    refusals = refused(args.root)
    for name, text in refusals.items():
        sys.stderr.write(f"{name}: the API server refuses it: {text}\n")
    if found or refusals:
        return 1
    print(f"{len(FILES)} generated files are current")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
