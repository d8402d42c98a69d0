"""`disagg render FILE [--namespace NS]`: the objects the operator would create, as YAML.

The same planner as the operator, without ownerReferences (there is no pipeline uid
outside a cluster). Invalid input prints the lines `disagg validate` prints, to stderr.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TextIO

import yaml

from disagg_core import spec
from disagg_core.spec import ROOT
from disagg_operator.plan import model, planner

DEFAULT_NAMESPACE = "default"


def render_cli(
    file: str,
    *,
    namespace: str | None,
    out: TextIO,
    err: TextIO,
    options: model.PlanOptions | None = None,
) -> int:
    """Print the plan of `file` to `out`; returns the exit status (1: invalid input)."""
    try:
        pipeline = spec.load_pipeline_file(file)
        target = namespace or pipeline.namespace or DEFAULT_NAMESPACE
        objects = planner.plan(pipeline, namespace=target, options=options)
    except spec.SpecError as error:
        for problem in error.problems:
            print(f"{file}: {problem.path or ROOT}: {problem.reason}", file=err)
        return 1
    out.write(dump_all(objects))
    return 0


def dump_all(objects: Iterable[dict[str, Any]]) -> str:
    """Multi-document YAML; multi-line strings (the topology file) as literal blocks."""
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, explicit_start=True, width=100)


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True  # every object stands alone, as kubectl expects


def _represent_str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _represent_str)
