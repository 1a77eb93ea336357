"""Request shapes: would a session of this size start on this node, and where would the manager send it?

Backend.AI starts a session in two steps. The manager (``sokovan/scheduler/provisioner/selectors/``)
keeps the agents whose **remaining slot totals** (what each agent reports minus what its kernels
occupy) cover the request and ranks them by those totals; the chosen agent then places the request
on its devices (:mod:`exporter.analysis.placement`), with the fragmentation guard and NUMA. An agent
whose totals look free but whose free shares are scattered is chosen and then refuses: the user
sees "not enough resources" although the fleet's totals say there is room.

This module answers, per node and per configured :class:`Shape`: the remaining totals as the
manager computes them (:func:`remaining_totals`), whether the agent would place the shape with
fragmentation allowed and disallowed, and if not, why (:func:`shape_figures`); and, to compare
with the HAMi scheduler, HAMi's node score of each slot (:func:`hami_node_scores`: its ``binpack``
node policy sends a request to the placeable node with the highest score, ``spread`` to the lowest)
and the devices HAMi's device policies would pick for each shape. The fleet answer is
PromQL over these series (``alerts/gpu-alloc-fleet.rules.yml``); :func:`rank_agents` is the same
ranking in Python, the model the rules are written from and the differential tests compare with the
released manager.

A shape is ``NAME=SLOT:AMOUNT,...`` (``fgpu-1=cuda.shares:1,cpu:4,mem:16g``): exactly one
accelerator slot (its devices are where placement can fail) and optionally the agent's intrinsic
slots (``cpu`` in cores, ``mem`` in bytes or a BinarySize), which the manager filters and ranks by
too. Pure functions, no I/O; exact ``Decimal`` amounts in each slot's unit.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from decimal import Decimal

from exporter.analysis.capacity import is_mig_slot
from exporter.analysis.node import NodeState
from exporter.analysis.placement import DeviceFree, Placement, Policy, Request, place
from exporter.analysis.simulate import HamiPolicy, hami_place, hami_score
from exporter.units import bounded, parse_binary_size, parse_decimal

__all__ = [
    "DEFAULT_SHAPES",
    "DEFAULT_SHAPE_TEXTS",
    "HAMI_POLICIES",
    "HamiPick",
    "MANAGER_PRIORITY",
    "REASONS",
    "SELECTORS",
    "Shape",
    "ShapeFigures",
    "ShapeVerdict",
    "hami_node_scores",
    "hami_rank",
    "rank_agents",
    "remaining_totals",
    "shape_figures",
]

_ZERO = Decimal(0)
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")

# (fGPU shares, CPU cores, memory): a shape's CPU and memory grow with its GPU share.
DEFAULT_SHAPE_TEXTS = (
    "fgpu-0.5=cuda.shares:0.5,cpu:2,mem:8g",
    "fgpu-1=cuda.shares:1,cpu:4,mem:16g",
    "fgpu-2=cuda.shares:2,cpu:8,mem:32g",
    "fgpu-4=cuda.shares:4,cpu:16,mem:64g",
    "fgpu-8=cuda.shares:8,cpu:32,mem:128g",
)

# Why a node refuses a shape (label ``reason``), in the order they are judged:
#   mig_profile_missing  the shape's MIG slot is not on the node at all
#   capacity             the node's remaining total of the slot is below the request (the
#                        manager never picks it), or the node has no device of the slot
#   stale_allocation     it would be placed if stale kernels' allocations were left out (only
#                        with --no-headroom.exclude-stale: by default they already are)
#   numa                 the fragmentation guard refuses it only because of the NUMA order: the
#                        first device of the agent's NUMA chain sets the guard's capacity
#   fragmented           the totals cover it, the devices' free pieces do not
REASONS = ("mig_profile_missing", "capacity", "stale_allocation", "numa", "fragmented")

# The manager's strategies the rules and :func:`rank_agents` reproduce. ``roundrobin`` rotates an
# in-process index over the compatible agents: not predictable from outside the manager.
SELECTORS = ("concentrated", "dispersed", "legacy")

# backend.ai-manager 26.9.6 ``agent-selection-resource-priority`` default. It is compared with
# slot names exactly, so ``cuda`` matches no ``cuda.*`` slot: with it, agents are ranked by
# remaining CPU cores, then memory, then (alphabetically) the other requested slots.
MANAGER_PRIORITY = ("cuda", "rocm", "tpu", "cpu", "mem")


@dataclass(frozen=True, slots=True)
class Shape:
    """A named request: slot -> amount (accelerator slot first), as a session would ask for it."""

    name: str
    slots: tuple[tuple[str, Decimal], ...]

    @property
    def accelerator(self) -> tuple[str, Decimal]:
        """(slot, amount) of the one accelerator slot: where device placement can fail."""
        return self.slots[0]

    @property
    def request(self) -> dict[str, Decimal]:
        return dict(self.slots)

    @classmethod
    def parse(cls, text: str) -> Shape:
        """Parse ``NAME=SLOT:AMOUNT,...``; raises ValueError with a one-line reason."""
        name, sep, body = text.partition("=")
        name = name.strip()
        if not sep or not body.strip():
            raise ValueError("expected NAME=SLOT:AMOUNT,..., e.g. fgpu-1=cuda.shares:1,cpu:4,mem:16g")
        if not _NAME.fullmatch(name):
            raise ValueError("NAME must be letters, digits, '_', '.' or '-' (at most 64)")
        slots: dict[str, Decimal] = {}
        for item in body.split(","):
            slot, colon, amount = item.strip().rpartition(":")
            slot, amount = slot.strip(), amount.strip()
            if not colon or not slot or not amount:
                raise ValueError(f"expected SLOT:AMOUNT, got {item.strip()[:40]!r}")
            if slot in slots:
                raise ValueError(f"slot {slot} given twice")
            try:
                value = Decimal(parse_binary_size(amount)) if slot == "mem" else parse_decimal(amount)
                bounded(value, amount)
            except ValueError as exc:
                raise ValueError(f"{slot}: {exc}") from None
            if value <= 0:
                raise ValueError(f"{slot}: the amount must be positive")
            slots[slot] = value
        accelerators = [s for s in slots if "." in s]
        if len(accelerators) != 1:
            raise ValueError("a shape names exactly one accelerator slot (such as cuda.shares or cuda.device)")
        first = accelerators[0]
        ordered = ((first, slots[first]), *((s, a) for s, a in slots.items() if s != first))
        return cls(name, ordered)

    def __str__(self) -> str:
        return f"{self.name}=" + ",".join(f"{s}:{a}" for s, a in self.slots)


DEFAULT_SHAPES = tuple(Shape.parse(t) for t in DEFAULT_SHAPE_TEXTS)


@dataclass(frozen=True, slots=True)
class ShapeVerdict:
    """One shape on one node, one fragmentation mode: placed, or the reason it is refused."""

    shape: str
    fragmentation: str  # "allowed" or "disallowed"
    placeable: bool
    reason: str | None  # one of REASONS when refused


# HAMi's policy names (``hami.io/node-scheduler-policy``, ``hami.io/gpu-scheduler-policy``) and
# the device policy :mod:`exporter.analysis.simulate` plays for each.
HAMI_POLICIES = {"binpack": HamiPolicy.BINPACK, "spread": HamiPolicy.SPREAD}


@dataclass(frozen=True, slots=True)
class HamiPick:
    """One shape under one HAMi device policy on this node: the devices it would take
    (device id -> amount), or None with the allocator's rejection reason."""

    shape: str
    policy: str  # "binpack" or "spread"
    placement: Mapping[str, Decimal] | None
    reason: str | None = None


