"""The spec's cross-field rules, each declared once: `gspo validate` runs its Python side
(`check`, validation.check_spec), the API server its CEL side (`cel`, the CRD's
x-kubernetes-validations, gspo_operator.crd_rules), and tests/contract/test_crd_cel.py keeps
the two in agreement on hand-written and generated specs.

A `Rule` sits on one object of the spec (`at`, "" for the spec itself): its CEL reads that
object as `self`, its `check` reads the whole validated spec. An `ItemRule` sits on each
item of a list (`at` ends in `[]`): its CEL and its `check` both read one item. Either
refuses `field` (below `at`) with `message`, which names the problem and ends with the fix;
where validate can print the values it judged, `said` words the message with them. The CEL
is written for Kubernetes 1.30+ with the standard library and macros only (crd_rules'
docstring says why, and what else it relies on).

Rules across a list's items are here where both sides name the list: reward.functions'
unique names and its one code component (a `Rule` on the list) and its length targets (one
on the spec, which also reads algorithm.maxResponseTokens). Rules that are not here: those
the API server cannot see; those across a list's items where validate names the item and the
CRD can only name the list (the pods' volume names and mounts: validation.check_pod_settings,
crd_rules._pod_rules); and the CRD's own (object names, what may change in flight:
crd_rules).

The table by what its rules judge: `shape` (the algorithm's batches, the model, ZeRO, tensor
parallelism, the checkpoint claim), `pods` (GPUs, the status port, volumes, mounts, env),
`reward` (reward.kind/function or reward.functions, the sandbox); `rule` holds the two kinds.
RULES is their order: validate reports in it, and each schema node lists its rules in it.
"""

from __future__ import annotations

from typing import Any

from gspo_api.rules.pods import (
    GPU_RESOURCE,
    POD_ITEM_RULES,
    POD_RULES,
    RESERVED_MOUNT_PATHS,
    RESERVED_VOLUMES,
    ROLES,
    mount_point,
)
from gspo_api.rules.reward import (
    REWARD_ENTRY_RULES,
    REWARD_RULES,
    SANDBOX_RULES,
    module_function,
)
from gspo_api.rules.rule import FORBIDDEN, INVALID, ItemRule, Rule, lit, prop
from gspo_api.rules.shape import CHECKPOINT_RULES, SHAPE_RULES

RULES: tuple[Rule | ItemRule[Any], ...] = (
    *SHAPE_RULES,
    *CHECKPOINT_RULES,
    *POD_RULES,
    *POD_ITEM_RULES,
    *SANDBOX_RULES,
    *REWARD_RULES,
    *REWARD_ENTRY_RULES,
)

__all__ = [
    "FORBIDDEN",
    "GPU_RESOURCE",
    "INVALID",
    "RESERVED_MOUNT_PATHS",
    "RESERVED_VOLUMES",
    "ROLES",
    "RULES",
    "ItemRule",
    "Rule",
    "lit",
    "module_function",
    "mount_point",
    "prop",
]
