"""The metric catalog: every series a dashboard panel or a rule may name, read from the code
that exports them, so that a renamed metric fails generation instead of leaving a dead panel.

Two sources must agree, or `catalog()` raises:
- the documented tables (the docstrings of `disagg_runtime.role.metrics` and
  `disagg_runtime.gateway.metrics`, rows ``name  type  ...``), and
- the families those modules actually register (a `RoleMetrics` and a `GatewayMetrics` are
  built and collected once; the operator's `Metrics` too, which has no table).

Names are the exposed ones: a counter ``disagg_requests`` is ``disagg_requests_total``, a
histogram ``disagg_request_seconds`` stays as is (panels add ``_bucket``/``_sum``/``_count``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from disagg_operator.reconcile import metrics as operator_metrics
from disagg_runtime.gateway import metrics as gateway_metrics
from disagg_runtime.role import metrics as role_metrics

_ROW: Final = re.compile(r"^``(disagg_\w+)``\s+(counter|gauge|histogram)\b", re.MULTILINE)


@dataclass(frozen=True)
class Catalog:
    """Exposed metric name -> type ("counter" | "gauge" | "histogram")."""

    types: Mapping[str, str]

    def name(self, name: str, kind: str) -> str:
        """`name` if the catalog has it with type `kind`; else KeyError (a dead panel)."""
        found = self.types.get(name)
        if found != kind:
            raise KeyError(f"no {kind} {name!r} is exported (found: {found})")
        return name

    def counter(self, name: str) -> str:
        return self.name(name, "counter")

    def gauge(self, name: str) -> str:
        return self.name(name, "gauge")

    def histogram(self, name: str) -> str:
        return self.name(name, "histogram")


def table(doc: str) -> dict[str, str]:
    """The ``name  type`` rows of an RST metric table in a docstring."""
    return {name: kind for name, kind in _ROW.findall(doc)}


def exposed(families: Iterable[tuple[str, str]]) -> dict[str, str]:
    """(family name, type) as a registry collects them -> exposed name -> type."""
    out: dict[str, str] = {}
    for name, kind in families:
        out[name + "_total" if kind == "counter" else name] = kind
    return out


def _collected(registry: object) -> list[tuple[str, str]]:
    return [(m.name, m.type) for m in registry.collect()]  # type: ignore[attr-defined]


def registered() -> tuple[dict[str, str], dict[str, str]]:
    """(documented-table families, operator families) as the code registers them."""
    sample = role_metrics.RoleSample(0, 0, 0, 0, 0)
    role = role_metrics.RoleMetrics(pipeline="p", role="r", replica=0, sample=lambda: sample)
    gateway = gateway_metrics.GatewayMetrics("p")
    documented = exposed(_collected(role.registry) + _collected(gateway.registry))
    operator = exposed(_collected(operator_metrics.Metrics().registry))
    return documented, operator


def check(documented: Mapping[str, str], code: Mapping[str, str]) -> list[str]:
    """Where the tables and the registered families disagree (empty when they agree)."""
    problems = [
        f"{name}: documented as {kind}, registered as {code.get(name)}"
        for name, kind in documented.items()
        if code.get(name) != kind
    ]
    problems += [
        f"{name}: registered but not documented" for name in code if name not in documented
    ]
    return problems


def catalog() -> Catalog:
    """Every exported series; raises ValueError if a table and its code disagree."""
    documented = table(role_metrics.__doc__ or "") | table(gateway_metrics.__doc__ or "")
    code, operator = registered()
    problems = check(documented, code)
    if problems:
        raise ValueError("metric tables disagree with the code: " + "; ".join(problems))
    return Catalog({**code, **operator})
