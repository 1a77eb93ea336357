"""Per-agent families of a multi-agent host (Backend.AI 25.17+ ``[[agents]]``).

They exist only when the host runs more than one agent, so a single-agent node's exposition is
unchanged; the node-wide families keep summing over every agent. Sample::

    gpu_alloc_agent_info{agent_id="i-node01-a",allocation_mode="auto-split",scratch_root="/var/lib/backend.ai/scratches"} 1
    gpu_alloc_agent_device_fgpu_allocated{agent_id="i-node01-a",device_id="GPU-5d2c…"} 0.5
    gpu_alloc_agent_node_headroom{agent_id="i-node01-a",fragmentation="allowed",slot="cuda.shares"} 6.25
"""

from __future__ import annotations

from decimal import Decimal
from typing import TYPE_CHECKING

from exporter.analysis.model import Analysis
from exporter.metrics.collectors import Inputs, Part, register
from exporter.metrics.families import gauge
from exporter.scratch.resources import SlotKind, slot_kind

if TYPE_CHECKING:
    from prometheus_client.core import Metric

__all__ = ["agent_families"]


def agent_families(model: Analysis) -> list[Metric]:
    """Identity, allocation and headroom of each agent; nothing on a single-agent host."""
    layout = model.layout
    if not layout.multi_agent:
        return []
    info = gauge("gpu_alloc_agent_info", "A Backend.AI agent of this host, a scratch root it writes to and its allocation mode",
              ["agent_id", "scratch_root", "allocation_mode"])
    count = gauge("gpu_alloc_agent_device_allocated", "Amount of a count slot an agent's own kernels hold on a device (its own allocation map)",
               ["agent_id", "device_id", "slot"])
    nbytes = gauge("gpu_alloc_agent_device_allocated_bytes", "Amount of a bytes slot an agent's own kernels hold on a device",
                ["agent_id", "device_id", "slot"])
    fgpu = gauge("gpu_alloc_agent_device_fgpu_allocated",
              "cuda.shares plus cuda.device an agent's own kernels hold on a device, as that agent's gpu_alloc_map reports it",
              ["agent_id", "device_id"])
    total = gauge("gpu_alloc_agent_slot_capacity",
               "What an agent reports to the scheduler of a slot: the node's total split by its allocation mode",
               ["agent_id", "slot"])
    room = gauge("gpu_alloc_agent_node_headroom",
              "Largest request of a slot an agent would place now: in its own map (every device whole) and within its reported total",
              ["agent_id", "slot", "fragmentation"])
    for agent_id in layout.agents:
        for root in layout.roots_of(agent_id):
            info.add_metric([agent_id, root, layout.allocation_mode], 1)
        share = model.agents.get(agent_id)
        view = share.view if share is not None else None
        if view is not None:
            for (device_id, slot), amount in sorted(view.device_totals.items()):
                fam = nbytes if slot_kind(slot) is SlotKind.BYTES else count
                fam.add_metric([agent_id, device_id, slot], float(amount))
            for device_id, amount in view.alloc_map.items():
                fgpu.add_metric([agent_id, device_id], float(Decimal(amount)))
        for slot, h in sorted(share.headroom.items() if share is not None else ()):
            if h.total is not None:
                total.add_metric([agent_id, slot], float(h.total))
            room.add_metric([agent_id, slot, "allowed"], float(h.headroom))
            room.add_metric([agent_id, slot, "disallowed"], float(h.headroom_nofrag))
    return [info, count, nbytes, fgpu, total, room]


@register("agents", "each agent's identity, allocation and headroom on a multi-agent host (none on a one-agent host)", order=80)
def _agents(inputs: Inputs) -> list[Part]:
    if len(inputs.agent_ids) < 2:  # a one-agent host's exposition has no agent families
        return []
    return [Part("agents", lambda: agent_families(inputs.model()), lambda: inputs.model().headroom_version)]
