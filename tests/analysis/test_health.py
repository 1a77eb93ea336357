"""Device health that stays until it is fixed, on the fake DGX A100 read through the real NVML source."""

from __future__ import annotations

import json
import logging
import time
from decimal import Decimal

import pytest
from helpers import wait_for

from exporter.analysis.health import HealthState, HealthStore, HealthTracker, parse_boot_id
from exporter.analysis.xid import CATALOGUE_VERSION, UNKNOWN_MEANING, xid_info
from exporter.metrics.health import health_families
from exporter.scratch.allocation import Allocation, Kernel, KernelState, ResourceSpec
from exporter.scratch.identity import Identity
from exporter.telemetry.devices import DeviceResolver
from exporter.telemetry.model import TelemetrySnapshot
from exporter.telemetry.nvml import NvmlSource
from exporter.telemetry.nvml.simulated import FakeNvml
from exporter.telemetry.sampler import TelemetrySampler

BOOT = "5f0c8a2e-1111-4222-8333-944445555666"


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def fake():
    machine = FakeNvml.dgx_a100()
    with machine.installed():
        yield machine


@pytest.fixture
def source(fake):
    src = NvmlSource(event_wait_ms=20)
    yield src
    src.close()


def sample(source: NvmlSource) -> TelemetrySnapshot:
    info = source.prepare()
    devices = tuple(r for r in map(source.read_device, info.device_keys) if r is not None)
    return TelemetrySnapshot(source="nvml", devices=devices, driver_version=info.driver_version, success=True,
                             device_count=info.device_count, xid_errors=source.xid_counters())


def kernel(kid: str, device_id: str, slot: str = "cuda.device") -> Kernel:
    spec = ResourceSpec((Allocation(slot, device_id, Decimal(1)),), (), None)
    return Kernel(kid, "/scratch", KernelState.OK, spec, None, 0.0, Identity(kid, session_id=f"s-{kid}", user_id=f"u-{kid}"))


def update(tracker: HealthTracker, snap: TelemetrySnapshot, kernels=()):
    by_id = {k.kernel_id: k for k in kernels}
    ids = [a.device_id for k in kernels for a in k.allocations]
    report = tracker.update(snap, by_id, DeviceResolver(snap, ids))
    return {d.uuid: d for d in report.devices}


def push_and_wait(fake: FakeNvml, source: NvmlSource, index: int, xid: int, gi: int | None = None) -> None:
    source.prepare()  # starts the XID thread
    before = sum(x.count for x in source.xid_counters())
    fake.push_xid(index, xid, gi)
    wait_for(lambda: sum(x.count for x in source.xid_counters()) > before)


def test_xid_79_stays_lost_across_a_restart_and_clears_only_after_a_reset(fake, source, tmp_path):
    state = tmp_path / "health.json"
    tracker = HealthTracker(HealthStore(state), BOOT, Clock())
    snap = sample(source)
    gpu1 = snap.devices[1].uuid
    assert update(tracker, snap)[gpu1].state is HealthState.OK
    push_and_wait(fake, source, 1, 79)
    fake.lose(1)
    health = update(tracker, sample(source), [kernel("k1", gpu1)])
    assert health[gpu1].state is HealthState.LOST and health[gpu1].xid == 79
    assert [k.session_id for k in health[gpu1].kernels] == ["s-k1"]
    assert json.loads(state.read_text())["devices"][gpu1]["state"] == "lost"

    # The exporter restarts: a new source (its XID counters start again) and a new tracker.
    source.close()
    again = NvmlSource(event_wait_ms=20)
    try:
        restarted = HealthTracker(HealthStore(state), BOOT, Clock(1_700_000_100.0))
        assert update(restarted, sample(again))[gpu1].state is HealthState.LOST
        fake.recover(1)  # it answers again, but nothing says it was reset
        assert update(restarted, sample(again))[gpu1].state is HealthState.LOST
        fake.reset(1)
        health = update(restarted, sample(again))
        assert health[gpu1].state is HealthState.OK and health[gpu1].since == 1_700_000_100.0
        assert json.loads(state.read_text())["devices"] == {}
    finally:
        again.close()


