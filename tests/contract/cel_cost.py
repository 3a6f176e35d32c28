"""The API server's static cost estimate of a CRD's CEL rules, for the contract tests.

kube-apiserver refuses a CRD whose rule's estimated cost times the number of times it can run
exceeds 10M, or whose rules together exceed 100M (apiextensions-apiserver
pkg/apis/apiextensions/validation/validation.go: StaticEstimatedCostLimit,
StaticEstimatedCRDCostLimit, getExpressionCost). The estimate is cel-go's checker/cost.go
over the rule, with sizes from the schema as k8s.io/apiserver/pkg/cel/common/schemas.go
(SchemaDeclType) and types.go give them (Kubernetes 1.33, read at kubernetes/kubernetes master
of 2026; cel-go checker/cost.go of the same date):
- a string with maxLength n is up to 4n long (maxLength counts code points, the estimate
  bytes: estimateMaxElementsFromMaxLength); without one, an enum's longest value, else the
  3 MiB request limit less 2 (formats: date 12, date-time and duration 32, byte n);
- an int-or-string is like a string (4 x maxLength, else the request limit);
- a list without maxItems holds (3 MiB - 2) / (its items' smallest JSON size + 1) items; a
  map without maxProperties (3 MiB - 2) / (smallest value + 6); smallest JSON sizes: string 2,
  number 1, boolean 4, list and map 2, object 2 plus, per required property without a
  default, its name's length + its smallest size + 4;
- numbers, booleans and objects read from the object have size 0 (DeclType.MaxElements);
- a rule runs once per element of every list or map it sits in (maxItems/maxProperties
  multiplied, validation.go's CELSchemaContext); under one without a bound, as often as its
  node's smallest JSON size fits a request (compilation.go's maxCardinality).
The estimator covers the constructs the rules use (standard macros, has, size, string, type,
matches, startsWith, in, +, comparisons, ternaries, list and map literals) and raises on any
other, so a new construct cannot be costed silently.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import lark

STATIC_RULE_LIMIT = 10_000_000  # apiextensions validation.StaticEstimatedCostLimit
STATIC_CRD_LIMIT = 100_000_000  # StaticEstimatedCRDCostLimit
MAX_REQUEST_BYTES = 3 * 1024 * 1024  # apiserver/pkg/cel limits.go MaxRequestSizeBytes
UNKNOWN = 2**64 - 1  # cel-go's unknown size
STRING_FACTOR, REGEX_FACTOR = 0.1, 0.25  # cel-go common.StringTraversalCostFactor, Regex...
LIST_CREATE, MAP_CREATE = 10, 30  # cel-go common.ListCreateBaseCost, MapCreateBaseCost
# apiserver/pkg/cel limits.go: the smallest JSON of each kind of value.
MIN_STRING, MIN_NUMBER, MIN_BOOL = 2, 1, 4
FORMAT_LENGTH = {"date": 12, "date-time": 32, "duration": 32}
MIN_FORMAT_SIZE = {"date": 12, "date-time": 21, "duration": 3}


@dataclass
class Est:
    """cel-go's estimate of one sub-expression: its cost, and what it is (kind, max size,
    schema node) so that the expressions using it can be estimated."""

    cost: int
    kind: str = "dyn"  # string int double bool list map object dyn
    size: int = UNKNOWN  # strings: characters; lists and maps: entries
    node: dict[str, Any] | None = None  # the schema node of a value read from the object
    item: Est | None = None  # a list's or map's entries


def _ceil(x: float) -> int:
    return min(UNKNOWN, math.ceil(x))


def max_length(node: dict[str, Any]) -> int:
    """The most characters a string (or int-or-string) node holds, as the estimate counts."""
    if "maxLength" in node:
        return node["maxLength"] if node.get("format") == "byte" else 4 * node["maxLength"]
    if node.get("x-kubernetes-int-or-string"):
        return MAX_REQUEST_BYTES - 2
    if node.get("format") in FORMAT_LENGTH:
        return FORMAT_LENGTH[node["format"]]
    if node.get("enum"):
        return max(len(v) for v in node["enum"] if isinstance(v, str))
    return MAX_REQUEST_BYTES - 2


def min_size(node: dict[str, Any]) -> int:
    """The smallest JSON a value of `node` serializes to (DeclType.MinSerializedSize)."""
    if node.get("x-kubernetes-int-or-string"):
        return 1
    kind = node.get("type")
    if kind == "string":
        return MIN_FORMAT_SIZE.get(node.get("format", ""), MIN_STRING)
    if kind in ("integer", "number"):
        return MIN_NUMBER
    if kind == "boolean":
        return MIN_BOOL
    if kind == "object" and "properties" in node:
        required = node.get("required", ())
        return 2 + sum(
            len(name) + min_size(sub) + 4
            for name, sub in node["properties"].items()
            if name in required and "default" not in sub
        )
    return 2  # lists, maps, objects without properties


def max_items(node: dict[str, Any]) -> int:
    """How many entries a list or map node holds, as the estimate counts."""
    if node.get("type") == "array":
        if "maxItems" in node:
            return node["maxItems"]
        return (MAX_REQUEST_BYTES - 2) // (min_size(node.get("items") or {}) + 1)
    if "maxProperties" in node:
        return node["maxProperties"]
    inner = node.get("additionalProperties")
    return (MAX_REQUEST_BYTES - 2) // (min_size(inner if isinstance(inner, dict) else {}) + 6)


def _of_node(node: dict[str, Any]) -> Est:
    """A value read from the object, sized as Kubernetes sizes it (schemas.go)."""
    if node.get("x-kubernetes-int-or-string"):
        return Est(0, "dyn", max_length(node), node)
    if node.get("type") == "string":
        return Est(0, "string", max_length(node), node)
    if node.get("type") == "array":
        return Est(0, "list", max_items(node), node, _of_node(node.get("items") or {}))
    if node.get("type") == "object" and isinstance(node.get("additionalProperties"), dict):
        return Est(0, "map", max_items(node), node, _of_node(node["additionalProperties"]))
    kinds = {"integer": "int", "number": "double", "boolean": "bool", "object": "object"}
    return Est(0, kinds.get(node.get("type", ""), "dyn"), 0, node)


def _child(est: Est, name: str) -> Est:
    node = est.node or {}
    name = re.sub(r"^__(.+)__$", r"\1", name)  # Kubernetes' escaping of CEL keywords
    if name in node.get("properties", {}):
        return _of_node(node["properties"][name])
    return Est(0)


class Estimator:
    """cel-go's checker.Cost over cel-python's parse tree, for the rules' constructs."""

    def __init__(self, node: dict[str, Any]) -> None:
        self.vars: dict[str, Est] = {"self": _of_node(node), "oldSelf": _of_node(node)}

    def __call__(self, tree: Any) -> Est:
        if isinstance(tree, lark.Token):
            return self.literal(tree)
        kids = tree.children
        name = tree.data
        if name in ("expr",) and len(kids) == 3:  # c ? a : b
            c, a, b = (self(k) for k in kids)
            return Est(c.cost + max(a.cost, b.cost), a.kind, max(a.size, b.size))
        if name in ("conditionalor", "conditionaland") and len(kids) == 2:
            a, b = self(kids[0]), self(kids[1])
            return Est(a.cost + b.cost, "bool", 1)
        if name == "relation" and len(kids) == 2:
            return self.relation(kids[0].data, self(kids[0].children[0]), self(kids[1]))
        if name in ("addition", "multiplication") and len(kids) == 2:
            a, b = self(kids[0].children[0]), self(kids[1])
            if kids[0].data == "addition_add" and "string" in (a.kind, b.kind):
                size = min(UNKNOWN, a.size + b.size)
                return Est(a.cost + b.cost + _ceil(size * STRING_FACTOR), "string", size)
            return Est(a.cost + b.cost + 1, a.kind, 1)
        if name == "unary" and len(kids) == 2:
            return Est(self(kids[1]).cost + 1, "bool", 1)
        if name == "member_dot":
            target = self(kids[0])
            return Est(target.cost + 1, **_fields(_child(target, str(kids[1]))))
        if name == "member_dot_arg":
            return self.method(kids[0], str(kids[1]), _args(kids[2] if len(kids) > 2 else None))
        if name == "member_index":
            target, index = self(kids[0]), self(kids[1])
            item = target.item or Est(0)
            return Est(target.cost + index.cost + 1, **_fields(item))
        if name == "ident_arg":
            return self.function(str(kids[0]), _args(kids[1] if len(kids) > 1 else None))
        if name == "ident":
            found = self.vars.get(str(kids[0]), Est(0))
            return Est(1, **_fields(found))
        if name == "list_lit":
            items = [self(k) for k in _args(kids[0] if kids else None)]
            widest = max(items, key=lambda e: e.size, default=Est(0))
            return Est(LIST_CREATE + sum(e.cost for e in items), "list", len(items), None, widest)
        if name == "map_lit":
            parts = [self(k) for k in _args(kids[0] if kids else None)]
            values = parts[1::2]
            widest = max(values, key=lambda e: e.size, default=Est(0))
            return Est(MAP_CREATE + sum(e.cost for e in parts), "map", len(values), None, widest)
        if len(kids) == 1:  # a grammar level with nothing of its own
            return self(kids[0])
        raise AssertionError(f"no estimate for {name}")

    def literal(self, token: lark.Token) -> Est:
        text = str(token)
        if token.type in ("STRING_LIT", "MLSTRING_LIT"):
            return Est(0, "string", len(text) - 2)
        if token.type == "BOOL_LIT":
            return Est(0, "bool", 1)
        return Est(0, "double" if token.type == "FLOAT_LIT" else "int", 1)

    def relation(self, op: str, a: Est, b: Est) -> Est:
        if op == "relation_in":
            per = b.size if b.kind == "list" else 1
            return Est(a.cost + b.cost + per, "bool", 1)
        if op in ("relation_eq", "relation_ne") or "string" in (a.kind, b.kind):
            return Est(a.cost + b.cost + _ceil(min(a.size, b.size) * STRING_FACTOR), "bool", 1)
        return Est(a.cost + b.cost + 1, "bool", 1)

    def method(self, target_tree: Any, name: str, args: list[Any]) -> Est:
        target = self(target_tree)
        if name in ("all", "exists", "exists_one", "filter", "map"):
            var = str(next(args[0].scan_values(lambda t: isinstance(t, lark.Token))))
            saved = self.vars.get(var)
            self.vars[var] = target.item or Est(0)
            body = self(args[1])
            if saved is None:
                del self.vars[var]
            else:
                self.vars[var] = saved
            # cel-go's expansion of each macro: the loop step and condition around the body.
            step = {"all": 3, "exists": 4, "exists_one": 2}.get(name, 13)
            per = body.cost + step
            cost = target.cost + _ceil(min(UNKNOWN, target.size * per))
            if name in ("filter", "map"):
                return Est(cost, "list", target.size, None, target.item)
            return Est(cost, "bool", 1)
        values = [self(a) for a in args]
        cost = target.cost + sum(v.cost for v in values)
        if name == "matches":
            text = _ceil((target.size + 1) * STRING_FACTOR)
            regex = _ceil(values[0].size * REGEX_FACTOR)
            return Est(cost + min(UNKNOWN, text * regex), "bool", 1)
        if name in ("startsWith", "endsWith"):
            return Est(cost + _ceil(values[0].size * STRING_FACTOR), "bool", 1)
        if name == "size":
            return Est(cost + 1, "int", 1)
        if name in ("hasValue",):
            return Est(cost + 1, "bool", 1)
        raise AssertionError(f"no estimate for .{name}()")

    def function(self, name: str, args: list[Any]) -> Est:
        if name == "has":  # a presence test: the select costs nothing more
            inner = args[0]
            while len(inner.children) == 1 and not isinstance(inner.children[0], lark.Token):
                inner = inner.children[0]
            return Est(self(inner.children[0]).cost + 1, "bool", 1)
        values = [self(a) for a in args]
        cost = sum(v.cost for v in values) + 1
        if name == "size":
            return Est(cost, "int", 1)
        if name == "string":  # no size estimate for a conversion: unknown
            return Est(cost, "string", values[0].size if values[0].kind == "string" else UNKNOWN)
        if name == "type":
            return Est(cost, "dyn", 1)
        raise AssertionError(f"no estimate for {name}()")


