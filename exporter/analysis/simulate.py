"""What-if placement for the ``simulate`` subcommand and ``/api/v1/simulate``.

``simulate(state, "cuda.shares=1.5", "evenly")`` places one request on a :class:`NodeState` (from
the live exporter, a scratch tree, or a JSON file written by :meth:`NodeState.to_json`) and
reports where it lands and the slot's headroom before and after. :func:`format_table` and
:func:`result_document` render the result; nothing here does I/O except :func:`load_state`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from exporter.analysis.headroom import SlotHeadroom
from exporter.analysis.node import NodeState
from exporter.analysis.placement import DeviceFree, Placement, Policy, Rejection, Request, apply_placement, place
from exporter.units import bounded

__all__ = ["SimulationResult", "format_table", "load_state", "parse_request", "result_document", "simulate"]


@dataclass(frozen=True)
class SimulationResult:
    """One what-if: the outcome, the slot's devices and its headroom before and after."""

    request: Request
    policy: Policy
    outcome: Placement | Rejection
    devices: tuple[DeviceFree, ...]  # before the placement, inventory order
    before: SlotHeadroom | None  # None when the node has no device of the slot
    after: SlotHeadroom | None  # None when rejected

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
    state: NodeState | Mapping[str, Any], request: Request | str, policy: Policy | str = Policy.EVENLY
) -> SimulationResult:
    """Place ``request`` (``SLOT=AMOUNT``) on ``state`` under ``policy`` without changing anything.

    :param state: a :class:`NodeState` or its JSON document.
    :raises ValueError: malformed request, unknown policy or malformed state document.
    """
    if not isinstance(state, NodeState):
        state = NodeState.from_json(state)
    if isinstance(request, str):
        request = parse_request(request)
    policy = Policy(policy)
    devices = state.slots.get(request.slot, ())
    if not devices:
        outcome: Placement | Rejection = Rejection("no-devices", f"no device of slot {request.slot} on this node")
        return SimulationResult(request, policy, outcome, (), None, None)
    outcome = place(
        devices, request, policy, quantum=state.slot_quantum(request.slot), rule=state.rule, links=state.links
    )
    after = state.summary(request.slot, apply_placement(devices, outcome)) if isinstance(outcome, Placement) else None
    return SimulationResult(request, policy, outcome, devices, state.summary(request.slot), after)


def load_state(path: str | Path) -> NodeState:
    """Read ``--state FILE``: a saved ``/api/v1/state`` document (its ``node_state``) or a bare
    node state; raises OSError or ValueError."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    if isinstance(doc, dict) and isinstance(doc.get("node_state"), dict):
        doc = doc["node_state"]
    return NodeState.from_json(doc)


_FIGURES = (  # (label, SlotHeadroom attribute)
    ("headroom, fragmentation allowed", "headroom"),
    ("headroom, fragmentation disallowed", "headroom_nofrag"),
    ("largest free on one device", "max_single_device_free"),
    ("whole free devices", "whole_free_devices"),
    ("fragmentation ratio", "fragmentation_ratio"),
)


def result_document(result: SimulationResult) -> dict[str, Any]:
    """The JSON answer (amounts as exact decimal strings)."""
    outcome = result.outcome
    placed = outcome.amounts if isinstance(outcome, Placement) else {}
    return {
        "request": {"slot": result.request.slot, "amount": str(result.request.amount)},
        "policy": result.policy.value,
        "placed": result.placed,
        "placement": {d: str(v) for d, v in placed.items()},
        "total": str(outcome.total) if isinstance(outcome, Placement) else "0",
        "note": outcome.note if isinstance(outcome, Placement) else "",
        "rejection": {"reason": outcome.reason, "detail": outcome.detail} if isinstance(outcome, Rejection) else None,
        "devices": [
            {
                "device_id": d.device_id,
                "capacity": str(d.capacity),
                "allocated": str(d.allocated),
                "placed": str(placed.get(d.device_id, Decimal(0))),
            }
            for d in result.devices
        ],
        "headroom": {"before": _figures(result.before), "after": _figures(result.after)},
    }


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
    lines = [f"request  {result.request}", f"policy   {result.policy.value}"]
    if isinstance(outcome, Placement):
        where = ", ".join(f"{d} {v}" for d, v in outcome.amounts.items())
        lines.append(f"result   placed {outcome.total} on {len(outcome.amounts)} device(s): {where}")
        if outcome.note:
            lines.append(f"note     {outcome.note}")
    else:
        lines.append(f"result   rejected ({outcome.reason}): {outcome.detail}")
    if result.devices:
        placed = outcome.amounts if isinstance(outcome, Placement) else {}
        rows = [("device", "capacity", "allocated", "free", "placed", "free after")]
        for d in result.devices:
            add = placed.get(d.device_id, Decimal(0))
            rows.append(
                (
                    d.device_id,
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