def test_a_new_boot_clears_what_the_state_file_latched(fake, source, tmp_path):
    state = tmp_path / "health.json"
    tracker = HealthTracker(HealthStore(state), BOOT, Clock())
    fake.update(2, remapped_rows=(0, 1, 1, 0))
    gpu2 = sample(source).devices[2].uuid
    assert update(tracker, sample(source))[gpu2].state is HealthState.NEEDS_RESET
    fake.update(2, remapped_rows=(0, 1, 0, 0))  # the pending flag alone going away is no remedy
    assert update(tracker, sample(source))[gpu2].state is HealthState.NEEDS_RESET
    assert HealthTracker(HealthStore(state), BOOT).latched == {gpu2: HealthState.NEEDS_RESET}
    rebooted = HealthTracker(HealthStore(state), "another-boot")
    assert rebooted.latched == {}
    assert update(rebooted, sample(source))[gpu2].state is HealthState.OK


def test_a_driver_reload_clears_a_latch(fake, source, tmp_path):
    tracker = HealthTracker(HealthStore(tmp_path / "h.json"), BOOT, Clock())
    push_and_wait(fake, source, 3, 48)
    gpu3 = sample(source).devices[3].uuid
    assert update(tracker, sample(source))[gpu3].state is HealthState.NEEDS_RESET
    fake.unload_driver()
    with pytest.raises(Exception):  # noqa: B017 - the source reports the driver gone
        sample(source)
    fake.load_driver()
    assert update(tracker, sample(source))[gpu3].state is HealthState.OK


def test_a_gpu_instance_xid_reaches_only_that_instance_and_a_parent_wide_one_all(fake, source, tmp_path):
    snap = sample(source)
    gpu6 = snap.devices[6]
    mig_a, mig_b = gpu6.mig_devices[0], gpu6.mig_devices[1]
    kernels = [kernel("ka", mig_a.uuid, "cuda.device:3g.20gb-mig"), kernel("kb", mig_b.uuid, "cuda.device:2g.10gb-mig")]
    tracker = HealthTracker(HealthStore(tmp_path / "h.json"), BOOT, Clock())
    push_and_wait(fake, source, 6, 94, mig_a.gpu_instance_id)
    health = update(tracker, sample(source), kernels)[gpu6.uuid]
    assert health.state is HealthState.DEGRADED and health.gpu_instances == (mig_a.gpu_instance_id,)
    assert [k.kernel_id for k in health.kernels] == ["ka"]
    push_and_wait(fake, source, 6, 95)  # an uncontained error: the whole GPU
    health = update(tracker, sample(source), kernels)[gpu6.uuid]
    assert health.state is HealthState.NEEDS_RESET and health.gpu_instances is None
    assert [k.kernel_id for k in health.kernels] == ["ka", "kb"]


def test_an_application_xid_latches_nothing_and_unknown_codes_say_so(fake, source, tmp_path):
    tracker = HealthTracker(HealthStore(tmp_path / "h.json"), BOOT, Clock())
    push_and_wait(fake, source, 0, 13)
    push_and_wait(fake, source, 0, 9999)
    assert update(tracker, sample(source))[sample(source).devices[0].uuid].state is HealthState.OK
    assert xid_info(9999).meaning == UNKNOWN_MEANING == "unknown XID, see the driver's catalogue"
    assert xid_info(79).effect == "lost"


