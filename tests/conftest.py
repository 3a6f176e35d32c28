"""Shared test fixtures, and how `make test` shares the suite among pytest-xdist's workers."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

# The API stand-in (operator/) and the local cluster (cluster/) are shared by both suites.
HERE = Path(__file__).resolve().parent
for shared in ("operator", "cluster"):
    if str(HERE / shared) not in sys.path:
        sys.path.insert(0, str(HERE / shared))
from checkout import run_gspo  # noqa: E402 (after the paths above)


@pytest.fixture
def gspo():
    return run_gspo


# --- the suite over several workers (`make test`: pytest -n 3 --dist loadscope) -------------
# Most of the suite's time is its process tests (vLLM servers, torchrun learners, the local
# cluster's pods), which wait on imports, sockets and timers as much as they compute: on two
# cores one test at a time left a core idle half the time. Each scope below runs whole on one
# worker, in collection order:
# - a module is a scope, so its module-scoped fixtures (a vLLM server, a reference run) are
#   built once, as in a plain run;
# - what a machine has only one of is one scope, "machine-wide": the local cluster's pod
#   network (an flock, /etc/netns; tests/cluster) and the code sandbox's user, whose leftover
#   processes test_code_sandbox_hostile.py counts host-wide (every test_code_* module).
# The process tests go out first, the machine-wide scope at their head (the longest unit), so
# the short tests fill in behind them instead of leaving one long module for the end.
MACHINE_WIDE = "machine-wide"
PROCESS_MARKERS = ("e2e", "cluster", "oracle")


def xdist_scope(nodeid: str) -> str:
    """The scope a test runs in (see above), from its node id ("tests/dir/test_x.py::...")."""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")
    if "cluster" in parts[:-1] or parts[-1].startswith("test_code_"):
        return MACHINE_WIDE
    return path


@pytest.hookimpl(optionalhook=True)  # a run without xdist knows no such hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadscope` with the scopes above, for `-n N` alone too (xdist's `load`, which
    would run two cluster tests at once). Other modes are the caller's choice. (xdist's
    `loadgroup` marks cannot do it under pytest 9: it renames `item._nodeid`, which pytest 9
    no longer reads.)"""
    if config.getvalue("dist") not in ("load", "loadscope"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return Scheduling(config, log)


def pytest_configure(config: pytest.Config) -> None:
    """On an xdist worker, torch computes on one thread: three workers each running a team of
    one thread per core, beside the servers and learners the process tests start, spent more
    time switching than computing (a checkpoint module took 131 s against 10 s alone). The
    processes the tests start keep their own settings."""
    if hasattr(config, "workerinput"):
        import torch

        torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker, the order scopes are handed out in: the machine-wide scope, then the
    other scopes holding process tests, then the rest (`--no-loadscope-reorder` keeps xdist
    from sorting them by their number of tests instead)."""
    if not hasattr(config, "workerinput"):
        return  # a plain run keeps pytest's order
    rank: dict[str, int] = {}
    for item in items:
        scope = xdist_scope(item.nodeid)
        heavy = any(item.get_closest_marker(m) for m in PROCESS_MARKERS)
        rank[scope] = min(rank.get(scope, 2), 0 if scope == MACHINE_WIDE else 1 if heavy else 2)
    items.sort(key=lambda item: rank[xdist_scope(item.nodeid)])  # stable: each keeps its order
