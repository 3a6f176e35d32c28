"""The CRD's CEL rules (x-kubernetes-validations), evaluated with cel-python.

Every rule compiles; every example passes every rule; every manifest `gspo validate` refuses
for a reason CEL can see (the cases of tests/trainer/test_spec_validation.py,
tests/operator/test_pod_settings_validation.py and test_validate_cli.py, reused) is refused by
the rule that mirrors that check, at the same field and with the same fix, and CEL never
refuses what validate accepts (also on generated specs); what only the operator can check is
left to it; spec fields freeze once a job exists, but for status.MUTABLE_FIELDS; the defaults
the API server fills in are the models' defaults; and each rule's cost, estimated the way
the API server estimates it, stays within its limits.

cel-python is not Kubernetes' CEL (cel-go with Kubernetes' libraries). Where it matters here:
- it does not type-check, so a rule Kubernetes would not compile could run here: the rules use
  the standard macros and functions only, and this file parses each one and checks its paths;
- it raises on `==` between an int and a string (cel-go answers false): the rules compare an
  int-or-string only after testing its type;
- it has no Kubernetes library (quantity, url, ip, lists, the strings extension, cel.bind): the
  rules use none; optional types (optionalOldSelf) are emulated in cel_admission;
- it has no cost model: `estimate` below is cel-go's static estimator (checker/cost.go) for the
  constructs the rules use, with Kubernetes' size estimates (maxLength, maxItems, else the
  3 MiB request limit); it approximates, so the test keeps every rule under half the limit.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lark
import pytest
import yaml
from cel_admission import (
    default,
    evaluate,
    failures,
    program,
    rules_of,
    to_cel,
    uses_old_self,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from test_spec_fuzz import extras, typed_mutation

from gspo_operator import names
from gspo_operator.crd import render_crd
from gspo_operator.crd_rules import REJECTED_AT_CREATION
from gspo_operator.manifest import check_job
from gspo_operator.status import MUTABLE_FIELDS
from gspo_trainer.config import GSPOJobSpec
from gspo_trainer.validation import Problem

REPO = Path(__file__).resolve().parents[2]
SCHEMA = render_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
RULES = list(rules_of(SCHEMA))
EXAMPLE = yaml.safe_load((REPO / "examples/gspojob.yaml").read_text())


def _cases(path: str, name: str) -> Any:
    """A test module of another suite, for its cases (loaded by path: not on sys.path here)."""
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SPEC_CASES = _cases("tests/trainer/test_spec_validation.py", "_spec_validation_cases")
POD_CASES = _cases("tests/operator/test_pod_settings_validation.py", "_pod_settings_cases")
CLI_CASES = _cases("tests/operator/test_validate_cli.py", "_validate_cli_cases")

# Problems validate finds that no CEL rule can see (crd_rules' docstring says why).
OPERATOR_ONLY = (
    "needs exactly one of",  # env valueFrom: preserved unknown fields are invisible to CEL
    "configMapRef or secretRef with a name",  # envFrom: likewise
    "not allowed on this cluster",  # the cluster's policy: hostPath
    "RestartJob feature gate",  # the cluster's policy: restartScope learner
)
# engineArgs is a preserved-unknown-fields map checked against vLLM's flag table: the
# operator's to check, invisible to CEL.
OPERATOR_ONLY_PATHS = ("spec.rollout.engineArgs.",)


def job(spec: dict[str, Any], name: str = "job") -> dict[str, Any]:
    return {
        "apiVersion": "gspo.dev/v1alpha1",
        "kind": "GSPOJob",
        "metadata": {"name": name},
        "spec": spec,
    }


def cel(doc: dict[str, Any], old: dict[str, Any] | None = None) -> list[Any]:
    """What the API server's CEL rules refuse in `doc` (defaults filled in, as it does)."""
    return failures(SCHEMA, default(SCHEMA, doc), None if old is None else default(SCHEMA, old))


def _fix(message: str) -> list[str]:
    return message.rsplit("; ", 1)[-1].split()


