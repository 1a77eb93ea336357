"""The fleet path on real engines: zone Prometheus → federation and remote write → global views.

One run (~30 s), everything from Debian's packages on loopback:

* three real exporters (``python -m exporter`` with mock telemetry over generated scratch trees):
  one with a planted overcommitted kernel (an alert fires), one whose free fGPU is scattered in
  small remainders (the "stranded free fGPU" table has a row), one plain; plus the golden
  expositions with process attribution (``tests/golden/full.prom``, ``mixed.prom``: what the mock
  source does not produce) served as two more nodes;
* a zone Prometheus built from ``deploy/prometheus/prometheus.yml`` (its external label, its rule
  files) scraping them under a job name no rule knows, and remote-writing with the relabelling
  of ``deploy/prometheus/remote-write.yml`` to a global VictoriaMetrics;
* a global Prometheus federating the zone with the ``match[]`` of ``deploy/prometheus/federation.yml``;
* a second VictoriaMetrics receiving the zone's raw series, with vmalert evaluating the same rule
  files there (the VictoriaMetrics-only path).

Every query of the fleet dashboard, and its variables, must return data on the global
Prometheus, on the global VictoriaMetrics and on the vmalert-evaluated VictoriaMetrics; the
firing-alerts and stranded-fGPU panels in particular, and nothing may carry the raw series or
the per-kernel recordings across.
"""

from __future__ import annotations

import copy
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e.harness import (
    Exporter,
    Prometheus,
    PromQLError,
    QueryAPI,
    StaticExpositions,
    VictoriaMetrics,
    VMAlert,
    Webhook,
    e2e_rules,
    wait_until,
)

from exporter.demo import build_demo_tree, demo_devices, write_kernel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "dashboards" / "src"))

import monitoring_checks as mc  # noqa: E402
from gpu_alloc_dashboards import FLEET_UID, expected_empty  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.tools("prometheus", "promtool", "victoria-metrics", "vmalert"),
]

DEPLOY = ROOT / "deploy" / "prometheus"
MOCK_FILE = ROOT / "exporter" / "data" / "demo-devices.toml"
JOB = "zone-a-racks"  # any name: nothing depends on it
ZONE = "zone-a"
# Panels the task calls out as empty on a global view before: they must have rows here.
GOLDEN_NODES = ("full.prom", "mixed.prom")  # the golden files that are whole nodes (with gpu_alloc_build_info)
MUST_HAVE_DATA = ("Firing gpu-alloc alerts", "Stranded free fGPU")


@dataclass
class Fleet:
    zone: Prometheus
    global_prom: Prometheus
    vm_global: VictoriaMetrics
    vm_zone: VictoriaMetrics
    vmalert: VMAlert
    exporters: list[Exporter]


def _capacity(exporter: Exporter) -> dict[str, Decimal]:
    """cuda.shares capacity per whole GPU, from the exporter's own /metrics."""
    out = {}
    for line in exporter.metrics().splitlines():
        m = re.match(r'gpu_alloc_device_capacity\{[^}]*device_id="(GPU-[^"]+)"[^}]*slot="cuda\.shares"[^}]*\} (\S+)', line)
        if m:
            out[m.group(1)] = Decimal(m.group(2))
    return out


def zone_config(targets: list[str], rule_files: list[Path], remote: list[dict[str, Any]]) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml for a test: fast intervals, loopback targets, the test's rule copies."""
    doc = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert doc["global"]["external_labels"] == {"zone": ZONE}
    assert doc["rule_files"] == [p.name for p in mc.RULE_FILES]
    doc["global"].update({"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"})
    doc["rule_files"] = [str(p) for p in rule_files]
    doc.pop("alerting")
    doc["scrape_configs"] = [{"job_name": JOB, "static_configs": [{"targets": targets}]}]
    doc["remote_write"] = remote
    return doc


def shipped_remote_write(url: str) -> dict[str, Any]:
    rw = copy.deepcopy(yaml.safe_load((DEPLOY / "remote-write.yml").read_text())["remote_write"][0])
    rw["url"] = url
    rw["queue_config"] = {"batch_send_deadline": "500ms"}
    return rw


