"""What each kernel holds of each physical GPU, how much of it it uses, and the chargeback
counters that integrate both over time.

Three results per analysis pass, all keyed by the **physical GPU** (a MIG slice counts against
the GPU it is carved from, so a GPU's health reaches every kernel on it, whatever it holds):

* the **share** of a GPU a kernel holds, 0–1: ``cuda.device`` = 1; ``cuda.shares`` = amount ÷
  the GPU's fractional capacity (:func:`~exporter.analysis.capacity.device_capacity`); a MIG
  slice = its SMs ÷ the GPU's SMs (its memory ÷ the GPU's memory where SMs are unknown);
* per kernel, **measured use normalised by what it holds**, averaged over its allocated devices
  (not summed, so a kernel on four GPUs at 30 % reads 0.3): SM utilisation from NVML's per-process
  samples, and GPU memory used ÷ memory held (the ``cuda.mem`` allocation where the plugin writes
  one, else the share × the device's memory). Where a device is not measured (MIG without
  per-process samples, a failed read, no telemetry) the kernel has **no value**, never 0;
* per kernel and GPU, **allocated share-seconds** and, while measured, **used share-seconds**
  (share × utilisation), integrated here at every analysis pass (every telemetry sample), not per
  scrape: counters are exact whatever the scrape interval, and reset only with the process. A
  pass integrates the shares the previous pass saw over the time since it, so an allocation
  change is counted from the next pass (an error of at most one telemetry interval per change).
  Counters of a kernel that went away stay for ``retention`` seconds, so the last increment is
  scraped (Backend.AI drops an ended kernel's series after 600 s as well).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from types import MappingProxyType

from exporter.analysis.attribution import AttributionResult
from exporter.analysis.capacity import CapacityConfig, GpuInventory, device_capacity, is_mig_slot
from exporter.scratch.allocation import Kernel
from exporter.scratch.resources import Allocation, SlotKind, slot_kind
from exporter.telemetry.devices import DeviceResolver
from exporter.telemetry.model import DeviceReading, MigDeviceReading, TelemetrySnapshot

__all__ = ["Accountant", "Accounting", "KernelUse", "gpu_shares"]

_NVML_PLUGIN = "cuda"
RETENTION_SECONDS = 600.0


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
    """One pass's immutable result.

    :param shares: (kernel_id, GPU device_id) -> share of the GPU held (0-1).
    :param kernels: kernel_id -> measured use normalised by allocation.
    :param allocated_seconds: (kernel_id, GPU device_id) -> share-seconds held since the exporter started.
    :param used_seconds: (kernel_id, GPU device_id) -> share-seconds used, for pairs measured at least once.
    """

    shares: Mapping[tuple[str, str], float] = field(default_factory=dict)
    kernels: Mapping[str, KernelUse] = field(default_factory=dict)
    allocated_seconds: Mapping[tuple[str, str], float] = field(default_factory=dict)
    used_seconds: Mapping[tuple[str, str], float] = field(default_factory=dict)


class _Counters(Mapping):
    """Counters that grow at constant rates between passes, read as of one time.

    Every counter is ``base + rate × (as_of - since)``: a pass whose rates are the last pass's
    (an idle node: the same kernels, nothing measured) publishes new counters in O(1), and the
    values are computed only when read (the exposition is rendered once per scrape, not per
    pass). ``base`` and ``rates`` are never changed once handed out.
    """

    __slots__ = ("_as_of", "_base", "_rates", "_since")

    def __init__(self, base: Mapping[tuple[str, str], float], rates: Mapping[tuple[str, str], float],
                 since: float, as_of: float) -> None:
        self._base, self._rates, self._since, self._as_of = base, rates, since, as_of

    def __getitem__(self, key: tuple[str, str]) -> float:
        return self._base[key] + self._rates.get(key, 0.0) * (self._as_of - self._since)

    def items(self):  # every value in one loop, not one method call per key (a render reads them all)
        dt, rates = self._as_of - self._since, self._rates
        return [(key, base + rates.get(key, 0.0) * dt) for key, base in self._base.items()]

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


# One kernel's cached holdings: its Kernel object, what it holds, and (GPU, share) pairs.
_HeldEntry = tuple[Kernel, tuple[_Held, ...], tuple[tuple[str, float], ...]]


class Accountant:
    """Keeps the chargeback counters; call :meth:`update` from the analysis thread only.

    The counters are integrated lazily: each holds its value at the last change of any rate
    (``since``) and grows at its rate from there (:class:`_Counters`). A pass over an unchanged
    node (same kernels, same inventory, nothing measured) changes no rate and costs O(1) instead
    of a walk over every kernel; a change settles every counter once, at the pass that sees it.

    :param monotonic: seconds, for the time between passes.
    :param retention: seconds an ended kernel's counters stay exported.
    """

    def __init__(self, monotonic: Callable[[], float] = time.monotonic, retention: float = RETENTION_SECONDS) -> None:
        self._monotonic = monotonic
        self._retention = retention
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
        # change: results already handed out keep theirs).
        self._since = 0.0
        self._alloc_base: dict[tuple[str, str], float] = {}
        self._used_base: dict[tuple[str, str], float] = {}
        self._alloc_rates: dict[tuple[str, str], float] = {}
        self._used_rates: dict[tuple[str, str], float] = {}
        self._ended: dict[str, float] = {}  # kernel_id -> monotonic time it went away

    def update(
        self,
        kernels: Collection[Kernel],
        snapshot: TelemetrySnapshot,
        resolver: DeviceResolver,
        capacity: CapacityConfig,
        attribution: AttributionResult | None,
        version: Hashable | None = None,
    ) -> Accounting:
        """One pass.

        :param version: identifies ``kernels`` (the allocation view's version); with the same
            version, inventory and no measurement as the last pass, the rates are known unchanged.
        """
        now = self._monotonic()
        measured = {(u.kernel_id, u.device_id): u for u in attribution.kernels if u.allocated} if attribution else {}
        env = (_inventory_key(snapshot), resolver.scheme, id(capacity))
        inputs = (version, env) if version is not None and not measured else None
        expiring = any(now - t > self._retention for t in self._ended.values())  # O(ended kernels)
        if inputs is not None and inputs == self._inputs and self._result is not None and not expiring:
            prev = self._result
            return Accounting(prev.shares, prev.kernels,
                              _Counters(self._alloc_base, self._alloc_rates, self._since, now),
                              _Counters(self._used_base, self._used_rates, self._since, now))
        self._inputs = inputs
        shares, uses, alloc_rates, used_rates, present = self._rates(kernels, snapshot, resolver, capacity, measured, env)
        self._settle(now, alloc_rates, used_rates, present)
        self._result = Accounting(
            shares=MappingProxyType(shares),
            kernels=MappingProxyType(uses),
            allocated_seconds=_Counters(self._alloc_base, self._alloc_rates, self._since, now),
            used_seconds=_Counters(self._used_base, self._used_rates, self._since, now),
        )
        return self._result

    def _rates(self, kernels: Collection[Kernel], snapshot: TelemetrySnapshot, resolver: DeviceResolver,
               capacity: CapacityConfig, measured: Mapping, env: Hashable) -> tuple:
        """Each kernel's shares and measured use, and the counters' rates from now on."""
        shares: dict[tuple[str, str], float] = {}
        uses: dict[str, KernelUse] = {}
        alloc_rates: dict[tuple[str, str], float] = {}
        used_rates: dict[tuple[str, str], float] = {}
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
                    shares[key] = alloc_rates[key] = share
                continue
            utils, mems = [], []
            per_gpu_util: dict[str, list[float | None]] = {}
            for h in held:
                u = measured.get((k.kernel_id, h.alloc_device_id))
                util = u.utilization_ratio if u is not None else None
                utils.append(util)
                per_gpu_util.setdefault(h.gpu, []).append(util)
                used = u.memory_used_bytes if u is not None else None
                # A 0-1 ratio: a kernel over its share (plugins that do not cap memory) counts as
                # fully using it; the bytes themselves are gpu_alloc_kernel_memory_used_bytes.
                mems.append(min(1.0, used / h.memory_bytes) if used is not None and h.memory_bytes else None)
            uses[k.kernel_id] = KernelUse(_mean(utils), _mean(mems))
            for gpu, share in held_shares:
                key = (k.kernel_id, gpu)
                shares[key] = alloc_rates[key] = share
                util = _mean(per_gpu_util[gpu])
                if util is not None:
                    used_rates[key] = share * util
        self._held = held_now
        return shares, uses, alloc_rates, used_rates, held_now

    def _settle(self, now: float, alloc_rates: dict, used_rates: dict, present: Mapping[str, object]) -> None:
        """Bring every counter to ``now`` at the old rates, then take the new ones (new dicts:
        results already handed out keep reading theirs)."""
        dt = max(0.0, now - self._since) if self._alloc_base or self._used_base else 0.0
        alloc = {key: value + self._alloc_rates.get(key, 0.0) * dt for key, value in self._alloc_base.items()}
        used = {key: value + self._used_rates.get(key, 0.0) * dt for key, value in self._used_base.items()}
        # Counters of kernels that went away stay for the retention period, then go.
        for kid in {key[0] for key in alloc} - present.keys():
            if now - self._ended.setdefault(kid, now) > self._retention:
                self._ended[kid] = -1.0  # marks it for removal below
        for kid in [k for k in self._ended if k in present]:
            del self._ended[kid]
        gone = {k for k, t in self._ended.items() if t < 0}
        if gone:
            alloc = {key: v for key, v in alloc.items() if key[0] not in gone}
            used = {key: v for key, v in used.items() if key[0] not in gone}
            for kid in gone:
                del self._ended[kid]
        # Pairs present now start their counters at 0, so the series exists from the first pass.
        for key in alloc_rates:
            alloc.setdefault(key, 0.0)
        for key in used_rates:
            used.setdefault(key, 0.0)
        self._alloc_base, self._used_base = alloc, used
        self._alloc_rates, self._used_rates = alloc_rates, used_rates
        self._since = now


def _mean(values: list[float | None]) -> float | None:
    if not values or any(v is None for v in values):
        return None
    return sum(values) / len(values)
