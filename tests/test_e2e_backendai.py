"""Sessions and users against a real Prometheus: Backend.AI's label contract, the shipped query
presets rendered exactly as Backend.AI's manager renders them, and GPU-hours per user across an
exporter restart.

One real ``gpu-alloc-exporter serve`` process (mock telemetry with compute processes, the fixture
/proc tree) over a scratch tree written as a 25.18+ agent leaves it: four sessions of three users,
three sharing one GPU (fGPU), one on a MIG slice NVML cannot measure per process. Beside it a
static exposition imitates a Backend.AI agent's ``/metrics``. The exporter is then stopped and
a second one started on the same address, so the chargeback counters reset mid-window.
"""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import pytest
from attribution_node import CID, K1, K2, K3, K5, PROC
from backendai_presets import regex_union, render_preset
from e2e.harness import Process, Prometheus, StaticExpositions, free_port, running, wait_until
from helpers import ROOT

from exporter.demo import demo_devices, write_kernel, write_recovery

pytest.importorskip("jinja2.sandbox")  # the preset renderer (tests/backendai_presets.py)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.tools("prometheus"),
]

USER_A, USER_B, USER_C = "f38dea23-50fa-42a0-b5ae-338f5f4693f4", "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d", "7e6d5c4b-3a29-4817-a6b5-c4d3e2f1a0b9"
SESSION = {K1: "b0a4e7c2-5d1f-4e6a-8c3b-2f9d7e1a6b4c", K2: "4c8e2a6f-1b3d-4f5a-9e7c-0d2b4f6a8c1e",
           K3: "c1d2e3f4-0a1b-4c2d-8e3f-a0b1c2d3e4f5", K5: "d4e5f6a7-1b2c-4d3e-9f4a-b1c2d3e4f5a6"}
OWNER = {K1: USER_A, K2: USER_B, K3: USER_A, K5: USER_C}
AGENT = "i-e2e-node01"
# Per-process SM samples on the shared GPU: K1's pid 1001, K2's 2001, K3's 3001 (no sample: idle).
UTIL = {K1: 0.6, K2: 0.2, K3: 0.0}
SHARES = {K1: Decimal("0.5"), K2: Decimal("0.5"), K3: Decimal("1.0")}
CAPACITY = Decimal("13.5")  # an 80 GB, 108-SM A100 at the plugin's defaults
INSTANCE = "node01"
SCRAPE = 0.25


def _exposition_of_an_agent() -> bytes:
    """What a Backend.AI agent's /metrics says about the same kernels (labels and formats of §4)."""
    lines = ["# HELP backendai_container_utilization Container utilization", "# TYPE backendai_container_utilization gauge"]
    for k in (K1, K2, K3, K5):
        labels = (f'agent_id="{AGENT}",container_metric_name="cuda_util",kernel_id="{k}",project_id="undefined",'
                  f'session_id="{SESSION[k]}",user_id="{OWNER[k]}",value_type="current"')
        lines.append(f"backendai_container_utilization{{{labels}}} 80")  # the whole device's load, per tenant
    lines += ["# HELP backendai_device_utilization Device utilization", "# TYPE backendai_device_utilization gauge"]
    gpus, _ = demo_devices()
    lines.append(f'backendai_device_utilization{{agent_id="{AGENT}",device_id="{gpus[0]}",device_metric_name="cuda_util",value_type="current"}} 80')
    return ("\n".join(lines) + "\n").encode()


def _tree(root: Path) -> None:
    gpus, migs = demo_devices()
    for k in (K1, K2, K3):
        write_kernel(root, k, {"cuda.shares": {gpus[0]: SHARES[k]}}, container_id=CID.get(k) if k != K3 else None)
    write_kernel(root, K5, {migs[0][1]: {migs[0][0]: Decimal(1)}}, container_id=CID[K5])
    for k in (K1, K2, K3, K5):
        write_recovery(root, k, SESSION[k], OWNER[k], agent_id=AGENT, session_type="batch" if k == K2 else "interactive")


def _devices(path: Path) -> None:
    text = (ROOT / "exporter" / "data" / "demo-devices.toml").read_text()
    procs = ('processes = [{ pid = 1001, used_memory = "1G", sm_util = 0.6 }, { pid = 2001, used_memory = "2G", sm_util = 0.2 },'
             ' { pid = 3001, used_memory = "1M", sm_util = 0.0 }]\n')
    path.write_text(text.replace('memory_size = "80G"\n', 'memory_size = "80G"\n' + procs, 1))