@dataclass(frozen=True)
class ShapeFigures:
    """What the fleet rules read of one node: remaining totals per slot, the shapes' requests
    (accelerator slot and amount) and a verdict per shape and fragmentation mode; HAMi's node
    score per slot and each shape's devices under HAMi's device policies."""

    remaining: Mapping[str, Decimal] = field(default_factory=dict)
    shapes: tuple[Shape, ...] = ()
    verdicts: tuple[ShapeVerdict, ...] = ()
    hami_scores: Mapping[str, Decimal] = field(default_factory=dict)
    hami_picks: tuple[HamiPick, ...] = ()


def _registered(state: NodeState, slot: str, d: DeviceFree) -> Decimal:
    # The agent registers the device's whole capacity; the node state's row may have had memory
    # no share can get (driver-reserved, ghost) taken off it.
    return d.capacity + state.blocked.get((d.device_id, slot), _ZERO)


def remaining_totals(state: NodeState) -> dict[str, Decimal]:
    """Per accelerator slot, what the manager sees left on this node's agent: the total the agent
    reports (its devices' registered capacity) minus what its kernels occupy. Stale kernels count
    as the node state counts them (``--headroom.exclude-stale``). May be negative when
    overcommitted, as the manager's own figure can be."""
    return {slot: sum((_registered(state, slot, d) - d.allocated for d in devices), _ZERO)
            for slot, devices in state.slots.items()}