def global_config(zone: str) -> dict[str, Any]:
    doc = yaml.safe_load((DEPLOY / "federation.yml").read_text())
    doc["global"].update({"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"})
    doc["scrape_configs"][0]["static_configs"] = [{"targets": [zone]}]
    return doc


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("fleet")
    gpus, _ = demo_devices()
    started: list[Any] = []
    try:
        exporters = []
        for i in range(3):
            node = work / f"node-{i}"
            scratch, cgroups = node / "scratch", node / "cgroup-empty"
            scratch.mkdir(parents=True)
            cgroups.mkdir()
            if i < 2:
                build_demo_tree(scratch)
            if i == 2:  # a first fractional kernel makes the node a cuda.shares node
                write_kernel(scratch, "f1ee0000-0000-4000-8000-0000000000ff", {"cuda.shares": {gpus[0]: Decimal("0.1")}})
            if i == 0:  # more shares than one GPU holds: GpuAllocFgpuOvercommitted fires
                write_kernel(scratch, "f1ee0000-0000-4000-8000-00000000fa17", {"cuda.shares": {gpus[3]: Decimal("14")}})
            exporter = Exporter(["--scratch.root", str(scratch), "--telemetry.source", "mock", "--telemetry.mock-file", str(MOCK_FILE),
                                 "--telemetry.interval", "0.5", "--path.cgroupfs", str(cgroups), "--agent.id", f"agent-{i}"], node)
            started.append(exporter)
            exporters.append(exporter)
        # node-2: leave 0.3 fGPU on each GPU, so its free fGPU (>= 1 in total) fits no 0.5 request.
        capacity = wait_until(lambda: _capacity(exporters[2]), 15, "node-2's capacity")
        for n, (gpu, cap) in enumerate(sorted(capacity.items())):
            held = Decimal("0.1") if gpu == gpus[0] else Decimal(0)
            write_kernel(work / "node-2" / "scratch", f"f1ee0000-0000-4000-8000-0000000000{n:02d}", {"cuda.shares": {gpu: cap - held - Decimal("0.3")}})

        goldens = {name: (mc.GOLDEN_DIR / name).read_bytes() for name in GOLDEN_NODES}
        static = StaticExpositions(goldens)
        started.append(static)
        webhook = Webhook()
        started.append(webhook)
        vm_global = VictoriaMetrics(work, "vm-global")
        started.append(vm_global)
        vm_zone = VictoriaMetrics(work, "vm-zone")
        started.append(vm_zone)
        # for: 0s copies (the durations are covered by the promtool unit tests), group intervals 1s.
        rules = e2e_rules(work, list(mc.RULE_FILES))
        # The VictoriaMetrics-only path: raw exporter series in, vmalert records and alerts there.
        raw = {"url": vm_zone.write_url, "queue_config": {"batch_send_deadline": "500ms"},
               "write_relabel_configs": [{"source_labels": ["__name__"], "regex": "gpu_alloc_.+|up", "action": "keep"}]}
        config = zone_config([e.address for e in exporters], rules, [shipped_remote_write(vm_global.write_url), raw])
        config["scrape_configs"] += [{"job_name": f"{JOB}-{name}", "metrics_path": f"/{name}",
                                      "static_configs": [{"targets": [f"127.0.0.1:{static.port}"], "labels": {"instance": name}}],
                                      "relabel_configs": [{"target_label": "job", "replacement": JOB}]} for name in goldens]
        zone = Prometheus(work, config=config, name="prometheus-zone")
        started.append(zone)
        global_prom = Prometheus(work, config=global_config(zone.address), name="prometheus-global")
        started.append(global_prom)
        vmalert = VMAlert(work, rules, vm_zone, f"http://127.0.0.1:{webhook.port}")
        started.append(vmalert)
        f = Fleet(zone, global_prom, vm_global, vm_zone, vmalert, exporters)
        # Cold start: ~5 s to the first scrape, then recording rules, federation and remote write;
        # the kernel group and the fault's alert must have been evaluated on every engine.
        ready = ('zone_kernel:gpu_alloc_kernel_fgpu_allocated:topk20', 'ALERTS{alertname="GpuAllocNodeFragmented", alertstate="firing"}',
                 'ALERTS{alertname="GpuAllocFgpuOvercommitted", alertstate="firing"}', f'count(instance:gpu_alloc_fgpu_allocated:sum{{job="{JOB}"}}) == {3 + len(GOLDEN_NODES)}',
                 "zone:gpu_alloc_idle_fgpu_allocated:sum")  # the longest chain of recorded series
        for engine in (global_prom, vm_global, vm_zone):
            wait_until(lambda engine=engine: all(_query(engine, q) for q in ready), 60, f"fleet series on {engine.url}", interval=0.5)
        yield f
    finally:
        for thing in reversed(started):
            thing.close() if hasattr(thing, "close") else thing.stop()


