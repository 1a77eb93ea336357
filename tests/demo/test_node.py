"""The living demo node: reproducible by seed, and read by the exporter's own code paths (NVML
binding over the simulated library, procfs attribution, cgroup liveness, the scratch reader)."""

from __future__ import annotations

import json
import math
from decimal import Decimal
from pathlib import Path

import pytest
from backendai_reference import scan_gpu_alloc_map_ratio
from helpers import wait_for

from exporter.analysis.attribution import ProcFS, Unattributed, container_id_from_cgroup, mount_roots, parse_start_time
from exporter.analysis.liveness import scan_cgroups
from exporter.app import Exporter
from exporter.config import resolve
from exporter.demo.node import DUTY_BUSY_S, DUTY_PERIOD_S, LivingNode
from exporter.scratch.allocation import KernelState
from exporter.settings import Settings
from exporter.telemetry.nvml import NvmlSource
from exporter.web.server import Request


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
                        telemetry_interval=0.05, health_state_file=tmp_path / "health.json", stale_grace=30)
    with node.running():
        exporter = Exporter(resolve(settings), telemetry=NvmlSource(event_wait_ms=50))
        exporter.start()
        try:
            def sample() -> tuple:
                seen = exporter.sampler.version
                assert exporter.sampler.wait_for_version(seen, 5)
                exporter.pipeline.step()
                model = exporter.analysis
                return model.snapshot, model.attribution

            def busy() -> tuple | None:
                snap, attribution = sample()
                return (snap, attribution) if any(k.utilization_ratio and k.utilization_ratio > 0.5
                                                  for k in attribution.kernels) else None

            # NVML's per-process utilisation covers the time since the previous sample: the first
            # samples may have none yet.
            snap, attribution = wait_for(busy, 5)
            assert any(u.reason is Unattributed.HOST for u in attribution.unattributed)
            assert any(k.allocated and k.processes and k.utilization_ratio == 0 for k in attribution.kernels)  # idle
            assert any(k.allocated and not k.processes for k in attribution.kernels)  # no process yet
            play(node, clock, 65)
            snap, attribution = sample()
            assert any(not k.allocated for k in attribution.kernels)  # the isolation breach
            lost = [d for d in snap.devices if not d.up]
            planted = next(dict(p.labels)["device_id"] for p in node.promises if p.alert == "GpuAllocGpuLost")
            assert [d.uuid for d in lost] == [planted]
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


