"""Headroom metrics: capacity, free space, fragmentation, MIG headroom and stale allocations.

Families are built fresh on every call from an :class:`~exporter.allocation.AllocationView`, the
last telemetry snapshot and the kernels' liveness; nothing is kept between scrapes. Sample::

    gpu_alloc_node_headroom{fragmentation="allowed",slot="cuda.shares"} 12.3
    gpu_alloc_mig_creatable_instances{device_id="GPU-5d2c…",profile="3g.40gb"} 0

Device ids are the agent's (as in ``resource.txt``), spelled by :class:`~exporter.devices.DeviceResolver`.
Every figure is explained, with PromQL, in ``docs/headroom.md``.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from exporter.allocation import AllocationView
from exporter.capacity import CapacityConfig, GpuInventory, device_capacity, is_fractional_slot, is_mig_slot
from exporter.devices import DeviceResolver
from exporter.headroom import SlotHeadroom, count_fits, summarize
from exporter.mig_geometry import (
    GpuInstance,
    HamiModel,
    MigLayoutError,
    MigProfile,
    MigTable,
    creatable_instances,
    hami_geometries_for,
    reachable_geometries,
    table_for_product,
)
from exporter.placement import DeviceFree, Links, NoFragRule, Policy, Request
from exporter.staleness import KernelLiveness, Liveness
from exporter.telemetry import DeviceReading, TelemetrySnapshot

__all__ = [
    "DEFAULT_REQUESTS",
    "HeadroomParams",
    "Inventory",
    "MigInstanceDevice",
    "MigLayout",
    "NodeState",
    "headroom_families",
    "inventory_from_snapshot",
    "live_state",
    "node_state",
]

DEFAULT_REQUESTS = tuple(
    Request.parse(r)
    for r in (
        "cuda.shares=0.5",
        "cuda.shares=1",
        "cuda.shares=2",
        "cuda.shares=4",
        "cuda.device=1",
        "cuda.device=2",
        "cuda.device=4",
    )
)
_ONE = Decimal(1)


@dataclass(frozen=True)
class HeadroomParams:
    """Settings the headroom figures depend on (see ``docs/headroom.md``).

    :param capacity: the fractional plugin's ``unit_mem``/``unit_proc``/``quantum_size``.
    :param mode: which slot whole GPUs are allocated as: ``fractional`` (``cuda.shares``),
        ``discrete`` (``cuda.device``) or ``auto`` (``cuda.shares`` once any kernel holds shares,
        else ``cuda.device``).
    :param rule: the agent's fragmentation guard, for the ``disallowed`` figures.
    :param requests: reference requests for ``gpu_alloc_request_fits``.
    :param exclude_stale: leave stale kernels' allocations out of "allocated" (the agent rebuilds
        its map from live containers only); they are always exported on their own.
    :param hami: HAMi ``knownMigGeometries`` entries for ``gpu_alloc_mig_geometry_reachable``.
    :param links: GPU pair scores for the ``besteffort`` what-if policy.
    """

    capacity: CapacityConfig = field(default_factory=CapacityConfig)
    mode: str = "auto"
    rule: NoFragRule = NoFragRule.MULTI_DEVICE
    requests: tuple[Request, ...] = DEFAULT_REQUESTS
    exclude_stale: bool = True
    hami: tuple[HamiModel, ...] = ()
    links: Links = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "fractional", "discrete"):
            raise ValueError(f"mode must be auto, fractional or discrete, not {self.mode!r}")


# --- inventory: what telemetry says is there ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class MigInstanceDevice:
    """A MIG device the agent can hand out: its device id and MIG slot."""

    device_id: str
    slot: str


@dataclass(frozen=True)
class MigLayout:
    """A MIG-enabled GPU's geometry: the table (NVML's profiles and possible placements, else the
    built-in one), its GPU instances, and NVML's remaining capacity per profile when readable."""

    device_id: str
    product_name: str
    table: MigTable
    instances: tuple[GpuInstance, ...]
    remaining: Mapping[str, int] | None = None


@dataclass(frozen=True)
class Inventory:
    """Allocatable devices: whole GPUs (MIG off), MIG devices, and MIG layouts of MIG GPUs."""

    gpus: tuple[GpuInventory, ...] = ()
    mig_devices: tuple[MigInstanceDevice, ...] = ()
    mig_layouts: tuple[MigLayout, ...] = ()


