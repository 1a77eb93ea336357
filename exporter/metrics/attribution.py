"""Metric families for GPU process attribution, built fresh from one :class:`AttributionResult`.

Measured use is its own family set, separate from allocation (``gpu_alloc_kernel_allocated``):
device series are never copied per kernel, so summing a device's kernel and unattributed series
gives what NVML listed on it. Values NVML cannot give are absent, never 0. Sample output::

    gpu_alloc_kernel_memory_used_bytes{device_id="GPU-5d2c…",kernel_id="0b3f…"} 8.589934592e+09
    gpu_alloc_device_unattributed_processes{device_id="GPU-5d2c…",reason="unknown_container"} 1

PIDs are labels only in the opt-in per-process families (``attribution_process_detail``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from exporter.analysis.model import AttributionResult
from exporter.metrics.collectors import Inputs, Part, register
from exporter.metrics.families import gauge
from exporter.metrics.status import Health

if TYPE_CHECKING:
    from prometheus_client.core import Metric

__all__ = ["BREACH_SERIES", "KERNEL_SERIES", "attribution_families", "attribution_health"]

_KERNEL = ["kernel_id", "device_id"]
_UNATTRIBUTED = ["device_id", "reason"]
_PROCESS = ["device_id", "pid", "kernel_id"]

# Per kernel and device: (name, help, KernelDeviceUsage field); a None field leaves the series out.
_KERNEL_FAMILIES = (
    ("gpu_alloc_kernel_processes", "Compute processes of a kernel on a device (NVML process lists, attributed through /proc)", "processes"),
    ("gpu_alloc_kernel_memory_used_bytes", "GPU memory used by a kernel's processes on a device, summed from NVML's per-process figures", "memory_used_bytes"),
    (
        "gpu_alloc_kernel_utilization_ratio",
        "SM utilisation by a kernel's processes on a device (0-1), summed from NVML per-process samples and capped at 1; "
        "absent where NVML cannot sample per process (MIG)",
        "utilization_ratio",
    ),
    (
        "gpu_alloc_kernel_idle_seconds",
        "How long the kernel's utilisation of an allocated device has stayed below the idle threshold (0 while busy); "
        "absent without per-process utilisation",
        "idle_seconds",
    ),
    (
        "gpu_alloc_kernel_no_process_seconds",
        "How long the kernel has had no process on an allocated device (0 while it has one), at most since the exporter started",
        "no_process_seconds",
    ),
)


KERNEL_SERIES = ("per-device", "per-kernel", "off")
BREACH_SERIES = ("all", "active")


def attribution_families(
    result: AttributionResult | None,
    *,
    process_detail: bool = False,
    kernel_series: str = "per-device",
    breach_series: str = "all",
) -> list[Metric]:
    """Families for one result; None (no telemetry sample attributed yet) has none.

    :param process_detail: add per-process families labelled with ``pid`` (one series per GPU
        process and device: for debugging, off by default).
    :param kernel_series: the per-kernel families (``--attribution.kernel-series``): one series per
        kernel and device, collapsed to one per kernel (no ``device_id``: processes and memory
        summed, utilisation the busiest device, idle and no-process time the shortest), or none.
    :param breach_series: ``all`` (0 or 1 for every kernel and device) or ``active`` (only the 1s:
        the rules count breaches from those alone).
    """
    if result is None:
        return []

    labels_of = _KERNEL if kernel_series == "per-device" else ["kernel_id"]
    kernel = [(gauge(name, doc, labels_of), field) for name, doc, field in _KERNEL_FAMILIES]
    breach = gauge("gpu_alloc_kernel_isolation_breach", "1 if the kernel runs processes on a device it was not allocated, else 0", labels_of)
    rows = _collapsed(result.kernels) if kernel_series == "per-kernel" else [
        ([u.kernel_id, u.device_id], 0 if u.allocated else 1, {f: getattr(u, f) for _, _, f in _KERNEL_FAMILIES}) for u in result.kernels]
    for labels, breached, values in ([] if kernel_series == "off" else rows):
        if breached or breach_series == "all":
            breach.add_metric(labels, breached)
        for family, field in kernel:
            if (value := values[field]) is not None:
                family.add_metric(labels, value)

    processes = gauge(
        "gpu_alloc_device_unattributed_processes",
        "Compute processes on a device that belong to no kernel, by reason "
        "(host, unknown_container, vanished, permission_denied, unreadable)",
        _UNATTRIBUTED,
    )
    memory = gauge("gpu_alloc_device_unattributed_memory_bytes", "GPU memory used by processes on a device that belong to no kernel, by reason", _UNATTRIBUTED)
    for u in result.unattributed:
        processes.add_metric([u.device_id, u.reason.value], u.processes)
        if u.memory_used_bytes is not None:
            memory.add_metric([u.device_id, u.reason.value], u.memory_used_bytes)

    attributable = gauge(
        "gpu_alloc_device_utilization_attributable",
        "1 if NVML samples utilisation per process on the device, so kernel utilisation is measured; 0 where it cannot be isolated (MIG)",
        ["device_id"],
    )
    for device_id, ok in sorted(result.devices.items()):
        attributable.add_metric([device_id], int(ok))

    families = [*(f for f, _ in kernel), breach, processes, memory, attributable] if kernel_series != "off" else [
        processes, memory, attributable]
    if process_detail:
        p_memory = gauge("gpu_alloc_process_memory_used_bytes", "GPU memory used by one process (kernel_id empty when unattributed)", _PROCESS)
        p_util = gauge("gpu_alloc_process_utilization_ratio", "SM utilisation of one process (0-1) from NVML per-process samples", _PROCESS)
        for p in result.processes:
            labels = [p.device_id, str(p.pid), p.kernel_id or ""]
            if p.memory_used_bytes is not None:
                p_memory.add_metric(labels, p.memory_used_bytes)
            if p.utilization_ratio is not None:
                p_util.add_metric(labels, p.utilization_ratio)
        families += [p_memory, p_util]
    return families


def attribution_health(result: AttributionResult | None) -> Health:
    """Failed until a telemetry sample has been attributed; then the last pass's duration."""
    return Health(False) if result is None else Health(True, result.duration_seconds)


# How the per-device figures of one kernel combine when collapsed to one series per kernel.
_COMBINE = {"processes": sum, "memory_used_bytes": sum, "utilization_ratio": max, "idle_seconds": min, "no_process_seconds": min}


def _collapsed(usages) -> list[tuple[list[str], int, dict]]:
    """One row per kernel: a figure is absent if any device lacks it (never a partial sum)."""
    by_kernel: dict[str, list] = {}
    for u in usages:
        by_kernel.setdefault(u.kernel_id, []).append(u)
    rows = []
    for kernel_id, us in sorted(by_kernel.items()):
        values = {}
        for field, combine in _COMBINE.items():
            figures = [getattr(u, field) for u in us]
            values[field] = None if any(f is None for f in figures) else combine(figures)
        rows.append(([kernel_id], int(any(not u.allocated for u in us)), values))
    return rows


@register("attribution", "GPU processes attributed to kernels: use, idle time, isolation breaches, unattributed processes",
          order=50)
def _attribution(inputs: Inputs) -> list[Part]:
    series = inputs.series

    def families() -> list[Metric]:
        return attribution_families(inputs.model().attribution, process_detail=series.process_detail,
                                    kernel_series=series.kernel_series, breach_series=series.breach_series)

    return [Part("attribution", families, lambda: inputs.model().usage_version,
                 health=lambda: attribution_health(inputs.model().attribution))]
