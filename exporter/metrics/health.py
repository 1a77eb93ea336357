"""Families for ghost memory and device health (:mod:`exporter.analysis.ghost`,
:mod:`exporter.analysis.health`). Sample output::

    gpu_alloc_device_ghost_memory_bytes{cause="dead_process",device_id="GPU-5d2c…"} 2.147483648e+09
    gpu_alloc_ghost_memory_holder_info{cause="dead_process",device_id="GPU-5d2c…",kernel_id="0b3f…",pid="4242",session_id="s-1",user_id="u-1"} 1
    gpu_alloc_device_health{device_id="GPU-5d2c…",state="needs_reset"} 1
    gpu_alloc_device_health_fault_info{action="…",catalogue_version="2026.11",device_id="GPU-5d2c…",meaning="…",reason="XID 48",state="needs_reset",xid="48"} 1

Driver-reserved memory is ``gpu_alloc_device_memory_reserved_bytes`` (the telemetry collector).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from exporter.analysis.model import GhostCause, GhostMemory, HealthReport, HealthState, xid_info
from exporter.metrics.collectors import Inputs, Part, register
from exporter.metrics.families import gauge

if TYPE_CHECKING:
    from prometheus_client.core import Metric

__all__ = ["ghost_families", "health_families"]


def ghost_families(ghost: GhostMemory | None, short_shares: tuple[tuple[str, str], ...] = ()) -> list[Metric]:
    """Ghost memory per device and cause (every cause of every device whose process list was
    read, 0 where none), its largest holders, and fGPU shares that cannot get their memory."""
    memory = gauge(
        "gpu_alloc_device_ghost_memory_bytes",
        "GPU memory NVML lists for holders that should hold none: processes that no longer exist (dead_process), "
        "processes of no kernel that are not known host services (unattributed_process), processes of a kernel whose "
        "scratch directory or container is gone (ended_kernel); left out of fGPU headroom",
        ["device_id", "cause"],
    )
    holders = gauge(
        "gpu_alloc_ghost_memory_holder_info",
        "The processes holding the most ghost memory per device (at most 5), with the kernel, session and user "
        "they last belonged to (empty when none is known)",
        ["device_id", "pid", "cause", "kernel_id", "session_id", "user_id"],
    )
    short = gauge(
        "gpu_alloc_kernel_share_memory_unavailable",
        "1 for a kernel's fGPU share on a device whose usable memory (total less reserved and ghost memory) no "
        "longer covers what is allocated there: the share may not get its memory",
        ["kernel_id", "device_id"],
    )
    if ghost is not None:
        for device_id in sorted(ghost.devices):
            for cause in GhostCause:
                memory.add_metric([device_id, cause.value], ghost.bytes.get((device_id, cause), 0))
        for h in ghost.holders:
            k = h.kernel
            holders.add_metric([h.device_id, str(h.pid), h.cause.value, k.kernel_id if k else "",
                                k.session_id if k else "", k.user_id if k else ""], 1)
    for kernel_id, device_id in short_shares:
        short.add_metric([kernel_id, device_id], 1)
    return [memory, holders, short]


def health_families(report: HealthReport | None) -> list[Metric]:
    """One state series per device, when it entered it, what latched it and whom it reaches."""
    state = gauge(
        "gpu_alloc_device_health",
        "GPU health, one series at 1: ok, degraded, needs_reset or lost (latched until a GPU reset, a driver reload "
        "or a reboot is seen), unknown (telemetry calls missed their deadline or cannot be made)",
        ["device_id", "state"],
    )
    since = gauge(
        "gpu_alloc_device_health_since_timestamp_seconds",
        "Unix time the GPU entered its current health state",
        ["device_id"],
    )
    fault = gauge(
        "gpu_alloc_device_health_fault_info",
        "What made a GPU's health other than ok: the reason, the XID when one did, its meaning and the recommended "
        "action (from the exporter's XID catalogue, whose version is catalogue_version)",
        ["device_id", "state", "reason", "xid", "meaning", "action", "catalogue_version"],
    )
    kernels = gauge(
        "gpu_alloc_device_health_kernel_info",
        "Kernels (with session and user) a GPU's fault reaches: all of the GPU's, or for an XID of one GPU instance "
        "only that instance's",
        ["device_id", "kernel_id", "session_id", "user_id"],
    )
    if report is not None:
        for d in report.devices:
            state.add_metric([d.device_id, d.state.value], 1)
            since.add_metric([d.device_id], d.since)
            if d.state is HealthState.OK:
                continue
            info = xid_info(d.xid) if d.xid is not None else None
            fault.add_metric([d.device_id, d.state.value, d.reason, "" if d.xid is None else str(d.xid),
                              info.meaning if info else "", info.action if info else _ACTIONS[d.state],
                              report.catalogue_version], 1)
            for k in d.kernels:
                kernels.add_metric([d.device_id, k.kernel_id, k.session_id, k.user_id], 1)
    return [state, since, fault, kernels]


_ACTIONS = {
    HealthState.DEGRADED: "watch the GPU's error counters; plan a GPU reset",
    HealthState.NEEDS_RESET: "drain the node, let the sessions end, then reset the GPU",
    HealthState.LOST: "drain the node and reset the GPU or reboot; check power and seating",
    HealthState.UNKNOWN: "check the driver: its calls do not return (see gpu_alloc_device_stale)",
}


@register("health", "ghost GPU memory and its holders, and each GPU's health, latched until a reset, "
          "driver reload or reboot", order=55)
def _health(inputs: Inputs) -> list[Part]:
    return [
        Part("ghost", lambda: ghost_families(inputs.model().ghost, inputs.model().short_shares),
             lambda: (inputs.model().usage_version, inputs.model().headroom_version)),
        Part("health", lambda: health_families(inputs.model().health), lambda: inputs.model().usage_version),
    ]
