"""The complete exposition, frozen: every family the exporter can emit, from one realistic node.

The node is the fake DGX A100 (GPUs 6 and 7 in MIG mode) read through the real NVML binding,
kernels written as Backend.AI writes them, the recorded /proc tree for process attribution and a
cgroup tree in which two kernels' containers are gone. The clock is frozen; durations are the only
values normalised. ``tests/golden/*.prom`` is also the name list the dashboards and alerts are
checked against.
"""

from __future__ import annotations

import re
import subprocess
from decimal import Decimal
from pathlib import Path

import pytest
from attribution_node import CID, K1, K2, K3, K4, K5, K6, PLACEMENT, PROC
from helpers import GOLDEN, wait_for
from prometheus_client import CollectorRegistry, generate_latest

from exporter.app import Exporter
from exporter.config import resolve
from exporter.demo import recovery_json, write_kernel, write_recovery
from exporter.metrics.registry import ExporterCollector, Part
from exporter.metrics.server import ServerStats
from exporter.metrics.telemetry import telemetry_families, telemetry_health
from exporter.settings import Settings
from exporter.telemetry.devices import DeviceResolver
from exporter.telemetry.mock import DEMO_DEVICES_FILE, MockSource
from exporter.telemetry.model import TelemetrySnapshot
from exporter.telemetry.nvml import NvmlSource
from exporter.telemetry.nvml.simulated import FakeNvml

GOLDEN_FILE = GOLDEN / "full.prom"
NOW = 1_700_000_000.0
USER_A = "f38dea23-50fa-42a0-b5ae-338f5f4693f4"
SESSION = {K1: "b0a4e7c2-5d1f-4e6a-8c3b-2f9d7e1a6b4c", K2: "4c8e2a6f-1b3d-4f5a-9e7c-0d2b4f6a8c1e", K4: "c1d2e3f4-0a1b-4c2d-8e3f-a0b1c2d3e4f5"}


def normalise(text: str, tmp: Path) -> str:
    text = text.replace(str(tmp), "/tmp")
    text = re.sub(r"^(gpu_alloc_\w*duration_seconds(?:\{[^}]*\})?) .*$", r"\1 0", text, flags=re.M)
    return re.sub(r'python_version="[^"]*"', 'python_version="X"', text)


def build_node(tmp: Path, fake: FakeNvml) -> Settings:
    gpu = [g.uuid for g in fake.gpus]
    mig = [ci.uuid for _, ci in fake.gpus[6].cis()]
    root = tmp / "scratches"
    write_kernel(root, K1, {"cuda.shares": {gpu[0]: Decimal("0.5"), gpu[1]: Decimal("0.5")}}, container_id=CID[K1])
    write_kernel(root, K2, {"cuda.device": {gpu[2]: Decimal(1)}}, container_id=CID[K2])
    write_kernel(root, K3, {"cuda.shares": {gpu[3]: Decimal("1.0")}, "cuda.mem": {gpu[3]: Decimal(8 << 30)}})
    write_kernel(root, K4, {"cuda.device": {gpu[4]: Decimal(1)}}, container_id=CID[K4])
    write_kernel(root, K5, {"cuda.device:3g.20gb-mig": {mig[0]: Decimal(1)}}, container_id=CID[K5])
    write_kernel(root, K6, {"cuda.device:1g.5gb-mig": {mig[2]: Decimal(1)}}, container_id="6b6b" * 16)
    write_kernel(root, "6193c0b8-7283-44b5-e0f1-6c7d8e9fa0b7", {"cuda.shares": {"GPU-00000000-dead-beef-0000-000000000000": Decimal("0.25")}},
                 container_id="7c7c" * 16)
    write_kernel(root, "72a4d1c9-8394-45c6-f102-7d8e9fa0b1c8", {"cuda.shares": {gpu[5]: Decimal(2)}}, complete=False)
    # Identity: K1 and K4 are two sessions of one user, K2 a batch session without an owner; K3's
    # agent predates recovery.json, and K5's file is torn mid-rewrite (so it has none yet).
    write_recovery(root, K1, SESSION[K1], USER_A, agent_id="i-dgx01")
    write_recovery(root, K2, SESSION[K2], None, agent_id="i-dgx01", session_type="batch")
    write_recovery(root, K4, SESSION[K4], USER_A, agent_id="i-dgx01")
    (root / K5 / "config" / "recovery.json").write_text(recovery_json(K5, SESSION[K4], USER_A)[:150])
    bad = root / "83b5e2da-94a5-46d7-0213-8e9fa0b1c2d9" / "config"
    bad.mkdir(parents=True)
    (bad / "resource.txt").write_text('SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={"cuda.shares":"1"}\nCUDA.SHARES_SHARES=GPU-x:-1\n')
    cgroup = tmp / "cgroup"
    (cgroup / "system.slice").mkdir(parents=True)
    (cgroup / "cgroup.controllers").write_text("cpu memory pids\n")
    for cid in (CID[K1], CID[K2], CID[K5]):
        (cgroup / "system.slice" / f"docker-{cid}.scope").mkdir()
    for gpu_ in fake.gpus:
        fake.set_processes(gpu_.index, PLACEMENT.get((gpu_.index, None), []))
        for _, ci in gpu_.cis():
            fake.set_processes(gpu_.index, PLACEMENT.get((gpu_.index, ci.mig_index), []), mig_index=ci.mig_index)
    fake.push_xid(4, 79)
    return Settings.load({
        "scratch_roots": [str(root)], "telemetry_source": "none", "path_procfs": str(PROC), "path_cgroupfs": str(cgroup),
        "stale_grace": 0, "agent_id": "i-dgx01", "telemetry_interval": 3600, "attribution_process_detail": True,
    })


