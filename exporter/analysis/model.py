"""The read model: one immutable :class:`Analysis` per change, the only thing of ``analysis/``
that the metric parts and the routes read.

:mod:`exporter.analysis.pipeline` builds it after each allocation change and each telemetry
sample (coalesced), and replaces it as a whole; a reader holds one object and sees one
consistent node: the allocation view it was computed from, the device join (which telemetry
device each allocated id is), the inventory, the node state and its headroom figures, the
ratio alloc map's divisors, each agent's own share, stale kernels, process attribution and
accounting. Nothing here computes analysis at scrape time; the two query methods
(:meth:`Analysis.what_if`, :meth:`Analysis.ratio_map`) answer a request's own question from
the published state.

This module also names the analysis types that readers format (liveness verdicts, slot
figures, agent figures, attribution and accounting results), so that ``metrics/`` and ``web/``
import nothing else from ``analysis/``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from exporter.analysis.accounting import Accounting, DrivenCounters
from exporter.analysis.agents import AgentHeadroom, AgentLayout
from exporter.analysis.attribution import AttributionResult
from exporter.analysis.capacity import is_fractional_slot
from exporter.analysis.ghost import GhostCause, GhostHolder, GhostMemory
from exporter.analysis.headroom import SlotHeadroom
from exporter.analysis.health import DeviceHealth, HealthReport, HealthState
from exporter.analysis.liveness import CgroupScan, KernelLiveness, Liveness
from exporter.analysis.node import HeadroomFigures, Inventory, NodeState
from exporter.analysis.shapes import ShapeFigures, ShapeVerdict
from exporter.analysis.simulate import parse_policy, parse_request, result_document, simulate
from exporter.analysis.xid import XidInfo, xid_info
from exporter.scratch.allocation import AllocationView
from exporter.telemetry.devices import DeviceResolver
from exporter.telemetry.model import TelemetrySnapshot

__all__ = [
    "Accounting",
    "AgentHeadroom",
    "AgentLayout",
    "AgentShare",
    "Analysis",
    "AttributionResult",
    "DeviceHealth",
    "DrivenCounters",
    "GhostCause",
    "GhostHolder",
    "GhostMemory",
    "HealthReport",
    "HealthState",
    "HeadroomFigures",
    "KernelLiveness",
    "Liveness",
    "NodeState",
    "ShapeFigures",
    "ShapeVerdict",
    "SlotHeadroom",
    "XidInfo",
    "is_fractional_slot",
    "xid_info",
]


@dataclass(frozen=True)
class AgentShare:
    """One agent's own part of a multi-agent host: its kernels and alloc map (as its own RPC
    answers), and per slot its reported total and headroom."""

    view: AllocationView
    headroom: Mapping[str, AgentHeadroom]


@dataclass(frozen=True)
class Analysis:
    """Everything the analysis pipeline last published (immutable; replaced as a whole).

    Versions let readers cache what they render: ``version`` moves on every publication,
    ``headroom_version`` only when the node state or its figures may have changed (allocation,
    inventory or liveness), ``liveness_version`` only when a kernel's liveness or the cgroup
    tree's visibility changed, ``usage_version`` on every attribution and accounting pass.
    """

    view: AllocationView
    snapshot: TelemetrySnapshot
    resolver: DeviceResolver  # the device join: allocation ids <-> telemetry devices
    inventory: Inventory
    state: NodeState
    headroom: HeadroomFigures
    layout: AgentLayout
    version: int = 0
    sample_version: int = 0  # the telemetry sampler's version of ``snapshot``
    headroom_version: int = 0
    liveness_version: int = 0
    usage_version: int = 0
    ratio_capacities: Mapping[tuple[str, str], Decimal] = field(default_factory=dict)
    # (device id, slot) -> amount allocated on a GPU id no telemetry device matches; None
    # when there is no inventory to judge by (telemetry off or failing).
    unknown_devices: Mapping[tuple[str, str], Decimal] | None = None
    agents: Mapping[str, AgentShare] = field(default_factory=dict)  # multi-agent hosts only
    cgroups: CgroupScan | None = None
    liveness: Mapping[str, KernelLiveness] = field(default_factory=dict)
    # Of ``liveness``: its stale verdicts and its number of verdicts per status, published with
    # it (kept as kernels change: a reader never walks every kernel's verdict).
    stale_kernels: Mapping[str, KernelLiveness] = field(default_factory=dict)
    liveness_counts: Mapping[Liveness, int] = field(default_factory=dict)
    attribution: AttributionResult | None = None
    accounting: Accounting | None = None
    # Ghost memory of the last usage pass (None: not tracked, or the check failed), and per
    # device label its bytes over all causes (what the node state leaves out of headroom).
    ghost: GhostMemory | None = None
    ghost_totals: Mapping[str, int] = field(default_factory=dict)
    # (kernel id, device id) of fractional shares whose device's usable memory no longer
    # covers what is allocated there (ghost or reserved memory took it).
    short_shares: tuple[tuple[str, str], ...] = ()
    health: HealthReport | None = None  # device health, latched until remedied; None: not tracked
    # Per configured request shape: remaining totals, placeable or why not (fleet what-if).
    shapes: ShapeFigures = field(default_factory=ShapeFigures)

    def ratio_map(self, view: AllocationView | None = None) -> dict[str, str]:
        """The ratio form of the alloc map (26.4.8+) of ``view`` (default: the whole node's)
        over the registered capacities; every agent registers each device whole, so one set
        of divisors serves each agent's own view too."""
        return (view or self.view).alloc_map_ratio(self.ratio_capacities)

    def what_if(self, request: str, policy: str = "evenly") -> dict[str, Any]:
        """``simulate``'s JSON document for one request on the published node state.

        :raises ValueError: the message names the parameter (``request`` or ``policy``).
        """
        try:
            want = parse_request(request)
        except ValueError as exc:
            raise ValueError(f"parameter request: {exc}") from None
        try:
            chosen = parse_policy(policy)
        except ValueError as exc:
            raise ValueError(f"parameter policy: {exc}") from None
        return result_document(simulate(self.state, want, chosen))
