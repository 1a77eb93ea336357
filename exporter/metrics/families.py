"""The one family builder of the metric modules.

prometheus_client (whose imports are a large part of a start's) is loaded on the first family
built, not when a metric module is imported: the command line imports every module to learn its
collector (:mod:`exporter.metrics.collectors`) before the exporter is ready, and the collector
itself is built after readiness.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client.core import Metric

_INF = float("inf")
# Below this, floatToGoString writes a finite float as repr does (Go switches to exponents sooner
# than Python only from 10**6 on).
_REPR_BELOW = 1e6
# From this on, orjson writes a float as repr does (see float_texts).
_ORJSON_FROM = 1e-4

__all__ = ["counter", "escape_label", "float_format", "float_texts", "gauge"]


def gauge(name: str, doc: str, labels: Iterable[str] = (), *, value: float | None = None) -> Metric:
    """A gauge family: with ``labels`` (add samples with ``add_metric``) or one unlabelled ``value``."""
    from prometheus_client.core import GaugeMetricFamily

    if value is not None:
        return GaugeMetricFamily(name, doc, value=value)
    return GaugeMetricFamily(name, doc, labels=list(labels))


def counter(name: str, doc: str, labels: Iterable[str] = (), *, value: float | None = None) -> Metric:
    """A counter family; ``name`` without ``_total``, which the exposition adds."""
    from prometheus_client.core import CounterMetricFamily

    if value is not None:
        return CounterMetricFamily(name, doc, value=value)
    return CounterMetricFamily(name, doc, labels=list(labels))


def float_format() -> Callable[[float], str]:
    """How the text format (and prometheus_client) writes a sample value; fetched once per render.

    prometheus_client's ``floatToGoString`` is Python code per sample; for a float below 10**6
    (every ratio, and most counters) it returns ``repr``, so that case skips the call: renderers
    of thousands of samples spend most of their time here.
    """
    from prometheus_client.utils import floatToGoString

    def go_float(value: float) -> str:
        if value.__class__ is float and -_INF < value < _REPR_BELOW:
            return repr(value)
        return floatToGoString(value)

    return go_float


def float_texts(values: list[float]) -> Iterable[str]:
    """:func:`float_format` of each value, for renderers of thousands of samples.

    Where every value is a float in the range that writes as ``repr`` (checked in C: types, sum,
    max), the values are written by orjson in one call: it writes a float's shortest round-trip
    digits, as ``repr`` does, ~10 times faster (12,500 counters: ~1.3 against ~13 ms). The two
    differ only in where they switch to exponents, which orjson does below 10**-4 (``1e-05``
    against ``0.00001``): a list with a value between 0 and that takes ``map(repr)``.
    """
    if values and set(map(type, values)) == {float} and math.isfinite(sum(values)) and max(values) < _REPR_BELOW:
        if min(values) >= 0.0 and min(filter(None, values), default=_ORJSON_FROM) >= _ORJSON_FROM:
            import orjson  # loaded by the first render, after readiness

            return orjson.dumps(values)[1:-1].decode().split(",")
        return map(repr, values)
    return map(float_format(), values)


def escape_label(value: str) -> str:
    """A label value escaped as the text format (and prometheus_client) escapes it, for renderers
    that write exposition text themselves."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