def inventory_from_snapshot(snapshot: TelemetrySnapshot | None, resolver: DeviceResolver) -> Inventory:
    """The :class:`Inventory` a telemetry snapshot shows, ids spelled by ``resolver`` (as the
    agent writes them: ``resolver.label``)."""
    if snapshot is None:
        return Inventory()
    gpus, migs, layouts = [], [], []
    for reading in snapshot.devices:
        device_id = resolver.label(reading)
        if not reading.mig_mode_current:
            gpus.append(GpuInventory(device_id, reading.memory_total_bytes, reading.multiprocessor_count))
            continue
        migs += [
            MigInstanceDevice(resolver.label(m), f"cuda.device:{m.profile}-mig")
            for m in reading.mig_devices
            if m.profile
        ]
        layout = _mig_layout(reading, device_id)
        if layout is not None:
            layouts.append(layout)
    return Inventory(tuple(gpus), tuple(migs), tuple(layouts))


def _mig_layout(reading: DeviceReading, device_id: str) -> MigLayout | None:
    # Never guess a geometry from MIG devices' memory sizes: no readable layout, no figure.
    if reading.mig_layout_readable is False:
        return None
    product = reading.name or ""
    capacity = reading.mig_profile_capacity
    if capacity:
        profiles = tuple(
            MigProfile(
                p.name,
                p.profile_id,
                p.placements[0].size,
                p.slice_count,
                p.instance_count,
                tuple(pl.start for pl in p.placements),
            )
            for p in capacity
            if p.placements
        )
        slices = max((pl.start + pl.size for p in capacity for pl in p.placements), default=0)
        table = MigTable(product or "nvml", slices, profiles)
        remaining = {p.name: p.remaining for p in capacity if p.remaining is not None}
    else:
        table, remaining = table_for_product(product), None
        if table is None:
            return None
    instances = tuple(GpuInstance(gi.profile_id, gi.placement.start, gi.placement.size) for gi in reading.gpu_instances)
    return MigLayout(device_id, product, table, instances, remaining or None)


# --- node state: devices per slot with capacity and allocation ---------------------------------


@dataclass(frozen=True)
class NodeState:
    """Each accelerator slot's devices (inventory order) with capacity and allocation, plus what
    stale kernels hold. The input of headroom figures and of ``simulate``; JSON round-trips.

    :param stale: (device id, slot) → amount held by stale kernels (already left out of
        ``allocated`` when ``exclude_stale``).
    """

    slots: Mapping[str, tuple[DeviceFree, ...]]
    quantum: Decimal = Decimal("0.01")
    rule: NoFragRule = NoFragRule.MULTI_DEVICE
    links: Links = field(default_factory=dict)
    stale: Mapping[tuple[str, str], Decimal] = field(default_factory=dict)

    def slot_quantum(self, slot: str) -> Decimal:
        """The quantum of fractional slots; whole devices and MIG instances count in ones."""
        return self.quantum if is_fractional_slot(slot) else _ONE

    def summary(self, slot: str, devices: Sequence[DeviceFree] | None = None) -> SlotHeadroom:
        """The headroom figures of ``slot``, on its current devices or on ``devices`` (the same
        devices after a what-if placement)."""
        rows = self.slots.get(slot, ()) if devices is None else devices
        return summarize(rows, self.slot_quantum(slot), self.rule, unique=is_mig_slot(slot))

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready document (amounts as exact decimal strings); :meth:`from_json` reads it."""
        return {
            "quantum": str(self.quantum),
            "nofrag_rule": self.rule.value,
            "slots": {
                slot: [
                    {"device_id": d.device_id, "capacity": str(d.capacity), "allocated": str(d.allocated)}
                    for d in devices
                ]
                for slot, devices in self.slots.items()
            },
            "links": [{"devices": sorted(pair), "score": score} for pair, score in self.links.items()],
            "stale": [{"device_id": d, "slot": s, "allocated": str(v)} for (d, s), v in self.stale.items()],
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> NodeState:
        """Read :meth:`to_json`'s document; raises ValueError on a malformed one."""
        try:
            slots = {
                slot: tuple(
                    DeviceFree(str(d["device_id"]), Decimal(str(d["capacity"])), Decimal(str(d["allocated"])))
                    for d in devices
                )
                for slot, devices in doc["slots"].items()
            }
            links = {frozenset(map(str, link["devices"])): int(link["score"]) for link in doc.get("links", [])}
            stale = {(str(s["device_id"]), str(s["slot"])): Decimal(str(s["allocated"])) for s in doc.get("stale", [])}
            return cls(
                slots,
                Decimal(str(doc.get("quantum", "0.01"))),
                NoFragRule(doc.get("nofrag_rule", "26.4")),
                links,
                stale,
            )
        except (KeyError, TypeError, AttributeError, ArithmeticError) as exc:
            raise ValueError(f"not a node state document: {exc!r}") from None


