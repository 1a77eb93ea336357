"""Shared fixtures: no leaked threads, golden-file updates, and the one gate for the Debian tools
the tests run (promtool, Prometheus, Alertmanager, node_exporter, VictoriaMetrics).

A test that needs a tool says so with ``@pytest.mark.tools("promtool", ...)``. Where a tool is
missing the test is skipped, loudly (each skip names the tool and its Debian package, and the run
ends with a list); where ``GPU_ALLOC_EXPORTER_TEST_REQUIRE_TOOLS=1`` is set, as ``scripts/test``
(and so CI) sets it, a missing tool fails the test instead: nothing skips there.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from hypothesis import settings
from processes import SKIPPED_FOR_TOOLS, require_tool

# Property tests draw the same examples on every run (a CI failure is then a real one and
# reproduces), with no example database left behind and no per-example deadline on a noisy machine.
settings.register_profile("deterministic", derandomize=True, database=None, deadline=None)
settings.load_profile("deterministic")

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN = Path(__file__).parent / "golden"


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("tools"):
        for tool in mark.args:
            require_tool(tool, item.nodeid)


def pytest_terminal_summary(terminalreporter) -> None:
    if SKIPPED_FOR_TOOLS:
        terminalreporter.section(f"{len(SKIPPED_FOR_TOOLS)} test(s) skipped for a missing tool", sep="!")
        for line in SKIPPED_FOR_TOOLS:
            terminalreporter.write_line(line)


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
