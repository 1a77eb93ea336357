"""Wiring: the allocation book, the watcher, telemetry and the HTTP routes of one exporter process.

``/metrics`` is rendered once per change of its inputs and served from cached bytes (plain and
gzip): prometheus_client renders ~150k samples/s, so re-rendering 20,000 samples for every scrape
would cost ~125 ms each, while an unchanged state costs a dictionary lookup.
"""

from __future__ import annotations

import gzip
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from decimal import Decimal
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from exporter import __version__
from exporter.allocation import AllocationBook, AllocationView
from exporter.collector import ExporterCollector, allocation_families, build_info, watcher_families
from exporter.scratch import Scanner
from exporter.server import Request, Response
from exporter.settings import Settings
from exporter.watcher import ScratchWatcher

__all__ = ["Exporter", "state_document"]

log = logging.getLogger(__name__)

TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"
JSON = "application/json"


class Exporter:
    """One exporter: call :meth:`start`, serve :meth:`handle`, then :meth:`close`."""

    def __init__(self, settings: Settings, *, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.clock = clock
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
        self._render_lock = threading.Lock()
        self._rendered: tuple[Any, bytes, bytes | None] | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ExporterCollector(self._sources()))
        self._routes: dict[str, Callable[[Request], Response]] = {
            "/": self._landing,
            "/metrics": self._metrics,
            "/-/healthy": self._healthy,
            "/-/ready": self._ready_route,
            "/api/v1/alloc-map": self._alloc_map,
            "/api/v1/state": self._state,
        }

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self.watcher.start()  # returns after the first full scan
        self._ready.set()

    def close(self) -> None:
        self.watcher.close()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    # -- metrics -------------------------------------------------------------------------------

    def _sources(self) -> list[tuple[str, Callable[[], Iterable[Metric]]]]:
        return [
            ("build", lambda: [build_info(self.settings.agent_id)]),
            ("scratch", lambda: allocation_families(self.book.view()) + watcher_families(self.watcher.status())),
        ]

    def _state_token(self) -> Any:
        """Everything the exposition depends on; equal tokens mean identical output."""
        return (self.book.version, self.watcher.status())

    def render(self, gzipped: bool = False) -> bytes:
        """The current exposition, rendered at most once per state change."""
        with self._render_lock:
            token = self._state_token()
            if self._rendered is None or self._rendered[0] != token:
                self._rendered = (token, generate_latest(self.registry), None)
            token, plain, packed = self._rendered
            if not gzipped:
                return plain
            if packed is None:
                packed = gzip.compress(plain, compresslevel=1)  # fast: this runs per change, not per scrape
                self._rendered = (token, plain, packed)
            return packed

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
        return _json(state_document(self.book.view(), [str(r) for r in self.settings.scratch_roots]))


def state_document(view: AllocationView, roots: list[str]) -> dict[str, Any]:
    """The ``/api/v1/state`` document (schema in docs/api.md). Amounts are decimal strings, exact."""
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