def hami_node_scores(state: NodeState) -> dict[str, Decimal]:
    """Per accelerator slot, HAMi's node score (``NodeScore.ComputeDefaultScore``): the used
    ratios of the node's devices summed over them, before the request
    (:func:`~exporter.analysis.simulate.hami_score` of what the kernels occupy over the registered
    total). HAMi's ``binpack`` node policy prefers the highest score, ``spread`` the lowest; slots
    without capacity are left out."""
    out = {}
    for slot, devices in state.slots.items():
        total = sum((_registered(state, slot, d) for d in devices), _ZERO)
        if total > 0:
            out[slot] = hami_score(sum((d.allocated for d in devices), _ZERO), total)
    return out


def _hami_pick(state: NodeState, shape: Shape, policy: str) -> HamiPick:
    slot, amount = shape.accelerator
    devices = state.slots.get(slot)
    if not devices:
        return HamiPick(shape.name, policy, None, "no-devices")
    result = hami_place(devices, Request(slot, amount), HAMI_POLICIES[policy], state.slot_quantum(slot))
    if isinstance(result, Placement):
        return HamiPick(shape.name, policy, dict(result.amounts))
    return HamiPick(shape.name, policy, None, result.reason)


def _placed(state: NodeState, devices: Sequence[DeviceFree], slot: str, amount: Decimal, guarded: bool) -> bool:
    policy = Policy.EVENLY_NOFRAG if guarded else Policy.EVENLY
    result = place(devices, Request(slot, amount), policy, quantum=state.slot_quantum(slot), rule=state.rule,
                   affinity=state.affinity)
    return isinstance(result, Placement)


def _verdict(state: NodeState, remaining: Mapping[str, Decimal], shape: Shape, guarded: bool,
             stale_counted: bool) -> tuple[bool, str | None]:
    slot, amount = shape.accelerator
    devices = state.slots.get(slot)
    if not devices:
        return False, "mig_profile_missing" if is_mig_slot(slot) else "capacity"
    if remaining.get(slot, _ZERO) < amount:
        return False, "capacity"
    if _placed(state, devices, slot, amount, guarded):
        return True, None
    stale = {d: a for (d, s), a in state.stale.items() if s == slot}
    if stale_counted and stale:
        freed = [replace(d, allocated=d.allocated - stale.get(d.device_id, _ZERO)) for d in devices]
        if _placed(state, freed, slot, amount, guarded):
            return False, "stale_allocation"
    if guarded and len({d.numa_node for d in devices}) > 1:
        flat = [replace(d, numa_node=None) for d in devices]
        if _placed(state, flat, slot, amount, guarded):
            return False, "numa"
    return False, "fragmented"


