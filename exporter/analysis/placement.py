"""The allocators: where would a request land on this node, under which policy?

Pure functions over :class:`DeviceFree` rows, exact ``Decimal`` amounts in the slot's unit. The
order of the rows matters: it is the order the agent enumerates devices in. :func:`place` returns
a :class:`Placement` ``{device_id: amount}`` or a :class:`Rejection` with a reason; nothing is
mutated.

Backend.AI rules (``src/ai/backend/agent/alloc_map.py``): a fractional request only considers
devices with at least ``MIN_FREE`` (0.01) free, computes in hundredths, and finally rounds every
per-device amount down to the plugin's quantum, so a kernel can receive less than it asked. With
fragmentation disallowed, ``ensure_slot_not_fragmented`` (:func:`nofrag_rejection`) runs first.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from decimal import ROUND_DOWN, Decimal
from enum import Enum
from operator import itemgetter

from exporter.analysis.capacity import is_device_slot, is_fractional_slot, is_mig_slot

__all__ = [
    "MIN_FREE",
    "P2P_SCORES",
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
    "place",
    "round_down",
]

_DIGITS = Decimal("0.01")  # FractionAllocMap.digits: the agent computes in hundredths
_ONE = Decimal(1)
MIN_FREE = Decimal("0.01")  # FractionAllocMap.allocate(min_memory=...) default


def round_down(value: Decimal, quantum: Decimal) -> Decimal:
    """``value`` rounded down to a multiple of ``quantum``, as upstream's ``round_down`` does."""
    remainder = value.remainder_near(quantum)
    if remainder < 0:
        remainder += quantum
    return value - remainder


@dataclass(frozen=True, slots=True)
class DeviceFree:
    """One device of one slot: capacity and the sum of what kernels hold on it (slot units)."""

    device_id: str
    capacity: Decimal
    allocated: Decimal

    @property
    def free(self) -> Decimal:
        """Capacity minus allocated; negative when overcommitted."""
        return self.capacity - self.allocated

    @property
    def overcommitted(self) -> bool:
        """More is allocated than the device holds (multi-agent ``shared`` mode, wrong capacity)."""
        return self.allocated > self.capacity


class NoFragRule(str, Enum):
    """Which ``ensure_slot_not_fragmented`` the agent runs when fragmentation is disallowed."""

    SINGLE_DEVICE = "before-26.4"  # the request must fit on the freest device
    MULTI_DEVICE = "26.4"  # #10477: equal quantized parts over n devices are fine


def _by_free(devices: Sequence[DeviceFree]) -> list[DeviceFree]:
    # Stable, as upstream's sorted(..., reverse=True): equal frees keep inventory order.
    return sorted(devices, key=lambda d: d.free, reverse=True)


def nofrag_rejection(devices: Sequence[DeviceFree], request: Decimal, quantum: Decimal, rule: NoFragRule) -> str | None:
    """Why the fragmentation guard rejects ``request``, or None when it lets it through.

    26.4 rule, with ``C`` the capacity of the freest device ("a single node with homogeneous
    devices" upstream assumes): ``R <= C`` must fit on one device; otherwise for ``n`` from
    ``ceil(R/C)`` up to the device count, every device gets ``D = round_down(R/n, q)`` and
    ``ceil((R - D*n)/q)`` of them ``D + q``; accepted as soon as enough devices have that much free.
    """
    ordered = _by_free(devices)
    if not ordered:
        return "no devices"
    most_free = ordered[0]
    if most_free.capacity <= 0:
        return "no capacity"
    if rule is NoFragRule.SINGLE_DEVICE or request <= most_free.capacity:
        if request <= most_free.free:
            return None
        return f"{request} does not fit on one device (largest free {most_free.free})"
    frees = [d.free for d in ordered]
    for n in range(math.ceil(request / most_free.capacity), len(frees) + 1):
        part = round_down(request / n, quantum)
        bigger = math.ceil((request - part * n) / quantum)
        if sum(f >= part for f in frees) >= n and sum(f >= part + quantum for f in frees) >= bigger:
            return None
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
    rule: NoFragRule = NoFragRule.MULTI_DEVICE,
    links: Links | None = None,
) -> Result:
    """Place ``request`` on ``devices`` (all of ``request.slot``, in inventory order).

    :param quantum: the plugin's ``quantum_size`` for fractional slots (ignored otherwise).
    :param rule: which fragmentation guard ``evenly-nofrag`` applies.
    :param links: pair scores for ``besteffort``; None or empty falls back to ``simple``.
    """
    links = links or {}
    slot = request.slot
    if is_fractional_slot(slot):
        if policy is Policy.EVENLY:
            return evenly(devices, request.amount, quantum)
        if policy is Policy.EVENLY_NOFRAG:
            return evenly(devices, request.amount, quantum, rule)
        return _equal_parts(devices, request.amount, quantum, _CHOOSERS[policy], links)
    if is_mig_slot(slot) and request.amount != _ONE:
        return Rejection("invalid-request", f"MIG slot {slot} is UNIQUE: request exactly 1")
    if is_device_slot(slot) or is_mig_slot(slot):
        if request.amount != request.amount.to_integral_value():
            return Rejection("invalid-request", f"{slot} counts whole devices: {request.amount} is not an integer")
        return _whole_devices(devices, int(request.amount), policy, links)
    return Rejection("invalid-request", f"{slot} is not an accelerator slot with per-device capacity")


