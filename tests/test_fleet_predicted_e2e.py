"""The predicted session failure, end to end: three exporters, a real Prometheus, the shipped rules.

Three ``python -m exporter`` processes on loopback, each with the mock devices of
``exporter/data/demo-devices.toml`` (4 fGPU A100s of 10 shares each, by ``--capacity.override``)
and its own scratch tree, serve the fleet what-if for ``fgpu-4`` (4 shares) and ``fgpu-1``. Their
remaining fGPU totals are 6, 8 and 2 shares, every GPU with the same small free piece (1.5, 2 and
0.5): the totals of two agents cover a 4-share session, no device holds 4 shares. Debian's
Prometheus scrapes them every second with the rule files of ``alerts/`` (``for:`` set to 0 s; the
durations are the promtool tests' business) and must

* record the manager's choice: ``concentrated`` the agent with 6 left, ``dispersed`` and ``legacy``
  the one with 8; two candidates;
* fire ``GpuAllocPredictedSessionFailure`` for ``fgpu-4`` with fragmentation disallowed only, the
  reason ``fragmented`` for every strategy, and name the two candidate nodes with their largest
  placeable request (1.5 and 2 shares);
* stay quiet for ``fgpu-4`` with fragmentation allowed, and for ``fgpu-1`` although the
  ``concentrated`` pick (the agent with 2 left, in pieces of 0.5) would refuse it: two agents
  place it;
* resolve once the agent with 6 left frees a whole GPU (its kernel on that GPU ends), the failure
  then predicted for ``concentrated`` only (it now picks the agent with 8 left).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from e2e.harness import Exporter, Prometheus, PromQLError, e2e_rules, wait_until

from exporter.demo import demo_devices, write_kernel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import monitoring_checks as mc  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.tools("prometheus", "promtool")]

MOCK_FILE = ROOT / "exporter" / "data" / "demo-devices.toml"
CAPACITY = Decimal(10)  # shares per GPU (--capacity.override)
FREE_PER_GPU = (Decimal("1.5"), Decimal(2), Decimal("0.5"))  # node-0, node-1, node-2
SHAPES = ("fgpu-4=cuda.shares:4,cpu:16,mem:64g", "fgpu-1=cuda.shares:1,cpu:4,mem:16g")
ALERT = "GpuAllocPredictedSessionFailure"


@dataclass
class Zone:
    prometheus: Prometheus
    exporters: list[Exporter]
    scratch: list[Path]

    def node(self, i: int) -> str:
        return self.exporters[i].address


def _kernel_id(node: int, gpu: int) -> str:
    return f"f1ee0000-0000-4000-8000-0000000{node:02d}{gpu:03d}"


@pytest.fixture(scope="module")
def zone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zone]:
    work = tmp_path_factory.mktemp("fleet-predicted")
    gpus, _ = demo_devices()
    overrides = [arg for gpu in gpus for arg in ("--capacity.override", f"{gpu}={CAPACITY}")]
    started: list[Any] = []
    try:
        exporters, scratches = [], []
        for n, free in enumerate(FREE_PER_GPU):
            node = work / f"node-{n}"
            scratch, cgroups = node / "scratch", node / "cgroup-empty"
            scratch.mkdir(parents=True)
            cgroups.mkdir()
            for g, gpu in enumerate(gpus):  # one kernel per GPU leaves the same free piece on each
                write_kernel(scratch, _kernel_id(n, g), {"cuda.shares": {gpu: CAPACITY - free}})
            args = ["--scratch.root", str(scratch), "--telemetry.source", "mock", "--telemetry.mock-file", str(MOCK_FILE),
                    "--telemetry.interval", "0.5", "--path.cgroupfs", str(cgroups), "--agent.id", f"agent-{n}", *overrides]
            for shape in SHAPES:
                args += ["--fleet.shape", shape]
            exporter = Exporter(args, node)
            started.append(exporter)
            exporters.append(exporter)
            scratches.append(scratch)
        rules = e2e_rules(work, list(mc.RULE_FILES))
        targets = [{"job_name": "zone-gpu-nodes", "static_configs": [{"targets": [e.address for e in exporters]}]}]
        prometheus = Prometheus(work, rule_files=rules, targets=targets, interval="1s")
        started.append(prometheus)
        yield Zone(prometheus, exporters, scratches)
    finally:
        for thing in reversed(started):
            thing.stop()


def _query(zone: Zone, expr: str) -> list[dict[str, Any]]:
    try:
        return zone.prometheus.query(expr)
    except (PromQLError, OSError):
        return []


def _firing(zone: Zone) -> list[dict[str, Any]]:
    alerts = zone.prometheus.api("alerts")["alerts"]
    return [a for a in alerts if a["labels"]["alertname"] == ALERT and a["state"] == "firing"]


def test_totals_fit_fragments_do_not_the_alert_names_reason_and_nodes(zone: Zone) -> None:
    node0, node1, node2 = (zone.node(i) for i in range(3))
    labels = {"alertname": ALERT, "severity": "warning", "shape": "fgpu-4", "fragmentation": "disallowed"}
    summary = "No agent can place a fgpu-4 session (fragmentation disallowed) although the remaining totals of 2 agent(s) cover it"
    closest = "".join(f"{n} ({v}); " for n, v in sorted([(node0, "1.5"), (node1, "2")]))
    description_end = ("Predicted per strategy (selector, reason): concentrated (fragmented); dispersed (fragmented); "
                       f"legacy (fragmented); nodes that come closest (largest placeable request of the slot): {closest}")

    def fgpu1_predicted() -> set[tuple[str, str, str]]:
        return {(s["metric"]["selector"], s["metric"]["fragmentation"], s["metric"]["reason"]) for s in _query(
            zone, 'shape_selector:gpu_alloc_session_failure:predicted{shape="fgpu-1"}')}

    def as_expected() -> bool:
        firing = _firing(zone)
        return [(a["labels"], a["annotations"]["summary"], a["annotations"]["description"].endswith(description_end))
                for a in firing] == [(labels, summary, True)] and fgpu1_predicted() == {("concentrated", "disallowed", "fragmented")}

    # The first evaluations may see only some of the targets scraped: wait for the whole zone
    # (the alert and the other shape's recorded prediction: rule groups evaluate apart).
    try:
        wait_until(as_expected, 45, f"{ALERT} to fire for the whole zone", interval=0.5)
    except AssertionError:
        pass  # the assertions below say what differs
    firing = _firing(zone)
    assert [a["labels"] for a in firing] == [labels]
    annotations = firing[0]["annotations"]
    assert annotations["summary"] == summary
    assert annotations["description"].endswith(description_end), annotations["description"]
    assert node2 not in annotations["description"]  # its totals do not cover the shape

    # The manager's choice, as recorded.
    selected = {(s["metric"]["selector"], s["metric"]["instance"]) for s in _query(
        zone, 'instance_shape_selector:gpu_alloc_node_remaining:selected{shape="fgpu-4"}')}
    assert selected == {("concentrated", node0), ("dispersed", node1), ("legacy", node1)}
    assert [float(s["value"][1]) for s in _query(zone, 'shape:gpu_alloc_candidate_agents:count{shape="fgpu-4"}')] == [2]
    predicted = {(s["metric"]["selector"], s["metric"]["fragmentation"], s["metric"]["reason"]) for s in _query(
        zone, 'shape_selector:gpu_alloc_session_failure:predicted{shape="fgpu-4"}')}
    assert predicted == {("concentrated", "disallowed", "fragmented"), ("dispersed", "disallowed", "fragmented"),
                         ("legacy", "disallowed", "fragmented")}
    # A 1-share session: node-0 and node-1 place it, so no alert; but `concentrated` picks node-2
    # (2 left, in pieces of 0.5), which refuses it with fragmentation disallowed.
    assert fgpu1_predicted() == {("concentrated", "disallowed", "fragmented")}
    assert {(s["metric"]["selector"], s["metric"]["instance"]) for s in _query(
        zone, 'instance_shape_selector:gpu_alloc_node_remaining:selected{shape="fgpu-1"}')} == {
        ("concentrated", node2), ("dispersed", node1), ("legacy", node1)}

    # node-0 frees a whole GPU: it places the shape, the session would start: resolved.
    shutil.rmtree(zone.scratch[0] / _kernel_id(0, 0))
    wait_until(lambda: _query(
        zone, 'gpu_alloc_node_request_placeable{shape="fgpu-4", fragmentation="disallowed"} == 1'), 30,
        "node-0 to place fgpu-4", interval=0.5)
    wait_until(lambda: not _firing(zone), 30, f"{ALERT} to resolve", interval=0.5)
    # node-0 (14.5 left) is now the dispersed pick and places it; the concentrated pick (node-1,
    # 8 left) still refuses: predicted for that strategy only.
    predicted = wait_until(lambda: {s["metric"]["selector"] for s in _query(
        zone, 'shape_selector:gpu_alloc_session_failure:predicted{shape="fgpu-4"}')} or None, 10, "the predicted failures")
    assert predicted == {"concentrated"}
