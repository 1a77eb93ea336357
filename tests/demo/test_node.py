"""The living demo node: reproducible by seed, and read by the exporter's own code paths (NVML
binding over the simulated library, procfs attribution, cgroup liveness, the scratch reader)."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from exporter.analysis.attribution import ProcFS, Unattributed, container_id_from_cgroup, mount_roots, parse_start_time
from exporter.analysis.liveness import scan_cgroups
from exporter.app import Exporter
from exporter.config import resolve
from exporter.demo.node import LivingNode
from exporter.scratch.allocation import KernelState
from exporter.settings import Settings
from exporter.telemetry.nvml import NvmlSource


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def play(node: LivingNode, clock: Clock, until: float) -> None:
    """Advance demo time to ``until`` seconds, one second at a time, running what falls due."""
    while node.now() < until:
        clock.t += 1.0 / node.time_scale
        node.run_due()


def snapshot(node: LivingNode) -> list[tuple]:
    return sorted((s.kernel_id, s.kind, tuple((slot, tuple(per.items())) for slot, per in sorted(s.allocations.items())))
                  for s in node.sessions.values())


def test_the_same_seed_plays_the_same_node(tmp_path: Path) -> None:
    runs = []
    for name in ("a", "b"):
        clock = Clock()
        node = LivingNode(tmp_path / name, seed=11, clock=clock)
        node.populate()
        play(node, clock, 300)
        runs.append((snapshot(node), sorted(p.name for p in (tmp_path / name / "scratches").iterdir())))
    assert runs[0] == runs[1]
    other = LivingNode(tmp_path / "c", seed=12, clock=Clock())
    other.populate()
    assert snapshot(other) != runs[0][0][: len(snapshot(other))]


def test_placement_follows_evenly_and_never_overcommits(tmp_path: Path) -> None:
    clock = Clock()
    node = LivingNode(tmp_path, seed=5, clock=clock)
    node.populate()
    trainer = next(s for s in node.sessions.values() if s.kind == "training")
    assert trainer.allocations["cuda.shares"] and sum(Decimal(str(a)) for a in trainer.allocations["cuda.shares"].values()) == 16
    for t in range(0, 600, 20):
        play(node, clock, t)
        for d in node._free("cuda.shares"):
            assert d.allocated <= d.capacity, (t, d)


def test_files_are_what_the_exporter_reads(tmp_path: Path) -> None:
    clock = Clock()
    node = LivingNode(tmp_path, seed=2, clock=clock)
    node.populate()
    procfs = ProcFS(node.host.proc)
    scan = scan_cgroups(node.host.cgroup)
    assert scan.visible and scan.layout == "v2"
    running = [s for s in node.sessions.values() if s.running]
    assert {s.container_id for s in running} <= scan.container_ids
    for s in running:
        for p in s.processes:
            assert container_id_from_cgroup(procfs.read(p.pid, "cgroup")) == s.container_id
            assert any(s.kernel_id in root for root in mount_roots(procfs.read(p.pid, "mountinfo")))
            assert parse_start_time(procfs.read(p.pid, "stat")) > 0
        text = (node.scratch / s.kernel_id / "config" / "resource.txt").read_text()
        assert text.endswith(f"CID={s.container_id}\n")


def test_the_exporter_sees_the_planted_events(tmp_path: Path) -> None:
    clock = Clock()
    node = LivingNode(tmp_path, seed=4, clock=clock)
    settings = Settings(scratch_roots=[node.scratch], path_procfs=node.host.proc, path_cgroupfs=node.host.cgroup,
                        telemetry_interval=0.05, stale_grace=30)
    with node.running():
        exporter = Exporter(resolve(settings), telemetry=NvmlSource(event_wait_ms=50))
        exporter.start()
        try:
            def sample() -> tuple:
                seen = exporter.sampler.version
                exporter.sampler.wait_for_version(seen, 5)
                exporter.pipeline.step()
                model = exporter.analysis
                return model.snapshot, model.attribution

            snap, attribution = sample()
            assert any(u.reason is Unattributed.HOST for u in attribution.unattributed)
            assert any(k.utilization_ratio and k.utilization_ratio > 0.5 for k in attribution.kernels)  # busy
            assert any(k.allocated and k.processes and k.utilization_ratio == 0 for k in attribution.kernels)  # idle
            assert any(k.allocated and not k.processes for k in attribution.kernels)  # no process yet
            play(node, clock, 65)
            snap, attribution = sample()
            assert any(not k.allocated for k in attribution.kernels)  # the isolation breach
            lost = [d for d in snap.devices if not d.up]
            assert len(lost) == 1 and lost[0].index == 5
            # Past the ends the demo announces for the lost GPU and the breach.
            play(node, clock, max(p.ends for p in node.promises if p.alert in ("GpuAllocGpuLost", "GpuAllocIsolationBreach")))
            snap, attribution = sample()
            assert all(d.up for d in snap.devices) and all(k.allocated for k in attribution.kernels)
            assert {x.xid for x in snap.xid_errors} == {13, 63, 79}
            states = {k.state for k in exporter.book.view().kernels.values()}
            assert KernelState.PENDING in states  # the half-written resource.txt
        finally:
            exporter.close()


@pytest.mark.parametrize("scale", [0, -1])
def test_a_time_scale_must_be_positive(tmp_path: Path, scale: float) -> None:
    with pytest.raises(ValueError, match="time scale"):
        LivingNode(tmp_path, seed=1, time_scale=scale)
