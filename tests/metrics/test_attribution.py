"""Exposition of attribution results: names, labels, values, opt-in PIDs, promtool-clean."""

from __future__ import annotations

import subprocess

import pytest
from attribution_node import GPU, K1, K2, K4, K5, K6, LEAKED_MIG, MIG, Clock, dgx, run, tracker
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from exporter.metrics.attribution import attribution_families, attribution_health
from exporter.metrics.registry import ExporterCollector, Part
from exporter.telemetry.nvml.simulated import GIB as GiB

FAMILIES = {
    "gpu_alloc_collector_success",
    "gpu_alloc_collector_duration_seconds",
    "gpu_alloc_collector_last_success_timestamp_seconds",
    "gpu_alloc_kernel_processes",
    "gpu_alloc_kernel_memory_used_bytes",
    "gpu_alloc_kernel_utilization_ratio",
    "gpu_alloc_kernel_isolation_breach",
    "gpu_alloc_kernel_idle_seconds",
    "gpu_alloc_kernel_no_process_seconds",
    "gpu_alloc_device_unattributed_processes",
    "gpu_alloc_device_unattributed_memory_bytes",
    "gpu_alloc_device_utilization_attributable",
}
PER_PROCESS = {"gpu_alloc_process_memory_used_bytes", "gpu_alloc_process_utilization_ratio"}


class _Families(Collector):
    def __init__(self, families):
        self._families = families

    def collect(self):
        return iter(self._families)


def registry_for(result, **kw) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    part = Part("attribution", lambda: attribution_families(result, **kw), lambda: 0, health=lambda: attribution_health(result))
    registry.register(ExporterCollector([part]))
    return registry


@pytest.fixture(scope="module")
def result():
    clock = Clock(0.0)
    t = tracker(clock=clock)
    run(t, dgx(gpu={4: {"process_utilization": None}}))
    clock.now = 900.0
    return run(t, dgx(gpu={4: {"process_utilization": None}}))


def test_families_and_values(result):
    reg = registry_for(result)
    names = {m.name for m in reg.collect()}
    assert names == FAMILIES

    def value(name, **labels):
        return reg.get_sample_value(name, labels)

    assert value("gpu_alloc_collector_success", collector="attribution") == 1
    assert value("gpu_alloc_kernel_processes", kernel_id=K1, device_id=GPU[0]) == 2
    assert value("gpu_alloc_kernel_memory_used_bytes", kernel_id=K1, device_id=GPU[0]) == 6 * GiB
    assert value("gpu_alloc_kernel_utilization_ratio", kernel_id=K1, device_id=GPU[0]) == 1.0
    assert value("gpu_alloc_kernel_isolation_breach", kernel_id=K1, device_id=GPU[0]) == 0
    assert value("gpu_alloc_kernel_isolation_breach", kernel_id=K2, device_id=GPU[3]) == 1
    assert value("gpu_alloc_kernel_isolation_breach", kernel_id=K5, device_id=MIG[1]) == 1
    assert value("gpu_alloc_kernel_idle_seconds", kernel_id=K1, device_id=GPU[1]) == 900
    assert value("gpu_alloc_kernel_no_process_seconds", kernel_id=K4, device_id=GPU[4]) == 900
    assert value("gpu_alloc_kernel_idle_seconds", kernel_id=K4, device_id=GPU[4]) is None  # no samples there
    assert value("gpu_alloc_kernel_no_process_seconds", kernel_id=K6, device_id=MIG[2]) == 900
    assert value("gpu_alloc_device_unattributed_processes", device_id=LEAKED_MIG, reason="unknown_container") == 1
    assert value("gpu_alloc_device_unattributed_memory_bytes", device_id=GPU[5], reason="host") == GiB // 2
    assert value("gpu_alloc_device_unattributed_processes", device_id=GPU[0], reason="host") is None
    assert value("gpu_alloc_device_utilization_attributable", device_id=GPU[0]) == 1
    assert value("gpu_alloc_device_utilization_attributable", device_id=MIG[0]) == 0


def test_what_cannot_be_measured_is_absent_not_zero(result):
    reg = registry_for(result)
    # MIG: no per-process utilisation, so neither utilisation nor idleness is claimed.
    assert reg.get_sample_value("gpu_alloc_kernel_utilization_ratio", {"kernel_id": K5, "device_id": MIG[0]}) is None
    assert reg.get_sample_value("gpu_alloc_kernel_idle_seconds", {"kernel_id": K5, "device_id": MIG[0]}) is None
    # Nor on a GPU whose driver gives no per-process samples.
    assert reg.get_sample_value("gpu_alloc_device_utilization_attributable", {"device_id": GPU[4]}) == 0
    assert reg.get_sample_value("gpu_alloc_kernel_utilization_ratio", {"kernel_id": K4, "device_id": GPU[4]}) is None


