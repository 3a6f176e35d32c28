"""The two kinds of declared rule and the CEL helpers they are written with (see the
package's docstring)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from gspo_api.spec import GSPOJobSpec

T = TypeVar("T")
# The API server's reasons (field.ErrorType); a rule's `reason` says which one it refuses with.
INVALID, FORBIDDEN = "FieldValueInvalid", "FieldValueForbidden"
# Kubernetes escapes a property named like one of these (apiserver/pkg/cel/escaping.go).
CEL_KEYWORDS = frozenset(
    {
        *("true", "false", "null", "in", "as", "break", "const", "continue", "else", "for"),
        *("function", "if", "import", "let", "loop", "package", "namespace", "return", "var"),
        *("void", "while"),
    }
)


def lit(value: str) -> str:
    """A CEL string literal (JSON's double-quoted form is valid CEL)."""
    return json.dumps(value)


def prop(name: str) -> str:
    """A property as CEL reads it (Kubernetes escapes keywords: `function` -> `__function__`)."""
    return f"__{name}__" if name in CEL_KEYWORDS else name


@dataclass(frozen=True)
class Rule:
    """One cross-field rule: where it sits, what it refuses, and the same test said twice."""

    at: str  # the object the CEL rule sits on, from the spec: "algorithm", "model.moe", ""
    field: str  # the field refused, below `at`: "groupSize" ("" for `at` itself)
    cel: str  # the rule for the API server, reading the object at `at` as `self`
    check: Callable[[GSPOJobSpec], bool]  # the same rule in Python: True when it holds
    message: str  # what is wrong and the fix, in words the API server can say
    # validate's words, given the spec and `message` (default: the message as it is).
    said: Callable[[GSPOJobSpec, str], str] | None = None
    message_expression: str | None = None  # CEL saying validate's very words, where it can
    reason: str = INVALID

    def refusals(self, spec: GSPOJobSpec) -> list[tuple[str, str]]:
        """(path below `spec`, validate's message) when `spec` breaks this rule."""
        if self.check(spec):
            return []
        path = ".".join(p for p in (self.at, self.field) if p)
        return [(path, self.said(spec, self.message) if self.said else self.message)]


@dataclass(frozen=True)
class ItemRule(Generic[T]):
    """A rule on each item of a list (`at` ends in `[]`): its CEL and its `check` both read
    one item; validate names the item by its index (`learner.volumes[2].name`)."""

    at: str  # the list's items, from the spec: "reward.functions[]"
    field: str  # the item's field refused ("" for the item itself)
    cel: str  # the rule for the API server, reading one item as `self`
    items: Callable[[GSPOJobSpec], Sequence[T]]  # the list, read off the validated spec
    check: Callable[[T], bool]  # the same rule in Python, on one item: True when it holds
    message: str
    said: Callable[[T, str], str] | None = None  # validate's words, given the item
    message_expression: str | None = None
    reason: str = INVALID

    def refusals(self, spec: GSPOJobSpec) -> list[tuple[str, str]]:
        """(path below `spec`, validate's message) for each item that breaks this rule."""
        listed = self.at.removesuffix("[]")
        return [
            (
                ".".join(p for p in (f"{listed}[{i}]", self.field) if p),
                self.said(item, self.message) if self.said else self.message,
            )
            for i, item in enumerate(self.items(spec))
            if not self.check(item)
        ]
