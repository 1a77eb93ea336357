"""/api/v1/alloc-map in both forms on a fractional DGX A100 without capacity overrides: the
absolute answer of agents before 26.4.8 and the ratio of 26.4.8+ / 26.8.x, each equal to the
reference re-implementation of the agent."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

from backendai_reference import scan_gpu_alloc_map, scan_gpu_alloc_map_ratio

from exporter.app import Exporter
from exporter.config import resolve
from exporter.demo import write_kernel
from exporter.settings import Settings
from exporter.telemetry.nvml import NvmlSource
from exporter.telemetry.nvml.simulated import FakeNvml
from exporter.web.server import Request

NOW = 1_700_000_000.0
A100_SHARES = Decimal("13.5")  # min(39.5 GiB / 2 GiB, 108 SMs / 8), as the plugin registers


def test_both_forms_on_fgpu_whole_gpu_and_mig(tmp_path: Path) -> None:
    fake = FakeNvml.dgx_a100(clock=lambda: NOW)
    gpu = [g.uuid for g in fake.gpus]
    mig = [ci.uuid for _, ci in fake.gpus[6].cis()]
    root = tmp_path / "scratches"
    write_kernel(root, "k1", {"cuda.shares": {gpu[0]: Decimal("0.5"), gpu[1]: Decimal("0.5")}}, container_id="a" * 64)
    write_kernel(root, "k2", {"cuda.shares": {gpu[0]: Decimal("2.25")}}, container_id="b" * 64)
    write_kernel(root, "k3", {"cuda.device": {gpu[2]: Decimal(1)}}, container_id="c" * 64)
    write_kernel(root, "k4", {"cuda.device:3g.20gb-mig": {mig[0]: Decimal(1)}}, container_id="d" * 64)
    texts = [(root / k / "config" / "resource.txt").read_text() for k in ("k1", "k2", "k3", "k4")]
    settings = Settings.load({"scratch_roots": [str(root)], "telemetry_source": "none", "headroom_mode": "fractional",
                              "telemetry_interval": 3600, "alloc_map_format": "ratio"})
    with fake.installed():
        exporter = Exporter(resolve(settings), clock=lambda: NOW, monotonic=lambda: NOW, telemetry=NvmlSource(clock=lambda: NOW, event_wait_ms=20))
        exporter.start()
        try:
            def get(query: dict) -> tuple[int, object]:
                r = exporter.routes.handle(Request(method="GET", path="/api/v1/alloc-map", query=query, headers={}))
                return r.status, json.loads(r.body) if r.status == 200 else r.body

            caps = {("cuda.shares", g): A100_SHARES for g in gpu[:6]}
            caps |= {("cuda.device", g): Decimal(1) for g in gpu[:6]}
            caps[("cuda.device:3g.20gb-mig", mig[0])] = Decimal(1)
            ratio = scan_gpu_alloc_map_ratio(texts, caps)
            assert ratio == {gpu[0]: "0.2037", gpu[1]: "0.0370", gpu[2]: "1.0000", mig[0]: "1.0000"}
            assert get({}) == (200, ratio)  # the configured default
            assert get({"format": ["ratio"]}) == (200, ratio)
            assert get({"format": ["absolute"]}) == (200, scan_gpu_alloc_map(texts))
            status, body = get({"format": ["percent"]})
            assert status == 400 and b"absolute, ratio" in body
        finally:
            exporter.close()