def same_fix(cel_message: str, validate_message: str) -> bool:
    """Both end with the same fix: the same last clause, or the same first or last words of
    it (a rule's message names fields where validate prints their values)."""
    if cel_message == validate_message or cel_message in validate_message:
        return True
    a, b = _fix(cel_message), _fix(validate_message)
    prefix = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    suffix = next(
        (i for i, (x, y) in enumerate(zip(a[::-1], b[::-1], strict=False)) if x != y),
        min(len(a), len(b)),
    )
    return max(prefix, suffix) >= 3


def _covers(field: str, path: str) -> bool:
    """A rule on a list (`spec.learner.volumes`) answers for its items' problems."""
    return path == field or path.startswith((f"{field}[", f"{field}."))


def assert_cel_agrees(doc: dict[str, Any], problems: list[Problem] | None = None) -> list[Any]:
    """CEL refuses exactly validate's CEL-visible problems, at their fields, with their fixes."""
    if problems is None:
        _, problems = check_job(doc)
    found = cel(doc)
    for f in found:
        matching = [p for p in problems if _covers(f.field, p.path)]
        assert matching, f"CEL refuses what validate accepts: {f} ({problems})"
        assert any(same_fix(f.message, p.message) for p in matching), (str(f), matching)
    for p in problems:
        seen = [f for f in found if _covers(f.field, p.path)]
        if any(w in p.message for w in OPERATOR_ONLY) or p.path.startswith(OPERATOR_ONLY_PATHS):
            assert not seen, f"{p} is the operator's to check, yet CEL refuses it: {seen}"
        else:
            assert seen, f"validate refuses {p}; no CEL rule does"
            assert any(same_fix(f.message, p.message) for f in seen), (
                str(p),
                [str(f) for f in seen],
            )
            # A rule whose messageExpression prints validate's values says its very words.
            exact = [
                f
                for f in seen
                if f.field == p.path
                and _rule(f.rule).get("messageExpression")
                and same_fix(f.message, p.message)
            ]
            assert all(f.message == p.message for f in exact), (str(p), [str(f) for f in exact])
    return found


def _rule(text: str) -> dict[str, Any]:
    return next(r for _, _, r in RULES if r["rule"] == text)


# --- the rules themselves ------------------------------------------------------------------


def _resolve(node: dict[str, Any], field_path: str) -> dict[str, Any] | None:
    """The schema node a fieldPath names, as Kubernetes' ValidFieldPath walks it."""
    for name, key in re.findall(r"\.([A-Za-z0-9_]+)|\['([^']+)'\]", field_path):
        if name and name in node.get("properties", {}):
            node = node["properties"][name]
        elif key and isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        elif key and key in node.get("properties", {}):
            node = node["properties"][key]
        else:
            return None
    return node


def test_every_rule_compiles_and_is_well_formed() -> None:
    assert len(RULES) > 30
    for path, node, r in RULES:
        program(r["rule"])  # cel-python parses it
        if "messageExpression" in r:
            program(r["messageExpression"])
        assert r["message"].strip() and "\n" not in r["message"], r
        assert r["reason"] in ("FieldValueInvalid", "FieldValueForbidden", "FieldValueRequired")
        if "fieldPath" in r:
            assert _resolve(node, r["fieldPath"]) is not None, (path, r["fieldPath"])
        if r.get("optionalOldSelf"):
            assert uses_old_self(r), r
        if uses_old_self(r):  # oldSelf cannot correlate through a list's items
            assert "[]" not in path, (path, r["rule"])
        # Only the standard library: no Kubernetes extension function (cel-python has none).
        calls = set(re.findall(r"\.?([A-Za-z_]+)\(", r["rule"] + r.get("messageExpression", "")))
        assert calls <= {
            "has",
            "size",
            "string",
            "type",
            "matches",
            "startsWith",
            "all",
            "exists",
            "exists_one",
            "filter",
            "hasValue",
        }, calls