def apply_placement(devices: Sequence[DeviceFree], placement: Placement) -> list[DeviceFree]:
    """The devices after ``placement`` was allocated (a new list; the input is untouched)."""
    return [replace(d, allocated=d.allocated + placement.amounts.get(d.device_id, 0)) for d in devices]


# --- Backend.AI FractionAllocMap EVENLY -------------------------------------------------------


def evenly(devices: Sequence[DeviceFree], amount: Decimal, quantum: Decimal, rule: NoFragRule | None = None) -> Result:
    """Backend.AI's fractional allocation: ``FractionAllocMap._allocate_evenly`` followed by
    ``allocate()``'s rounding of every part down to ``quantum``.

    :param rule: when given, fragmentation is disallowed and ``ensure_slot_not_fragmented`` under
        that rule runs first.
    """
    if rule is not None:
        reason = nofrag_rejection(devices, amount, quantum, rule)
        if reason is not None:
            return Rejection("fragmented", f"ensure_slot_not_fragmented ({rule.value} rule): {reason}")
    candidates = [d for d in _by_free(devices) if d.free >= MIN_FREE]
    total = sum((d.free for d in candidates), Decimal(0))
    if not candidates or total.quantize(_DIGITS) < amount.quantize(_DIGITS):
        return Rejection("insufficient", f"{amount} requested, {total} free on devices with at least {MIN_FREE}")
    if amount <= candidates[0].free:
        # Fits on one device: the smallest one that still fits (best fit).
        chosen = next(d for d in reversed(candidates) if amount <= d.free)
        raw = {chosen.device_id: amount.quantize(_DIGITS)}
    else:
        raw = _evenly_across(candidates, amount)
    amounts = {dev: round_down(value, quantum) for dev, value in raw.items()}
    amounts = {dev: value for dev, value in amounts.items() if value > 0}
    if not amounts:
        return Rejection("below-quantum", f"{amount} rounds down to 0 with quantum {quantum}")
    got = sum(amounts.values(), Decimal(0))
    note = f"quantum {quantum} rounds {amount} down to {got}" if got != amount else ""
    return Placement(amounts, note)


def _evenly_across(candidates: list[DeviceFree], amount: Decimal) -> dict[str, Decimal]:
    """The multi-device branch: try windows of the free-sorted candidates, from the fewest devices
    that hold the request up to all, and keep the most even split (then fewer devices)."""
    needed, held = 0, Decimal(0)
    for d in candidates:
        needed += 1
        held += d.free
        if held.quantize(_DIGITS) >= amount.quantize(_DIGITS):
            break
    best = []
    for size in range(needed, len(candidates) + 1):
        window_free = sum((d.free for d in candidates[:size]), Decimal(0))
        split = _split_window(candidates[:size], amount)
        top_evenness = _evenness(split)
        options = [(split, top_evenness, -len(split))]
        for start in range(1, len(candidates) - size + 1):
            window_free += candidates[start + size - 1].free - candidates[start - 1].free
            if window_free.quantize(_DIGITS) < amount.quantize(_DIGITS):
                break
            split = _split_window(candidates[start : start + size], amount)
            evenness = _evenness(split)
            # Later windows hold less, so evenness only gets worse from here.
            if evenness < top_evenness:
                break
            options.append((split, evenness, -len(split)))
        # Upstream sorts by device count only; the stable sort keeps the last window on ties.
        best.append(sorted(options, key=itemgetter(2))[-1])
    # Upstream also ranks by a fragmentation count that is always 0 with the default min_memory
    # (it counts leftovers strictly between 0.01 and 0.01), and stops early when evenness equals
    # +0.01, which an evenness <= 0 never does; both are left out.
    return sorted(best, key=itemgetter(1, 2))[-1][0]


def _split_window(window: list[DeviceFree], amount: Decimal) -> dict[str, Decimal]:
    """``allocate_across_devices``: devices too small for an even share give all they have (from
    the smallest up); the rest share the remainder evenly in hundredths."""
    split: dict[str, Decimal] = {}
    remaining = amount.normalize()
    count = len(window)
    while count > 0:
        smallest = window[count - 1]
        if smallest.free >= remaining / count:
            break
        split[smallest.device_id] = smallest.free.quantize(_DIGITS)
        remaining -= smallest.free
        count -= 1
    if count > 0:
        share = (remaining / count).quantize(_DIGITS, rounding=ROUND_DOWN)
        for d in window[:count]:
            split[d.device_id] = share
        # Leftover hundredths go to the first (freest) devices of the window.
        for d in window[: round(remaining * 100 - share * count * 100)]:
            split[d.device_id] += _DIGITS
    return split


def _evenness(split: Mapping[str, Decimal]) -> Decimal:
    values = sorted(split.values())
    return -sum((b - a for a, b in itertools.pairwise(values)), Decimal(0).quantize(_DIGITS))


# --- whole devices and MIG instances ----------------------------------------------------------


def _whole_devices(devices: Sequence[DeviceFree], count: int, policy: Policy, links: Links) -> Result:
    # DiscretePropertyAllocMap EVENLY walks the free-sorted devices; the others take inventory order.
    ordered = _by_free(devices) if policy in (Policy.EVENLY, Policy.EVENLY_NOFRAG) else list(devices)
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
    for count in range(1, len(devices) + 1):
        part = round_down(wanted / count, quantum)
        if part <= 0:
            break
        bigger = int((wanted - part * count) / quantum)
        largest = part + quantum if bigger else part
        eligible = [d for d in devices if d.free >= largest]
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
