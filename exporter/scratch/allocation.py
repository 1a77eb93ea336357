"""The allocation model: kernels × devices × slots, published as immutable snapshots.

No I/O happens here. Whoever reads the scratch tree (the scanner and the watcher) hands each
kernel's parse outcome to an :class:`AllocationBook`; readers (the collector, the JSON API) take an
:class:`AllocationView`, a frozen snapshot that a later change never touches, so a scrape never
sees a half-applied update.

Device totals are kept incrementally with exact ``Decimal`` arithmetic (no float drift), so an
update costs O(allocations of one kernel), not O(all kernels): that keeps event-to-metric latency
flat at 10,000 kernels.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from enum import Enum
from functools import lru_cache
from types import MappingProxyType

import immutables

from exporter.scratch.identity import Identity
from exporter.scratch.resources import Allocation, Pending, ResourceParseError, ResourceSpec

__all__ = [
    "ALLOC_MAP_FORMATS",
    "FGPU_SLOTS",
    "RATIO_PLACES",
    "AllocationBook",
    "AllocationView",
    "Kernel",
    "KernelState",
    "Outcome",
    "absolute_alloc_map",
    "is_accelerator_slot",
    "ratio_alloc_map",
]

# Backend.AI's scan_gpu_alloc_map adds these two slots into one number per device id.
FGPU_SLOTS = ("cuda.shares", "cuda.device")
# The two meanings of gpu_alloc_map: before 26.4.8 the absolute sum of FGPU_SLOTS; from 26.4.8 /
# 26.8.x on (lablup/backend.ai#14327) a 0-1 ratio of every cuda.* slot to its capacity.
ALLOC_MAP_FORMATS = ("absolute", "ratio")
RATIO_PLACES = Decimal("0.0001")  # the ratio form's quantum ("0.2500")
_ZERO = Decimal(0)

log = logging.getLogger(__name__)

Outcome = ResourceSpec | Pending | ResourceParseError
"""What reading one kernel's resource.txt gave."""


def is_accelerator_slot(slot: str) -> bool:
    """Accelerator slots are ``<plugin>.<kind>`` (``cuda.shares``, ``rocm.device``, MIG slots);
    the agent's intrinsic slots (``cpu``, ``mem``) have no dot."""
    return "." in slot


def absolute_alloc_map(allocations: Iterable[Allocation]) -> dict[str, str]:
    """``gpu_alloc_map`` as agents before 26.4.8 answer it: per device id, the exact sum of its
    ``cuda.shares`` and ``cuda.device`` amounts, as ``str(Decimal)`` (``"0.60"``, ``"1"``).

    Decimal addition is exact and keeps the smallest exponent, so the order of the terms (the
    agent's completion order) cannot change the string.
    """
    totals: dict[str, Decimal] = {}
    for a in allocations:
        if a.slot in FGPU_SLOTS:
            totals[a.device_id] = totals.get(a.device_id, Decimal(0)) + a.amount
    return {d: str(v) for d, v in sorted(totals.items())}


def ratio_alloc_map(
    allocations: Iterable[Allocation], capacities: Mapping[tuple[str, str], Decimal]
) -> dict[str, str]:
    """``gpu_alloc_map`` as agents from 26.4.8 / 26.8.x on answer it (lablup/backend.ai#14327;
    26.9.6 ``scan_gpu_alloc_map``).

    Per device id: the sum over every slot of the ``cuda`` device (``cuda.shares``,
    ``cuda.device``, MIG slots, ``cuda.mem``) of the amount divided by the capacity registered
    for that (slot, device), or the raw amount where none is registered or it is not positive;
    quantized to 4 places (``"0.2500"``; ROUND_HALF_EVEN, Decimal's default, as
    ``Decimal.quantize`` in the agent). The agent logs a warning for every raw addition on every
    scan; this logs each (slot, device) once (:func:`_raw_amount_added`).

    :param capacities: (slot, device id) → the capacity the plugin registers, in the slot's unit.
    """
    totals: dict[str, Decimal] = {}
    for a in allocations:
        if a.slot.split(".", 1)[0] != "cuda":
            continue
        capacity = capacities.get((a.slot, a.device_id))
        if capacity is not None and capacity > 0:
            share = a.amount / capacity
        else:
            share = a.amount
            _raw_amount_added(a.slot, a.device_id, capacity)
        totals[a.device_id] = totals.get(a.device_id, Decimal(0)) + share
    return {d: str(v.quantize(RATIO_PLACES)) for d, v in sorted(totals.items())}


