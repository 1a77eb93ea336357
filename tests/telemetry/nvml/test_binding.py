"""The NVML source on the fake libnvidia-ml (and, marked ``gpu``, on a real driver)."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import fields

import pytest
from helpers import wait_for

from exporter.telemetry.model import DeviceReading, MigPlacement, NullSource, TelemetryUnavailable
from exporter.telemetry.nvml import THROTTLE_REASONS, NvmlSource, probe
from exporter.telemetry.nvml.simulated import GIB, UNKNOWN, FakeNvml
from exporter.telemetry.sources import open_source


@pytest.fixture(params=["fake", pytest.param("real", marks=pytest.mark.gpu)])
def machine(request: pytest.FixtureRequest):
    """The fake DGX A100, or this host's driver (skipped when NVML does not initialise)."""
    if request.param == "fake":
        fake = FakeNvml.dgx_a100()
        with fake.installed():
            yield fake
    else:
        problem = probe()
        if problem is not None:
            pytest.skip(f"NVML unavailable: {problem}")
        yield None


@pytest.fixture
def dgx():
    fake = FakeNvml.dgx_a100()
    with fake.installed():
        yield fake


def read_all(source: NvmlSource) -> list[DeviceReading]:
    info = source.prepare()
    return [r for r in map(source.read_device, info.device_keys) if r is not None]


def no_nan(reading: object) -> None:
    for f in fields(reading):  # type: ignore[arg-type]
        value = getattr(reading, f.name)
        assert not (isinstance(value, float) and math.isnan(value)), f.name


# -- structural facts: the same on the fake and on real hardware --------------------------


def test_every_gpu_is_read_in_base_units(machine: FakeNvml | None) -> None:
    source = NvmlSource()
    try:
        info = source.prepare()
        readings = read_all(source)
    finally:
        source.close()
    assert info.device_count == len(info.device_keys) == len(readings) > 0
    assert info.driver_version and info.cuda_version
    assert len({r.uuid for r in readings}) == len(readings)
    for r in readings:
        no_nan(r)
        assert r.uuid.startswith("GPU-") and r.up and not r.stale
        assert r.memory_total_bytes and r.memory_total_bytes > 2**30
        assert r.memory_used_bytes is None or 0 <= r.memory_used_bytes <= r.memory_total_bytes
        for ratio in (r.utilization_gpu_ratio, r.utilization_memory_ratio):
            assert ratio is None or 0 <= ratio <= 1
        assert r.temperature_celsius is None or 0 < r.temperature_celsius < 130
        assert r.power_usage_watts is None or 0 <= r.power_usage_watts < 2000
        assert r.sm_clock_hz is None or r.sm_clock_hz > 1e7
        assert set(r.throttle_reasons) <= {name for _, name in THROTTLE_REASONS}
        for process in r.processes or ():
            assert process.pid > 0
        assert all(0 <= ratio <= 1 for ratio in (r.process_utilization or {}).values())


def test_mig_devices_sit_inside_their_gpu_instances(machine: FakeNvml | None) -> None:
    source = NvmlSource()
    try:
        readings = read_all(source)
    finally:
        source.close()
    for r in readings:
        if not r.mig_mode_current:
            assert r.mig_devices == () and r.mig_layout_readable is None
            continue
        assert r.utilization_gpu_ratio is None  # NVML has none on MIG-enabled GPUs
        instances = {gi.gpu_instance_id: gi for gi in r.gpu_instances}
        for mig in r.mig_devices:
            no_nan(mig)
            assert mig.uuid.startswith("MIG-") and mig.parent_uuid == r.uuid and mig.profile
            if r.mig_layout_readable:
                assert mig.placement == instances[mig.gpu_instance_id].placement
        spans = sorted((gi.placement.start, gi.placement.start + gi.placement.size) for gi in r.gpu_instances)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
        for profile in r.mig_profile_capacity or ():
            assert profile.remaining is None or 0 <= profile.remaining <= profile.instance_count


# -- the fake's presets in detail ---------------------------------------------------------


