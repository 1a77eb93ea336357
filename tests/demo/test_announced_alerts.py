"""The demo keeps its word: every alert it announces fires, and resolves, by the time it prints,
under the shipped rules.

* The figures the demo computes its times from (:data:`exporter.demo.node.SHIPPED_RULES`: each
  alert's ``for:``, its group's interval, an XID's recent window; the 15 s scrape and evaluation
  interval) are those of alerts/*.yml and deploy/prometheus/prometheus.yml.
* Read from the rule files, each announced fault lasts at least the alert's ``for:`` plus two
  evaluation intervals before the time the demo says it fires, and the resolve time comes after
  the fault's end (or the XID's window) by two more.
* The replay: the living node (seed 7, as tests/test_e2e_demo.py plays it) runs on a clock this
  test moves 15 s at a time, read by the real exporter (simulated NVML, its /proc and cgroups);
  each step's /metrics becomes one sample of promtool input series, and ``promtool test rules``
  evaluates the shipped rules over them (the announced alerts and every recording rule they
  read, as written in alerts/) every 15 s, as deploy/prometheus/prometheus.yml does. Each
  announced alert is quiet before its fault, firing at its announced time and resolved at its
  announced resolve time.
"""

from __future__ import annotations

import math
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import monitoring_checks as mc
import pytest
import yaml
from helpers import ROOT, wait_for

from exporter.app import Exporter
from exporter.config import resolve
from exporter.demo.node import EVALUATION_INTERVAL_S, SHIPPED_RULES, AlertPromise, LivingNode
from exporter.settings import Settings
from exporter.telemetry.nvml import NvmlSource

SEED = 7
STEP = 15  # seconds between scrapes (and rule evaluations) of the replay
JOB, INSTANCE = "demo", "127.0.0.1:19402"
PROMETHEUS_YML = ROOT / "deploy" / "prometheus" / "prometheus.yml"
_UNITS = {"s": 1, "m": 60, "h": 3600}


