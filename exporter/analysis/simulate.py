"""What-if placement for the ``simulate`` subcommand and ``/api/v1/simulate``.

``simulate(state, "cuda.shares=1.5", "evenly")`` places one request on a :class:`NodeState` (from
the live exporter, a scratch tree, or a JSON file written by :meth:`NodeState.to_json`) and
reports where it lands and the slot's headroom before and after. :func:`format_table` and
:func:`result_document` render the result; nothing here does I/O except :func:`load_state`
(:func:`parse_state` reads the text).

Besides the allocators of :class:`~exporter.analysis.placement.Policy`, the HAMi scheduler's
device policies (:class:`HamiPolicy`, ``hami-binpack`` and ``hami-spread``) rank the slot's
devices by HAMi's device score (:func:`hami_score`, :func:`hami_device_order`) and take the first
that hold the request's part (:func:`hami_place`); docs/headroom.md gives the formula.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from enum import Enum
from pathlib import Path
from typing import Any

from exporter.analysis.headroom import SlotHeadroom
from exporter.analysis.node import NodeState
from exporter.analysis.placement import (
    DEFAULT_AFFINITY,
    DEFAULT_RULE,
    AffinityPolicy,
    DeviceFree,
    NoFragRule,
    Placement,
    Policy,
    Rejection,
    Request,
    apply_placement,
    place,
)
from exporter.units import bounded, parse_decimal

__all__ = [
    "HAMI_WEIGHT",
    "POLICIES",
    "HamiPolicy",
    "SimulationResult",
    "format_table",
    "hami_device_order",
    "hami_place",
    "hami_score",
    "load_state",
    "parse_policy",
    "parse_request",
    "parse_state",
    "result_document",
    "simulate",
]


class HamiPolicy(str, Enum):
    """HAMi's GPU scheduler policies (``hami.io/gpu-scheduler-policy``), played on this node's devices."""

    BINPACK = "hami-binpack"  # the device with the highest score first
    SPREAD = "hami-spread"  # the device with the lowest score first


# Every policy ``simulate`` accepts: Backend.AI's and the other allocators', then HAMi's.
POLICIES = (*(p.value for p in Policy), *(p.value for p in HamiPolicy))

# HAMi's score weight (pkg/util ``Weight``): a score is 10 × the sum of its used ratios.
HAMI_WEIGHT = Decimal(10)
_ZERO = Decimal(0)


def parse_policy(text: str | Policy | HamiPolicy) -> Policy | HamiPolicy:
    """A policy name of :data:`POLICIES`; raises ValueError naming the choices."""
    if isinstance(text, Policy | HamiPolicy):
        return text
    for kind in (Policy, HamiPolicy):
        try:
            return kind(text)
        except ValueError:
            pass
    raise ValueError(f"expected one of {', '.join(POLICIES)}")


def hami_score(used: Decimal, total: Decimal) -> Decimal:
    """HAMi's score of ``used`` out of ``total`` shares (one device, or a node's devices summed).

    HAMi adds three used ratios, each times its weight (default 1), and multiplies the sum by
    :data:`HAMI_WEIGHT`: tasks on the GPU over its split count, cores and memory. A Backend.AI
    share is a fixed part of a device's SMs (``unit_proc``) and memory (``unit_mem``), so the core
    and the memory ratio are both ``used / total``; the task term has no Backend.AI counterpart
    (no per-GPU task limit) and is left out, as a slot weight of 0 would. 0 when ``total`` is not
    positive, as HAMi scores a device without capacity. Range 0 to 20 (more when overcommitted).
    """
    if total <= 0:
        return _ZERO
    return HAMI_WEIGHT * 2 * used / total


def hami_device_order(devices: Sequence[DeviceFree], part: Decimal, policy: HamiPolicy) -> list[DeviceFree]:
    """``devices`` in the order HAMi's ``Fit`` tries them for a request of ``part`` per device.

    Each device's score counts the part as if placed there (:func:`hami_score` of allocated plus
    ``part``). HAMi sorts the devices (binpack: score ascending; spread: descending; equal scores by
    NUMA node ascending) and ``Fit`` walks the list from its end: binpack tries the highest score
    first, spread the lowest, and on equal scores the higher NUMA node first (unknown counts as 0,
    HAMi's default). Devices equal in both keep inventory order (HAMi's sort is not stable).
    """
    def numa(d: DeviceFree) -> int:
        return d.numa_node or 0

    def score(d: DeviceFree) -> Decimal:
        return hami_score(d.allocated + part, d.capacity)

    if policy is HamiPolicy.BINPACK:
        return sorted(devices, key=lambda d: (-score(d), -numa(d)))
    return sorted(devices, key=lambda d: (score(d), -numa(d)))


def hami_place(devices: Sequence[DeviceFree], request: Request, policy: HamiPolicy, quantum: Decimal) -> Placement | Rejection:
    """Place ``request`` as HAMi's device policy would pick the devices.

    The request is cut as the whole-device policies cut it (equal parts on the fewest devices that
    can each hold the largest part; whole devices and MIG instances count one each); then the
    devices are taken in :func:`hami_device_order` for that part, the first ones that hold it.
    """
    first = place(devices, request, Policy.SIMPLE, quantum=quantum)
    if not isinstance(first, Placement):
        return first
    part = min(first.amounts.values())  # the parts differ by one quantum at most
    return place(hami_device_order(devices, part, policy), request, Policy.SIMPLE, quantum=quantum)


@dataclass(frozen=True)
class SimulationResult:
    """One what-if: the outcome, the slot's devices and its headroom before and after, and the
    agent release (``rule``) and ``affinity-policy`` the allocator and the figures followed."""

    request: Request
    policy: Policy | HamiPolicy
    outcome: Placement | Rejection
    devices: tuple[DeviceFree, ...]  # before the placement, inventory order
    before: SlotHeadroom | None  # None when the node has no device of the slot
    after: SlotHeadroom | None  # None when rejected
    rule: NoFragRule = DEFAULT_RULE
    affinity: AffinityPolicy = DEFAULT_AFFINITY

    @property
    def placed(self) -> bool:
        return isinstance(self.outcome, Placement)


def parse_request(text: str) -> Request:
    """``SLOT=AMOUNT`` with the amount bounded as the resource.txt parser bounds amounts (at most
    10^18, at most 9 decimal places), so no placement runs on an astronomically large or fine
    amount; raises ValueError."""
    request = Request.parse(text)
    bounded(request.amount, text.partition("=")[2].strip())
    return request


def simulate(
    state: NodeState | Mapping[str, Any], request: Request | str, policy: Policy | HamiPolicy | str = Policy.EVENLY
) -> SimulationResult:
    """Place ``request`` (``SLOT=AMOUNT``) on ``state`` under ``policy`` (one of :data:`POLICIES`)
    without changing anything.

    :param state: a :class:`NodeState` or its JSON document.
    :raises ValueError: malformed request, unknown policy or malformed state document.
    """
    if not isinstance(state, NodeState):
        state = NodeState.from_json(state)
    if isinstance(request, str):
        request = parse_request(request)
    policy = parse_policy(policy)
    devices = state.slots.get(request.slot, ())
    if not devices:
        others = ", ".join(sorted(state.slots)) or "none"
        detail = f"no device of slot {request.slot} on this node (its slots: {others})"
        outcome: Placement | Rejection = Rejection("no-devices", detail)
        return SimulationResult(request, policy, outcome, (), None, None, state.rule, state.affinity)
    if isinstance(policy, HamiPolicy):
        outcome = hami_place(devices, request, policy, state.slot_quantum(request.slot))
    else:
        outcome = place(
            devices,
            request,
            policy,
            quantum=state.slot_quantum(request.slot),
            rule=state.rule,
            affinity=state.affinity,
            links=state.links,
        )
    after = state.summary(request.slot, apply_placement(devices, outcome)) if isinstance(outcome, Placement) else None
    return SimulationResult(request, policy, outcome, devices, state.summary(request.slot), after, state.rule, state.affinity)


def load_state(path: str | Path) -> NodeState:
    """Read ``--state FILE``; raises ValueError with one line naming the file and the reason."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(_MAX_STATE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"--state {path}: cannot read the file ({exc.strerror or 'unreadable'})") from None
    except UnicodeDecodeError:
        raise ValueError(f"--state {path}: not UTF-8 text") from None
    if len(text) > _MAX_STATE_BYTES:
        raise ValueError(f"--state {path}: larger than {_MAX_STATE_BYTES >> 20} MiB")
    try:
        return parse_state(text)
    except ValueError as exc:
        raise ValueError(f"--state {path}: {exc}") from None


