"""The Prometheus configs in deploy/prometheus/: valid for Debian's promtool, and carrying exactly
what the fleet dashboard reads to the global level (federation and remote write alike)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import monitoring_checks as mc  # noqa: E402

DEPLOY = ROOT / "deploy" / "prometheus"

pytestmark = pytest.mark.tools("promtool")


def _check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True, timeout=60)


def test_zone_config_passes_promtool_with_every_rule_file(tmp_path: Path) -> None:
    """As installed: prometheus.yml with the rule files of alerts/ next to it (/etc/prometheus/)."""
    shutil.copy(DEPLOY / "prometheus.yml", tmp_path / "prometheus.yml")
    for rules in mc.RULE_FILES:
        shutil.copy(rules, tmp_path / rules.name)
    result = _check_config(tmp_path / "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(mc.RULE_FILES)} rule files found" in result.stdout, result.stdout
    assert yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["rule_files"] == [p.name for p in mc.RULE_FILES]
    # Without the rule files the check fails: the config really loads them.
    (tmp_path / "gpu-alloc.rules.yml").unlink()
    assert _check_config(tmp_path / "prometheus.yml").returncode != 0


def test_zone_config_with_remote_write_and_the_global_config_pass_promtool(tmp_path: Path) -> None:
    zone = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    zone["rule_files"] = [str(p) for p in mc.RULE_FILES]
    zone.update(yaml.safe_load((DEPLOY / "remote-write.yml").read_text()))
    (tmp_path / "zone.yml").write_text(yaml.safe_dump(zone))
    result = _check_config(tmp_path / "zone.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    result = _check_config(DEPLOY / "federation.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    glob = yaml.safe_load((DEPLOY / "federation.yml").read_text())
    assert "rule_files" not in glob, "the zones evaluate the rules; the global Prometheus only federates"


def _federation_matchers() -> list[str]:
    doc = yaml.safe_load((DEPLOY / "federation.yml").read_text())
    return doc["scrape_configs"][0]["params"]["match[]"]


def federated(name: str, labels: dict[str, str] | None = None) -> bool:
    """Whether a series with this name (and labels) matches one of federation.yml's match[]."""
    labels = {"__name__": name, **(labels or {})}
    for sel in _federation_matchers():
        m = re.fullmatch(r"(\w*)\{(.*)\}", sel.strip())
        assert m, sel
        ok = not m.group(1) or m.group(1) == name
        for lname, op, value in re.findall(r'(\w+)\s*(=~|!=|=)\s*"([^"]*)"', m.group(2)):
            got = labels.get(lname, "")
            ok &= {"=": got == value, "!=": got != value, "=~": re.fullmatch(value, got) is not None}[op]
        if ok:
            return True
    return False


def remote_written(name: str, labels: dict[str, str] | None = None) -> bool:
    labels = {"__name__": name, **(labels or {})}
    for rule in yaml.safe_load((DEPLOY / "remote-write.yml").read_text())["remote_write"][0]["write_relabel_configs"]:
        value = rule.get("separator", ";").join(labels.get(s, "") for s in rule["source_labels"])
        match = re.fullmatch(rule["regex"], value) is not None
        if rule["action"] == "keep" and not match or rule["action"] == "drop" and match:
            return False
    return True


def _fleet_queries() -> list[mc.Query]:
    return mc.dashboard_queries(json.loads((ROOT / "dashboards" / "gpu-alloc-fleet.json").read_text()))


def _zone_only(name: str) -> bool:
    return name.startswith(("instance_kernel:", "instance_user:", "instance_shape:"))


WHERE_TABLE = "Where can a session of each shape start?"  # per node and shape: a zone's table, says so


def _fleet_names() -> set[str]:
    """What the fleet dashboard reads, but the per-kernel series it reads only where a zone's
    Prometheus has them (beside the crossing top 20 that stands in for them elsewhere)."""
    return {n for q in _fleet_queries() for n in mc.metric_names(q.expr) if not _zone_only(n)}


def test_the_fleet_dashboard_reads_zone_only_series_beside_what_crosses() -> None:
    """The top-kernel tables read a zone's per-kernel series (exact for a node filter) or else the
    zones' recorded top 20, which crosses: on a global Prometheus or VictoriaMetrics they still
    have data."""
    readers = [q for q in _fleet_queries() if any(_zone_only(n) for n in mc.metric_names(q.expr)) and WHERE_TABLE not in q.key]
    assert len(readers) == 6  # three top-kernel tables, the ledger's three per-user columns
    for q in readers:
        for name in filter(_zone_only, mc.metric_names(q.expr)):
            level, metric, op = name.split(":")
            stand_in = f"zone_kernel:{metric}:topk20" if level == "instance_kernel" else f"zone_user:{metric}:{op}"
            assert re.search(rf"{re.escape(name)}\{{[^}}]*\}}\)? or {re.escape(stand_in)}\{{", q.expr), q.key
            assert federated(stand_in) and remote_written(stand_in), stand_in


