"""The observability files generated from the metric catalog: `make generate` writes them,
`make verify` fails naming each stale one (as `disagg_operator.gen.generate` does for the CRD and
the docs; the operator may not import the runtime, so these have their own entry point).

    python -m disagg_runtime.observe.generate [--check] [--root DIR]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Final

from disagg_runtime.observe import catalog, dashboard, rules

CHART_FILES: Final = "charts/disagg-operator/files"
DASHBOARD: Final = f"{CHART_FILES}/dashboards/disagg.json"
RULES: Final = f"{CHART_FILES}/rules/disagg.rules.yaml"
FILES: Final[tuple[tuple[str, Callable[[catalog.Catalog], str]], ...]] = (
    (DASHBOARD, dashboard.render),
    (RULES, rules.render),
)


def _read(path: pathlib.Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def stale(root: pathlib.Path) -> dict[str, str]:
    """Generated path -> wanted text, for each file under `root` that differs from it."""
    cat = catalog.catalog()
    wanted = {name: make(cat) for name, make in FILES}
    return {name: text for name, text in wanted.items() if _read(root / name) != text}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m disagg_runtime.observe.generate")
    parser.add_argument("--root", type=pathlib.Path, default=pathlib.Path("."), help="repository")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    found = stale(args.root)
    if args.check:
        if found:
            sys.stderr.write(f"stale generated files: {', '.join(found)}; run `make generate`\n")
            return 1
        print(f"{len(FILES)} observability files are current")
        return 0
    for name, text in found.items():
        path = args.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