class Clock:
    now = NOW

    def __call__(self) -> float:
        return self.now


def render_node(tmp: Path) -> str:
    clock = Clock()
    fake = FakeNvml.dgx_a100(clock=clock)
    settings = build_node(tmp, fake)
    with fake.installed():
        # The HTTP server's counters as a fresh server has them: every refusal reason at 0.
        exporter = Exporter(resolve(settings), clock=clock, monotonic=clock, telemetry=NvmlSource(clock=clock, event_wait_ms=20, pcie=True),
                            server_stats=ServerStats)
        exporter.start()
        try:
            # The first sample is published before the first analysis reads it at start().
            assert exporter.sampler.latest().success, exporter.sampler.latest().error
            # The ledger counts from its first pass, which the usage thread runs right after readiness.
            wait_for(lambda: exporter.pipeline.current.usage_version > 1)
            clock.now = NOW + 600  # ten minutes on, kernels without a live container are stale
            exporter.pipeline.step()
            return normalise(exporter.render().decode(), tmp)
        finally:
            exporter.close()


def test_full_golden(tmp_path: Path, update_golden: bool) -> None:
    text = render_node(tmp_path)
    if update_golden:
        GOLDEN_FILE.write_text(text)
    assert text == GOLDEN_FILE.read_text(), "exposition changed; review and run pytest --update-golden"


def _sample(source) -> TelemetrySnapshot:
    try:
        info = source.prepare()
        devices = tuple(source.read_device(k) for k in info.device_keys)
    finally:
        source.close()
    return TelemetrySnapshot(source=source.name, devices=devices, driver_version=info.driver_version,
                             cuda_version=info.cuda_version, device_count=info.device_count, success=True,
                             duration_seconds=0.0, timestamp=NOW, last_success_timestamp=NOW)


def _older_gpus() -> TelemetrySnapshot:
    """A V100 node on an R470 driver: retired pages and the older NVML calls."""
    with FakeNvml.v100_old_driver(clock=lambda: NOW).installed():
        return _sample(NvmlSource(clock=lambda: NOW, event_wait_ms=20))


def _mock_devices() -> TelemetrySnapshot:
    """The demo's mock devices: fans and SM counts, which NVML does not give for A100s."""
    return _sample(MockSource(DEMO_DEVICES_FILE, clock=lambda: NOW))


@pytest.mark.parametrize(("name", "snapshot"), [("v100.prom", _older_gpus), ("mock.prom", _mock_devices)])
def test_telemetry_golden(name: str, snapshot, update_golden: bool) -> None:
    snap = snapshot()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ExporterCollector([Part(snap.source, lambda: telemetry_families(snap, DeviceResolver(snap)), lambda: 0,
                                              health=lambda: telemetry_health(snap))], clock=lambda: NOW))
    text = generate_latest(registry).decode()
    golden = GOLDEN_FILE.with_name(name)
    if update_golden:
        golden.write_text(text)
    assert text == golden.read_text(), "exposition changed; review and run pytest --update-golden"


@pytest.mark.tools("promtool")
@pytest.mark.parametrize("name", ["full.prom", "v100.prom", "mock.prom", "mixed.prom"])
def test_golden_expositions_are_promtool_clean(name: str) -> None:
    result = subprocess.run(["promtool", "check", "metrics"], input=GOLDEN_FILE.with_name(name).read_bytes(), capture_output=True)
    assert result.returncode == 0, result.stderr.decode()
