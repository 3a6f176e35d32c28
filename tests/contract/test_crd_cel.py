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
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
from cel_cost import (
    MAX_REQUEST_BYTES,
    STATIC_CRD_LIMIT,
    STATIC_RULE_LIMIT,
    _ceil,
    cardinality,
    estimate,
    max_items,
    max_length,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from test_spec_fuzz import extras, typed_mutation

from gspo_api.spec import GSPOJobSpec
from gspo_api.validation import Problem
from gspo_operator import names
from gspo_operator.crd import render_crd
from gspo_operator.crd_rules import REJECTED_AT_CREATION
from gspo_operator.manifest import check_job
from gspo_operator.status import MUTABLE_FIELDS

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
    "per GPU and the GPU has",  # the memory plan: the model's config.json, not the spec
    "and vLLM refuses to start",  # likewise, a rollout server's GPU
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
            "map",
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


def test_a_sandbox_pod_setting_beside_a_local_service_url_is_refused_once_alike() -> None:
    """Mode local with a serviceUrl and a sandbox pod setting: both are read in mode service
    only, and that is all either side says; the own-service rule (remove serviceUrl to have
    the pods run) speaks in mode service alone, where removing serviceUrl does run them."""
    sandbox = {"mode": "local", "serviceUrl": "http://s:1", "replicas": 2}
    found = assert_cel_agrees(job(SPEC_CASES.minimal(reward={"kind": "code", "sandbox": sandbox})))
    assert sorted(f.field for f in found) == [
        "spec.reward.sandbox.replicas",
        "spec.reward.sandbox.serviceUrl",
    ]
    assert not any("remove serviceUrl" in f.message for f in found), [str(f) for f in found]


def test_a_sandbox_without_a_code_reward_is_refused_alike_with_one_fix() -> None:
    """No code reward, mode service: both sides say remove mode, and neither asks for the
    runtimeClassName of sandbox pods that never run (the API server would otherwise admit the
    job once it is given, for the operator to fail it)."""
    for reward in ({"kind": "math"}, {"functions": [{"name": "f", "kind": "format"}]}):
        doc = job(SPEC_CASES.minimal(reward={**reward, "sandbox": {"mode": "service"}}))
        found = assert_cel_agrees(doc)
        assert [f.field for f in found] == ["spec.reward.sandbox.mode"], [str(f) for f in found]


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
    doc = copy.deepcopy(EXAMPLE)
    doc["metadata"]["name"] = name
    if models_take(doc, mutations, extra):
        event("refused" if assert_cel_agrees(doc) else "accepted")


def models_take(
    doc: dict[str, Any], mutations: list[Any], extra: dict[tuple[str, ...], Any]
) -> bool:
    """Sets test_spec_fuzz's generated values in `doc`'s spec; whether the models take it,
    field by field as the CRD's OpenAPI schema would (a refusal there comes before CEL)."""
    from test_spec_fuzz import _set

    for path, value in [*mutations, *extra.items()]:
        _set(doc["spec"], path, value)
    try:
        GSPOJobSpec.model_validate(doc["spec"])
    except ValidationError:
        event("a field-level refusal (the OpenAPI schema's, before CEL)")
        return False
    return True


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
    from gspo_operator.status import rejected_at_creation

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
    # An invalid edit (InvalidSpec, reason InvalidSpec) of a job whose children exist, which
    # then failed: its fields stay frozen.
    failed_after_an_invalid_edit = {
        "phase": "Failed",
        "conditions": [
            {"type": "Created", "status": "True", "reason": "ChildrenCreated"},
            *refused["conditions"][:1],
            {"type": "Failed", "status": "True", "reason": "FailedJobs", "message": "..."},
        ],
    }
    old = copy.deepcopy(EXAMPLE)
    new = copy.deepcopy(old)
    new["spec"]["algorithm"]["learningRate"] = 0.5
    cases = (
        (refused, True),
        (running, False),
        (changed_later, False),
        (failed_after_an_invalid_edit, False),
    )
    for status, editable in cases:
        assert rejected_at_creation(status) == editable
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
    assert estimate("self.s == 'abc'", node) == 3  # 2 + ceil(min(4 x 10, 3) * 0.1)
    assert estimate("self.s.matches('^ab$')", node) == 2 + 5 * 1  # ceil(41 * .1) * ceil(4 * .25)
    assert estimate("self.s == self.s", node) == 4 + 4  # ceil(min(40, 40) * 0.1)
    assert estimate("self.l.all(x, x == 'a')", node) == 2 + 5 * (2 + 3)  # 5 x (body + step)
    # 5 x (x 1, self.s 2, compare ceil(min(16, 40) * 0.1) = 2, step 3)
    assert estimate("self.l.all(x, x == self.s)", node) == 2 + 5 * (1 + 2 + 2 + 3)
    assert estimate("self.l.size() + 1 > self.n", node) == 2 + 1 + 1 + 2 + 1
    unbounded = {"type": "object", "properties": {"s": {"type": "string"}}}
    assert estimate("self.s == self.s", unbounded) == 4 + _ceil((MAX_REQUEST_BYTES - 2) * 0.1)


def test_sizes_follow_the_api_servers_declared_types() -> None:
    """apiserver/pkg/cel/common/schemas.go: 4 bytes per character of maxLength, an enum's
    longest value, the request limit otherwise; lists and maps sized by their items' smallest
    JSON when unbounded; rules under an unbounded list run as often as their node fits."""
    assert max_length({"type": "string", "maxLength": 253}) == 1012
    assert max_length({"type": "string", "enum": ["all", "learner"]}) == 7
    assert max_length({"type": "string"}) == MAX_REQUEST_BYTES - 2
    assert max_length({"x-kubernetes-int-or-string": True}) == MAX_REQUEST_BYTES - 2
    strings = {"type": "array", "items": {"type": "string"}}
    assert max_items(strings) == (MAX_REQUEST_BYTES - 2) // 3
    assert max_items({**strings, "maxItems": 8}) == 8
    ints = {"type": "object", "additionalProperties": {"type": "integer"}}
    assert max_items(ints) == (MAX_REQUEST_BYTES - 2) // 7
    item = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}
    schema = {"type": "object", "properties": {"l": {"type": "array", "items": item}}}
    assert cardinality(schema, ".l[]") == MAX_REQUEST_BYTES // (2 + len("name") + 2 + 4 + 1)
    schema["properties"]["l"]["maxItems"] = 16
    assert cardinality(schema, ".l[]") == 16


def test_every_rule_cost_is_bounded() -> None:
    """Each rule times how often it runs, and each messageExpression, under half of the API
    server's per-expression limit (the estimate follows cel-go's and the API server's sizes;
    half leaves room for a schema change); all under half of its CRD total. Every list a rule
    iterates, or a rule sits in, is bounded by maxItems."""
    total = 0
    for path, node, r in RULES:
        cost = estimate(r["rule"], node) * cardinality(SCHEMA, path)
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