def seconds(text: str) -> int:
    """A Prometheus duration of the rule files (``1h30m``, ``15s``) in seconds."""
    parts = re.findall(r"(\d+)([smh])", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    return sum(int(n) * _UNITS[u] for n, u in parts)


def shipped_timing() -> dict[str, tuple[int, int]]:
    """Every alert of the shipped rule files: (for:, its group's evaluation interval) in seconds."""
    default = seconds(yaml.safe_load(PROMETHEUS_YML.read_text())["global"]["evaluation_interval"])
    out = {}
    for path in mc.RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            interval = seconds(group.get("interval", f"{default}s"))
            for rule in group["rules"]:
                if "alert" in rule:
                    out[rule["alert"]] = (seconds(str(rule.get("for", "0s"))), interval)
    return out


def planned_node(base: Path, clock: Callable[[], float]) -> LivingNode:
    node = LivingNode(base, seed=SEED, clock=clock)
    node.populate()
    return node


# --- what the demo states --------------------------------------------------------------------


def test_the_demo_states_the_shipped_rules() -> None:
    config = yaml.safe_load(PROMETHEUS_YML.read_text())["global"]
    assert seconds(config["scrape_interval"]) == seconds(config["evaluation_interval"]) == EVALUATION_INTERVAL_S
    timing = shipped_timing()
    for name, rule in SHIPPED_RULES.items():
        assert (rule.for_s, rule.interval_s) == timing[name], name
    # An XID alert holds while the XID is younger than the threshold the recording rules keep.
    recorded = mc.load_rules(mc.RULE_FILES).records["global:gpu_alloc_xid_recent_seconds:threshold"]
    window = float(re.fullmatch(r"vector\(([\d.]+)\)", recorded.strip()).group(1))
    for name in ("GpuAllocXidCritical", "GpuAllocSessionsOnUnhealthyGpu"):
        assert SHIPPED_RULES[name].event_age_s == window, name
    assert all(not r.event_age_s for n, r in SHIPPED_RULES.items() if "Xid" not in n and "Unhealthy" not in n)


def test_every_announced_fault_lasts_past_its_alerts_for(tmp_path: Path) -> None:
    node = planned_node(tmp_path, lambda: 0.0)
    timing = shipped_timing()
    announced = {p.alert for p in node.promises}
    assert announced == set(SHIPPED_RULES), "an alert the demo states rules for but never announces, or the reverse"
    for p in node.promises:
        for_s, interval = timing[p.alert]
        assert p.fires_by - p.onset >= for_s + 2 * interval, p
        assert p.ends >= p.fires_by + interval, f"{p.alert}: the fault ends before it has surely fired"
        assert p.resolves_by >= max(p.ends, p.onset + p.rule.event_age_s) + 2 * interval, p
    # What the demo prints says each of them, under the event that raises it.
    text = node.describe()
    for p in node.promises:
        event = next(line for line in text.splitlines() if line.endswith(p.fault))
        below = text.split(event + "\n", 1)[1].split("\n  +", 1)[0]
        assert p.describe() in below, p.alert
    assert "fires GpuAlloc" not in text and "after 10m" not in text  # no promise left in prose


def test_a_time_scaled_demo_says_what_its_times_need(tmp_path: Path) -> None:
    node = LivingNode(tmp_path, seed=SEED, time_scale=10, clock=lambda: 0.0)
    node.populate()
    assert "divided by 10 too" in node.describe()
    assert "divided by" not in planned_node(tmp_path / "x1", lambda: 0.0).describe()


# --- the replay ------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$")


class Replay:
    """The demo node and the exporter reading it, on a clock this test moves; each :meth:`scrape`
    renders /metrics as Prometheus would scrape it at that demo second."""

    def __init__(self, base: Path) -> None:
        self.t = 0.0
        self.epoch = time.time()
        self.node = planned_node(base, lambda: self.t)
        self.pushed = 0  # XIDs pushed: the exporter has counted each before a scrape
        push = self.node.machine.push_xid

        def counted(index: int, xid: int) -> None:
            self.pushed += 1
            push(index, xid)

        self.node.machine.push_xid = counted
        self.series: dict[str, dict[int, float]] = {}
        self._parsed: dict[str, tuple[str, float]] = {}  # exposition line -> (series, value)
        self.steps = 0

    def wall(self) -> float:
        return self.epoch + self.t

    def run(self, until: float) -> None:
        node = self.node
        settings = Settings.load({
            "scratch_roots": [str(node.scratch)], "path_procfs": str(node.host.proc), "path_cgroupfs": str(node.host.cgroup),
            "agent_id": node.agent_id, "telemetry_interval": 0.02, "telemetry_pcie": True, "stale_grace": 60,
            "health_state_file": str(node.base / "health.json"),
        })
        with node.machine.installed():
            self.source = NvmlSource(clock=self.wall, event_wait_ms=50, pcie=True)
            self.exporter = Exporter(resolve(settings), clock=self.wall, monotonic=lambda: self.t, telemetry=self.source)
            self.exporter.start()
            try:
                while self.steps * STEP <= until:
                    self.scrape(self.steps * STEP)
            finally:
                self.exporter.close()

    def scrape(self, at: float) -> None:
        while self.t < at:  # one demo second at a time, as the node's thread would run
            self.t = min(at, self.t + 1.0)
            self.node.run_due()
        self.node.tick()
        exporter = self.exporter
        # The scratch tree as written now (a full rescan), every XID counted, and a telemetry
        # sample taken after this step.
        rescans = exporter.watcher.status().rescans_total
        exporter.watcher.request_rescan()
        wait_for(lambda: exporter.watcher.status().rescans_total > rescans, 10)
        wait_for(lambda: sum(c.count for c in self.source.xid_counters()) >= self.pushed, 10)
        version = exporter.sampler.version
        assert exporter.sampler.wait_for_version(version + 1, 10)
        exporter.pipeline.step()
        self.record(exporter.render().decode())
        self.steps += 1

    def record(self, text: str) -> None:
        step = self.steps
        self.series.setdefault(f'up{{job="{JOB}",instance="{INSTANCE}"}}', {})[step] = 1.0
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            parsed = self._parsed.get(line)
            if parsed is None:
                m = _SAMPLE.match(line)
                assert m, line
                name, labels, value = m.groups()
                labels = f'job="{JOB}",instance="{INSTANCE}"' + (f",{labels}" if labels else "")
                parsed = self._parsed[line] = (f"{name}{{{labels}}}", float(value))
            key, value = parsed
            if key.split("{", 1)[0].endswith("_timestamp_seconds"):
                value -= self.epoch  # promtool's clock starts at 0 where the replay's starts at epoch
            self.series.setdefault(key, {})[step] = value

    def input_series(self) -> list[dict[str, str]]:
        return [{"series": key, "values": notation([samples.get(i) for i in range(self.steps)])}
                for key, samples in sorted(self.series.items())]


def _num(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(int(v)) if v == int(v) and abs(v) < 1e15 else repr(v)


def _same(a: float | None, b: float | None) -> bool:
    return a == b or (a is not None and b is not None and math.isnan(a) and math.isnan(b))


def notation(samples: list[float | None]) -> str:
    """promtool's series notation, runs compressed (``_xN``: N missing samples, ``v+0xN``: N+1
    times v). A series that leaves a scrape gets a staleness marker first, as Prometheus writes
    one, so it is gone at once rather than visible for the 5-minute lookback."""
    out, i = [], 0
    while i < len(samples):
        j = i
        while j + 1 < len(samples) and _same(samples[j + 1], samples[i]):
            j += 1
        v, n = samples[i], j - i + 1
        if v is None:
            gone = ["stale"] if i else []
            blanks = n - len(gone)
            out += gone + ([] if not blanks else ["_"] if blanks == 1 else [f"_x{blanks}"])
        else:
            out.append(_num(v) if n == 1 else f"{_num(v)}+0x{n - 1}")
        i = j + 1
    return " ".join(out)


@pytest.mark.tools("promtool")
def test_notation_round_trips_through_promtool(tmp_path: Path) -> None:
    samples = [None, None, 1.0, 1.0, 1.0, 2.5, None, float("nan"), 7.0, 7.0]
    test = {"interval": "1m", "input_series": [{"series": 'x{a="b"}', "values": notation(samples)}],
            "promql_expr_test": [{"expr": "x", "eval_time": f"{i}m", "exp_samples": [] if v is None else [{"labels": 'x{a="b"}', "value": v}]}
                                 for i, v in enumerate(samples) if v is None or not math.isnan(v)]}
    run_promtool(tmp_path, [test], rule_files=[])


def firing(p: AlertPromise) -> str:
    matchers = ",".join(f'{k}="{v}"' for k, v in (("alertname", p.alert), ("alertstate", "firing"), *p.labels))
    return f"count(ALERTS{{{matchers}}})"


def promise_checks(promises: list[AlertPromise]) -> list[dict]:
    """Quiet before the fault, firing by the announced time, resolved by the announced one."""
    checks = []
    for p in promises:
        if p.onset >= STEP:
            checks.append({"expr": firing(p), "eval_time": f"{int(p.onset - STEP)}s", "exp_samples": []})
        checks.append({"expr": firing(p), "eval_time": f"{int(p.fires_by)}s", "exp_samples": [{"labels": "{}", "value": 1}]})
        checks.append({"expr": firing(p), "eval_time": f"{int(p.resolves_by)}s", "exp_samples": []})
    return checks


def run_promtool(work: Path, tests: list[dict], rule_files=mc.RULE_FILES) -> None:
    rule_files = list(rule_files)
    # Recording groups first, so alerts read this evaluation's recorded series, as in Prometheus
    # where each group sees the others' last results at most one interval late.
    order = [g["name"] for f in rule_files for g in yaml.safe_load(f.read_text())["groups"] if all("record" in r for r in g["rules"])]
    path = work / "demo.test.yml"
    path.write_text(yaml.safe_dump({"rule_files": [str(f) for f in rule_files], "evaluation_interval": f"{STEP}s",
                                    "group_eval_order": order, "tests": tests}, sort_keys=False, width=100_000))
    result = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-20000:]


def rules_for(alerts: set[str], dest: Path) -> list[Path]:
    """Copies of the shipped rule files holding only these alerts and the recording rules they
    read (promtool evaluates every rule it loads at every step; the rest would only cost time)."""
    rules = mc.load_rules(mc.RULE_FILES)
    keep = set(alerts)
    for name in alerts:
        keep |= {n for n in mc.rule_inputs(rules.alerts[name]["expr"], rules) if n in rules.records}
    out = []
    for path in mc.RULE_FILES:
        groups = []
        for group in yaml.safe_load(path.read_text())["groups"]:
            group["rules"] = [r for r in group["rules"] if (r.get("alert") or r.get("record")) in keep]
            groups += [group] if group["rules"] else []
        if groups:
            out.append(dest / path.name)
            out[-1].write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return out


@pytest.mark.slow
@pytest.mark.tools("promtool")
def test_every_announced_alert_fires_and_resolves_on_time(tmp_path: Path) -> None:
    replay = Replay(tmp_path / "node")
    promises = replay.node.promises
    end = max(p.resolves_by for p in promises)
    replay.run(end)
    rule_files = rules_for({p.alert for p in promises}, tmp_path)
    run_promtool(tmp_path, [{"name": f"demo seed {SEED}", "interval": f"{STEP}s", "input_series": replay.input_series(),
                             "promql_expr_test": promise_checks(promises)}], rule_files)
