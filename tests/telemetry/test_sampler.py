"""The background sampler: deadlines, stale devices, lost GPUs, driver loss and recovery."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from pathlib import Path

import pytest
from helpers import FIXTURES, wait_for

from exporter.telemetry.mock import MockConfigError, MockSource
from exporter.telemetry.model import DeviceReading, NullSource, SourceInfo, TelemetrySnapshot, XidCounter
from exporter.telemetry.nvml import NvmlSource
from exporter.telemetry.nvml.simulated import FakeNvml
from exporter.telemetry.sampler import TelemetrySampler
from exporter.telemetry.sources import open_source

UPSTREAM_MOCK = FIXTURES / "mock-accelerator.toml"


@pytest.fixture
def dgx():
    fake = FakeNvml.dgx_a100()
    with fake.installed():
        yield fake


def sampler(source, interval_s: float = 0.02, timeout_s: float = 0.2, **kwargs) -> TelemetrySampler:
    return TelemetrySampler(source, interval_s=interval_s, timeout_s=timeout_s, **kwargs)


def until(s: TelemetrySampler, condition: Callable[[TelemetrySnapshot], bool], timeout: float = 5.0) -> TelemetrySnapshot:
    """The first published snapshot that meets ``condition`` (bounded wait)."""
    return wait_for(lambda: (lambda snap: snap if condition(snap) else None)(s.latest()), timeout)


def healthy(snap: TelemetrySnapshot) -> bool:
    return snap.success and len(snap.devices) == 8 and all(d.up and not d.stale for d in snap.devices)


def nvml_workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("telemetry-nvml-")]


def timed_latest(s: TelemetrySampler) -> TelemetrySnapshot:
    started = time.perf_counter()
    snap = s.latest()
    assert time.perf_counter() - started < 0.01
    return snap


def test_a_hung_call_never_delays_latest_and_the_other_gpus_keep_flowing(dgx: FakeNvml) -> None:
    with sampler(NvmlSource(event_wait_ms=20)) as s:
        until(s, healthy)
        hang = dgx.hang("nvmlDeviceGetPowerUsage", index=2)
        assert hang.entered.wait(5)
        stuck_since = time.time()
        timed_latest(s)
        snap = until(
            s,
            lambda sn: sn.success
            and sn.devices[2].stale
            and all(d.last_update_timestamp > stuck_since for i, d in enumerate(sn.devices) if i != 2),
        )
        assert snap.devices[2].up is False and snap.devices[2].uuid == dgx.gpus[2].uuid
        assert snap.devices[2].last_update_timestamp < stuck_since
        assert all(d.up and not d.stale for i, d in enumerate(snap.devices) if i != 2)
        version = s.version
        assert s.wait_for_version(version + 3, 5)  # cycles go on; the stuck GPU is not asked again
        assert len(nvml_workers()) <= 2  # the stuck worker and its replacement
        timed_latest(s)
        hang.release()
        until(s, healthy)


def test_a_hung_prepare_marks_every_gpu_stale_until_it_returns(dgx: FakeNvml) -> None:
    with sampler(NvmlSource(event_wait_ms=20)) as s:
        until(s, healthy)
        hang = dgx.hang("nvmlDeviceGetCount_v2")
        snap = until(s, lambda sn: not sn.success)
        assert "blocked" in snap.error
        assert len(snap.devices) == 8 and all(d.stale and not d.up for d in snap.devices)
        timed_latest(s)
        hang.release()
        until(s, healthy)


def test_calls_stuck_on_every_gpu_stop_new_threads_at_the_limit(dgx: FakeNvml) -> None:
    with sampler(NvmlSource(event_wait_ms=20), max_blocked_calls=2) as s:
        until(s, healthy)
        hang = dgx.hang("nvmlDeviceGetPowerUsage")
        snap = until(s, lambda sn: len(sn.devices) == 8 and all(d.stale for d in sn.devices))
        assert not any(d.up for d in snap.devices)
        version = s.version
        assert s.wait_for_version(version + 2, 5)
        assert len(nvml_workers()) <= 2
        hang.release()
        until(s, healthy)


def test_a_gpu_lost_mid_run_is_down_in_the_next_cycle_and_the_others_keep_reporting(dgx: FakeNvml) -> None:
    with sampler(NvmlSource(event_wait_ms=20), interval_s=0.05) as s:
        until(s, healthy)
        version = s.version
        dgx.lose(3)
        # The cycle under way may have read GPU 3 before it was lost; the next one cannot.
        assert s.wait_for_version(version + 1, 5)
        snap = s.latest()
    assert snap.success
    assert [d.up for d in snap.devices] == [i != 3 for i in range(8)]
    assert not any(d.stale for d in snap.devices)
    assert snap.devices[3].uuid == dgx.gpus[3].uuid and snap.devices[3].power_usage_watts is None
    assert all(d.power_usage_watts is not None for i, d in enumerate(snap.devices) if i != 3)
    # Its energy counter stays at the last value read: what the accounting counted before the
    # loss must stay visible to increase(); the other readings are gone.
    assert snap.devices[3].energy_joules is not None and snap.devices[3].energy_joules > 0


def test_driver_loss_reports_failure_and_reinitialises_with_backoff(dgx: FakeNvml) -> None:
    clock = [5000.0]
    with sampler(NvmlSource(event_wait_ms=20), clock=lambda: clock[0]) as s:
        until(s, healthy)
        dgx.unload_driver()
        failed = until(s, lambda sn: not sn.success)
        # The clock moves only now: a cycle that succeeded just before the unload is stamped 5000 too.
        clock[0] = 6000.0
        assert failed.devices == () and failed.error and failed.last_success_timestamp == 5000.0
        inits, started = dgx.calls["nvmlInitWithFlags"], time.monotonic()
        wait_for(lambda: dgx.calls["nvmlInitWithFlags"] >= inits + 3)
        # Retries at 2, 4, 8 … intervals: three of them take at least 0.2 s; without backoff 0.06 s.
        assert time.monotonic() - started >= 0.2
        assert not s.latest().success
        dgx.load_driver()
        back = until(s, healthy)
        assert back.last_success_timestamp == 6000.0
        dgx.push_xid(1, 94)  # the XID watcher came back with the new NVML session
        until(s, lambda sn: [(x.device_uuid, x.xid, x.count) for x in sn.xid_errors] == [(dgx.gpus[1].uuid, 94, 1)])


def test_the_first_snapshot_is_served_before_the_first_cycle_ends(dgx: FakeNvml) -> None:
    hang = dgx.hang("nvmlInitWithFlags")
    with sampler(NvmlSource(event_wait_ms=20), timeout_s=5.0) as s:
        assert hang.entered.wait(5)
        snap = timed_latest(s)
        assert (s.version, snap.success, snap.source, snap.devices) == (0, False, "nvml", ())
        hang.release()
        until(s, healthy)


def test_mig_reconfiguration_and_xids_reach_the_snapshot(dgx: FakeNvml) -> None:
    with sampler(NvmlSource(event_wait_ms=20)) as s:
        until(s, healthy)
        dgx.configure_mig(6, [("4g.20gb", 0), ("3g.20gb", 4)])
        dgx.push_xid(4, 13)
        snap = until(s, lambda sn: [m.profile for m in sn.devices[6].mig_devices] == ["4g.20gb", "3g.20gb"])
        until(s, lambda sn: any(x.xid == 13 for x in sn.xid_errors))
    assert [m.placement.start for m in snap.devices[6].mig_devices] == [0, 4]


class ScriptedSource:
    """A non-blocking source whose devices can be made to fail."""

    name = "scripted"
    may_block = False

    def __init__(self) -> None:
        self.failing: set[int] = set()
        self.closed = False

    def prepare(self) -> SourceInfo:
        return SourceInfo((0, 1, 2), "1.0", "12.0", 3)

    def read_device(self, key: Hashable) -> DeviceReading:
        if key in self.failing:
            raise RuntimeError("a bug in the source")
        return DeviceReading(uuid=f"GPU-{key}", index=int(key), last_update_timestamp=time.time())  # type: ignore[call-overload]

    def xid_counters(self) -> tuple[XidCounter, ...]:
        return ()

    def close(self) -> None:
        self.closed = True


def test_a_failing_device_read_keeps_the_last_reading_as_stale() -> None:
    source = ScriptedSource()
    s = sampler(source, clock=lambda: 42.0)
    first = until(s, lambda sn: sn.success)
    assert (first.timestamp, first.last_success_timestamp, first.driver_version) == (42.0, 42.0, "1.0")
    assert first.duration_seconds is not None and first.duration_seconds >= 0
    source.failing.add(1)
    snap = until(s, lambda sn: sn.devices[1].stale)
    assert snap.success and [d.stale for d in snap.devices] == [False, True, False]
    assert not [t for t in threading.enumerate() if t.name.startswith("telemetry-scripted-")]  # no workers
    s.close()
    s.close()
    assert source.closed


def test_mock_devices_are_sampled_on_the_injected_clock() -> None:
    with sampler(MockSource(UPSTREAM_MOCK, clock=lambda: 1000.0)) as s:
        snap = until(s, lambda sn: sn.success)
    assert [d.uuid for d in snap.devices] == [f"GPU-c59395cd-ac91-4cd3-a1b0-3d2568aa2d0{i}" for i in range(1, 5)]
    assert {d.last_update_timestamp for d in snap.devices} == {1000.0}
    assert (snap.driver_version, snap.cuda_version, snap.device_count) == ("450.0.0", "11.0", 4)
    assert not [t for t in threading.enumerate() if t.name == "nvml-xid-events"]  # mock devices raise no XIDs


def test_open_source_builds_each_kind(dgx: FakeNvml, tmp_path: Path) -> None:
    assert isinstance(open_source("none"), NullSource)
    assert isinstance(open_source("nvml"), NvmlSource)
    assert isinstance(open_source("mock", mock_file=UPSTREAM_MOCK), MockSource)
    with pytest.raises(ValueError, match="device file"):
        open_source("mock")
    with pytest.raises(MockConfigError, match="missing.toml"):
        open_source("mock", mock_file=tmp_path / "missing.toml")
    with pytest.raises(ValueError, match="unknown telemetry source"):
        open_source("dcgm")


def test_the_none_source_publishes_an_empty_successful_snapshot() -> None:
    with sampler(NullSource()) as s:
        snap = until(s, lambda sn: sn.success)
    assert (snap.source, snap.devices) == ("none", ())


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError):
        TelemetrySampler(NullSource(), interval_s=0)
