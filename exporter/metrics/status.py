"""Each collector part's health and the ``gpu_alloc_collector_*`` families the registry alone
emits from it, as node_exporter's ``execute()`` does: success, duration and last success per part."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # Health is imported by the app before readiness; prometheus_client is not
    from prometheus_client.core import Metric

__all__ = ["Health", "PartStatus", "status_families"]


@dataclass(frozen=True, slots=True)
class Health:
    """What a part's background work last reported of itself (the telemetry sampler's cycle, the
    scratch scan, the attribution pass). ``None`` fields: not measured there."""

    success: bool
    duration_seconds: float | None = None
    last_success_timestamp: float | None = None


@dataclass(frozen=True, slots=True)
class PartStatus:
    """One part's row of the status families, as of this render."""

    collector: str
    success: bool
    duration_seconds: float | None  # None until the part has rendered once
    last_success_timestamp: float | None  # None until the part has succeeded once


def status_families(rows: Sequence[PartStatus]) -> list[Metric]:
    """The three status families, one sample per part and family (a value that is not known yet is
    left out rather than exported as 0)."""
    from prometheus_client.core import GaugeMetricFamily

    success = GaugeMetricFamily("gpu_alloc_collector_success", "1 if the collector's last run succeeded", labels=["collector"])
    duration = GaugeMetricFamily("gpu_alloc_collector_duration_seconds", "Duration of the collector's last run", labels=["collector"])
    last = GaugeMetricFamily(
        "gpu_alloc_collector_last_success_timestamp_seconds", "Unix time of the collector's last successful run", labels=["collector"]
    )
    for row in rows:
        success.add_metric([row.collector], int(row.success))
        if row.duration_seconds is not None:
            duration.add_metric([row.collector], row.duration_seconds)
        if row.last_success_timestamp is not None:
            last.add_metric([row.collector], row.last_success_timestamp)
    return [success, duration, last]
