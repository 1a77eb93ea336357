"""Headroom metrics: capacity, free space, fragmentation, MIG headroom and stale allocations.

Families are built fresh on every call from an :class:`~exporter.scratch.allocation.AllocationView`, the
last telemetry snapshot and the kernels' liveness; nothing is kept between scrapes. Sample::

    gpu_alloc_node_headroom{fragmentation="allowed",slot="cuda.shares"} 12.3
    gpu_alloc_mig_creatable_instances{device_id="GPU-5d2c…",profile="3g.40gb"} 0

Device ids are the agent's (as in ``resource.txt``), spelled by :class:`~exporter.telemetry.devices.DeviceResolver`.
Every figure is explained, with PromQL, in ``docs/headroom.md``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from decimal import Decimal

from prometheus_client.core import GaugeMetricFamily, Metric

from exporter.analysis.capacity import is_fractional_slot
from exporter.analysis.headroom import count_fits
from exporter.analysis.liveness import KernelLiveness, Liveness
from exporter.analysis.node import HeadroomParams, Inventory, NodeState, inventory_of, node_state
from exporter.analysis.placement import Policy, Request
from exporter.scratch.allocation import AllocationView
from exporter.telemetry.devices import DeviceResolver
from exporter.telemetry.mig import HamiModel, MigLayoutError, creatable_instances, hami_geometries_for, reachable_geometries
from exporter.telemetry.model import TelemetrySnapshot

__all__ = ["headroom_families"]


# --- metric families ---------------------------------------------------------------------------


def _g(name: str, doc: str, *labels: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def headroom_families(
    view: AllocationView,
    snapshot: TelemetrySnapshot | None,
    devices: DeviceResolver | Inventory,
    params: HeadroomParams,
    liveness: Mapping[str, KernelLiveness] | None = None,
    cgroup_visible: bool | None = None,
) -> list[Metric]:
    """Every headroom family, built fresh.

    :param devices: the scrape's :class:`~exporter.telemetry.devices.DeviceResolver` (device ids as the
        agent spells them), or a ready :class:`Inventory` (``snapshot`` is then ignored).
    :param liveness: per kernel id, from :func:`exporter.analysis.liveness.classify_kernels`; None when
        staleness is not checked.
    :param cgroup_visible: whether the cgroup tree showed the host's containers (None: not checked).
    """
    inventory = inventory_of(snapshot, devices)
    state = node_state(view, inventory, params, liveness)
    return [
        *_device_families(state),
        *_node_families(state, params.requests),
        *_mig_families(inventory, params.hami),
        *_stale_families(state, liveness, cgroup_visible),
    ]


def _device_families(state: NodeState) -> list[Metric]:
    capacity = _g(
        "gpu_alloc_device_capacity",
        "What a device holds of a slot, in the slot's unit (fGPU shares, devices, MIG instances)",
        "device_id",
        "slot",
    )
    free = _g(
        "gpu_alloc_device_free",
        "Capacity minus allocated on a device, in the slot's unit; 0 when overcommitted",
        "device_id",
        "slot",
    )
    over = _g(
        "gpu_alloc_device_overcommitted",
        "1 if more of a slot is allocated on a device than it holds (multi-agent shared mode, wrong capacity)",
        "device_id",
        "slot",
    )
    for slot, devices in state.slots.items():
        for d in devices:
            capacity.add_metric([d.device_id, slot], float(d.capacity))
            free.add_metric([d.device_id, slot], float(max(d.free, Decimal(0))))
            over.add_metric([d.device_id, slot], int(d.overcommitted))
    return [capacity, free, over]


def _node_families(state: NodeState, requests: Sequence[Request]) -> list[Metric]:
    headroom = _g(
        "gpu_alloc_node_headroom",
        "Largest request of a slot one kernel would receive in full now; fragmentation=disallowed applies the agent's "
        "ensure_slot_not_fragmented",
        "slot",
        "fragmentation",
    )
    contiguous = _g(
        "gpu_alloc_node_headroom_contiguous",
        "Every request of a slot up to this size would be received in full now; above it, up to gpu_alloc_node_headroom, "
        "some sizes may be refused (fragmentation=disallowed: a request up to one device's capacity must fit on one device)",
        "slot",
        "fragmentation",
    )
    single = _g(
        "gpu_alloc_node_max_single_device_free",
        "Largest free amount of a slot on one device (a request up to this size stays on one device)",
        "slot",
    )
    whole = _g(
        "gpu_alloc_node_whole_free_devices",
        "Devices of a slot with nothing allocated on them (whole GPUs, free MIG instances)",
        "slot",
    )
    ratio = _g(
        "gpu_alloc_node_fragmentation_ratio",
        "Share (0-1) of a fractional slot's free capacity that sits on partly allocated devices",
        "slot",
    )
    fits = _g(
        "gpu_alloc_request_fits",
        "How many more requests of this size the agent would place one after another (EVENLY allocator)",
        "slot",
        "request",
        "fragmentation",
    )
    for slot in state.slots:
        s = state.summary(slot)
        headroom.add_metric([slot, "allowed"], float(s.headroom))
        headroom.add_metric([slot, "disallowed"], float(s.headroom_nofrag))
        contiguous.add_metric([slot, "allowed"], float(s.contiguous))
        contiguous.add_metric([slot, "disallowed"], float(s.contiguous_nofrag))
        single.add_metric([slot], float(s.max_single_device_free))
        whole.add_metric([slot], s.whole_free_devices)
        if is_fractional_slot(slot):
            ratio.add_metric([slot], float(s.fragmentation_ratio))
    for request in requests:
        devices = state.slots.get(request.slot)
        if devices is None:
            continue
        for label, policy in (("allowed", Policy.EVENLY), ("disallowed", Policy.EVENLY_NOFRAG)):
            n = count_fits(devices, request, policy, quantum=state.slot_quantum(request.slot), rule=state.rule)
            fits.add_metric([request.slot, str(request.amount), label], n)
    return [headroom, contiguous, single, whole, ratio, fits]


def _mig_families(inventory: Inventory, hami: Sequence[HamiModel]) -> list[Metric]:
    creatable = _g(
        "gpu_alloc_mig_creatable_instances",
        "GPU instances of a MIG profile that could still be created on a GPU, each profile on its own (not jointly)",
        "device_id",
        "profile",
    )
    reachable = _g(
        "gpu_alloc_mig_geometry_reachable",
        "1 if an allowed MIG geometry (HAMi knownMigGeometries) can still be reached by creating instances only",
        "device_id",
        "geometry",
    )
    for layout in inventory.mig_layouts:
        try:
            counts = creatable_instances(layout.table, layout.instances, remaining=layout.remaining)
            verdicts = reachable_geometries(
                layout.table, layout.instances, hami_geometries_for(hami, layout.product_name)
            )
        except MigLayoutError:
            continue  # the reported instances cannot coexist: no figure beats a wrong one
        for profile, n in counts.items():
            creatable.add_metric([layout.device_id, profile], n)
        for label, ok in verdicts.items():
            if ok is not None:
                reachable.add_metric([layout.device_id, label], int(ok))
    return [creatable, reachable]


def _stale_families(
    state: NodeState, liveness: Mapping[str, KernelLiveness] | None, cgroup_visible: bool | None
) -> list[Metric]:
    if liveness is None:
        return []
    held = _g(
        "gpu_alloc_device_stale_allocated",
        "Amount of a slot held on a device by stale kernels (scratch directory without a running container)",
        "device_id",
        "slot",
    )
    for (device_id, slot), amount in sorted(state.stale.items()):
        held.add_metric([device_id, slot], float(amount))
    stale = _g("gpu_alloc_kernel_stale", "1 for each stale kernel, with why it is judged stale", "kernel_id", "reason")
    counts = _g("gpu_alloc_kernels_liveness", "Kernel scratch directories by liveness (live, stale, unknown)", "status")
    by_status = Counter(verdict.status for verdict in liveness.values())
    # Sort only the stale ones: at 10,000 kernels sorting every verdict would dominate a render.
    for kernel_id, verdict in sorted((k, v) for k, v in liveness.items() if v.status is Liveness.STALE):
        stale.add_metric([kernel_id, verdict.reason], 1)
    for status in Liveness:
        counts.add_metric([status.value], by_status[status])
    out: list[Metric] = [held, stale, counts]
    if cgroup_visible is not None:
        visible = "1 if the cgroup tree shows the host's containers (else liveness is unknown)"
        out.append(GaugeMetricFamily("gpu_alloc_cgroup_visible", visible, value=int(cgroup_visible)))
    return out