def test_dgx_a100_reports_every_gpu_and_mig_device_with_profile_and_placement(dgx: FakeNvml) -> None:
    source = NvmlSource()
    info = source.prepare()
    readings = read_all(source)
    source.close()
    assert (info.driver_version, info.cuda_version) == ("550.54.15", "12.4")
    assert [r.index for r in readings] == list(range(8))
    assert [r.uuid for r in readings] == [g.uuid for g in dgx.gpus]
    assert readings[0].pci_bus_id == "00000000:07:00.0" and readings[0].name == "NVIDIA A100-SXM4-40GB"
    # Driver 550 lacks nvmlDeviceGetTemperatureV: the older call answered.
    assert readings[0].temperature_celsius == 61
    assert readings[0].power_usage_watts == 362.0 and readings[0].power_limit_watts == 400.0
    assert readings[0].memory_reserved_bytes == 512 * 2**20
    assert [(p.pid, p.used_memory_bytes) for p in readings[0].processes] == [(4101, 12 * GIB), (4102, 3 * GIB)]
    assert readings[2].throttle_reasons["sw_power_cap"] and not readings[2].throttle_reasons["gpu_idle"]
    assert readings[3].remapped_rows_correctable == 2 and readings[3].remapped_rows_pending is False
    assert readings[5].ecc_corrected_errors == 12
    assert all(r.mig_mode_current is False for r in readings[:6])

    gpu6 = readings[6]
    assert gpu6.mig_layout_readable is True
    assert [(m.profile, m.placement) for m in gpu6.mig_devices] == [
        ("3g.20gb", MigPlacement(0, 4)),
        ("2g.10gb", MigPlacement(4, 2)),
        ("1g.5gb", MigPlacement(6, 1)),
    ]
    assert [m.multiprocessor_count for m in gpu6.mig_devices] == [42, 28, 14]
    assert gpu6.mig_devices[0].memory_total_bytes == 19968 * 2**20
    (process,) = gpu6.mig_devices[0].processes
    assert (process.pid, process.gpu_instance_id, process.compute_instance_id) == (6100, 1, 0)
    assert gpu6.remapped_rows_pending is None  # unsupported while MIG instances exist
    gpu7 = readings[7]
    assert [m.placement.start for m in gpu7.mig_devices] == list(range(7))
    assert {m.profile for m in gpu7.mig_devices} == {"1g.5gb"}
    capacity = {p.name: p for p in gpu7.mig_profile_capacity}
    assert set(capacity) == {"1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"}
    assert capacity["1g.10gb"].placements == tuple(MigPlacement(s, 2) for s in (0, 2, 4, 6))
    assert all(p.remaining == 0 for p in capacity.values())  # slice 7 is stranded


def test_remaining_capacity_follows_the_free_memory_slices() -> None:
    fake = FakeNvml.h100_node()
    with fake.installed():
        fake.configure_mig(0, [("3g.40gb", 4)])
        source = NvmlSource()
        source.prepare()
        reading = source.read_device(0)
        source.close()
    remaining = {p.name: p.remaining for p in reading.mig_profile_capacity}
    # One 3g instance at start 4 (4 of the 8 memory slices) leaves the lower half free.
    assert remaining == {"1g.10gb": 4, "1g.10gb+me": 1, "1g.20gb": 2, "2g.20gb": 2, "3g.40gb": 1, "4g.40gb": 1, "7g.80gb": 0}


def test_a_lost_gpu_is_down_with_its_identity_and_the_others_are_unaffected(dgx: FakeNvml) -> None:
    source = NvmlSource()
    before = read_all(source)
    dgx.lose(3)
    dgx.lose(5, handle_code=UNKNOWN)  # how GetHandleByIndex answers for some broken GPUs
    after = read_all(source)
    source.close()
    for lost in (3, 5):
        assert after[lost].up is False and not after[lost].stale
        assert (after[lost].uuid, after[lost].name, after[lost].serial) == (before[lost].uuid, before[lost].name, before[lost].serial)
        assert after[lost].memory_used_bytes is None and after[lost].power_usage_watts is None
    assert [r.up for r in after] == [i not in (3, 5) for i in range(8)]
    assert after[0].power_usage_watts == before[0].power_usage_watts


