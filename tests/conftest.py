"""Shared test fixtures."""

from __future__ import annotations

import sys
from pathlib import Path

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
