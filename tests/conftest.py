"""Shared test fixtures."""

from __future__ import annotations

import pytest
from checkout import run_gspo


@pytest.fixture
def gspo():
    return run_gspo
