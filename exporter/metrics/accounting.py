"""Families for GPU accounting (:mod:`exporter.analysis.accounting`): the share of each physical
GPU a kernel holds, each kernel's measured use normalised by what it holds, and the chargeback
counters. Identity is never copied here: join ``gpu_alloc_kernel_identity_info`` on ``kernel_id``.
Sample output::

    gpu_alloc_kernel_gpu_share_ratio{device_id="GPU-5d2c…",kernel_id="0b3f…"} 0.037
    gpu_alloc_kernel_measured_utilization_ratio{kernel_id="0b3f…"} 0.3
    gpu_alloc_kernel_allocated_gpu_seconds_total{device_id="GPU-5d2c…",kernel_id="0b3f…"} 13.3
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from exporter.analysis.model import Accounting
from exporter.metrics.collectors import Inputs, Part, register
from exporter.metrics.families import counter, gauge
from exporter.metrics.status import Health

if TYPE_CHECKING:
    from prometheus_client.core import Metric

__all__ = ["accounting_families", "accounting_health"]

_PAIR = ["device_id", "kernel_id"]


def accounting_families(result: Accounting | None) -> list[Metric]:
    """Families for one pass; None (no pass yet, or the pass failed) has none."""
    if result is None:
        return []
    share = gauge(
        "gpu_alloc_kernel_gpu_share_ratio",
        "Share (0-1) of a physical GPU a kernel holds: 1 for cuda.device, shares over the GPU's fractional capacity, "
        "a MIG slice's SMs over the GPU's (device_id is the GPU, also for MIG slices)",
        _PAIR,
    )
    for (kernel_id, gpu), value in sorted(result.shares.items()):
        share.add_metric([gpu, kernel_id], value)
    util = gauge(
        "gpu_alloc_kernel_measured_utilization_ratio",
        "SM utilisation of the kernel's processes on its allocated GPUs, averaged per allocated device (0-1); "
        "absent where any allocated device is not measured (MIG, a failed read)",
        ["kernel_id"],
    )
    memory = gauge(
        "gpu_alloc_kernel_measured_memory_ratio",
        "GPU memory the kernel's processes use over the memory it holds, averaged per allocated device "
        "(0-1: use beyond the share, where the plugin does not cap memory, counts as 1); absent where any allocated device is not measured",
        ["kernel_id"],
    )
    # Only measured kernels have a sample: sort those, not every kernel (this part renders at
    # every scrape, since its counters move, and would pay for sorting the unmeasured ones each time).
    measured = [(k, use) for k, use in result.kernels.items() if use.utilization_ratio is not None or use.memory_ratio is not None]
    for kernel_id, use in sorted(measured):
        if use.utilization_ratio is not None:
            util.add_metric([kernel_id], use.utilization_ratio)
        if use.memory_ratio is not None:
            memory.add_metric([kernel_id], use.memory_ratio)
    allocated = counter(
        "gpu_alloc_kernel_allocated_gpu_seconds",
        "GPU share held by a kernel, integrated over time (share-seconds; /3600 for GPU-hours); "
        "integrated in the background at every telemetry sample, reset only when the exporter restarts",
        _PAIR,
    )
    for (kernel_id, gpu), value in sorted(result.allocated_seconds.items()):
        allocated.add_metric([gpu, kernel_id], value)
    used = counter(
        "gpu_alloc_kernel_used_gpu_seconds",
        "GPU share held times measured utilisation, integrated over time (share-seconds) while the kernel's use is measured",
        _PAIR,
    )
    for (kernel_id, gpu), value in sorted(result.used_seconds.items()):
        used.add_metric([gpu, kernel_id], value)
    return [share, util, memory, allocated, used]


def accounting_health(result: Accounting | None) -> Health:
    """Failed until a pass has run, or when the last pass failed."""
    return Health(result is not None)


@register("accounting", "GPU share per kernel, measured use over what it holds, chargeback counters", order=60)
def _accounting(inputs: Inputs) -> list[Part]:
    return [Part("accounting", lambda: accounting_families(inputs.model().accounting), lambda: inputs.model().usage_version,
                 health=lambda: accounting_health(inputs.model().accounting))]
