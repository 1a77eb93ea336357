"""Offline checks for the dashboards and the Prometheus rules (used by the tests and as a CLI).

``python tools/monitoring_checks.py`` lints every dashboard in ``dashboards/`` (schema-free
checks plus a promtool parse of every PromQL query), runs ``promtool check rules`` and
``promtool test rules``, and checks that every alert has unit tests that make it fire, keep it
quiet on healthy data and keep it quiet on no data while a guard alert fires. It prints one line
per problem and exits 1 if there is any. Schema validation is in ``tools/dashboard_schema.py``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = ROOT / "dashboards"
ALERTS = ROOT / "alerts"
RULE_FILES = (ALERTS / "gpu-alloc.recording.yml", ALERTS / "gpu-alloc.rules.yml", ALERTS / "gpu-alloc-sessions.rules.yml",
              ALERTS / "gpu-alloc-fleet.rules.yml")
GRID_COLUMNS = 24

# Grafana's own variables, and what the checks put in their place.
BUILTIN_VARS = {
    "__rate_interval": "5m",
    "__interval": "1m",
    "__range": "1h",
    "__range_s": "3600",
    "__interval_ms": "60000",
    "__rate_interval_ms": "300000",
}
# Series Prometheus itself produces; allowed in queries although no exporter exports them.
PROMETHEUS_SERIES = frozenset({"up", "ALERTS", "ALERTS_FOR_STATE", "scrape_duration_seconds", "scrape_samples_scraped"})
# Recording rules that hold series only while something is wrong: a healthy node or fleet records
# nothing there (their promtool tests plant the fault).
# Records that are empty on a healthy node: faults, or figures some GPUs cannot give.
RECORDS_MAY_BE_EMPTY = {
    "shape:gpu_alloc_shape_request:mig_profile_nowhere": "a request shape whose MIG profile no node has",
    "shape_selector:gpu_alloc_session_failure:predicted": "a predicted session-creation failure",
    "instance:gpu_alloc_busy_over_allocated:ratio1h": "busy time measured on some GPU (not on MIG, nor without per-process samples)",
}


def records_expected_empty() -> dict[tuple[str, str, str], str]:
    """(``"recording"``, record name, ``"record"``) -> why it may be empty: the keys of
    :class:`Query` objects built for recording rules."""
    return {("recording", name, "record"): why for name, why in RECORDS_MAY_BE_EMPTY.items()}

_PROMQL_WORDS = frozenset({
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
    "inf", "nan", "Inf", "NaN", "atan2",
})
_VAR = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\$(\w+)|\[\[(\w+)(?::[^\]]*)?\]\]")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_NAME_MATCHER = re.compile(r'__name__\s*=~?\s*"([^"]*)"')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w:.$])([A-Za-z_:][A-Za-z0-9_:]*)(?![\w:])(?!\s*\()")


# --- PromQL helpers --------------------------------------------------------------------------


def substitute_vars(expr: str, values: Mapping[str, str] | None = None, default: str = "dummy") -> str:
    """Replace Grafana variables (``$x``, ``${x}``, ``${x:fmt}``, ``[[x]]``) with values."""
    values = {**BUILTIN_VARS, **(values or {})}

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        return values.get(name, default)

    return _VAR.sub(repl, expr)


def variables_used(text: str) -> set[str]:
    return {m.group(1) or m.group(2) or m.group(3) for m in _VAR.finditer(text)}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (recorded names, with colons, included).

    A small lexer, not a parser: strings, label matchers, ranges and grouping clauses are
    removed, then every identifier not followed by ``(`` and not a keyword is a metric name.
    ``{__name__=~"a|b"}`` yields ``a`` and ``b``.
    """
    names: set[str] = set()
    for m in _NAME_MATCHER.finditer(expr):
        names |= {n for n in m.group(1).split("|") if re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", n)}
    text = substitute_vars(expr)
    text = _STRING.sub('""', text)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = _GROUPING.sub(" ", text)
    text = re.sub(r"\b(?:offset|@)\s*-?[\w.]+", " ", text)
    for m in _IDENT.finditer(text):
        word = m.group(1)
        if word not in _PROMQL_WORDS:
            names.add(word)
    return names


def label_values_metric(query: str) -> str | None:
    """The series selector of a Grafana ``label_values(selector, label)`` variable query, or the
    expression of a ``query_result(expr)`` one."""
    m = re.match(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*$", query, re.S) or re.match(r"\s*query_result\((.*)\)\s*$", query, re.S)
    return m.group(1) if m else None


def promtool_parse(exprs: Mapping[str, str]) -> list[str]:
    """Parse each expression with ``promtool check rules`` (as recording rules named by key).

    Returns one problem per expression that does not parse, naming its key.
    """
    if not exprs:
        return []
    promtool = shutil.which("promtool")
    if promtool is None:
        return ["promtool not found (Debian package prometheus)"]
    keys = sorted(exprs)
    records = {f"expr_{i}": k for i, k in enumerate(keys)}
    doc = {"groups": [{"name": "parse", "rules": [{"record": r, "expr": exprs[k]} for r, k in records.items()]}]}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "exprs.yml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    if result.returncode == 0:
        return []
    problems = []
    for line in (result.stdout + result.stderr).splitlines():
        m = re.search(r'"(expr_\d+)": (.*)', line)
        if m:
            problems.append(f"{records[m.group(1)]}: PromQL: {m.group(2)}")
    return problems or [f"promtool check rules failed: {result.stderr.strip() or result.stdout.strip()}"]


# --- dashboards ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    """One PromQL target of a dashboard panel, or a variable's query."""

    dashboard: str  # uid
    panel: str  # panel title, or "variable <name>"
    ref: str
    expr: str
    legend: str = ""
    table: bool = False

    @property
    def key(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref}"


def iter_panels(doc: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    for p in doc.get("panels", []):
        yield p
        yield from p.get("panels", []) or []


def dashboard_queries(doc: Mapping[str, Any]) -> list[Query]:
    """Every PromQL target of every panel, and every ``label_values`` variable selector."""
    uid = doc.get("uid", "?")
    out = []
    for p in iter_panels(doc):
        for t in p.get("targets", []) or []:
            if "expr" in t:
                out.append(Query(uid, p.get("title", f"panel {p.get('id')}"), t.get("refId", "?"), t["expr"],
                                 t.get("legendFormat", ""), t.get("format") == "table"))
    for v in doc.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v.get("query")
            q = q.get("query", "") if isinstance(q, dict) else q or ""
            selector = label_values_metric(q)
            if selector is not None:
                out.append(Query(uid, f"variable {v['name']}", "var", selector))
    return out


def lint_dashboard(doc: Mapping[str, Any], name: str = "") -> list[str]:
    """What grafana/dashboard-linter would say, and a few house rules. One string per problem."""
    where = name or doc.get("uid", "?")
    problems: list[str] = []
    if not doc.get("uid"):
        problems.append(f"{where}: no uid")
    if not isinstance(doc.get("schemaVersion"), int):
        problems.append(f"{where}: no schemaVersion")
    defined = {v.get("name") for v in doc.get("templating", {}).get("list", [])}
    if "datasource" not in defined:
        problems.append(f"{where}: no datasource variable")
    ids: dict[Any, str] = {}
    cells: dict[tuple[int, int], str] = {}
    for p in iter_panels(doc):
        title = p.get("title", "?")
        pid = p.get("id")
        if pid in ids:
            problems.append(f"{where}: panel id {pid} used by '{ids[pid]}' and '{title}'")
        ids[pid] = title
        g = p.get("gridPos") or {}
        x, y, w, h = (g.get(k) for k in ("x", "y", "w", "h"))
        if not all(isinstance(v, int) for v in (x, y, w, h)):
            problems.append(f"{where}: panel '{title}' has no integer gridPos")
            continue
        if x < 0 or w <= 0 or h <= 0 or x + w > GRID_COLUMNS:
            problems.append(f"{where}: panel '{title}' wider than {GRID_COLUMNS} columns or empty (x={x}, w={w})")
        for cx in range(max(x, 0), min(x + w, GRID_COLUMNS)):
            for cy in range(y, y + h):
                if (cx, cy) in cells and p.get("type") != "row":
                    problems.append(f"{where}: panel '{title}' overlaps '{cells[(cx, cy)]}'")
                    break
                cells[(cx, cy)] = title
            else:
                continue
            break
        if p.get("type") == "row":
            continue
        ds = p.get("datasource") or {}
        if ds.get("uid") != "${datasource}":
            problems.append(f"{where}: panel '{title}' does not use the ${{datasource}} variable")
        defaults = (p.get("fieldConfig") or {}).get("defaults") or {}
        if p.get("type") != "text":
            if not defaults.get("unit"):
                problems.append(f"{where}: panel '{title}' has no unit")
            if not defaults.get("noValue"):
                problems.append(f"{where}: panel '{title}' has no noValue text (say why a panel can be empty)")
        for t in p.get("targets", []) or []:
            tds = t.get("datasource") or {}
            if tds and tds.get("uid") != "${datasource}":
                problems.append(f"{where}: panel '{title}' target {t.get('refId')} does not use ${{datasource}}")
    for q in dashboard_queries(doc):
        for job in job_name_matchers(q.expr):
            problems.append(f"{where}: '{q.panel}' selects the scrape job {job!r} by name (use the $job variable)")
        for var in variables_used(q.expr) - defined - set(BUILTIN_VARS):
            problems.append(f"{where}: undefined variable ${var} in '{q.panel}': {q.expr}")
        if q.ref != "var" and not q.table and not q.legend:
            problems.append(f"{where}: '{q.panel}' {q.ref} has no legendFormat")
    for v in doc.get("templating", {}).get("list", []):
        q = v.get("query") if v.get("type") == "query" else None
        text = (q.get("query", "") if isinstance(q, dict) else q) or ""
        for var in variables_used(text) - defined - set(BUILTIN_VARS):
            problems.append(f"{where}: undefined variable ${var} in variable '{v.get('name')}'")
    exprs = {f"{where}: {q.key}": substitute_vars(q.expr) for q in dashboard_queries(doc)}
    problems += promtool_parse(exprs)
    return problems


def load_dashboards(directory: Path = DASHBOARDS) -> dict[Path, dict[str, Any]]:
    return {p: json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))}


# --- metric names: what the dashboards and rules use, what the exporter exports ---------------

GOLDEN_DIR = ROOT / "tests" / "golden"


def exposition_names(text: str) -> set[str]:
    """Sample names in a text exposition (``# HELP``/``# TYPE`` lines ignored)."""
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


def declared_names(text: str) -> set[str]:
    """Family names declared by ``# TYPE`` lines, samples or not (an empty family is still a
    name the exporter exports, e.g. a ratio only fractional slots have)."""
    return set(re.findall(r"^# TYPE (\S+) ", text, re.M))


def golden_names(directory: Path = GOLDEN_DIR) -> set[str]:
    out: set[str] = set()
    for path in sorted(directory.glob("*.prom")):
        text = path.read_text()
        out |= exposition_names(text) | declared_names(text)
    return out


def used_metric_names(dashboard_dir: Path = DASHBOARDS, rule_files: Iterable[Path] = RULE_FILES) -> dict[str, set[str]]:
    """Every metric name the dashboards and rules read → where (recorded names included)."""
    used: dict[str, set[str]] = {}
    for path, doc in load_dashboards(dashboard_dir).items():
        for q in dashboard_queries(doc):
            for name in metric_names(q.expr):
                used.setdefault(name, set()).add(f"{path.name}: {q.panel}")
    for path in rule_files:
        for group in (yaml.safe_load(path.read_text()) or {}).get("groups", []):
            for rule in group.get("rules", []):
                for name in metric_names(rule["expr"]):
                    used.setdefault(name, set()).add(f"{path.name}: {rule.get('alert') or rule.get('record')}")
    return used


# --- rules -----------------------------------------------------------------------------------


@dataclass
class Rules:
    alerts: dict[str, dict[str, Any]] = field(default_factory=dict)  # alert name -> rule
    records: dict[str, str] = field(default_factory=dict)  # record name -> expr
    alert_file: dict[str, Path] = field(default_factory=dict)
    record_file: dict[str, Path] = field(default_factory=dict)


def load_rules(paths: Iterable[Path]) -> Rules:
    rules = Rules()
    for path in paths:
        for group in (yaml.safe_load(path.read_text()) or {}).get("groups", []):
            for rule in group.get("rules", []):
                if "alert" in rule:
                    rules.alerts[rule["alert"]] = rule
                    rules.alert_file[rule["alert"]] = path.resolve()
                else:
                    rules.records[rule["record"]] = rule["expr"]
                    rules.record_file[rule["record"]] = path.resolve()
    return rules


def rule_inputs(expr: str, rules: Rules) -> set[str]:
    """Every metric an expression depends on: raw names, recorded names, and (transitively) the
    inputs of those recorded names."""
    out: set[str] = set()
    todo = list(metric_names(expr))
    while todo:
        name = todo.pop()
        if name in out:
            continue
        out.add(name)
        if name in rules.records:
            todo += metric_names(rules.records[name])
    return out


# A label matcher on ``job`` with a literal value. Rules and dashboards must work under any scrape
# job name: targets are found by gpu_alloc_build_info, and a dashboard's ``$job`` variable takes
# its values from that series, so only a variable may stand there.
_JOB_MATCHER = re.compile(r'\bjob\s*(?:=~|!~|!=|=)\s*"([^"]*)"')


def job_name_matchers(expr: str) -> list[str]:
    """The literal scrape-job names an expression selects by (``job="x"``, ``job=~"x.*"``)."""
    return [value for value in _JOB_MATCHER.findall(expr) if not value.startswith("$")]


def check_rule_files(paths: Iterable[Path]) -> list[str]:
    """``promtool check rules --lint-fatal`` plus house rules: severity, annotations, for:."""
    paths = list(paths)
    problems = []
    result = subprocess.run(["promtool", "check", "rules", "--lint-fatal", *map(str, paths)], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        problems.append(f"promtool check rules: {(result.stdout + result.stderr).strip()}")
    rules = load_rules(paths)
    for name, rule in rules.alerts.items():
        labels, notes = rule.get("labels") or {}, rule.get("annotations") or {}
        if labels.get("severity") not in ("critical", "warning", "info"):
            problems.append(f"alert {name}: severity label must be critical, warning or info")
        for key in ("summary", "description", "runbook"):
            if not notes.get(key):
                problems.append(f"alert {name}: no {key} annotation")
        if "for" not in rule:
            problems.append(f"alert {name}: no explicit for:")
    for name in rules.records:
        if name.count(":") != 2 or name.startswith(":"):
            problems.append(f"recording rule {name}: name is not level:metric:operations")
    for kind, name, expr in [("alert", n, r["expr"]) for n, r in rules.alerts.items()] + [
            ("recording rule", n, e) for n, e in rules.records.items()]:
        for job in job_name_matchers(str(expr)):
            problems.append(f"{kind} {name}: selects the scrape job {job!r} by name (find targets by gpu_alloc_build_info)")
    return problems


@dataclass
class _Case:
    file: Path
    group: str
    loaded: frozenset[Path]
    series: frozenset[str]
    # eval_time -> {alertname: firing?}
    asserts: dict[str, dict[str, bool]]


def _series_name(selector: str) -> str:
    s = selector.strip()
    if s.startswith("{"):
        m = _NAME_MATCHER.search(s)
        return m.group(1) if m else ""
    return re.split(r"[{\s]", s, maxsplit=1)[0]


def _load_cases(test_files: Iterable[Path]) -> list[_Case]:
    cases = []
    for path in test_files:
        doc = yaml.safe_load(path.read_text()) or {}
        loaded = frozenset((path.parent / f).resolve() for f in doc.get("rule_files", []))
        for i, group in enumerate(doc.get("tests", [])):
            series = frozenset(_series_name(s["series"]) for s in group.get("input_series", []))
            asserts: dict[str, dict[str, bool]] = {}
            for t in group.get("alert_rule_test", []) or []:
                asserts.setdefault(str(t["eval_time"]), {})[t["alertname"]] = bool(t.get("exp_alerts"))
            cases.append(_Case(path, group.get("name", f"#{i}"), loaded, series, asserts))
    return cases


def check_alert_coverage(rule_files: Iterable[Path], test_files: Iterable[Path]) -> list[str]:
    """Every alert needs promtool tests that (1) make it fire, (2) keep it quiet with all its
    inputs present, and (3) cover no data: either it stays quiet in a group that lacks one of
    its inputs while another alert (the guard) fires at the same time, or it fires there itself
    (it is a guard). A recorded input counts as present when the test file loads the rule file
    that records it."""
    rules = load_rules(rule_files)
    cases = _load_cases(test_files)
    problems = []
    for name, rule in sorted(rules.alerts.items()):
        inputs = rule_inputs(rule["expr"], rules)
        fires = quiet = no_data = False
        for case in cases:
            if rules.alert_file[name] not in case.loaded:
                continue

            def present(metric: str, case: _Case = case) -> bool:
                if metric in rules.records:
                    return rules.record_file[metric] in case.loaded
                return metric in case.series

            complete = all(present(m) for m in inputs)
            for results in case.asserts.values():
                if name not in results:
                    continue
                if results[name]:
                    fires = True
                    no_data |= not complete
                else:
                    quiet |= complete
                    no_data |= not complete and any(v for k, v in results.items() if k != name)
        if not fires:
            problems.append(f"alert {name}: no test makes it fire")
        if not quiet:
            problems.append(f"alert {name}: no test keeps it quiet with all of its inputs present")
        if not no_data:
            problems.append(f"alert {name}: no test covers no data (quiet without one of its inputs while a guard alert fires)")
    return problems


def run_promtool_tests(test_files: Iterable[Path]) -> list[str]:
    problems = []
    for path in test_files:
        result = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            problems.append(f"{path.name}: promtool test rules failed:\n{result.stdout}{result.stderr}")
    return problems


def test_files() -> list[Path]:
    return sorted((ALERTS / "tests").glob("*.test.yml"))


def main() -> int:
    problems: list[str] = []
    for path, doc in load_dashboards().items():
        problems += lint_dashboard(doc, path.name)
    problems += check_rule_files(RULE_FILES)
    problems += run_promtool_tests(test_files())
    problems += check_alert_coverage(RULE_FILES, test_files())
    for p in problems:
        print(p)
    print(f"{len(problems)} problem(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
