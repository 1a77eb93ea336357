"""Which Backend.AI agents run on this host, and which kernel belongs to which: the agent layout.

Since 25.17 one host may run several agents (``[[agents]]`` in agent.toml); each keeps its own
allocation map and answers its own ``gpu_alloc_map`` RPC. :func:`resolve_agent_layout` is pure:
settings, the text of agent.toml (or None) and the host name in, an immutable
:class:`AgentLayout` out. Precedence, highest first:

* ``--scratch.agent ROOT=AGENT_ID`` (repeatable): the host's agents and their roots, replacing
  agent.toml's ``[[agents]]``;
* ``--scratch.root``: the roots to read (agent.toml's agents keep their ids; a root no agent
  names alone is split by each kernel's ``recovery.json``);
* ``--agent.id``: the id of the host's one agent (with several, ``--scratch.agent`` names them);
* agent.toml (``--agent.config``, else ``/etc/backend.ai/agent.toml`` when present): roots, ids,
  allocation mode; an agent without ``id`` takes ``i-<hostname>`` as the agent does off a cloud
  (a cloud instance id comes from a metadata service the exporter does not query: set the id).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from types import MappingProxyType

from exporter.analysis.capacity import agent_slot_total
from exporter.analysis.node import NodeState
from exporter.analysis.placement import DeviceFree
from exporter.scratch.agent_config import AgentConfigError, AgentToml, parse_agent_config
from exporter.scratch.allocation import AllocationView, Kernel, KernelState, absolute_alloc_map, is_accelerator_slot
from exporter.scratch.identity import UNDEFINED

# Stands for the agent's working directory where flags name the roots: never an absolute path, so
# never one of the roots read.
_UNKNOWN_DIR = "<agent working directory>"

__all__ = ["AgentFlags", "AgentHeadroom", "AgentLayout", "AgentLayoutError", "agent_headroom", "agent_views", "resolve_agent_layout"]


class AgentLayoutError(ValueError):
    """Flags and agent.toml that describe no usable layout; one line naming the flag or file."""


@dataclass(frozen=True)
class AgentFlags:
    """What the command line says about agents (the app builds this from its settings).

    :param scratch_roots: ``--scratch.root`` values, or their default when ``roots_given`` is False.
    :param roots_given: whether ``--scratch.root`` was set explicitly (it then wins over agent.toml).
    :param scratch_agents: ``--scratch.agent ROOT=AGENT_ID`` values.
    :param agent_id: ``--agent.id``, or None.
    """

    scratch_roots: tuple[str, ...]
    roots_given: bool = False
    scratch_agents: tuple[str, ...] = ()
    agent_id: str | None = None


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


def resolve_agent_layout(flags: AgentFlags, agent_toml: str | None, source: str | None, hostname: str) -> AgentLayout:
    """The layout the flags and agent.toml describe (see the module docstring for precedence).

    :param agent_toml: agent.toml's text, or None when none is read.
    :param source: its path, for error messages.
    :raises AgentLayoutError: one line naming the file or flag and the reason.
    """
    toml: AgentToml | None = None
    # A relative scratch-root (the agent's default ./scratches) cannot be located from outside the
    # agent; that only matters when no flag names the roots.
    roots_given = bool(flags.scratch_agents) or flags.roots_given
    if agent_toml is not None:
        try:
            toml = parse_agent_config(
                agent_toml, source or "agent.toml", working_dir=_UNKNOWN_DIR if roots_given else None
            ).with_default_ids(hostname)
        except AgentConfigError as exc:
            raise AgentLayoutError(str(exc).replace("\n", " ")) from None

    explicit = _parse_bindings(flags.scratch_agents)
    mode = toml.allocation_mode if toml else "shared"
    allocations: dict[str, Mapping[str, Decimal]] = {}
    if explicit:
        pairs = explicit
        if toml:
            allocations = {a.agent_id: a.allocations for a in toml.agents if a.agent_id in {i for _, i in pairs}}
    elif toml:
        pairs = [(a.scratch_root, a.agent_id) for a in toml.agents]  # ids set by with_default_ids
        allocations = {a.agent_id: a.allocations for a in toml.agents}
    else:
        pairs = []

    agents = tuple(dict.fromkeys(i for _, i in pairs))
    if flags.agent_id is not None:
        if len(agents) > 1:
            raise AgentLayoutError(
                f"--agent.id names one agent but {_where(explicit, source)} names {len(agents)}; "
                "tie roots to agents with --scratch.agent ROOT=AGENT_ID"
            )
        agents = (flags.agent_id,)
        pairs = [(root, flags.agent_id) for root, _ in pairs]

    if flags.roots_given or not pairs:
        roots = list(flags.scratch_roots)
    else:
        roots = []
    for root, _ in pairs:
        if root not in roots and Path(root).is_absolute() and (explicit or not flags.roots_given):
            roots.append(root)

    by_root: dict[str, set[str]] = {}
    for root, agent_id in pairs:
        by_root.setdefault(root, set()).add(agent_id)
    bindings = {r: next(iter(ids)) for r, ids in by_root.items() if len(ids) == 1 and r in roots}
    if len(agents) == 1:  # one agent: every root is its own
        bindings = dict.fromkeys(roots, agents[0])
    return AgentLayout(
        roots=tuple(roots),
        bindings=MappingProxyType(bindings),
        agents=agents,
        allocation_mode=mode,
        allocations=MappingProxyType(allocations),
        source=source if toml else None,
    )


def _parse_bindings(items: tuple[str, ...]) -> list[tuple[str, str]]:
    out = []
    for item in items:
        root, sep, agent_id = item.rpartition("=")
        if not sep or not root or not agent_id.strip() or any(c.isspace() for c in agent_id):
            raise AgentLayoutError(f"--scratch.agent expects ROOT=AGENT_ID, got {item!r}")
        if not Path(root).is_absolute():
            raise AgentLayoutError(f"--scratch.agent root {root!r} must be an absolute path")
        out.append((str(Path(root)), agent_id))
    return out


def _where(explicit: list[tuple[str, str]], source: str | None) -> str:
    return "--scratch.agent" if explicit else (source or "agent.toml")


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
        devices = own.slots.get(slot) or tuple(DeviceFree(d.device_id, d.capacity, Decimal(0)) for d in node_devices)
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
