"""The allocators: where would a request land on this node, under which policy?

Pure functions over :class:`DeviceFree` rows, exact ``Decimal`` amounts in the slot's unit. The
order of the rows matters: it is the order the agent enumerates devices in. :func:`place` returns
a :class:`Placement` ``{device_id: amount}`` or a :class:`Rejection` with a reason; nothing is
mutated.

Backend.AI rules (``src/ai/backend/agent/alloc_map.py``): a fractional request only considers
devices with at least ``MIN_FREE`` (0.01) free, computes in hundredths, and finally rounds every
per-device amount down to the plugin's quantum, so a kernel can receive less than it asked. With
fragmentation disallowed, ``ensure_slot_not_fragmented`` (:func:`nofrag_rejection`) runs first.

The agent always allocates with an affinity hint (``resources.allocate()``), so the devices reach
the allocator grouped by NUMA node (:func:`numa_chain`): one list per node, each sorted by free
space, the least-allocated node first, chained or interleaved by ``[resource] affinity-policy``.
Which allocator then runs depends on the agent's release (:class:`NoFragRule`).

Policies:

``evenly`` / ``evenly-nofrag``
    Backend.AI's ``FractionAllocMap`` EVENLY strategy, reproduced step by step (fragmentation
    allowed, or guarded); whole-device and MIG slots follow ``DiscretePropertyAllocMap`` EVENLY.
``simple`` / ``besteffort``
    NVIDIA go-gpuallocator: the first devices in order, or the set with the best link score
    (NVLink, PCIe distance) over the best partition of all devices; without link information
    ``besteffort`` falls back to ``simple``.
``compact-first`` / ``low-load-first``
    NexusGPU tensor-fusion: devices with the most, or the least, allocated share of their capacity
    first.

Those four place whole devices upstream. Here a fractional request becomes equal parts (as
equal as the quantum allows) on the fewest devices that can each hold the largest part; the
policy only decides which devices.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from decimal import ROUND_DOWN, Decimal
from enum import Enum
from operator import itemgetter
from typing import TypeVar

from exporter.analysis.capacity import is_device_slot, is_fractional_slot, is_mig_slot

__all__ = [
    "DEFAULT_AFFINITY",
    "DEFAULT_RULE",
    "MIN_FREE",
    "P2P_SCORES",
    "AffinityPolicy",
    "DeviceFree",
    "Links",
    "NoFragRule",
    "Placement",
    "Policy",
    "Rejection",
    "Request",
    "apply_placement",
    "evenly",
    "link_score",
    "nofrag_rejection",
    "numa_chain",
    "numa_clusters",
    "place",
    "round_down",
]

_DIGITS = Decimal("0.01")  # FractionAllocMap.digits: the agent computes in hundredths
_ONE = Decimal(1)
_ZERO = Decimal(0)
MIN_FREE = Decimal("0.01")  # FractionAllocMap.allocate(min_memory=...) default
T = TypeVar("T")


def round_down(value: Decimal, quantum: Decimal) -> Decimal:
    """``value`` rounded down to a multiple of ``quantum``, as upstream's ``round_down`` does."""
    remainder = value.remainder_near(quantum)
    if remainder < 0:
        remainder += quantum
    return value - remainder


@dataclass(frozen=True, slots=True)
class DeviceFree:
    """One device of one slot: capacity and the sum of what kernels hold on it (slot units).

    :param numa_node: the device's NUMA node (the plugin's ``numa_node``, NVML
        ``nvmlDeviceGetNumaNodeId``), or None when unknown; devices with the same value form one
        of the agent's device clusters, unknown ones included.
    """

    device_id: str
    capacity: Decimal
    allocated: Decimal
    numa_node: int | None = None

    @property
    def free(self) -> Decimal:
        """Capacity minus allocated; negative when overcommitted."""
        return self.capacity - self.allocated

    @property
    def overcommitted(self) -> bool:
        """More is allocated than the device holds (multi-agent ``shared`` mode, wrong capacity)."""
        return self.allocated > self.capacity


