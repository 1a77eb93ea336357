"""Wiring: the allocation book, the watcher, telemetry and the analysis pipeline of one
exporter, and the collector and routes that read what they publish.

Three kinds of background work publish immutable results; scrapes only read them:

* the scratch watcher keeps the :class:`AllocationBook` current (inotify thread + rescan worker);
* the telemetry sampler publishes :class:`TelemetrySnapshot` s (NVML never runs in a scrape);
* the analysis pipeline (:mod:`exporter.analysis.pipeline`) turns both into one read model
  after each change (coalesced).

``/metrics`` is rendered part by part (:mod:`exporter.metrics.collectors`), each part once per
change of its inputs, and served from cached bytes (plain and gzip).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from exporter.analysis.accounting import Accountant
from exporter.analysis.attribution import AttributionTracker, ProcFS
from exporter.analysis.ghost import GhostTracker
from exporter.analysis.health import HealthStore, HealthTracker, parse_boot_id
from exporter.analysis.model import Analysis
from exporter.analysis.pipeline import AnalysisPipeline, PipelineConfig
from exporter.config import Config
from exporter.files import FileReadError, read_text
from exporter.metrics.collectors import Inputs, SeriesOptions
from exporter.metrics.status import Health
from exporter.scratch.allocation import AllocationBook
from exporter.scratch.reader import Scanner
from exporter.scratch.watcher import ScratchWatcher
from exporter.telemetry.model import TelemetrySnapshot, TelemetrySource
from exporter.telemetry.sampler import TelemetrySampler
from exporter.telemetry.sources import SourceChoice, build_source
from exporter.web.routes import Routes, Served
from exporter.web.server import Request, Response

if TYPE_CHECKING:
    from exporter.metrics.registry import ExporterCollector

__all__ = ["Exporter"]

log = logging.getLogger(__name__)

# glibc's mallopt() parameter, and its initial mmap threshold (128 KiB).
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 128 * 1024


def _pin_mmap_threshold() -> None:
    """Keep glibc's malloc from raising its mmap threshold, so large blocks go back to the system.

    glibc serves blocks of at least the threshold with their own mapping, unmapped when freed, but
    raises the threshold to the size of each such block freed (up to 32 MiB): once the first large
    exposition (above the initial threshold, below that cap) is replaced, later ones come from the
    heap, whose freed pages stay resident: the idle RSS grows, and more with each change. Setting
    the threshold turns the raise off. Skipped where an operator set ``MALLOC_MMAP_THRESHOLD_``
    (glibc then uses theirs) and where the C library has no ``mallopt``.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)


