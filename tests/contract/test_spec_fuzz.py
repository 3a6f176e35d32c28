"""Generated GSPOJob specs thrown at the validation: it never crashes, and every rejection
names a field that exists in the spec and says what to do."""

from __future__ import annotations

import copy
import json
import re
from contextlib import suppress
from typing import Any

import pytest
import yaml
from checkout import REPO
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from rendered_checks import check_rendered

from gspo_api.validation import SpecError, parse_spec

EXAMPLE = yaml.safe_load((REPO / "examples" / "gspojob.yaml").read_text())["spec"]


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += _paths(value, (*prefix, i))
    return out


PATHS = _paths(EXAMPLE)
KEYS = st.text(alphabet="abcdefgxyzAZ019_", min_size=1, max_size=10)
junk = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**40), max_value=2**40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)
mutation = st.tuples(
    st.sampled_from(["set", "delete", "add"]),
    st.sampled_from(PATHS),
    junk,
    KEYS,
)


def _apply(spec: dict[str, Any], op: str, path: tuple[Any, ...], value: Any, key: str) -> None:
    parent: Any = spec
    for part in path[:-1]:
        parent = parent[part]
    last = path[-1]
    if op == "set":
        parent[last] = value
    elif op == "delete" and isinstance(parent, dict):
        parent.pop(last, None)
    elif op == "add" and isinstance(parent, dict):
        parent[key] = value


def _names_a_field(path: str, spec: Any) -> bool:
    """`spec.a.b[0][x.y/z]["a]b"].c` walks through the spec given; only the last step may be
    missing. A bracketed key in double quotes is JSON (it holds a bracket or a quote)."""
    if not path.startswith("spec"):
        return False
    parts = re.findall(
        r'\.([^.\[]+)|\[("(?:[^"\\]|\\.)*")\]|\[([^\]]+)\]', path.removeprefix("spec")
    )
    if "".join(f".{a}" if a else f"[{b or c}]" for a, b, c in parts) != path.removeprefix("spec"):
        return False  # the path does not read as a whole
    node = spec
    for i, (name, quoted, bracketed) in enumerate(parts):
        key: Any = name or (json.loads(quoted) if quoted else bracketed)
        if isinstance(node, list) and bracketed.isdigit() and int(bracketed) < len(node):
            node = node[int(bracketed)]
        elif isinstance(node, dict) and key in node:
            node = node[key]
        elif i < len(parts) - 1:
            return False
    return True


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(mutation, min_size=1, max_size=4))
def test_validation_never_crashes_and_names_fields(mutations: list[Any]) -> None:
    spec = copy.deepcopy(EXAMPLE)
    for op, path, value, key in mutations:
        with suppress(KeyError, IndexError, TypeError):  # a parent was removed or replaced
            _apply(spec, op, path, value, key)
    try:
        parse_spec(spec)
    except SpecError as exc:
        assert exc.problems
        for problem in exc.problems:
            assert _names_a_field(problem.path, spec), problem
            assert len(problem.message) > 10, problem


@settings(max_examples=100, deadline=None)
@given(junk)
def test_any_value_as_the_whole_spec_is_refused_or_accepted_cleanly(value: Any) -> None:
    try:
        parse_spec(value)
    except SpecError as exc:
        assert all(p.path.startswith("spec") for p in exc.problems)


# --- accepted specs render to objects the Kubernetes schemas accept -----------------------

EXAMPLE_DOC = yaml.safe_load((REPO / "examples" / "gspojob.yaml").read_text())
ENV_NAME = st.from_regex(r"[A-Z_][A-Z0-9_]{0,12}", fullmatch=True)
LABEL_TEXT = st.text(alphabet="abcxyz0189-._/", min_size=0, max_size=20)


def _dig(node: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        node = node[part]
    return node


def _set(spec: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    node: Any = spec
    for part in path[:-1]:
        node = node[part] if isinstance(node, list) else node.setdefault(part, {})
    node[path[-1]] = value


def _like(value: Any) -> st.SearchStrategy[Any]:
    """A value of the same type as `value`: mostly plausible, so that many specs pass."""
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return st.integers(min_value=-2, max_value=max(2 * value, 70000))
    if isinstance(value, float):
        return st.floats(min_value=-1.0, max_value=max(2 * value, 2.0), allow_nan=False)
    if isinstance(value, str):
        return st.sampled_from([value, value.upper(), value + "-x"]) | st.text(max_size=16)
    return st.just(value)


SCALARS = [p for p in PATHS if not isinstance(_dig(EXAMPLE, p), dict | list)]
typed_mutation = st.sampled_from(SCALARS).flatmap(
    lambda path: st.tuples(st.just(path), _like(_dig(EXAMPLE, path)))
)
extras = st.fixed_dictionaries(
    {},
    optional={
        ("learner", "env"): st.lists(
            st.fixed_dictionaries({"name": ENV_NAME, "value": st.text(max_size=12)}),
            max_size=3,
        ),
        ("rollout", "engineArgs"): st.dictionaries(
            st.from_regex(r"[a-z_]{1,12}", fullmatch=True),
            st.integers(0, 9) | st.booleans() | st.text(max_size=8),
            max_size=3,
        ),
        ("runPolicy", "scheduling", "nodeSelector"): st.dictionaries(
            LABEL_TEXT, LABEL_TEXT, max_size=2
        ),
        ("checkpoint", "claimName"): st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True),
        ("checkpoint", "storageClassName"): st.text(max_size=10),
        ("metrics", "podMonitor"): st.booleans(),
        ("runPolicy", "suspend"): st.booleans(),
        ("weightSync", "method"): st.sampled_from(["broadcast", "filesystem", "nope"]),
    },
)
job_name = st.from_regex(r"[a-z][a-z0-9-]{0,55}", fullmatch=True) | st.text(max_size=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(typed_mutation, max_size=3), extras, job_name)
def test_accepted_specs_render_to_valid_kubernetes_objects(
    mutations: list[Any], extra: dict[tuple[str, ...], Any], name: str
) -> None:
    from gspo_operator.manifest import check_job
    from gspo_operator.render import render_job

    doc = copy.deepcopy(EXAMPLE_DOC)
    doc["metadata"] = {"name": name, "namespace": "team-a", "uid": "0b5e8a76-0000-4000-8000-1"}
    for path, value in [*mutations, *extra.items()]:
        _set(doc["spec"], path, value)
    spec, problems = check_job(doc)
    if spec is None:
        event("rejected")
        assert problems and all(p.path.startswith(("spec", "metadata")) for p in problems)
        return
    event("accepted and rendered")
    objs = render_job(doc, spec, token="t0ken")
    assert check_rendered(objs) == []


def test_a_key_holding_a_bracket_is_named_as_one_step_of_the_path() -> None:
    spec = copy.deepcopy(EXAMPLE)
    for key, shown in [("0].", 'spec.model["0]."]'), ("", 'spec.model[""]')]:
        spec["model"] = {key: None}
        with pytest.raises(SpecError) as exc:
            parse_spec(spec)
        paths = [p.path for p in exc.value.problems]
        assert shown in paths, paths
        assert all(_names_a_field(p, spec) for p in paths), paths
