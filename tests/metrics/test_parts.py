"""The collector contract on the exporter's real parts, as node_exporter's ``execute()`` keeps it:
every render has one status sample per part under names fixed at start; a part that raises shows
``success 0``, drops its own series, and is tried again (and recovers) on the next scrape."""

from __future__ import annotations

import dataclasses
import importlib
from collections import Counter
from decimal import Decimal
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter.app import Exporter
from exporter.config import resolve
from exporter.demo import write_kernel
from exporter.settings import Settings
from exporter.telemetry.mock import DEMO_DEVICES_FILE

PARTS = ["build", "scratch", "watcher", "mock", "headroom", "fleet", "attribution", "ghost", "health", "accounting"]
# (part, "module:function" of exporter.metrics that builds its families, a family only it emits)
CASES = [
    ("build", "exporter:build_info", "gpu_alloc_build_info"),
    ("scratch", "allocation:allocation_families", "gpu_alloc_device_allocated"),
    ("watcher", "exporter:watcher_families", "gpu_alloc_watcher_up"),
    ("mock", "telemetry:telemetry_families", "gpu_alloc_device_up"),
    ("headroom", "headroom:headroom_families", "gpu_alloc_device_capacity"),
    ("fleet", "fleet:fleet_families", "gpu_alloc_node_remaining"),
    ("attribution", "attribution:attribution_families", None),
    ("ghost", "health:ghost_families", None),  # the mock devices list no processes: no ghost figures
    ("health", "health:health_families", "gpu_alloc_device_health"),
    ("accounting", "accounting:accounting_families", "gpu_alloc_kernel_gpu_share_ratio"),
]


def samples(text: bytes) -> list[tuple[str, tuple, float]]:
    return [(s.name, tuple(sorted(s.labels.items())), s.value)
            for fam in text_string_to_metric_families(text.decode()) for s in fam.samples]


def status(rows: list[tuple[str, tuple, float]]) -> dict[str, float]:
    return {dict(labels)["collector"]: v for name, labels, v in rows if name == "gpu_alloc_collector_success"}


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    root = tmp_path / "scratches"
    write_kernel(root, "k1", {"cuda.shares": {"GPU-c59395cd-ac91-4cd3-a1b0-3d2568aa2d01": Decimal("0.5")}}, container_id="ab" * 32)
    (tmp_path / "proc").mkdir()
    return Settings.load({"scratch_roots": [str(root)], "telemetry_source": "mock", "telemetry_mock_file": str(DEMO_DEVICES_FILE),
                          "path_procfs": str(tmp_path / "proc"), "path_cgroupfs": str(tmp_path), "telemetry_interval": 3600})


def test_every_part_reports_once_under_a_fixed_name(settings: Settings) -> None:
    exporter = Exporter(resolve(settings))
    exporter.start()
    try:
        rows = samples(exporter.render())
    finally:
        exporter.close()
    assert not [k for k, n in Counter((name, labels) for name, labels, _ in rows).items() if n > 1]
    assert status(rows) == dict.fromkeys(PARTS, 1.0)


@pytest.mark.parametrize(("part", "function", "family"), CASES, ids=[c[0] for c in CASES])
def test_a_failing_part_is_dropped_then_recovers(settings: Settings, monkeypatch, part: str, function: str,
                                                 family: str | None, caplog) -> None:
    def broken(*_, **__):
        raise RuntimeError("injected")

    module_name, _, function = function.partition(":")
    module = importlib.import_module(f"exporter.metrics.{module_name}")
    real = getattr(module, function)
    monkeypatch.setattr(module, function, broken)
    exporter = Exporter(resolve(settings))
    exporter.start()
    try:
        failing = [samples(exporter.render()) for _ in range(2)]
        monkeypatch.setattr(module, function, real)
        recovered = samples(exporter.render())
    finally:
        exporter.close()
    for rows in (*failing, recovered):
        assert not [k for k, n in Counter((name, labels) for name, labels, _ in rows).items() if n > 1]
    for rows in failing:
        assert status(rows) == {**dict.fromkeys(PARTS, 1.0), part: 0.0}  # the names never change
        if family:
            assert family not in {name for name, _, _ in rows}
    assert status(recovered) == dict.fromkeys(PARTS, 1.0)
    if family:
        assert family in {name for name, _, _ in recovered}
    # One traceback for the failure streak, not one per scrape.
    assert sum(f"collector {part} failed" in r.getMessage() for r in caplog.records) == 1


def test_a_collector_switched_off_serves_nothing_and_the_rest_is_unchanged(settings: Settings) -> None:
    exporter = Exporter(resolve(settings, collectors={"headroom": False, "attribution": False}))
    exporter.start()
    try:
        rows = samples(exporter.render())
    finally:
        exporter.close()
    assert status(rows) == dict.fromkeys([p for p in PARTS if p not in ("headroom", "attribution")], 1.0)
    names = {name for name, _, _ in rows}
    assert "gpu_alloc_node_headroom" not in names and "gpu_alloc_device_capacity" not in names
    assert "gpu_alloc_device_allocated" in names and "gpu_alloc_kernel_gpu_share_ratio" in names


def test_collectors_are_registered_once_in_exposition_order() -> None:
    from exporter.metrics.collectors import build_parts, collectors, register

    names = list(collectors())
    assert names[:3] == ["build", "scratch", "watcher"] and len(set(names)) == len(names)
    with pytest.raises(ValueError, match="registered twice"):
        register("headroom", "again", order=99)(lambda inputs: [])
    with pytest.raises(ValueError, match="unknown collector"):
        build_parts(None, {"nope": True})  # type: ignore[arg-type]


def test_the_accounting_text_is_what_prometheus_client_writes() -> None:
    """The accounting part renders at nearly every scrape: its own renderer must write exactly the
    text generate_latest writes for its families, labels escaped the same way."""
    from exporter.analysis.accounting import Accounting, KernelUse
    from exporter.metrics.accounting import AccountingText, accounting_families
    from exporter.metrics.registry import render_families
    from exporter.metrics.text import inflate, openmetrics_text

    odd = 'k-"quoted"\\back\nline %s 100%'  # escapes, and the renderer's own template's marks
    result = Accounting(
        shares={("k1", "GPU-a"): 0.5, (odd, "GPU-b"): 1.0},
        kernels={"k1": KernelUse(0.25, None), odd: KernelUse(None, 1.0), "k3": KernelUse(None, None)},
        allocated_seconds={("k1", "GPU-a"): 12.5, (odd, "GPU-b"): 3_456_789.5, ("gone", "GPU-a"): 7.0},  # Go's exponent
        busy_seconds={("k1", "GPU-a"): 1e-9},
    )
    moved = dataclasses.replace(result, shares={("k1", "GPU-a"): 0.25, (odd, "GPU-b"): 1.0})
    asides: list[int] = []
    text = AccountingText(aside=lambda: asides.append(1))
    # Pairs dropped, then back; then the same pairs with other shares (kept share lines are not reused).
    for case in (result, Accounting(), result, result, moved, moved):
        expected = render_families(accounting_families(case))
        asides.clear()
        assert inflate(text.render(case)) == expected
        assert len(asides) == 4  # before the render, and before each of its three per-pair families
        # The OpenMetrics form shares the samples and is the conversion of the text.
        assert inflate(text.openmetrics()) == openmetrics_text(expected)
    assert not text.render(None) and not text.openmetrics()