_MAX_STATE_BYTES = 64 << 20  # a 10,000-kernel node's /api/v1/state is a few MiB
_RULES = ", ".join(r.value for r in NoFragRule)
_AFFINITIES = ", ".join(a.value for a in AffinityPolicy)


def parse_state(text: str) -> NodeState:
    """Parse a saved ``/api/v1/state`` document (its ``node_state``) or a bare node state
    (:meth:`NodeState.to_json`). Raises ValueError with a one-line reason that names the place in
    the document, never its content."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise ValueError("not JSON (nested too deeply)") from None
    where = ""
    if isinstance(doc, dict) and "node_state" in doc:
        doc, where = doc["node_state"], "node_state."
    if not isinstance(doc, dict) or "slots" not in doc:
        raise ValueError(f"no {where}slots: expected a saved /api/v1/state document (curl …/api/v1/state) or its node_state")
    slots = doc["slots"]
    if not isinstance(slots, dict):
        raise ValueError(f"{where}slots is not an object of slot → devices")
    for slot, devices in slots.items():
        if not isinstance(devices, list):
            raise ValueError(f"{where}slots[{slot!r}] is not a list of devices")
        for i, d in enumerate(devices):
            _check_entry(d, f"{where}slots[{slot!r}][{i}]", ("device_id", "capacity", "allocated"))
    if "quantum" in doc:
        quantum = _amount(doc["quantum"], f"{where}quantum")
        if quantum == 0:
            raise ValueError(f"{where}quantum must be positive")
    if doc.get("nofrag_rule", DEFAULT_RULE.value) not in {r.value for r in NoFragRule}:
        raise ValueError(f"{where}nofrag_rule must be one of {_RULES}")
    if doc.get("affinity_policy", DEFAULT_AFFINITY.value) not in {a.value for a in AffinityPolicy}:
        raise ValueError(f"{where}affinity_policy must be one of {_AFFINITIES}")
    for key, fields in (("links", ("devices", "score")), ("stale", ("device_id", "slot", "allocated"))):
        entries = doc.get(key, [])
        if not isinstance(entries, list):
            raise ValueError(f"{where}{key} is not a list")
        for i, entry in enumerate(entries):
            _check_entry(entry, f"{where}{key}[{i}]", fields)
    return NodeState.from_json(doc)


def _check_entry(entry: Any, where: str, fields: tuple[str, ...]) -> None:
    if not isinstance(entry, dict):
        raise ValueError(f"{where} is not an object")
    for name in fields:
        if name not in entry:
            raise ValueError(f"{where} has no {name!r}")
    for name in ("capacity", "allocated"):
        if name in fields:
            _amount(entry[name], f"{where}.{name}")
    if "capacity" in fields and entry.get("numa_node") is not None:
        numa = entry["numa_node"]
        if isinstance(numa, bool) or not isinstance(numa, int) or numa < 0:
            raise ValueError(f"{where}.numa_node is not a non-negative integer or null")
    if "devices" in fields and not (isinstance(entry["devices"], list) and len(entry["devices"]) == 2):
        raise ValueError(f"{where}.devices is not a pair of device ids")
    if "score" in fields and (isinstance(entry["score"], bool) or not isinstance(entry["score"], int)):
        raise ValueError(f"{where}.score is not an integer")


def _amount(value: Any, where: str) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"{where} is not a decimal number")
    try:
        return parse_decimal(str(value))
    except ValueError:
        raise ValueError(f"{where} is not a finite, non-negative decimal number") from None


_FIGURES = (  # (label, SlotHeadroom attribute)
    ("headroom, fragmentation allowed", "headroom"),
    ("headroom, fragmentation disallowed", "headroom_nofrag"),
    ("every size fits up to, allowed", "contiguous"),
    ("every size fits up to, disallowed", "contiguous_nofrag"),
    ("largest free on one device", "max_single_device_free"),
    ("whole free devices", "whole_free_devices"),
    ("fragmentation ratio", "fragmentation_ratio"),
)


def result_document(result: SimulationResult) -> dict[str, Any]:
    """The JSON answer (amounts as exact decimal strings)."""
    outcome = result.outcome
    placed = outcome.amounts if isinstance(outcome, Placement) else {}
    return {
        "request": {"slot": result.request.slot, "amount": _amount_text(result.request.amount)},
        "policy": result.policy.value,
        "nofrag_rule": result.rule.value,
        "affinity_policy": result.affinity.value,
        "placed": result.placed,
        "placement": {d: _amount_text(v) for d, v in placed.items()},
        "total": _amount_text(outcome.total) if isinstance(outcome, Placement) else "0",
        "note": outcome.note if isinstance(outcome, Placement) else "",
        "rejection": {"reason": outcome.reason, "detail": outcome.detail} if isinstance(outcome, Rejection) else None,
        "devices": [
            {
                "device_id": d.device_id,
                "capacity": _amount_text(d.capacity),
                "allocated": _amount_text(d.allocated),
                "numa_node": d.numa_node,
                "placed": _amount_text(placed.get(d.device_id, Decimal(0))),
            }
            for d in result.devices
        ],
        "headroom": {"before": _figures(result.before), "after": _figures(result.after)},
    } | ({"hami_scores": {d: _num(v) for d, v in _hami_scores(result).items()}} if isinstance(result.policy, HamiPolicy) else {})


def _hami_scores(result: SimulationResult) -> dict[str, Decimal]:
    # What HAMi sorted the devices by: each device's score with the request's part counted there
    # (the smallest part placed); a rejected request counts none.
    placed = result.outcome.amounts if isinstance(result.outcome, Placement) else {}
    part = min(placed.values(), default=_ZERO)
    return {d.device_id: hami_score(d.allocated + part, d.capacity) for d in result.devices}


def _amount_text(value: Decimal) -> str:
    """An amount as an exact decimal string. A quotient (a capacity from memory and SMs, an even
    split) can carry Decimal's 28 digits of trailing zeros ("11.96000000000000000000000000"):
    beyond the 9 places an amount may have, the zeros go; a value written with fewer places
    keeps them as written ("12.00")."""
    return str(value) if value.as_tuple().exponent >= -9 else format(value.normalize(), "f")


def _figures(h: SlotHeadroom | None) -> dict[str, str] | None:
    return None if h is None else {attr: _num(getattr(h, attr)) for _, attr in _FIGURES}


def _num(value: Decimal | int) -> str:
    # Ratios are exact quotients with up to 28 digits; four are plenty to read.
    return (
        str(value.quantize(Decimal("0.0001")))
        if isinstance(value, Decimal) and value.as_tuple().exponent < -4
        else str(value)
    )


def format_table(result: SimulationResult) -> str:
    """A plain-text report for the terminal."""
    outcome = result.outcome
    lines = [
        f"request  {result.request}",
        f"policy   {result.policy.value}",
        f"agent    rule {result.rule.value}, affinity-policy {result.affinity.value}",
    ]
    if isinstance(outcome, Placement):
        where = ", ".join(f"{d} {v}" for d, v in outcome.amounts.items())
        lines.append(f"result   placed {outcome.total} on {len(outcome.amounts)} device(s): {where}")
        if outcome.note:
            lines.append(f"note     {outcome.note}")
    else:
        lines.append(f"result   rejected ({outcome.reason}): {outcome.detail}")
    if isinstance(result.policy, HamiPolicy) and result.devices:
        scores = ", ".join(f"{d} {_num(v)}" for d, v in _hami_scores(result).items())
        lines.append(f"hami     device scores, the request's part counted: {scores}")
    if result.devices:
        placed = outcome.amounts if isinstance(outcome, Placement) else {}
        rows = [("device", "numa", "capacity", "allocated", "free", "placed", "free after")]
        for d in result.devices:
            add = placed.get(d.device_id, Decimal(0))
            rows.append(
                (
                    d.device_id,
                    "-" if d.numa_node is None else str(d.numa_node),
                    str(d.capacity),
                    str(d.allocated),
                    str(d.free),
                    str(add) if add else "-",
                    str(d.free - add),
                )
            )
        lines += ["", *_columns(rows)]
    if result.before is not None:
        rows = [("", "before", "after")]
        for label, attr in _FIGURES:
            after = _num(getattr(result.after, attr)) if result.after is not None else "-"
            rows.append((label, _num(getattr(result.before, attr)), after))
        lines += ["", *_columns(rows)]
    return "\n".join(lines) + "\n"


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
