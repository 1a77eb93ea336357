"""Telemetry families: names, units, omission of unknown values, escaping, promtool."""

from __future__ import annotations

import dataclasses
import subprocess

import pytest
from processes import require_tool
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporter.metrics.registry import ExporterCollector, Part
from exporter.metrics.telemetry import ALERTING_THROTTLE_REASONS, telemetry_families, telemetry_health
from exporter.telemetry.devices import DeviceResolver
from exporter.telemetry.mock import DEMO_DEVICES_FILE, MockSource
from exporter.telemetry.model import DeviceReading, TelemetrySnapshot, XidCounter
from exporter.telemetry.nvml import NvmlSource
from exporter.telemetry.nvml.simulated import FakeNvml


class _Collector:
    def __init__(self, snapshot: TelemetrySnapshot, resolver: DeviceResolver) -> None:
        self.snapshot, self.resolver = snapshot, resolver

    def collect(self):
        # As the exporter wires it: the part named after the source, the registry reporting its health.
        part = Part(self.snapshot.source, lambda: telemetry_families(self.snapshot, self.resolver), lambda: 0,
                    health=lambda: telemetry_health(self.snapshot))
        return ExporterCollector([part]).collect()


def registry_for(snapshot: TelemetrySnapshot, scheme: str = "auto") -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(_Collector(snapshot, DeviceResolver(snapshot, scheme=scheme)))
    return registry


def render(snapshot: TelemetrySnapshot, scheme: str = "auto") -> str:
    return generate_latest(registry_for(snapshot, scheme)).decode()


def series_of(text: str, device_id: str) -> set[str]:
    return {
        sample.name
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels.get("device_id") == device_id
    }


def nvml_snapshot(fake: FakeNvml, **source_args) -> TelemetrySnapshot:
    with fake.installed():
        source = NvmlSource(event_wait_ms=20, **source_args)
        info = source.prepare()
        devices = tuple(r for r in map(source.read_device, info.device_keys) if r is not None)
        source.close()
    return TelemetrySnapshot(
        source="nvml",
        devices=devices,
        driver_version=info.driver_version,
        cuda_version=info.cuda_version,
        device_count=info.device_count,
        success=True,
        duration_seconds=0.012,
        timestamp=1700000000.0,
        last_success_timestamp=1700000000.0,
        xid_errors=(XidCounter(devices[4].uuid, 79, 2, 1699999000.0),),
    )


@pytest.fixture
def dgx() -> FakeNvml:
    return FakeNvml.dgx_a100()