# (slot, device id) pairs already logged as added raw; bounded so that a tree of ever-new device
# ids cannot grow it without end (past the bound, nothing more is logged).
_RAW_LOGGED: set[tuple[str, str]] = set()
_RAW_LOGGED_LIMIT = 4096
_raw_lock = threading.Lock()


def _raw_amount_added(slot: str, device_id: str, capacity: Decimal | None) -> None:
    with _raw_lock:
        if (slot, device_id) in _RAW_LOGGED or len(_RAW_LOGGED) >= _RAW_LOGGED_LIMIT:
            return
        _RAW_LOGGED.add((slot, device_id))
    why = "no capacity is registered" if capacity is None else f"its registered capacity is {capacity}"
    log.warning(
        "ratio alloc map: %s on device %s is added as its raw amount, as the agent does: %s for it",
        slot, device_id, why,
    )


class KernelState(str, Enum):
    OK = "ok"  # resource.txt parsed
    PENDING = "pending"  # the agent is still writing resource.txt
    INVALID = "invalid"  # resource.txt is malformed; the last good allocation is kept


@dataclass(frozen=True, slots=True, weakref_slot=True)
class Kernel:
    """One kernel's scratch directory as last seen (weakly referable: renderers that keep what
    they last encoded must not keep ended kernels alive)."""

    kernel_id: str
    scratch_root: str
    state: KernelState
    spec: ResourceSpec | None  # the last good spec; kept while pending or invalid
    reason: str | None  # why pending or invalid
    since: float  # unix time the kernel entered this state
    # Session, owner and agent from recovery.json (or Docker labels); None until one was read.
    identity: Identity | None = None

    @property
    def allocations(self) -> tuple[Allocation, ...]:
        return self.spec.allocations if self.spec else ()

    @property
    def container_id(self) -> str | None:
        return self.spec.container_id if self.spec else None


@dataclass(frozen=True)
class AllocationView:
    """An immutable snapshot of the whole book."""

    version: int
    kernels: Mapping[str, Kernel]
    # (device_id, slot) -> amount summed over kernels; only accelerator slots are per device.
    device_totals: Mapping[tuple[str, str], Decimal]
    # slot -> amount summed over kernels, for the intrinsic slots (cpu, mem).
    node_totals: Mapping[str, Decimal]
    state_counts: Mapping[KernelState, int]
    parse_errors_total: int
    created_at: float = field(compare=False)

    # Backend.AI's ``gpu_alloc_map``: per device id, ``cuda.shares`` + ``cuda.device``, as
    # ``str(Decimal)`` exactly as the agent's RPC returns it (devices with no entry are absent).
    alloc_map: Mapping[str, str]
    # kernel id -> why the agent's own reader rejects its file (ResourceSpec.agent_unreadable);
    # nearly always empty, and kept as kernels change so that no reader walks every kernel for it.
    agent_unreadable: Mapping[str, tuple[str, ...]]
    # The book's recent changes, (version, kernel id) in version order, complete for every version
    # after ``changes_from`` (None: no record, as for a view built by hand). See changed_since.
    changes: tuple[tuple[int, str], ...] = field(default=(), compare=False, repr=False)
    changes_from: int | None = field(default=None, compare=False)

    def changed_since(self, version: int) -> frozenset[str] | None:
        """The ids of the kernels that changed (came, went, or were replaced) after ``version`` up to
        this view's; None where that is not known (``version`` older than the book's record, or
        not one of this book's). What lets a reader of 10,000 kernels redo only the few that changed."""
        if version == self.version:
            return frozenset()
        if self.changes_from is None or not self.changes_from <= version < self.version:
            return None
        start = bisect_right(self.changes, version, key=_entry_version)
        return frozenset(kernel_id for _, kernel_id in self.changes[start:])

    def device_ids(self) -> frozenset[str]:
        return frozenset(d for d, _ in self.device_totals)

    def alloc_map_ratio(self, capacities: Mapping[tuple[str, str], Decimal]) -> dict[str, str]:
        """The #14327 form of :attr:`alloc_map` over every kernel (see :func:`ratio_alloc_map`)."""
        # Division distributes over the per-kernel sum, so the running totals give the same ratios.
        return ratio_alloc_map(
            (Allocation(slot, device_id, amount) for (device_id, slot), amount in self.device_totals.items()),
            capacities,
        )


