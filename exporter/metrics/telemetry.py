"""Prometheus families for device telemetry, built fresh from one :class:`TelemetrySnapshot`.

Every series carries ``device_id`` spelled as Backend.AI spells it on this node
(:class:`exporter.telemetry.devices.DeviceResolver`). A value the source could not read (None) is omitted,
never exported as NaN or 0. A stale device (its driver calls are stuck) keeps its identity,
``up`` 0, ``stale`` 1 and its last-update time; its values are omitted but its energy counter,
which stays at the last value read (so is a lost GPU's: the accounting split those joules among
the kernels, and ``increase()`` of the counter must see them too). Sample::

    gpu_alloc_device_info{device_id="GPU-8fbf…",uuid="GPU-8fbf…",index="0",model="NVIDIA A100-SXM4-40GB",…} 1
    gpu_alloc_device_power_watts{device_id="GPU-8fbf…"} 362
    gpu_alloc_mig_device_info{device_id="MIG-a03f…",parent_device_id="GPU-bb94…",profile="3g.20gb",gi_id="1",…} 1
    gpu_alloc_xid_errors_total{device_id="GPU-6075…",xid="79"} 1
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from exporter.metrics.allocation import unknown_device_families
from exporter.metrics.collectors import Inputs, Part, register
from exporter.metrics.families import counter, gauge
from exporter.metrics.status import Health
from exporter.telemetry.devices import DeviceResolver
from exporter.telemetry.model import DeviceReading, MigDeviceReading, TelemetrySnapshot

if TYPE_CHECKING:
    from prometheus_client.core import Metric

__all__ = ["ALERTING_THROTTLE_REASONS", "THROTTLE_SERIES", "telemetry_families", "telemetry_health"]

_Getter = Callable[[DeviceReading], Any]

# Scalar device series: (type, name, help, value).
# Also written for a stale device: a counter stays at its last value while its GPU does not answer.
_ENERGY = ("counter", "gpu_alloc_device_energy_joules",
           "Energy consumed since the driver was loaded (held at the last value read while the GPU does not answer).")
_DEVICE_SERIES: tuple[tuple[str, str, str, _Getter], ...] = (
    ("gauge", "gpu_alloc_device_memory_total_bytes",
     "Total framebuffer memory (nvidia-smi memory.total).",
     lambda d: d.memory_total_bytes),
    ("gauge", "gpu_alloc_device_memory_used_bytes",
     "Framebuffer memory in use, excluding what the driver reserves (nvidia-smi memory.used).",
     lambda d: d.memory_used_bytes),
    ("gauge", "gpu_alloc_device_memory_reserved_bytes",
     "Framebuffer memory reserved by the driver and firmware (nvidia-smi memory.reserved).",
     lambda d: d.memory_reserved_bytes),
    ("gauge", "gpu_alloc_device_multiprocessors",
     "Streaming multiprocessors (SMs) of the GPU, where the source reports them.",
     lambda d: d.multiprocessor_count),
    ("gauge", "gpu_alloc_device_utilization_ratio",
     "Fraction of the last sample period (1/6 s to 1 s) in which a kernel ran (nvidia-smi utilization.gpu); "
     "absent on MIG-enabled GPUs.",
     lambda d: d.utilization_gpu_ratio),
    ("gauge", "gpu_alloc_device_memory_utilization_ratio",
     "Fraction of the last sample period in which device memory was read or written (nvidia-smi utilization.memory).",
     lambda d: d.utilization_memory_ratio),
    ("gauge", "gpu_alloc_device_temperature_celsius",
     "GPU core temperature (nvidia-smi temperature.gpu).",
     lambda d: d.temperature_celsius),
    ("gauge", "gpu_alloc_device_power_watts",
     "Power draw (nvidia-smi power.draw).",
     lambda d: d.power_usage_watts),
    ("gauge", "gpu_alloc_device_power_limit_watts",
     "Power limit in force (nvidia-smi enforced.power.limit).",
     lambda d: d.power_limit_watts),
    (*_ENERGY, lambda d: d.energy_joules),
    ("gauge", "gpu_alloc_device_fan_speed_ratio",
     "Fan speed as a fraction of its maximum (nvidia-smi fan.speed); can exceed 1.",
     lambda d: d.fan_speed_ratio),
    ("counter", "gpu_alloc_device_ecc_corrected_errors",
     "Corrected ECC memory errors over the GPU's lifetime (nvidia-smi ecc.errors.corrected.aggregate.total).",
     lambda d: d.ecc_corrected_errors),
    ("counter", "gpu_alloc_device_ecc_uncorrected_errors",
     "Uncorrected ECC memory errors over the GPU's lifetime (nvidia-smi ecc.errors.uncorrected.aggregate.total).",
     lambda d: d.ecc_uncorrected_errors),
    ("gauge", "gpu_alloc_device_remapped_rows_pending",
     "1 when remapped memory rows wait for a GPU reset (nvidia-smi remapped_rows.pending).",
     lambda d: d.remapped_rows_pending),
    ("gauge", "gpu_alloc_device_remapped_rows_failure",
     "1 when a memory row remapping failed; the GPU needs service (nvidia-smi remapped_rows.failure).",
     lambda d: d.remapped_rows_failure),
    ("gauge", "gpu_alloc_device_retired_pages_pending",
     "1 when retired memory pages wait for a reboot (nvidia-smi retired_pages.pending).",
     lambda d: d.retired_pages_pending),
    ("gauge", "gpu_alloc_device_mig_layout_readable",
     "1 when the MIG layout (GPU instances, placements) could be read; "
     "0 when the driver denied it (needs the mig/monitor capability).",
     lambda d: d.mig_layout_readable),
)

# Device series with one extra label: (type, name, help, label name, ((label value, value), ...)).
_LABELLED_SERIES: tuple[tuple[str, str, str, str, tuple[tuple[str, _Getter], ...]], ...] = (
    ("gauge", "gpu_alloc_device_clock_hertz",
     "Current clock frequency (nvidia-smi clocks.sm, clocks.mem).",
     "clock", (("sm", lambda d: d.sm_clock_hz), ("memory", lambda d: d.memory_clock_hz))),
    ("gauge", "gpu_alloc_device_pcie_throughput_bytes_per_second",
     "PCIe throughput sampled over 20 ms (opt-in: --telemetry.pcie).",
     "direction", (("rx", lambda d: d.pcie_rx_bytes_per_second), ("tx", lambda d: d.pcie_tx_bytes_per_second))),
    ("counter", "gpu_alloc_device_remapped_rows",
     "Memory rows remapped over the GPU's lifetime, by the kind of error that caused it (Ampere and later).",
     "cause", (("correctable", lambda d: d.remapped_rows_correctable), ("uncorrectable", lambda d: d.remapped_rows_uncorrectable))),
    ("counter", "gpu_alloc_device_retired_pages",
     "Memory pages retired over the GPU's lifetime, by cause (before Ampere).",
     "cause", (("single_bit_ecc", lambda d: d.retired_pages_single_bit), ("double_bit_ecc", lambda d: d.retired_pages_double_bit))),
    ("gauge", "gpu_alloc_device_mig_mode",
     "1 when MIG mode is enabled; pending differs from current until the GPU is reset.",
     "state", (("current", lambda d: d.mig_mode_current), ("pending", lambda d: d.mig_mode_pending))),
)

_THROTTLE = (
    "gpu_alloc_device_throttle_active",
    "1 while this clocks-event (throttle) reason holds the clocks down (nvidia-smi clocks_event_reasons.*).",
)

_MIG_SERIES: tuple[tuple[str, str, Callable[[MigDeviceReading], Any]], ...] = (
    ("gpu_alloc_mig_device_memory_total_bytes", "Memory of the MIG device's GPU instance.", lambda m: m.memory_total_bytes),
    ("gpu_alloc_mig_device_memory_used_bytes", "Memory in use in the MIG device's GPU instance.", lambda m: m.memory_used_bytes),
    ("gpu_alloc_mig_device_multiprocessors", "Streaming multiprocessors (SMs) of the MIG device.", lambda m: m.multiprocessor_count),
)


class _Families:
    """Collects samples into one family per name, skipping unknown values."""

    def __init__(self) -> None:
        self._families: dict[str, Metric] = {}

    def add(self, kind: str, name: str, help_text: str, labels: Mapping[str, str], value: Any) -> None:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return
        family = self._families.get(name)
        if family is None:
            build = counter if kind == "counter" else gauge
            family = self._families[name] = build(name, help_text, list(labels))
        family.add_metric(list(labels.values()), float(value))

    def result(self) -> list[Metric]:
        return list(self._families.values())


def _text(value: object) -> str:
    return "" if value is None else str(value)


THROTTLE_SERIES = ("all", "alerting", "active")
# The reasons the shipped rules read (GpuAllocThermalThrottle, GpuAllocHardwareSlowdown and their
# recordings); with ``--telemetry.throttle-reasons alerting`` only these are served.
ALERTING_THROTTLE_REASONS = frozenset({"sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
                                       "hw_power_brake_slowdown"})


def telemetry_families(snapshot: TelemetrySnapshot, resolver: DeviceResolver, throttle_series: str = "all") -> list[Metric]:
    """All telemetry families for ``snapshot``; empty for the ``none`` source.

    Families: ``gpu_alloc_collector_{success,duration_seconds,last_success_timestamp_seconds}``
    ``{collector}``, ``gpu_alloc_driver_info``, ``gpu_alloc_driver_devices``, per GPU
    ``gpu_alloc_device_*{device_id}``, per MIG device ``gpu_alloc_mig_device_*{device_id}``, and
    ``gpu_alloc_xid_errors_total`` / ``gpu_alloc_xid_last_seen_timestamp_seconds{device_id,xid}``.
    """
    if snapshot.source == "none":
        return []
    out = _Families()
    if snapshot.driver_version is not None or snapshot.cuda_version is not None:
        versions = {"driver_version": _text(snapshot.driver_version), "cuda_version": _text(snapshot.cuda_version)}
        out.add("gauge", "gpu_alloc_driver_info", "GPU driver and the CUDA version it supports.", versions, 1)
    out.add("gauge", "gpu_alloc_driver_devices", "GPUs the driver reports (nvidia-smi -L), including ones that cannot be read.",
            {}, snapshot.device_count)

    for device in snapshot.devices:
        device_id = resolver.label(device)
        label = {"device_id": device_id}
        info = {
            "device_id": device_id,
            "uuid": device.uuid,
            "index": _text(device.index),
            "model": _text(device.name),
            "pci_bus_id": _text(device.pci_bus_id),
            "serial": _text(device.serial),
            "numa_node": _text(device.numa_node),
        }
        out.add("gauge", "gpu_alloc_device_info", "Identity of a GPU; value 1.", info, 1)
        out.add("gauge", "gpu_alloc_device_up",
                "1 when the GPU answers; 0 when it is lost (fell off the bus) or its driver calls are stuck.", label, device.up)
        out.add("gauge", "gpu_alloc_device_stale",
                "1 when the GPU's values could not be refreshed and are omitted.", label, device.stale)
        out.add("gauge", "gpu_alloc_device_last_update_timestamp_seconds", "When the GPU was last read.",
                label, device.last_update_timestamp)
        if device.stale:
            out.add(*_ENERGY, label, device.energy_joules)
            continue
        for kind, name, help_text, get in _DEVICE_SERIES:
            out.add(kind, name, help_text, label, get(device))
        for kind, name, help_text, label_name, parts in _LABELLED_SERIES:
            for part, get in parts:
                out.add(kind, name, help_text, {**label, label_name: part}, get(device))
        for reason, active in device.throttle_reasons.items():
            # --telemetry.throttle-reasons: every reason (0 or 1), the ones the rules read, or the active ones.
            if throttle_series == "all" or (throttle_series == "alerting" and reason in ALERTING_THROTTLE_REASONS) or (
                    throttle_series == "active" and active):
                out.add("gauge", *_THROTTLE, {**label, "reason": reason}, active)
        for mig in device.mig_devices:
            mig_id = resolver.label(mig)
            placement = mig.placement
            mig_info = {
                "device_id": mig_id,
                "parent_device_id": device_id,
                "uuid": mig.uuid,
                "profile": _text(mig.profile),
                "gi_id": _text(mig.gpu_instance_id),
                "ci_id": _text(mig.compute_instance_id),
                "placement_start": _text(placement.start if placement else None),
                "placement_size": _text(placement.size if placement else None),
            }
            out.add("gauge", "gpu_alloc_mig_device_info", "Identity and placement of a MIG device; value 1.", mig_info, 1)
            for name, help_text, get_mig in _MIG_SERIES:
                out.add("gauge", name, help_text, {"device_id": mig_id}, get_mig(mig))

    for xid in snapshot.xid_errors:
        labels = {"device_id": resolver.label_for_uuid(xid.device_uuid), "xid": str(xid.xid)}
        out.add("counter", "gpu_alloc_xid_errors",
                "XID errors the driver reported since the exporter started, by XID code.", labels, xid.count)
        out.add("gauge", "gpu_alloc_xid_last_seen_timestamp_seconds",
                "When the driver last reported this XID for the GPU.", labels, xid.last_seen_timestamp)
    return out.result()


def telemetry_health(snapshot: TelemetrySnapshot) -> Health:
    """The sampler's last cycle: success, how long it took, and when a cycle last succeeded."""
    return Health(snapshot.success, snapshot.duration_seconds, snapshot.last_success_timestamp)


@register("telemetry", "device telemetry (NVML or mock GPUs), MIG devices, XIDs, and allocations on unknown devices; "
          "its collector label is the source's name", order=30)
def _telemetry(inputs: Inputs) -> list[Part]:
    def families() -> list[Metric]:
        model = inputs.model()
        return (telemetry_families(model.snapshot, model.resolver, inputs.series.throttle_reasons)
                + unknown_device_families(model.unknown_devices))

    def token() -> tuple[int, int]:
        model = inputs.model()  # device labels follow the allocated ids' spelling: the view too
        return model.sample_version, model.view.version

    return [Part(inputs.telemetry_source, families, token, health=lambda: telemetry_health(inputs.model().snapshot))]