class NoFragRule(str, Enum):
    """Which release of the agent's ``FractionAllocMap`` to follow: its fragmentation guard
    (``ensure_slot_not_fragmented``) and its EVENLY allocator.

    ``before-26.4``: the guard wants the request on the first device of the NUMA chain; EVENLY
    walks the chain as it comes. ``26.4`` (#10477; 26.4.0 to 26.8.x, and the 25.15 / 26.2 / 26.3
    backports): the guard takes its capacity ``C`` from the chain's first device and accepts
    equal quantized parts over ``n >= ceil(R/C)`` devices; EVENLY as before, which can hand a
    device more than it has free when the chain is not in free order. ``26.9``: the same guard;
    EVENLY sorts the devices by free space, tries one candidate per NUMA node plus one over all
    devices, prefers the NUMA-local one on ties, and never overfills a device.
    """

    SINGLE_DEVICE = "before-26.4"
    MULTI_DEVICE = "26.4"
    NUMA_CANDIDATES = "26.9"


DEFAULT_RULE = NoFragRule.NUMA_CANDIDATES


class AffinityPolicy(str, Enum):
    """The agent's ``[resource] affinity-policy``: how the NUMA nodes' device lists are joined for
    a kernel's first accelerator slot (``AffinityMap``/``get_current_allocations``)."""

    INTERLEAVED = "INTERLEAVED"  # round robin over the nodes (the agent's default since 25.12)
    PREFER_SINGLE_NODE = "PREFER_SINGLE_NODE"  # one node after the other


DEFAULT_AFFINITY = AffinityPolicy.INTERLEAVED


def _by_free(devices: Iterable[DeviceFree]) -> list[DeviceFree]:
    # Stable, as upstream's sorted(..., reverse=True): equal frees keep their incoming order.
    return sorted(devices, key=lambda d: d.free, reverse=True)


def numa_clusters(devices: Sequence[DeviceFree]) -> list[list[DeviceFree]]:
    """The agent's device clusters for a slot's first allocation: one per NUMA node, the
    least-allocated node first, each sorted by free space (``_get_device_clusters``).

    ``AffinityMap`` joins devices of equal ``numa_node`` (weight 0) into connected components in
    the order their first device is enumerated; they are ordered larger first, then (stably) by
    the sum of what is allocated on them.
    """
    groups: dict[int | None, list[DeviceFree]] = {}
    for d in devices:
        groups.setdefault(d.numa_node, []).append(d)
    clusters = sorted(groups.values(), key=lambda group: -len(group))
    clusters.sort(key=lambda group: sum((d.allocated for d in group), _ZERO))
    return [_by_free(group) for group in clusters]


def _join(clusters: Sequence[Sequence[T]], affinity: AffinityPolicy) -> list[T]:
    if affinity is AffinityPolicy.PREFER_SINGLE_NODE:
        return [d for cluster in clusters for d in cluster]
    # more_itertools.interleave_longest: one from each node in turn, skipping exhausted ones.
    return [d for row in itertools.zip_longest(*clusters) for d in row if d is not None]


def numa_chain(devices: Sequence[DeviceFree], affinity: AffinityPolicy = DEFAULT_AFFINITY) -> list[DeviceFree]:
    """The order the agent hands a slot's devices to its allocator (``get_current_allocations``
    with the hint ``resources.allocate()`` always passes): :func:`numa_clusters` chained or
    interleaved. On a node with one NUMA node (or none known) it is simply by free space."""
    return _join(numa_clusters(devices), affinity)