def _entry_version(entry: tuple[int, str]) -> int:
    return entry[0]


# Changes the book keeps for AllocationView.changed_since: a few seconds of a busy node's churn.
# Past it the oldest versions go whole, and a reader that far behind walks every kernel.
_CHANGES_KEPT = 2048


@lru_cache(maxsize=1024)
def _exponent(amount: str) -> int:
    """The exponent of ``Decimal(amount)``. ``Decimal.as_tuple()`` builds its named tuple in Python
    code; a node's amounts are few, and ``str()`` spells one exactly, exponent included."""
    return Decimal(amount).as_tuple().exponent


class _Totals:
    """Exact running sums, keyed, that drop a key with its last contributor.

    ``Decimal`` keeps trailing zeros: a fresh ``0 + 1 + 0.50`` prints ``1.50`` and, after the
    ``0.50`` leaves, a fresh sum prints ``1`` where a running ``1.50 - 0.50`` prints ``1.00``. To
    print what the agent would, each key also counts its contributors' exponents, and
    :meth:`exponent` gives the one a fresh sum would have.
    """

    def __init__(self) -> None:
        self.sums: dict = {}
        self._exps: dict = {}  # key -> {exponent: number of contributions}

    def add(self, key, amount: Decimal, sign: int) -> None:
        """Add (``sign`` +1) or take away (-1) one contribution."""
        exps = self._exps.get(key)
        if exps is None:
            exps = self._exps[key] = {}
        e = _exponent(str(amount))
        left = exps.get(e, 0) + sign
        if left:
            exps[e] = left
        else:
            del exps[e]
            if not exps:
                del self._exps[key]
                del self.sums[key]
                return
        total = self.sums.get(key, _ZERO)
        self.sums[key] = total + amount if sign > 0 else total - amount

    def exponent(self, key) -> int:
        """The exponent of ``Decimal(0) + <current contributions>``."""
        return min(0, *self._exps.get(key, {0: 1}))


class KernelTable(Mapping[str, "Kernel"]):
    """The book's kernels as a persistent map (a hash array mapped trie, :mod:`immutables`): a
    change makes a new table sharing all but one path with the last, so a view hands the table
    out as it is. A dict would be copied whole for every view after a change (~0.5 ms at 10,000
    kernels, on every change's path). Reads, iteration and equality are a ``Mapping``'s; the
    order of iteration is not the order of insertion."""

    __slots__ = ("_keys", "_map")

    def __init__(self, table: immutables.Map | None = None) -> None:
        self._map = immutables.Map() if table is None else table
        self._keys: frozenset[str] | None = None

    def set(self, kernel_id: str, kernel: Kernel) -> KernelTable:
        return KernelTable(self._map.set(kernel_id, kernel))

    def delete(self, kernel_id: str) -> KernelTable:
        return KernelTable(self._map.delete(kernel_id))

    def __getitem__(self, kernel_id: str) -> Kernel:
        return self._map[kernel_id]

    def get(self, kernel_id: str, default=None):
        return self._map.get(kernel_id, default)

    def __contains__(self, kernel_id: object) -> bool:
        return kernel_id in self._map

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)

    def keys(self) -> frozenset[str]:  # the table never changes: its key set, built once, in C
        if self._keys is None:
            self._keys = frozenset(self._map)
        return self._keys

    def items(self):  # the trie's own views: iterated in C
        return self._map.items()

    def values(self):
        return self._map.values()

    def __repr__(self) -> str:
        return f"KernelTable({dict(self._map.items())!r})"


