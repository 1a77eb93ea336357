"""OpenMetrics 1.0 on request: negotiation as Prometheus's clients do it, the form made from the
text format 0.0.4 (checked with prometheus_client's OpenMetrics parser against the golden files),
``_created`` only where a counter's start is known and only when switched on, and the registry
making the form lazily, once per change, without touching the text form."""

from __future__ import annotations

import gzip
import re

import pytest
from helpers import GOLDEN
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from exporter.metrics import registry
from exporter.metrics.registry import ExporterCollector, Part, render_families
from exporter.metrics.text import OPENMETRICS_EOF, CreatedTimes, Deflated, deflate, negotiate, openmetrics_text

GOLDENS = sorted(GOLDEN.glob("*.prom"))

# What Debian's Prometheus 2.42 sends (seen on the wire), what later Prometheus versions send, and
# what VictoriaMetrics' own scraper sends.
PROMETHEUS_2_42 = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                   "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
PROMETHEUS_LATER = ("application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,"
                    "text/plain;version=0.0.4;q=0.3,*/*;q=0.2")
VICTORIAMETRICS = "text/plain;version=0.0.4;q=1,*/*;q=0.1"


@pytest.mark.parametrize(("accept", "openmetrics"), [
    (PROMETHEUS_2_42, True),
    (PROMETHEUS_LATER, True),
    (VICTORIAMETRICS, False),
    ("", False),  # curl, promtool's users
    ("*/*", False),
    ("application/openmetrics-text", True),
    ("Application/OpenMetrics-Text; Version=1.0.0", True),
    ("application/openmetrics-text; version=0.0.1", False),  # a version this exporter does not write
    ("application/openmetrics-text;version=2.0.0,text/plain", False),
    ("text/plain;q=0.9,application/openmetrics-text;q=0.8", False),  # q-values, not order
    ("text/plain;q=0.8,application/openmetrics-text;q=0.9", True),
    ("text/plain,application/openmetrics-text", False),  # a tie: header order
    ("application/openmetrics-text;q=0,text/plain", False),  # q=0: not acceptable
    ("application/openmetrics-text;q=nope,*/*;q=0.1", False),  # a malformed q-value: passed over
    ("application/json,application/openmetrics-text;q=0.5", True),  # an unknown type: passed over
    ("text/plain;version=1.0.0,application/openmetrics-text;q=0.5", True),  # text 1.0.0 is not written here
])
def test_negotiation_follows_q_values_as_prometheus_clients_do(accept: str, openmetrics: bool) -> None:
    assert negotiate(accept) is openmetrics


def _samples(families) -> list[tuple[str, tuple, float]]:
    return sorted((s.name, tuple(sorted(s.labels.items())), s.value) for f in families for s in f.samples)


@pytest.mark.parametrize("golden", GOLDENS, ids=lambda p: p.name)
def test_every_golden_exposition_converts_to_openmetrics_the_parser_accepts(golden) -> None:
    text = golden.read_bytes()
    om = (openmetrics_text(text) + OPENMETRICS_EOF).decode()
    families = list(parse_openmetrics(om))  # raises on anything OpenMetrics 1.0 forbids
    classic = list(parse_text(text.decode()))
    assert _samples(families) == _samples(classic)  # the same samples, no more (no _created)
    assert "_created" not in om
    by_name = {f.name: f for f in families}
    for family in classic:
        assert by_name[family.name].type == family.type
        assert by_name[family.name].documentation == family.documentation
    for name, family in by_name.items():
        unit = re.search(r"_(seconds|bytes|joules|watts|celsius|hertz|volts|amperes|meters|grams|ratio)$", name)
        assert family.unit == (unit.group(1) if unit else ""), name
    assert "# TYPE gpu_alloc_collector_success gauge" in om or golden.name == "multi-agent.prom"


def test_counter_metadata_and_help_escaping() -> None:
    text = render_families([
        CounterMetricFamily("gpu_alloc_device_energy_joules", 'Energy "since boot"\\ with\nnewline', value=5),
        GaugeMetricFamily("gpu_alloc_kernel_memory_ratio", "a ratio", value=0.5),
    ])
    om = (openmetrics_text(text) + OPENMETRICS_EOF).decode()
    assert om.startswith('# HELP gpu_alloc_device_energy_joules Energy \\"since boot\\"\\\\ with\\nnewline\n'
                         "# TYPE gpu_alloc_device_energy_joules counter\n# UNIT gpu_alloc_device_energy_joules joules\n"
                         "gpu_alloc_device_energy_joules_total 5.0\n")
    (energy, ratio) = parse_openmetrics(om)
    assert energy.documentation == 'Energy "since boot"\\ with\nnewline' and energy.unit == "joules"
    assert ratio.unit == "ratio"


def _counter_text(values: dict[str, float]) -> bytes:
    family = CounterMetricFamily("gpu_alloc_watcher_events", "events", labels=["root"])
    for root, value in values.items():
        family.add_metric([root], value)
    return render_families([family, GaugeMetricFamily("gpu_alloc_up", "up", value=1)])


def _created(om: bytes) -> dict[str, float]:
    families = list(parse_openmetrics((om + OPENMETRICS_EOF).decode()))
    return {s.labels["root"]: s.value for f in families for s in f.samples if s.name.endswith("_created")}