def test_a_hung_call_turns_health_unknown_within_the_deadline_and_scrapes_stay_fast(fake, tmp_path):
    source = NvmlSource(event_wait_ms=20)
    sampler = TelemetrySampler(source, interval_s=0.05, timeout_s=0.2)
    fault = None
    try:
        wait_for(lambda: sampler.latest().success and len(sampler.latest().devices) == 8)
        tracker = HealthTracker(HealthStore(tmp_path / "h.json"), BOOT, Clock())
        gpu0 = sampler.latest().devices[0].uuid
        assert update(tracker, sampler.latest())[gpu0].state is HealthState.OK
        fault = fake.hang("nvmlDeviceGetPowerUsage", index=0)
        started = time.monotonic()
        wait_for(lambda: update(tracker, sampler.latest())[gpu0].state is HealthState.UNKNOWN, timeout=3.0)
        assert time.monotonic() - started < 2.0  # a deadline (0.2 s) and a cycle or two, not the hang
        t0 = time.perf_counter()
        report = tracker.update(sampler.latest(), {}, DeviceResolver(sampler.latest(), []))
        families = health_families(report)
        assert time.perf_counter() - t0 < 0.1
        state = {s.labels["device_id"]: s.labels["state"] for s in families[0].samples}
        assert state[gpu0] == "unknown"
        fault.release()
        wait_for(lambda: update(tracker, sampler.latest())[gpu0].state is HealthState.OK, timeout=3.0)
    finally:
        if fault is not None:
            fault.release()
        sampler.close()
        source.close()


def test_a_corrupt_state_file_is_one_log_line_and_a_fresh_start(tmp_path, caplog):
    state = tmp_path / "health.json"
    state.write_text("{not json")
    with caplog.at_level(logging.WARNING):
        tracker = HealthTracker(HealthStore(state), BOOT)
    assert tracker.latched == {}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and str(state) in lines[0] and "{not json" not in lines[0]
    state.write_text("x" * 70_000)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert HealthTracker(HealthStore(state), BOOT).latched == {}
    assert len(caplog.records) == 1


def test_an_unwritable_state_file_is_logged_once_and_latches_stay_in_memory(fake, source, tmp_path, caplog):
    state = tmp_path / "missing-dir" / "health.json"
    tracker = HealthTracker(HealthStore(state), BOOT, Clock())
    with caplog.at_level(logging.WARNING, logger="exporter.analysis.health"):
        fake.update(0, remapped_rows=(0, 0, 1, 0))
        update(tracker, sample(source))
        fake.update(1, remapped_rows=(0, 0, 1, 0))
        update(tracker, sample(source))
    writes = [r for r in caplog.records if "cannot be written" in r.getMessage()]
    assert len(writes) == 1
    assert len(tracker.latched) == 2 and not state.exists()


def test_the_state_file_is_written_atomically_and_bounded(fake, source, tmp_path):
    state = tmp_path / "health.json"
    tracker = HealthTracker(HealthStore(state), BOOT, Clock())
    for i in range(4):
        fake.update(i, remapped_rows=(0, 0, 1, 0))
    update(tracker, sample(source))
    doc = json.loads(state.read_text())
    assert doc["boot_id"] == BOOT and len(doc["devices"]) == 4
    assert [p.name for p in tmp_path.iterdir()] == ["health.json"]  # no temporary file left
    assert state.stat().st_size < 64 * 1024


def test_boot_id_parser():
    assert parse_boot_id(BOOT + "\n") == BOOT
    assert parse_boot_id("") is None
    assert parse_boot_id("x" * 100) is None


def test_fault_info_names_the_xid_meaning_and_catalogue_version(fake, source, tmp_path):
    tracker = HealthTracker(HealthStore(tmp_path / "h.json"), BOOT, Clock())
    push_and_wait(fake, source, 4, 48)
    snap = sample(source)
    report = tracker.update(snap, {}, DeviceResolver(snap, []))
    families = health_families(report)
    (fault,) = families[2].samples
    assert fault.labels["xid"] == "48" and fault.labels["state"] == "needs_reset"
    assert fault.labels["meaning"] == xid_info(48).meaning and fault.labels["catalogue_version"] == CATALOGUE_VERSION
