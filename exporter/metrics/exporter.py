"""The exporter's own families: build identity and the scratch watcher's health."""

from __future__ import annotations

import platform

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from exporter import __version__
from exporter.scratch.watcher import WatcherStatus

__all__ = ["build_info", "watcher_families"]


def _g(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def build_info(agent_id: str | None) -> Metric:
    info = _g("gpu_alloc_build_info", "Exporter build and runtime identity", ["version", "python_version", "agent_id"])
    info.add_metric([__version__, platform.python_version(), agent_id or ""], 1)
    return info


def watcher_families(status: WatcherStatus) -> list[Metric]:
    """The scratch watcher's own health."""
    out = [
        _one("gpu_alloc_watcher_up", "1 if the scratch watcher's threads are alive", int(status.up)),
        _one("gpu_alloc_watcher_degraded", "1 if events may be missed (inotify watch limit, unreadable root); rescans then run at the poll interval", int(status.degraded is not None)),
        _one("gpu_alloc_watcher_watches", "inotify watches held (one per kernel plus one per scratch root)", status.watches),
        _counter("gpu_alloc_watcher_events", "inotify events handled", status.events_total),
        _counter("gpu_alloc_watcher_overflows", "inotify queue overflows (each triggers a full rescan)", status.overflows_total),
        _counter("gpu_alloc_watcher_errors", "Errors while watching or handling events", status.watch_errors_total),
        _counter("gpu_alloc_watcher_rescans", "Full rescans of the scratch roots (start, periodic, after overflow)", status.rescans_total),
    ]
    if status.last_event_timestamp is not None:
        out.append(_one("gpu_alloc_watcher_last_event_timestamp_seconds", "Unix time of the last inotify event", status.last_event_timestamp))
    roots = _g("gpu_alloc_scratch_root_up", "1 if the scratch root could be listed at the last scan", ["scratch_root"])
    for s in status.last_scan:
        roots.add_metric([s.root], int(s.ok))
    out.append(roots)
    return out


def _one(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