def _series(text: str, name: str, **labels: str) -> float | None:
    """The value of the one sample of ``name`` whose labels include ``labels``, or None."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_the_demo_writes_what_a_current_plugin_writes(tmp_path: Path) -> None:
    """No cuda.mem anywhere; the ratio alloc map is what Backend.AI 26.9.6 answers, dividing each
    allocation by the one capacity its device registers (cuda.shares of a whole GPU, 1 for a MIG
    device)."""
    clock = Clock()
    node = LivingNode(tmp_path, seed=7, clock=clock)
    settings = Settings(scratch_roots=[node.scratch], path_procfs=node.host.proc, path_cgroupfs=node.host.cgroup,
                        telemetry_interval=0.05, health_state_file=tmp_path / "health.json", alloc_map_format="ratio")
    with node.running():
        assert all("cuda.mem" not in s.allocations for s in node.sessions.values())
        exporter = Exporter(resolve(settings), telemetry=NvmlSource(event_wait_ms=50))
        exporter.start()
        try:
            caps = {("cuda.shares", node.device_id(g)): node._capacity[g] for g in node._shares_gpus}
            caps |= {(slot, node.device_id(g, m)): Decimal(1) for g, m, slot in node._mig_devices()}
            for until in (0, 40):  # at the start, and with sessions that arrived since
                play(node, clock, until)
                exporter.watcher.request_rescan()
                texts = [p.read_text() for p in sorted(node.scratch.glob("*/config/resource.txt"))]
                assert texts and not any("CUDA.MEM" in t for t in texts)
                expected = scan_gpu_alloc_map_ratio(texts, caps)

                def answer(expected: dict[str, str] = expected) -> bool:
                    exporter.pipeline.step()
                    r = exporter.routes.handle(Request(method="GET", path="/api/v1/alloc-map", query={"format": ["ratio"]}, headers={}))
                    return r.status == 200 and json.loads(r.body) == expected

                wait_for(answer, 5)
                assert all(Decimal(v) <= 1 for v in expected.values())  # ratios, not raw amounts
        finally:
            exporter.close()


def test_ghost_memory_and_latched_health_until_a_reset(tmp_path: Path) -> None:
    """The session that ends at +2:30 leaves its process's memory behind: ghost memory, named by
    its session, out of the GPU's usable capacity, within one telemetry sample. The lost GPU and
    the remapped one stay lost / needs_reset until the demo resets them."""
    clock = Clock()
    node = LivingNode(tmp_path, seed=7, clock=clock)
    settings = Settings(scratch_roots=[node.scratch], path_procfs=node.host.proc, path_cgroupfs=node.host.cgroup,
                        telemetry_interval=0.05, health_state_file=tmp_path / "health.json", stale_grace=30)
    with node.running():
        ghost = next(p for p in node.promises if p.alert == "GpuAllocGhostMemory")
        gpu_of = {node.device_id(i): i for i in range(len(node.machine.gpus))}
        ghost_device = dict(ghost.labels)["device_id"]
        (lost,), (remap,) = ({dict(p.labels)["device_id"] for p in node.promises if p.alert == name}
                             for name in ("GpuAllocGpuLost", "GpuAllocGpuResetPending"))
        ghosted = next(s for s in node.sessions.values() if s.planted.startswith("ends at"))
        held = sum(p.memory for p in ghosted.processes)
        exporter = Exporter(resolve(settings), telemetry=NvmlSource(event_wait_ms=50))
        exporter.start()
        try:
            def metrics() -> str:
                """The exposition after the first telemetry sample taken wholly from now on."""
                seen = exporter.sampler.version
                assert exporter.sampler.wait_for_version(seen + 1, 5)  # the one under way may predate now
                exporter.pipeline.step()
                return exporter.render().decode()

            def health(text: str, device: str) -> str | None:
                return next((s for s in ("ok", "degraded", "needs_reset", "lost", "unknown")
                             if _series(text, "gpu_alloc_device_health", device_id=device, state=s) == 1), None)

            play(node, clock, ghost.onset - 1)
            text = metrics()
            assert not _series(text, "gpu_alloc_device_ghost_memory_bytes", device_id=ghost_device, cause="dead_process")
            capacity = _series(text, "gpu_alloc_device_capacity", device_id=ghost_device, slot="cuda.shares")
            assert capacity == float(node._capacity[gpu_of[ghost_device]])
            assert health(text, lost) == "lost" and health(text, remap) == "needs_reset"

            play(node, clock, ghost.onset)  # the session ends; one telemetry sample later:
            text = metrics()
            assert _series(text, "gpu_alloc_device_ghost_memory_bytes", device_id=ghost_device, cause="dead_process") == held
            assert _series(text, "gpu_alloc_ghost_memory_holder_info", device_id=ghost_device, kernel_id=ghosted.kernel_id,
                           session_id=ghosted.session_id) == 1
            # The memory the SM bound leaves spare takes the first 12.5 GiB; the rest costs whole shares.
            spare = node.machine.gpus[gpu_of[ghost_device]].memory_total - node.machine.gpus[gpu_of[ghost_device]].memory_reserved \
                - capacity * 2 * 1024**3
            lost_shares = _series(text, "gpu_alloc_device_capacity", device_id=ghost_device, slot="cuda.shares")
            assert lost_shares == capacity - math.ceil((held - spare) / (2 * 1024**3) * 100) / 100 < capacity

            play(node, clock, 181)  # GPU 5 was reset at +3:00: cleared once a sample reads it again
            wait_for(lambda: health(metrics(), lost) == "ok", 5)
            play(node, clock, ghost.ends)
            text = metrics()
            assert not _series(text, "gpu_alloc_device_ghost_memory_bytes", device_id=ghost_device, cause="dead_process")
            assert _series(text, "gpu_alloc_device_capacity", device_id=ghost_device, slot="cuda.shares") == capacity
            reset_at = next(p.ends for p in node.promises if p.alert == "GpuAllocGpuResetPending")
            play(node, clock, reset_at - 1)
            assert health(metrics(), remap) == "needs_reset"  # 15 minutes on, still latched
            play(node, clock, reset_at)
            wait_for(lambda: health(metrics(), remap) == "ok", 5)
        finally:
            exporter.close()


def test_the_duty_cycled_kernel_defeats_a_scraped_gauge_but_not_the_busy_counter(tmp_path: Path) -> None:
    """Busy 3 s of every 15 s, in step with a 15 s scrape: the utilisation gauge a scraper reads
    every 15 s sees one phase of the cycle each time (off by 50 % or more), while the busy-time
    counter, integrated from the driver's own samples, counts every burst (within 1 %)."""
    clock = Clock()
    node = LivingNode(tmp_path, seed=7, clock=clock, driver_clock=clock)
    with node.machine.installed():
        node.populate()
        duty = next(s for s in node.sessions.values() if s.duty)
        assert duty.planted.startswith("duty-cycled") and "duty-cycled" in node.describe()
        pids = {p.pid for p in duty.processes}
        gpus = sorted({p.gpu for p in duty.processes})
        source = NvmlSource(clock=clock, xid_events=False)
        source.prepare()
        try:
            def step_to(demo_t: float) -> None:
                while node.now() < demo_t:
                    clock.t += 1.0
                    node.tick()

            def busy() -> float:
                return sum(s for g in gpus for pid, s in (source.read_device(g).process_busy_seconds or {}).items() if pid in pids)

            start = math.ceil(node.now() / DUTY_PERIOD_S + 1) * DUTY_PERIOD_S
            step_to(start)
            before, scraped = busy(), []
            for cycle in range(1, 11):  # ten cycles, read every second as the exporter samples, scraped every 15 s
                for second in range(int(DUTY_PERIOD_S)):
                    step_to(start + (cycle - 1) * DUTY_PERIOD_S + second + 1)
                    readings = [source.read_device(g).process_utilization or {} for g in gpus]
                    if second == 6:  # the scrape, at the same phase of every cycle
                        scraped.append(sum(r.get(pid, 0.0) for r in readings for pid in pids) / len(pids))
            counted = busy() - before
        finally:
            source.close()
    truth = DUTY_BUSY_S / DUTY_PERIOD_S
    window = 10 * DUTY_PERIOD_S
    assert counted == pytest.approx(truth * window * len(pids), rel=0.01)
    gauge = sum(scraped) / len(scraped)
    assert abs(gauge - truth) >= 0.5 * truth, (gauge, truth)
