"""The table in `reconcile/metrics.py`'s docstring names every family the operator registers,
with its type and labels, and nothing else (the docs and alerts quote that table)."""

from __future__ import annotations

import re

import prometheus_client

from disagg_operator.reconcile import metrics

ROW = re.compile(
    r"^    (?P<name>disagg_operator_\w+)(?:\{(?P<labels>[\w,]*)\})?\s*(?:\n\s+)?"
    r"(?P<type>histogram|counter|gauge);",
    re.M,
)


def documented() -> dict[str, tuple[str, tuple[str, ...]]]:
    doc = metrics.__doc__ or ""
    rows = {
        m["name"]: (m["type"], tuple((m["labels"] or "").split(",")) if m["labels"] else ())
        for m in ROW.finditer(doc)
    }
    assert rows, "no table found in the docstring"
    return rows


def registered() -> dict[str, tuple[str, tuple[str, ...]]]:
    found: dict[str, tuple[str, tuple[str, ...]]] = {}
    for value in vars(metrics.Metrics()).values():
        if not isinstance(value, prometheus_client.metrics.MetricWrapperBase):
            continue
        kind = str(value._type)
        name = value._name + ("_total" if kind == "counter" else "")
        found[name] = (kind, tuple(value._labelnames))
    return found


def test_the_docstring_table_is_the_registered_families() -> None:
    assert documented() == registered()


def test_every_family_is_in_the_registry_served() -> None:
    m = metrics.Metrics()
    served = {family.name for family in m.registry.collect()}
    assert {name.removesuffix("_total") for name in registered()} == served
