"""What each kernel holds of each physical GPU, how much of it it uses, and the GPU ledger: the
counters that integrate both, with the energy, per kernel, device and owner.

Per analysis pass, all keyed by the **physical GPU** (a MIG slice counts against the GPU it is
carved from, so a GPU's health reaches every kernel on it, whatever it holds):

* the **share** of a GPU a kernel holds, 0–1: ``cuda.device`` = 1; ``cuda.shares`` = amount ÷
  the GPU's fractional capacity (:func:`~exporter.analysis.capacity.device_capacity`); a MIG
  slice = its SMs ÷ the GPU's SMs (its memory ÷ the GPU's memory where SMs are unknown);
* per kernel, **measured use normalised by what it holds**, averaged over its allocated devices
  (not summed, so a kernel on four GPUs at 30 % reads 0.3): SM utilisation from NVML's per-process
  samples, and GPU memory used ÷ memory held (the ``cuda.mem`` allocation where the plugin writes
  one, else the share × the device's memory). Where a device is not measured (MIG without
  per-process samples, a failed read, no telemetry) the kernel has **no value**, never 0;
* the **ledger**, counters integrated at every analysis pass (every telemetry sample), not per
  scrape, so they are exact whatever the scrape interval, and reset only with the process:

  - *allocated* GPU-seconds per kernel and GPU (share × seconds; on an overcommitted GPU, whose
    shares add up to more than 1, each share ÷ their sum) and the GPU's *unallocated* seconds:
    per GPU, Σ allocated + unallocated = the seconds the GPU was known × 1 GPU;
  - *busy* GPU-seconds per kernel and GPU: the busy seconds of the kernel's processes, from the
    source's cumulative per-process SM-busy counters (``DeviceReading.process_busy_seconds``)
    differenced between passes per (PID, process start time), × the share it held — normalised
    by what it holds, as the utilisation ratio is. Nothing is lost between samples, a reused PID
    is a new process, a restarted source (new ``nvml_generation``) counts from 0, and a process
    that left the list between two reads is charged to the kernel it last belonged to. Processes
    busy together for longer than the time since the GPU's last measurement (concurrent
    processes, or a kernel time-sliced beyond its share) are charged what the kernel held then:
    busy ≤ allocated, always. Where the GPU's busy time cannot be measured (no per-process
    counter, as on MIG; an unread process list; no attribution) the kernel has no busy sample,
    never 0, and the GPU's measurability is 0;
  - *energy* per kernel and GPU: each interval's increase of the GPU's energy counter split by
    the policy ``energy_split`` (:data:`ENERGY_SPLITS`), the rest *unattributed*; per GPU,
    Σ kernels' joules + unattributed = the counter's increase since the exporter first read it
    (a counter that goes back, or a new ``nvml_generation``, counts from 0). ``allocation``: by
    allocated share (the unallocated part is unattributed); ``use``: the allocated part by each
    kernel's part of the kernels' busy GPU-seconds (unattributed while none is busy); ``max``
    (default): per kernel the larger of the two, scaled down where they add up to more than
    the whole, so an idle holder pays its share and a busy one pays for its activity. Use counts
    only for an interval whose both ends measured it; else the interval is split by allocation.
    A MIG GPU without per-process counters splits by instance size, its use by the size of the
    instances that run a process of their kernel;
  - the same per GPU and per **owner** (user_id, project_id from ``recovery.json``;
    ``undefined`` where unknown), as counters that stay while kernels come and go, so a session
    shorter than a scrape interval is counted in full by ``increase()``.

  A pass integrates the shares the previous pass saw over the time since it (the times the
  kernels were observed, see :meth:`Accountant.update`), so an allocation change is counted from
  the next pass (an error of at most one telemetry interval per change).
  Counters of a kernel that went away stay for ``retention`` seconds, so the last increment is
  scraped (Backend.AI drops an ended kernel's series after 600 s as well).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from types import MappingProxyType

from exporter.analysis.attribution import AttributionResult, ProcessUsage
from exporter.analysis.capacity import CapacityConfig, GpuInventory, device_capacity, is_mig_slot
from exporter.scratch.allocation import Kernel
from exporter.scratch.identity import UNDEFINED
from exporter.scratch.resources import Allocation, SlotKind, slot_kind
from exporter.telemetry.devices import DeviceResolver
from exporter.telemetry.model import DeviceReading, MigDeviceReading, TelemetrySnapshot

__all__ = ["DEFAULT_ENERGY_SPLIT", "ENERGY_SPLITS", "Accountant", "Accounting", "DrivenCounters", "KernelUse", "gpu_shares"]

_NVML_PLUGIN = "cuda"
RETENTION_SECONDS = 600.0
# How a GPU's energy is split between the kernels on it (the module docstring defines each).
ENERGY_SPLITS = ("allocation", "use", "max")
DEFAULT_ENERGY_SPLIT = "max"

_Pair = tuple[str, str]  # (kernel_id, GPU device_id)
_Owner = tuple[str, str]  # (user_id, project_id), Backend.AI's label values
_NO_OWNER: _Owner = (UNDEFINED, UNDEFINED)
# A pass that sees at most this many changed kernels, and measures nothing, moves only their
# counters (Accountant._shift); past it, one walk over every kernel costs less than the bookkeeping.
_SHIFT_KERNELS = 256
# Shifts one log keeps: a renderer behind by more (a scrape every 15 s, a change every 50 ms)
# rebuilds what it derived from the tables once, where walking the log would cost as much.
_SHIFT_LOG = 512


@dataclass(frozen=True, slots=True)
class _Held:
    """One allocated cuda device of one kernel."""

    alloc_device_id: str  # as resource.txt spells it (attribution keys by this)
    gpu: str  # the physical GPU's device_id label
    share: float | None  # of the physical GPU, 0-1; None when the capacity is unknown
    memory_bytes: float | None  # device memory held


@dataclass(frozen=True, slots=True)
class KernelUse:
    """A kernel's measured use of what it holds (0-1, averaged per allocated device); None where
    any of its devices is not measured."""

    utilization_ratio: float | None
    memory_ratio: float | None


@dataclass(frozen=True)
class Accounting:
    """One pass's immutable result; every counter is as of the pass.

    :param shares: (kernel_id, GPU device_id) -> share of the GPU held (0-1).
    :param kernels: kernel_id -> measured use normalised by allocation.
    :param allocated_seconds: (kernel_id, GPU) -> GPU-seconds held since the exporter started.
    :param busy_seconds: (kernel_id, GPU) -> GPU-seconds its processes kept the SMs busy, at most
        what it held; only pairs on GPUs whose busy time was measured at least once.
    :param energy_joules: (kernel_id, GPU) -> joules of the GPU charged to the kernel; only pairs
        on GPUs whose energy counter was read.
    :param device_allocated_seconds: GPU -> Σ kernels' allocated GPU-seconds (kept when they go).
    :param device_unallocated_seconds: GPU -> GPU-seconds no kernel held.
    :param device_busy_seconds: GPU -> Σ kernels' busy GPU-seconds.
    :param device_energy_joules: GPU -> Σ kernels' joules.
    :param device_unattributed_joules: GPU -> joules charged to no kernel.
    :param owner_allocated_seconds: (user_id, project_id) -> allocated GPU-seconds of its kernels.
    :param owner_busy_seconds: (user_id, project_id) -> busy GPU-seconds of its kernels.
    :param owner_energy_joules: (user_id, project_id) -> joules of its kernels.
    :param measured: GPU -> whether this pass measured its busy time (its energy ledger exists
        where its energy counter was read once: ``energy_joules`` and the device's).
    :param shift_log: the pairs each shift moved (:meth:`Accountant._shift`), in order, since the
        last settle (a settle, which may move any counter, starts a new list; entries are only
        appended), and ``shifts`` how many of its entries this result includes (see
        :meth:`moved_since`).
    """

    shares: Mapping[_Pair, float] = field(default_factory=dict)
    kernels: Mapping[str, KernelUse] = field(default_factory=dict)
    allocated_seconds: Mapping[_Pair, float] = field(default_factory=dict)
    busy_seconds: Mapping[_Pair, float] = field(default_factory=dict)
    energy_joules: Mapping[_Pair, float] = field(default_factory=dict)
    device_allocated_seconds: Mapping[str, float] = field(default_factory=dict)
    device_unallocated_seconds: Mapping[str, float] = field(default_factory=dict)
    device_busy_seconds: Mapping[str, float] = field(default_factory=dict)
    device_energy_joules: Mapping[str, float] = field(default_factory=dict)
    device_unattributed_joules: Mapping[str, float] = field(default_factory=dict)
    owner_allocated_seconds: Mapping[_Owner, float] = field(default_factory=dict)
    owner_busy_seconds: Mapping[_Owner, float] = field(default_factory=dict)
    owner_energy_joules: Mapping[_Owner, float] = field(default_factory=dict)
    measured: Mapping[str, bool] = field(default_factory=dict)
    shift_log: list[frozenset[_Pair]] | None = field(default=None, compare=False, repr=False)
    shifts: int = field(default=0, compare=False)

    def moved_since(self, earlier: Accounting) -> frozenset[_Pair] | None:
        """The pairs whose share or per-pair counter terms (``terms()`` of ``allocated_seconds``
        and ``energy_joules``) differ between ``earlier`` and this result, or None where that is
        not known (a settle between them). The other pairs' entries are the same in both: a
        renderer may patch what it derived from ``earlier`` at these pairs only."""
        log = self.shift_log
        if log is None or earlier.shift_log is not log or earlier.shifts > self.shifts:
            return None
        return frozenset().union(*log[earlier.shifts:self.shifts])


class _Counters(Mapping):
    """Counters that grow at constant rates between passes, read as of one time.

    Every counter is ``base + rate × (as_of - since)``: a pass whose rates are the last pass's
    (an idle node: the same kernels, nothing measured) publishes new counters in O(1), and the
    values are computed only when read (the exposition is rendered once per scrape, not per
    pass). ``base`` and ``rates`` are never changed once handed out.
    """

    __slots__ = ("_as_of", "_base", "_rates", "_since")

    def __init__(self, base: Mapping[Hashable, float], rates: Mapping[Hashable, float],
                 since: float, as_of: float) -> None:
        self._base, self._rates, self._since, self._as_of = base, rates, since, as_of

    def __getitem__(self, key: Hashable) -> float:
        return self._base[key] + self._rates.get(key, 0.0) * (self._as_of - self._since)

    def items(self):  # every value in one loop, not one method call per key (a render reads them all)
        dt, rates = self._as_of - self._since, self._rates
        return [(key, base + rates.get(key, 0.0) * dt) for key, base in self._base.items()]

    def keys(self):  # the base's own view: set operations on it run in C (a render unites the families' keys)
        return self._base.keys()

    def __iter__(self):
        return iter(self._base)

    def __len__(self) -> int:
        return len(self._base)


# Energy rates: per counter, (GPU, fraction of that GPU's energy) pairs.
_Split = tuple[tuple[str, float], ...]


class DrivenCounters(Mapping):
    """Counters that grow with a per-GPU drive between passes: ``base + Σ fraction × drive[GPU]``,
    computed when read, as :class:`_Counters` does with time. The drive is the joules a GPU used
    since ``since``, or (for the per-pair and per-owner families) the GPU-seconds or joules one
    unit of share earned since then: 1 per second (per joule) while the GPU's shares add up to at
    most 1, 1 ÷ their sum while it is overcommitted (see ``Accountant._drives``)."""

    __slots__ = ("_base", "_drive", "_rates")

    def __init__(self, base: Mapping[Hashable, float], rates: Mapping[Hashable, _Split], drive: Mapping[str, float]) -> None:
        self._base, self._rates, self._drive = base, rates, drive

    def _value(self, key: Hashable, base: float) -> float:
        drive = self._drive
        for gpu, fraction in self._rates.get(key, ()):
            base += fraction * drive.get(gpu, 0.0)
        return base

    def __getitem__(self, key: Hashable) -> float:
        return self._value(key, self._base[key])

    def items(self):  # every value in one comprehension (a render reads them all); one-GPU splits inline
        drive = self._drive
        if not any(drive.values()):
            return list(self._base.items())
        get, value, on = self._rates.get, self._value, drive.get
        return [(key, base + s[0][1] * on(s[0][0], 0.0) if len(s := get(key, ())) == 1 else value(key, base))
                for key, base in self._base.items()]

    def keys(self):  # the base's own view: set operations on it run in C (a render unites the families' keys)
        return self._base.keys()

    def terms(self) -> tuple[Mapping[Hashable, float], Mapping[Hashable, _Split], Mapping[str, float]]:
        """``(base, splits, drive)``: each counter reads ``base[key]`` plus, over ``splits[key]``
        (none: it does not grow), ``fraction × drive[GPU]``, summed in the split's order. Every
        result of the ledger hands out the same ``base`` and ``splits`` objects until a pass changes
        them, so a renderer may keep what it derived from them for as long as they are the same."""
        return self._base, self._rates, self._drive

    def __iter__(self):
        return iter(self._base)

    def __len__(self) -> int:
        return len(self._base)


def _gpu_of(reading: DeviceReading | MigDeviceReading | None, snapshot: TelemetrySnapshot) -> DeviceReading | None:
    if isinstance(reading, DeviceReading):
        return reading
    if isinstance(reading, MigDeviceReading):
        return next((d for d in snapshot.devices if d.uuid == reading.parent_uuid), None)
    return None


# One allocation's part of :func:`_held`, per (slot, device, amount): (the allocation, whether it
# is a cuda memory slot, what it holds apart from such a slot). A node's kernels repeat a few
# hundred such triples, so the first pass over 10,000 kernels computes a few hundred capacities
# instead of 10,000, which were a visible part of the start. Keyed by value, not by object: the
# parser shares the objects of identical lines only, and a random mix of 1-2 GPUs per kernel
# repeats few lines.
_AllocMemo = dict[tuple[str, str, Decimal], tuple[Allocation, bool, "_Held | None"]]


def _held_alloc(a: Allocation, snapshot: TelemetrySnapshot, resolver: DeviceResolver, capacity: CapacityConfig) -> _Held | None:
    """What one cuda allocation holds (its share and memory), or None for any other slot."""
    if a.slot.partition(".")[0] != _NVML_PLUGIN or slot_kind(a.slot) is SlotKind.BYTES or not a.amount:
        return None
    reading = resolver.resolve(a.device_id)
    gpu = _gpu_of(reading, snapshot)
    label = resolver.label(gpu) if gpu is not None else a.device_id
    share: float | None = None
    memory: float | None = None
    if is_mig_slot(a.slot):
        if isinstance(reading, MigDeviceReading) and gpu is not None:
            if reading.multiprocessor_count and gpu.multiprocessor_count:
                share = reading.multiprocessor_count / gpu.multiprocessor_count
            elif reading.memory_total_bytes and gpu.memory_total_bytes:
                share = reading.memory_total_bytes / gpu.memory_total_bytes
            memory = reading.memory_total_bytes
    else:
        inv = GpuInventory(label, gpu.memory_total_bytes, gpu.multiprocessor_count) if gpu is not None else None
        cap = device_capacity(a.slot, a.device_id, inv, capacity)
        if cap:
            share = min(1.0, float(a.amount / cap))
        if share is not None and gpu is not None and gpu.memory_total_bytes:
            memory = share * gpu.memory_total_bytes
    return _Held(a.device_id, label, share, memory)


def _held(
    kernel: Kernel, snapshot: TelemetrySnapshot, resolver: DeviceResolver, capacity: CapacityConfig, memo: _AllocMemo
) -> tuple[_Held, ...]:
    parts = []
    for a in kernel.allocations:
        key = (a.slot, a.device_id, a.amount)
        entry = memo.get(key)
        if entry is None:
            is_memory = a.slot.partition(".")[0] == _NVML_PLUGIN and slot_kind(a.slot) is SlotKind.BYTES
            entry = memo[key] = (a, is_memory, _held_alloc(a, snapshot, resolver, capacity))
        parts.append(entry)
    # The plugin's memory slot (cuda.mem), where it writes one, is what the device's allocation holds.
    mem_slot: dict[str, Decimal] = {}
    for a, is_memory, _ in parts:
        if is_memory:
            mem_slot[a.device_id] = mem_slot.get(a.device_id, Decimal(0)) + a.amount
    out = []
    for a, _, held in parts:
        if held is not None:
            if a.device_id in mem_slot:
                held = _Held(held.alloc_device_id, held.gpu, held.share, float(mem_slot[a.device_id]))
            out.append(held)
    return tuple(out)  # kept per kernel: a tuple is the smallest sequence


def _inventory_key(snapshot: TelemetrySnapshot) -> Hashable:
    """What :func:`_held` reads of a snapshot: each device's identity, memory and SM count."""
    return tuple(
        (d.uuid, d.index, d.memory_total_bytes, d.multiprocessor_count,
         tuple((m.uuid, m.index, m.memory_total_bytes, m.multiprocessor_count) for m in d.mig_devices))
        for d in snapshot.devices
    )


def gpu_shares(held: Iterable[_Held]) -> dict[str, float]:
    """GPU device_id -> share held, summed over a kernel's allocations on that GPU (capped at 1)."""
    out: dict[str, float] = {}
    for h in held:
        if h.share is not None:
            out[h.gpu] = min(1.0, out.get(h.gpu, 0.0) + h.share)
    return out


# For Accountant._shift: each GPU's pairs with their shares, each owner's per GPU with their rates,
# and the kernels that have counters.
_Index = tuple[dict[str, dict[_Pair, float]], dict[_Owner, dict[str, dict[_Pair, float]]], set[str]]

# One kernel's cached holdings: its Kernel object, what it holds, and (GPU, share) pairs.
_HeldEntry = tuple[Kernel, tuple[_Held, ...], tuple[tuple[str, float], ...]]


@dataclass(slots=True)
class _Seen:
    """A process's last cumulative busy seconds, when it was last listed, and its kernel."""

    busy: float
    at: float
    kernel_id: str | None


@dataclass
class _Pass:
    """What one slow pass measured, for :meth:`Accountant._settle`."""

    now: float
    devices: tuple[str, ...]  # every GPU label of the snapshot and of the allocations
    busy_measured: frozenset[str]  # GPUs whose busy time this pass read from a new sample
    busy_again: frozenset[str]  # GPUs measured, but the sample is the one already counted
    raw_busy: dict[_Pair, float]  # busy seconds of the pair's processes since the GPU's last measured sample
    active: frozenset[_Pair]  # pairs with a process of the kernel on the GPU now
    mig: frozenset[str]  # MIG-enabled GPUs whose instances' processes were read this pass
    owners: dict[str, _Owner]  # kernel_id -> owner, of the kernels present now


class Accountant:
    """Keeps the ledger; call :meth:`update` from the analysis thread only.

    Time-driven counters (allocated, unallocated) grow at constant rates between changes
    (:class:`_Counters`) and energy counters at constant fractions of each GPU's energy
    (:class:`DrivenCounters`): a pass over an unchanged node (same kernels, same inventory, nothing
    measured) changes no rate and costs O(GPUs) instead of a walk over every kernel; a pass that
    measures nothing and is told which few kernels changed moves only the counters whose rate
    changes (:meth:`_shift`); any other pass settles every counter once. Busy time changes only
    where it is measured, at the passes that measure it.

    :param monotonic: seconds, for the time between passes.
    :param retention: seconds an ended kernel's counters stay exported.
    :param energy_split: one of :data:`ENERGY_SPLITS`.
    """

    def __init__(self, monotonic: Callable[[], float] = time.monotonic, retention: float = RETENTION_SECONDS,
                 energy_split: str = DEFAULT_ENERGY_SPLIT) -> None:
        if energy_split not in ENERGY_SPLITS:
            raise ValueError(f"energy_split must be one of {', '.join(ENERGY_SPLITS)}")
        self._monotonic = monotonic
        self._retention = retention
        self._split = energy_split
        # What each kernel holds depends only on its immutable Kernel object and the devices'
        # inventory: cached per kernel object while the inventory stays the same (a pass over
        # unchanged kernels then costs lookups, not one capacity computation per kernel). The
        # shares per GPU are kept as pairs: a tuple of one pair is far smaller than a dict.
        self._held_env: Hashable = None
        self._held: dict[str, _HeldEntry] = {}
        # The last pass's inputs and result, for a pass that sees the same ones.
        self._inputs: Hashable = None
        self._result: Accounting | None = None
        # Counters at ``self._since`` and the rates they grow at from there (new dicts at every
        # change: results already handed out keep theirs). Time rates are GPU-seconds per second.
        self._since = 0.0
        self._settled = False
        # Per pair: its allocated counter at ``since``, its share of the GPU (present pairs), and
        # the split ((GPU, share),) its allocated and energy counters grow by (see DrivenCounters).
        self._alloc_base: dict[_Pair, float] = {}
        self._shares: dict[_Pair, float] = {}
        self._fracs: dict[_Pair, _Split] = {}
        # Per GPU with shares: 1 ÷ Σ shares where that is over 1, else 1; and where the unit drives
        # (GPU-seconds, joules per unit of share) were when that scale last changed: (time, drive)
        # and (joules since ``since``, drive). None recorded: (since, 0) and (0, 0).
        self._scale: dict[str, float] = {}
        self._time_anchor: dict[str, tuple[float, float]] = {}
        self._joule_anchor: dict[str, tuple[float, float]] = {}
        self._dev_alloc_base: dict[str, float] = {}
        self._dev_alloc_rates: dict[str, float] = {}
        self._dev_free_base: dict[str, float] = {}
        self._dev_free_rates: dict[str, float] = {}
        # Per owner: its counters at ``since`` and its split ((GPU, Σ shares), ...) by GPU.
        self._own_alloc_base: dict[_Owner, float] = {}
        self._own_fracs: dict[_Owner, _Split] = {}
        # Energy: counters at ``since`` (per pair and owner growing by their splits above).
        self._energy_base: dict[_Pair, float] = {}
        self._dev_energy_base: dict[str, float] = {}
        self._dev_energy_rates: dict[str, _Split] = {}
        self._dev_unattr_base: dict[str, float] = {}
        self._dev_unattr_rates: dict[str, _Split] = {}
        self._own_energy_base: dict[_Owner, float] = {}
        # Busy time, changed only by the passes that measure it.
        self._busy: dict[_Pair, float] = {}
        self._dev_busy: dict[str, float] = {}
        self._own_busy: dict[_Owner, float] = {}
        self._owners: dict[str, _Owner] = {}  # kernel_id -> owner, as of ``since``
        # Each GPU's energy counter: (nvml_generation, last value), and the joules it used since
        # the exporter first read it (never decreasing), now and at ``since``.
        self._energy_read: dict[str, tuple[int | None, float]] = {}
        self._joules: dict[str, float] = {}
        self._joules_at_since: dict[str, float] = {}
        # Each GPU's processes: (pid, start time) -> last busy seconds; the source's generation.
        self._procs: dict[str, dict[tuple[int, int | None], _Seen]] = {}
        self._procs_gen: dict[str, int | None] = {}
        self._busy_read: dict[str, DeviceReading] = {}  # GPU -> the reading last counted
        # (kernel, GPU) -> its allocated counter when the GPU's busy time was last measured (a
        # kernel is charged at most what it held since), and the GPUs whose use (busy time, or a
        # MIG GPU's active instances) the last pass measured.
        self._mark: dict[_Pair, float] = {}
        self._use_before: frozenset[str] = frozenset()
        self._ended: dict[str, float] = {}  # kernel_id -> monotonic time it went away
        # For a shift (see _shift): the GPUs of the last settle, those of the inventory, and (built
        # on the first shift after a settle) each GPU's pairs with their shares and each owner's
        # with their rates.
        self._devices: tuple[str, ...] = ()
        self._inventory_gpus: frozenset[str] = frozenset()
        self._index: _Index | None = None
        self._log: list[frozenset[_Pair]] = []  # the pairs each shift since the last settle moved
        # The joule drives of the last result handed out: (per GPU, per unit of share).
        self._shown: tuple[Mapping[str, float], Mapping[str, float]] = ({}, {})
        # The read-only view of ``_busy`` handed out, made where the table is replaced: the same
        # object while the table is, it tells a renderer (with the other tables' identities) that
        # the set of pairs did not move.
        self._busy_view: Mapping[_Pair, float] = MappingProxyType(self._busy)

    def update(
        self,
        kernels: Collection[Kernel],
        snapshot: TelemetrySnapshot,
        resolver: DeviceResolver,
        capacity: CapacityConfig,
        attribution: AttributionResult | None,
        version: Hashable | None = None,
        changes: Callable[[Hashable], Mapping[str, Kernel | None] | None] | None = None,
        at: float | None = None,
    ) -> Accounting:
        """One pass.

        :param version: identifies ``kernels`` (the allocation view's version); with the same
            version, inventory and no measurement as the last pass, the rates are known unchanged.
        :param changes: an earlier ``version`` -> the kernels changed since (kernel id -> its
            kernel now, None where it went), or None where that is not known. With it, a pass that
            measures nothing and sees a few kernels changed moves only their counters
            (:meth:`_shift`): O(changed kernels), where a settle walks every kernel (10,000
            kernels: ~0.1 s of Python, holding the GIL from every scrape and every kernel change).
        :param at: when ``kernels`` were observed (seconds of ``monotonic``, not before the last
            pass's); None: now. The counters are as of then: a caller that observes the kernels
            and counts them later counts each kernel for the time it held its share.
        """
        now = self._monotonic() if at is None else at
        self._read_energy(snapshot, resolver)
        measured = {(u.kernel_id, u.device_id): u for u in attribution.kernels if u.allocated} if attribution else {}
        env = (_inventory_key(snapshot), resolver.scheme, id(capacity))
        inputs = (version, env) if version is not None and not measured else None
        expiring = any(now - t > self._retention for t in self._ended.values())  # O(ended kernels)
        if inputs is not None and inputs == self._inputs and self._result is not None and not expiring:
            # Nothing measured: an interval after this one is split by allocation, as these
            # counters read (see _settle), whatever the next pass measures.
            self._use_before = frozenset()
            prev = self._result
            return self._publish(prev.shares, prev.kernels, now, MappingProxyType(dict.fromkeys(prev.measured, False)))
        busy_measured, again, raw, mig = self._read_busy(snapshot, resolver, attribution, now)
        last = self._inputs
        if (inputs is not None and last is not None and changes is not None and self._result is not None
                and inputs[1] == last[1] and not expiring and not (busy_measured or again or raw or mig)):
            changed = changes(last[0])
            if changed is not None and len(changed) <= _SHIFT_KERNELS:
                shifted = self._shift(changed, snapshot, resolver, capacity, now)
                if shifted is not None:
                    self._inputs, self._use_before = inputs, frozenset()
                    return self._publish(*shifted, now, MappingProxyType(dict.fromkeys(self._devices, False)))
        self._inputs = inputs
        shares, uses, present, active = self._rates(kernels, snapshot, resolver, capacity, measured, env)
        inventory = {resolver.label(d) for d in snapshot.devices}
        devices = inventory | {gpu for _, gpu in shares}
        owners = {k.kernel_id: _owner(k) for k in kernels}
        # Sums of floats depend on their order: summed in key order, the per-device and per-owner
        # counters are the same whatever order the kernels were read in (the scan's order is
        # the file system's).
        raw = dict(sorted(raw.items()))
        step = _Pass(now, tuple(sorted(devices)), busy_measured, again, raw, frozenset(active), mig, owners)
        self._settle(step, dict(sorted(shares.items())), present)
        self._devices, self._inventory_gpus, self._index = step.devices, frozenset(inventory), None
        self._log = []
        flags = MappingProxyType({gpu: gpu in busy_measured or gpu in again for gpu in step.devices})
        return self._publish(MappingProxyType(shares), MappingProxyType(uses), now, flags)

    def _drives(self, now: float) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        """As of ``now``: per GPU, the GPU-seconds one unit of share earned since ``since``, the
        joules the GPU used since then, and the joules one unit of share earned."""
        since, joules = self._since, self._joules
        seconds, per_share = {}, {}
        raw = {gpu: j - self._joules_at_since.get(gpu, 0.0) for gpu, j in joules.items()}
        for gpu, scale in self._scale.items():
            t0, d0 = self._time_anchor.get(gpu, (since, 0.0))
            seconds[gpu] = d0 + scale * (now - t0)
            j0, e0 = self._joule_anchor.get(gpu, (0.0, 0.0))
            per_share[gpu] = e0 + scale * (raw.get(gpu, 0.0) - j0)
        return seconds, raw, per_share

    def _publish(self, shares: Mapping, uses: Mapping, now: float, flags: Mapping[str, bool]) -> Accounting:
        since = self._since
        seconds, drive, per_share = self._drives(now)
        self._shown = (drive, per_share)
        self._result = Accounting(
            shares=shares,
            kernels=uses,
            allocated_seconds=DrivenCounters(self._alloc_base, self._fracs, seconds),
            busy_seconds=self._busy_view,
            energy_joules=DrivenCounters(self._energy_base, self._fracs, per_share),
            device_allocated_seconds=_Counters(self._dev_alloc_base, self._dev_alloc_rates, since, now),
            device_unallocated_seconds=_Counters(self._dev_free_base, self._dev_free_rates, since, now),
            device_busy_seconds=MappingProxyType(self._dev_busy),
            device_energy_joules=DrivenCounters(self._dev_energy_base, self._dev_energy_rates, drive),
            device_unattributed_joules=DrivenCounters(self._dev_unattr_base, self._dev_unattr_rates, drive),
            owner_allocated_seconds=DrivenCounters(self._own_alloc_base, self._own_fracs, seconds),
            owner_busy_seconds=MappingProxyType(self._own_busy),
            owner_energy_joules=DrivenCounters(self._own_energy_base, self._own_fracs, per_share),
            measured=flags,
            shift_log=self._log,
            shifts=len(self._log),
        )
        return self._result

    def _read_energy(self, snapshot: TelemetrySnapshot, resolver: DeviceResolver) -> None:
        """Adds each GPU's energy since the last read to its joules.

        A counter that went back or belongs to a new ``nvml_generation`` (the driver was
        reloaded) counts from 0; a failed read adds nothing, and the next one adds the gap.
        """
        for d in snapshot.devices:
            if d.energy_joules is None or not d.up or d.stale:
                continue
            gpu = resolver.label(d)
            last = self._energy_read.get(gpu)
            if last is None:
                delta = 0.0  # the first read is the baseline: the ledger starts here
            elif last[0] != d.nvml_generation or d.energy_joules < last[1]:
                delta = d.energy_joules
            else:
                delta = d.energy_joules - last[1]
            self._energy_read[gpu] = (d.nvml_generation, d.energy_joules)
            self._joules[gpu] = self._joules.get(gpu, 0.0) + delta

    def _read_busy(self, snapshot: TelemetrySnapshot, resolver: DeviceResolver, attribution: AttributionResult | None,
                   now: float) -> tuple[frozenset[str], frozenset[str], dict[_Pair, float], frozenset[str]]:
        """The GPUs whose busy time a new sample measured, those whose sample was already
        counted (a pass for an allocation change between samples: it adds nothing and keeps the
        marks, so the next sample is charged over its whole span), each (kernel, GPU)'s busy
        seconds since the GPU's last measured sample, and the MIG GPUs whose instances'
        processes were read."""
        measured: set[str] = set()
        again: set[str] = set()
        mig: set[str] = set()
        raw: dict[_Pair, float] = {}
        if attribution is None:
            return frozenset(), frozenset(), raw, frozenset()
        read = attribution.devices
        units: dict[str, str] = {}  # process list label -> GPU label
        gpus = []
        for d in snapshot.devices:
            gpu = resolver.label(d)
            labels = [resolver.label(m) for m in d.mig_devices] or [gpu]
            if not d.up or d.stale or not all(label in read for label in labels):
                continue
            if d.mig_devices:
                mig.add(gpu)
            if d.process_busy_seconds is None:
                continue
            for label in labels:
                units[label] = gpu
            gpus.append((gpu, d))
        if not gpus:
            return frozenset(), frozenset(), raw, frozenset(mig)
        listed: dict[str, list[ProcessUsage]] = {}
        for p in attribution.processes:
            gpu = units.get(p.device_id)
            if gpu is not None:
                listed.setdefault(gpu, []).append(p)
        horizon = now - self._retention
        for gpu, d in gpus:
            if self._busy_read.get(gpu) is d:
                again.add(gpu)
                continue
            self._busy_read[gpu] = d
            measured.add(gpu)
            busy = d.process_busy_seconds
            seen = self._procs.get(gpu)
            if seen is None or self._procs_gen.get(gpu) != d.nvml_generation:
                seen = self._procs[gpu] = {}  # a new source generation counts every process from 0
                self._procs_gen[gpu] = d.nvml_generation
            by_pid = {key[0]: key for key in seen}
            counted = set()
            for p in listed.get(gpu, ()):
                counted.add(p.pid)
                self._count(seen, (p.pid, p.start_time), busy.get(p.pid), p.kernel_id, gpu, raw, now)
            # A process the counter names but the list no longer does (it ended between the
            # two reads) is charged to the kernel it last belonged to.
            for pid, value in busy.items():
                if pid not in counted and pid in by_pid:
                    key = by_pid[pid]
                    self._count(seen, key, value, seen[key].kernel_id, gpu, raw, now)
            for key in [key for key, s in seen.items() if s.at < horizon]:
                del seen[key]
        return frozenset(measured), frozenset(again), raw, frozenset(mig)

    @staticmethod
    def _count(seen: dict, key: tuple[int, int | None], value: float | None, kernel_id: str | None, gpu: str,
               raw: dict[_Pair, float], now: float) -> None:
        if value is None:  # listed, but no busy time yet: an idle process
            return
        last = seen.get(key)
        # A counter that went back belongs to a new process under a recycled key: all of it is new.
        delta = value - last.busy if last is not None and value >= last.busy else value
        seen[key] = _Seen(value, now, kernel_id)
        if kernel_id is not None and delta > 0:
            pair = (kernel_id, gpu)
            raw[pair] = raw.get(pair, 0.0) + delta

    def _rates(self, kernels: Collection[Kernel], snapshot: TelemetrySnapshot, resolver: DeviceResolver,
               capacity: CapacityConfig, measured: Mapping, env: Hashable) -> tuple:
        """Each kernel's shares and measured use, and the counters' rates from now on."""
        shares: dict[_Pair, float] = {}
        uses: dict[str, KernelUse] = {}
        active: list[_Pair] = []
        if env != self._held_env:
            self._held_env, self._held = env, {}
        held_now: dict[str, _HeldEntry] = {}
        unmeasured = KernelUse(None, None)
        memo: _AllocMemo = {}  # this pass only: what a pass reads of the devices is fixed
        for k in kernels:
            cached = self._held.get(k.kernel_id)
            if cached is None or cached[0] is not k:
                held = _held(k, snapshot, resolver, capacity, memo)
                cached = (k, held, tuple(gpu_shares(held).items()))
            held_now[k.kernel_id] = cached
            held, held_shares = cached[1], cached[2]
            if not held:
                continue
            if not measured or not any((k.kernel_id, h.alloc_device_id) in measured for h in held):
                # Nothing measured (no telemetry, MIG, no process yet): no ratios, shares only.
                uses[k.kernel_id] = unmeasured
                for gpu, share in held_shares:
                    key = (k.kernel_id, gpu)  # one key object for both maps (and the counters)
                    shares[key] = share
                continue
            utils, mems = [], []
            for h in held:
                u = measured.get((k.kernel_id, h.alloc_device_id))
                util = u.utilization_ratio if u is not None else None
                utils.append(util)
                if u is not None and u.processes:
                    active.append((k.kernel_id, h.gpu))
                used = u.memory_used_bytes if u is not None else None
                # A 0-1 ratio: a kernel over its share (plugins that do not cap memory) counts as
                # fully using it; the bytes themselves are gpu_alloc_kernel_memory_used_bytes.
                mems.append(min(1.0, used / h.memory_bytes) if used is not None and h.memory_bytes else None)
            uses[k.kernel_id] = KernelUse(_mean(utils), _mean(mems))
            for gpu, share in held_shares:
                key = (k.kernel_id, gpu)
                shares[key] = share
        self._held = held_now
        return shares, uses, held_now, active

    def _shift(self, changed: Mapping[str, Kernel | None], snapshot: TelemetrySnapshot, resolver: DeviceResolver,
               capacity: CapacityConfig, now: float) -> tuple[Mapping, Mapping] | None:
        """Take the changed kernels' new shares without a settle, for a pass that measures nothing
        (so the interval since the last pass is split by allocation, as the counters already
        read): O(changed kernels), whatever the number of kernels. The changed pairs' and their
        owners' counters are rebased so that they read, from now on, their value now plus their
        new split's growth (:func:`_rebased_driven`: never less than they read before, so no
        counter goes back by a rounding error); a GPU whose Σ shares moves changes its scale from
        now on (``_time_anchor``, ``_joule_anchor``), which re-rates every pair of an
        overcommitted GPU without touching them; the device counters take their new rates.
        ``since`` stays.

        Returns the shares and uses to publish, or None, with nothing changed, where a settle is
        needed: a GPU known only from allocations that comes or goes, or a kernel whose owner
        changed (a settle charges the busy time to the owner known now).
        """
        # The internal tables (held, owners) change in place once nothing can send the pass to a
        # settle; what results handed out read is copied once (a copy of 10,000 entries costs
        # ~1.5 ms where their objects are cold in the cache).
        held: dict[str, _HeldEntry | None] = {}  # kernel -> its entry now (None: it went)
        owners: dict[str, _Owner] = {}  # kernel -> its owner now, of the kernels present
        moved: dict[_Pair, float] = {}  # pair of a changed kernel -> its share now (0.0: it went)
        memo: _AllocMemo = {}
        for kid, kernel in changed.items():
            entry = self._held.get(kid)
            for gpu, _ in entry[2] if entry is not None else ():
                moved[(kid, gpu)] = 0.0
            held[kid] = None
            if kernel is None:
                continue
            owner = owners[kid] = _owner(kernel)
            if kid in self._owners and self._owners[kid] != owner:
                return None
            if entry is None or entry[0] is not kernel:
                parts = _held(kernel, snapshot, resolver, capacity, memo)
                entry = (kernel, parts, tuple(gpu_shares(parts).items()))
            held[kid] = entry
            for gpu, share in entry[2]:
                moved[(kid, gpu)] = share
        shares0 = self._shares
        moved = {key: share for key, share in moved.items() if shares0.get(key) != (share or None)}
        by_gpu, by_owner, counted = self._index or self._build_index()
        gpu_now = {gpu: dict(by_gpu.get(gpu, {})) for gpu in {key[1] for key in moved}}
        pair_owner = {key: owners.get(key[0]) or self._owners.get(key[0], _NO_OWNER) for key in moved}
        owner_now = {owner: dict(by_owner.get(owner, {})) for owner in set(pair_owner.values())}
        copied: set[tuple[_Owner, str]] = set()
        for key, share in moved.items():
            owner, gpu = pair_owner[key], key[1]
            if (owner, gpu) not in copied:
                owner_now[owner][gpu] = dict(owner_now[owner].get(gpu, {}))
                copied.add((owner, gpu))
            for pairs in (gpu_now[gpu], owner_now[owner][gpu]):
                if share:
                    pairs[key] = share
                else:
                    pairs.pop(key, None)
        if any(bool(pairs) != bool(by_gpu.get(gpu)) and gpu not in self._inventory_gpus for gpu, pairs in gpu_now.items()):
            return None  # a GPU known only from allocations came or went: the devices change
        # Committed from here on.
        seconds, drive, per_share = self._drives(now)
        energy_gpus = self._energy_read.keys()
        started = [key for key, share in moved.items() if share]
        fracs = {key: ((key[1], share),) if share else None for key, share in moved.items()}
        self._energy_base = _rebased_driven(self._energy_base, self._fracs, fracs, per_share,
                                            present=[key for key in started if key[1] in energy_gpus], keep_rates=True)[0]
        self._alloc_base, self._fracs = _rebased_driven(self._alloc_base, self._fracs, fracs, seconds, present=started)
        counted.update(key[0] for key in started)
        if len(self._log) >= _SHIFT_LOG:  # a renderer that far behind redoes its tables once
            self._log = []
        self._log.append(frozenset(moved))
        self._shares = shares = dict(shares0)
        for key, share in moved.items():
            if share:
                shares[key] = share
            else:
                shares.pop(key, None)
        # Each GPU whose Σ shares moved: its scale from now on, and its device counters' rates.
        scale, time_anchor, joule_anchor = dict(self._scale), dict(self._time_anchor), dict(self._joule_anchor)
        dev_new: dict[str, float | None] = {}
        for gpu, pairs in gpu_now.items():
            total = math.fsum(pairs.values())
            if pairs:
                time_anchor[gpu] = (now, seconds.get(gpu, 0.0))
                joule_anchor[gpu] = (drive.get(gpu, 0.0), per_share.get(gpu, 0.0))
                scale[gpu] = 1.0 / total if total > 1.0 else 1.0
            else:
                for d in (scale, time_anchor, joule_anchor):
                    d.pop(gpu, None)
            dev_new[gpu] = min(total, 1.0) if pairs else None
        self._scale, self._time_anchor, self._joule_anchor = scale, time_anchor, joule_anchor
        free_new = {gpu: max(0.0, 1.0 - (rate or 0.0)) for gpu, rate in dev_new.items() if gpu in self._devices}
        d = now - self._since  # as _Counters reads it
        self._dev_alloc_base, self._dev_alloc_rates = _rebased(self._dev_alloc_base, self._dev_alloc_rates, dev_new, d,
                                                               present=gpu_now)
        self._dev_free_base, self._dev_free_rates = _rebased(self._dev_free_base, self._dev_free_rates, free_new, d, present=())
        self._dev_energy_base, self._dev_energy_rates = _rebased_driven(
            self._dev_energy_base, self._dev_energy_rates, {g: ((g, r),) if r is not None else None for g, r in dev_new.items()},
            drive, present=())
        self._dev_unattr_base, self._dev_unattr_rates = _rebased_driven(
            self._dev_unattr_base, self._dev_unattr_rates, {g: ((g, r),) for g, r in free_new.items()}, drive, present=())
        # Each owner of a moved pair: its split by GPU from now on.
        own_new = {owner: tuple((gpu, math.fsum(per_gpu[gpu].values())) for gpu in sorted(per_gpu) if per_gpu[gpu]) or None
                   for owner, per_gpu in owner_now.items()}
        self._own_energy_base = _rebased_driven(
            self._own_energy_base, self._own_fracs, own_new, per_share,
            present=[o for o, split in own_new.items() if split and not energy_gpus.isdisjoint(g for g, _ in split)],
            keep_rates=True)[0]
        self._own_alloc_base, self._own_fracs = _rebased_driven(self._own_alloc_base, self._own_fracs, own_new, seconds,
                                                                present=[o for o, split in own_new.items() if split])
        by_gpu.update(gpu_now)
        by_owner.update(owner_now)
        for kid, entry in held.items():  # as a settle does: a kernel that went keeps its counters for the retention
            if entry is not None:
                self._held[kid] = entry
                self._owners[kid] = owners[kid]
                self._ended.pop(kid, None)
            else:
                self._held.pop(kid, None)
                self._owners.pop(kid, None)
                if kid in counted:
                    self._ended.setdefault(kid, now)
        uses = self._result.kernels.copy()
        unmeasured = KernelUse(None, None)
        for kid, entry in held.items():
            if entry is not None and entry[1]:
                uses[kid] = unmeasured
            else:
                uses.pop(kid, None)
        return MappingProxyType(shares), MappingProxyType(uses)  # never changed once handed out

    def _build_index(self) -> _Index:
        by_gpu: dict[str, dict[_Pair, float]] = {}
        by_owner: dict[_Owner, dict[str, dict[_Pair, float]]] = {}
        for key, share in self._shares.items():
            by_gpu.setdefault(key[1], {})[key] = share
            by_owner.setdefault(self._owners.get(key[0], _NO_OWNER), {}).setdefault(key[1], {})[key] = share
        self._index = (by_gpu, by_owner, {key[0] for key in self._alloc_base})
        return self._index

    def _use_weights(self, step: _Pass, dt: float, busy: Mapping[_Pair, float]) -> dict[str, dict[_Pair, float]]:
        """Per GPU whose energy of the interval that ends now is split by use, each kernel's
        fraction of it (``busy``: the busy GPU-seconds charged this pass). The other GPUs' energy
        is split by allocation, as their counters grew."""
        if self._split == "allocation" or dt <= 0:
            return {}
        before = self._use_before  # both ends of the interval must have measured use
        by_gpu: dict[str, dict[_Pair, float]] = {}
        for key, share in self._shares.items():
            gpu = key[1]
            if gpu in before and (gpu in step.busy_measured or gpu in step.mig):
                by_gpu.setdefault(gpu, {})[key] = share * self._scale.get(gpu, 1.0)
        out = {}
        for gpu, alloc in by_gpu.items():
            if gpu in step.busy_measured:
                activity = {key: busy.get(key, 0.0) for key in alloc}
            else:  # MIG, no per-process counter: the instances running a process
                activity = {key: rate if key in step.active else 0.0 for key, rate in alloc.items()}
            # By use: the allocated part of the energy follows each kernel's part of the activity
            # (none where nothing was active); the unallocated part stays unattributed.
            total, held = sum(activity.values()), sum(alloc.values())
            use = {key: held * a / total if total > 0 else 0.0 for key, a in activity.items()}
            weights = use if self._split == "use" else {key: max(rate, use[key]) for key, rate in alloc.items()}
            total = sum(weights.values())
            out[gpu] = {key: w / total for key, w in weights.items()} if total > 1.0 else weights
        return out

    def _settle(self, step: _Pass, shares: dict[_Pair, float], present: Mapping[str, object]) -> None:
        """Bring every counter to ``now`` as it grew (energy at this interval's split, busy time
        where measured), then take the new shares and scales (new dicts: results already handed
        out keep reading theirs)."""
        now = step.now
        dt = max(0.0, now - self._since) if self._settled else 0.0
        seconds, joules, per_share = self._drives(now)
        fracs, own_fracs = self._fracs, self._own_fracs
        alloc = {key: _driven_value(value, fracs.get(key, ()), seconds) for key, value in self._alloc_base.items()}
        dev_alloc = _grown(self._dev_alloc_base, self._dev_alloc_rates, dt)
        dev_free = _grown(self._dev_free_base, self._dev_free_rates, dt)
        own_alloc = {o: _driven_value(value, own_fracs.get(o, ()), seconds) for o, value in self._own_alloc_base.items()}
        # Busy time: the kernel's processes' busy seconds (at most the time since the GPU's last
        # measurement) × the share it held, i.e. at most the GPU-seconds it held since then.
        busy, dev_busy, own_busy = dict(self._busy), dict(self._dev_busy), dict(self._own_busy)
        mark = self._mark
        measured = step.busy_measured
        # The owner of a measured busy interval: as known now (an identity read late still claims
        # the busy time before it), else as known at its start (a kernel that ended). Allocated time
        # and energy grow between passes by the splits of the owners known at the interval's start
        # (what the counters read meanwhile), so they stay with those owners: a settle that moved
        # them would take back what an owner's counter already showed.
        now_owners, old_owners = step.owners, self._owners

        def owner_of(kernel_id: str) -> _Owner:
            return now_owners.get(kernel_id) or old_owners.get(kernel_id, _NO_OWNER)

        def start_owner_of(kernel_id: str) -> _Owner:
            return old_owners.get(kernel_id) or now_owners.get(kernel_id, _NO_OWNER)

        charged: dict[_Pair, float] = {}
        if measured:
            for key, value in step.raw_busy.items():
                if key in alloc and key[1] in measured:
                    rate = self._shares.get(key, 0.0) * self._scale.get(key[1], 1.0)
                    c = charged[key] = max(0.0, min(value * rate, alloc[key] - mark.get(key, 0.0)))
                    busy[key] = busy.get(key, 0.0) + c
                    dev_busy[key[1]] = dev_busy.get(key[1], 0.0) + c
                    owner = owner_of(key[0])
                    own_busy[owner] = own_busy.get(owner, 0.0) + c
            for key in alloc:
                if key[1] in measured:
                    mark[key] = alloc[key]
        energy, dev_energy = dict(self._energy_base), dict(self._dev_energy_base)
        dev_unattr, own_energy = dict(self._dev_unattr_base), dict(self._own_energy_base)
        by_use = self._use_weights(step, dt, charged)
        # Split by use where both ends of the interval measured it: each kernel's part of the
        # joules the GPU used.
        for gpu, weights in by_use.items():
            used_j, total = joules.get(gpu, 0.0), 0.0
            if used_j:
                for key, w in weights.items():
                    e = used_j * w
                    total += e
                    energy[key] = energy.get(key, 0.0) + e
                    owner = start_owner_of(key[0])
                    own_energy[owner] = own_energy.get(owner, 0.0) + e
            dev_energy[gpu] = dev_energy.get(gpu, 0.0) + total
            dev_unattr[gpu] = dev_unattr.get(gpu, 0.0) + max(0.0, used_j - total)
        # Elsewhere by allocation, as every counter grew meanwhile (by the very formulas they read,
        # whatever shifts re-split them within the interval).
        for key, value in self._energy_base.items():
            if key[1] not in by_use:
                energy[key] = _driven_value(value, fracs.get(key, ()), per_share)
        for owner, value in self._own_energy_base.items():
            split = tuple((g, f) for g, f in own_fracs.get(owner, ()) if g not in by_use)
            own_energy[owner] += _driven_value(value, split, per_share) - value
        for settled, base, splits in ((dev_energy, self._dev_energy_base, self._dev_energy_rates),
                                      (dev_unattr, self._dev_unattr_base, self._dev_unattr_rates)):
            for gpu, value in base.items():
                if gpu not in by_use:
                    settled[gpu] = _driven_value(value, splits.get(gpu, ()), joules)
        # Per owner and device these are sums of the pairs' parts, in another order than the
        # counters summed them while they grew: never below what they read (by a rounding error).
        shown_joules, shown_per_share = self._shown
        for settled, base, splits, drive in ((own_energy, self._own_energy_base, own_fracs, shown_per_share),
                                             (dev_energy, self._dev_energy_base, self._dev_energy_rates, shown_joules),
                                             (dev_unattr, self._dev_unattr_base, self._dev_unattr_rates, shown_joules)):
            for key, value in base.items():
                shown = _driven_value(value, splits.get(key, ()), drive)
                if settled[key] < shown:
                    settled[key] = shown
        # Counters of kernels that went away stay for the retention period, then go.
        for kid in {key[0] for key in alloc} - present.keys():
            if now - self._ended.setdefault(kid, now) > self._retention:
                self._ended[kid] = -1.0  # marks it for removal below
        for kid in [k for k in self._ended if k in present]:
            del self._ended[kid]
        gone = {k for k, t in self._ended.items() if t < 0}
        if gone:
            alloc, energy, busy = ({key: v for key, v in d.items() if key[0] not in gone} for d in (alloc, energy, busy))
            self._mark = mark = {key: v for key, v in mark.items() if key[0] not in gone}
            for kid in gone:
                del self._ended[kid]
        # Pairs and GPUs present now start their counters at 0, so the series exist from the
        # first pass; energy and busy only where measured (no sample where not, never 0).
        energy_gpus = self._energy_read.keys()
        for key in shares:
            alloc.setdefault(key, 0.0)
            if key[1] in energy_gpus:
                energy.setdefault(key, 0.0)
            if key[1] in measured:
                busy.setdefault(key, 0.0)
                mark.setdefault(key, 0.0)
        for gpu in step.devices:
            dev_alloc.setdefault(gpu, 0.0)
            dev_free.setdefault(gpu, 0.0)
            if gpu in energy_gpus:
                dev_energy.setdefault(gpu, 0.0)
                dev_unattr.setdefault(gpu, 0.0)
            if gpu in measured:
                dev_busy.setdefault(gpu, 0.0)
        # From now on: each pair grows by its share of its GPU's unit drive, each owner by its
        # shares per GPU, each GPU's allocated counter at min(Σ shares, 1). Sums by math.fsum,
        # exactly rounded: the same whatever the order of their terms, so a shift that sums one
        # GPU's or one owner's shares anew gets what a settle gets.
        per_gpu: dict[str, list[float]] = {}
        per_owner: dict[_Owner, dict[str, list[float]]] = {}
        new_fracs: dict[_Pair, _Split] = {}
        for key, share in shares.items():
            gpu, owner = key[1], step.owners.get(key[0], _NO_OWNER)
            per_gpu.setdefault(gpu, []).append(share)
            per_owner.setdefault(owner, {}).setdefault(gpu, []).append(share)
            new_fracs[key] = ((gpu, share),)
        totals = {gpu: math.fsum(values) for gpu, values in per_gpu.items()}
        dev_rates = {gpu: min(total, 1.0) for gpu, total in totals.items()}
        new_own = {owner: tuple((gpu, math.fsum(split[gpu])) for gpu in sorted(split)) for owner, split in per_owner.items()}
        for owner, split in new_own.items():
            own_alloc.setdefault(owner, 0.0)
            if not energy_gpus.isdisjoint(g for g, _ in split):
                own_energy.setdefault(owner, 0.0)
            if not measured.isdisjoint(g for g, _ in split):
                own_busy.setdefault(owner, 0.0)
        free_rates = {gpu: max(0.0, 1.0 - dev_rates.get(gpu, 0.0)) for gpu in step.devices}
        self._alloc_base, self._shares, self._fracs = alloc, shares, new_fracs
        self._scale = {gpu: 1.0 / total if total > 1.0 else 1.0 for gpu, total in totals.items()}
        self._time_anchor, self._joule_anchor = {}, {}
        self._dev_alloc_base, self._dev_alloc_rates = dev_alloc, dev_rates
        self._dev_free_base, self._dev_free_rates = dev_free, free_rates
        self._own_alloc_base, self._own_fracs = own_alloc, new_own
        self._energy_base = energy
        self._dev_energy_base, self._dev_energy_rates = dev_energy, {g: ((g, r),) for g, r in dev_rates.items()}
        self._dev_unattr_base, self._dev_unattr_rates = dev_unattr, {g: ((g, r),) for g, r in free_rates.items()}
        self._own_energy_base = own_energy
        self._busy, self._dev_busy, self._own_busy = busy, dev_busy, own_busy
        self._busy_view = MappingProxyType(busy)
        self._owners = step.owners
        self._use_before = measured | step.busy_again | step.mig
        self._joules_at_since = dict(self._joules)
        self._since, self._settled = now, True


def _rebased(base: dict, rates: dict, new: Mapping[Hashable, float | None], d: float,
             present: Iterable[Hashable]) -> tuple[dict, dict]:
    """Copies of a :class:`_Counters` family's ``base`` and ``rates`` in which each key of
    ``new`` grows at its new rate (None: none, and the rate is dropped) from what it reads now
    (``d``: now - since); keys of ``present`` that had no counter start one at 0."""
    base, rates = dict(base), dict(rates)
    for key in present:
        if key not in base:
            base[key] = 0.0 - rates.get(key, 0.0) * d
    for key, rate in new.items():
        old = rates.get(key, 0.0)
        if key in base and rate != old:
            now, step = base[key] + old * d, (rate or 0.0) * d
            base[key] = _raised(now - step, lambda value, step=step: value + step, now)
        if rate is None:
            rates.pop(key, None)
        else:
            rates[key] = rate
    return base, rates


def _raised(value: float, reads: Callable[[float], float], target: float) -> float:
    """``value``, raised until the counter it is the base of ``reads`` at least ``target`` (what it
    read before a rebase): rounding must never make a counter go back. Each step adds the
    deficit, at least one unit in the last place of either number, so a step or two do."""
    while (now := reads(value)) < target:
        value += max(target - now, math.ulp(target), math.ulp(value))
    return value


def _driven_value(base: float, split: _Split, drive: Mapping[str, float]) -> float:
    for gpu, fraction in split:  # as DrivenCounters._value sums, in the same order
        base += fraction * drive.get(gpu, 0.0)
    return base


def _rebased_driven(base: dict, rates: dict, new: Mapping[Hashable, _Split | None], drive: Mapping[str, float],
                    present: Iterable[Hashable], keep_rates: bool = False) -> tuple[dict, dict]:
    """:func:`_rebased` for a :class:`DrivenCounters` family: ``drive`` (GPU -> joules since ``since``, or
    per unit of share) in place of the time. ``keep_rates``: ``rates`` is not copied nor changed
    (another family that grows by the same splits takes the new ones)."""
    base, rates = dict(base), rates if keep_rates else dict(rates)
    for key in present:
        if key not in base:
            base[key] = 0.0 - (_driven_value(0.0, rates.get(key, ()), drive))
    for key, split in new.items():
        old = rates.get(key, ())
        if key in base and (split or ()) != old:
            now, grows = _driven_value(base[key], old, drive), split or ()
            base[key] = _raised(now - _driven_value(0.0, grows, drive),
                                lambda value, grows=grows: _driven_value(value, grows, drive), now)
        if keep_rates:
            continue
        if split is None:
            rates.pop(key, None)
        else:
            rates[key] = split
    return base, rates


def _grown(base: Mapping[Hashable, float], rates: Mapping[Hashable, float], dt: float) -> dict:
    return {key: value + rates.get(key, 0.0) * dt for key, value in base.items()}


def _owner(kernel: Kernel) -> _Owner:
    identity = kernel.identity
    return (identity.user_id, identity.project_id) if identity is not None else _NO_OWNER


def _mean(values: list[float | None]) -> float | None:
    if not values or any(v is None for v in values):
        return None
    return sum(values) / len(values)