def nofrag_rejection(
    devices: Sequence[DeviceFree],
    request: Decimal,
    quantum: Decimal,
    rule: NoFragRule = DEFAULT_RULE,
    affinity: AffinityPolicy = DEFAULT_AFFINITY,
) -> str | None:
    """Why ``ensure_slot_not_fragmented`` rejects ``request``, or None when it lets it through.

    It looks at every device in :func:`numa_chain` order. ``before-26.4``: the chain's first
    device must hold the request. ``26.4`` and ``26.9``, with ``C`` the capacity of the chain's
    first device (upstream assumes "a single node with homogeneous devices"): for ``n`` from
    ``ceil(R/C)`` (only ``n = 1`` when ``R <= C``) up to the device count, every part is
    ``D = round_down(R/n, q)`` and ``ceil((R - D*n)/q)`` of them ``D + q``; accepted as soon as
    enough devices have that much free.
    """
    chain = numa_chain(devices, affinity)
    if not chain:
        return "no devices"
    first = chain[0]
    if rule is NoFragRule.SINGLE_DEVICE:
        if first.free >= request:
            return None
        return f"{request} does not fit on the first device the agent tries ({first.device_id}, {first.free} free)"
    capacity = first.capacity
    if capacity <= 0:
        return "no capacity"
    frees = [d.free for d in chain]
    smallest = math.ceil(request / capacity)
    largest = smallest if request <= capacity else len(frees)
    need = request
    for n in range(smallest, largest + 1):
        part = round_down(request / Decimal(n), quantum)
        shortfall = request - part * n
        bigger = math.ceil(shortfall / quantum) if shortfall > 0 else 0
        high = sum(f >= part + quantum for f in frees)
        low = sum(part <= f < part + quantum for f in frees)
        if high >= bigger and high + low >= n:
            return None
        need = part + quantum if bigger else part
    if request <= capacity:
        return f"{request} is within one device's capacity ({capacity}) and no device has {need} free"
    return f"{request} cannot be split into equal parts over devices with enough free"


# go-gpuallocator calculateGPUPairScore points, keyed by nvidia-smi topo -m spellings.
P2P_SCORES = {"SYS": 10, "NODE": 20, "PHB": 30, "PXB": 40, "PIX": 50, "BOARD": 60}
_NVLINK_POINTS = 100  # per NVLink between the two GPUs

Links = Mapping[frozenset[str], int]
"""Pair score between two device ids (see :func:`link_score`); missing pairs score 0."""


def link_score(p2p: str | None, nvlinks: int = 0) -> int:
    """go-gpuallocator's score of one GPU pair: PCIe distance points plus 100 per NVLink.

    :param p2p: the pair's ``nvidia-smi topo -m`` entry (``SYS``, ``NODE``, ``PHB``, ``PXB``,
        ``PIX``, ``BOARD``), or None when unknown.
    :param nvlinks: number of NVLinks between the two GPUs.
    """
    return P2P_SCORES.get((p2p or "").upper(), 0) + _NVLINK_POINTS * nvlinks


class Policy(str, Enum):
    EVENLY = "evenly"
    EVENLY_NOFRAG = "evenly-nofrag"
    SIMPLE = "simple"
    BESTEFFORT = "besteffort"
    COMPACT_FIRST = "compact-first"
    LOW_LOAD_FIRST = "low-load-first"


@dataclass(frozen=True, slots=True)
class Request:
    """``amount`` of ``slot``, as a kernel would ask for it (``cuda.shares=1.5``)."""

    slot: str
    amount: Decimal

    @classmethod
    def parse(cls, text: str) -> Request:
        """Parse ``SLOT=AMOUNT``; raises ValueError on anything else."""
        slot, sep, amount = text.partition("=")
        slot, amount = slot.strip(), amount.strip()
        if not sep or not slot or not amount:
            raise ValueError(f"expected SLOT=AMOUNT, got {text!r}")
        try:
            value = Decimal(amount)
        except ArithmeticError:
            raise ValueError(f"not a number: {amount!r}") from None
        if not value.is_finite() or value <= 0:
            raise ValueError(f"amount must be a positive number, got {amount!r}")
        return cls(slot, value)

    def __str__(self) -> str:
        return f"{self.slot}={self.amount}"


@dataclass(frozen=True)
class Placement:
    """Where the request lands: device id → amount, in the order the policy chose them."""

    amounts: Mapping[str, Decimal]
    note: str = ""

    @property
    def total(self) -> Decimal:
        return sum(self.amounts.values(), Decimal(0))


@dataclass(frozen=True)
class Rejection:
    """The request would be refused. ``reason`` is one of ``insufficient`` (not enough free in
    total), ``fragmented`` (enough in total, not in the shape the policy needs),
    ``below-quantum`` (rounds down to nothing), ``invalid-request``; ``simulate`` adds
    ``no-devices`` (the node has no device of the slot)."""

    reason: str
    detail: str


Result = Placement | Rejection


