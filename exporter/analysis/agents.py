"""Which Backend.AI agents run on this host, and which kernel belongs to which: the agent layout.

Since 25.17 one host may run several agents (``[[agents]]`` in agent.toml); each keeps its own
allocation map and answers its own ``gpu_alloc_map`` RPC. The configuration room
(:func:`exporter.config.agent_layout`) resolves flags and agent.toml into an immutable
:class:`AgentLayout`; here, each agent's own view of the allocation and its headroom.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from decimal import Decimal
from types import MappingProxyType

from exporter.analysis.capacity import agent_slot_total
from exporter.analysis.node import NodeState
from exporter.scratch.allocation import AllocationView, Kernel, KernelState, absolute_alloc_map, is_accelerator_slot
from exporter.scratch.identity import UNDEFINED

__all__ = ["AgentHeadroom", "AgentLayout", "agent_headroom", "agent_views"]


@dataclass(frozen=True)
class AgentLayout:
    """This host's agents as the exporter sees them.

    :param roots: scratch roots to read, in order.
    :param bindings: scratch root → the one agent writing there (a root shared by several agents,
        or whose agent is not known, is absent: its kernels are split by ``recovery.json``).
    :param agents: the host's agent ids, in agent.toml's order (``auto-split`` remainders follow
        it); empty when no id is known.
    :param allocation_mode: ``[resource] allocation-mode``: ``shared``, ``auto-split``, ``manual``.
    :param allocations: ``manual`` mode: agent id → slot → the amount configured for it.
    :param source: the agent.toml read, if any.
    """

    roots: tuple[str, ...]
    bindings: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    agents: tuple[str, ...] = ()
    allocation_mode: str = "shared"
    allocations: Mapping[str, Mapping[str, Decimal]] = field(default_factory=lambda: MappingProxyType({}))
    source: str | None = None
    affinity_policy: str | None = None  # [resource] affinity-policy; None: the agent's default

    @property
    def multi_agent(self) -> bool:
        """More than one agent on this host: per-agent series and maps are served."""
        return len(self.agents) > 1

    @property
    def default_agent_id(self) -> str | None:
        """The host's one agent id (``gpu_alloc_build_info``, kernels not identified yet), else None."""
        return self.agents[0] if len(self.agents) == 1 else None

    def agent_of(self, kernel: Kernel) -> str:
        """The agent a kernel belongs to: the one its ``recovery.json`` names when that is one of
        this host's agents, else its root's agent, else the host's only agent, else ``undefined``."""
        named = kernel.identity.agent_id if kernel.identity is not None else UNDEFINED
        if named != UNDEFINED and named in self.agents:
            return named
        bound = self.bindings.get(kernel.scratch_root)
        if bound is not None:
            return bound
        return self.default_agent_id or UNDEFINED

    def roots_of(self, agent_id: str) -> tuple[str, ...]:
        """The roots an agent writes to: its own, and every root not tied to one agent."""
        return tuple(r for r in self.roots if self.bindings.get(r, agent_id) == agent_id)


def agent_views(view: AllocationView, layout: AgentLayout) -> dict[str, AllocationView]:
    """Each host agent's own share of ``view``: the kernels it owns (:meth:`AgentLayout.agent_of`),
    with totals and ``alloc_map`` recomputed over them, as that agent's RPC would answer.

    O(allocations); the caller caches the result per view version. Kernels whose agent is not
    known (a shared root, no ``recovery.json`` yet) are in no agent's view.
    """
    own: dict[str, dict[str, Kernel]] = {a: {} for a in layout.agents}
    for kernel_id, kernel in view.kernels.items():
        bucket = own.get(layout.agent_of(kernel))
        if bucket is not None:
            bucket[kernel_id] = kernel
    out = {}
    for agent_id, kernels in own.items():
        device: dict[tuple[str, str], Decimal] = {}
        node: dict[str, Decimal] = {}
        counts = dict.fromkeys(KernelState, 0)
        for kernel in kernels.values():
            counts[kernel.state] += 1
            for a in kernel.allocations:
                if is_accelerator_slot(a.slot):
                    device[(a.device_id, a.slot)] = device.get((a.device_id, a.slot), Decimal(0)) + a.amount
                else:
                    node[a.slot] = node.get(a.slot, Decimal(0)) + a.amount
        allocations = (a for k in kernels.values() for a in k.allocations)
        out[agent_id] = AllocationView(
            version=view.version,
            kernels=MappingProxyType(kernels),
            device_totals=MappingProxyType(dict(sorted(device.items()))),
            node_totals=MappingProxyType(node),
            state_counts=MappingProxyType(counts),
            parse_errors_total=0,
            created_at=view.created_at,
            alloc_map=MappingProxyType(absolute_alloc_map(allocations)),
            agent_unreadable=MappingProxyType({k: r for k, r in view.agent_unreadable.items() if k in kernels}),
        )
    return out


@dataclass(frozen=True, slots=True)
class AgentHeadroom:
    """One agent's figures for one slot.

    :param total: what the agent reports to the scheduler (:func:`agent_slot_total`), or None
        (``manual`` mode without an amount for the slot).
    :param allocated: what its own kernels hold.
    :param headroom: the largest request it would place now, in its own map (every device whole)
        and within what its reported total leaves; ``nofrag``: with the fragmentation guard.
    """

    total: Decimal | None
    allocated: Decimal
    headroom: Decimal
    headroom_nofrag: Decimal


def agent_headroom(node: NodeState, own: NodeState, layout: AgentLayout, agent_id: str) -> dict[str, AgentHeadroom]:
    """Per slot, an agent's headroom: ``own`` is :func:`~exporter.analysis.node.node_state` over
    its view (each device at its whole capacity, only its kernels' allocations), ``node`` the
    whole host's (for the node totals ``allocation-mode`` splits)."""
    index = layout.agents.index(agent_id)
    manual = layout.allocations.get(agent_id, {})
    out = {}
    for slot, node_devices in node.slots.items():
        # A slot none of its kernels hold: every device whole and free in its map.
        devices = own.slots.get(slot) or tuple(replace(d, allocated=Decimal(0)) for d in node_devices)
        node_total = sum((d.capacity for d in node.slots.get(slot, devices)), Decimal(0))
        try:
            total = agent_slot_total(layout.allocation_mode, slot, node_total, len(layout.agents), index, manual.get(slot))
        except ValueError:
            total = None
        allocated = sum((d.allocated for d in devices), Decimal(0))
        s = own.summary(slot, devices)
        # The scheduler offers the agent no more than its reported total leaves free.
        left = max(total - allocated, Decimal(0)) if total is not None else None
        room, nofrag = (s.headroom, s.headroom_nofrag) if left is None else (min(s.headroom, left), min(s.headroom_nofrag, left))
        out[slot] = AgentHeadroom(total, allocated, room, nofrag)
    return out