def shape_figures(state: NodeState, shapes: Sequence[Shape], exclude_stale: bool = True) -> ShapeFigures:
    """Remaining totals and every shape's verdict on ``state``, fragmentation allowed and disallowed.

    :param exclude_stale: ``state`` already leaves stale kernels out of ``allocated``
        (``--headroom.exclude-stale``, the default), so ``stale_allocation`` is never the reason;
        otherwise a refusal that leaving them out would turn into a placement is ``stale_allocation``.
    """
    remaining = remaining_totals(state)
    verdicts = []
    for shape in shapes:
        for label, guarded in (("allowed", False), ("disallowed", True)):
            ok, reason = _verdict(state, remaining, shape, guarded, stale_counted=not exclude_stale)
            verdicts.append(ShapeVerdict(shape.name, label, ok, reason))
    picks = tuple(_hami_pick(state, shape, policy) for shape in shapes for policy in HAMI_POLICIES)
    return ShapeFigures(remaining, tuple(shapes), tuple(verdicts), hami_node_scores(state), picks)


# --- the manager's ranking ----------------------------------------------------------------------


def _unutilized(totals: Mapping[str, Decimal], request: Mapping[str, Decimal]) -> int:
    # count_unutilized_capabilities: slots the request asks 0 of that the agent still has left.
    # A shape's amounts are positive, so this is 0 for shapes; kept for requests with zeros.
    zero = {s for s, a in request.items() if a == 0}
    return sum(1 for s, left in totals.items() if s in zero and left > 0)


def _priority_order(request: Mapping[str, Decimal], priority: Sequence[str]) -> list[str]:
    # order_slots_by_priority: exact names from the priority list first, then the rest sorted.
    first = [s for s in priority if s in request]
    return first + sorted(set(request) - set(first))


def rank_agents(
    remaining: Mapping[str, Mapping[str, Decimal]],
    request: Mapping[str, Decimal],
    selector: str,
    priority: Sequence[str] = MANAGER_PRIORITY,
) -> tuple[str, ...]:
    """The agents ``selector`` ranks first for ``request``, all of them when tied (the manager
    takes the first of the tie in its own agent order): agent id -> slot -> remaining total.

    An agent is a candidate when its remaining total of every requested slot covers the request
    (``ResourceTrackerFilter``; a slot it lacks counts as 0). ``concentrated`` prefers fewer
    unutilised capabilities, then the least remaining in ``priority`` order; ``dispersed`` and
    ``legacy`` (the same key in 26.9.6) the most. Empty: no candidate.
    """
    if selector not in SELECTORS:
        raise ValueError(f"selector must be one of {', '.join(SELECTORS)}, not {selector!r}")
    order = _priority_order(request, priority)
    candidates = [a for a, totals in remaining.items()
                  if all(amount <= totals.get(slot, _ZERO) for slot, amount in request.items())]
    if not candidates:
        return ()
    if selector == "concentrated":
        def key(agent: str) -> tuple:
            totals = remaining[agent]
            return (_unutilized(totals, request), *(totals.get(s, Decimal(sys.maxsize)) for s in order))
        best = min(key(a) for a in candidates)
    else:
        def key(agent: str) -> tuple:
            totals = remaining[agent]
            return (-_unutilized(totals, request), *(totals.get(s, Decimal(-sys.maxsize)) for s in order))
        best = max(key(a) for a in candidates)
    return tuple(a for a in candidates if key(a) == best)


def hami_rank(scores: Mapping[str, Decimal], policy: str) -> tuple[str, ...]:
    """Nodes (node id -> HAMi node score of the request's slot, for the nodes that can place it)
    in the order HAMi's node ``policy`` prefers them: ``binpack`` the highest score first,
    ``spread`` the lowest; equal scores keep the given order (HAMi's sort is not stable, so it
    may take any of them). The first is where HAMi sends the request."""
    if policy not in HAMI_POLICIES:
        raise ValueError(f"policy must be one of {', '.join(HAMI_POLICIES)}, not {policy!r}")
    sign = -1 if policy == "binpack" else 1
    return tuple(sorted(scores, key=lambda node: sign * scores[node]))