def _gspojobs() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in sorted((REPO / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "GSPOJob":
                yield path.name, doc


def test_every_example_passes_every_rule_on_create_and_on_update() -> None:
    examples = list(_gspojobs())
    assert len(examples) >= 3
    for name, doc in examples:
        assert check_job(doc)[1] == [], name
        assert cel(doc) == [], name
        assert cel(doc, old=doc) == [], name


def test_defaults_are_the_models_defaults() -> None:
    """What the API server stores for a minimal spec is what the models read from it."""
    raw = {"model": {"name": "Qwen/Qwen3-30B-A3B-Base"}, "data": {"source": "/data/x.jsonl"}}
    stored = default(SCHEMA, job(raw))["spec"]
    models = GSPOJobSpec.model_validate(raw).model_dump(
        mode="json", by_alias=True, exclude_none=True
    )
    for computed in ("clipLow", "clipHigh"):  # filled by the model from lossLevel, not defaults
        models["algorithm"].pop(computed)
    models["reward"].pop("kind")  # math, filled by the model unless reward.functions is set
    assert stored == models
    assert GSPOJobSpec.model_validate(stored) == GSPOJobSpec.model_validate(raw)


def test_nulls_are_pruned_unless_null_means_something() -> None:
    doc = job({**copy.deepcopy(EXAMPLE["spec"]), "algorithm": {"clipLow": None}})
    assert "clipLow" not in default(SCHEMA, doc)["spec"]["algorithm"]
    doc["spec"]["model"]["moe"] = None  # a dense model: no router loss
    assert default(SCHEMA, doc)["spec"]["model"]["moe"] is None


# --- bad manifests: the same refusals as `gspo validate` -----------------------------------


@pytest.mark.parametrize(("sections", "path", "words"), SPEC_CASES.CROSS_FIELD_CASES)
def test_cross_field_rules_refuse_what_validate_refuses(
    sections: dict, path: str, words: str
) -> None:
    found = assert_cel_agrees(job(SPEC_CASES.minimal(**sections)))
    assert any(f.field == path for f in found), [str(f) for f in found]


@pytest.mark.parametrize(("learner", "expected"), POD_CASES.BAD_POD_SETTINGS)
def test_pod_settings_rules_refuse_what_validate_refuses(learner: dict, expected: str) -> None:
    doc = copy.deepcopy(POD_CASES.EXAMPLE)
    doc["spec"]["learner"] = {**doc["spec"].get("learner", {}), **learner}
    found = assert_cel_agrees(doc)
    visible = not any(words in expected for words in OPERATOR_ONLY)
    assert bool(found) == visible, [str(f) for f in found]


@pytest.mark.parametrize("name", CLI_CASES.BAD_JOB_NAMES)
def test_name_rules_refuse_what_validate_refuses(name: str) -> None:
    doc = job(copy.deepcopy(EXAMPLE["spec"]), name)
    doc["spec"]["learner"]["replicas"] = doc["spec"]["rollout"]["replicas"] = 1  # as the CLI test
    found = assert_cel_agrees(doc)
    assert any(f.field == "metadata.name" for f in found)


def test_the_name_limit_follows_the_replicas_as_jobset_does() -> None:
    doc = copy.deepcopy(EXAMPLE)
    for servers in (4, 10, 12, 0):
        doc["spec"]["rollout"]["replicas"] = servers
        limit = names.max_job_name(doc["spec"]["learner"]["replicas"], servers)
        doc["metadata"]["name"] = "a" * limit
        assert assert_cel_agrees(doc) == []
        doc["metadata"]["name"] = "a" * (limit + 1)
        assert [f.field for f in assert_cel_agrees(doc)] == ["metadata.name"]


def test_what_only_the_operator_can_check_is_left_to_it() -> None:
    for learner in (
        {
            "volumes": [{"name": "host", "hostPath": {"path": "/mnt"}}],
            "volumeMounts": [{"name": "host", "mountPath": "/mnt"}],
        },
        {"env": [{"name": "A", "valueFrom": {"secretKeyRefs": {}}}]},
    ):
        doc = copy.deepcopy(EXAMPLE)
        doc["spec"]["learner"] = {**doc["spec"]["learner"], **learner}
        assert check_job(doc)[1] and cel(doc) == []
    doc = copy.deepcopy(EXAMPLE)
    doc["spec"].setdefault("runPolicy", {})["restartScope"] = "learner"
    assert check_job(doc)[1] and cel(doc) == []


NAMES = st.from_regex(r"[a-z][a-z0-9-]{0,50}", fullmatch=True) | st.sampled_from(
    CLI_CASES.BAD_JOB_NAMES
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(typed_mutation, max_size=3), extras, NAMES)
def test_generated_specs_cel_and_validate_agree(
    mutations: list[Any], extra: dict[tuple[str, ...], Any], name: str
) -> None:
    """test_spec_fuzz's generated specs: where the models take a spec (field by field, as the
    CRD's OpenAPI schema would), CEL refuses exactly the cross-field problems it can see."""
    from test_spec_fuzz import _set

    doc = copy.deepcopy(EXAMPLE)
    doc["metadata"]["name"] = name
    for path, value in [*mutations, *extra.items()]:
        _set(doc["spec"], path, value)
    try:
        GSPOJobSpec.model_validate(doc["spec"])
    except ValidationError:
        event("a field-level refusal (the OpenAPI schema's, before CEL)")
        return
    event("refused" if assert_cel_agrees(doc) else "accepted")


# --- what may change while the job exists --------------------------------------------------


def _scalars(node: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _scalars(value, (*path, key))
    elif not isinstance(node, dict | list):
        yield path


def _changed(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value * 2 + 1
    return f"{value}-x"


def test_every_field_but_the_mutable_ones_freezes_once_the_job_exists() -> None:
    old = default(SCHEMA, copy.deepcopy(EXAMPLE))
    mutable = {tuple(f.split(".")) for f in MUTABLE_FIELDS}
    checked = 0
    for path in _scalars(old["spec"]):
        if path in mutable:
            continue
        new = copy.deepcopy(old)
        node = new["spec"]
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = _changed(node[path[-1]])
        frozen = [f for f in cel(new, old) if f.message.startswith("cannot change")]
        assert [f.field for f in frozen] == [f"spec.{path[0]}"], (path, frozen)
        assert f"spec.{path[0]}" in frozen[0].message
        checked += 1
    assert checked > 60
    # Optional fields appearing or going, lists growing, count as changes too.
    for section, key, value in (
        ("model", "revision", "main"),
        ("learner", "imagePullSecrets", ["pull"]),
        ("runPolicy", "scheduling", {"queue": "q"}),
    ):
        new = copy.deepcopy(old)
        new["spec"][section][key] = value
        assert [f.field for f in cel(new, old)] == [f"spec.{section}"], key
        assert [f.field for f in cel(old, new)] == [f"spec.{section}"], key


@pytest.mark.parametrize("field", MUTABLE_FIELDS)
def test_the_mutable_fields_change_in_flight(field: str) -> None:
    section, key = field.split(".")
    old = copy.deepcopy(EXAMPLE)
    for before, after in ((None, 30), (30, 31), (31, None), (False, True), (True, False)):
        if isinstance(before, bool) != (key == "suspend"):
            continue
        a, b = copy.deepcopy(old), copy.deepcopy(old)
        for doc, value in ((a, before), (b, after)):
            if value is None:
                doc["spec"].setdefault(section, {}).pop(key, None)
            else:
                doc["spec"].setdefault(section, {})[key] = value
        assert cel(b, a) == [], (field, before, after)


def test_a_job_refused_at_creation_may_still_be_fixed() -> None:
    """The operator starts a job it refused once its manifest is fixed (reconcile.py): until a
    child exists nothing is frozen, so the rules let such an edit through."""
    from gspo_operator.reconcile import _rejected_at_creation

    refused = {
        "phase": "Failed",
        "conditions": [
            {"type": "InvalidSpec", "status": "True", "reason": "InvalidSpec", "message": "..."},
            {"type": "Failed", "status": "True", "reason": "InvalidSpec", "message": "..."},
        ],
    }
    running = {"phase": "Running", "conditions": [{"type": "Running", "status": "True"}]}
    changed_later = {
        "phase": "Running",
        "conditions": [{"type": "InvalidSpec", "status": "True", "reason": "SpecChangeRefused"}],
    }
    old = copy.deepcopy(EXAMPLE)
    new = copy.deepcopy(old)
    new["spec"]["algorithm"]["learningRate"] = 0.5
    for status, editable in ((refused, True), (running, False), (changed_later, False)):
        assert _rejected_at_creation(status) == editable
        stored = {**old, "status": status}
        frozen = [f for f in cel({**new, "status": status}, stored) if "cannot change" in f.message]
        assert (not frozen) == editable, status
        as_cel = to_cel(default(SCHEMA, stored), SCHEMA, root=True)
        assert bool(evaluate(REJECTED_AT_CREATION, as_cel, as_cel)) == editable


def test_the_name_rules_judge_a_new_job_only() -> None:
    """A job stored before the rules existed keeps its name and can still be updated (its
    finalizer removed): a root rule is never ratcheted, so these run on create only."""
    old = copy.deepcopy(EXAMPLE)
    old["metadata"]["name"] = "x" * 60
    assert [f.field for f in cel(old)] == ["metadata.name"]
    new = copy.deepcopy(old)
    new["spec"]["runPolicy"] = {**new["spec"].get("runPolicy", {}), "suspend": True}
    assert cel(new, old) == []


def test_a_null_model_moe_does_not_freeze_the_job() -> None:
    """Kubernetes finds an object holding a null unequal even to itself: model is compared
    field by field, and has() reads the null as absent."""
    old = copy.deepcopy(EXAMPLE)
    old["spec"]["model"]["moe"] = None
    assert cel(old, old) == []
    new = copy.deepcopy(old)
    new["spec"]["model"]["moe"] = {"routerAuxLossCoef": 0.01}
    assert [f.field for f in cel(new, old)] == ["spec.model"]


# --- cost ----------------------------------------------------------------------------------

STATIC_RULE_LIMIT = 10_000_000  # apiextensions validation.StaticEstimatedCostLimit
STATIC_CRD_LIMIT = 100_000_000  # StaticEstimatedCRDCostLimit
MAX_REQUEST_BYTES = 3 * 1024 * 1024  # the API server's request size limit
UNKNOWN = 2**64 - 1  # cel-go's unknown size
STRING_FACTOR, REGEX_FACTOR = 0.1, 0.25  # cel-go common.StringTraversalCostFactor, Regex...
LIST_CREATE, MAP_CREATE = 10, 30  # cel-go common.ListCreateBaseCost, MapCreateBaseCost


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


def _of_node(node: dict[str, Any]) -> Est:
    """A value read from the object, sized as Kubernetes sizes it (schema bounds, else the
    most a request can carry)."""
    if node.get("x-kubernetes-int-or-string") or node.get("type") == "string":
        kind = "dyn" if node.get("x-kubernetes-int-or-string") else "string"
        return Est(0, kind, node.get("maxLength", MAX_REQUEST_BYTES - 2), node)
    if node.get("type") == "array":
        items = node.get("maxItems", (MAX_REQUEST_BYTES - 2) // 3)
        return Est(0, "list", items, node, _of_node(node["items"]))
    if node.get("type") == "object" and "properties" not in node:
        entries = node.get("maxProperties", (MAX_REQUEST_BYTES - 2) // 3)
        inner = node.get("additionalProperties")
        return Est(0, "map", entries, node, _of_node(inner) if isinstance(inner, dict) else None)
    kinds = {"integer": "int", "number": "double", "boolean": "bool", "object": "object"}
    kind = kinds.get(node.get("type", ""), "dyn")
    return Est(0, kind, 1 if kind in ("int", "double", "bool") else 0, node)


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


def _cardinality(path: str) -> int:
    """How often a rule at `path` runs per object: the product of its enclosing lists' and
    maps' maxItems/maxProperties (Kubernetes' MaxCardinality)."""
    node, out = SCHEMA, 1
    for step in re.findall(r"\.[A-Za-z]+|\[\]|\{\}", path):
        if step == "[]":
            out *= node.get("maxItems", (MAX_REQUEST_BYTES - 2) // 3)
            node = node["items"]
        elif step == "{}":
            out *= node.get("maxProperties", (MAX_REQUEST_BYTES - 2) // 3)
            node = node["additionalProperties"]
        else:
            node = node["properties"][step[1:]]
    return out


def test_the_estimator_follows_cel_go_formulas() -> None:
    """The estimator on small shapes, worked out by hand from cel-go's checker/cost.go."""
    node = {
        "type": "object",
        "properties": {
            "s": {"type": "string", "maxLength": 10},
            "n": {"type": "integer"},
            "l": {"type": "array", "maxItems": 5, "items": {"type": "string", "maxLength": 4}},
        },
    }
    assert estimate("self.n >= 2", node) == 3  # ident 1, select 1, compare 1
    assert estimate("self.s == 'abc'", node) == 3  # 2 + ceil(min(10, 3) * 0.1)
    assert estimate("self.s.matches('^ab$')", node) == 2 + 2 * 1  # ceil(11 * .1) * ceil(4 * .25)
    assert estimate("self.l.all(x, x == 'a')", node) == 2 + 5 * (2 + 3)  # 5 x (body + step)
    assert estimate("self.l.size() + 1 > self.n", node) == 2 + 1 + 1 + 2 + 1
    unbounded = {"type": "object", "properties": {"s": {"type": "string"}}}
    assert estimate("self.s == self.s", unbounded) == 4 + _ceil((MAX_REQUEST_BYTES - 2) * 0.1)


def test_every_rule_cost_is_bounded() -> None:
    """Each rule times how often it runs, and each messageExpression, under half of the API
    server's per-expression limit (the estimate approximates cel-go's); all under its CRD
    total. Every list a rule iterates, or a rule sits in, is bounded by maxItems."""
    total = 0
    for path, node, r in RULES:
        cost = estimate(r["rule"], node) * _cardinality(path)
        assert cost <= STATIC_RULE_LIMIT // 2, (path, r["rule"][:80], cost)
        total += cost
        if "messageExpression" in r:
            said = estimate(r["messageExpression"], node)
            assert said <= STATIC_RULE_LIMIT // 2, (path, r["messageExpression"][:80], said)
            total += said
        for inside in re.finditer(r"\[\]", path):  # lists a rule runs inside
            assert "maxItems" in _node_at(path[: inside.start()]), (path, r["rule"][:60])
        loops = r"\b(?:self|oldSelf)((?:\.[A-Za-z_]+)+)\.(?:all|exists|exists_one|filter)\("
        for loop in re.findall(loops, r["rule"]):  # lists a rule iterates
            walked = _resolve(node, loop)
            assert walked is not None and "maxItems" in walked, (path, loop)
    assert total <= STATIC_CRD_LIMIT // 2, total


def _node_at(path: str) -> dict[str, Any]:
    node = SCHEMA
    for step in re.findall(r"\.[A-Za-z]+|\[\]|\{\}", path):
        key = {"[]": "items", "{}": "additionalProperties"}.get(step)
        node = node[key] if key else node["properties"][step[1:]]
    return node


def test_rules_see_values_typed_as_kubernetes_types_them() -> None:
    """`number` fields are doubles even when written 1; null properties read as absent."""
    node = SCHEMA["properties"]["spec"]["properties"]["algorithm"]
    value = to_cel({"clipLow": 1, "clipHigh": None}, node)
    assert evaluate("self.clipLow > 0.5 && !has(self.clipHigh)", value)
