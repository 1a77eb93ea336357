"""Wiring: the allocation book, the watcher, telemetry, analysis and the HTTP routes of one exporter.

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

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from prometheus_client.core import Metric

from exporter import __version__
from exporter.allocation import AllocationBook, AllocationView
from exporter.attribution import AttributionResult, AttributionTracker, ProcFS
from exporter.attribution_metrics import attribution_families
from exporter.capacity import CapacityConfig
from exporter.collector import (
    ExporterCollector,
    KernelText,
    Source,
    allocation_families,
    build_info,
    kernel_families,
    render_families,
    unknown_device_families,
    watcher_families,
)
from exporter.devices import DeviceResolver
from exporter.headroom_metrics import (
    DEFAULT_REQUESTS,
    HeadroomParams,
    Inventory,
    NodeState,
    headroom_families,
    inventory_from_snapshot,
    live_state,
)
from exporter.mig_geometry import parse_hami_geometries
from exporter.placement import NoFragRule, Request as PlacementRequest
from exporter.scratch import Scanner
from exporter.server import Request, Response
from exporter.settings import ConfigError, Settings
from exporter.simulate import result_document, simulate
from exporter.staleness import CgroupScan, KernelLiveness, classify_kernels, scan_cgroups
from exporter.telemetry import TelemetrySampler, TelemetrySnapshot, TelemetrySource, open_source
from exporter.telemetry_metrics import telemetry_families
from exporter.watcher import ScratchWatcher

__all__ = ["Exporter", "state_document"]

log = logging.getLogger(__name__)

TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"
STALE_CHECK_SECONDS = 30.0
JSON = "application/json"


@dataclass(frozen=True)
class Analysis:
    """What the analysis thread last published."""

    version: int = 0  # bumped on every analysis (attribution durations move every sample)
    liveness_version: int = 0  # bumped only when liveness or cgroup visibility changed
    cgroups: CgroupScan | None = None
    liveness: Mapping[str, KernelLiveness] = field(default_factory=dict)
    attribution: AttributionResult | None = None


def headroom_params(settings: Settings) -> HeadroomParams:
    """Headroom settings from the flags; raises ConfigError for unusable values."""
    try:
        overrides = {}
        for item in settings.capacity_overrides:
            device_id, sep, shares = item.rpartition("=")
            if not sep or not device_id:
                raise ValueError(f"--capacity.override expects DEVICE_ID=SHARES, got {item!r}")
            overrides[device_id] = Decimal(shares)
        hami = ()
        if settings.mig_geometries_file is not None:
            hami = tuple(parse_hami_geometries(settings.mig_geometries_file.read_text()))
        return HeadroomParams(
            capacity=CapacityConfig(
                unit_mem_bytes=settings.capacity_unit_mem, unit_proc=settings.capacity_unit_proc,
                quantum=settings.capacity_quantum, agents=settings.capacity_agents, overrides=overrides,
            ),
            mode=settings.headroom_mode,
            rule=NoFragRule(settings.headroom_nofrag_rule),
            requests=tuple(PlacementRequest.parse(r) for r in settings.headroom_requests) or DEFAULT_REQUESTS,
            exclude_stale=settings.headroom_exclude_stale,
            hami=hami,
        )
    except (ValueError, ArithmeticError, OSError) as exc:
        raise ConfigError(str(exc).replace("\n", " ")) from None


class Exporter:
    """One exporter: call :meth:`start`, serve :meth:`handle`, then :meth:`close`.

    :param clock: unix time (kernel state timestamps, staleness, telemetry timestamps).
    :param monotonic: seconds for durations (idle and no-process windows).
    :param telemetry: a ready telemetry source (tests pass a fake); by default one is opened
        from ``--telemetry.source`` at :meth:`start`.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        telemetry: TelemetrySource | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.params = headroom_params(settings)
        self._source = telemetry
        self.sampler: TelemetrySampler | None = None
        self._tracker = AttributionTracker(
            ProcFS(str(settings.path_procfs)), monotonic, idle_threshold_ratio=settings.attribution_idle_threshold_ratio
        )
        self.analysis = Analysis()
        self._monotonic = monotonic
        self._judged: tuple[int, float] = (-1, 0.0)  # (view version, monotonic time) of the last staleness check
        self._stop = threading.Event()
        self._analyser: threading.Thread | None = None
        self.book = AllocationBook(clock)
        self.scanner = Scanner(self.book, settings.scratch_max_file_bytes)
        self.watcher = ScratchWatcher(
            self.scanner,
            [str(r) for r in settings.scratch_roots],
            mode=settings.scratch_watch_mode,
            rescan_interval=settings.scratch_rescan_interval,
            poll_interval=settings.scratch_poll_interval,
            clock=clock,
        )
        self._ready = threading.Event()
        self._kernel_text = KernelText()
        self.collector = ExporterCollector(self._sources())
        self._routes: dict[str, Callable[[Request], Response]] = {
            "/": self._landing,
            "/metrics": self._metrics,
            "/-/healthy": self._healthy,
            "/-/ready": self._ready_route,
            "/api/v1/alloc-map": self._alloc_map,
            "/api/v1/state": self._state,
            "/api/v1/simulate": self._simulate,
        }

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        source = self._source or open_source(
            self.settings.telemetry_source, mock_file=self.settings.telemetry_mock_file, pcie=self.settings.telemetry_pcie
        )
        self.sampler = TelemetrySampler(source, self.settings.telemetry_interval, self.settings.telemetry_timeout, self.clock)
        try:
            self.watcher.start()  # returns after the first full scan
        except BaseException:
            self.sampler.close()
            raise
        # The first sample runs alongside the scan; give it until its deadline so the first scrape
        # after /-/ready already has telemetry (a hung NVML only delays readiness by the timeout).
        self.sampler.wait_for_version(0, self.settings.telemetry_timeout)
        self._analyse()
        self._analyser = threading.Thread(target=self._analysis_loop, name="analysis", daemon=True)
        self._analyser.start()
        self._ready.set()

    def close(self) -> None:
        self._stop.set()
        if self.sampler is not None:
            self.sampler.close()  # also wakes the analysis thread
        if self._analyser is not None:
            self._analyser.join()
        self.watcher.close()

    # -- analysis: stale kernels and process attribution, off the scrape path --------------------

    def _analysis_loop(self) -> None:
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
                liveness = classify_kernels(view.kernels, cgroups, self.clock(), self.settings.stale_grace)
            except Exception:
                log.exception("stale-kernel check failed")
                cgroups, liveness = None, {}
            self._judged = (view.version, now)
        try:
            attribution = self._tracker.update(snapshot, view.kernels.values(), self._resolver(view, snapshot))
        except Exception:
            log.exception("process attribution failed")
            attribution = None
        visible = cgroups.visible if cgroups else None
        moved = liveness != prev.liveness or visible != (prev.cgroups.visible if prev.cgroups else None)
        self.analysis = Analysis(prev.version + 1, prev.liveness_version + moved, cgroups, liveness, attribution)

    def _resolver(self, view: AllocationView, snapshot: TelemetrySnapshot) -> DeviceResolver:
        # Only GPU slots decide the id scheme: CPU core ids ("0", "1") would look like ordinals.
        gpu_ids = {d for d, slot in view.device_totals if slot.startswith("cuda.")}
        return DeviceResolver(snapshot, gpu_ids, self.settings.device_id_scheme)

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    # -- metrics -------------------------------------------------------------------------------

    def _sources(self) -> list[Source]:
        """Each source with the token its output depends on (see ExporterCollector.render)."""
        s = self.settings
        book, watcher = self.book, self.watcher

        def telemetry() -> list[Metric]:
            view, snapshot = book.view(), self._snapshot()
            resolver = self._resolver(view, snapshot)
            return telemetry_families(snapshot, resolver) + unknown_device_families(view, snapshot, resolver)

        def inventory() -> Inventory:
            view, snapshot = book.view(), self._snapshot()
            return inventory_from_snapshot(snapshot, self._resolver(view, snapshot))

        def headroom() -> list[Metric]:
            analysis = self.analysis
            visible = analysis.cgroups.visible if analysis.cgroups else None
            return headroom_families(book.view(), None, inventory(), self.params, analysis.liveness, visible)

        def scratch() -> list[Metric]:
            view = book.view()
            return allocation_families(view) + kernel_families(view)

        def scratch_text() -> bytes:
            view = book.view()
            return render_families(allocation_families(view)) + self._kernel_text.render(view)

        return [
            Source("build", lambda: [build_info(s.agent_id)], lambda: 0),
            Source("scratch", scratch, lambda: book.version, scratch_text),
            Source("watcher", lambda: watcher_families(watcher.status()), watcher.status),
            Source("telemetry", telemetry, lambda: (book.version, self._sampler_version())),
            # Headroom depends on the inventory (capacity, MIG layout), not on each sample's readings.
            Source("headroom", headroom, lambda: (book.version, self.analysis.liveness_version, inventory())),
            Source("attribution", lambda: attribution_families(
                self.analysis.attribution, process_detail=s.attribution_process_detail), lambda: self.analysis.version),
        ]

    def _snapshot(self) -> TelemetrySnapshot:
        return self.sampler.latest() if self.sampler else TelemetrySnapshot(source="none")

    def _sampler_version(self) -> int:
        return self.sampler.version if self.sampler else 0

    def node_state(self) -> NodeState:
        """Devices with capacity and allocation now: what ``simulate`` places requests on."""
        view, snapshot = self.book.view(), self._snapshot()
        return live_state(view, snapshot, self._resolver(view, snapshot), self.params, self.analysis.liveness)

    def render(self, gzipped: bool = False) -> bytes:
        """The current exposition; each part is rendered once per change of what it shows."""
        return self.collector.render(gzipped)

    # -- HTTP ----------------------------------------------------------------------------------

    def handle(self, request: Request) -> Response:
        route = self._routes.get(request.path.rstrip("/") or "/")
        if route is None:
            return Response(404, b"not found\n")
        if request.method not in ("GET", "HEAD"):
            return Response(405, b"method not allowed\n", headers={"Allow": "GET, HEAD"})
        return route(request)

    def _landing(self, _: Request) -> Response:
        links = "".join(f'<li><a href="{p}">{p}</a></li>' for p in self._routes if p != "/")
        body = (
            f"<html><head><title>gpu-alloc-exporter</title></head><body><h1>gpu-alloc-exporter {__version__}</h1>"
            f"<p>GPU allocation of Backend.AI kernels.</p><ul>{links}</ul></body></html>"
        )
        return Response(200, body.encode(), "text/html; charset=utf-8")

    def _metrics(self, request: Request) -> Response:
        gz = "gzip" in request.headers.get("accept-encoding", "")
        body = self.render(gzipped=gz)
        return Response(200, body, TEXT_FORMAT, {"Content-Encoding": "gzip"} if gz else {})

    def _healthy(self, _: Request) -> Response:
        status = self.watcher.status()
        if self.ready and not status.up:
            return Response(503, b"scratch watcher stopped\n")
        return Response(200, b"OK\n")

    def _ready_route(self, _: Request) -> Response:
        return Response(200, b"OK\n") if self.ready else Response(503, b"first scan not finished\n")

    def _alloc_map(self, _: Request) -> Response:
        return _json(dict(self.book.view().alloc_map))

    def _state(self, _: Request) -> Response:
        return _json(state_document(self.book.view(), [str(r) for r in self.settings.scratch_roots], self.node_state()))

    def _simulate(self, request: Request) -> Response:
        want = request.query.get("request", [""])[0]
        policy = request.query.get("policy", ["evenly"])[0]
        try:
            result = simulate(self.node_state(), want, policy)
        except ValueError as exc:
            return Response(400, f"{exc}\n".encode())
        return _json(result_document(result))