def place(
    devices: Sequence[DeviceFree],
    request: Request,
    policy: Policy,
    *,
    quantum: Decimal = Decimal("0.01"),
    rule: NoFragRule = DEFAULT_RULE,
    affinity: AffinityPolicy = DEFAULT_AFFINITY,
    links: Links | None = None,
) -> Result:
    """Place ``request`` on ``devices`` (all of ``request.slot``, in inventory order).

    :param quantum: the plugin's ``quantum_size`` for fractional slots (ignored otherwise).
    :param rule: which agent release ``evenly`` and ``evenly-nofrag`` follow.
    :param affinity: the agent's ``affinity-policy`` (how NUMA nodes are joined).
    :param links: pair scores for ``besteffort``; None or empty falls back to ``simple``.
    """
    links = links or {}
    slot = request.slot
    if is_fractional_slot(slot):
        if policy in (Policy.EVENLY, Policy.EVENLY_NOFRAG):
            guarded = policy is Policy.EVENLY_NOFRAG
            return evenly(devices, request.amount, quantum, rule, guarded=guarded, affinity=affinity)
        return _equal_parts(devices, request.amount, quantum, _CHOOSERS[policy], links)
    if is_mig_slot(slot) and request.amount != _ONE:
        return Rejection("invalid-request", f"MIG slot {slot} is UNIQUE: request exactly 1")
    if is_device_slot(slot) or is_mig_slot(slot):
        if request.amount != request.amount.to_integral_value():
            return Rejection("invalid-request", f"{slot} counts whole devices: {request.amount} is not an integer")
        return _whole_devices(devices, int(request.amount), policy, links, affinity)
    return Rejection("invalid-request", f"{slot} is not an accelerator slot with per-device capacity")


def apply_placement(devices: Sequence[DeviceFree], placement: Placement) -> list[DeviceFree]:
    """The devices after ``placement`` was allocated (a new list; the input is untouched)."""
    return [replace(d, allocated=d.allocated + placement.amounts.get(d.device_id, 0)) for d in devices]


# --- Backend.AI FractionAllocMap EVENLY -------------------------------------------------------


def evenly(
    devices: Sequence[DeviceFree],
    amount: Decimal,
    quantum: Decimal,
    rule: NoFragRule = DEFAULT_RULE,
    *,
    guarded: bool = False,
    affinity: AffinityPolicy = DEFAULT_AFFINITY,
) -> Result:
    """Backend.AI's fractional allocation as ``resources.allocate()`` runs it: the devices in
    :func:`numa_chain` order, ``FractionAllocMap._allocate_evenly`` of the ``rule``'s release,
    then ``allocate()``'s rounding of every part down to ``quantum``.

    :param guarded: fragmentation disallowed: ``ensure_slot_not_fragmented`` runs first.
    """
    if guarded:
        reason = nofrag_rejection(devices, amount, quantum, rule, affinity)
        if reason is not None:
            return Rejection("fragmented", f"ensure_slot_not_fragmented ({rule.value} rule): {reason}")
    # (device id, free) pairs, as upstream's (device id, allocated) with its allocatable amount.
    clusters = [[(d.device_id, d.free) for d in cluster] for cluster in numa_clusters(devices)]
    chain = _join(clusters, affinity)
    if rule is NoFragRule.NUMA_CANDIDATES:
        raw = _evenly_numa(clusters, chain, amount)
    else:
        raw = _evenly_chain(chain, amount)
    if raw is None:
        total = sum((free for _, free in chain if free >= MIN_FREE), _ZERO)
        return Rejection("insufficient", f"{amount} requested, {total} free on devices with at least {MIN_FREE}")
    amounts = {dev: round_down(value, quantum) for dev, value in raw.items()}
    amounts = {dev: value for dev, value in amounts.items() if value > 0}
    if not amounts:
        return Rejection("below-quantum", f"{amount} rounds down to 0 with quantum {quantum}")
    got = sum(amounts.values(), _ZERO)
    notes = [f"quantum {quantum} rounds {amount} down to {got}"] if got != amount else []
    # The 26.4 allocator walks the NUMA chain as it comes and can give a device more than it has.
    frees = dict(chain)
    notes += [f"{dev} receives {value} with {frees[dev]} free" for dev, value in amounts.items() if value > frees[dev]]
    return Placement(amounts, "; ".join(notes))


