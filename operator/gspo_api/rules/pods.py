"""The rules on what the learner's and rollout servers' pods are given: GPUs, the status
port, volumes, mounts and env (each item alone; what needs its siblings is
validation.check_pod_settings' and crd_rules')."""

from __future__ import annotations

import re
from typing import Any

from gspo_api.ports import RESERVED_PORTS
from gspo_api.rules.rule import ItemRule, Rule, lit
from gspo_api.spec import (
    VOLUME_SOURCES,
    EnvVar,
    GSPOJobSpec,
    LearnerConfig,
    RolloutConfig,
    Volume,
    VolumeMount,
)

# --- what the pods are given: GPUs, the status port --------------------------------------

GPU_RESOURCE = "nvidia.com/gpu"
ROLES = ("learner", "rollout")
_GPUS_ONCE = (
    "GPUs are stated once: remove this entry (the operator sets requests and limits from "
    "gpusPerReplica) or make them equal"
)


def _pods(spec: GSPOJobSpec, role: str) -> LearnerConfig | RolloutConfig:
    return spec.learner if role == "learner" else spec.rollout


def _gpus_agree(pods: LearnerConfig | RolloutConfig, section: str) -> bool:
    """A GPU count under resources equals gpusPerReplica, as text: 8 and "8" agree, "08" not."""
    gpus = getattr(pods.resources, section).get(GPU_RESOURCE)
    return gpus is None or str(gpus) == str(pods.gpus_per_replica)


def _gpu_rule(role: str, section: str) -> Rule:
    gpus = f"self.resources.{section}[{lit(GPU_RESOURCE)}]"
    # An int-or-string: cel-python raises on comparing an int with a string, so test its type.
    as_int, as_text = f"{gpus} == self.gpusPerReplica", f"{gpus} == string(self.gpusPerReplica)"
    same = f"type({gpus}) == int ? {as_int} : {as_text}"
    return Rule(
        at=role,
        field=f"resources.{section}[{GPU_RESOURCE}]",
        cel=f"!({lit(GPU_RESOURCE)} in self.resources.{section}) || ({same})",
        check=lambda s: _gpus_agree(_pods(s, role), section),
        message=f"disagrees with {role}.gpusPerReplica; {_GPUS_ONCE}",
        said=lambda s, _: (
            f"{getattr(_pods(s, role).resources, section)[GPU_RESOURCE]} disagrees with "
            f"{role}.gpusPerReplica={_pods(s, role).gpus_per_replica}; {_GPUS_ONCE}"
        ),
    )


_PORTS = ", ".join(str(p) for p in RESERVED_PORTS)
# Whole messages as the values of a CEL map: constant strings have a known size, printed
# numbers do not (crd_rules' docstring).
_PORT_MESSAGES = ", ".join(
    f"{p}: {lit(f'{p} is used by {who}; pick another')}" for p, who in RESERVED_PORTS.items()
)
POD_RULES = (
    *(_gpu_rule(role, section) for role in ROLES for section in ("requests", "limits")),
    Rule(
        at="metrics",
        field="port",
        cel=f"!(self.port in [{_PORTS}])",
        check=lambda s: s.metrics.port not in RESERVED_PORTS,
        message=f"is a port the pods use already ({_PORTS}); pick another",
        said=lambda s, _: (
            f"{s.metrics.port} is used by {RESERVED_PORTS[s.metrics.port]}; pick another"
        ),
        message_expression=f"{{{_PORT_MESSAGES}}}[self.port]",
    ),
)


# --- the pods' volumes, mounts and env, each item alone ------------------------------------

# Volumes and mount paths of the pod contract (render.py); user volumes may not reuse them.
RESERVED_VOLUMES = ("config", "checkpoints", "dshm", "home", "tmp", "model-cache")
RESERVED_MOUNT_PATHS = ("/etc/gspo", "/checkpoints", "/dev/shm", "/home/gspo", "/tmp")
_ALLOWED_SOURCES = ", ".join(VOLUME_SOURCES)
_CEL_SOURCES = " + ".join(f"(has(self.{s}) ? 1 : 0)" for s in VOLUME_SOURCES)
# ", ".join(the sources set) or "none", as validate words it.
_CEL_SOURCES_SET = " + ".join(
    f"(has(self.{source}) ? "
    f"({' || '.join(f'has(self.{s})' for s in VOLUME_SOURCES[:i]) or 'false'} ? "
    f"{lit(', ' + source)} : {lit(source)}) : '')"
    for i, source in enumerate(VOLUME_SOURCES)
)
_CEL_RESERVED_MOUNT = "|".join(re.escape(p) for p in RESERVED_MOUNT_PATHS)


def mount_point(mount: VolumeMount) -> str:
    """A mountPath without its trailing slashes (`/data/` and `/data` name one mount point)."""
    return mount.mount_path.rstrip("/") or "/"


def _role_item_rules(role: str) -> tuple[ItemRule[Any], ...]:
    volumes: ItemRule[Volume] = ItemRule(
        at=f"{role}.volumes[]",
        field="",
        cel=f"{_CEL_SOURCES} == 1",
        items=lambda s: _pods(s, role).volumes,
        check=lambda v: len(v.sources()) == 1,
        message=f"needs exactly one volume source; allowed: {_ALLOWED_SOURCES}",
        said=lambda v, _: (
            f"needs exactly one volume source (got {', '.join(v.sources()) or 'none'}); "
            f"allowed: {_ALLOWED_SOURCES}"
        ),
        message_expression=(
            f"'needs exactly one volume source (got ' + ({_CEL_SOURCES} == 0 ? 'none' : "
            f"{_CEL_SOURCES_SET}) + '); allowed: {_ALLOWED_SOURCES}'"
        ),
    )
    names: ItemRule[Volume] = ItemRule(
        at=f"{role}.volumes[]",
        field="name",
        cel=f"!(self.name in [{', '.join(lit(v) for v in RESERVED_VOLUMES)}])",
        items=lambda s: _pods(s, role).volumes,
        check=lambda v: v.name not in RESERVED_VOLUMES,
        message="is a volume the operator adds; rename it",
        said=lambda v, m: f"{v.name!r} {m}",
        message_expression='"\'" + self.name + "\' is a volume the operator adds; rename it"',
    )
    mounts: ItemRule[VolumeMount] = ItemRule(
        at=f"{role}.volumeMounts[]",
        field="mountPath",
        cel=f"!self.mountPath.matches({lit(f'^({_CEL_RESERVED_MOUNT})/*$')})",
        items=lambda s: _pods(s, role).volume_mounts,
        check=lambda m: mount_point(m) not in RESERVED_MOUNT_PATHS,
        message="is mounted by the operator; mount somewhere else",
        said=lambda mount, m: f"{mount_point(mount)} {m}",
    )
    env: ItemRule[EnvVar] = ItemRule(
        at=f"{role}.env[]",
        field="",
        cel="!(has(self.value) && has(self.valueFrom))",
        items=lambda s: _pods(s, role).env,
        check=lambda e: e.value is None or e.value_from is None,
        message="sets both value and valueFrom; keep one",
    )
    return volumes, names, mounts, env


POD_ITEM_RULES = tuple(rule for role in ROLES for rule in _role_item_rules(role))