def state_document(view: AllocationView, roots: list[str], node: NodeState | None = None) -> dict[str, Any]:
    """The ``/api/v1/state`` document (schema in the README). Amounts are decimal strings, exact.

    ``node_state`` (devices with capacity, allocation and stale amounts) is what
    ``gpu-alloc-exporter simulate --state FILE`` reads back.
    """
    devices: dict[str, dict[str, str]] = {}
    for (device_id, slot), amount in sorted(view.device_totals.items()):
        devices.setdefault(device_id, {})[slot] = str(amount)
    return {
        "version": view.version,
        "generated_at": view.created_at,
        "scratch_roots": roots,
        "alloc_map": dict(view.alloc_map),
        "devices": devices,
        "node": {slot: str(v) for slot, v in sorted(view.node_totals.items())},
        "kernel_states": {s.value: n for s, n in view.state_counts.items()},
        "node_state": node.to_json() if node is not None else None,
        "kernels": [
            {
                "kernel_id": k.kernel_id,
                "scratch_root": k.scratch_root,
                "state": k.state.value,
                "reason": k.reason,
                "since": k.since,
                "container_id": k.container_id,
                "requested": {s: str(v) for s, v in k.spec.requested} if k.spec else {},
                "allocations": [
                    {"slot": a.slot, "device_id": a.device_id, "amount": str(a.amount)} for a in k.allocations
                ],
            }
            for k in sorted(view.kernels.values(), key=lambda k: k.kernel_id)
        ],
    }


def _json(obj: Any) -> Response:
    return Response(200, json.dumps(obj, indent=1, default=_default).encode() + b"\n", JSON)


def _default(o: Any) -> Any:
    if isinstance(o, Decimal):
        return str(o)
    raise TypeError(type(o).__name__)