def test_a_gpu_lost_before_it_was_ever_identified_is_left_out(dgx: FakeNvml) -> None:
    dgx.lose(3)
    source = NvmlSource()
    readings = read_all(source)
    source.close()
    assert [r.index for r in readings] == [0, 1, 2, 4, 5, 6, 7]


def test_not_supported_everywhere_leaves_only_the_identity(dgx: FakeNvml) -> None:
    dgx.set_unsupported(2, "*")
    source = NvmlSource()
    reading = read_all(source)[2]
    source.close()
    assert reading.uuid == dgx.gpus[2].uuid and reading.up
    identity = {"uuid", "index", "name", "pci_bus_id", "up", "stale", "last_update_timestamp", "nvml_generation"}
    empty = {"throttle_reasons", "mig_devices", "gpu_instances"}
    from_cuda = {"multiprocessor_count", "allocatable_memory_bytes"}  # libcuda answers regardless of NVML
    assert reading.multiprocessor_count == 108
    for f in fields(reading):
        if f.name not in identity | empty | from_cuda:
            assert getattr(reading, f.name) is None, f.name
    assert all(not getattr(reading, name) for name in empty)


def test_an_old_driver_is_read_through_the_older_calls() -> None:
    fake = FakeNvml.v100_old_driver()
    with fake.installed():
        source = NvmlSource()
        readings = read_all(source)
        read_all(source)
        source.close()
    v100 = readings[0]
    assert v100.temperature_celsius == 35
    assert (v100.memory_total_bytes, v100.memory_used_bytes, v100.memory_reserved_bytes) == (32 * GIB, 9 * GIB, None)
    assert [(p.pid, p.used_memory_bytes) for p in v100.processes] == [(3100, 9 * GIB)]
    assert v100.throttle_reasons["gpu_idle"] is True  # via ...ClocksThrottleReasons
    assert v100.numa_node is None and v100.mig_mode_current is None and v100.remapped_rows_pending is None
    assert (readings[1].retired_pages_single_bit, readings[1].retired_pages_double_bit) == (2, 1)
    assert readings[1].retired_pages_pending is True
    # The older calls answered for all four GPUs in both cycles.
    assert fake.calls["nvmlDeviceGetMemoryInfo"] == fake.calls["nvmlDeviceGetTemperature"] == 8


def test_no_permission_on_mig_geometry_is_recorded_not_guessed(dgx: FakeNvml) -> None:
    dgx.unprivileged = True
    source = NvmlSource()
    gpu6 = read_all(source)[6]
    source.close()
    assert gpu6.mig_layout_readable is False
    assert gpu6.gpu_instances == () and gpu6.mig_profile_capacity is None
    assert [m.profile for m in gpu6.mig_devices] == ["3g.20gb", "2g.10gb", "1g.5gb"]  # from the device names
    assert [m.placement for m in gpu6.mig_devices] == [None, None, None]
    assert [m.gpu_instance_id for m in gpu6.mig_devices] == [1, 2, 3]
    # The parent's aggregates need privileges too; each MIG handle still answers for itself.
    assert gpu6.memory_used_bytes is None and gpu6.processes is None
    assert gpu6.mig_devices[0].processes[0].pid == 6100


def test_driver_unload_makes_the_source_unavailable_until_it_can_initialise_again(dgx: FakeNvml) -> None:
    source = NvmlSource()
    assert len(read_all(source)) == 8
    dgx.unload_driver()
    with pytest.raises(TelemetryUnavailable):
        source.read_device(0)
    with pytest.raises(TelemetryUnavailable, match="nvmlInit"):
        source.prepare()
    dgx.load_driver()
    assert len(read_all(source)) == 8
    source.close()