def _fields(est: Est) -> dict[str, Any]:
    return {"kind": est.kind, "size": est.size, "node": est.node, "item": est.item}


def _args(exprlist: Any) -> list[Any]:
    return [] if exprlist is None else list(exprlist.children)


def estimate(text: str, node: dict[str, Any]) -> int:
    return Estimator(node)(program_tree(text)).cost


def program_tree(text: str) -> Any:
    import celpy

    return celpy.Environment().compile(text)


def cardinality(schema: dict[str, Any], path: str) -> int:
    """How often a rule at `path` (`.spec.learner.volumes[]`) runs per object: the product of
    its enclosing lists' maxItems and maps' maxProperties; under one without a bound, as many
    times as the rule's node's smallest JSON fits a request (maxCardinality)."""
    node, out, bounded = schema, 1, True
    for step in re.findall(r"\.[A-Za-z]+|\[\]|\{\}", path):
        if step == "[]":
            bounded = bounded and "maxItems" in node
            out *= node.get("maxItems", 1)
            node = node["items"]
        elif step == "{}":
            bounded = bounded and "maxProperties" in node
            out *= node.get("maxProperties", 1)
            node = node["additionalProperties"]
        else:
            node = node["properties"][step[1:]]
    return out if bounded else MAX_REQUEST_BYTES // (min_size(node) + 1)
