"""Collectors that register themselves, as node_exporter's ``registerCollector`` does.

Each ``metrics/<concern>.py`` declares its collector with :func:`register`: a name (the
``--collector.<name>`` / ``--no-collector.<name>`` switch), whether it is on by default, and a
builder that returns its :class:`Part` s: name, families, change token and health. A part reads
only what :class:`Inputs` hands it: the allocation view, the published read model
(:class:`~exporter.analysis.model.Analysis`) and fixed facts of this exporter; nothing here
reaches back into the wiring. :func:`collectors` imports the concern modules (light: none loads
prometheus_client before it renders) and returns the registry in exposition order.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from exporter.analysis.model import Analysis
    from exporter.metrics.status import Health
    from exporter.metrics.text import Deflated
    from exporter.scratch.allocation import AllocationView
    from exporter.scratch.watcher import WatcherStatus

__all__ = ["CONCERNS", "Collector", "Inputs", "Part", "SeriesOptions", "build_parts", "collectors", "register"]

# The modules that declare collectors, imported by collectors().
CONCERNS = ("exporter", "allocation", "telemetry", "headroom", "fleet", "attribution", "health", "accounting", "agents", "server")


@dataclass(frozen=True)
class Part:
    """A named producer of metric families (one per concern: scratch, telemetry, headroom…).

    :param token: returns a value that changes whenever the families would; it is read *before*
        the families are built, so a cached rendering is never older than its token.
    :param text: a faster renderer of the same families as text; None: ``generate_latest``.
    :param health: the verdict of the part's background work (a failed telemetry cycle is
        ``success 0`` even though its families render); None: the render's own success.
    :param gzipped: ``text`` gives the text compressed (:class:`~exporter.metrics.text.Deflated`),
        and only that is cached: a plain scrape inflates it.
    :param openmetrics: the OpenMetrics 1.0 form of what the last ``text`` call gave, in the same
        encoding, without ``_created`` samples; None (or ``_created`` on): converted from the text.
    :param ahead: render it after each analysis pass whose result the next scrape will read
        (:meth:`~exporter.metrics.registry.ExporterCollector.render_ahead`), not in that scrape:
        for a part whose token moves at every usage pass and whose render is long.
    """

    name: str
    families: Callable[[], Iterable[Metric]]
    token: Callable[[], Hashable]
    text: Callable[[], bytes | Deflated] | None = None
    health: Callable[[], Health] | None = None
    gzipped: bool = False
    openmetrics: Callable[[], bytes | Deflated] | None = None
    ahead: bool = False


@dataclass(frozen=True)
class SeriesOptions:
    """Which optional series the exporter serves: the cardinality switches (docs/deploy.md)."""

    process_detail: bool = False  # --attribution.process-detail
    kernel_series: str = "per-device"  # --attribution.kernel-series
    breach_series: str = "all"  # --attribution.breach-series
    throttle_reasons: str = "all"  # --telemetry.throttle-reasons


@dataclass(frozen=True)
class Inputs:
    """What the parts read: published, immutable results, and facts fixed for the exporter's life.

    :param view: the allocation book's current view.
    :param model: the analysis pipeline's current read model.
    :param watcher: the scratch watcher's status.
    :param telemetry_source: the telemetry part's ``collector`` name: the source's own
        (``nvml``, ``mock``, ``none``).
    :param agent_ids: the host's agent ids (``gpu_alloc_build_info``); empty when none is known.
    :param docker_labels: the opt-in Docker label reader's health; None: not configured.
    :param server: the HTTP server's counters; None: not served (tests, ``scan``).
    :param aside: called between the long steps of a render: on the thread that renders ahead of
        the scrape, it waits while kernels change (:mod:`exporter.foreground`); elsewhere it
        returns at once.
    """

    view: Callable[[], AllocationView]
    model: Callable[[], Analysis]
    watcher: Callable[[], WatcherStatus]
    telemetry_source: str = "none"
    agent_ids: tuple[str, ...] = ()
    series: SeriesOptions = SeriesOptions()
    docker_labels: Callable[[], Health] | None = None
    server: Callable[[], Hashable] | None = None  # () -> exporter.metrics.server.ServerStats
    aside: Callable[[], None] = lambda: None

    @property
    def agent_id(self) -> str | None:
        """The agent id of a single-agent host (kernels not yet identified are labelled with it)."""
        return self.agent_ids[0] if len(self.agent_ids) == 1 else None


@dataclass(frozen=True)
class Collector:
    """A registered collector: its switch, its default and the builder of its parts (which
    may return none where the node has nothing of the concern, such as agents on a one-agent host)."""

    name: str
    help: str
    default: bool
    order: int  # position in the exposition
    build: Callable[[Inputs], list[Part]]


_REGISTRY: dict[str, Collector] = {}


def register(name: str, help: str, *, order: int, default: bool = True) -> Callable[[Callable[[Inputs], list[Part]]], Callable]:
    """Declare a collector (a decorator on its builder)."""

    def declare(build: Callable[[Inputs], list[Part]]) -> Callable[[Inputs], list[Part]]:
        if name in _REGISTRY and _REGISTRY[name].build is not build:
            raise ValueError(f"collector {name!r} is registered twice")
        _REGISTRY[name] = Collector(name, help, default, order, build)
        return build

    return declare


def collectors() -> dict[str, Collector]:
    """Every registered collector by name, in exposition order."""
    for concern in CONCERNS:
        importlib.import_module(f"exporter.metrics.{concern}")
    return {c.name: c for c in sorted(_REGISTRY.values(), key=lambda c: c.order)}


def build_parts(inputs: Inputs, enabled: Mapping[str, bool] | None = None) -> list[Part]:
    """The parts of every enabled collector (``enabled`` overrides each collector's default)."""
    enabled = enabled or {}
    unknown = set(enabled) - set(collectors())
    if unknown:
        raise ValueError(f"unknown collector(s): {', '.join(sorted(unknown))}")
    return [part for c in collectors().values() if enabled.get(c.name, c.default) for part in c.build(inputs)]
