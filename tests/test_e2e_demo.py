"""The living demo in a real Prometheus: every panel of every shipped dashboard gets data, and
alerts fire and resolve.

``gpu-alloc-exporter demo --time-scale 10`` runs as a real process (its 5-minute schedule of
planted events plays in 30 s), scraped by Debian's Prometheus every 500 ms with the shipped
recording and alert rules, posting to Alertmanager and a local webhook. Time is compressed the
same way on both sides, only here: the demo plays its schedule 10 times faster
(``--time-scale``), and the rules are a temporary copy in which every alert's ``for:`` is divided
by 10 and group intervals are removed (:func:`scaled_rules`). So an alert that fires here fires
at time scale 1 with the shipped ``for:``, at 10 times the delay: GpuAllocGpuLost (1m) and
GpuAllocIsolationBreach (2m) fire and resolve by the times the demo prints for them (a tenth of
them here, plus Prometheus' start). tests/demo/test_announced_alerts.py replays every announced
alert against the shipped rules unscaled.

The test iterates over whatever ``dashboards/*.json`` and ``alerts/*.yml`` hold. Each panel query
(dashboard variables bound to the demo node and each of its kernels) must return data at least
once within the deadline; ``empty_ok`` marks of the dashboard source do not excuse a query here.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import monitoring_checks as mc
import pytest
import yaml
from e2e.harness import Alertmanager, Exporter, Prometheus, PromQLError, Webhook, free_port, running

pytestmark = [
    pytest.mark.slow,
    pytest.mark.tools("prometheus", "prometheus-alertmanager", "promtool"),
]

JOB = "gpu-nodes-rack7"  # any name: no rule or dashboard selects a job by name
TIME_SCALE = 10
SEED = 7
# Every query must have returned data by then (the first 5 minutes of demo time take 30 s wall).
DEADLINE_SECONDS = 75
# Beyond the demo's announced times (a tenth of them here): Prometheus finds its targets and
# Alertmanager ~5 s after it starts, and a notification needs one more evaluation and send.
SLACK_SECONDS = 15


# What the demo node's GPUs (A100, Ampere) cannot report, as on the real hardware: queries that
# read these metrics may stay empty.
NOT_ON_THIS_HARDWARE = {
    "gpu_alloc_device_retired_pages_pending": "page retirement is pre-Ampere; A100s remap rows instead",
}
# What no current accelerator plugin writes, so the demo node, which writes what a current one
# does, has none: per-device bytes slots exist only as cuda.mem, a legacy plugin's slot.
NOT_FROM_A_CURRENT_PLUGIN = {
    "gpu_alloc_device_allocated_bytes": "cuda.mem only, which no current plugin registers",
    "gpu_alloc_kernel_allocated_bytes": "cuda.mem only, which no current plugin registers",
}


@dataclass
class Demo:
    prom: Prometheus
    webhook: Webhook
    exporter: Exporter
    instance: str
    started: float  # time.monotonic() when the demo was ready: its demo second 0


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    work = tmp_path_factory.mktemp("e2e-demo")
    address = f"127.0.0.1:{free_port()}"
    with running() as started:
        webhook = Webhook()
        started.append(webhook)
        am = Alertmanager(work, f"http://127.0.0.1:{webhook.port}/hook")
        started.append(am)
        # Prometheus first, so the demo's first seconds are scraped (its events come fast at this time scale).
        targets = [{"job_name": JOB, "static_configs": [{"targets": [address]}]}]
        prom = Prometheus(work, scaled_rules(work, list(mc.RULE_FILES), TIME_SCALE), targets, am.address)
        started.append(prom)
        exporter = Exporter(["--seed", str(SEED), "--time-scale", str(TIME_SCALE), "--telemetry.interval", "0.5",
                             "--demo.dir", str(work / "node")], work, command=("demo",), listen=address)
        started.append(exporter)
        yield Demo(prom, webhook, exporter, address, time.monotonic())


_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def seconds(duration: str) -> float:
    """A Prometheus duration (``1h30m``, ``5m``, ``0s``) in seconds."""
    parts = re.findall(r"(\d+)(ms|[smhdwy])", duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        raise ValueError(f"not a Prometheus duration: {duration!r}")
    return sum(int(n) * _UNITS[u] for n, u in parts)


def scaled_rules(dest: Path, rule_files: list[Path], factor: float) -> list[Path]:
    """Copies of the rule files with every ``for:`` divided by ``factor`` (in whole milliseconds)
    and group intervals removed (the global 500 ms evaluation applies). Expressions, windows,
    labels and annotations stay as they are."""
    out = []
    for src in rule_files:
        doc = yaml.safe_load(src.read_text())
        for group in doc["groups"]:
            group.pop("interval", None)
            for rule in group["rules"]:
                if "alert" in rule:
                    rule["for"] = f"{int(seconds(str(rule.get('for', '0s'))) * 1000 / factor)}ms"
        path = dest / src.name
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        out.append(path)
    return out


def _variables(instance: str, kernels: list[str]) -> list[dict[str, str]]:
    base = {"job": JOB, "agent": ".*", "instance": instance, "datasource": "prometheus", "__rate_interval": "5s",
            "__interval": "1s", "__range": "1h", "__range_s": "3600"}
    out = []
    for kernel in kernels or ["none"]:
        for frag in ("disallowed", "allowed"):
            out.append({**base, "kernel_id": kernel, "fragmentation": frag})
    return out


def announced(log: str) -> dict[str, tuple[int, int, str | None]]:
    """The first announcement of each alert in the demo's printed schedule: (fires by, resolves
    by) in demo seconds, and the device id of the first GPU its event names (None: none)."""
    devices = dict(re.findall(r"^  GPU (\d+) (GPU-[0-9a-f-]+):", log, re.M))
    out: dict[str, tuple[int, int, str | None]] = {}
    event = ""
    for line in log.splitlines():
        if re.match(r"  \+\d+:\d\d  ", line):
            event = line
        m = re.search(r"(GpuAlloc\w+) fires by \+(\d+):(\d\d), resolves by \+(\d+):(\d\d)", line)
        if m and m.group(1) not in out:
            gpu = re.search(r"GPU (\d+)", event)
            out[m.group(1)] = (60 * int(m.group(2)) + int(m.group(3)), 60 * int(m.group(4)) + int(m.group(5)),
                               devices.get(gpu.group(1)) if gpu else None)
    return out


def test_every_panel_gets_data_and_alerts_fire_and_resolve(demo: Demo) -> None:
    rules = mc.load_rules(mc.RULE_FILES)
    queries = [q for doc in mc.load_dashboards().values() for q in mc.dashboard_queries(doc)]
    queries += [mc.Query("recording", name, "record", name) for name in rules.records]
    assert queries, "no dashboards or recording rules found"
    pending = {q.key: q for q in queries if not (mc.metric_names(q.expr) & (NOT_ON_THIS_HARDWARE.keys() | NOT_FROM_A_CURRENT_PLUGIN.keys()))
               and (q.dashboard, q.panel, q.ref) not in mc.records_expected_empty()}
    failing: dict[str, str] = {}
    deadline = time.monotonic() + DEADLINE_SECONDS
    while pending and time.monotonic() < deadline:
        kernels = sorted({r["metric"]["kernel_id"] for r in demo.prom.query(f'gpu_alloc_kernel_info{{instance="{demo.instance}"}}')})
        tried: dict[str, bool] = {}  # substituted expression -> data
        for key, q in list(pending.items()):
            for values in _variables(demo.instance, kernels):
                expr = mc.substitute_vars(q.expr, values, default=".*")
                if expr not in tried:
                    try:
                        tried[expr] = bool(demo.prom.query(expr))
                    except PromQLError as exc:
                        failing[key] = str(exc)
                        tried[expr] = False
                if tried[expr]:
                    del pending[key]
                    failing.pop(key, None)
                    break
        time.sleep(1)
    problems = [f"{key}: {'query fails: ' + failing[key] if key in failing else 'no data'}: {q.expr}" for key, q in sorted(pending.items())]
    assert not problems, f"{len(problems)} of {len(queries)} queries never returned data:\n" + "\n".join(problems)

    # No current plugin writes cuda.mem, and neither does the demo.
    assert demo.prom.query("gpu_alloc_device_allocated_bytes or gpu_alloc_kernel_allocated_bytes") == []

    # The planted GPU loss (held lost until the demo resets it), isolation breach and ghost memory
    # reach Alertmanager by the time the demo announced, about the GPU it named, and resolve by
    # the time it announced.
    log = demo.exporter.log()
    for alert in ("GpuAllocGpuLost", "GpuAllocDeviceNeedsReset", "GpuAllocIsolationBreach", "GpuAllocGhostMemory"):
        fires_by, resolves_by, device_id = announced(log)[alert]
        assert device_id, alert
        left = lambda demo_s: max(1.0, demo.started + demo_s / TIME_SCALE + SLACK_SECONDS - time.monotonic())  # noqa: E731
        firing = demo.webhook.wait_for("firing", alert, left(fires_by), instance=demo.instance, device_id=device_id)
        assert firing["labels"]["severity"] == rules.alerts[alert]["labels"]["severity"]
        demo.webhook.wait_for("resolved", alert, left(resolves_by), instance=demo.instance, device_id=device_id)
    # The ghost alert names the session that ended.
    ghost = demo.webhook.alerts("firing", "GpuAllocGhostMemory", instance=demo.instance, device_id=announced(log)["GpuAllocGhostMemory"][2])
    ended = re.search(r"  session ([0-9a-f-]+) ends: .* \(ghost memory", log).group(1)
    assert f"session {ended}" in ghost[0]["annotations"]["description"]
    # The demo says what it plants, and logs each event as it happens.
    assert "planned:" in log and "demo event at +1:00: GPU 5 falls off the bus" in log
    assert demo.exporter.alive()
