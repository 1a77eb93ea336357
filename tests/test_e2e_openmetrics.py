"""OpenMetrics against real engines: the exporter as a process, scraped by Debian's Prometheus
2.42 (which asks for OpenMetrics first) and written on to VictoriaMetrics.

Two exporters on one demo tree: one with the default (no ``_created``), one with
``--web.openmetrics-created``. Checks that

* a plain request gets text format 0.0.4 that ``promtool check metrics`` passes, and Prometheus'
  Accept header gets OpenMetrics 1.0 (the right Content-Type, gzip or not) that
  prometheus_client's OpenMetrics parser accepts;
* Prometheus ingests the OpenMetrics form (the target is up, the units reach its metadata);
* with the default, Prometheus and VictoriaMetrics hold exactly the series of the text form;
* with ``_created`` switched on, both store every ``_created`` sample as a series of its own:
  why the switch is off by default.
"""

from __future__ import annotations

import gzip
import http.client
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from e2e.harness import Exporter, Prometheus, VictoriaMetrics, running, wait_until
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from exporter.demo import build_demo_tree

ROOT = Path(__file__).resolve().parent.parent
MOCK_FILE = ROOT / "exporter" / "data" / "demo-devices.toml"
# What Debian's Prometheus 2.42 sends, as seen on the wire.
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")

pytestmark = [pytest.mark.slow, pytest.mark.tools("prometheus", "promtool", "victoria-metrics")]


@dataclass
class Engines:
    plain: Exporter  # the default: no _created
    created: Exporter  # --web.openmetrics-created
    prom: Prometheus
    vm: VictoriaMetrics


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    work = tmp_path_factory.mktemp("openmetrics")
    scratch, cgroups = work / "scratch", work / "cgroup-empty"
    build_demo_tree(scratch)
    cgroups.mkdir()
    args = ["--scratch.root", str(scratch), "--telemetry.source", "mock", "--telemetry.mock-file", str(MOCK_FILE),
            "--path.cgroupfs", str(cgroups), "--agent.id", "om-agent"]
    with running() as started:
        for name in ("plain", "created"):
            (work / name).mkdir()  # each exporter's log
        plain = Exporter(args, work / "plain")
        started.append(plain)
        created = Exporter([*args, "--web.openmetrics-created"], work / "created")
        started.append(created)
        vm = VictoriaMetrics(work)
        started.append(vm)
        config = {
            "global": {"scrape_interval": "500ms", "scrape_timeout": "500ms"},
            "scrape_configs": [{"job_name": "om", "static_configs": [{"targets": [plain.address, created.address]}]}],
            "remote_write": [{"url": vm.write_url}],
        }
        prom = Prometheus(work, config=config)
        started.append(prom)
        wait_until(lambda: len(prom.query('up{job="om"} == 1')) == 2 and len(prom.query('count by (instance) (gpu_alloc_build_info)')) == 2,
                   30, "Prometheus to scrape both exporters")
        yield Engines(plain, created, prom, vm)


def get(exporter: Exporter, headers: dict[str, str]) -> tuple[str, str, bytes]:
    """(Content-Type, Content-Encoding, body as sent)."""
    conn = http.client.HTTPConnection("127.0.0.1", exporter.port, timeout=10)
    try:
        conn.request("GET", "/metrics", headers=headers)
        r = conn.getresponse()
        return r.getheader("Content-Type", ""), r.getheader("Content-Encoding", ""), r.read()
    finally:
        conn.close()


def test_text_for_plain_clients_and_openmetrics_for_prometheus(engines: Engines) -> None:
    content_type, encoding, text = get(engines.plain, {})
    assert content_type == "text/plain; version=0.0.4; charset=utf-8" and encoding == ""
    lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert lint.returncode == 0, lint.stderr.decode()
    assert b"# EOF" not in text and b"# UNIT" not in text

    for gz in (False, True):
        content_type, encoding, body = get(engines.plain, {"Accept": PROMETHEUS_ACCEPT, **({"Accept-Encoding": "gzip"} if gz else {})})
        assert content_type == "application/openmetrics-text; version=1.0.0; charset=utf-8"
        assert encoding == ("gzip" if gz else "")
        om = (gzip.decompress(body) if gz else body).decode()
        families = {f.name: f for f in parse_openmetrics(om)}
        assert families["gpu_alloc_collector_duration_seconds"].unit == "seconds"
        assert families["gpu_alloc_watcher_events"].type == "counter"
        assert not any(s.name.endswith("_created") for f in families.values() for s in f.samples)
    # The text form is what it was: the same families, and no sample name only one form has.
    names = {s.name for f in parse_text(text.decode()) for s in f.samples}
    assert names == {s.name for f in parse_openmetrics(om) for s in f.samples}


def _series(engine, instance: str) -> set[tuple]:
    data = engine.api("series", **{"match[]": f'{{job="om",instance="{instance}",__name__=~"gpu_alloc_.+"}}'})
    return {tuple(sorted(s.items())) for s in data}


def _names(series: set[tuple]) -> set[str]:
    return {dict(s)["__name__"] for s in series}


def _text_names(exporter: Exporter) -> set[str]:
    return {s.name for f in parse_text(get(exporter, {})[2].decode()) for s in f.samples}


def test_prometheus_ingests_openmetrics_and_the_default_adds_no_series(engines: Engines) -> None:
    prom, vm = engines.prom, engines.vm
    targets = prom.api("targets")["activeTargets"]
    assert {t["health"] for t in targets} == {"up"} and {t["lastError"] for t in targets} == {""}
    # Units exist only in OpenMetrics: their presence shows which parser Prometheus used.
    metadata = prom.api("targets/metadata", match_target=f'{{instance="{engines.plain.address}"}}',
                        metric="gpu_alloc_collector_duration_seconds")
    assert metadata and metadata[0]["unit"] == "seconds"

    # The default: the series of the text form, in Prometheus and in VictoriaMetrics (the demo
    # node settles in its first seconds: compare once both are current).
    wait_until(lambda: _names(_series(prom, engines.plain.address)) == _text_names(engines.plain), 15,
               "Prometheus to hold the series of the text form")
    stored = _series(prom, engines.plain.address)
    assert not any(n.endswith("_created") for n in _names(stored))
    wait_until(lambda: _series(vm, engines.plain.address) == stored, 15, "VictoriaMetrics to hold what Prometheus holds")

    # Switched on: each _created sample becomes one more series in both engines, beside its _total.
    wait_until(lambda: _names(_series(prom, engines.created.address)) - _text_names(engines.created)
               and all(n.endswith("_created") for n in _names(_series(prom, engines.created.address)) - _text_names(engines.created)),
               15, "Prometheus to hold the _created series")
    with_created = _series(prom, engines.created.address)
    extra = {s for s in with_created if dict(s)["__name__"].endswith("_created")}
    for series in extra:
        labels = dict(series)
        total = {**labels, "__name__": labels["__name__"].removesuffix("_created") + "_total"}
        assert tuple(sorted(total.items())) in with_created, series
    wait_until(lambda: {s for s in _series(vm, engines.created.address) if dict(s)["__name__"].endswith("_created")} == extra, 15,
               "VictoriaMetrics to hold the _created series")
