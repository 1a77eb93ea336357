"""The blast radius of an XID, end to end: the simulated DGX A100 read through the real NVML
binding, three sessions sharing GPU 0 (fGPU) with their ``recovery.json``, XID 79 on that GPU;
the exporter's exposition scraped by a real Prometheus with the shipped session rules, and the
alert delivered by a real Alertmanager naming all three sessions and their users."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest
from e2e.harness import Alertmanager, Prometheus, StaticExpositions, Webhook, e2e_rules
from helpers import ROOT, wait_for

from exporter.app import Exporter
from exporter.config import resolve
from exporter.demo import write_kernel, write_recovery
from exporter.settings import Settings
from exporter.telemetry.nvml import NvmlSource
from exporter.telemetry.nvml.simulated import FakeNvml

pytestmark = pytest.mark.tools("prometheus", "prometheus-alertmanager")

SESSIONS = {  # kernel id -> (session id, owner user id)
    "0b3f6a52-1c2d-4e5f-8a9b-0c1d2e3f4a51": ("5e55a001-0000-4000-8000-000000000001", "f38dea23-50fa-42a0-b5ae-338f5f4693f4"),
    "1c4e7b63-2d3e-4f60-9bac-1d2e3f4a5b62": ("5e55a002-0000-4000-8000-000000000002", "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"),
    "2d5f8c74-3e4f-4071-acbd-2e3f4a5b6c73": ("5e55a003-0000-4000-8000-000000000003", None),
}


def test_an_xid_on_a_shared_gpu_names_every_session(tmp_path: Path) -> None:
    fake = FakeNvml.dgx_a100()
    gpu0 = fake.gpus[0].uuid
    root = tmp_path / "scratches"
    for kernel_id, (session_id, user_id) in SESSIONS.items():
        write_kernel(root, kernel_id, {"cuda.shares": {gpu0: Decimal("2.5")}}, container_id="c" * 64)
        write_recovery(root, kernel_id, session_id, user_id, agent_id="i-node01")
    (tmp_path / "proc").mkdir()
    settings = Settings(scratch_roots=[root], path_procfs=tmp_path / "proc", path_cgroupfs=tmp_path, telemetry_interval=0.2,
                        agent_id="i-node01")
    fake.push_xid(0, 79)  # GPU 0 fell off the bus
    with fake.installed():
        exporter = Exporter(resolve(settings), telemetry=NvmlSource(event_wait_ms=20))
        exporter.start()
        try:
            # The XID arrives through the event thread; shares need a telemetry sample and an analysis pass.
            def complete() -> bytes | None:
                text = exporter.render()
                ready = (b'xid="79"' in text and b"gpu_alloc_kernel_gpu_share_ratio{" in text
                         and text.count(b"gpu_alloc_kernel_identity_info{") == 3)
                return text if ready else None

            body = wait_for(complete, timeout=20)
        finally:
            exporter.close()

    hook = Webhook()
    static = StaticExpositions({"node01.prom": body})
    am = Alertmanager(tmp_path, f"http://127.0.0.1:{hook.port}/hook")
    targets = [{"job_name": "any-name", "metrics_path": "/node01.prom", "static_configs": [{"targets": [f"127.0.0.1:{static.port}"]}]}]
    prom = Prometheus(tmp_path, e2e_rules(tmp_path, [ROOT / "alerts" / "gpu-alloc-sessions.rules.yml"]), targets, am.address)
    try:
        firing = hook.wait_for("firing", "GpuAllocSessionsOnUnhealthyGpu", 60, device_id=gpu0)
    finally:
        for thing in (prom, am, static, hook):
            thing.close() if hasattr(thing, "close") else thing.stop()
    assert firing["labels"]["severity"] == "critical"
    assert firing["annotations"]["summary"].startswith("3 kernel(s) on unhealthy GPU")
    named = firing["annotations"]["sessions"]
    for session_id, user_id in SESSIONS.values():
        assert f"session {session_id} (user {user_id or 'undefined'})" in named
