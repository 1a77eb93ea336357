"""Shared test helpers: the repository's paths and polling. Test modules import from the
support modules (``helpers``, ``attribution_node``, ``pki``, ``processes``, ``docker_fake``), never
from each other."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent  # the repository


FIXTURES = ROOT / "tests" / "fixtures"


GOLDEN = ROOT / "tests" / "golden"


def wait_for(predicate, timeout: float = 5.0, interval: float = 0.005):
    """Poll until ``predicate()`` is truthy; returns its value or fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout}s")
        time.sleep(interval)