class Serve(Process):
    """``gpu-alloc-exporter serve`` on a fixed port, so a restart keeps the scrape target."""

    def __init__(self, port: int, work: Path, scratch: Path, devices: Path) -> None:
        super().__init__(f"exporter-{time.monotonic_ns()}", [
            sys.executable, "-m", "exporter", "serve", "--web.listen-address", f"127.0.0.1:{port}", "--scratch.root", str(scratch),
            "--telemetry.source", "mock", "--telemetry.mock-file", str(devices), "--telemetry.interval", "0.2",
            "--path.procfs", str(PROC), "--path.cgroupfs", str(work), "--agent.id", AGENT], work)
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.start_checked(lambda: "gpu_alloc_kernel_measured_utilization_ratio{" in self.metrics(), "measured use on /metrics")

    def metrics(self) -> str:
        try:
            with urllib.request.urlopen(self.url, timeout=2) as r:
                return r.read().decode()
        except OSError:
            return ""


@dataclass
class Stack:
    prom: Prometheus
    work: Path
    scratch: Path
    devices: Path
    port: int
    exporter: Serve


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("e2e-backendai")
    scratch, devices = work / "scratch", work / "devices.toml"
    _tree(scratch)
    _devices(devices)
    port = free_port()
    with running() as started:
        static = StaticExpositions({"metrics": _exposition_of_an_agent()})
        started.append(static)
        exporter = Serve(port, work, scratch, devices)
        started.append(exporter)
        targets = [
            {"job_name": "any-scrape-job", "static_configs": [{"targets": [f"127.0.0.1:{port}"], "labels": {"instance": INSTANCE}}]},
            {"job_name": "backendai-agent", "static_configs": [{"targets": [f"127.0.0.1:{static.port}"]}]},
        ]
        prom = Prometheus(work, [], targets, "127.0.0.1:9", interval=f"{int(SCRAPE * 1000)}ms")
        started.append(prom)
        wait_until(lambda: prom.query("gpu_alloc_kernel_measured_utilization_ratio") and prom.query("backendai_container_utilization"),
                   30, "the first scrapes")
        stack = Stack(prom, work, scratch, devices, port, exporter)
        yield stack
        started.append(stack.exporter)  # a restarted exporter replaces the first


def _by(result: list[dict], label: str) -> dict[str, float]:
    return {r["metric"][label]: float(r["value"][1]) for r in result}


def test_identity_joins_with_backendais_own_series(stack: Stack) -> None:
    q = stack.prom.query
    # Every kernel shows its session and user, in the agent's formats, on one info series.
    info = q("gpu_alloc_kernel_identity_info")
    assert {r["metric"]["kernel_id"]: (r["metric"]["session_id"], r["metric"]["user_id"]) for r in info} == \
        {k: (SESSION[k], OWNER[k]) for k in SESSION}
    # The agent's per-kernel series and ours, matched on kernel_id and on session_id.
    joined = q('gpu_alloc_kernel_measured_utilization_ratio * on (kernel_id) group_left (session_id, user_id) '
               'backendai_container_utilization{container_metric_name="cuda_util",value_type="current"}')
    assert {r["metric"]["session_id"] for r in joined} == {SESSION[K1], SESSION[K2], SESSION[K3]}
    per_session = q('sum by (session_id) (gpu_alloc_kernel_gpu_share_ratio * on (instance, kernel_id) group_left (session_id) '
                    'gpu_alloc_kernel_identity_info) / on (session_id) group_left () '
                    'sum by (session_id) (backendai_container_utilization{container_metric_name="cuda_util",value_type="current"})')
    assert set(_by(per_session, "session_id")) == set(SESSION.values())
    # Devices: the same device_id string on both sides.
    dev = q('gpu_alloc_device_fgpu_allocated * on (device_id) group_left (agent_id) '
            'backendai_device_utilization{device_metric_name="cuda_util",value_type="current"}')
    assert [r["metric"]["agent_id"] for r in dev] == [AGENT]




