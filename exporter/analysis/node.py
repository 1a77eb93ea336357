"""The node's allocatable state: inventory from telemetry, devices per slot with capacity and
allocation, and the headroom settings. The input of the headroom figures and of ``simulate``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from exporter.analysis.capacity import (
    CapacityConfig,
    GpuInventory,
    device_capacity,
    is_fractional_slot,
    is_mig_slot,
    usable_capacity,
)
from exporter.analysis.headroom import SlotHeadroom, count_fits, summarize
from exporter.analysis.liveness import KernelLiveness, Liveness
from exporter.analysis.placement import (
    DEFAULT_AFFINITY,
    DEFAULT_RULE,
    AffinityPolicy,
    DeviceFree,
    Links,
    NoFragRule,
    Policy,
    Request,
)
from exporter.scratch.allocation import AllocationView
from exporter.telemetry.devices import DeviceResolver
from exporter.telemetry.mig import (
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
from exporter.telemetry.model import DeviceReading, TelemetrySnapshot

__all__ = [
    "DEFAULT_REQUESTS",
    "HeadroomFigures",
    "HeadroomParams",
    "Inventory",
    "MigInstanceDevice",
    "MigLayout",
    "NodeState",
    "headroom_figures",
    "inventory_from_snapshot",
    "node_state",
    "ratio_capacities",
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
    :param rule: the agent release whose fractional allocator and fragmentation guard the
        figures follow (``--headroom.nofrag-rule``).
    :param affinity: the agent's ``[resource] affinity-policy`` (how NUMA nodes are joined).
    :param requests: reference requests for ``gpu_alloc_request_fits``.
    :param exclude_stale: leave stale kernels' allocations out of "allocated" (the agent rebuilds
        its map from live containers only); they are always exported on their own.
    :param hami: HAMi ``knownMigGeometries`` entries for ``gpu_alloc_mig_geometry_reachable``.
    :param links: GPU pair scores for the ``besteffort`` what-if policy.
    """

    capacity: CapacityConfig = field(default_factory=CapacityConfig)
    mode: str = "auto"
    rule: NoFragRule = DEFAULT_RULE
    requests: tuple[Request, ...] = DEFAULT_REQUESTS
    exclude_stale: bool = True
    hami: tuple[HamiModel, ...] = ()
    links: Links = field(default_factory=dict)
    affinity: AffinityPolicy = DEFAULT_AFFINITY

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "fractional", "discrete"):
            raise ValueError(f"mode must be auto, fractional or discrete, not {self.mode!r}")


# --- inventory: what telemetry says is there ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class MigInstanceDevice:
    """A MIG device the agent can hand out: its device id, MIG slot and (its GPU's) NUMA node."""

    device_id: str
    slot: str
    numa_node: int | None = None


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
    """Allocatable devices: whole GPUs (MIG off), MIG devices, MIG layouts of MIG GPUs, and the
    whole devices of other plugins (``rocm.device``, ``tpu.device``, ``tt-n300.device`` ...) as
    (slot, device id) pairs, which NVML cannot see: each holds 1, so a free one counts too."""

    gpus: tuple[GpuInventory, ...] = ()
    mig_devices: tuple[MigInstanceDevice, ...] = ()
    mig_layouts: tuple[MigLayout, ...] = ()
    other_devices: tuple[tuple[str, str], ...] = ()


