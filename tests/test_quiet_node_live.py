"""A healthy node pages nobody, tried live: the exporter over mock GPUs and three kernels that
never change, scraped by Debian's Prometheus with every shipped rule file as shipped (``for:``
and group intervals untouched), for longer than the staleness threshold plus its ``for:`` (the
alert that used to page every quiet node after about ten minutes).

At the end no warning or critical alert is firing, or even pending: a pending alert is one that
would page later, so "nothing pending" also covers the rules whose ``for:`` is longer than the
run. The 24-hour promtool replay (tests/test_alert_matrix.py) covers what only time changes.
"""

from __future__ import annotations

import time
from decimal import Decimal
from pathlib import Path

import monitoring_checks as mc  # noqa: E402 - tools/, on pytest's pythonpath
import pytest
from e2e.harness import Exporter, Prometheus, wait_until
from helpers import ROOT

from exporter.demo import write_kernel

pytestmark = [pytest.mark.slow, pytest.mark.tools("prometheus", "promtool")]

MOCK_FILE = ROOT / "exporter" / "data" / "demo-devices.toml"
JOB = "rack-quiet"  # any name: no rule selects a job by name
GPU = ["c59395cd-ac91-4cd3-a1b0-3d2568aa2d01", "c59395cd-ac91-4cd3-a1b0-3d2568aa2d02"]
KERNELS = {  # kernel id -> (container id, GPU, shares)
    "5a1f0c2e-0d1b-4c3a-9e8f-000000000001": ("a1" * 32, GPU[0], "2.5"),
    "5a1f0c2e-0d1b-4c3a-9e8f-000000000002": ("b2" * 32, GPU[1], "2.5"),
    "5a1f0c2e-0d1b-4c3a-9e8f-000000000003": ("c3" * 32, GPU[1], "5"),
}
# 15 minutes: past GpuAllocTelemetryStale's threshold (300 s) plus its for: (5m), the alert that
# used to page every quiet node at about 10 minutes, and past the 15-minute window of GpuAllocScanStale.
RUN_SECONDS = 15 * 60


def test_a_quiet_node_pages_nobody_with_the_shipped_rules(tmp_path: Path) -> None:
    scratch, cgroup = tmp_path / "scratch", tmp_path / "cgroup"
    (cgroup / "system.slice").mkdir(parents=True)
    (cgroup / "cgroup.controllers").write_text("cpu memory pids\n")
    for kernel_id, (cid, gpu, shares) in KERNELS.items():
        write_kernel(scratch, kernel_id, {"cuda.shares": {gpu: Decimal(shares)}}, container_id=cid)
        (cgroup / "system.slice" / f"docker-{cid}.scope").mkdir()
    started = []
    try:
        exporter = Exporter(["--scratch.root", str(scratch), "--telemetry.source", "mock", "--telemetry.mock-file", str(MOCK_FILE),
                             "--path.cgroupfs", str(cgroup), "--agent.id", "i-quiet", "--health.state-file",
                             str(tmp_path / "health.json")], tmp_path)
        started.append(exporter)
        targets = [{"job_name": JOB, "static_configs": [{"targets": [exporter.address]}]}]
        # Scraped every 5 s (shorter than production's 15 s, which the docs allow), each group
        # evaluated at its own interval as shipped.
        prom = Prometheus(tmp_path, list(mc.RULE_FILES), targets, interval="5s")
        started.append(prom)
        wait_until(lambda: prom.query(f'up{{instance="{exporter.address}"}} == 1'), 60, "the first scrape")
        deadline = time.monotonic() + RUN_SECONDS
        paging = 'ALERTS{severity=~"warning|critical"}'
        while time.monotonic() < deadline:
            seen = prom.query(paging)
            assert not seen, [(a["metric"]["alertname"], a["metric"]["alertstate"]) for a in seen]
            assert exporter.alive(), exporter.log()
            time.sleep(15)
        assert prom.query(f'up{{instance="{exporter.address}"}} == 1')
        assert not prom.query(paging)
        # The run saw what matters: telemetry sampled all along, the kernels live and counted.
        assert prom.query(f'gpu_alloc_kernels_liveness{{status="live",instance="{exporter.address}"}} == 3')
        assert prom.query(f'time() - gpu_alloc_collector_last_success_timestamp_seconds{{collector="mock",instance="{exporter.address}"}} < 60')
    finally:
        for process in reversed(started):
            process.stop()