def node_state(
    view: AllocationView,
    inventory: Inventory,
    params: HeadroomParams,
    liveness: Mapping[str, KernelLiveness] | None = None,
) -> NodeState:
    """Devices per slot: inventory devices first (in order), then devices only allocations name.
    Devices whose capacity is unknown (fractional slot without inventory or override) are left
    out rather than guessed."""
    stale: dict[tuple[str, str], Decimal] = defaultdict(Decimal)
    for kernel_id, verdict in (liveness or {}).items():
        kernel = view.kernels.get(kernel_id)
        if verdict.status is Liveness.STALE and kernel is not None:
            for a in kernel.allocations:
                if (a.device_id, a.slot) in view.device_totals:  # accelerator slots only
                    stale[(a.device_id, a.slot)] += a.amount

    whole_gpu_slot = _whole_gpu_slot(view, params.mode)
    members: dict[str, list[str]] = defaultdict(list)
    members[whole_gpu_slot] = [g.device_id for g in inventory.gpus]
    for m in inventory.mig_devices:
        members[m.slot].append(m.device_id)
    for device_id, slot in sorted(view.device_totals):
        if device_id not in members[slot]:
            members[slot].append(device_id)

    gpus = {g.device_id: g for g in inventory.gpus}
    slots: dict[str, tuple[DeviceFree, ...]] = {}
    for slot, device_ids in members.items():
        rows = []
        for device_id in device_ids:
            capacity = device_capacity(slot, device_id, gpus.get(device_id), params.capacity)
            if capacity is None:
                continue
            allocated = view.device_totals.get((device_id, slot), Decimal(0))
            if params.exclude_stale:
                allocated -= stale.get((device_id, slot), Decimal(0))
            rows.append(DeviceFree(device_id, capacity, allocated))
        if rows:
            slots[slot] = tuple(rows)
    return NodeState(slots, params.capacity.quantum, params.rule, params.links, dict(stale))


def live_state(
    view: AllocationView,
    snapshot: TelemetrySnapshot | None,
    devices: DeviceResolver | Inventory,
    params: HeadroomParams,
    liveness: Mapping[str, KernelLiveness] | None = None,
) -> NodeState:
    """:func:`node_state` over what a telemetry snapshot shows: the state ``/api/v1/simulate``
    and the ``simulate`` subcommand place requests on. ``devices`` as for :func:`headroom_families`."""
    return node_state(view, _inventory(snapshot, devices), params, liveness)


def _inventory(snapshot: TelemetrySnapshot | None, devices: DeviceResolver | Inventory) -> Inventory:
    return devices if isinstance(devices, Inventory) else inventory_from_snapshot(snapshot, devices)


def _whole_gpu_slot(view: AllocationView, mode: str) -> str:
    if mode == "fractional" or (mode == "auto" and any(slot == "cuda.shares" for _, slot in view.device_totals)):
        return "cuda.shares"
    return "cuda.device"


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

    :param devices: the scrape's :class:`~exporter.devices.DeviceResolver` (device ids as the
        agent spells them), or a ready :class:`Inventory` (``snapshot`` is then ignored).
    :param liveness: per kernel id, from :func:`exporter.staleness.classify_kernels`; None when
        staleness is not checked.
    :param cgroup_visible: whether the cgroup tree showed the host's containers (None: not checked).
    """
    inventory = _inventory(snapshot, devices)
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
    return [headroom, single, whole, ratio, fits]


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