Pair = tuple[str, Decimal]  # (device id, free)
Rank = tuple[Decimal, int, int]
Across = Callable[[Sequence[Pair], Decimal], dict[str, Decimal]]
_free_of = itemgetter(1)


def _pairs_by_free(pairs: Iterable[Pair]) -> list[Pair]:
    return sorted(pairs, key=_free_of, reverse=True)  # stable: equal frees keep the chain's order


def _evenly_numa(clusters: list[list[Pair]], chain: list[Pair], amount: Decimal) -> dict[str, Decimal] | None:
    """26.9: the tightest single device that holds the request; else the best candidate of one
    search per NUMA node and one over all devices, ranked by (evenness, fewer devices, NUMA
    locality: the earlier node first, all devices last)."""
    usable = _pairs_by_free(p for p in chain if p[1] >= MIN_FREE)
    for device_id, free in reversed(usable):
        if amount <= free:
            return {device_id: amount.quantize(_DIGITS)}
    candidates = [
        _search(_pairs_by_free(p for p in cluster if p[1] >= MIN_FREE), amount, _across_pending, len(clusters) - idx)
        for idx, cluster in enumerate(clusters)
    ]
    candidates.append(_search(usable, amount, _across_pending, 0))
    found = [c for c in candidates if c is not None]
    if not found:
        return None
    return max(found, key=itemgetter(0))[1]  # the first of equal ranks, as upstream's max()


def _evenly_chain(chain: list[Pair], amount: Decimal) -> dict[str, Decimal] | None:
    """Before 26.9: the usable devices in chain order (free order only within a NUMA node); one
    device when the first one holds the request (the last in the chain that does), else the
    windows of the chain."""
    usable = [p for p in chain if p[1] >= MIN_FREE]
    if not usable:
        return None  # upstream raises InsufficientResource (or fails on the empty list)
    if amount <= usable[0][1]:  # then the total holds it too: upstream's total check passes
        device_id = next(dev for dev, free in reversed(usable) if amount <= free)
        return {device_id: amount.quantize(_DIGITS)}
    found = _search(usable, amount, _across_from_end, 0)
    return None if found is None else found[1]


def _search(rows: list[Pair], amount: Decimal, across: Across, numa_local: int) -> tuple[Rank, dict[str, Decimal]] | None:
    """``_search_best_allocation`` (26.9) / the multi-device branch before it, over usable
    devices (sorted by free from 26.9 on, in chain order before): windows of ``rows``, from the
    fewest that hold the request up to all, the most even split of each size (the last window
    among equals), then the best size by (evenness, fewer devices).

    Upstream also ranks by a fragmentation count that is always 0 at the agent's ``min_memory``
    (it counts leftovers strictly between 0.01 and 0.01), and stops early when evenness equals
    +0.01, which an evenness <= 0 never does; both are left out.
    """
    if not rows:
        return None
    frees = [free for _, free in rows]
    want = amount.quantize(_DIGITS)
    if sum(frees, _ZERO).quantize(_DIGITS) < want:
        return None
    needed, held = 0, _ZERO
    for free in frees:
        needed += 1
        held += free
        if held.quantize(_DIGITS) >= want:
            break
    best: list[tuple[Rank, dict[str, Decimal]]] = []
    for size in range(needed, len(rows) + 1):
        window_free = sum(frees[:size], _ZERO)
        chosen = across(rows[:size], amount)
        top = chosen_evenness = _evenness(chosen)
        for start in range(1, len(rows) - size + 1):
            window_free += frees[start + size - 1] - frees[start - 1]
            if window_free.quantize(_DIGITS) < want:
                break
            split = across(rows[start : start + size], amount)
            evenness = _evenness(split)
            # Later windows hold less, so evenness only gets worse from here.
            if evenness < top:
                break
            chosen, chosen_evenness = split, evenness  # the last window that is no less even
        best.append(((chosen_evenness, -len(chosen), numa_local), chosen))
    return sorted(best, key=itemgetter(0))[-1]  # stable: the last of equal ranks, as upstream


