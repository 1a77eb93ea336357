"""The family helpers' value formatting: the fast paths write exactly what prometheus_client writes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.utils import floatToGoString

from exporter.metrics.families import float_format, float_texts

# What renderers write in bulk: counters and ratios, mostly in [0, 10**6), some tiny, some past it
# (joules, GPU-seconds of a long life), up to where repr itself writes an exponent.
_COUNTERS = (st.floats(min_value=0.0, max_value=999_999.0) | st.floats(min_value=0.0, max_value=1e-3) | st.just(0.0)
             | st.floats(min_value=1e6, max_value=1e17) | st.integers(10**6, 10**16).map(float))


def _go(values: list) -> list[bytes]:
    return [floatToGoString(v).encode() for v in values]


@given(st.lists(_COUNTERS, min_size=1, max_size=50))
def test_bulk_values_are_written_as_prometheus_client_writes_them(values: list[float]) -> None:
    assert float_texts(values) == _go(values)


@given(st.lists(st.floats(allow_nan=True, allow_infinity=True) | st.integers(-10**20, 10**20), min_size=1, max_size=20))
def test_any_values_are_written_as_prometheus_client_writes_them(values: list) -> None:
    assert float_texts(values) == _go(values)
    assert [float_format()(v) for v in values] == [floatToGoString(v) for v in values]


def test_the_edges_of_the_one_call_path() -> None:
    """Below 10**-4 orjson writes no exponent where repr does; 10**6 is where Go's format starts
    one; from 10**16 repr writes one too."""
    for values in ([0.0, 1e-4, 0.5, 999_999.9999999999], [0.0, 9.99e-5, 2.0], [-0.0, 3.0], [1e6, 1.0], [-1e-5, 1.0],
                   [1e6, 1000000.5, 1234567.125, 10.0, 1.5e15, 9999999999999998.0], [1e16, 1.0], [1e15, 1e16 - 2, 0.0]):
        assert float_texts(values) == _go(values)