def promtool_check(text: str) -> None:
    result = subprocess.run([require_tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_a_dgx_a100_exposition_is_clean_and_has_no_nan(dgx: FakeNvml) -> None:
    text = render(nvml_snapshot(dgx, pcie=True))
    promtool_check(text)
    assert "NaN" not in text and "nan" not in text.lower().replace("nanos", "")
    names = {family.name for family in text_string_to_metric_families(text)}
    assert all(name.startswith("gpu_alloc_") for name in names)
    assert "gpu_alloc_build_info" not in names


def test_demo_and_failure_expositions_are_clean_too() -> None:
    source = MockSource(DEMO_DEVICES_FILE, clock=lambda: 1000.0)
    demo = TelemetrySnapshot(source="mock", devices=tuple(map(source.read_device, range(5))), success=True, duration_seconds=0.001)
    promtool_check(render(demo))
    promtool_check(render(TelemetrySnapshot(source="nvml", error="nvmlInit failed", duration_seconds=0.002)))


def test_values_are_in_base_units(dgx: FakeNvml) -> None:
    snapshot = nvml_snapshot(dgx, pcie=True)
    registry = registry_for(snapshot)
    gpu0, gpu2 = {"device_id": dgx.gpus[0].uuid}, {"device_id": dgx.gpus[2].uuid}
    value = registry.get_sample_value
    assert value("gpu_alloc_device_power_watts", gpu0) == 362.0
    assert value("gpu_alloc_device_power_limit_watts", gpu0) == 400.0
    assert value("gpu_alloc_device_memory_total_bytes", gpu0) == 40 * 2**30
    assert value("gpu_alloc_device_utilization_ratio", gpu0) == 0.97
    assert value("gpu_alloc_device_temperature_celsius", gpu0) == 61
    assert value("gpu_alloc_device_clock_hertz", {**gpu0, "clock": "sm"}) == 1.41e9
    assert value("gpu_alloc_device_pcie_throughput_bytes_per_second", {**gpu0, "direction": "rx"}) == 1200 * 1024
    assert value("gpu_alloc_device_energy_joules_total", gpu0) >= 1000.0
    assert value("gpu_alloc_device_throttle_active", {**gpu2, "reason": "sw_power_cap"}) == 1
    assert value("gpu_alloc_device_throttle_active", {**gpu2, "reason": "gpu_idle"}) == 0
    assert value("gpu_alloc_device_ecc_corrected_errors_total", {"device_id": dgx.gpus[5].uuid}) == 12
    assert value("gpu_alloc_device_remapped_rows_total", {"device_id": dgx.gpus[3].uuid, "cause": "correctable"}) == 2
    assert value("gpu_alloc_device_mig_mode", {"device_id": dgx.gpus[6].uuid, "state": "current"}) == 1
    assert value("gpu_alloc_device_mig_layout_readable", {"device_id": dgx.gpus[6].uuid}) == 1
    assert value("gpu_alloc_device_up", gpu0) == 1 and value("gpu_alloc_device_stale", gpu0) == 0
    assert value("gpu_alloc_driver_info", {"driver_version": "550.54.15", "cuda_version": "12.4"}) == 1
    assert value("gpu_alloc_driver_devices", {}) == 8
    assert value("gpu_alloc_collector_success", {"collector": "nvml"}) == 1
    assert value("gpu_alloc_collector_duration_seconds", {"collector": "nvml"}) == 0.012
    assert value("gpu_alloc_collector_last_success_timestamp_seconds", {"collector": "nvml"}) == 1700000000.0
    xid = {"device_id": dgx.gpus[4].uuid, "xid": "79"}
    assert value("gpu_alloc_xid_errors_total", xid) == 2
    assert value("gpu_alloc_xid_last_seen_timestamp_seconds", xid) == 1699999000.0


def test_mig_devices_carry_profile_placement_and_parent(dgx: FakeNvml) -> None:
    snapshot = nvml_snapshot(dgx)
    text = render(snapshot, scheme="index")
    (info,) = [f for f in text_string_to_metric_families(text) if f.name == "gpu_alloc_mig_device_info"]
    gpu6 = [s.labels for s in info.samples if s.labels["parent_device_id"] == "6"]
    assert [(s["profile"], s["gi_id"], s["ci_id"], s["placement_start"], s["placement_size"]) for s in gpu6] == [
        ("3g.20gb", "1", "0", "0", "4"),
        ("2g.10gb", "2", "0", "4", "2"),
        ("1g.5gb", "3", "0", "6", "1"),
    ]
    mig = gpu6[0]["device_id"]
    assert mig.startswith("MIG-") and gpu6[0]["uuid"] == mig
    registry = registry_for(snapshot)
    assert registry.get_sample_value("gpu_alloc_mig_device_memory_total_bytes", {"device_id": mig}) == 19968 * 2**20
    assert registry.get_sample_value("gpu_alloc_mig_device_multiprocessors", {"device_id": mig}) == 42
    assert registry.get_sample_value("gpu_alloc_device_utilization_ratio", {"device_id": dgx.gpus[6].uuid}) is None


def test_unsupported_fields_are_omitted_not_nan(dgx: FakeNvml) -> None:
    dgx.set_unsupported(2, "*")
    text = render(nvml_snapshot(dgx))
    identity = {
        "gpu_alloc_device_info",
        "gpu_alloc_device_up",
        "gpu_alloc_device_stale",
        "gpu_alloc_device_last_update_timestamp_seconds",
        "gpu_alloc_device_multiprocessors",  # from libcuda, which NVML's NOT_SUPPORTED does not touch
    }
    assert series_of(text, dgx.gpus[2].uuid) == identity
    assert "gpu_alloc_device_power_watts" in series_of(text, dgx.gpus[1].uuid)
    assert "NaN" not in text


def test_lost_and_stale_gpus_keep_identity_and_drop_values(dgx: FakeNvml) -> None:
    snapshot = nvml_snapshot(dgx)
    stale = dataclasses.replace(snapshot.devices[1], up=False, stale=True)
    # What NvmlSource reports for a GPU that fell off the bus (see test_nvml.py).
    lost = DeviceReading(uuid=dgx.gpus[3].uuid, index=3, name=dgx.gpus[3].name, up=False, last_update_timestamp=1.0)
    snapshot = dataclasses.replace(snapshot, devices=(snapshot.devices[0], stale, lost))
    registry = registry_for(snapshot)
    text = generate_latest(registry).decode()
    for reading, stale_value in ((stale, 1), (lost, 0)):
        labels = {"device_id": reading.uuid}
        assert registry.get_sample_value("gpu_alloc_device_up", labels) == 0
        assert registry.get_sample_value("gpu_alloc_device_stale", labels) == stale_value
        assert registry.get_sample_value("gpu_alloc_device_power_watts", labels) is None
        assert "gpu_alloc_device_info" in series_of(text, reading.uuid)
    last_update = registry.get_sample_value("gpu_alloc_device_last_update_timestamp_seconds", {"device_id": stale.uuid})
    assert last_update == stale.last_update_timestamp
    # A counter stays at its last value while the GPU does not answer (the sampler keeps a lost
    # GPU's); nothing else of its readings is served.
    energy = registry.get_sample_value("gpu_alloc_device_energy_joules_total", {"device_id": stale.uuid})
    assert stale.energy_joules is not None and energy == stale.energy_joules
    assert registry.get_sample_value("gpu_alloc_device_energy_joules_total", {"device_id": lost.uuid}) is None


def test_an_unreadable_mig_layout_is_0_with_empty_placement_labels(dgx: FakeNvml) -> None:
    dgx.unprivileged = True
    snapshot = nvml_snapshot(dgx)
    registry = registry_for(snapshot)
    assert registry.get_sample_value("gpu_alloc_device_mig_layout_readable", {"device_id": dgx.gpus[6].uuid}) == 0
    (info,) = [f for f in text_string_to_metric_families(generate_latest(registry).decode()) if f.name == "gpu_alloc_mig_device_info"]
    placements = {(s.labels.get("placement_start", ""), s.labels.get("placement_size", "")) for s in info.samples}
    assert placements == {("", "")}


def test_a_failed_collection_exports_status_only() -> None:
    snapshot = TelemetrySnapshot(source="nvml", error="Driver Not Loaded", duration_seconds=0.003, last_success_timestamp=1600000000.0)
    registry = registry_for(snapshot)
    assert registry.get_sample_value("gpu_alloc_collector_success", {"collector": "nvml"}) == 0
    assert registry.get_sample_value("gpu_alloc_collector_duration_seconds", {"collector": "nvml"}) == 0.003
    assert registry.get_sample_value("gpu_alloc_collector_last_success_timestamp_seconds", {"collector": "nvml"}) == 1600000000.0
    names = {f.name for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert names == {
        "gpu_alloc_collector_success",
        "gpu_alloc_collector_duration_seconds",
        "gpu_alloc_collector_last_success_timestamp_seconds",
    }


def test_the_none_source_exports_nothing() -> None:
    assert telemetry_families(TelemetrySnapshot(source="none", success=True), DeviceResolver(TelemetrySnapshot(source="none"))) == []


def test_label_values_are_escaped_by_the_client_library() -> None:
    awkward = 'NVIDIA "A100"\\SXM4\nrev 2'
    snapshot = TelemetrySnapshot(source="nvml", devices=(DeviceReading(uuid="GPU-1", index=0, name=awkward),), success=True)
    text = render(snapshot)
    (info,) = [f for f in text_string_to_metric_families(text) if f.name == "gpu_alloc_device_info"]
    assert info.samples[0].labels["model"] == awkward
    promtool_check(text)


def test_device_id_follows_the_resolver(dgx: FakeNvml) -> None:
    snapshot = nvml_snapshot(dgx)
    registry = registry_for(snapshot, scheme="bare-uuid")
    bare = dgx.gpus[0].uuid.removeprefix("GPU-")
    assert registry.get_sample_value("gpu_alloc_device_info", {
        "device_id": bare, "uuid": dgx.gpus[0].uuid, "index": "0", "model": "NVIDIA A100-SXM4-40GB",
        "pci_bus_id": "00000000:07:00.0", "serial": "1563920000000", "numa_node": "3",
    }) == 1
    xid = {"device_id": dgx.gpus[4].uuid.removeprefix("GPU-"), "xid": "79"}
    assert registry.get_sample_value("gpu_alloc_xid_errors_total", xid) == 2


def test_throttle_reason_series_can_be_reduced(dgx: FakeNvml) -> None:
    snapshot = nvml_snapshot(dgx)
    resolver = DeviceResolver(snapshot)

    def reasons(mode: str) -> list:
        return [s for m in telemetry_families(snapshot, resolver, mode) if m.name == "gpu_alloc_device_throttle_active"
                for s in m.samples]

    every, alerting, active = reasons("all"), reasons("alerting"), reasons("active")
    assert {s.labels["reason"] for s in alerting} <= ALERTING_THROTTLE_REASONS
    assert {(s.labels["device_id"], s.labels["reason"]) for s in alerting} == {
        (s.labels["device_id"], s.labels["reason"]) for s in every if s.labels["reason"] in ALERTING_THROTTLE_REASONS}
    assert active and all(s.value == 1 for s in active) and len(active) == sum(1 for s in every if s.value == 1)
    assert len(active) < len(alerting) < len(every)
