"""The wiring's own behaviour: what it logs when kernels go stale (once, when it happens)."""

from __future__ import annotations

import logging
from decimal import Decimal
from pathlib import Path

from exporter.app import STALE_CHECK_SECONDS, Exporter
from exporter.demo import write_kernel
from exporter.settings import Settings
from exporter.telemetry.model import NullSource

LIVE, GONE = "a1" * 32, "b2" * 32


def test_stale_kernels_leaving_the_figures_is_logged_once(tmp_path: Path, caplog) -> None:
    root, cgroup = tmp_path / "scratches", tmp_path / "cgroup"
    write_kernel(root, "k-live", {"cuda.shares": {"GPU-a": Decimal("0.5")}}, container_id=LIVE)
    write_kernel(root, "k-gone", {"cuda.shares": {"GPU-a": Decimal("0.25")}}, container_id=GONE)
    (cgroup / "system.slice" / f"docker-{LIVE}.scope").mkdir(parents=True)
    (cgroup / "cgroup.controllers").write_text("cpu memory pids\n")
    settings = Settings.load({"scratch_roots": [str(root)], "path_cgroupfs": str(cgroup), "stale_grace": 0,
                              "telemetry_source": "none", "telemetry_interval": 3600})
    now = [1000.0]
    exporter = Exporter(settings, clock=lambda: now[0], monotonic=lambda: now[0], telemetry=NullSource())
    caplog.set_level(logging.INFO, logger="exporter.app")
    exporter.start()
    try:
        now[0] += 600
        exporter._analyse()
        lines = [r.getMessage() for r in caplog.records if "stale" in r.getMessage()]
        assert lines == ["1 kernel(s) stale, their allocations left out of the allocated and headroom figures: k-gone (container-gone)"]
        for _ in range(3):  # judged again and again: said once
            now[0] += STALE_CHECK_SECONDS
            exporter._analyse()
        assert len([r for r in caplog.records if "stale" in r.getMessage()]) == 1
        (cgroup / "system.slice" / f"docker-{GONE}.scope").mkdir()  # the container is back
        now[0] += STALE_CHECK_SECONDS
        exporter._analyse()
        assert caplog.records[-1].getMessage() == "1 kernel(s) live again, their allocations counted again: k-gone (container-running)"
    finally:
        exporter.close()