def test_everything_the_fleet_dashboard_reads_crosses_both_ways() -> None:
    names = _fleet_names()
    assert "ALERTS" in names and "instance:gpu_alloc_build_info:last" in names
    for name in sorted(names):
        labels = {"alertname": "GpuAllocNodeFragmented", "alertstate": "firing"} if name == "ALERTS" else {}
        assert federated(name, labels), f"{name} is not federated"
        assert remote_written(name, labels), f"{name} is not remote-written"


def test_federation_and_remote_write_select_the_same_series() -> None:
    rules = mc.load_rules(mc.RULE_FILES)
    golden = mc.golden_names()
    for name in sorted(set(rules.records) | golden | {"up"}):
        assert federated(name) == remote_written(name), name
    for alert in rules.alerts:
        for state in ("firing", "pending"):
            labels = {"alertname": alert, "alertstate": state}
            assert federated("ALERTS", labels) == remote_written("ALERTS", labels) == (state == "firing"), (alert, state)
    assert not federated("ALERTS", {"alertname": "NodeDown", "alertstate": "firing"})


def test_raw_and_per_kernel_series_stay_in_the_zone() -> None:
    rules = mc.load_rules(mc.RULE_FILES)
    for name in mc.golden_names():
        assert not federated(name) and not remote_written(name), name
    per_kernel = [n for n in rules.records if n.startswith("instance_kernel:")]
    assert per_kernel and not any(federated(n) or remote_written(n) for n in per_kernel)
    # The fleet what-if's per node and shape steps stay too (a zone's alert reads them there); the
    # global level gets their per-shape results.
    per_shape = [n for n in rules.records if n.startswith(("instance_shape:", "instance_shape_selector:"))]
    assert per_shape and not any(federated(n) or remote_written(n) for n in per_shape)
    # The ledger's per node and user or session series stay too; their per-user sums cross.
    per_owner = [n for n in rules.records if n.startswith(("instance_user:", "instance_session:"))]
    assert per_owner and not any(federated(n) or remote_written(n) for n in per_owner)
    # Every other recorded series crosses: the fleet view has per-node and zone figures only.
    local = ("instance_kernel:", "instance_shape:", "instance_shape_selector:", "instance_user:", "instance_session:")
    crossing = {n for n in rules.records if not n.startswith(local)}
    assert all(federated(n) for n in crossing)


def test_the_checker_sees_a_dropped_name() -> None:
    assert not federated("instance_kernel:gpu_alloc_kernel_fgpu_allocated:sum")
    assert not remote_written("gpu_alloc_kernel_allocated")
    assert federated("zone_kernel:gpu_alloc_kernel_fgpu_allocated:topk20")


# --- vmalert, documented -----------------------------------------------------------------------


def documented_vmalert_commands() -> list[list[str]]:
    """Every vmalert command line the docs and README show (inline code or sh blocks)."""
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        out += [m.split() for m in re.findall(r"(?<!`)`(vmalert\s[^`]+)`", text)]
        for block in re.findall(r"```(?:sh|bash)\n(.*?)```", text, flags=re.S):
            out += [line.split() for line in block.replace("\\\n", " ").splitlines() if line.startswith("vmalert ")]
    return out


def test_documented_vmalert_evaluates_at_the_zone_interval() -> None:
    """vmalert's default interval is 1 minute: without the flag the 15 s groups would run four
    times less often than on the zone Prometheus."""
    interval = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["global"]["evaluation_interval"]
    commands = documented_vmalert_commands()
    assert commands, "no vmalert command documented"
    for argv in commands:
        assert f"-evaluationInterval={interval}" in argv, " ".join(argv)
        assert [a for a in argv if a.startswith("-rule=")] == [f"-rule=alerts/{p.name}" for p in mc.RULE_FILES], " ".join(argv)


@pytest.mark.tools("vmalert")
def test_documented_vmalert_command_accepts_the_rule_files() -> None:
    for argv in documented_vmalert_commands():
        flags = [a for a in argv[1:] if a.startswith(("-rule=", "-evaluationInterval="))]
        result = subprocess.run(["vmalert", *flags, "-dryRun", "-loggerLevel=ERROR"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
