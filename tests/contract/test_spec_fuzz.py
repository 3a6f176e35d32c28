"""Generated GSPOJob specs thrown at the validation: it never crashes, and every rejection
names a field that exists in the spec and says what to do."""

from __future__ import annotations

import copy
import re
from contextlib import suppress
from typing import Any

import yaml
from checkout import REPO
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gspo_trainer.validation import SpecError, parse_spec

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
    """`spec.a.b[0][x.y/z].c` walks through the spec given; only the last step may be missing."""
    if not path.startswith("spec"):
        return False
    parts = re.findall(r"\.([^.\[]+)|\[([^\]]+)\]", path.removeprefix("spec"))
    node = spec
    for i, (name, bracketed) in enumerate(parts):
        key: Any = name or bracketed
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
