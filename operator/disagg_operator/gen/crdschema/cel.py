"""The CEL rules of a schema (x-kubernetes-validations): compiled and evaluated with
cel-python, and their cost estimated the way the API server bounds it (k8s.io/apiextensions-
apiserver's StaticEstimatedCostLimit per rule, StaticEstimatedCRDCostLimit for a schema's
rules together, each multiplied by how often it may run).

The estimate walks the rule's syntax tree with the schema at hand: a macro (`all`, `exists`,
`exists_one`, `map`, `filter`) over a list or map costs its size times its body, a string
function (`matches`, `contains`, `startsWith`, ...) the string's length. A list without
maxItems, a map without maxProperties and a string without maxLength are as large as the
largest request allows (3 MiB), as on the server. The constants differ from cel-go's, the
orders of magnitude do not: a rule bounded by maxItems/maxLength passes, an unbounded nested
iteration does not.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import celpy
import lark
from celpy.adapter import json_to_cel
from celpy.celparser import CELParseError
from celpy.celtypes import BoolType

Schema = dict[str, Any]

PER_RULE_LIMIT: Final = 10_000_000  # StaticEstimatedCostLimit
TOTAL_LIMIT: Final = 100_000_000  # StaticEstimatedCRDCostLimit
MAX_REQUEST_BYTES: Final = 3 * 1024 * 1024
_MACROS: Final = frozenset({"all", "exists", "exists_one", "map", "filter"})
_STRING_SCANS: Final = frozenset(
    {"matches", "contains", "startsWith", "endsWith", "indexOf", "lastIndexOf", "split",
     "replace", "lowerAscii", "upperAscii", "trim", "find", "findAll"}
)  # fmt: skip
_ENV: Final = celpy.Environment()


class CompileError(ValueError):
    """A rule that does not compile: its message follows `compilation failed: `."""


@dataclass(frozen=True)
class Rule:
    """One x-kubernetes-validations entry, compiled."""

    rule: str
    message: str | None
    field_path: str | None
    program: Any

    @property
    def transition(self) -> bool:
        return "oldSelf" in self.rule


@functools.lru_cache(maxsize=1024)
def _parse(rule: str) -> lark.Tree[Any]:
    try:
        tree: lark.Tree[Any] = _ENV.compile(rule)
    except CELParseError as error:
        raise CompileError(f"ERROR: <input>: Syntax error: {str(error).splitlines()[0]}") from None
    return tree


def compile_rule(entry: dict[str, Any], schema: Schema | None) -> Rule:
    """The rule of `entry`, checked against `schema` (the node it is declared on; None: not
    checked): a syntax error or a reference to a field the schema does not declare is a
    CompileError."""
    tree = _parse(str(entry.get("rule", "")))
    if schema is not None:
        _Estimator(schema).cost(tree)  # undefined fields raise
    return Rule(
        rule=str(entry["rule"]),
        message=entry.get("message"),
        field_path=entry.get("fieldPath"),
        program=_ENV.program(tree),
    )


def evaluate(rule: Rule, value: Any, old: Any = None) -> bool | str:
    """True when the rule holds for `value`; False when it does not; an error's text when it
    cannot be evaluated (a missing field, a type error)."""
    activation = {"self": json_to_cel(value)}
    if rule.transition:
        activation["oldSelf"] = json_to_cel(old)
    try:
        result = rule.program.evaluate(activation)
    except Exception as error:  # cel-python raises its own errors and Python's
        return str(error)
    if isinstance(result, BoolType):
        return bool(result)
    return str(result)


def cost(rule: str, schema: Schema) -> int:
    """The rule's estimated cost on `schema` (its node)."""
    return _Estimator(schema).cost(_parse(rule))


def max_elements(schema: Schema) -> int:
    """The most items a list (properties: a map) of this schema may hold."""
    if schema.get("type") == "array":
        if "maxItems" in schema:
            return int(schema["maxItems"])
        return MAX_REQUEST_BYTES // (_min_size(schema.get("items") or {}) + 1)
    if "maxProperties" in schema:
        return int(schema["maxProperties"])
    return MAX_REQUEST_BYTES // (_min_size(schema.get("additionalProperties") or {}) + 4)