class _Exposition:
    """The metrics collector, built on first use: the analysis thread builds it right after
    readiness, so the imports of prometheus_client and the renderer, a large part of a start's,
    are part of neither the start nor the first scrape."""

    def __init__(self, inputs: Inputs, enabled: dict[str, bool], clock: Callable[[], float], openmetrics_created: bool = False,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._inputs, self._enabled, self._clock, self._monotonic = inputs, enabled, clock, monotonic
        self._openmetrics_created = openmetrics_created  # --web.openmetrics-created
        self._collector: ExporterCollector | None = None
        self._lock = threading.Lock()

    @property
    def collector(self) -> ExporterCollector:
        collector = self._collector
        if collector is None:
            with self._lock:
                if self._collector is None:
                    from exporter.metrics.collectors import build_parts
                    from exporter.metrics.registry import ExporterCollector

                    self._collector = ExporterCollector(build_parts(self._inputs, self._enabled), self._clock,
                                                        openmetrics_created=self._openmetrics_created,
                                                        monotonic=self._monotonic)
                collector = self._collector
        return collector

    def render(self, gzipped: bool = False, openmetrics: bool = False) -> bytes:
        """The current exposition; each part is rendered once per change of what it shows."""
        return self.collector.render(gzipped, openmetrics)

    def render_cached(self, gzipped: bool = False, openmetrics: bool = False) -> bytes | None:
        """The current exposition if nothing has to be rendered for it, else None (never waits)."""
        collector = self._collector
        return collector.render_cached(gzipped, openmetrics) if collector is not None else None

    def render_ahead(self, next_pass_in: float) -> None:
        """A usage pass was published: render ahead what the next scrape will read (see
        :meth:`~exporter.metrics.registry.ExporterCollector.render_ahead`)."""
        collector = self._collector
        if collector is not None:
            collector.render_ahead(next_pass_in)


def _boot_id(path: Path) -> str | None:
    """This boot's id, or None where the file cannot be read (then a reboot cannot be told)."""
    try:
        return parse_boot_id(read_text(path, 256))
    except FileReadError as exc:
        log.warning("boot id %s; latched GPU faults survive reboots", exc)
        return None


class Exporter:
    """One exporter: call :meth:`start`, serve :meth:`handle`, then :meth:`close`.

    :param config: what the exporter was told, resolved (:func:`exporter.config.resolve`); the
        exporter never raises a configuration error.
    :param clock: unix time (kernel state timestamps, staleness, telemetry timestamps).
    :param monotonic: seconds for durations (idle and no-process windows).
    :param telemetry: a ready telemetry source (tests and the demo pass their own); by default the
        one the configuration chose (``config.telemetry``), else none.
    :param server_stats: the HTTP server's counters, for the ``http`` collector.
    """

    def __init__(
        self,
        config: Config,
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        telemetry: TelemetrySource | None = None,
        server_stats: Callable | None = None,
    ) -> None:
        self.config = config
        s = self.settings = config.settings
        self.layout = config.layout
        self.clock = clock
        self.params = config.headroom
        # Opened now (the mock file is read, NVML probed for ``auto``) so that the telemetry part's
        # ``collector`` name is the source's own from the first render on.
        self._source = telemetry or build_source(config.telemetry or SourceChoice("none"), pcie=s.telemetry_pcie)
        self.sampler: TelemetrySampler | None = None
        self._monotonic = monotonic
        self._stop = threading.Event()
        self.book = AllocationBook(clock)
        self.scanner = Scanner(self.book, s.scratch_max_file_bytes)
        self.watcher = ScratchWatcher(self.scanner, list(self.layout.roots), mode=s.scratch_watch_mode,
                                      rescan_interval=s.scratch_rescan_interval, poll_interval=s.scratch_poll_interval, clock=clock)
        stages = PipelineConfig(self.params, self.layout, s.device_id_scheme, s.telemetry_interval, s.path_cgroupfs, s.stale_grace,
                                shapes=config.shapes)
        procfs = ProcFS(str(s.path_procfs))
        tracker = AttributionTracker(procfs, monotonic, idle_threshold_ratio=s.attribution_idle_threshold_ratio)
        health = HealthTracker(HealthStore(config.health_state_file), _boot_id(config.boot_id_file), clock)
        self.pipeline = AnalysisPipeline(stages, self.book.view, self._published, tracker=tracker,
                                         accountant=Accountant(monotonic, energy_split=s.accounting_energy_split), ghost=GhostTracker(procfs), health=health,
                                         clock=clock, monotonic=monotonic)
        self.book.subscribe(self.pipeline.poke)
        self._ready = threading.Event()
        # Opt-in identity from the kernel containers' Docker labels (agents before 25.18).
        self._labels = None
        if s.identity_docker_socket is not None:
            from exporter.scratch.containers import DockerLabels  # here: http.client only when enabled

            self._labels = DockerLabels(str(s.identity_docker_socket))
        self._labels_health = Health(False)
        self._labels_failing = False
        self._labeller: threading.Thread | None = None
        series = SeriesOptions(s.attribution_process_detail, s.attribution_kernel_series, s.attribution_breach_series,
                               s.telemetry_throttle_reasons)
        default_id = self.layout.default_agent_id
        inputs = Inputs(self.book.view, lambda: self.pipeline.current, self.watcher.status, self._source.name,
                        self.layout.agents if self.layout.multi_agent else ((default_id,) if default_id else ()), series,
                        (lambda: self._labels_health) if self._labels else None, server_stats, self.pipeline.step_aside)
        self.exposition = _Exposition(inputs, dict(config.collectors), clock, s.web_openmetrics_created, monotonic)
        self.routes = Routes(Served(self.book.view, lambda: self.pipeline.current, self.exposition.render,
                                    self.exposition.render_cached, self._ready.is_set, self.watcher.status,
                                    tuple(self.layout.roots), s.alloc_map_format, lambda: self.book.version))

    @property
    def collector(self) -> ExporterCollector:
        """The metrics collector (built on first use)."""
        return self.exposition.collector

    @property
    def analysis(self) -> Analysis:
        """The current read model."""
        return self.pipeline.current

    def _published(self) -> tuple[int, TelemetrySnapshot]:
        return self.sampler.published() if self.sampler else (0, TelemetrySnapshot(source="none"))

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        _pin_mmap_threshold()  # before the scan: its big transient tables would raise the threshold too
        self.sampler = TelemetrySampler(self._source, self.settings.telemetry_interval, self.settings.telemetry_timeout, self.clock)
        self.sampler.subscribe(self.pipeline.sampled)
        # The first scan and analysis build every kernel's objects, which all live on: the cyclic
        # collector would walk them again and again as they pile up and free nothing. They build
        # no cycles worth collecting.
        collecting = gc.isenabled()
        gc.disable()
        try:
            try:
                self.watcher.start()  # returns after the first full scan
            except BaseException:
                self.sampler.close()
                raise
            # The first sample runs alongside the scan; give it until its deadline so the first scrape
            # after /-/ready already has telemetry (a hung NVML only delays readiness by the timeout).
            self.sampler.wait_for_version(0, self.settings.telemetry_timeout)
            # The ledger's first pass (every counter at zero) runs on the usage thread, right after.
            self.pipeline.step(ledger=False)
            # Everything built so far (the kernels, the imports) lives as long as the process: keep it
            # out of the collector's generations, so a full collection during a scrape does not walk
            # every kernel's objects again (CPython's gc.freeze, meant for exactly this).
            gc.freeze()
        finally:
            if collecting:
                gc.enable()
        # The collector is built on the analysis thread, after readiness, rather than by the first scrape.
        # The ledger's first pass, right after readiness, builds tables per (kernel, GPU) pair that
        # live as long as the start's objects: out of the collector's generations with them, or
        # every full collection walks them again (20-30 ms at 10,000 kernels, under the GIL).
        self.pipeline.start(first=lambda: self.exposition.collector, counted=gc.freeze, used=self.exposition.render_ahead)
        if self._labels is not None:
            # Readiness never waits on this opt-in source: its first read runs on its own thread.
            self._labeller = threading.Thread(target=self._labels_loop, name="docker-labels", daemon=True)
            self._labeller.start()
        self._ready.set()

    def close(self) -> None:
        self._stop.set()
        if self.sampler is not None:
            self.sampler.close()
        else:
            self._source.close()
        self.pipeline.close()
        if self._labeller is not None:
            self._labeller.join()
        self.watcher.close()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    # -- identity from Docker labels (opt-in) ------------------------------------------------------

    def _labels_loop(self) -> None:
        self._read_labels()
        while not self._stop.wait(self.settings.identity_docker_interval):
            self._read_labels()

    def _read_labels(self) -> None:
        """One list request; each kernel without a readable recovery.json takes its labels' identity."""
        from exporter.scratch.containers import ContainerListError  # imported by __init__ already

        started = self._monotonic()
        try:
            identities = self._labels.fetch()
        except ContainerListError as exc:
            if not self._labels_failing:  # one line per failure streak, not one per read
                log.warning("kernel identity from Docker labels: %s; kernels keep the identity they have", exc)
            self._labels_failing = True
            self._labels_health = Health(False, self._monotonic() - started, self._labels_health.last_success_timestamp)
            return
        if self._labels_failing:
            log.info("kernel identity from Docker labels: %s answers again", self._labels.socket_path)
            self._labels_failing = False
        for kernel_id, identity in identities.items():
            self.scanner.apply_label_identity(kernel_id, identity)
        self._labels_health = Health(True, self._monotonic() - started, self.clock())

    # -- serving -------------------------------------------------------------------------------

    def render(self, gzipped: bool = False) -> bytes:
        """The current exposition (see :class:`_Exposition`)."""
        return self.exposition.render(gzipped)

    def handle(self, request: Request) -> Response:
        """Answer one HTTP request (the server calls this; see :class:`~exporter.web.routes.Routes`)."""
        return self.routes.handle(request)
