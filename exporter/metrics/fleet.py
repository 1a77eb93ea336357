"""Fleet what-if metrics: what the manager sees left on this node, and whether the agent would
really place each configured request shape.

The figures are the read model's (:class:`~exporter.analysis.model.ShapeFigures`, computed by the
analysis pipeline after each allocation change); the fleet-wide answer (which agent the manager
would pick, and whether that pick fails) is PromQL over these series in
``alerts/gpu-alloc-fleet.rules.yml``. Sample::

    gpu_alloc_node_remaining{slot="cuda.shares"} 6.5
    gpu_alloc_shape_request{shape="fgpu-4",slot="cuda.shares"} 4
    gpu_alloc_node_request_placeable{fragmentation="disallowed",shape="fgpu-4"} 0
    gpu_alloc_node_request_refused{fragmentation="disallowed",reason="fragmented",shape="fgpu-4"} 1
    gpu_alloc_node_hami_score{slot="cuda.shares"} 6.25

The HAMi node score (10 × the core and memory used ratios of the slot's devices, 0 to 20) lets a
fleet table rank where HAMi's ``binpack`` (highest first) or ``spread`` (lowest first) node policy
would send a request among the nodes that place it. Explained, with PromQL, in ``docs/headroom.md`` (*Where will a session start?*).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from exporter.analysis.model import Analysis
from exporter.metrics.collectors import Inputs, Part, register
from exporter.metrics.families import gauge

if TYPE_CHECKING:
    from prometheus_client.core import Metric

__all__ = ["fleet_families"]


def fleet_families(model: Analysis) -> list[Metric]:
    """Every fleet what-if family of one read model."""
    figures = model.shapes
    remaining = gauge(
        "gpu_alloc_node_remaining",
        "What the manager sees left of a slot on this node's agent: its reported total minus what its kernels occupy, "
        "in the slot's unit (the totals the manager filters and ranks agents by)",
        ["slot"],
    )
    request = gauge(
        "gpu_alloc_shape_request",
        "A configured request shape's accelerator slot and amount, in the slot's unit (--fleet.shape)",
        ["shape", "slot"],
    )
    placeable = gauge(
        "gpu_alloc_node_request_placeable",
        "1 if the agent would place a request of this shape on its devices now (EVENLY allocator), 0 if it would refuse it",
        ["shape", "fragmentation"],
    )
    refused = gauge(
        "gpu_alloc_node_request_refused",
        "1 with why the agent would refuse a request of this shape now (capacity, fragmented, numa, mig_profile_missing, "
        "stale_allocation); absent while it would place it",
        ["shape", "fragmentation", "reason"],
    )
    hami = gauge(
        "gpu_alloc_node_hami_score",
        "HAMi's node score of a slot's devices before a request: 10 x (core used ratio + memory used ratio), "
        "0 to 20; HAMi's binpack node policy prefers the highest, spread the lowest (docs/headroom.md)",
        ["slot"],
    )
    for slot, score in sorted(figures.hami_scores.items()):
        hami.add_metric([slot], float(score))
    for slot, left in sorted(figures.remaining.items()):
        remaining.add_metric([slot], float(left))
    for shape in figures.shapes:
        slot, amount = shape.accelerator
        request.add_metric([shape.name, slot], float(amount))
    for v in figures.verdicts:
        placeable.add_metric([v.shape, v.fragmentation], int(v.placeable))
        if v.reason is not None:
            refused.add_metric([v.shape, v.fragmentation, v.reason], 1)
    return [remaining, request, placeable, refused, hami]


@register("fleet", "remaining slot totals and whether request shapes would be placed (fleet what-if)", order=45)
def _fleet(inputs: Inputs) -> list[Part]:
    return [Part("fleet", lambda: fleet_families(inputs.model()), lambda: inputs.model().headroom_version)]