def max_length(schema: Schema) -> int:
    if "maxLength" in schema:
        return int(schema["maxLength"])
    if "enum" in schema:
        return max(len(str(v)) for v in schema["enum"])
    return MAX_REQUEST_BYTES - 2


def _min_size(schema: Schema) -> int:
    """The fewest bytes an item of the schema takes in a request."""
    kind = schema.get("type")
    if kind in ("object", "array"):
        return 2
    if kind == "string":
        return 2 + int(schema.get("minLength", 0))
    if kind == "boolean":
        return 4
    return 1


def cardinality(ancestors: list[Schema]) -> int:
    """How many times a rule on a node may run: the sizes of the lists and maps above it."""
    total = 1
    for node in ancestors:
        if node.get("type") == "array" or isinstance(node.get("additionalProperties"), dict):
            total *= max_elements(node)
    return total


class _Estimator:
    """The cost of a rule's tree; the schema of each expression where it is known."""

    def __init__(self, schema: Schema) -> None:
        self.scopes: list[dict[str, Schema | None]] = [{"self": schema}]

    def cost(self, tree: lark.Tree[Any]) -> int:
        return self._visit(tree)[0]

    def _lookup(self, name: str) -> Schema | None:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        return None

    def _visit(self, node: Any) -> tuple[int, Schema | None]:
        if not isinstance(node, lark.Tree):
            return 0, None
        kind, children = node.data, node.children
        if kind == "primary" and children and isinstance(children[0], lark.Tree):
            inner = children[0]
            if inner.data == "ident":
                return 1, self._lookup(str(inner.children[0]))
        if kind == "member_dot":
            base_cost, base = self._visit(children[0])
            return base_cost + 1, self._field(base, str(children[1]))
        if kind == "member_dot_arg":
            return self._call(children)
        if kind == "member_index":
            base_cost, base = self._visit(children[0])
            index_cost, _ = self._visit(children[1])
            item = (base or {}).get("items") or (base or {}).get("additionalProperties")
            return base_cost + index_cost + 1, item if isinstance(item, dict) else None
        if len(children) == 1:  # a wrapper (expr, member, unary, ...): its child's schema
            return self._visit(children[0])
        total = sum(self._visit(child)[0] for child in children)
        return total + 1, None

    def _field(self, schema: Schema | None, name: str) -> Schema | None:
        if schema is None or schema.get("x-kubernetes-preserve-unknown-fields"):
            return None
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        if properties is not None and name in properties:
            result: Schema = properties[name]
            return result
        if isinstance(extra, dict):
            return extra
        if properties is not None or schema.get("type") == "object":
            raise CompileError(f"ERROR: <input>: undefined field '{name}'")
        return None

    def _call(self, children: list[Any]) -> tuple[int, Schema | None]:
        target_cost, target = self._visit(children[0])
        method = str(children[1])
        args = list(_args(children[2] if len(children) > 2 else None))
        if method in _MACROS and args and target is not None:
            variable = _ident_name(args[0])
            item = target.get("items") if target.get("type") == "array" else {"type": "string"}
            self.scopes.append({variable: item if isinstance(item, dict) else None})
            try:
                body = sum(self._visit(arg)[0] for arg in args[1:])
            finally:
                self.scopes.pop()
            return target_cost + max_elements(target) * (body + 1), None
        if method in _MACROS and args:
            self.scopes.append({_ident_name(args[0]): None})
            try:
                body = sum(self._visit(arg)[0] for arg in args[1:])
            finally:
                self.scopes.pop()
            return target_cost + MAX_REQUEST_BYTES * (body + 1), None
        arg_cost = sum(self._visit(arg)[0] for arg in args)
        if method in _STRING_SCANS:
            length = max_length(target) if target is not None else MAX_REQUEST_BYTES
            return target_cost + arg_cost + 1 + length // 10, None
        return target_cost + arg_cost + 1, None


def _args(exprlist: Any) -> Iterator[Any]:
    if isinstance(exprlist, lark.Tree):
        yield from exprlist.children


def _ident_name(expr: Any) -> str:
    """The name of a macro's variable (`r` in `x.all(r, ...)`)."""
    while isinstance(expr, lark.Tree) and expr.children:
        if expr.data == "ident":
            return str(expr.children[0])
        expr = expr.children[0]
    return ""