def _query(engine: QueryAPI, expr: str) -> list[dict[str, Any]]:
    try:
        return engine.query(expr)
    except (PromQLError, OSError):
        return []


def fleet_values(fragmentation: str) -> dict[str, str]:
    return {"job": ".*", "agent": ".*", "instance": ".*", "fragmentation": fragmentation, "datasource": "x",
            "__rate_interval": "4s", "__interval": "1s"}


def missing_fleet_data(engine: QueryAPI) -> list[str]:
    """Fleet-dashboard queries (and variables) that fail or return nothing on ``engine``."""
    doc = json.loads((ROOT / "dashboards" / "gpu-alloc-fleet.json").read_text())
    empty_ok = expected_empty()
    problems = []
    for q in mc.dashboard_queries(doc):
        try:
            got = any(engine.query(mc.substitute_vars(q.expr, fleet_values(f))) for f in ("disallowed", "allowed"))
        except PromQLError as exc:
            problems.append(f"{q.key}: fails: {exc}")
            continue
        if got:
            continue
        if (FLEET_UID, q.panel, q.ref) in empty_ok and q.panel not in MUST_HAVE_DATA:
            continue
        problems.append(f"{q.key}: no data: {q.expr}")
    return problems


@pytest.mark.parametrize("engine", ["global-prometheus", "vm-remote-write", "vm-vmalert"])
def test_every_fleet_panel_returns_data(fleet: Fleet, engine: str) -> None:
    target = {"global-prometheus": fleet.global_prom, "vm-remote-write": fleet.vm_global, "vm-vmalert": fleet.vm_zone}[engine]
    assert missing_fleet_data(target) == []


def test_variables_list_the_zone_nodes_on_every_engine(fleet: Fleet) -> None:
    instances = {e.address for e in fleet.exporters} | set(GOLDEN_NODES)
    for engine in (fleet.global_prom, fleet.vm_global, fleet.vm_zone):
        got = {r["metric"]["instance"] for r in engine.query("instance:gpu_alloc_build_info:last")}
        assert got == instances, engine.url
        agents = {r["metric"]["agent_id"] for r in engine.query("instance:gpu_alloc_build_info:last")}
        assert {"agent-0", "agent-1", "agent-2"} < agents


def test_the_global_level_gets_the_zone_label_and_no_raw_or_per_kernel_series(fleet: Fleet) -> None:
    for engine in (fleet.global_prom, fleet.vm_global):
        names = {r["metric"]["__name__"] for r in engine.query('{__name__=~".+", zone="zone-a"}')}
        assert names, engine.url
        assert not {n for n in names if n.startswith("gpu_alloc_") or n.startswith("instance_kernel:")}, engine.url
        assert "ALERTS" in names and "global:gpu_alloc_node_free_fgpu:threshold" in names
        assert not engine.query('ALERTS{alertstate="pending"}')
        assert not engine.query('{__name__=~".+", zone!="zone-a", job!="federate-gpu-alloc"}'), engine.url


def test_federated_series_per_node_stay_small(fleet: Fleet) -> None:
    """The zone-level series (zone_*, global:*, job:*, ALERTS) are per zone; per node it is tens."""
    per_node = fleet.global_prom.query('count by (instance) ({__name__=~"instance.*:gpu_alloc_.+", zone="zone-a"})')
    assert len(per_node) == 3 + len(GOLDEN_NODES)
    assert all(int(r["value"][1]) <= 50 for r in per_node), per_node


def test_vmalert_evaluates_every_rule_without_error(fleet: Fleet) -> None:
    groups = fleet.vmalert.groups()
    rules = [r for g in groups for r in g["rules"]]
    loaded = mc.load_rules(mc.RULE_FILES)
    assert len(rules) == len(loaded.alerts) + len(loaded.records)
    bad = [f"{r['name']}: {r.get('lastError')}" for r in rules if r.get("lastError")]
    assert not bad, bad


def test_vmalert_alerts_carry_labels_and_annotations(fleet: Fleet) -> None:
    """vmalert expands the same annotation templates (summary, links) as Prometheus."""
    frag = [a for a in fleet.vmalert.alerts() if a["name"] == "GpuAllocNodeFragmented"]
    assert [a["labels"]["instance"] for a in frag] == [fleet.exporters[2].address], frag
    assert frag[0]["annotations"]["dashboard"].startswith("/d/gpu-alloc-node/gpu-alloc-node?var-instance=")
    assert "fGPU free but scattered" in frag[0]["annotations"]["summary"]
