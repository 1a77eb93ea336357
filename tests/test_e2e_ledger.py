"""The GPU ledger against a real Prometheus: the idle-checker presets that read the lossless
busy-time counters, rendered exactly as Backend.AI's manager renders them; the ledger's sums as
Prometheus stores them; and a session too short for any scrape, counted in full by its owner's
and its GPU's counters.

One real ``gpu-alloc-exporter serve`` process with mock telemetry over a scratch tree written as a
25.18+ agent leaves it (the node of tests/test_e2e_backendai.py): three sessions of two users share
one GPU at known SM utilisations, a fourth sits on a MIG slice without per-process counters.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import pytest
from attribution_node import CID, K1, K2, K3, K5, PROC
from backendai_presets import regex_union, render_preset
from e2e.harness import Process, Prometheus, free_port, running, wait_until
from helpers import ROOT

from exporter.demo import demo_devices, write_kernel, write_recovery

pytest.importorskip("jinja2.sandbox")  # the preset renderer (tests/backendai_presets.py)

pytestmark = [pytest.mark.slow, pytest.mark.tools("prometheus")]

SCRAPE = 0.5
PRESETS = ROOT / "integrations" / "backendai" / "query-presets.json"
USER_A, USER_B = "f38dea23-50fa-42a0-b5ae-338f5f4693f4", "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"
SESSION = {K1: "b0a4e7c2-5d1f-4e6a-8c3b-2f9d7e1a6b4c", K2: "4c8e2a6f-1b3d-4f5a-9e7c-0d2b4f6a8c1e",
           K3: "c1d2e3f4-0a1b-4c2d-8e3f-a0b1c2d3e4f5", K5: "d4e5f6a7-1b2c-4d3e-9f4a-b1c2d3e4f5a6"}
OWNER = {K1: USER_A, K2: USER_B, K3: USER_A, K5: USER_B}
UTIL = {K1: 0.6, K2: 0.2, K3: 0.0}  # the mock's per-process SM samples of pids 1001, 2001, 3001
AGENT = "i-e2e-node01"


def _tree(root: Path) -> None:
    gpus, migs = demo_devices()
    for k, shares in ((K1, "0.5"), (K2, "0.5"), (K3, "1.0")):
        write_kernel(root, k, {"cuda.shares": {gpus[0]: Decimal(shares)}}, container_id=CID.get(k) if k != K3 else None)
    write_kernel(root, K5, {migs[0][1]: {migs[0][0]: Decimal(1)}}, container_id=CID[K5])
    for k in (K1, K2, K3, K5):
        write_recovery(root, k, SESSION[k], OWNER[k], agent_id=AGENT)


def _devices(path: Path) -> None:
    text = (ROOT / "exporter" / "data" / "demo-devices.toml").read_text()
    procs = ('processes = [{ pid = 1001, used_memory = "1G", sm_util = 0.6 }, { pid = 2001, used_memory = "2G", sm_util = 0.2 },'
             ' { pid = 3001, used_memory = "1M", sm_util = 0.0 }]\n')
    path.write_text(text.replace('memory_size = "80G"\n', 'memory_size = "80G"\n' + procs, 1))


class Serve(Process):
    def __init__(self, port: int, work: Path, scratch: Path, devices: Path) -> None:
        super().__init__(f"exporter-{time.monotonic_ns()}", [
            sys.executable, "-m", "exporter", "serve", "--web.listen-address", f"127.0.0.1:{port}", "--scratch.root", str(scratch),
            "--telemetry.source", "mock", "--telemetry.mock-file", str(devices), "--telemetry.interval", "0.2",
            "--path.procfs", str(PROC), "--path.cgroupfs", str(work), "--agent.id", AGENT], work)
        self.port = port
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.start_checked(lambda: "gpu_alloc_kernel_busy_gpu_seconds_total{" in self.metrics(), "busy counters on /metrics")

    def metrics(self) -> str:
        try:
            with urllib.request.urlopen(self.url, timeout=2) as r:
                return r.read().decode()
        except OSError:
            return ""




def _by(result: list[dict], label: str) -> dict[str, float]:
    return {r["metric"][label]: float(r["value"][1]) for r in result}


@dataclass
class Node:
    prom: Prometheus
    exporter: Serve
    scratch: Path
    started: float  # time.monotonic() when Prometheus had scraped the first counters

    def settle(self, window: float) -> None:
        """Wait until a window of this many seconds lies after the counters' first samples, so
        increase() does not extrapolate towards their start."""
        time.sleep(max(0.0, self.started + window + 2 * SCRAPE - time.monotonic()))


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    work = tmp_path_factory.mktemp("e2e-ledger")
    scratch, devices = work / "scratch", work / "devices.toml"
    _tree(scratch)
    _devices(devices)
    with running() as started:
        exporter = Serve(free_port(), work, scratch, devices)
        started.append(exporter)
        prom = Prometheus(work, [], [{"job_name": "gpu", "static_configs": [{"targets": [f"127.0.0.1:{exporter.port}"],
                                                                             "labels": {"instance": "node01"}}]}],
                          "127.0.0.1:9", interval=f"{int(SCRAPE * 1000)}ms")
        started.append(prom)
        wait_until(lambda: len(prom.query("gpu_alloc_kernel_busy_gpu_seconds_total")) == 3, 30, "the busy counters")
        yield Node(prom, exporter, scratch, time.monotonic())


def samples(metrics: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for m in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", metrics, re.M):
        out[tuple(re.findall(r'(\w+)="([^"]*)"', m.group(1)))] = float(m.group(2))
    return out


def test_the_busy_time_presets_measure_each_session_and_never_judge_an_unmeasured_one(node: Node) -> None:
    presets = [p for p in json.loads(PRESETS.read_text())["prometheus_query_presets"]
               if p["metric_name"] == "gpu_alloc_kernel_busy_gpu_seconds_total"]
    assert {p["id"] for p in presets} >= {"5a1b0a74-27ed-5678-8cea-981348a7b9be"}  # the idle checker's preset
    sessions = list(SESSION.values())
    node.settle(4.0)
    window = "4s"  # within the exporter's run: its first sample measured no busy time yet (no interval)
    for preset in presets:
        query = render_preset(preset["query_template"], {"session_id": ("=~", regex_union(sessions))}, {"session_id"}, window)
        values = wait_until(lambda q=query: _by(node.prom.query(q), "session_id"), 20, "a window of measured samples")
        # K5 is on a MIG slice without per-process counters: no value, so never idle.
        assert set(values) == {SESSION[K1], SESSION[K2], SESSION[K3]}, preset["name"]
        # Busy over held: the SM utilisation of each process (the mock's per-process samples);
        # within what sampling at the window's two ends can move it.
        assert values == pytest.approx({SESSION[k]: u for k, u in UTIL.items()}, abs=0.05), preset["name"]
        one = render_preset(preset["query_template"], {"session_id": ("=~", regex_union([SESSION[K2]])), "user_id": ("=", USER_B)},
                      {"session_id", "user_id"}, window)
        assert list(_by(node.prom.query(one), "session_id")) == [SESSION[K2]]
    # The GPU of the MIG slice says why it has no busy value.
    measured = {r["metric"]["device_id"]: float(r["value"][1]) for r in node.prom.query("gpu_alloc_device_busy_measured")}
    assert 0.0 in measured.values() and 1.0 in measured.values()


def test_the_ledger_balances_as_prometheus_stores_it(node: Node) -> None:
    q = node.prom.query
    window = "5s"
    node.settle(5.0)
    # One scrape holds every counter as of one pass: the sums match exactly.
    for kernels, devices in (("gpu_alloc_kernel_allocated_gpu_seconds_total", "gpu_alloc_device_allocated_gpu_seconds_total"),
                             ("gpu_alloc_kernel_busy_gpu_seconds_total", "gpu_alloc_device_busy_gpu_seconds_total"),
                             ("gpu_alloc_kernel_energy_joules_total", "gpu_alloc_device_attributed_energy_joules_total")):
        diff = q(f"sum by (device_id) ({kernels}) - sum by (device_id) ({devices})")
        assert diff and all(abs(float(r["value"][1])) < 1e-6 for r in diff), kernels
    for user, device in (("allocated_gpu_seconds", "allocated_gpu_seconds"), ("busy_gpu_seconds", "busy_gpu_seconds"),
                         ("energy_joules", "attributed_energy_joules")):
        diff = q(f"sum(gpu_alloc_user_{user}_total) - sum(gpu_alloc_device_{device}_total)")
        assert abs(float(diff[0]["value"][1])) < 1e-6, user
    # Allocated + unallocated grows by the time that passed, on every GPU (one GPU each).
    held = q(f"increase(gpu_alloc_device_allocated_gpu_seconds_total[{window}]) + increase(gpu_alloc_device_unallocated_gpu_seconds_total[{window}])")
    assert len(held) >= 4 and all(float(r["value"][1]) == pytest.approx(5.0, rel=0.15) for r in held)
    # Attributed + unattributed joules: the increase of the GPU's own energy counter.
    energy = q(f"(increase(gpu_alloc_device_attributed_energy_joules_total[{window}]) + increase(gpu_alloc_device_unattributed_energy_joules_total[{window}]))"
               f" / on (instance, device_id) increase(gpu_alloc_device_energy_joules_total[{window}])")
    assert energy and all(float(r["value"][1]) == pytest.approx(1.0, rel=0.1) for r in energy)
    # Busy never exceeds allocated.
    assert q("gpu_alloc_kernel_busy_gpu_seconds_total > on (instance, kernel_id, device_id) gpu_alloc_kernel_allocated_gpu_seconds_total") == []


def test_a_session_shorter_than_a_scrape_counts_in_full_for_its_owner_and_its_gpu(node: Node) -> None:
    """A kernel of user A lives for less than a scrape interval: the user's and the GPU's counters
    keep what it held, whatever Prometheus saw of the kernel's own series."""
    gpus, _ = demo_devices()
    kid, sid = str(uuid.UUID(int=0x5E55, version=4)), str(uuid.UUID(int=0x5E56, version=4))
    before = node.exporter.metrics()
    (node.scratch / kid / "config").mkdir(parents=True)
    write_recovery(node.scratch, kid, sid, USER_A, agent_id=AGENT)  # its owner is known from its first pass
    write_kernel(node.scratch, kid, {"cuda.shares": {gpus[1]: Decimal("6.75")}})
    info = re.compile(rf'^gpu_alloc_kernel_identity_info\{{[^}}]*kernel_id="{kid}"[^}}]*user_id="{USER_A}"', re.M)
    wait_until(lambda: info.search(node.exporter.metrics()), 10, "the short kernel")
    time.sleep(0.4 * SCRAPE)
    shutil.rmtree(node.scratch / kid)
    share = re.compile(rf'^gpu_alloc_kernel_gpu_share_ratio\{{[^}}]*kernel_id="{kid}"', re.M)
    wait_until(lambda: not share.search(node.exporter.metrics()), 10, "the kernel to end")
    time.sleep(0.5)  # a few more passes: its counters no longer move
    after = node.exporter.metrics()
    short = sum(v for labels, v in samples(after, "gpu_alloc_kernel_allocated_gpu_seconds_total").items() if ("kernel_id", kid) in labels)
    assert short > 0  # it held half of GPU 1 for a while
    # User A's counter grew by what A's other kernels held plus all of the short one.
    mine = [k for k in (K1, K3) if OWNER[k] == USER_A]

    def held(metrics: str) -> tuple[float, float]:
        user = samples(metrics, "gpu_alloc_user_allocated_gpu_seconds_total")[(("project_id", "undefined"), ("user_id", USER_A))]
        kernels = sum(v for labels, v in samples(metrics, "gpu_alloc_kernel_allocated_gpu_seconds_total").items()
                      if any(("kernel_id", k) in labels for k in mine))
        return user, kernels

    (u0, k0), (u1, k1) = held(before), held(after)
    assert (u1 - u0) - (k1 - k0) == pytest.approx(short, rel=1e-9)
    # And Prometheus has the user's counter continuous across the session (one series all along).
    series = node.prom.query(f'gpu_alloc_user_allocated_gpu_seconds_total{{user_id="{USER_A}"}}')
    assert len(series) == 1