class AllocationBook:
    """The mutable, thread-safe model behind the views.

    :param clock: returns unix time in seconds; injected so tests are deterministic.
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._kernels = KernelTable()
        self._device = _Totals()
        self._node = _Totals()
        # Kept as kernels change, so that a view costs copies of these small tables, not a pass over every kernel.
        self._states = dict.fromkeys(KernelState, 0)
        self._unreadable: dict[str, tuple[str, ...]] = {}
        self._version = 0
        self._changes: list[tuple[int, str]] = []  # (version, kernel id), for AllocationView.changed_since
        self._changes_from = 0  # every change after this version is in _changes
        self._errors_total = 0
        self._view: AllocationView | None = None
        self._known: dict[str, tuple[int, frozenset[str]]] = {}  # root -> (version, its kernel ids)
        self._listeners: tuple[Callable[[], None], ...] = ()

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` after every change (under the book's lock: it must be quick and
        must not read the book, e.g. an event's ``set``)."""
        self._listeners += (listener,)

    @property
    def version(self) -> int:
        return self._version

    def apply(self, kernel_id: str, scratch_root: str, outcome: Outcome, identity: Identity | None = None) -> Kernel | None:
        """Record the outcome of reading one kernel's file.

        :param identity: who the kernel belongs to, read with it: a kernel new to the book enters
            with its owner in one version, so no pass sees it without one.
        :returns: the new :class:`Kernel` if its state, reason or allocation changed, else None
            (so callers log a bad file once, not on every rescan).
        """
        changed = self.apply_many(scratch_root, ((kernel_id, outcome, identity),))
        return changed[0] if changed else None

    def apply_many(self, scratch_root: str, entries: Iterable[tuple[str, Outcome, Identity | None]]) -> list[Kernel]:
        """Record the outcomes of reading many kernels' files, ``(kernel id, outcome, identity)``
        each, as one change: one version and one notification (a forced scan lands a batch at a
        time, not a version per kernel). Returns the kernels that changed, as :meth:`apply` does."""
        with self._lock:
            changed = [
                new for kernel_id, outcome, identity in entries if (new := self._record(kernel_id, scratch_root, outcome, identity)) is not None
            ]
            if changed:
                self._changed()
            return changed

    def _record(self, kernel_id: str, scratch_root: str, outcome: Outcome, identity: Identity | None) -> Kernel | None:
        # Caller holds the lock; the caller announces the change.
        old = self._kernels.get(kernel_id)
        spec = old.spec if old else None
        if isinstance(outcome, ResourceSpec):
            state, reason, spec = KernelState.OK, None, outcome
        elif isinstance(outcome, Pending):
            state, reason = KernelState.PENDING, outcome.reason
        else:
            state, reason = KernelState.INVALID, str(outcome)
            self._errors_total += 1
        if identity is None and old is not None:
            identity = old.identity
        if old and (old.state, old.reason, old.spec, old.scratch_root, old.identity) == (state, reason, spec, scratch_root, identity):
            return None
        since = old.since if old and old.state is state else self._clock()
        new = Kernel(kernel_id, scratch_root, state, spec, reason, since, identity)
        self._put(old, new)
        return new

    def set_identity(self, kernel_id: str, identity: Identity) -> Kernel | None:
        """Record who a known kernel belongs to.

        :returns: the new :class:`Kernel` if the identity changed, else None. An unchanged
            identity keeps the same object and version: the agent rewrites every kernel's
            recovery.json on each kernel start and stop, and a rewrite that says the same must
            cost no re-rendering (per-kernel text is cached by object).
        """
        with self._lock:
            old = self._kernels.get(kernel_id)
            if old is None or old.identity == identity:
                return None
            new = dataclasses.replace(old, identity=identity)
            self._kernels = self._kernels.set(kernel_id, new)  # allocations unchanged: no totals to move
            self._changes.append((self._version + 1, kernel_id))
            self._changed()
            return new

    def remove(self, kernel_id: str) -> bool:
        """Forget a kernel whose directory is gone. Returns whether it was known."""
        return self.remove_many((kernel_id,)) == 1

    def remove_many(self, kernel_ids: Iterable[str]) -> int:
        """Forget kernels whose directories are gone, as one change: one version and one
        notification for all of them (a node's kernels deleted at once cost one analysis pass,
        not one each). Returns how many were known."""
        with self._lock:
            removed = 0
            for kernel_id in kernel_ids:
                old = self._kernels.get(kernel_id)
                if old is not None:
                    self._put(old, None)
                    removed += 1
            if removed:
                self._changed()
            return removed

    def holds(self, kernel_id: str, scratch_root: str) -> bool:
        """Whether ``kernel_id`` is recorded under ``scratch_root`` (O(1), unlike :meth:`known`)."""
        with self._lock:
            kernel = self._kernels.get(kernel_id)
            return kernel is not None and kernel.scratch_root == scratch_root

    def known(self, scratch_root: str) -> frozenset[str]:
        """Kernel ids currently recorded under one scratch root (kept until the book changes: each
        safety-net rescan asks twice per root, and an idle book's answer does not change)."""
        with self._lock:
            kept = self._known.get(scratch_root)
            if kept is None or kept[0] != self._version:
                kept = self._known[scratch_root] = (
                    self._version, frozenset(k for k, v in self._kernels.items() if v.scratch_root == scratch_root))
            return kept[1]

    def view(self) -> AllocationView:
        """The current snapshot; cheap when nothing changed since the last call."""
        with self._lock:
            if self._view is None or self._view.version != self._version:
                self._view = AllocationView(
                    version=self._version,
                    kernels=self._kernels,
                    device_totals=MappingProxyType(dict(self._device.sums)),
                    alloc_map=MappingProxyType(self._alloc_map()),
                    node_totals=MappingProxyType(dict(self._node.sums)),
                    state_counts=MappingProxyType(dict(self._states)),
                    agent_unreadable=MappingProxyType(dict(self._unreadable)),
                    parse_errors_total=self._errors_total,
                    created_at=self._clock(),
                    changes=tuple(self._changes),
                    changes_from=self._changes_from,
                )
            return self._view

    def _alloc_map(self) -> dict[str, str]:
        # O(devices), from the running totals; see _Totals for why exponents matter.
        per_device: dict[str, list] = {}
        for (device_id, slot), amount in self._device.sums.items():
            if slot in FGPU_SLOTS:
                acc = per_device.setdefault(device_id, [Decimal(0), 0])
                acc[0] += amount
                acc[1] = min(acc[1], self._device.exponent((device_id, slot)))
        return {d: str(total.quantize(Decimal(1).scaleb(exp))) for d, (total, exp) in sorted(per_device.items())}

    def _put(self, old: Kernel | None, new: Kernel | None) -> None:
        # Caller holds the lock; the caller announces the change.
        self._changes.append((self._version + 1, (old or new).kernel_id))
        if old is not None:
            self._count(old.allocations, -1)
            self._states[old.state] -= 1
            self._unreadable.pop(old.kernel_id, None)
        if new is not None:
            self._count(new.allocations, +1)
            self._states[new.state] += 1
            self._kernels = self._kernels.set(new.kernel_id, new)
            if new.spec is not None and new.spec.agent_unreadable:
                self._unreadable[new.kernel_id] = tuple(new.spec.agent_unreadable)
        elif old is not None:
            self._kernels = self._kernels.delete(old.kernel_id)

    def _changed(self) -> None:
        # Caller holds the lock.
        self._version += 1
        changes = self._changes
        if len(changes) > _CHANGES_KEPT:
            # Whole versions go, oldest first: a version is either recorded in full or not at all.
            cut = changes[len(changes) - _CHANGES_KEPT][0]
            start = bisect_right(changes, cut, key=_entry_version)
            del changes[:start]
            self._changes_from = cut
        for listener in self._listeners:
            listener()

    def _count(self, allocations: Iterable[Allocation], sign: int) -> None:
        for a in allocations:
            if is_accelerator_slot(a.slot):
                self._device.add((a.device_id, a.slot), a.amount, sign)
            else:
                self._node.add(a.slot, a.amount, sign)
