"""One fault, one notification: the shipped Alertmanager configuration against a real Alertmanager.

deploy/alertmanager/alertmanager.yml groups by node and GPU and inhibits consequences by their
cause. Checked here:

* both shipped configurations pass ``amtool check-config``, route each severity to its receiver
  (``amtool config routes test``) and have the same routing and inhibition; every alert name an
  inhibit rule names exists in the rule files; group_wait outlasts the time every incident's cause
  needs to arrive after its first consequence;
* (slow, ~25 s) each incident of alerts/tests/matrix.yml, whose alerts and start times promtool
  verified (tests/test_alert_matrix.py), replayed into Debian's ``prometheus-alertmanager`` with
  the shipped configuration (times scaled 1 minute → 1 second, the receivers pointed at a local
  webhook) yields exactly one notification, carrying exactly the incident's ``page`` alerts,
  to the receiver of their severity; the blast-radius alert's sessions changing during the fault
  yields no second one;
* (slow) an exporter that is down inhibits every other alert of its node, and only of its node.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import monitoring_checks as mc
import pytest
import yaml
from e2e.harness import Process, Webhook, free_port, wait_until
from processes import require_tool

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
COMPOSE = ROOT / "deploy" / "compose" / "alertmanager" / "alertmanager.yml"
MATRIX = ROOT / "alerts" / "tests" / "matrix.yml"
SCALE = 1 / 60  # one minute of an incident is one second of the replay
STEP = 15  # seconds between rule evaluations in production (deploy/prometheus/prometheus.yml)
JOB = "gpu-nodes-rack7"

needs_amtool = pytest.mark.tools("amtool")
needs_alertmanager = pytest.mark.tools("prometheus-alertmanager")


def _seconds(text: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    parts = re.findall(r"(\d+)(ms|s|m|h|d)", str(text))
    if not parts or "".join(n + u for n, u in parts) != str(text):
        raise ValueError(f"not a duration: {text!r}")
    return sum(int(n) * units[u] for n, u in parts)


def _amtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["amtool", *args], capture_output=True, text=True, timeout=30)


def _severities() -> dict[str, str]:
    return {name: rule["labels"]["severity"] for name, rule in mc.load_rules(mc.RULE_FILES).alerts.items()}


# --- the configuration, offline --------------------------------------------------------------------


@needs_amtool
@pytest.mark.parametrize("path", [SHIPPED, COMPOSE], ids=["shipped", "compose"])
def test_config_passes_amtool_and_routes_by_severity(path: Path) -> None:
    result = _amtool("check-config", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    for severity, receiver in (("critical", "pager"), ("warning", "tickets"), ("info", "reports")):
        result = _amtool("config", "routes", "test", f"--config.file={path}", f"--verify.receivers={receiver}",
                         "alertname=GpuAllocGpuLost", "instance=node-1:19402", f"severity={severity}")
        assert result.returncode == 0, (severity, result.stdout + result.stderr)


def test_compose_config_routes_and_inhibits_like_the_shipped_one() -> None:
    shipped, compose = yaml.safe_load(SHIPPED.read_text()), yaml.safe_load(COMPOSE.read_text())
    assert compose["route"] == shipped["route"]
    assert compose["inhibit_rules"] == shipped["inhibit_rules"]
    assert [r["name"] for r in compose["receivers"]] == [r["name"] for r in shipped["receivers"]]


def _named_alerts(matchers: list[str]) -> set[str]:
    names: set[str] = set()
    for m in matchers:
        found = re.fullmatch(r'alertname(=~|=)"(.*)"', m)
        if found:
            names |= set(found.group(2).split("|"))
    return names


def test_inhibit_rules_name_alerts_that_exist() -> None:
    config = yaml.safe_load(SHIPPED.read_text())
    alerts = set(mc.load_rules(mc.RULE_FILES).alerts)
    named = set()
    for rule in config["inhibit_rules"]:
        named |= _named_alerts(rule.get("source_matchers", [])) | _named_alerts(rule.get("target_matchers", []))
    assert named and sorted(named - alerts) == []
    assert config["route"]["group_by"] == ["instance", "device_id"]


def test_group_wait_outlasts_each_causes_delay() -> None:
    """In every incident, each paged alert fires within group_wait of the first alert of its
    group (less two evaluation intervals, for the offsets between rule groups), so the first
    notification already has the consequences inhibited."""
    wait = _seconds(yaml.safe_load(SHIPPED.read_text())["route"]["group_wait"])
    for inc in incidents():
        first = min(a.start for a in inc.firing)
        for a in inc.firing:
            if a.alert in inc.page:
                assert a.start - first <= wait - 2 * STEP, (inc.name, a.alert)


# --- incidents from the matrix ----------------------------------------------------------------------


@dataclass(frozen=True)
class Posted:
    alert: str
    labels: dict[str, str]
    start: float  # seconds after the fault started (unscaled)


@dataclass(frozen=True)
class Incident:
    name: str
    instance: str
    firing: tuple[Posted, ...]
    page: tuple[str, ...]
    sessions: dict[float, str]  # offset → the blast-radius alert's sessions annotation


def incidents() -> list[Incident]:
    severity = _severities()
    out = []
    for name, inc in yaml.safe_load(MATRIX.read_text())["incidents"].items():
        instance = f"{name}:19402"
        firing = []
        for f in inc["firing"]:
            labels = {"alertname": f["alert"], "severity": severity[f["alert"]], **{k: str(v) for k, v in (f.get("labels") or {}).items()}}
            if f.get("per_node", True):
                labels.update(job=JOB, instance=instance)
            firing.append(Posted(f["alert"], labels, _seconds(f["from"])))
        sessions = {_seconds(k): v for k, v in (inc.get("sessions") or {}).items()}
        out.append(Incident(name, instance, tuple(firing), tuple(inc["page"]), sessions))
    return out


# --- a real Alertmanager -----------------------------------------------------------------------------


def scaled_config(webhook_port: int) -> dict[str, Any]:
    """The shipped configuration with its durations scaled down and every receiver posting to the
    local webhook (the receiver's name is in each notification)."""
    config = copy.deepcopy(yaml.safe_load(SHIPPED.read_text()))

    def scale(route: dict[str, Any]) -> None:
        for key in ("group_wait", "group_interval", "repeat_interval"):
            if key in route:
                route[key] = f"{max(1, round(_seconds(route[key]) * SCALE * 1000))}ms"
        for child in route.get("routes", []):
            scale(child)

    scale(config["route"])
    for receiver in config["receivers"]:
        receiver["webhook_configs"] = [{"url": f"http://127.0.0.1:{webhook_port}/{receiver['name']}", "send_resolved": True}]
    return config


@dataclass
class Stack:
    url: str
    webhook: Webhook
    config: dict[str, Any]

    def post(self, alerts: list[dict[str, Any]]) -> None:
        body = json.dumps(alerts).encode()
        request = urllib.request.Request(f"{self.url}/api/v2/alerts", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=5) as r:
            assert r.status == 200

    def notifications(self, instance: str) -> list[dict[str, Any]]:
        with self.webhook.cond:
            return [n["payload"] for n in self.webhook.notifications
                    if any(a["labels"].get("instance") == instance for a in n["payload"]["alerts"])]


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("alertmanager")
    webhook = Webhook()
    am = None
    try:
        config = scaled_config(webhook.port)
        path = work / "alertmanager.yml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        require_tool("amtool")
        check = _amtool("check-config", str(path))
        assert check.returncode == 0, check.stdout + check.stderr
        port = free_port()
        # --cluster.listen-address= (empty) disables HA gossip, which would bind 0.0.0.0:9094.
        am = Process("alertmanager", ["prometheus-alertmanager", f"--config.file={path}", f"--storage.path={work / 'data'}",
                                      f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=", "--log.level=warn"], work)
        url = f"http://127.0.0.1:{port}"
        am.start_checked(lambda: _ready(url), "Alertmanager to be ready")
        yield Stack(url, webhook, config)
    finally:
        if am is not None:
            am.stop()
        webhook.close()


def _alert(labels: dict[str, str], **annotations: str) -> dict[str, Any]:
    return {"labels": labels, "annotations": {"summary": labels["alertname"], **annotations}, "generatorURL": "http://prometheus/graph"}


def _receiver(config: dict[str, Any], severity: str) -> str:
    for child in config["route"].get("routes", []):
        if f'severity="{severity}"' in child.get("matchers", []):
            return child["receiver"]
    return config["route"]["receiver"]


def _replay(stack: Stack, incidents: list[Incident]) -> float:
    """Post every incident's alerts at their (scaled) start, and the blast-radius alert again
    whenever its sessions change; returns when the last post went out."""
    schedule: list[tuple[float, list[dict[str, Any]]]] = []
    for inc in incidents:
        by_start: dict[float, list[dict[str, Any]]] = {}
        for a in inc.firing:
            notes = {"sessions": inc.sessions[0.0]} if a.alert == "GpuAllocSessionsOnUnhealthyGpu" and inc.sessions else {}
            by_start.setdefault(a.start, []).append(_alert(a.labels, **notes))
        for offset, text in inc.sessions.items():
            if offset:
                blast = next(a for a in inc.firing if a.alert == "GpuAllocSessionsOnUnhealthyGpu")
                by_start.setdefault(offset, []).append(_alert(blast.labels, sessions=text))
        schedule += [(start * SCALE, alerts) for start, alerts in by_start.items()]
    began = time.monotonic()
    for at, alerts in sorted(schedule, key=lambda s: s[0]):
        time.sleep(max(0.0, began + at - time.monotonic()))
        stack.post(alerts)
    return time.monotonic()


@pytest.mark.slow
@needs_alertmanager
def test_each_incident_notifies_once(stack: Stack) -> None:
    """All incidents at once, each on its own node (instance)."""
    incs = incidents()
    assert incs
    last = _replay(stack, incs)
    # Long enough for a second notification of any group to arrive (group_interval after the first).
    interval = _seconds(stack.config["route"]["group_interval"])
    wait_until(lambda: all(stack.notifications(i.instance) for i in incs), 10, "a notification for every incident")
    time.sleep(max(0.0, last + interval + 1.5 - time.monotonic()))
    severity = _severities()
    problems = []
    for inc in incs:
        got = stack.notifications(inc.instance)
        if len(got) != 1:
            problems.append(f"{inc.name}: {len(got)} notifications: {[sorted(a['labels']['alertname'] for a in n['alerts']) for n in got]}")
            continue
        n = got[0]
        names = sorted(a["labels"]["alertname"] for a in n["alerts"] if a["status"] == "firing")
        if names != sorted(inc.page):
            problems.append(f"{inc.name}: the notification carries {names}, not {sorted(inc.page)}")
        receivers = {_receiver(stack.config, severity[p]) for p in inc.page}
        if {n["receiver"]} != receivers:
            problems.append(f"{inc.name}: sent to {n['receiver']}, not {receivers}")
        expected = {json.dumps(a.labels, sort_keys=True) for a in inc.firing if a.alert in inc.page}
        if {json.dumps(a["labels"], sort_keys=True) for a in n["alerts"]} != expected:
            problems.append(f"{inc.name}: alert identities differ: {[a['labels'] for a in n['alerts']]}")
    assert problems == []


@pytest.mark.slow
@needs_alertmanager
def test_exporter_down_inhibits_its_node_only(stack: Stack) -> None:
    """Alerts still active for a node whose exporter stopped answering (and a fault on another
    node): the node's one notification is GpuAllocExporterDown; the other node pages for itself."""
    down, other = "exporter-down:19402", "other-node:19402"
    node = {"job": JOB, "instance": down}
    stack.post([
        _alert({"alertname": "GpuAllocExporterDown", "severity": "critical", "agent_id": "i-node01", **node}),
        _alert({"alertname": "GpuAllocWatcherDown", "severity": "critical", **node}),
        _alert({"alertname": "GpuAllocGpuLost", "severity": "critical", "device_id": "GPU-1", **node}),
        _alert({"alertname": "GpuAllocMemoryNearlyFull", "severity": "warning", "device_id": "GPU-0", **node}),
        _alert({"alertname": "GpuAllocXidCritical", "severity": "critical", "device_id": "GPU-1", "xid": "48", "job": JOB, "instance": other}),
    ])
    interval = _seconds(stack.config["route"]["group_interval"])
    wait_until(lambda: stack.notifications(down) and stack.notifications(other), 10, "the notifications of both nodes")
    time.sleep(interval + 1.5)
    got = stack.notifications(down)
    assert [sorted(a["labels"]["alertname"] for a in n["alerts"]) for n in got] == [["GpuAllocExporterDown"]]
    assert [sorted(a["labels"]["alertname"] for a in n["alerts"]) for n in stack.notifications(other)] == [["GpuAllocXidCritical"]]

