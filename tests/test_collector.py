"""Exposition: a golden /metrics for a fixture scratch tree, promtool-clean, failures as data."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from exporter.allocation import AllocationBook
from exporter.collector import ExporterCollector, allocation_families, build_info, watcher_families
from exporter.scratch import Scanner, ScanStats
from exporter.watcher import WatcherStatus

FIXTURE = Path(__file__).parent / "fixtures" / "scratch" / "mixed"
GOLDEN = Path(__file__).parent / "golden" / "mixed.prom"
STATUS = WatcherStatus(
    mode="inotify", up=True, watches=17, overflows_total=0, watch_errors_total=0, events_total=3, rescans_total=1,
    last_event_timestamp=1.7e9, last_scan=(ScanStats("/scratch", 15, 0.0125, True),), degraded=None,
)


def render(tree: Path, status: WatcherStatus = STATUS) -> bytes:
    book = AllocationBook(clock=lambda: 1.7e9)
    Scanner(book).scan(str(tree))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ExporterCollector([
        ("build", lambda: [build_info("agent-1")]),
        ("scratch", lambda: allocation_families(book.view()) + watcher_families(status)),
    ]))
    return generate_latest(registry)


def test_golden_metrics(update_golden: bool) -> None:
    text = render(FIXTURE).decode().replace(__import__("platform").python_version(), "PYTHON")
    if update_golden:
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "exposition changed; review and run pytest --update-golden"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
def test_promtool_check_metrics_is_clean() -> None:
    result = subprocess.run(["promtool", "check", "metrics"], input=render(FIXTURE), capture_output=True)
    assert result.returncode == 0, result.stderr.decode()


def test_hostile_label_values_are_escaped() -> None:
    text = render(FIXTURE).decode()
    # The invalid kernel's quoted device id never reaches a label (its file never parsed), and
    # nothing in the output breaks the line structure.
    assert 'GPU-"quoted"' not in text
    for line in text.splitlines():
        assert line.startswith("#") or line.count('"') % 2 == 0


def test_a_failing_source_reports_success_0_and_the_scrape_still_works() -> None:
    def broken():
        raise RuntimeError("NVML went away")

    registry = CollectorRegistry(auto_describe=False)
    registry.register(ExporterCollector([("nvml", broken), ("build", lambda: [build_info(None)])]))
    assert registry.get_sample_value("gpu_alloc_collector_success", {"collector": "nvml"}) == 0
    assert registry.get_sample_value("gpu_alloc_build_info", {"version": __import__("exporter").__version__,
                                                                "python_version": __import__("platform").python_version(),
                                                                "agent_id": ""}) == 1


def test_a_failed_scan_reports_success_0() -> None:
    status = WatcherStatus(**{**STATUS.__dict__, "last_scan": (ScanStats("/gone", 0, 0.0, False, "No such file"),)})
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ExporterCollector([("scratch", lambda: watcher_families(status))]))
    assert registry.get_sample_value("gpu_alloc_collector_success", {"collector": "scratch"}) == 0
    assert registry.get_sample_value("gpu_alloc_scratch_root_up", {"scratch_root": "/gone"}) == 0
