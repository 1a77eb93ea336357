"""The exporter's collector parts: which families each concern contributes, and the token that
says when they must be rendered again.

The parts read a running node through :class:`NodeReader` (the app's ``Exporter`` satisfies it),
so this layer depends on the data it renders, never on the wiring that produces it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

from prometheus_client.core import Metric

from exporter.analysis.agents import AgentHeadroom, AgentLayout
from exporter.analysis.node import Analysis, HeadroomParams, Inventory, inventory_from_snapshot
from exporter.metrics.accounting import accounting_families, accounting_health
from exporter.metrics.agents import agent_families
from exporter.metrics.allocation import KernelText, allocation_families, kernel_families, unknown_device_families
from exporter.metrics.attribution import attribution_families, attribution_health
from exporter.metrics.exporter import build_info, watcher_families
from exporter.metrics.headroom import headroom_families
from exporter.metrics.registry import Part, render_families
from exporter.metrics.status import Health
from exporter.metrics.telemetry import telemetry_families, telemetry_health
from exporter.scratch.allocation import AllocationBook, AllocationView
from exporter.scratch.watcher import ScratchWatcher
from exporter.telemetry.devices import DeviceResolver
from exporter.telemetry.model import TelemetrySnapshot

__all__ = ["NodeReader", "exporter_parts"]


class NodeReader(Protocol):
    """What the parts read of a running node; every attribute is a published, immutable result."""

    book: AllocationBook
    watcher: ScratchWatcher
    analysis: Analysis
    params: HeadroomParams

    def snapshot(self) -> TelemetrySnapshot: ...

    def sampler_version(self) -> int: ...

    def resolver(self, view: AllocationView, snapshot: TelemetrySnapshot) -> DeviceResolver: ...

    def agent_views(self) -> dict[str, AllocationView]: ...

    def agent_headroom(self) -> dict[str, dict[str, AgentHeadroom]]: ...


@dataclass(frozen=True)
class SeriesOptions:
    """Which optional series the exporter serves: the cardinality switches (docs/deploy.md)."""

    process_detail: bool = False  # --attribution.process-detail
    kernel_series: str = "per-device"  # --attribution.kernel-series
    breach_series: str = "all"  # --attribution.breach-series
    throttle_reasons: str = "all"  # --telemetry.throttle-reasons


def exporter_parts(
    node: NodeReader, *, telemetry_source: str, agent_id: str | None, series: SeriesOptions | None = None,
    layout: AgentLayout | None = None, docker_labels: Callable[[], Health] | None = None,
) -> list[Part]:
    """Each part with the token its output depends on (see :meth:`ExporterCollector.render`).

    :param telemetry_source: the telemetry part's ``collector`` name: the source's own (``nvml``,
        ``mock``, ``none``), fixed for the life of the exporter.
    :param agent_id: the ``agent_id`` label of ``gpu_alloc_build_info``.
    :param series: the cardinality switches; None: every series (the defaults).
    :param layout: the host's agents; a multi-agent host gets the ``agents`` part (per-agent
        families), a single-agent one no extra part, so its exposition stays as it was.
    :param docker_labels: the health of the opt-in Docker label reader (``--identity.docker-socket``);
        its part has no families of its own (the identities it reads are on the scratch part's
        series), only its ``collector`` status.
    """
    series = series or SeriesOptions()
    book, watcher = node.book, node.watcher
    kernel_text = KernelText(agent_id, gzipped=True)

    def telemetry() -> list[Metric]:
        view, snapshot = book.view(), node.snapshot()
        resolver = node.resolver(view, snapshot)
        return telemetry_families(snapshot, resolver, series.throttle_reasons) + unknown_device_families(view, snapshot, resolver)

    def inventory() -> Inventory:
        view, snapshot = book.view(), node.snapshot()
        return inventory_from_snapshot(snapshot, node.resolver(view, snapshot))

    def headroom() -> list[Metric]:
        analysis = node.analysis
        visible = analysis.cgroups.visible if analysis.cgroups else None
        return headroom_families(book.view(), None, inventory(), node.params, analysis.liveness, visible)

    def scratch() -> list[Metric]:
        view = book.view()
        return allocation_families(view) + kernel_families(view, agent_id)

    def scratch_text() -> bytes:
        view = book.view()
        return kernel_text.render(view, head=render_families(allocation_families(view)))

    def scratch_health() -> Health:
        scans = watcher.status().last_scan
        return Health(bool(scans) and all(s.ok for s in scans), sum(s.duration_seconds for s in scans))

    def headroom_token() -> Hashable:
        # Headroom depends on the inventory (capacity, MIG layout), not on each sample's readings.
        return (book.version, node.analysis.liveness_version, inventory())

    parts = [
        Part("build", lambda: [build_info(agent_id)], lambda: 0),
        Part("scratch", scratch, lambda: book.version, scratch_text, scratch_health, gzipped=True),
        Part("watcher", lambda: watcher_families(watcher.status()), watcher.status,
             health=lambda: Health(watcher.status().up)),
        Part(telemetry_source, telemetry, lambda: (book.version, node.sampler_version()),
             health=lambda: telemetry_health(node.snapshot())),
        Part("headroom", headroom, headroom_token),
        Part("attribution", lambda: attribution_families(node.analysis.attribution, process_detail=series.process_detail,
                                                         kernel_series=series.kernel_series, breach_series=series.breach_series),
             lambda: node.analysis.version, health=lambda: attribution_health(node.analysis.attribution)),
        Part("accounting", lambda: accounting_families(node.analysis.accounting), lambda: node.analysis.version,
             health=lambda: accounting_health(node.analysis.accounting)),
    ]
    if docker_labels is not None:
        parts.append(Part("docker-labels", list, docker_labels, health=docker_labels))
    if layout is not None and layout.multi_agent:
        parts.append(Part("agents", lambda: agent_families(layout, node.agent_views(), node.agent_headroom()), headroom_token))
    return parts