def test_a_driver_newer_than_the_kernel_module_is_unavailable(dgx: FakeNvml) -> None:
    dgx.driver_state = "rm_mismatch"
    source = NvmlSource()
    with pytest.raises(TelemetryUnavailable, match="(?i)mismatch"):
        source.prepare()
    source.close()


def test_mig_reconfiguration_shows_up_on_the_next_read(dgx: FakeNvml) -> None:
    source = NvmlSource()
    old = read_all(source)[6].mig_devices
    dgx.configure_mig(6, [("7g.40gb", 0)])
    (whole,) = read_all(source)[6].mig_devices
    assert (whole.profile, whole.placement) == ("7g.40gb", MigPlacement(0, 8))
    assert whole.uuid not in {m.uuid for m in old}
    dgx.disable_mig(6)
    gpu6 = read_all(source)[6]
    source.close()
    assert gpu6.mig_mode_current is False and gpu6.mig_devices == () and gpu6.utilization_gpu_ratio == 0


def test_xid_events_are_counted_per_gpu_and_code_even_from_a_lost_gpu() -> None:
    now = [1000.0]
    fake = FakeNvml.dgx_a100()
    with fake.installed():
        source = NvmlSource(clock=lambda: now[0], event_wait_ms=20)
        source.prepare()
        fake.push_xid(2, 48)
        fake.push_xid(2, 48)
        fake.push_xid(5, 31)
        wait_for(lambda: sum(x.count for x in source.xid_counters()) == 3)
        now[0] = 2000.0
        fake.lose(2)
        fake.push_xid(2, 79)  # "fell off the bus": the GPU can no longer tell its UUID
        wait_for(lambda: len(source.xid_counters()) == 3)
        counters = {(x.device_uuid, x.xid): x for x in source.xid_counters()}
        source.close()
    uuid2, uuid5 = fake.gpus[2].uuid, fake.gpus[5].uuid
    assert {k: c.count for k, c in counters.items()} == {(uuid2, 48): 2, (uuid5, 31): 1, (uuid2, 79): 1}
    assert counters[(uuid2, 48)].last_seen_timestamp == 1000.0
    assert counters[(uuid2, 79)].last_seen_timestamp == 2000.0


def test_process_utilization_covers_the_samples_since_the_last_read() -> None:
    now = [1000.0]
    fake = FakeNvml.dgx_a100(clock=lambda: now[0])
    with fake.installed():
        source = NvmlSource(clock=lambda: now[0])
        first = read_all(source)
        again = read_all(source)  # same instant: no newer samples, so nothing ran
        now[0] += 5
        later = read_all(source)
        source.close()
    assert first[0].process_utilization == {4101: 0.61, 4102: 0.33}
    assert first[1].process_utilization == {5120: 0.64}
    assert first[3].process_utilization == {}  # sampled, no process
    assert first[6].process_utilization is None  # NVML has no per-process samples under MIG
    assert again[0].process_utilization == {}
    assert later[0].process_utilization == first[0].process_utilization


def test_pcie_throughput_is_read_only_when_asked(dgx: FakeNvml) -> None:
    plain, pcie = NvmlSource(), NvmlSource(pcie=True)
    assert read_all(plain)[0].pcie_rx_bytes_per_second is None
    assert "nvmlDeviceGetPcieThroughput" not in dgx.calls
    reading = read_all(pcie)[0]
    plain.close()
    pcie.close()
    assert (reading.pcie_rx_bytes_per_second, reading.pcie_tx_bytes_per_second) == (1200 * 1024, 800 * 1024)


def test_auto_picks_nvml_only_when_nvml_initialises(dgx: FakeNvml) -> None:
    assert isinstance(open_source("auto"), NvmlSource)
    dgx.unload_driver()
    assert probe() is not None
    assert isinstance(open_source("auto"), NullSource)


def test_importing_the_exporter_does_not_touch_the_driver() -> None:
    code = (
        "import sys, exporter.telemetry.nvml, exporter.telemetry, exporter.metrics.telemetry, exporter.telemetry.devices, exporter.telemetry.mock;"
        "assert 'pynvml' not in sys.modules, 'pynvml imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