def inventory_from_snapshot(snapshot: TelemetrySnapshot | None, resolver: DeviceResolver) -> Inventory:
    """The :class:`Inventory` a telemetry snapshot shows, ids spelled by ``resolver`` (as the
    agent writes them: ``resolver.label``)."""
    if snapshot is None:
        return Inventory()
    gpus, migs, layouts = [], [], []
    for reading in snapshot.devices:
        device_id = resolver.label(reading)
        if not reading.mig_mode_current:
            # The plugin sizes shares from the memory CUDA reports; NVML's total where CUDA is silent.
            memory = reading.allocatable_memory_bytes or reading.memory_total_bytes
            # CUDA's figure already leaves the driver's reserve out; NVML's total does not.
            reserved = 0 if reading.allocatable_memory_bytes else (reading.memory_reserved_bytes or 0)
            gpus.append(GpuInventory(device_id, memory, reading.multiprocessor_count, reading.numa_node, reserved))
            continue
        migs += [
            MigInstanceDevice(resolver.label(m), f"cuda.device:{m.profile}-mig", reading.numa_node)
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
    """Each accelerator slot's devices (inventory order) with capacity, allocation and NUMA node,
    plus what stale kernels hold. The input of headroom figures and of ``simulate``; JSON
    round-trips.

    :param rule: the agent release whose allocator the figures and what-ifs follow.
    :param stale: (device id, slot) → amount held by stale kernels (already left out of
        ``allocated`` when ``exclude_stale``).
    :param affinity: the agent's ``affinity-policy``.
    :param gpu_slot: the slot whole GPUs register as (``cuda.shares`` or ``cuda.device``), when
        the state was built from an inventory (for :func:`ratio_capacities`); neither part of
        the JSON document nor of equality.
    :param blocked: (device id, slot) -> shares of a fractional device's registered capacity
        whose memory no share can get (driver-reserved or ghost memory beyond the spare memory):
        ``capacity`` of its row is already the usable part; the registered one adds this back.
    """

    slots: Mapping[str, tuple[DeviceFree, ...]]
    quantum: Decimal = Decimal("0.01")
    rule: NoFragRule = DEFAULT_RULE
    links: Links = field(default_factory=dict)
    stale: Mapping[tuple[str, str], Decimal] = field(default_factory=dict)
    affinity: AffinityPolicy = DEFAULT_AFFINITY
    gpu_slot: str | None = field(default=None, compare=False)
    blocked: Mapping[tuple[str, str], Decimal] = field(default_factory=dict)

    def slot_quantum(self, slot: str) -> Decimal:
        """The quantum of fractional slots; whole devices and MIG instances count in ones."""
        return self.quantum if is_fractional_slot(slot) else _ONE

    def summary(self, slot: str, devices: Sequence[DeviceFree] | None = None) -> SlotHeadroom:
        """The headroom figures of ``slot``, on its current devices or on ``devices`` (the same
        devices after a what-if placement)."""
        rows = self.slots.get(slot, ()) if devices is None else devices
        return summarize(rows, self.slot_quantum(slot), self.rule, unique=is_mig_slot(slot), affinity=self.affinity)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready document (amounts as exact decimal strings); :meth:`from_json` reads it."""
        return {
            "quantum": str(self.quantum),
            "nofrag_rule": self.rule.value,
            "affinity_policy": self.affinity.value,
            "slots": {
                slot: [
                    {
                        "device_id": d.device_id,
                        "capacity": str(d.capacity),
                        "allocated": str(d.allocated),
                        "numa_node": d.numa_node,
                    }
                    for d in devices
                ]
                for slot, devices in self.slots.items()
            },
            "links": [{"devices": sorted(pair), "score": score} for pair, score in self.links.items()],
            "stale": [{"device_id": d, "slot": s, "allocated": str(v)} for (d, s), v in self.stale.items()],
        } | ({"blocked": [{"device_id": d, "slot": s, "capacity": str(v)} for (d, s), v in self.blocked.items()]}
             if self.blocked else {})

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> NodeState:
        """Read :meth:`to_json`'s document; raises ValueError on a malformed one. ``numa_node``,
        ``nofrag_rule`` and ``affinity_policy`` are optional (older documents lack the first and
        the last): unknown, and the defaults."""
        try:
            slots = {
                slot: tuple(
                    DeviceFree(
                        str(d["device_id"]),
                        Decimal(str(d["capacity"])),
                        Decimal(str(d["allocated"])),
                        None if d.get("numa_node") is None else int(d["numa_node"]),
                    )
                    for d in devices
                )
                for slot, devices in doc["slots"].items()
            }
            links = {frozenset(map(str, link["devices"])): int(link["score"]) for link in doc.get("links", [])}
            stale = {(str(s["device_id"]), str(s["slot"])): Decimal(str(s["allocated"])) for s in doc.get("stale", [])}
            blocked = {(str(b["device_id"]), str(b["slot"])): Decimal(str(b["capacity"])) for b in doc.get("blocked", [])}
            return cls(
                slots,
                Decimal(str(doc.get("quantum", "0.01"))),
                NoFragRule(doc.get("nofrag_rule", DEFAULT_RULE.value)),
                links,
                stale,
                AffinityPolicy(doc.get("affinity_policy", DEFAULT_AFFINITY.value)),
                blocked=blocked,
            )
        except (KeyError, TypeError, AttributeError, ArithmeticError) as exc:
            raise ValueError(f"not a node state document: {exc!r}") from None


def node_state(
    view: AllocationView,
    inventory: Inventory,
    params: HeadroomParams,
    liveness: Mapping[str, KernelLiveness] | None = None,
    canonical: Callable[[str], str] | None = None,
    ghost_memory: Mapping[str, int] | None = None,
) -> NodeState:
    """Devices per slot: inventory devices first (in order), then devices only allocations name.
    Devices whose capacity is unknown (fractional slot without inventory or override) are left
    out rather than guessed.

    A fractional device's capacity counts only usable memory: its total less what the driver
    reserves and less ``ghost_memory`` (device id -> bytes held by dead processes, processes of
    no kernel, processes of ended kernels), see :func:`~exporter.analysis.capacity.usable_capacity`.

    :param canonical: an allocated device id -> the id of the device it names, as the inventory
        spells it (:meth:`DeviceResolver.label` of what it resolves to): kernels that name one GPU
        two ways (``GPU-<uuid>`` and ``<uuid>``) hold it once. None: ids as written.
    """
    spell = canonical or str

    def canonical_id(device_id: str, slot: str) -> str:
        # NVML sees only CUDA devices: another plugin's "0" is not GPU 0.
        return spell(device_id) if slot.startswith("cuda.") else device_id

    totals: dict[tuple[str, str], Decimal] = defaultdict(Decimal)
    for (device_id, slot), amount in view.device_totals.items():
        totals[(canonical_id(device_id, slot), slot)] += amount
    stale: dict[tuple[str, str], Decimal] = defaultdict(Decimal)
    for kernel_id, verdict in (liveness or {}).items():
        kernel = view.kernels.get(kernel_id)
        if verdict.status is Liveness.STALE and kernel is not None:
            for a in kernel.allocations:
                if (a.device_id, a.slot) in view.device_totals:  # accelerator slots only
                    stale[(canonical_id(a.device_id, a.slot), a.slot)] += a.amount

    whole_gpu_slot = _whole_gpu_slot(view, params.mode)
    members: dict[str, list[str]] = defaultdict(list)
    members[whole_gpu_slot] = [g.device_id for g in inventory.gpus]
    for m in inventory.mig_devices:
        members[m.slot].append(m.device_id)
    for slot, device_id in inventory.other_devices:
        if device_id not in members[slot]:
            members[slot].append(device_id)
    for device_id, slot in sorted(totals):
        if device_id not in members[slot]:
            members[slot].append(device_id)

    gpus = {g.device_id: g for g in inventory.gpus}
    numa = {g.device_id: g.numa_node for g in inventory.gpus} | {m.device_id: m.numa_node for m in inventory.mig_devices}
    ghost = ghost_memory or {}
    blocked: dict[tuple[str, str], Decimal] = {}
    slots: dict[str, tuple[DeviceFree, ...]] = {}
    for slot, device_ids in members.items():
        rows = []
        for device_id in device_ids:
            capacity = device_capacity(slot, device_id, gpus.get(device_id), params.capacity)
            if capacity is None:
                continue
            gpu = gpus.get(device_id)
            if gpu is not None and is_fractional_slot(slot):
                unusable = gpu.memory_reserved_bytes + ghost.get(device_id, 0)
                usable = usable_capacity(capacity, gpu.memory_total_bytes, unusable, params.capacity)
                if usable != capacity:
                    blocked[(device_id, slot)] = capacity - usable
                    capacity = usable
            allocated = totals.get((device_id, slot), Decimal(0))
            if params.exclude_stale:
                allocated -= stale.get((device_id, slot), Decimal(0))
            rows.append(DeviceFree(device_id, capacity, allocated, numa.get(device_id)))
        if rows:
            slots[slot] = tuple(rows)
    return NodeState(
        slots, params.capacity.quantum, params.rule, params.links, dict(stale), params.affinity, whole_gpu_slot, blocked
    )


_ZERO_D = Decimal(0)


def _whole_gpu_slot(view: AllocationView, mode: str) -> str:
    if mode == "fractional" or (mode == "auto" and any(slot == "cuda.shares" for _, slot in view.device_totals)):
        return "cuda.shares"
    return "cuda.device"


def ratio_capacities(state: NodeState, inventory: Inventory) -> dict[tuple[str, str], Decimal]:
    """(slot, device id) → the capacity the compute plugin registers: the divisors of the ratio
    ``gpu_alloc_map`` (26.4.8+; 26.9.6 ``collect_device_capacities``).

    Each device registers exactly one slot: a whole GPU the node's whole-GPU slot
    (``cuda.shares`` or ``cuda.device``), a MIG device its profile's slot, other plugins' devices
    theirs. Nothing registers ``cuda.mem``. An allocation under any other (slot, device), such as
    ``cuda.device`` on a GPU handed out as shares or ``cuda.mem`` bytes, is added raw by the agent
    (:func:`~exporter.scratch.allocation.ratio_alloc_map`). Devices only allocations name keep
    their row: the agent registers whatever it has for them, and a whole-device row's 1 divides
    nothing.
    """
    gpus = {g.device_id for g in inventory.gpus}
    migs = {m.device_id: m.slot for m in inventory.mig_devices}
    capacities: dict[tuple[str, str], Decimal] = {}
    for slot, rows in state.slots.items():
        for d in rows:
            if d.device_id in gpus and state.gpu_slot is not None and slot != state.gpu_slot:
                continue
            if d.device_id in migs and slot != migs[d.device_id]:
                continue
            # The agent registers the whole capacity, memory held by no share included.
            capacities[(slot, d.device_id)] = d.capacity + state.blocked.get((d.device_id, slot), _ZERO_D)
    return capacities


# --- headroom figures: what the headroom and MIG families show --------------------------------


@dataclass(frozen=True)
class HeadroomFigures:
    """The node's headroom figures, computed once per change of the node state or inventory.

    :param summaries: per slot, every node-level figure (:class:`SlotHeadroom`).
    :param fits: (slot, request amount, ``allowed``/``disallowed``, how many more such
        requests the agent would place one after another), per reference request.
    :param mig_creatable: (device id, profile, GPU instances that could still be created).
    :param mig_reachable: (device id, geometry, 1 if an allowed geometry is still reachable).
    """

    summaries: Mapping[str, SlotHeadroom] = field(default_factory=dict)
    fits: tuple[tuple[str, str, str, int], ...] = ()
    mig_creatable: tuple[tuple[str, str, int], ...] = ()
    mig_reachable: tuple[tuple[str, str, int], ...] = ()


def headroom_figures(state: NodeState, inventory: Inventory, params: HeadroomParams) -> HeadroomFigures:
    """Every headroom figure of ``state`` and of the MIG layouts in ``inventory``."""
    summaries = {slot: state.summary(slot) for slot in state.slots}
    fits = []
    for request in params.requests:
        devices = state.slots.get(request.slot)
        if devices is None:
            continue
        for label, policy in (("allowed", Policy.EVENLY), ("disallowed", Policy.EVENLY_NOFRAG)):
            n = count_fits(
                devices, request, policy, quantum=state.slot_quantum(request.slot), rule=state.rule, affinity=state.affinity
            )
            fits.append((request.slot, str(request.amount), label, n))
    creatable, reachable = [], []
    for layout in inventory.mig_layouts:
        try:
            counts = creatable_instances(layout.table, layout.instances, remaining=layout.remaining)
            verdicts = reachable_geometries(layout.table, layout.instances, hami_geometries_for(params.hami, layout.product_name))
        except MigLayoutError:
            continue  # the reported instances cannot coexist: no figure beats a wrong one
        creatable += [(layout.device_id, profile, n) for profile, n in counts.items()]
        reachable += [(layout.device_id, label, int(ok)) for label, ok in verdicts.items() if ok is not None]
    return HeadroomFigures(summaries, tuple(fits), tuple(creatable), tuple(reachable))
