"""Headroom of one slot on one node: how much more the agent would hand out, and how it is cut up.

Pure functions over :class:`~exporter.analysis.placement.DeviceFree` rows, no I/O; amounts are exact
``Decimal`` in the slot's unit (shares for ``cuda.shares``, devices for ``cuda.device`` and MIG
slots). Every figure is defined by what the allocator in :mod:`exporter.analysis.placement` would do:

*headroom* is the largest multiple of the quantum that a single request can ask for and receive
in full. With fragmentation allowed that is at most ``round_down(Σ free >= 0.01, q)``
(docs/headroom.md, *Headroom*); with the default quantum of 0.01 it always is, with a coarser one
EVENLY's hundredth-wise split can lose to rounding, so the figure is confirmed by placing it,
stepping down a quantum at a time. With fragmentation disallowed, ``ensure_slot_not_fragmented``
must also accept it; its largest accepted request has a closed form (:func:`nofrag_bound`).

*headroom* is the largest size that fits, not a promise for every smaller size: with
fragmentation disallowed (26.4+ rule) a request no larger than one device's capacity must fit on
one device, while a larger one may be split. Free ``[7.26, 7.25]`` of 13.5 each takes 14.51
(7.26 + 7.25) but rejects 10.01 and 12. :func:`contiguous_headroom` is the size up to which every
request fits: between it and *headroom* only a what-if placement answers.

Every figure follows the agent release ``rule`` names and its NUMA order
(:func:`~exporter.analysis.placement.numa_chain`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from decimal import Decimal

from exporter.analysis.capacity import is_fractional_slot
from exporter.analysis.placement import (
    DEFAULT_AFFINITY,
    DEFAULT_RULE,
    MIN_FREE,
    AffinityPolicy,
    DeviceFree,
    NoFragRule,
    Placement,
    Policy,
    Rejection,
    Request,
    apply_placement,
    evenly,
    numa_chain,
    place,
    round_down,
)

__all__ = [
    "SlotHeadroom",
    "contiguous_headroom",
    "count_fits",
    "fragmentation_ratio",
    "headroom",
    "max_single_device_free",
    "nofrag_bound",
    "summarize",
    "whole_free_devices",
]

_ZERO = Decimal(0)
HUNDREDTH = Decimal("0.01")  # the agent computes fractional amounts in hundredths
_SEARCH_LIMIT = 2_000  # quantum steps tried below the bound before settling for the single-device figure


def max_single_device_free(devices: Sequence[DeviceFree]) -> Decimal:
    """The largest free amount on one device (0 when none is free); not rounded to the quantum."""
    return max((d.free for d in devices), default=_ZERO).max(_ZERO)


def nofrag_bound(
    devices: Sequence[DeviceFree],
    quantum: Decimal,
    rule: NoFragRule = DEFAULT_RULE,
    affinity: AffinityPolicy = DEFAULT_AFFINITY,
) -> Decimal:
    """Largest multiple of ``quantum`` that the fragmentation guard and the allocator's total check
    both accept (the allocator may still round the parts down; :func:`headroom` checks that).

    Closed form instead of a search, with ``C`` the capacity of the first device of the NUMA
    chain: up to ``C`` the largest free piece; above it, for ``n`` devices sorted by free
    (``f_1 >= f_2 >= ...``), the 26.4+ guard accepts every multiple of ``q`` up to
    ``n*D + k*q`` with ``D = round_down(f_n, q)`` and ``k`` = how many of the other devices have
    ``D + q`` free, capped at ``n*C``. Before 26.4: what the chain's first device has free.
    """
    chain = numa_chain(devices, affinity)
    if not chain:
        return _ZERO
    if rule is NoFragRule.SINGLE_DEVICE:
        return min(round_down(chain[0].free, quantum).max(_ZERO), _allowed_bound(devices, quantum))
    frees = sorted((d.free for d in chain), reverse=True)
    capacity = chain[0].capacity
    if frees[0] <= 0 or capacity <= 0:
        return _ZERO
    best = round_down(min(frees[0], capacity), quantum)
    for n in range(2, len(frees) + 1):
        if frees[n - 1] < 0:
            break  # parts are never negative; fewer devices already did better
        part = round_down(frees[n - 1], quantum)
        bigger = min(n - 1, sum(f >= part + quantum for f in frees))
        reach = min(n * part + bigger * quantum, round_down(n * capacity, quantum))
        if reach > capacity:
            best = max(best, reach)
    return min(best, _allowed_bound(devices, quantum))


def _allowed_bound(devices: Sequence[DeviceFree], quantum: Decimal) -> Decimal:
    return round_down(sum((d.free for d in devices if d.free >= MIN_FREE), _ZERO), quantum)


def _single_device_size(
    devices: Sequence[DeviceFree], rule: NoFragRule, guarded: bool, affinity: AffinityPolicy
) -> Decimal:
    """Up to this size (unrounded) every request lands whole on one device: the allocator keeps
    it on one device and, guarded, the guard accepts it."""
    chain = numa_chain(devices, affinity)
    usable = [d for d in chain if d.free >= MIN_FREE]
    if not usable:
        return _ZERO
    # 26.9 fits a request on any device that holds it; before, only when the chain's first does.
    size = max(d.free for d in usable) if rule is NoFragRule.NUMA_CANDIDATES else usable[0].free
    if guarded:
        size = min(size, chain[0].free if rule is NoFragRule.SINGLE_DEVICE else chain[0].capacity)
    return size.max(_ZERO)


def headroom(
    devices: Sequence[DeviceFree],
    quantum: Decimal,
    rule: NoFragRule = DEFAULT_RULE,
    *,
    guarded: bool = False,
    affinity: AffinityPolicy = DEFAULT_AFFINITY,
) -> Decimal:
    """Largest multiple of ``quantum`` one fractional request receives in full.

    :param rule: the agent release whose allocator (and guard) applies.
    :param guarded: fragmentation disallowed: the guard must accept it too.
    """
    top = nofrag_bound(devices, quantum, rule, affinity) if guarded else _allowed_bound(devices, quantum)
    # Below this the search can stop: such a request always lands whole on one device.
    single = round_down(_single_device_size(devices, rule, guarded, affinity), quantum)
    candidate = top
    for _ in range(_SEARCH_LIMIT):
        if candidate <= single:
            return candidate
        result = evenly(devices, candidate, quantum, rule, guarded=guarded, affinity=affinity)
        if isinstance(result, Placement) and result.total == candidate:
            return candidate
        candidate -= quantum
    return single


def contiguous_headroom(
    devices: Sequence[DeviceFree],
    quantum: Decimal,
    rule: NoFragRule = DEFAULT_RULE,
    *,
    guarded: bool = False,
    affinity: AffinityPolicy = DEFAULT_AFFINITY,
) -> Decimal:
    """Largest multiple of ``quantum`` up to which *every* request is received in full: a request
    of at most this size fits; above it, up to :func:`headroom`, some sizes may not (the gaps).

    With fragmentation allowed the sizes that fit have no gaps at the agent's 0.01 quantum. With
    it disallowed (26.4+), a request up to the capacity ``C`` of the NUMA chain's first device
    must fit on one device, so when no device has ``C`` free the sizes between the largest free
    piece and ``C`` are refused; above ``C`` the accepted splits are closed downwards (smaller
    parts fit wherever larger ones did). Before 26.4 the guard accepts exactly what the chain's
    first device has free. A coarser quantum can lose sizes to EVENLY's rounding anywhere, so
    each size is then confirmed by placing it (at most ``_SEARCH_LIMIT`` of them; the figure
    stays a safe bound).
    """
    bound = headroom(devices, quantum, rule, guarded=guarded, affinity=affinity)
    chain = numa_chain(devices, affinity)
    if guarded and chain:
        largest_free = max(d.free for d in chain)
        if rule is NoFragRule.SINGLE_DEVICE:
            bound = min(bound, round_down(chain[0].free, quantum).max(_ZERO))
        elif largest_free < chain[0].capacity:
            # The next size up is no larger than C, yet no device holds it.
            bound = min(bound, round_down(largest_free, quantum).max(_ZERO))
    if quantum == HUNDREDTH:
        return bound  # EVENLY splits in hundredths: every accepted size arrives whole
    size = quantum
    for _ in range(_SEARCH_LIMIT):
        if size > bound:
            break
        result = evenly(devices, size, quantum, rule, guarded=guarded, affinity=affinity)
        if not (isinstance(result, Placement) and result.total == size):
            break
        size += quantum
    return size - quantum


def whole_free_devices(devices: Sequence[DeviceFree]) -> int:
    """Devices nobody holds any of (a whole GPU, or a MIG instance, is still available)."""
    return sum(1 for d in devices if d.allocated == 0 and d.capacity > 0)


def fragmentation_ratio(devices: Sequence[DeviceFree]) -> Decimal:
    """Share (0-1) of the free capacity that sits on partly allocated devices.

    0: all free capacity is on untouched devices (or nothing is free); 1: every free share is a
    remainder next to someone else's allocation, so only fractions can still be handed out.
    """
    free = sum((d.free for d in devices if d.free > 0), _ZERO)
    if free == 0:
        return _ZERO
    partial = sum((d.free for d in devices if d.free > 0 and d.allocated > 0), _ZERO)
    return partial / free


def count_fits(
    devices: Sequence[DeviceFree],
    request: Request,
    policy: Policy,
    *,
    quantum: Decimal = Decimal("0.01"),
    rule: NoFragRule = DEFAULT_RULE,
    affinity: AffinityPolicy = DEFAULT_AFFINITY,
    limit: int = 10_000,
) -> int:
    """How many requests like ``request`` would be placed one after another (at most ``limit``)."""
    current = list(devices)
    placed = 0
    amount = request.amount
    if (
        is_fractional_slot(request.slot)
        and policy in (Policy.EVENLY, Policy.EVENLY_NOFRAG)
        and amount == round_down(amount, quantum) == amount.quantize(Decimal("0.01"))
        and _one_device_phase(current, amount, policy, rule)
    ):
        # EVENLY keeps every request that fits on one device on one device (best fit) and only
        # splits once none does, so the single-device phase ends with each device holding its
        # free space modulo the request: no need to replay it request by request.
        per_device = [math.floor(d.free / amount) if d.free >= amount else 0 for d in current]
        placed = min(sum(per_device), limit)
        current = [replace(d, allocated=d.allocated + k * amount) if k else d for d, k in zip(current, per_device, strict=True)]
    while placed < limit:
        result = place(current, request, policy, quantum=quantum, rule=rule, affinity=affinity)
        if isinstance(result, Rejection):
            break
        current = apply_placement(current, result)
        placed += 1
    return placed


def _one_device_phase(devices: Sequence[DeviceFree], amount: Decimal, policy: Policy, rule: NoFragRule) -> bool:
    """Whether every request of ``amount`` lands on one device as long as one holds it: 26.9
    fits on any device (before, only when the NUMA chain's first device holds it, which is the
    freest only on one NUMA node), and the guard must not refuse what fits on one device (26.4+:
    a request within every device's capacity; before 26.4: one NUMA node)."""
    one_node = len({d.numa_node for d in devices}) <= 1
    if rule is not NoFragRule.NUMA_CANDIDATES and not one_node:
        return False
    if policy is Policy.EVENLY or rule is NoFragRule.SINGLE_DEVICE:
        return True
    return all(amount <= d.capacity for d in devices)


@dataclass(frozen=True, slots=True)
class SlotHeadroom:
    """Every node-level figure of one slot (units of the slot; see ``docs/headroom.md``)."""

    capacity: Decimal
    allocated: Decimal
    free: Decimal  # Σ free of devices that are not overcommitted
    headroom: Decimal  # fragmentation allowed
    headroom_nofrag: Decimal  # fragmentation disallowed, under the configured rule
    contiguous: Decimal  # every request up to this fits, fragmentation allowed
    contiguous_nofrag: Decimal  # every request up to this fits, fragmentation disallowed
    max_single_device_free: Decimal
    whole_free_devices: int
    fragmentation_ratio: Decimal
    overcommitted_devices: tuple[str, ...]


def summarize(
    devices: Sequence[DeviceFree],
    quantum: Decimal,
    rule: NoFragRule = DEFAULT_RULE,
    *,
    unique: bool = False,
    affinity: AffinityPolicy = DEFAULT_AFFINITY,
) -> SlotHeadroom:
    """All headroom figures of one slot at once. Whole-device and MIG slots pass quantum 1: their
    headroom is then the number of free devices, with or without fragmentation.

    :param rule: the agent release whose allocator and guard apply.
    :param unique: the slot is ``UNIQUE`` (MIG): a request is exactly one device, so headroom is
        at most 1 however many are free.
    :param affinity: the agent's ``affinity-policy``.
    """
    allowed = headroom(devices, quantum, rule, affinity=affinity)
    guarded = headroom(devices, quantum, rule, guarded=True, affinity=affinity)
    gapless = contiguous_headroom(devices, quantum, rule, affinity=affinity)
    gapless_nofrag = contiguous_headroom(devices, quantum, rule, guarded=True, affinity=affinity)
    if unique:
        allowed, guarded = min(allowed, Decimal(1)), min(guarded, Decimal(1))
        gapless, gapless_nofrag = min(gapless, Decimal(1)), min(gapless_nofrag, Decimal(1))
    return SlotHeadroom(
        capacity=sum((d.capacity for d in devices), _ZERO),
        allocated=sum((d.allocated for d in devices), _ZERO),
        free=sum((d.free for d in devices if d.free > 0), _ZERO),
        headroom=allowed,
        headroom_nofrag=guarded,
        contiguous=gapless,
        contiguous_nofrag=gapless_nofrag,
        max_single_device_free=max_single_device_free(devices),
        whole_free_devices=whole_free_devices(devices),
        fragmentation_ratio=fragmentation_ratio(devices),
        overcommitted_devices=tuple(d.device_id for d in devices if d.overcommitted),
    )
