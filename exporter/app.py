"""Wiring: the allocation book, the watcher, telemetry and analysis of one exporter, and the
collector and routes that read them.

Three kinds of background work publish immutable results; scrapes only read them:

* the scratch watcher keeps the :class:`AllocationBook` current (inotify thread + rescan worker);
* the telemetry sampler publishes :class:`TelemetrySnapshot` s (NVML never runs in a scrape);
* the analysis thread, after each telemetry sample (or every ``--telemetry.interval``), reads
  the cgroup tree for stale kernels and ``/proc`` for process attribution, and publishes both.

``/metrics`` is rendered part by part, each part once per change of its inputs, and served from
cached bytes (plain and gzip): prometheus_client renders ~150k samples/s, so re-rendering 20,000
per-kernel samples whenever a telemetry sample arrives would cost ~125 ms a scrape.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import TYPE_CHECKING

from exporter.analysis.accounting import Accountant
from exporter.analysis.agents import (
    AgentFlags,
    AgentHeadroom,
    AgentLayout,
    AgentLayoutError,
    agent_headroom,
    agent_views,
    resolve_agent_layout,
)
from exporter.analysis.attribution import AttributionTracker, ProcFS
from exporter.analysis.capacity import CapacityConfig
from exporter.analysis.liveness import KernelLiveness, Liveness, classify_kernels, scan_cgroups
from exporter.analysis.node import (
    DEFAULT_REQUESTS,
    Analysis,
    HeadroomParams,
    NodeState,
    inventory_from_snapshot,
    live_state,
    node_state,
    ratio_capacities,
)
from exporter.analysis.placement import NoFragRule
from exporter.analysis.placement import Request as PlacementRequest
from exporter.metrics.status import Health
from exporter.scratch.allocation import AllocationBook, AllocationView
from exporter.scratch.identity import UNDEFINED
from exporter.scratch.reader import Scanner
from exporter.scratch.watcher import ScratchWatcher
from exporter.settings import ConfigError, Settings
from exporter.telemetry.devices import DeviceResolver
from exporter.telemetry.mig import parse_hami_geometries
from exporter.telemetry.model import TelemetrySnapshot, TelemetrySource
from exporter.telemetry.sampler import TelemetrySampler
from exporter.telemetry.sources import open_source
from exporter.units import bounded, parse_decimal
from exporter.web.routes import Routes
from exporter.web.server import Request, Response

if TYPE_CHECKING:
    from exporter.metrics.registry import ExporterCollector

__all__ = ["Exporter", "agent_layout", "headroom_params"]

log = logging.getLogger(__name__)

# Staleness moves on a scale of minutes: re-judged on a kernel change, else every this many seconds.
STALE_CHECK_SECONDS = 30.0
_LOG_KERNELS = 5  # kernels named in one stale-change log line; the rest are counted


# glibc's mallopt() parameter, and its initial mmap threshold (128 KiB).
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 128 * 1024


def _pin_mmap_threshold() -> None:
    """Keep glibc's malloc from raising its mmap threshold, so large blocks go back to the system.

    glibc serves blocks of at least the threshold with their own mapping, unmapped when freed, but
    raises the threshold to the size of each such block freed (up to 32 MiB): after the first
    ~5 MB exposition at 10,000 kernels is replaced, later ones come from the heap, whose freed
    pages stay resident (+4 MiB idle, +13 MiB after a few changes at 10,000 kernels). Setting the
    threshold turns the raise off. Skipped where an operator set ``MALLOC_MMAP_THRESHOLD_``
    (glibc then uses theirs) and where the C library has no ``mallopt``.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)


def _cut(text: str, limit: int = 80) -> str:
    # A flag's value, quoted back to the person who typed it: cut, so one line stays one line.
    return text if len(text) <= limit else text[:limit] + "…"


def headroom_params(settings: Settings) -> HeadroomParams:
    """Headroom settings from the flags; raises ConfigError naming the flag (or file) and the reason."""
    overrides: dict[str, Decimal] = {}
    for item in settings.capacity_overrides:
        device_id, sep, shares = item.rpartition("=")
        if not sep or not device_id.strip() or not shares.strip():
            raise ConfigError(f"--capacity.override {_cut(item)!r}: expected DEVICE_ID=SHARES, e.g. GPU-8e3c…=13.5")
        try:
            overrides[device_id.strip()] = parse_decimal(shares.strip())
        except ValueError:
            raise ConfigError(
                f"--capacity.override {_cut(item)!r}: SHARES must be a finite, non-negative number of shares"
            ) from None
    requests = []
    for item in settings.headroom_requests:
        try:
            request = PlacementRequest.parse(item)
            bounded(request.amount, item)
        except ValueError as exc:
            raise ConfigError(f"--headroom.request {_cut(item)!r}: {exc}") from None
        requests.append(request)
    hami = ()
    if settings.mig_geometries_file is not None:
        path = settings.mig_geometries_file
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"--mig.geometries-file {path}: cannot read the file ({exc.strerror or 'unreadable'})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"--mig.geometries-file {path}: not UTF-8 text") from None
        try:
            hami = tuple(parse_hami_geometries(text))
        except ValueError as exc:
            raise ConfigError(f"--mig.geometries-file {path}: {exc}") from None
    return HeadroomParams(
        capacity=CapacityConfig(
            unit_mem_bytes=settings.capacity_unit_mem, unit_proc=settings.capacity_unit_proc,
            quantum=settings.capacity_quantum, overrides=overrides,
        ),
        mode=settings.headroom_mode,
        rule=NoFragRule(settings.headroom_nofrag_rule),
        requests=tuple(requests) or DEFAULT_REQUESTS,
        exclude_stale=settings.headroom_exclude_stale,
        hami=hami,
    )


