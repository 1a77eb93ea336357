"""The self-metrics of each collector part: success, duration and last success, by ``collector``."""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily, Metric

__all__ = ["collector_status"]


def _g(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def collector_status(
    collector: str, success: bool, duration_seconds: float | None = None, last_success: float | None = None
) -> list[Metric]:
    """The self-metrics every source reports, labelled ``{collector}``; :func:`merge` joins the
    families of all sources into one per name."""
    out = [_g("gpu_alloc_collector_success", "1 if the collector's last run succeeded", ["collector"])]
    out[0].add_metric([collector], int(success))
    if duration_seconds is not None:
        out.append(_g("gpu_alloc_collector_duration_seconds", "Duration of the collector's last run", ["collector"]))
        out[-1].add_metric([collector], duration_seconds)
    if last_success is not None:
        out.append(_g("gpu_alloc_collector_last_success_timestamp_seconds", "Unix time of the collector's last successful run", ["collector"]))
        out[-1].add_metric([collector], last_success)
    return out
