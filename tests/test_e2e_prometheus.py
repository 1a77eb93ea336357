"""Dashboards and rules against a real Prometheus and Alertmanager on loopback.

One run (~10 s): the exporter as a real process (mock telemetry, a demo scratch tree), every
golden exposition served as an extra scrape target, Prometheus (500 ms scrape and evaluation,
the project's recording and alert rules with ``for:`` set to 0s) and Alertmanager posting to a
local webhook. It checks that

* every rule evaluates without error (joins that are many-to-many at runtime show up here);
* every recording rule and every PromQL query of every dashboard panel and variable returns
  data, with the dashboard variables bound to a real node and kernel;
* a planted fault (a kernel holding more fGPU than a GPU has) reaches the webhook through
  Alertmanager as GpuAllocFgpuOvercommitted, and its resolution arrives once the kernel is gone;
* the same data check reports a dashboard whose query names a misspelled metric.

A query may come back empty only if its target is marked ``empty_ok`` in the dashboard source
(e.g. XID series exist only after an XID) and every metric it reads is exported by the running
exporter or appears in a golden file.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from e2e.harness import Alertmanager, Exporter, Prometheus, PromQLError, StaticExpositions, Webhook, e2e_rules, wait_until

from exporter.demo import build_demo_tree, demo_devices, write_kernel

ROOT = Path(__file__).resolve().parent.parent

import monitoring_checks as mc  # noqa: E402
from gpu_alloc_dashboards import expected_empty  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.tools("prometheus", "prometheus-alertmanager", "promtool"),
]

JOB = "gpu-nodes-rack7"  # any name: no rule or dashboard selects a job by name
MOCK_FILE = ROOT / "exporter" / "data" / "demo-devices.toml"


@dataclass(frozen=True)
class Binding:
    """Values for the dashboard variables: one node (and one of its kernels)."""

    instance: str
    kernel_id: str = "none"

    def values(self, fragmentation: str) -> dict[str, str]:
        return {"job": JOB, "agent": ".*", "instance": self.instance, "kernel_id": self.kernel_id, "fragmentation": fragmentation,
                "user": ".*", "session": ".*",
                "datasource": "prometheus", "__rate_interval": "5s", "__interval": "1s"}


@dataclass
class Stack:
    prom: Prometheus
    webhook: Webhook
    exporter: Exporter
    scratch: Path
    live_instance: str
    known_names: set[str]  # served by the exporter or a golden file
    bindings: list[Binding]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("e2e")
    scratch, cgroups = work / "scratch", work / "cgroup-empty"
    build_demo_tree(scratch)
    cgroups.mkdir()  # no visible containers: liveness "unknown", so no kernel is dropped as stale
    goldens = {p.name: p.read_bytes() for p in sorted(mc.GOLDEN_DIR.glob("*.prom"))}
    started: list[Any] = []
    try:
        webhook = Webhook()
        started.append(webhook)
        static = StaticExpositions(goldens)
        started.append(static)
        exporter = Exporter(["--scratch.root", str(scratch), "--telemetry.source", "mock", "--telemetry.mock-file", str(MOCK_FILE),
                             "--telemetry.interval", "0.5", "--path.cgroupfs", str(cgroups), "--agent.id", "e2e-agent"], work)
        started.append(exporter)
        am = Alertmanager(work, f"http://127.0.0.1:{webhook.port}/hook")
        started.append(am)
        targets = [{"job_name": JOB, "static_configs": [{"targets": [exporter.address]}]}]
        for name in goldens:
            targets.append({"job_name": f"{JOB}-golden-{name.removesuffix('.prom')}", "metrics_path": f"/{name}",
                            "static_configs": [{"targets": [f"127.0.0.1:{static.port}"],
                                                "labels": {"instance": f"golden-{name.removesuffix('.prom')}"}}],
                            # one job name for every target, as on a real fleet
                            "relabel_configs": [{"target_label": "job", "replacement": JOB}]})
        prom = Prometheus(work, e2e_rules(work, list(mc.RULE_FILES)), targets, am.address)
        started.append(prom)

        # Exporter targets are those serving gpu_alloc_build_info (some golden files are partial).
        with_build_info = [n for n, body in goldens.items() if b"\ngpu_alloc_build_info{" in body]
        # Cold start: Prometheus' discovery manager hands targets to the scraper at most every 5 s.
        # Rule groups run at their own offsets: wait for a per-node and a job-level record, and
        # for two scrapes (rate() and increase() need two samples).
        wait_until(lambda: prom.query(f'instance:gpu_alloc_fgpu_capacity:sum{{instance="{exporter.address}"}}')
                   and prom.query(f'job:gpu_alloc_exporters_up:sum{{job="{JOB}"}} >= {1 + len(with_build_info)}')
                   and prom.query(f'rate(gpu_alloc_watcher_rescans_total{{instance="{exporter.address}"}}[5s])'), 30,
                   "the first scrape and rule evaluation")
        known = mc.exposition_names(exporter.metrics()) | mc.golden_names()
        yield Stack(prom, webhook, exporter, scratch, exporter.address, known, _bindings(prom, exporter.address, goldens))
    finally:
        for thing in reversed(started):
            thing.close() if hasattr(thing, "close") else thing.stop()


def _bindings(prom: Prometheus, live: str, goldens: Iterable[str]) -> list[Binding]:
    """The live node first, with its kernels that hold a GPU, then the golden nodes."""
    out = []
    for instance in [live, *(f"golden-{g.removesuffix('.prom')}" for g in goldens)]:
        kernels = sorted({r["metric"]["kernel_id"] for r in prom.query(f'gpu_alloc_kernel_allocated{{instance="{instance}"}}')})
        out += [Binding(instance, k) for k in kernels[:4]] or [Binding(instance)]
    return out


def _returns_data(prom: Prometheus, expr: str, bindings: list[Binding]) -> bool:
    for b in bindings:
        for frag in ("disallowed", "allowed"):
            if prom.query(mc.substitute_vars(expr, b.values(frag))):
                return True
    return False


def check_queries_return_data(stack: Stack, queries: Iterable[mc.Query], empty_ok: dict[tuple[str, str, str], str],
                              rules: mc.Rules) -> list[str]:
    """Queries that fail, or return nothing without a recorded reason to."""
    problems = []
    for q in queries:
        try:
            if _returns_data(stack.prom, q.expr, stack.bindings):
                continue
        except PromQLError as exc:
            problems.append(f"{q.key}: query fails: {exc}: {q.expr}")
            continue
        raw = {n for n in mc.rule_inputs(q.expr, rules) if n not in rules.records}
        unknown = sorted(raw - stack.known_names - mc.PROMETHEUS_SERIES)
        if (q.dashboard, q.panel, q.ref) in empty_ok and not unknown:
            continue
        problems.append(f"{q.key}: no data" + (f" (not exported: {', '.join(unknown)})" if unknown else "") + f": {q.expr}")
    return problems


def test_rules_evaluate_without_errors(stack: Stack) -> None:
    groups = stack.prom.api("rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == len(mc.load_rules(mc.RULE_FILES).alerts) + len(mc.load_rules(mc.RULE_FILES).records)
    wait_until(lambda: all(r.get("lastEvaluation", "").startswith("2") for g in stack.prom.api("rules")["groups"] for r in g["rules"]),
               10, "every rule to be evaluated once")
    bad = [f"{r['name']}: {r.get('lastError')}" for g in stack.prom.api("rules")["groups"] for r in g["rules"] if r["health"] != "ok"]
    assert not bad, bad


def test_planted_fault_reaches_the_webhook_and_resolves(stack: Stack) -> None:
    gpus, _ = demo_devices()
    # More shares than an 80 GB, 108-SM A100 holds (13.5 with the plugin defaults).
    fault = write_kernel(stack.scratch, "e2e00000-0000-4000-8000-00000000fa17", {"cuda.shares": {gpus[3]: Decimal("14")}})
    labels = {"instance": stack.live_instance, "device_id": gpus[3]}
    firing = stack.webhook.wait_for("firing", "GpuAllocFgpuOvercommitted", 20, **labels)
    assert firing["labels"]["severity"] == "warning" and firing["labels"]["slot"] == "cuda.shares"
    assert firing["annotations"]["summary"] == f"cuda.shares overcommitted on {gpus[3]} of {stack.live_instance}"
    assert firing["annotations"]["runbook"] and firing["annotations"]["dashboard"].startswith("/d/gpu-alloc-node/")

    # While it fires, every dashboard and recording rule query must return data (ALERTS included).
    _all_queries_return_data(stack)

    shutil.rmtree(fault.parent.parent)
    stack.webhook.wait_for("resolved", "GpuAllocFgpuOvercommitted", 20, **labels)


def _all_queries_return_data(stack: Stack) -> None:
    rules = mc.load_rules(mc.RULE_FILES)
    queries = [q for doc in mc.load_dashboards().values() for q in mc.dashboard_queries(doc)]
    queries += [mc.Query("recording", name, "record", name) for name in rules.records]
    problems = check_queries_return_data(stack, queries, {**expected_empty(), **mc.records_expected_empty()}, rules)
    assert not problems, "\n".join(problems)


def test_a_misspelled_metric_in_a_dashboard_is_reported(stack: Stack) -> None:
    doc = copy.deepcopy(json.loads((ROOT / "dashboards" / "gpu-alloc-node.json").read_text()))
    panel = next(p for p in mc.iter_panels(doc) if p.get("title") == "fGPU allocated per device vs capacity")
    panel["targets"][0]["expr"] = panel["targets"][0]["expr"].replace("gpu_alloc_device_fgpu_allocated", "gpu_alloc_device_fgpu_alocated")
    queries = [q for q in mc.dashboard_queries(doc) if q.panel == panel["title"]]
    problems = check_queries_return_data(stack, queries, {}, mc.load_rules(mc.RULE_FILES))
    assert len(problems) == 1 and "not exported: gpu_alloc_device_fgpu_alocated" in problems[0], problems