def agent_layout(settings: Settings, agent_toml: str | None, source: str | None, hostname: str) -> AgentLayout:
    """The host's agents from the flags and agent.toml's text (see :mod:`exporter.analysis.agents`).

    :raises ConfigError: one line naming the flag or file and the reason.
    """
    flags = AgentFlags(
        scratch_roots=tuple(str(r) for r in settings.scratch_roots),
        roots_given="scratch_roots" in settings.model_fields_set,
        scratch_agents=tuple(settings.scratch_agents),
        agent_id=settings.agent_id,
    )
    try:
        return resolve_agent_layout(flags, agent_toml, source, hostname)
    except AgentLayoutError as exc:
        raise ConfigError(str(exc)) from None


class Exporter:
    """One exporter: call :meth:`start`, serve :meth:`handle`, then :meth:`close`.

    :param clock: unix time (kernel state timestamps, staleness, telemetry timestamps).
    :param monotonic: seconds for durations (idle and no-process windows).
    :param telemetry: a ready telemetry source (tests pass a fake); by default one is opened
        from ``--telemetry.source`` here.
    :param layout: the host's agents and scratch roots (the CLI resolves it with agent.toml);
        by default from the flags alone.
    :raises SourceConfigError: the source cannot be opened (a bad mock file).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        telemetry: TelemetrySource | None = None,
        layout: AgentLayout | None = None,
    ) -> None:
        self.settings = settings
        self.layout = layout or agent_layout(settings, None, None, socket.gethostname())
        self._agent_views: tuple[int, dict[str, AllocationView]] = (-1, {})
        self._node_state: tuple[AllocationView, TelemetrySnapshot, Mapping, NodeState] | None = None
        self.clock = clock
        self.params = headroom_params(settings)
        # Opened now (the mock file is read, NVML probed for ``auto``) so that the telemetry part's
        # ``collector`` name is the source's own from the first render on.
        self._source = telemetry or open_source(
            settings.telemetry_source, mock_file=settings.telemetry_mock_file, pcie=settings.telemetry_pcie
        )
        self.sampler: TelemetrySampler | None = None
        self._tracker = AttributionTracker(
            ProcFS(str(settings.path_procfs)), monotonic, idle_threshold_ratio=settings.attribution_idle_threshold_ratio
        )
        self.analysis = Analysis()
        self._accountant = Accountant(monotonic)
        self._monotonic = monotonic
        self._judged: tuple[int, float] = (-1, 0.0)  # (view version, monotonic time) of the last staleness check
        self._stop = threading.Event()
        self._analyser: threading.Thread | None = None
        self.book = AllocationBook(clock)
        self.scanner = Scanner(self.book, settings.scratch_max_file_bytes)
        self.watcher = ScratchWatcher(
            self.scanner,
            list(self.layout.roots),
            mode=settings.scratch_watch_mode,
            rescan_interval=settings.scratch_rescan_interval,
            poll_interval=settings.scratch_poll_interval,
            clock=clock,
        )
        self._ready = threading.Event()
        # Opt-in identity from the kernel containers' Docker labels (agents before 25.18).
        socket_path = settings.identity_docker_socket
        self._labels = None
        if socket_path is not None:
            from exporter.scratch.containers import DockerLabels  # http.client: ~10 ms of a start without it

            self._labels = DockerLabels(str(socket_path))
        self._labels_health = Health(False)
        self._labels_failing = False
        self._labeller: threading.Thread | None = None
        self._collector: ExporterCollector | None = None
        self._collector_lock = threading.Lock()
        self.routes = Routes(self, list(self.layout.roots), settings.alloc_map_format)

    @property
    def collector(self) -> ExporterCollector:
        """The metrics collector, built on first use: the analysis thread builds it right after
        readiness, so prometheus_client and the metric modules (~60 ms of imports) are part of
        neither the start nor the first scrape."""
        collector = self._collector
        if collector is None:
            with self._collector_lock:
                if self._collector is None:
                    from exporter.metrics.parts import SeriesOptions, exporter_parts
                    from exporter.metrics.registry import ExporterCollector

                    s = self.settings
                    series = SeriesOptions(s.attribution_process_detail, s.attribution_kernel_series,
                                           s.attribution_breach_series, s.telemetry_throttle_reasons)
                    labels = (lambda: self._labels_health) if self._labels else None
                    self._collector = ExporterCollector(
                        exporter_parts(self, telemetry_source=self._source.name, agent_id=self.layout.default_agent_id,
                                       series=series, layout=self.layout, docker_labels=labels),
                        self.clock,
                    )
                collector = self._collector
        return collector

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        _pin_mmap_threshold()  # before the scan: its big transient tables would raise the threshold too
        self.sampler = TelemetrySampler(self._source, self.settings.telemetry_interval, self.settings.telemetry_timeout, self.clock)
        # The first scan and analysis build every kernel's objects, which all live on: the cyclic
        # collector would walk them again and again as they pile up (at 10,000 kernels ~20% of
        # the time to ready) and free nothing. They build no cycles worth collecting.
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
            self._analyse()
            # Everything built so far (the kernels, the imports) lives as long as the process: keep it
            # out of the collector's generations, so a full collection during a scrape does not walk
            # 10,000 kernels' objects again (CPython's gc.freeze, meant for exactly this).
            gc.freeze()
        finally:
            if collecting:
                gc.enable()
        self._analyser = threading.Thread(target=self._analysis_loop, name="analysis", daemon=True)
        self._analyser.start()
        if self._labels is not None:
            self._read_labels()  # before readiness, so the first scrape already names the sessions
            self._labeller = threading.Thread(target=self._labels_loop, name="docker-labels", daemon=True)
            self._labeller.start()
        self._ready.set()

    def close(self) -> None:
        self._stop.set()
        if self.sampler is not None:
            self.sampler.close()  # also wakes the analysis thread, and closes the source
        else:
            self._source.close()
        if self._analyser is not None:
            self._analyser.join()
        if self._labeller is not None:
            self._labeller.join()
        self.watcher.close()

    # -- identity from Docker labels (opt-in) ------------------------------------------------------

    def _labels_loop(self) -> None:
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

    # -- analysis: stale kernels and process attribution, off the scrape path --------------------

    def _analysis_loop(self) -> None:
        try:
            self.collector  # noqa: B018 - built here, after readiness, rather than by the first scrape
        except Exception:  # a scrape builds it again, and a failure there is a 500, never a dead thread
            log.exception("building the metrics collector failed")
        seen = self.sampler.version
        while not self._stop.is_set():
            self.sampler.wait_for_version(seen, self.settings.telemetry_interval)
            if self._stop.is_set():
                return
            seen = self.sampler.version
            self._analyse()

    def _analyse(self) -> None:
        prev, view, snapshot = self.analysis, self.book.view(), self.sampler.latest()
        cgroups, liveness = prev.cgroups, prev.liveness
        # Staleness moves on a scale of minutes (--stale.grace): re-judge when the kernels change,
        # else at most every STALE_CHECK_SECONDS, not on every telemetry sample.
        now = self._monotonic()
        if view.version != self._judged[0] or now - self._judged[1] >= STALE_CHECK_SECONDS:
            try:
                cgroups = scan_cgroups(self.settings.path_cgroupfs)
                # A kernel without CID= that its agent still keeps in its registry is live.
                recovery = {
                    kid: k.identity.agent_id
                    for kid, k in view.kernels.items()
                    if k.identity is not None and k.identity.agent_id != UNDEFINED
                }
                liveness = classify_kernels(
                    view.kernels, cgroups, self.clock(), self.settings.stale_grace,
                    recovery_agents=recovery, host_agents=frozenset(self.layout.agents),
                )
            except Exception:
                log.exception("stale-kernel check failed")
                cgroups, liveness = None, {}
            self._judged = (view.version, now)
            self._log_stale_changes(prev.liveness, liveness)
        resolver = self.resolver(view, snapshot)
        try:
            attribution = self._tracker.update(snapshot, view.kernels.values(), resolver)
        except Exception:
            log.exception("process attribution failed")
            attribution = None
        try:
            accounting = self._accountant.update(view.kernels.values(), snapshot, resolver, self.params.capacity, attribution)
        except Exception:
            log.exception("GPU accounting failed")
            accounting = None
        visible = cgroups.visible if cgroups else None
        moved = liveness != prev.liveness or visible != (prev.cgroups.visible if prev.cgroups else None)
        self.analysis = Analysis(prev.version + 1, prev.liveness_version + moved, cgroups, liveness, attribution, accounting)

    def _log_stale_changes(self, before: Mapping[str, KernelLiveness], after: Mapping[str, KernelLiveness]) -> None:
        """Say once, when it happens, that kernels' allocations leave (or rejoin) the allocated and
        headroom figures: an operator comparing them with the agent's map needs to know why."""
        became = sorted(k for k, v in after.items() if v.status is Liveness.STALE and (k not in before or before[k].status is not Liveness.STALE))
        back = sorted(k for k, v in before.items() if v.status is Liveness.STALE and k in after and after[k].status is not Liveness.STALE)
        excluded = self.settings.headroom_exclude_stale
        effect = ("left out of the allocated and headroom figures" if excluded
                  else "still counted in the allocated and headroom figures (--no-headroom.exclude-stale)")
        for kernels, what, verb in ((became, "stale", effect), (back, "live again", "counted again")):
            if not kernels or (what == "live again" and not excluded):
                continue
            shown = ", ".join(f"{k} ({after[k].reason})" for k in kernels[:_LOG_KERNELS])
            more = f" and {len(kernels) - _LOG_KERNELS} more" if len(kernels) > _LOG_KERNELS else ""
            log.info("%d kernel(s) %s, their allocations %s: %s%s", len(kernels), what, verb, shown, more)

    def resolver(self, view: AllocationView, snapshot: TelemetrySnapshot) -> DeviceResolver:
        """How this node's device ids map to the snapshot's devices."""
        # Only GPU slots decide the id scheme: CPU core ids ("0", "1") would look like ordinals.
        gpu_ids = {d for d, slot in view.device_totals if slot.startswith("cuda.")}
        return DeviceResolver(snapshot, gpu_ids, self.settings.device_id_scheme)

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    # -- metrics -------------------------------------------------------------------------------

    def snapshot(self) -> TelemetrySnapshot:
        """The last published telemetry snapshot (an empty ``none`` one before the sampler starts)."""
        return self.sampler.latest() if self.sampler else TelemetrySnapshot(source="none")

    def sampler_version(self) -> int:
        """Bumped on every published telemetry sample."""
        return self.sampler.version if self.sampler else 0

    def ratio_capacities(self) -> dict[tuple[str, str], Decimal]:
        """The divisors of the ratio alloc map: each device's registered capacity per slot."""
        view, snapshot = self.book.view(), self.snapshot()
        inventory = inventory_from_snapshot(snapshot, self.resolver(view, snapshot))
        return ratio_capacities(self._live_state(view, snapshot), inventory)

    def node_state(self) -> NodeState:
        """Devices with capacity and allocation now: what ``simulate`` places requests on."""
        return self._live_state(self.book.view(), self.snapshot())

    def _live_state(self, view: AllocationView, snapshot: TelemetrySnapshot) -> NodeState:
        """:func:`live_state` of the view and snapshot, built once per change of its inputs
        (immutable objects, compared by identity): at 10,000 kernels a build holds the GIL ~8 ms,
        which every /api/v1/state, ratio alloc-map and agent-headroom request would otherwise pay."""
        liveness = self.analysis.liveness
        cached = self._node_state
        if cached is not None and cached[0] is view and cached[1] is snapshot and cached[2] is liveness:
            return cached[3]
        state = live_state(view, snapshot, self.resolver(view, snapshot), self.params, liveness)
        self._node_state = (view, snapshot, liveness, state)  # one tuple swap, as agent_views does
        return state

    def agent_views(self) -> dict[str, AllocationView]:
        """Each host agent's own kernels and alloc map (:func:`agent_views`), once per book version."""
        view = self.book.view()
        cached = self._agent_views
        if cached[0] != view.version:
            cached = (view.version, agent_views(view, self.layout))
            self._agent_views = cached  # one tuple swap: a racing reader sees the old or the new
        return cached[1]

    def agent_headroom(self) -> dict[str, dict[str, AgentHeadroom]]:
        """Per agent and slot: its reported total and headroom in its own map."""
        view, snapshot = self.book.view(), self.snapshot()
        inventory = inventory_from_snapshot(snapshot, self.resolver(view, snapshot))
        liveness = self.analysis.liveness
        whole = self._live_state(view, snapshot)
        return {
            agent_id: agent_headroom(whole, node_state(own, inventory, self.params, liveness), self.layout, agent_id)
            for agent_id, own in self.agent_views().items()
        }

    def render(self, gzipped: bool = False) -> bytes:
        """The current exposition; each part is rendered once per change of what it shows."""
        return self.collector.render(gzipped)

    def render_cached(self, gzipped: bool = False) -> bytes | None:
        """The current exposition if nothing has to be rendered for it, else None (never waits)."""
        collector = self._collector
        return collector.render_cached(gzipped) if collector is not None else None

    def handle(self, request: Request) -> Response:
        """Answer one HTTP request (the server calls this; see :class:`~exporter.web.routes.Routes`)."""
        return self.routes.handle(request)