def _across_pending(window: Sequence[Pair], amount: Decimal) -> dict[str, Decimal]:
    """26.9 ``_allocate_across_devices``: while the least free device cannot hold an even share,
    it gives all it has; the rest share the remainder. Never more than a device has free."""
    split: dict[str, Decimal] = {}
    remaining = amount.normalize()
    pending = list(window)
    while pending:
        device_id, free = min(pending, key=_free_of)  # the first of equals, as upstream's min()
        if free >= remaining / len(pending):
            break
        split[device_id] = free.quantize(_DIGITS)
        remaining -= free
        pending = [p for p in pending if p[0] != device_id]
    _distribute(pending, remaining, split)
    return split


def _across_from_end(window: Sequence[Pair], amount: Decimal) -> dict[str, Decimal]:
    """Before 26.9: devices give all they have from the window's end while the one there cannot
    hold an even share; the window is assumed sorted by free, which a NUMA chain is not, so a
    device before it can receive more than it has."""
    split: dict[str, Decimal] = {}
    remaining = amount.normalize()
    count = len(window)
    while count > 0:
        device_id, free = window[count - 1]
        if free >= remaining / count:
            break
        split[device_id] = free.quantize(_DIGITS)
        remaining -= free
        count -= 1
    _distribute(window[:count], remaining, split)
    return split


def _distribute(pairs: Sequence[Pair], remaining: Decimal, split: dict[str, Decimal]) -> None:
    """``_distribute_evenly``: equal hundredths, the leftover hundredths to the first devices."""
    if not pairs:
        return
    share = (remaining / len(pairs)).quantize(_DIGITS, rounding=ROUND_DOWN)
    for device_id, _ in pairs:
        split[device_id] = share
    for device_id, _ in pairs[: round(remaining * 100 - share * len(pairs) * 100)]:
        split[device_id] += _DIGITS


def _evenness(split: Mapping[str, Decimal]) -> Decimal:
    values = sorted(split.values())
    return -sum((b - a for a, b in itertools.pairwise(values)), _ZERO.quantize(_DIGITS))


# --- whole devices and MIG instances ----------------------------------------------------------


def _whole_devices(
    devices: Sequence[DeviceFree], count: int, policy: Policy, links: Links, affinity: AffinityPolicy
) -> Result:
    # DiscretePropertyAllocMap EVENLY hands one device each to the first free devices of the NUMA
    # chain; the others take inventory order.
    ordered = numa_chain(devices, affinity) if policy in (Policy.EVENLY, Policy.EVENLY_NOFRAG) else list(devices)
    free = [d for d in ordered if d.free >= _ONE]
    if len(free) < count:
        return Rejection("insufficient", f"{count} whole devices requested, {len(free)} free")
    chosen, note = _CHOOSERS.get(policy, _first)(free, count, links)
    return Placement({d.device_id: _ONE for d in chosen}, note)


# --- equal parts for the whole-device policies -------------------------------------------------

Chooser = Callable[[list[DeviceFree], int, Links], tuple[list[DeviceFree], str]]


def _equal_parts(
    devices: Sequence[DeviceFree], amount: Decimal, quantum: Decimal, choose: Chooser, links: Links
) -> Result:
    """The whole-device policies on a fraction: the request rounded down to the quantum, cut into
    ``count`` parts that differ by at most one quantum, for the smallest ``count`` that has enough
    devices able to hold the largest part."""
    wanted = round_down(amount, quantum)
    if wanted <= 0:
        return Rejection("below-quantum", f"{amount} rounds down to 0 with quantum {quantum}")
    frees = [(d, d.free) for d in devices]
    # A part is at least one quantum: no more parts than devices that hold one (on a full node, none).
    holders = sum(1 for _, free in frees if free >= quantum)
    for count in range(1, holders + 1):
        part = round_down(wanted / count, quantum)
        if part <= 0:
            break
        bigger = int((wanted - part * count) / quantum)
        largest = part + quantum if bigger else part
        eligible = [d for d, free in frees if free >= largest]
        if len(eligible) >= count:
            chosen, note = choose(eligible, count, links)
            amounts = {d.device_id: part + quantum if i < bigger else part for i, d in enumerate(chosen)}
            if wanted != amount:
                note = "; ".join(filter(None, [f"quantum {quantum} rounds {amount} down to {wanted}", note]))
            return Placement(amounts, note)
    free = sum((d.free for d in devices if d.free > 0), Decimal(0))
    if free < wanted:
        return Rejection("insufficient", f"{wanted} requested, {free} free")
    return Rejection("fragmented", f"no set of devices can each hold an equal part of {wanted}")


