"""The rules' table (gspo_api.rules), rule by rule: the CRD carries each rule's CEL on the node
its `at` names, and on every spec the CEL (cel-python, on the object as the API server stores
it) and the Python `check` (on the validated spec) give one answer; where the CEL says
validate's words (a messageExpression), they are the same words.

test_crd_cel.py compares what the API server and `gspo validate` refuse as a whole (by field
and fix); this compares each declared rule with itself, on the same specs.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from cel_admission import default, evaluate, to_cel
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_crd_cel import EXAMPLE, POD_CASES, RULES, SCHEMA, SPEC_CASES, job, models_take
from test_spec_fuzz import extras, typed_mutation

from gspo_api.rules import RULES as TABLE
from gspo_api.rules import ItemRule, Rule
from gspo_api.spec import GSPOJobSpec


def _where(declared: Rule | ItemRule[Any]) -> str:
    """The schema path (as cel_admission.rules_of writes it) of the node `at` names."""
    return ".spec" + "".join(f".{part}" for part in declared.at.split(".") if part)


def _attached(declared: Rule | ItemRule[Any]) -> dict[str, Any]:
    """The schema node the CRD carries `declared` on (exactly once, with its fieldPath)."""
    found = [
        (node, r)
        for path, node, r in RULES
        if path == _where(declared) and r["rule"] == declared.cel
    ]
    assert len(found) == 1, (declared.at, declared.cel, len(found))
    node, r = found[0]
    field_path = f".{declared.field}".replace("[", "['").replace("]", "']")
    assert r.get("fieldPath") == (field_path if declared.field else None), r
    assert (r["message"], r.get("messageExpression")) == (
        declared.message,
        declared.message_expression,
    )
    return node


NODES = [_attached(declared) for declared in TABLE]


def _dig(stored: dict[str, Any], at: str) -> Any:
    """The stored value at `at` ("model.moe", "reward.functions[]": the list); None if absent."""
    value: Any = stored
    for part in filter(None, at.removesuffix("[]").split(".")):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _agree(
    declared: Rule | ItemRule[Any], node: dict[str, Any], raw: Any, holds: bool, said: str
) -> None:
    value = to_cel(raw, node)
    assert bool(evaluate(declared.cel, value)) == holds, (declared.at, declared.field, raw)
    if not holds and declared.message_expression:
        assert str(evaluate(declared.message_expression, value)) == said, declared.cel


def assert_each_rule_agrees(doc: dict[str, Any]) -> int:
    """Every declared rule judges `doc` alike on both sides; how many refused it."""
    stored = default(SCHEMA, doc)["spec"]
    spec = GSPOJobSpec.model_validate(doc["spec"])
    refused = 0
    for declared, node in zip(TABLE, NODES, strict=True):
        raw = _dig(stored, declared.at)
        if isinstance(declared, ItemRule):
            items = declared.items(spec)
            assert len(raw or []) == len(items), declared.at
            for one, item in zip(raw or [], items, strict=True):
                holds = declared.check(item)
                said = declared.said(item, declared.message) if declared.said else declared.message
                _agree(declared, node, one, holds, said)
                refused += not holds
        elif raw is None:  # the API server runs no rule on an absent object
            assert declared.check(spec), (declared.at, declared.field)
        else:
            problems = declared.refusals(spec)
            _agree(declared, node, raw, not problems, problems[0][1] if problems else "")
            refused += bool(problems)
    return refused


@pytest.mark.parametrize(("sections", "path", "words"), SPEC_CASES.CROSS_FIELD_CASES)
def test_each_rule_agrees_on_the_cross_field_cases(sections: dict, path: str, words: str) -> None:
    assert_each_rule_agrees(job(SPEC_CASES.minimal(**sections)))


@pytest.mark.parametrize(("learner", "expected"), POD_CASES.BAD_POD_SETTINGS)
def test_each_rule_agrees_on_the_pod_settings_cases(learner: dict, expected: str) -> None:
    doc = copy.deepcopy(POD_CASES.EXAMPLE)
    doc["spec"]["learner"] = {**doc["spec"].get("learner", {}), **learner}
    assert_each_rule_agrees(doc)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(typed_mutation, max_size=3), extras)
def test_each_rule_agrees_on_generated_specs(
    mutations: list[Any], extra: dict[tuple[str, ...], Any]
) -> None:
    doc = copy.deepcopy(EXAMPLE)
    if models_take(doc, mutations, extra):
        event("refused by a rule" if assert_each_rule_agrees(doc) else "accepted by every rule")
