"""Prometheus rules: promtool-clean, unit-tested in every direction, names that exist, docs in step."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent

import monitoring_checks as mc  # noqa: E402

DOC = ROOT / "docs" / "dashboards.md"
XID_RE = re.compile(r'xid=~"([0-9|]+)"')

pytestmark = pytest.mark.tools("promtool")


def test_rule_files_pass_promtool_and_house_rules() -> None:
    assert mc.check_rule_files(mc.RULE_FILES) == []


def test_a_rule_that_selects_a_scrape_job_by_name_is_reported(tmp_path: Path) -> None:
    doc = yaml.safe_load(mc.RULE_FILES[1].read_text())
    doc["groups"][0]["rules"][0]["expr"] = 'up{job=~".*gpu-alloc.*"} == 0'
    rules = tmp_path / "gpu-alloc.rules.yml"
    rules.write_text(yaml.safe_dump(doc, sort_keys=False))
    name = doc["groups"][0]["rules"][0]["alert"]
    assert f"alert {name}: selects the scrape job '.*gpu-alloc.*' by name (find targets by gpu_alloc_build_info)" in (
        mc.check_rule_files([rules]))


@pytest.mark.parametrize(("expr", "jobs"), [
    ('up{job="gpu-alloc-exporter"}', ["gpu-alloc-exporter"]),
    ("sum by (job) (x{job=~'$job'})", []),
    ('x{job=~"$job", instance="a"} * on (job, instance) group_left () y{job != "node"}', ["node"]),
    ('count by (job, instance) (gpu_alloc_build_info)', []),
])
def test_job_name_matchers(expr: str, jobs: list[str]) -> None:
    assert mc.job_name_matchers(expr) == jobs


@pytest.mark.parametrize("path", mc.test_files(), ids=lambda p: p.name)
def test_promtool_unit_tests_pass(path: Path) -> None:
    assert mc.run_promtool_tests([path]) == []


def test_every_alert_fires_stays_quiet_and_covers_no_data() -> None:
    assert mc.check_alert_coverage(mc.RULE_FILES, mc.test_files()) == []


def test_an_untested_alert_is_reported(tmp_path: Path) -> None:
    """A rule file with one more alert and no test for it: the coverage check says so."""
    doc = yaml.safe_load(mc.RULE_FILES[1].read_text())
    doc["groups"][0]["rules"].append({
        "alert": "GpuAllocUntested", "expr": "gpu_alloc_watcher_errors_total > 100", "for": "5m",
        "labels": {"severity": "warning"}, "annotations": {"summary": "s", "description": "d", "runbook": "r"},
    })
    rules = tmp_path / "gpu-alloc.rules.yml"
    rules.write_text(yaml.safe_dump(doc, sort_keys=False))
    shutil.copy(mc.RULE_FILES[0], tmp_path / mc.RULE_FILES[0].name)
    (tmp_path / "tests").mkdir()
    for t in mc.test_files():
        shutil.copy(t, tmp_path / "tests" / t.name)
    problems = mc.check_alert_coverage([tmp_path / mc.RULE_FILES[0].name, rules], sorted((tmp_path / "tests").glob("*.yml")))
    assert problems == [
        "alert GpuAllocUntested: no test makes it fire",
        "alert GpuAllocUntested: no test keeps it quiet with all of its inputs present",
        "alert GpuAllocUntested: no test covers no data (quiet without one of its inputs while a guard alert fires)",
    ]


def test_an_alert_tested_only_for_firing_is_reported(tmp_path: Path) -> None:
    rules = tmp_path / "r.yml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [
        {"alert": "OnlyFires", "expr": "x > 1", "for": "0m", "labels": {"severity": "info"},
         "annotations": {"summary": "s", "description": "d", "runbook": "r"}}]}]}))
    test = tmp_path / "r.test.yml"
    test.write_text(yaml.safe_dump({"rule_files": ["r.yml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": [{"series": 'x{instance="a"}', "values": "2x5"}],
        "alert_rule_test": [{"eval_time": "2m", "alertname": "OnlyFires",
                             "exp_alerts": [{"exp_labels": {"severity": "info", "instance": "a"},
                                             "exp_annotations": {"summary": "s", "description": "d", "runbook": "r"}}]}]}]}))
    assert mc.run_promtool_tests([test]) == []
    assert mc.check_alert_coverage([rules], [test]) == [
        "alert OnlyFires: no test keeps it quiet with all of its inputs present",
        "alert OnlyFires: no test covers no data (quiet without one of its inputs while a guard alert fires)",
    ]


def test_a_failing_unit_test_is_reported(tmp_path: Path) -> None:
    src = mc.ALERTS / "tests" / "exporter.test.yml"
    broken = tmp_path / src.name
    text = src.read_text().replace("../gpu-alloc", str(mc.ALERTS / "gpu-alloc"))
    broken.write_text(text.replace("is down\"", "is up\"", 1))
    problems = mc.run_promtool_tests([broken])
    assert len(problems) == 1 and "FAILED" in problems[0]


def test_every_metric_used_exists_in_the_golden_expositions() -> None:
    """A renamed metric would silently blank a panel or mute an alert. Recorded series (with
    colons) and Prometheus' own series are exempt. A family declared in a golden file without
    samples counts (e.g. the fragmentation ratio, which only fractional slots have)."""
    golden = mc.golden_names()
    used = mc.used_metric_names()
    missing = {n: sorted(w)[:3] for n, w in used.items() if ":" not in n and n not in golden | mc.PROMETHEUS_SERIES}
    assert not missing, json.dumps(missing, indent=1)


def test_a_misspelled_metric_is_reported(tmp_path: Path) -> None:
    doc = copy.deepcopy(json.loads((ROOT / "dashboards" / "gpu-alloc-node.json").read_text()))
    next(p for p in mc.iter_panels(doc) if p.get("targets"))["targets"][0]["expr"] = "sum(gpu_alloc_device_fgpu_alocated)"
    (tmp_path / "broken.json").write_text(json.dumps(doc))
    used = mc.used_metric_names(tmp_path, [])
    missing = {n for n in used if ":" not in n and n not in mc.golden_names() | mc.PROMETHEUS_SERIES}
    assert missing == {"gpu_alloc_device_fgpu_alocated"}


def test_every_recorded_series_used_is_recorded_and_every_record_is_used() -> None:
    rules = mc.load_rules(mc.RULE_FILES)
    used = mc.used_metric_names()
    assert sorted(n for n in used if ":" in n and n not in rules.records) == []
    assert sorted(n for n in rules.records if n not in used) == []


@pytest.mark.parametrize(("expr", "names"), [
    ('sum by (job, instance) (rate(gpu_alloc_watcher_events_total{job=~"$job"}[$__rate_interval]))', {"gpu_alloc_watcher_events_total"}),
    ("absent(up{job=~\".*gpu-alloc.*\"}) or absent(global:x:threshold)", {"up", "global:x:threshold"}),
    ("a / ignoring (slot) b{slot=\"cuda.mem\"} > on () group_left () c", {"a", "b", "c"}),
    ("max_over_time(x[1d:5m]) offset 5m < bool 3600", {"x"}),
    ('{__name__=~"m1|m2", instance="a"}', {"m1", "m2"}),
    ("topk(20, instance_kernel:m:sum) and on (job, instance, kernel_id) y", {"instance_kernel:m:sum", "y"}),
    ('label_replace(z, "dst", "$1", "src", "(.*)")', {"z"}),
    ("1e9 * time() - vector(0.5)", set()),
])
def test_metric_name_extraction(expr: str, names: set[str]) -> None:
    assert mc.metric_names(expr) == names


# --- the document matches the rules ---------------------------------------------------------------


def _doc_table(heading_contains: str, first_col: str) -> list[list[str]]:
    """Rows of the first Markdown table whose header starts with ``| first_col |`` after a heading."""
    text = DOC.read_text()
    start = next(m.end() for m in re.finditer(r"^#+ .*$", text, re.M) if heading_contains in m.group(0))
    rows = []
    for line in text[start:].splitlines():
        if line.startswith(f"| {first_col} |"):
            rows = []
            continue
        if line.startswith("|") and not set(line) <= set("|- "):
            rows.append([c.strip().strip("`") for c in line.strip("|").split("|")])
        elif rows:
            break
    return rows


def test_documented_alerts_match_the_rules() -> None:
    rules = mc.load_rules(mc.RULE_FILES)
    documented = {r[0]: (r[1], r[2]) for r in _doc_table("## Alerts", "alert")}
    actual = {n: (a["labels"]["severity"], a["for"]) for n, a in rules.alerts.items()}
    assert documented == actual


def test_documented_thresholds_match_the_recording_rules() -> None:
    rules = mc.load_rules(mc.RULE_FILES)
    actual = {n: float(re.fullmatch(r"vector\((.*)\)", e.strip()).group(1)) for n, e in rules.records.items() if n.endswith(":threshold")}
    documented = {r[0]: float(r[1]) for r in _doc_table("Thresholds and how to tune them", "series")}
    assert documented == actual
    # Every threshold series is used by some alert.
    used = mc.used_metric_names(ROOT / "nonexistent", [mc.RULE_FILES[1]])
    assert set(actual) <= set(used)


def test_documented_recording_rules_match() -> None:
    rules = mc.load_rules(mc.RULE_FILES)
    documented = {r[0] for r in _doc_table("## Recording rules", "series")}
    assert documented == {n for n in rules.records if not n.endswith(":threshold")}


def test_xid_list_is_the_same_in_rules_recording_and_docs() -> None:
    lists = {p.name: {tuple(m.split("|")) for m in XID_RE.findall(p.read_text())} for p in mc.RULE_FILES}
    lists = {name: v for name, v in lists.items() if v}  # files that read no XID (the fleet what-if) say nothing
    assert len(lists) >= 2 and all(len(v) == 1 for v in lists.values()), lists
    in_rules = [next(iter(v)) for v in lists.values()]
    assert in_rules[0] == in_rules[1]
    documented = tuple(r[0] for r in _doc_table("### XID codes", "XID"))
    assert documented == in_rules[0]
