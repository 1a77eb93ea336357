"""Headroom of one slot on one node: how much more the agent would hand out, and how it is cut up.

Pure functions over :class:`~exporter.analysis.placement.DeviceFree` rows, no I/O; amounts are exact
``Decimal`` in the slot's unit (shares for ``cuda.shares``, devices for ``cuda.device`` and MIG
slots). Every figure is defined by what the allocator in :mod:`exporter.analysis.placement` would do:

*headroom* is the largest multiple of the quantum that a single request can ask for and receive
in full. With fragmentation allowed that is ``round_down(Σ free >= 0.01, q)`` (backendai-scratch.md
§11); with the default quantum of 0.01 it always is, with a coarser one EVENLY's hundredth-wise
split can lose to rounding, so the figure is confirmed by placing it, stepping down a quantum at a
time. With fragmentation disallowed, ``ensure_slot_not_fragmented`` must also accept it; its
largest accepted request has a closed form (:func:`nofrag_bound`).

*headroom* is the largest size that fits, not a promise for every smaller size: with
fragmentation disallowed (26.4 rule) a request no larger than one device's capacity must fit on
one device, while a larger one may be split. Free ``[7.26, 7.25]`` of 13.5 each takes 14.51
(7.26 + 7.25) but rejects 10.01 and 12. :func:`contiguous_headroom` is the size up to which every
request fits: between it and *headroom* only a what-if placement answers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from decimal import Decimal

from exporter.analysis.capacity import is_fractional_slot
from exporter.analysis.placement import (
    MIN_FREE,
    DeviceFree,
    NoFragRule,
    Placement,
    Policy,
    Rejection,
    Request,
    apply_placement,
    evenly,
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


def nofrag_bound(devices: Sequence[DeviceFree], quantum: Decimal, rule: NoFragRule) -> Decimal:
    """Largest multiple of ``quantum`` that the fragmentation guard and the allocator's total check
    both accept (the allocator may still round the parts down; :func:`headroom` checks that).

    Closed form instead of a search: for ``n`` devices sorted by free (``f_1 >= f_2 >= ...``) the
    26.4 guard accepts every multiple of ``q`` up to ``n*D + k*q`` with ``D = round_down(f_n, q)``
    and ``k`` = how many of the other devices have ``D + q`` free, capped at ``n*C``.
    """
    ordered = sorted(devices, key=lambda d: d.free, reverse=True)
    if not ordered or ordered[0].free <= 0:
        return _ZERO
    most_free = ordered[0]
    if rule is NoFragRule.SINGLE_DEVICE:
        return round_down(most_free.free, quantum)
    capacity = most_free.capacity
    best = round_down(min(most_free.free, capacity), quantum)
    frees = [d.free for d in ordered]
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


def headroom(devices: Sequence[DeviceFree], quantum: Decimal, rule: NoFragRule | None = None) -> Decimal:
    """Largest multiple of ``quantum`` one fractional request receives in full.

    :param rule: None for fragmentation allowed (EVENLY); else the guard the agent applies.
    """
    top = _allowed_bound(devices, quantum) if rule is None else nofrag_bound(devices, quantum, rule)
    # A request that fits on the freest device (and, guarded, within its capacity) always lands
    # whole on one device: below this the search can stop.
    ordered = sorted(devices, key=lambda d: d.free, reverse=True)
    single = _ZERO
    if ordered and ordered[0].free > 0:
        limit = ordered[0].free if rule is not NoFragRule.MULTI_DEVICE else min(ordered[0].free, ordered[0].capacity)
        single = round_down(limit, quantum)
    candidate = top
    for _ in range(_SEARCH_LIMIT):
        if candidate <= single:
            return candidate
        result = evenly(devices, candidate, quantum, rule)
        if isinstance(result, Placement) and result.total == candidate:
            return candidate
        candidate -= quantum
    return single


def contiguous_headroom(devices: Sequence[DeviceFree], quantum: Decimal, rule: NoFragRule | None = None) -> Decimal:
    """Largest multiple of ``quantum`` up to which *every* request is received in full: a request
    of at most this size fits; above it, up to :func:`headroom`, some sizes may not (the gaps).

    With fragmentation allowed the sizes that fit have no gaps at the agent's 0.01 quantum. With
    it disallowed, a request up to the freest device's capacity ``C`` must fit on one device, so
    when no device has ``C`` free the sizes between the largest free piece and ``C`` are refused;
    above ``C`` the accepted splits are closed downwards (smaller parts fit wherever larger ones
    did). A coarser quantum can lose sizes to EVENLY's rounding anywhere, so each size is then
    confirmed by placing it (at most ``_SEARCH_LIMIT`` of them; the figure stays a safe bound).
    """
    bound = headroom(devices, quantum, rule)
    ordered = sorted(devices, key=lambda d: d.free, reverse=True)
    if rule is not None and ordered and ordered[0].free > 0:
        most_free = ordered[0]
        if rule is NoFragRule.SINGLE_DEVICE or most_free.free < most_free.capacity:
            # The next size up is no larger than C, yet no device holds it.
            bound = min(bound, round_down(most_free.free, quantum))
    if quantum == HUNDREDTH:
        return bound  # EVENLY splits in hundredths: every accepted size arrives whole
    size = quantum
    for _ in range(_SEARCH_LIMIT):
        if size > bound:
            break
        result = evenly(devices, size, quantum, rule)
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
    rule: NoFragRule = NoFragRule.MULTI_DEVICE,
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
    ):
        # EVENLY keeps every request that fits on one device on one device (best fit) and only
        # splits once none does, so the single-device phase ends with each device holding its
        # free space modulo the request: no need to replay it request by request.
        per_device = [math.floor(d.free / amount) if d.free >= amount else 0 for d in current]
        placed = min(sum(per_device), limit)
        current = [replace(d, allocated=d.allocated + k * amount) for d, k in zip(current, per_device, strict=True)]
    while placed < limit:
        result = place(current, request, policy, quantum=quantum, rule=rule)
        if isinstance(result, Rejection):
            break
        current = apply_placement(current, result)
        placed += 1
    return placed


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
    devices: Sequence[DeviceFree], quantum: Decimal, rule: NoFragRule, *, unique: bool = False
) -> SlotHeadroom:
    """All headroom figures of one slot at once. Whole-device and MIG slots pass quantum 1: their
    headroom is then the number of free devices, with or without fragmentation.

    :param unique: the slot is ``UNIQUE`` (MIG): a request is exactly one device, so headroom is
        at most 1 however many are free.
    """
    allowed, guarded = headroom(devices, quantum), headroom(devices, quantum, rule)
    gapless, gapless_nofrag = contiguous_headroom(devices, quantum), contiguous_headroom(devices, quantum, rule)
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
