"""Headroom metrics: capacity, free space, fragmentation, MIG headroom and stale allocations.

Every figure is computed by the analysis pipeline (:class:`~exporter.analysis.model.Analysis`:
its node state and :class:`~exporter.analysis.node.HeadroomFigures`); this module only writes
them as families. Sample::

    gpu_alloc_node_headroom{fragmentation="allowed",slot="cuda.shares"} 12.3
    gpu_alloc_mig_creatable_instances{device_id="GPU-5d2c…",profile="3g.40gb"} 0

Device ids are the agent's (as in ``resource.txt``). Every figure is explained, with PromQL, in
``docs/headroom.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from typing import TYPE_CHECKING

from exporter.analysis.model import Analysis, HeadroomFigures, KernelLiveness, Liveness, NodeState, is_fractional_slot
from exporter.metrics.collectors import Inputs, Part, register
from exporter.metrics.families import gauge

if TYPE_CHECKING:
    from prometheus_client.core import Metric

__all__ = ["headroom_families"]


def headroom_families(model: Analysis, liveness_rows: LivenessRows | None = None) -> list[Metric]:
    """Every headroom family of one read model (``liveness_rows``: kept across renders, so that
    a render after a kernel change does not walk every kernel's liveness verdict again)."""
    return [
        *_device_families(model.state),
        *_node_families(model.state, model.headroom),
        *_mig_families(model.headroom),
        *_stale_families(model, liveness_rows or LivenessRows()),
    ]


@register("headroom", "capacity, free space, headroom, request fits, fragmentation, MIG and stale allocations", order=40)
def _headroom(inputs: Inputs) -> list[Part]:
    rows = LivenessRows()
    return [Part("headroom", lambda: headroom_families(inputs.model(), rows), lambda: inputs.model().headroom_version)]


class LivenessRows:
    """The stale kernels of one liveness result, sorted, kept until the next one: the headroom
    families are rendered again on every kernel change, the stale kernels move far less often."""

    def __init__(self) -> None:
        self._of: Mapping[str, KernelLiveness] | None = None
        self._rows: list[tuple[str, str]] = []

    def __call__(self, stale: Mapping[str, KernelLiveness]) -> list[tuple[str, str]]:
        """(kernel id, reason) of each stale kernel, in kernel id order."""
        if stale is not self._of:
            self._rows, self._of = sorted((k, v.reason) for k, v in stale.items()), stale
        return self._rows


def _device_families(state: NodeState) -> list[Metric]:
    capacity = gauge(
        "gpu_alloc_device_capacity",
        "What a device holds of a slot, in the slot's unit (fGPU shares, devices, MIG instances)",
        ["device_id",
        "slot"],
    )
    free = gauge(
        "gpu_alloc_device_free",
        "Capacity minus allocated on a device, in the slot's unit; 0 when overcommitted",
        ["device_id",
        "slot"],
    )
    over = gauge(
        "gpu_alloc_device_overcommitted",
        "1 if more of a slot is allocated on a device than it holds (multi-agent shared mode, wrong capacity)",
        ["device_id",
        "slot"],
    )
    for slot, devices in state.slots.items():
        for d in devices:
            capacity.add_metric([d.device_id, slot], float(d.capacity))
            free.add_metric([d.device_id, slot], float(max(d.free, Decimal(0))))
            over.add_metric([d.device_id, slot], int(d.overcommitted))
    return [capacity, free, over]


def _node_families(state: NodeState, figures: HeadroomFigures) -> list[Metric]:
    headroom = gauge(
        "gpu_alloc_node_headroom",
        "Largest request of a slot one kernel would receive in full now; fragmentation=disallowed applies the agent's "
        "ensure_slot_not_fragmented",
        ["slot",
        "fragmentation"],
    )
    contiguous = gauge(
        "gpu_alloc_node_headroom_contiguous",
        "Every request of a slot up to this size would be received in full now; above it, up to gpu_alloc_node_headroom, "
        "some sizes may be refused (fragmentation=disallowed: a request up to one device's capacity must fit on one device)",
        ["slot",
        "fragmentation"],
    )
    single = gauge(
        "gpu_alloc_node_max_single_device_free",
        "Largest free amount of a slot on one device (a request up to this size stays on one device)",
        ["slot"],
    )
    whole = gauge(
        "gpu_alloc_node_whole_free_devices",
        "Devices of a slot with nothing allocated on them (whole GPUs, free MIG instances)",
        ["slot"],
    )
    ratio = gauge(
        "gpu_alloc_node_fragmentation_ratio",
        "Share (0-1) of a fractional slot's free capacity that sits on partly allocated devices",
        ["slot"],
    )
    fits = gauge(
        "gpu_alloc_request_fits",
        "How many more requests of this size the agent would place one after another (EVENLY allocator)",
        ["slot",
        "request",
        "fragmentation"],
    )
    for slot, s in figures.summaries.items():
        headroom.add_metric([slot, "allowed"], float(s.headroom))
        headroom.add_metric([slot, "disallowed"], float(s.headroom_nofrag))
        contiguous.add_metric([slot, "allowed"], float(s.contiguous))
        contiguous.add_metric([slot, "disallowed"], float(s.contiguous_nofrag))
        single.add_metric([slot], float(s.max_single_device_free))
        whole.add_metric([slot], s.whole_free_devices)
        if is_fractional_slot(slot):
            ratio.add_metric([slot], float(s.fragmentation_ratio))
    for slot, amount, fragmentation, n in figures.fits:
        fits.add_metric([slot, amount, fragmentation], n)
    return [headroom, contiguous, single, whole, ratio, fits]


def _mig_families(figures: HeadroomFigures) -> list[Metric]:
    creatable = gauge(
        "gpu_alloc_mig_creatable_instances",
        "GPU instances of a MIG profile that could still be created on a GPU, each profile on its own (not jointly)",
        ["device_id",
        "profile"],
    )
    reachable = gauge(
        "gpu_alloc_mig_geometry_reachable",
        "1 if an allowed MIG geometry (HAMi knownMigGeometries) can still be reached by creating instances only",
        ["device_id",
        "geometry"],
    )
    for device_id, profile, n in figures.mig_creatable:
        creatable.add_metric([device_id, profile], n)
    for device_id, geometry, ok in figures.mig_reachable:
        reachable.add_metric([device_id, geometry], ok)
    return [creatable, reachable]


def _stale_families(model: Analysis, liveness_rows: LivenessRows) -> list[Metric]:
    state = model.state
    cgroup_visible = model.cgroups.visible if model.cgroups else None
    held = gauge(
        "gpu_alloc_device_stale_allocated",
        "Amount of a slot held on a device by stale kernels (scratch directory without a running container)",
        ["device_id",
        "slot"],
    )
    for (device_id, slot), amount in sorted(state.stale.items()):
        held.add_metric([device_id, slot], float(amount))
    stale = gauge("gpu_alloc_kernel_stale", "1 for each stale kernel, with why it is judged stale", ["kernel_id", "reason"])
    counts = gauge("gpu_alloc_kernels_liveness", "Kernel scratch directories by liveness (live, stale, unknown)", ["status"])
    for kernel_id, reason in liveness_rows(model.stale_kernels):
        stale.add_metric([kernel_id, reason], 1)
    for status in Liveness:
        counts.add_metric([status.value], model.liveness_counts.get(status, 0))
    out: list[Metric] = [held, stale, counts]
    if cgroup_visible is not None:
        visible = "1 if the cgroup tree shows the host's containers (else liveness is unknown)"
        out.append(gauge("gpu_alloc_cgroup_visible", visible, value=int(cgroup_visible)))
    return out
