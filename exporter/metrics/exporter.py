"""The exporter's own families: build identity, the scratch watcher's health, and the health of
the opt-in Docker label reader."""

from __future__ import annotations

import platform
from typing import TYPE_CHECKING

from exporter import __version__
from exporter.metrics.collectors import Inputs, Part, register
from exporter.metrics.families import counter, gauge
from exporter.metrics.status import Health
from exporter.scratch.watcher import WatcherStatus

if TYPE_CHECKING:
    from prometheus_client.core import Metric

__all__ = ["build_info", "watcher_families"]


def build_info(agent_ids: tuple[str, ...] | str | None) -> Metric:
    """One sample per agent of the host (one with ``agent_id=""`` when none is known)."""
    ids = (agent_ids,) if isinstance(agent_ids, str) or agent_ids is None else agent_ids
    info = gauge("gpu_alloc_build_info", "Exporter build and runtime identity", ["version", "python_version", "agent_id"])
    for agent_id in ids or (None,):
        info.add_metric([__version__, platform.python_version(), agent_id or ""], 1)
    return info


def watcher_families(status: WatcherStatus) -> list[Metric]:
    """The scratch watcher's own health."""
    out = [
        gauge("gpu_alloc_watcher_up", "1 if the scratch watcher's threads are alive", value=int(status.up)),
        gauge("gpu_alloc_watcher_degraded",
              "1 if events may be missed (inotify watch limit, unreadable root); rescans then run at the poll interval",
              value=int(status.degraded is not None)),
        gauge("gpu_alloc_watcher_watches", "inotify watches held (one per kernel plus one per scratch root)", value=status.watches),
        counter("gpu_alloc_watcher_events", "inotify events handled", value=status.events_total),
        counter("gpu_alloc_watcher_overflows", "inotify queue overflows (each triggers a full rescan)", value=status.overflows_total),
        counter("gpu_alloc_watcher_errors", "Errors while watching or handling events", value=status.watch_errors_total),
        counter("gpu_alloc_watcher_rescans", "Full rescans of the scratch roots (start, periodic, after overflow)",
                value=status.rescans_total),
    ]
    if status.last_event_timestamp is not None:
        out.append(gauge("gpu_alloc_watcher_last_event_timestamp_seconds", "Unix time of the last inotify event",
                         value=status.last_event_timestamp))
    roots = gauge("gpu_alloc_scratch_root_up", "1 if the scratch root could be listed at the last scan", ["scratch_root"])
    for s in status.last_scan:
        roots.add_metric([s.root], int(s.ok))
    out.append(roots)
    return out


@register("build", "gpu_alloc_build_info: version, Python and agent ids", order=0)
def _build(inputs: Inputs) -> list[Part]:
    return [Part("build", lambda: [build_info(inputs.agent_ids)], lambda: 0)]


@register("watcher", "the scratch watcher's health: inotify watches, events, overflows, rescans", order=20)
def _watcher(inputs: Inputs) -> list[Part]:
    return [Part("watcher", lambda: watcher_families(inputs.watcher()), inputs.watcher,
                 health=lambda: Health(inputs.watcher().up))]


@register("docker-labels", "the health of the opt-in Docker label reader (--identity.docker-socket); no families", order=70)
def _docker_labels(inputs: Inputs) -> list[Part]:
    if inputs.docker_labels is None:
        return []
    return [Part("docker-labels", list, inputs.docker_labels, health=inputs.docker_labels)]
