"""Shared fixtures: no leaked threads, a scratch-tree builder, golden-file updates."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN = Path(__file__).parent / "golden"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/golden/* from the current output")


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-golden"))


@pytest.fixture(autouse=True)
def _no_thread_leaks():
    """Fail a test that leaves threads behind (watchdog's own test suite does the same)."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        leaked = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not leaked:
            return
        time.sleep(0.01)
    pytest.fail(f"leaked threads: {[t.name for t in leaked]}")


@pytest.fixture(autouse=True)
def _no_host_agent_toml(tmp_path_factory, monkeypatch):
    """In-process runs never read this machine's /etc/backend.ai/agent.toml."""
    import exporter.cli

    monkeypatch.setattr(exporter.cli, "DEFAULT_AGENT_CONFIG", tmp_path_factory.getbasetemp() / "no-agent.toml")