def _first(eligible: list[DeviceFree], count: int, links: Links) -> tuple[list[DeviceFree], str]:
    """go-gpuallocator Simple: the first ``count`` available devices."""
    return eligible[:count], ""


def _compact_first(eligible: list[DeviceFree], count: int, links: Links) -> tuple[list[DeviceFree], str]:
    """tensor-fusion CompactFirst: highest allocated share of capacity first (pack)."""
    return sorted(eligible, key=_used_ratio, reverse=True)[:count], ""


def _low_load_first(eligible: list[DeviceFree], count: int, links: Links) -> tuple[list[DeviceFree], str]:
    """tensor-fusion LowLoadFirst: lowest allocated share of capacity first (spread)."""
    return sorted(eligible, key=_used_ratio)[:count], ""


def _used_ratio(d: DeviceFree) -> Decimal:
    return d.allocated / d.capacity if d.capacity > 0 else _ONE


# Exhaustive partition search grows factorially; beyond this many candidates only single sets
# are scored (still exact for the set, no longer weighing what it leaves to later requests).
_PARTITION_LIMIT = 10
_SET_LIMIT = 20_000


def _best_effort(eligible: list[DeviceFree], count: int, links: Links) -> tuple[list[DeviceFree], str]:
    """go-gpuallocator BestEffort: among all partitions of the available devices into sets of
    ``count``, take the partition with the highest summed link score, then its best set."""
    if not links:
        return eligible[:count], "no link information: fell back to simple"
    if count == 1:
        return eligible[:1], ""
    ids = [d.device_id for d in eligible]
    if len(ids) <= _PARTITION_LIMIT:
        best_set = _best_set_of_best_partition(ids, count, links)
        note = ""
    elif math.comb(len(ids), count) <= _SET_LIMIT:
        best_set = max(itertools.combinations(ids, count), key=lambda s: _set_score(s, links))
        note = f"{len(ids)} candidate devices: best single set, partitions not weighed"
    else:
        return eligible[:count], f"{len(ids)} candidate devices: too many sets to score, fell back to simple"
    by_id = {d.device_id: d for d in eligible}
    return [by_id[i] for i in best_set], note


def _set_score(ids: Sequence[str | None], links: Links) -> int:
    return sum(links.get(frozenset(pair), 0) for pair in itertools.combinations([i for i in ids if i], 2))


def _best_set_of_best_partition(ids: list[str], size: int, links: Links) -> tuple[str, ...]:
    # Pad with None so the devices split into sets of ``size`` exactly, as upstream does; a set
    # holds either no padding or all of it. Unlike upstream, a padded set (short of ``size``
    # devices) is never the answer.
    padded: list[str | None] = [*ids, *[None] * (-len(ids) % size)]
    padding = len(padded) - len(ids)
    best: tuple[int, list[tuple[str | None, ...]]] | None = None

    def walk(rest: list[str | None], sets: list[tuple[str | None, ...]]) -> None:
        nonlocal best
        if not rest:
            score = sum(_set_score(s, links) for s in sets)
            if best is None or score > best[0]:
                best = (score, list(sets))
            return
        # The first remaining device opens the next set: each partition is seen once.
        for others in itertools.combinations(rest[1:], size - 1):
            group = (rest[0], *others)
            if group.count(None) not in (0, padding):
                continue
            left = list(rest[1:])
            for member in others:
                left.remove(member)
            walk(left, [*sets, group])

    walk(padded, [])
    assert best is not None
    full = [s for s in best[1] if None not in s]
    return max(full, key=lambda s: _set_score(s, links))  # first of equals, as upstream


_CHOOSERS: dict[Policy, Chooser] = {
    Policy.SIMPLE: _first,
    Policy.BESTEFFORT: _best_effort,
    Policy.COMPACT_FIRST: _compact_first,
    Policy.LOW_LOAD_FIRST: _low_load_first,
}
