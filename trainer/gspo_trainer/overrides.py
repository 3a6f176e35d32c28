"""`--set path=value`: any spec field from the command line, as Helm's --set and Hydra's
overrides write it (`algorithm.groupSize=8`, `reward.functions[0].weight=2`,
`data.chatTemplateKwargs.enable_thinking=false`).

The value is read as YAML (8 is a number, true a boolean, [a, b] a list, null removes the
field, whose default then applies); the
path may start with `spec.` and may spell a field in snake_case (group_size), as Hydra users
write it. Overrides only edit the manifest: the result is validated like the file, so a bad
value or an unknown field is refused with its spec path.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from pydantic import BaseModel

from gspo_api.spec import GSPOJobSpec
from gspo_api.validation import _model_of

_SEGMENT = re.compile(r"([^.\[\]]+)((?:\[\d+\])*)")


class OverrideError(ValueError):
    """A --set the command line cannot apply; the message names it and the fix."""


def parse_path(path: str) -> list[str | int]:
    """ "a.b[0].c" -> ["a", "b", 0, "c"]; a leading "spec." is dropped, and a dot inside a
    key is escaped as Helm's is (learner.labels.app\\.kubernetes\\.io/name)."""
    path = path.removeprefix("spec.")
    parts: list[str | int] = []
    for segment in path.replace("\\.", "\0").split("."):
        match = _SEGMENT.fullmatch(segment)
        if match is None:
            raise OverrideError(
                f"{path!r} is not a field path; write it like "
                "algorithm.groupSize or reward.functions[0].weight"
            )
        parts.append(match.group(1).replace("\0", "."))
        parts.extend(int(i) for i in re.findall(r"\[(\d+)\]", match.group(2)))
    return parts


def spec_names(parts: list[str | int]) -> list[str | int]:
    """Each field name as the manifest spells it (camelCase), found by walking the spec
    models; keys below a free-form mapping (engineArgs, labels) are left as written."""
    model: type[BaseModel] | None = GSPOJobSpec
    out: list[str | int] = []
    for part in parts:
        if isinstance(part, int) or model is None:
            out.append(part)
            continue
        fields = dict(model.model_fields)
        by_alias = {(f.alias or n): f for n, f in fields.items()}
        field = by_alias.get(part) or fields.get(part)
        if field is None:  # unknown: validation names it with the fields allowed
            out.append(part)
            model = None
            continue
        out.append(field.alias or part)
        model = _model_of(field.annotation)
    return out


def _shown(parts: list[str | int]) -> str:
    text = "spec"
    for p in parts:
        text += f"[{p}]" if isinstance(p, int) else f".{p}"
    return text


def apply_override(spec: dict[str, Any], assignment: str) -> None:
    """Set one `path=value` in the manifest's spec mapping, in place."""
    path, eq, raw = assignment.partition("=")
    if not eq or not path.strip():
        raise OverrideError(
            f"--set {assignment!r}: write it as path=value, e.g. --set algorithm.groupSize=8"
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0]
        message = f"--set {assignment!r}: the value is not YAML ({first}); quote it"
        raise OverrideError(message) from exc
    try:
        parts = spec_names(parse_path(path.strip()))
    except OverrideError as exc:
        raise OverrideError(f"--set {assignment!r}: {exc}") from exc
    node: Any = spec
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        where = _shown(parts[:i])
        if isinstance(part, int):
            if not isinstance(node, list):
                raise OverrideError(f"--set {assignment!r}: {where} is not a list")
            if part > len(node):
                raise OverrideError(
                    f"--set {assignment!r}: {where} has {len(node)} items; "
                    f"index {part} would leave a gap"
                )
            if part == len(node):
                node.append(None if last else {})
        elif not isinstance(node, dict):
            raise OverrideError(f"--set {assignment!r}: {where} is not a mapping")
        if last:
            if value is None and isinstance(node, dict):  # as Helm's: the default applies
                node.pop(part, None)
            else:
                node[part] = value
            return
        child = node[part] if isinstance(part, int) else node.get(part)  # a list, else a dict
        if child is None:
            child = [] if isinstance(parts[i + 1], int) else {}
            node[part] = child
        node = child


def apply_overrides(spec: dict[str, Any], assignments: list[str]) -> dict[str, Any]:
    """The spec with every assignment applied in order (later ones win)."""
    for assignment in assignments:
        apply_override(spec, assignment)
    return spec
