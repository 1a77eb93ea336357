"""The one family builder of the metric modules.

prometheus_client (whose imports are a large part of a start's) is loaded on the first family
built, not when a metric module is imported: the command line imports every module to learn its
collector (:mod:`exporter.metrics.collectors`) before the exporter is ready, and the collector
itself is built after readiness.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from itertools import compress, count
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client.core import Metric

_INF = float("inf")
# Below this, floatToGoString writes a finite float as repr does (Go switches to exponents sooner
# than Python only from 10**6 on).
_REPR_BELOW = 1e6
# From this on, and below the next, orjson writes a float as repr does (see float_texts).
_ORJSON_FROM = 1e-4
_ORJSON_BELOW = 1e16
_GO_DIGITS = 6  # integer digits Go writes before it switches to an exponent

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


def float_texts(values: list[float]) -> list[bytes]:
    """:func:`float_format` of each value, as ASCII, for renderers of thousands of samples.

    Where every value is a finite float from 0 or 10**-4 up to 10**16 (checked in C: types, sum,
    extremes), the values are written by orjson in one call: it writes a float's shortest
    round-trip digits, as ``repr`` does, ~10 times faster (12,500 counters: ~1.3 against ~13 ms).
    Below 10**-4 the two write different exponents (orjson ``5e-5``, ``repr`` ``5e-05``): those
    values are written by ``repr``, one call each and only for them (a counter that started since
    the last pass is one; the others keep the one call). Go, and so the text format, writes an
    exponent past six integer digits (``1.234567125e+06``): those values are rewritten from
    orjson's digits as ``floatToGoString`` rewrites ``repr``'s, one short step each and only for
    them (a GPU's joules pass 10**6 within half an hour).
    """
    if values and set(map(type, values)) == {float} and math.isfinite(sum(values)):
        low, high = min(values), max(values)
        if low >= 0.0 and high < _ORJSON_BELOW:
            import orjson  # loaded by the first render, after readiness

            texts = orjson.dumps(values)[1:-1].split(b",")
            if min(filter(None, values), default=_ORJSON_FROM) < _ORJSON_FROM:
                # The indexes below 10**-4 found in C; zeros among them are written alike.
                for i in compress(count(), map(_ORJSON_FROM.__gt__, values)):
                    if values[i]:
                        texts[i] = repr(values[i]).encode()
            if high >= _REPR_BELOW:
                texts = [_go_exponent(t) if t.find(b".") > _GO_DIGITS else t for t in texts]
            return texts
    return [text.encode() for text in map(float_format(), values)]


def _go_exponent(text: bytes) -> bytes:
    """A decimal ``repr`` text with more than six integer digits as floatToGoString writes it:
    the digits after the first as a fraction, trailing zeros (and a bare point) dropped."""
    dot = text.find(b".")
    return (text[:1] + b"." + text[1:dot] + text[dot + 1:]).rstrip(b"0.") + b"e+%02d" % (dot - 1)


def escape_label(value: str) -> str:
    """A label value escaped as the text format (and prometheus_client) escapes it, for renderers
    that write exposition text themselves."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