def test_no_pid_label_unless_asked(result):
    plain = generate_latest(registry_for(result)).decode()
    assert "pid=" not in plain
    detailed = registry_for(result, process_detail=True)
    assert {m.name for m in detailed.collect()} == FAMILIES | PER_PROCESS
    labels = {"device_id": GPU[5], "pid": "4001", "kernel_id": ""}
    assert detailed.get_sample_value("gpu_alloc_process_memory_used_bytes", labels) == GiB // 2
    assert detailed.get_sample_value("gpu_alloc_process_utilization_ratio", labels) == 0.1
    labels = {"device_id": MIG[0], "pid": "5001", "kernel_id": K5}
    assert detailed.get_sample_value("gpu_alloc_process_memory_used_bytes", labels) == 8 * GiB
    assert detailed.get_sample_value("gpu_alloc_process_utilization_ratio", labels) is None


def test_allocation_and_use_never_share_a_family(result):
    # Measured use is never a copy of a device series per kernel: device memory is split, not repeated.
    reg = registry_for(result)
    per_kernel = sum(
        s.value for m in reg.collect() if m.name == "gpu_alloc_kernel_memory_used_bytes" for s in m.samples if s.labels["device_id"] == GPU[3]
    )
    assert per_kernel == 7 * GiB  # K3's 6 GiB + K2's stray 1 GiB = what NVML listed on GPU 3


def test_no_result_reports_failure_only():
    reg = registry_for(None)
    # The registry reports the part (failed, with its render time); the part itself has no series.
    assert [m.name for m in reg.collect() if m.samples] == ["gpu_alloc_collector_success", "gpu_alloc_collector_duration_seconds"]
    assert reg.get_sample_value("gpu_alloc_collector_success", {"collector": "attribution"}) == 0


def test_families_are_fresh_per_call(result):
    first, second = attribution_families(result), attribution_families(result)
    assert all(a is not b for a, b in zip(first, second, strict=True))
    assert [len(m.samples) for m in first] == [len(m.samples) for m in second]


@pytest.mark.tools("promtool")
def test_promtool_check_metrics_is_clean(result):
    text = generate_latest(registry_for(result, process_detail=True))
    checked = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True)
    assert checked.returncode == 0, checked.stderr.decode()



def _series(reg: CollectorRegistry, prefix: str) -> list:
    return [s for m in reg.collect() if m.name.startswith(prefix) for s in m.samples]


def test_kernel_series_collapse_per_kernel_or_go(result):
    per_device = registry_for(result)
    per_kernel = registry_for(result, kernel_series="per-kernel")
    off = registry_for(result, kernel_series="off")
    # Collapsed: one series per kernel, no device_id; processes and memory summed over its devices.
    assert all("device_id" not in s.labels for s in _series(per_kernel, "gpu_alloc_kernel_"))
    assert per_kernel.get_sample_value("gpu_alloc_kernel_processes", {"kernel_id": K1}) == sum(
        s.value for s in _series(per_device, "gpu_alloc_kernel_processes") if s.labels["kernel_id"] == K1)
    assert per_kernel.get_sample_value("gpu_alloc_kernel_memory_used_bytes", {"kernel_id": K1}) == sum(
        s.value for s in _series(per_device, "gpu_alloc_kernel_memory_used_bytes") if s.labels["kernel_id"] == K1)
    assert len(_series(per_kernel, "gpu_alloc_kernel_")) < len(_series(per_device, "gpu_alloc_kernel_"))
    assert not _series(off, "gpu_alloc_kernel_")
    assert _series(off, "gpu_alloc_device_unattributed_processes")  # device-level figures stay


def test_breach_series_can_be_served_only_while_active(result):
    every = _series(registry_for(result), "gpu_alloc_kernel_isolation_breach")
    active = _series(registry_for(result, breach_series="active"), "gpu_alloc_kernel_isolation_breach")
    assert {0.0, 1.0} == {s.value for s in every}
    assert active and all(s.value == 1 for s in active)
    assert {tuple(sorted(s.labels.items())) for s in active} == {tuple(sorted(s.labels.items())) for s in every if s.value == 1}