def test_presets_rendered_as_backendai_renders_them_give_one_value_per_measured_session(stack: Stack) -> None:
    presets = json.loads((ROOT / "integrations" / "backendai" / "query-presets.json").read_text())["prometheus_query_presets"]
    assert len(presets) >= 4
    sessions = list(SESSION.values())
    for preset in presets:
        assert "session_id" in preset["options"]["group_labels"] and "session_id" in preset["options"]["filter_labels"]
        if preset["metric_name"] == "gpu_alloc_kernel_busy_gpu_seconds_total":
            continue  # ratios of counters over a window: tests/test_e2e_ledger.py
        # The utilization idle checker: group by session_id, a session_id=~ matcher for the sessions it judges.
        query = render_preset(preset["query_template"], {"session_id": ("=~", regex_union(sessions))}, {"session_id"},
                        preset["time_window"] or "5m")
        values = _by(stack.prom.query(query), "session_id")
        # K5's session sits on a MIG slice, where NVML has no per-process samples: no value, never 0.
        assert SESSION[K5] not in values, (preset["name"], values)
        if "Memory" in preset["name"]:
            held = {k: float(SHARES[k] / CAPACITY) * 80 * 2**30 for k in UTIL}  # the mock's "80G" is binary
            expected = {SESSION[K1]: 2**30 / held[K1], SESSION[K2]: 2 * 2**30 / held[K2], SESSION[K3]: 2**20 / held[K3]}
        else:
            expected = {SESSION[k]: u for k, u in UTIL.items()}
        assert values == pytest.approx(expected, rel=1e-6), preset["name"]
        # Scoped to one session, as for a checker bound to one user's sessions.
        one = render_preset(preset["query_template"], {"session_id": ("=~", regex_union([SESSION[K2]])), "user_id": ("=", USER_B)},
                      {"session_id", "user_id"}, preset["time_window"] or "5m")
        assert list(_by(stack.prom.query(one), "session_id")) == [SESSION[K2]]


GPU_HOURS = ('sum by (user_id) ('
             ' increase(gpu_alloc_kernel_allocated_gpu_seconds_total[{w}])'
             ' * on (instance, kernel_id) group_left (user_id)'
             ' max by (instance, kernel_id, user_id) (last_over_time(gpu_alloc_kernel_identity_info{{session_id!="undefined"}}[{w}]))'
             ') / 3600')


def _final(metrics: str) -> dict[str, float]:
    """Share-seconds per kernel in one exporter's last exposition."""
    out: dict[str, float] = {}
    for m in re.finditer(r'^gpu_alloc_kernel_allocated_gpu_seconds_total\{device_id="[^"]*",kernel_id="([^"]*)"\} (\S+)$', metrics, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def test_gpu_hours_per_user_over_a_window_with_an_exporter_restart(stack: Stack) -> None:
    start, before = time.time(), _final(stack.exporter.metrics())
    time.sleep(3)
    first = {k: v - before.get(k, 0.0) for k, v in _final(stack.exporter.metrics()).items()}
    stack.exporter.stop()
    stack.exporter = Serve(stack.port, stack.work, stack.scratch, stack.devices)
    time.sleep(3)
    second = _final(stack.exporter.metrics())
    time.sleep(2 * SCRAPE)  # let Prometheus scrape past the values read above
    window = f"{int((time.time() - start) * 1000)}ms"  # this test's run, restart included
    got = _by(stack.prom.query(GPU_HOURS.format(w=window)), "user_id")
    # What the exporters counted over the same time, by owner.
    expected: dict[str, float] = {}
    for counts in (first, second):
        for k, seconds in counts.items():
            expected[OWNER[k]] = expected.get(OWNER[k], 0.0) + seconds / 3600
    # The restart is visible to Prometheus as a counter reset, which increase() absorbs.
    resets = stack.prom.query(f"resets(gpu_alloc_kernel_allocated_gpu_seconds_total[{window}])")
    assert resets and all(float(r["value"][1]) >= 1 for r in resets)
    assert set(got) == {USER_A, USER_B, USER_C}
    # Each user's GPU-hours match what the exporters integrated, within what a scrape interval can
    # hide at each end of the two runs (the last share-seconds before a stop are never scraped).
    for user, hours in expected.items():
        kernels = sum(1 for k in OWNER if OWNER[k] == user)  # each holds at most one GPU here
        assert got[user] == pytest.approx(hours, abs=4 * SCRAPE * kernels / 3600 + 0.02 * hours), user