def test_created_only_where_a_counter_was_seen_at_zero_and_kept_while_it_counts_up() -> None:
    created = CreatedTimes()
    # "b" is first seen above 0: it counted before anyone looked, its start is unknown.
    assert _created(openmetrics_text(_counter_text({"a": 0, "b": 7}), created, 100.0)) == {"a": 100.0}
    assert _created(openmetrics_text(_counter_text({"a": 3, "b": 9, "c": 0}), created, 200.0)) == {"a": 100.0, "c": 200.0}
    # "a" fell: a reset at an unknown time; "c" still 0; "b" went away and is forgotten.
    assert _created(openmetrics_text(_counter_text({"a": 1, "c": 0}), created, 300.0)) == {"c": 200.0}
    assert len(created) == 1
    # "a" at 0 again: it counts from now; "b" back at 0 is new.
    assert _created(openmetrics_text(_counter_text({"a": 0, "b": 0, "c": 4}), created, 400.0)) == {"a": 400.0, "b": 400.0, "c": 200.0}
    # Each _created follows its own _total (OpenMetrics groups a series' samples).
    lines = openmetrics_text(_counter_text({"a": 1, "b": 1, "c": 5}), created, 500.0).decode().splitlines()
    assert lines[2:8] == ['gpu_alloc_watcher_events_total{root="a"} 1.0', 'gpu_alloc_watcher_events_created{root="a"} 400.0',
                          'gpu_alloc_watcher_events_total{root="b"} 1.0', 'gpu_alloc_watcher_events_created{root="b"} 400.0',
                          'gpu_alloc_watcher_events_total{root="c"} 5.0', 'gpu_alloc_watcher_events_created{root="c"} 200.0']


def _collector(version: dict[str, int], **kwargs) -> ExporterCollector:
    def counters() -> list:
        family = CounterMetricFamily("gpu_alloc_watcher_events", "events", labels=["root"])
        family.add_metric(["/scratch"], version["n"])
        return [family]

    def big() -> Deflated:  # kept compressed only, as the scratch part is
        return deflate(render_families([GaugeMetricFamily("gpu_alloc_big_bytes", "big", value=2 ** 20)]))

    return ExporterCollector([
        Part("big", list, lambda: 0, big, gzipped=True),
        Part("counters", counters, lambda: version["n"]),
    ], clock=lambda: 1.7e9, **kwargs)


def _no_durations(text: bytes) -> bytes:
    return re.sub(rb"^gpu_alloc_collector_duration_seconds.*$", b"", text, flags=re.M)


def test_openmetrics_is_made_only_when_asked_once_per_change_and_leaves_the_text_alone(monkeypatch) -> None:
    conversions = []
    real = registry.openmetrics_text
    def spy(text: bytes, *args) -> bytes:
        if not text.startswith(b"# HELP gpu_alloc_collector_success"):  # the status families: made with each body
            conversions.append(text)
        return real(text, *args)

    monkeypatch.setattr(registry, "openmetrics_text", spy)
    version = {"n": 0}
    collector = _collector(version)
    text, packed = collector.render(), collector.render(gzipped=True)
    assert conversions == []  # a text-only fleet pays nothing
    assert collector.render_cached(openmetrics=True) is None  # never made on the serving loop

    om = collector.render(openmetrics=True)
    families = {f.name: f for f in parse_openmetrics(om.decode())}
    assert families["gpu_alloc_watcher_events"].type == "counter"
    assert families["gpu_alloc_big_bytes"].unit == "bytes"
    assert families["gpu_alloc_collector_success"].samples[0].labels == {"collector": "big"}
    assert om.endswith(b"\n# EOF\n") and om.count(b"# EOF") == 1
    assert "gpu_alloc_watcher_events_created" not in {s.name for f in families.values() for s in f.samples}  # off by default
    made = len(conversions)
    assert made == 2  # each part once

    # Cached per format and encoding: the same bytes objects, no more conversions.
    assert collector.render_cached(openmetrics=True) is om is collector.render(openmetrics=True)
    om_packed = collector.render(gzipped=True, openmetrics=True)
    assert gzip.decompress(om_packed) == om and collector.render_cached(gzipped=True, openmetrics=True) is om_packed
    assert len(conversions) == made
    assert collector.render() is text and collector.render(gzipped=True) is packed  # the text form untouched

    # A change: only the part that changed is converted again (and the status families).
    version["n"] = 1
    assert collector.render_cached(openmetrics=True) is None
    om2 = collector.render(gzipped=True, openmetrics=True)
    assert b"gpu_alloc_watcher_events_total{root=\"/scratch\"} 1.0" in gzip.decompress(om2)
    assert len(conversions) == made + 1
    assert _no_durations(gzip.decompress(collector.render(gzipped=True))) == _no_durations(
        text.replace(b'{root="/scratch"} 0.0', b'{root="/scratch"} 1.0'))


def test_created_is_written_when_switched_on() -> None:
    version = {"n": 0}
    collector = _collector(version, openmetrics_created=True)
    assert b"_created" not in collector.render()  # never in the text form
    om = collector.render(openmetrics=True)
    assert b'gpu_alloc_watcher_events_created{root="/scratch"} 1700000000.0\n' in om
    list(parse_openmetrics(om.decode()))
    version["n"] = 2
    assert b'gpu_alloc_watcher_events_created{root="/scratch"} 1700000000.0\n' in collector.render(openmetrics=True)
