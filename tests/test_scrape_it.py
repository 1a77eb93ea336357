"""README.md's "Scrape it", run as written: Debian's Prometheus and Alertmanager with the shipped
configurations, in a root-like layout under tmp_path.

Every command of the section's ``sh`` blocks runs in bash from the repository root, with three
substitutions that move the machine into tmp_path: paths under ``/etc/prometheus`` and
``/var/lib/prometheus`` go below a temporary root (the installed configuration files too, as the
package would find them there), ``localhost:9090``/``:9093`` (and the configuration's
``127.0.0.1`` spellings of them) become free loopback ports, and ``sudo`` is dropped
(``sudo -b`` starts a process in the background, which the test stops by its PID). Two commands
cannot run here: ``apt-get install`` (the test requires the packages' tools instead, and checks
the line names the packages that ship them) and ``systemctl`` (no systemd; the units it names must
be Debian's). Then Prometheus, started the non-systemd way, has loaded every shipped rule, found
the demo target in the file it was told to read, and sees Alertmanager.

The same section is checked against the rest of the repository: the rule files live in one place
(README, deploy/prometheus/prometheus.yml and docs/dashboards.md agree), the receiver lines the
README tells an operator to edit are the ones in deploy/alertmanager/alertmanager.yml, and its
e-mail example is a valid Alertmanager configuration once uncommented.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import urllib.request
from pathlib import Path

import monitoring_checks as mc
import pytest
import yaml
from e2e.harness import free_port, wait_until
from helpers import ROOT
from processes import TOOLS

README = ROOT / "README.md"
PROMETHEUS_YML = ROOT / "deploy" / "prometheus" / "prometheus.yml"
ALERTMANAGER_YML = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
DAEMONS = ("prometheus", "prometheus-alertmanager")
TOOLS_USED = ("prometheus", "promtool", "prometheus-alertmanager", "amtool")


def section() -> str:
    text = README.read_text()
    start = text.index("## Scrape it\n")
    return text[start:text.index("\n## ", start + 1)]


def commands() -> list[str]:
    """The section's shell commands, in order (continuation lines joined)."""
    out = []
    for block in re.findall(r"```sh\n(.*?)```", section(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line:
                out.append(line)
    return out


def installed_rule_paths() -> set[str]:
    """Where the README puts each rule file: ``install ... alerts/X.yml ... DIR/``."""
    out = set()
    for line in commands():
        words = shlex.split(line)
        if "install" in words and any(w.startswith("alerts/") for w in words):
            dest = words[-1]
            assert dest.endswith("/"), line
            out |= {dest + Path(w).name for w in words if w.startswith("alerts/")}
    return out


# --- the section agrees with the repository ------------------------------------------------------


def test_one_rule_path_everywhere() -> None:
    readme = installed_rule_paths()
    # deploy/prometheus/prometheus.yml names the files relative to itself, installed as
    # /etc/prometheus/prometheus.yml by the same README.
    config_dir = next(shlex.split(c)[-1] for c in commands() if "deploy/prometheus/prometheus.yml" in c)
    config = {config_dir + f for f in yaml.safe_load(PROMETHEUS_YML.read_text())["rule_files"]}
    dashboards = (ROOT / "docs" / "dashboards.md").read_text()
    block = re.search(r"```yaml\nrule_files:\n(.*?)```", dashboards, flags=re.S).group(1)
    documented = set(re.findall(r"^\s*-\s*(\S+)$", block, flags=re.M))
    assert readme == config == documented, (readme, config, documented)
    assert {Path(p).name for p in readme} == {p.name for p in mc.RULE_FILES}
    # The install lines quoted at the top of the shipped configurations are the README's.
    readme_lines = {re.sub(r"^sudo ", "", c) for c in commands()}
    for path in (PROMETHEUS_YML, ALERTMANAGER_YML):
        quoted = [line[1:].strip() for line in path.read_text().splitlines() if line.startswith("#   install ")]
        assert quoted and set(quoted) <= readme_lines, (path.name, quoted)


def test_the_receivers_the_readme_points_at(tmp_path: Path) -> None:
    text = " ".join(section().split())
    url_lines = [int(n) for n in re.search(r"edit the `url:` on lines (\d+), (\d+) and (\d+)", text).groups()]
    first, last = (int(n) for n in re.search(r"`email_configs:` example on lines (\d+)-(\d+)", text).groups())
    lines = ALERTMANAGER_YML.read_text().splitlines()
    config = yaml.safe_load(ALERTMANAGER_YML.read_text())
    urls = [c["url"] for r in config["receivers"] for c in r.get("webhook_configs", [])]
    assert [lines[n - 1].strip() for n in url_lines] == [f"- url: {u}" for u in urls]
    # Each receiver the README names gets the severity it says.
    routed = dict(re.findall(r"`(critical|warning|info)`(?: alerts)? to (?:the receiver )?`(\w+)`", text))
    assert set(routed) == {"critical", "warning", "info"}
    assert routed["critical"] == config["route"]["receiver"]
    for route in config["route"]["routes"]:
        severity = re.fullmatch(r'severity="(\w+)"', route["matchers"][0]).group(1)
        assert routed[severity] == route["receiver"], severity
    # The e-mail example, uncommented, is a configuration Alertmanager accepts.
    example = lines[first - 1:last]
    assert example[0].strip() == "# email_configs:" and all(line.lstrip().startswith("#") for line in example)
    uncommented = lines[:first - 1] + [line.replace("# ", "", 1) for line in example] + lines[last:]
    mail = yaml.safe_load("\n".join(uncommented))
    assert any(r.get("email_configs") for r in mail["receivers"])
    (tmp_path / "mail.yml").write_text("\n".join(uncommented) + "\n")
    result = subprocess.run(["amtool", "check-config", str(tmp_path / "mail.yml")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_deploy_guide_names_the_alertmanager_config() -> None:
    text = (ROOT / "docs" / "deploy.md").read_text()
    assert "`deploy/alertmanager/`" in text and "`deploy/alertmanager/alertmanager.yml`" in text


# --- the section, run ----------------------------------------------------------------------------


class Layout:
    """A root-like tree under tmp_path as Debian's packages leave it, and the substitutions that
    move the README's commands into it."""

    def __init__(self, tmp: Path) -> None:
        self.root = tmp / "root"
        self.logs = tmp / "logs"
        self.logs.mkdir()
        for d in ("etc/prometheus", "var/lib/prometheus/metrics2", "var/lib/prometheus/alertmanager"):
            (self.root / d).mkdir(parents=True)
        self.prometheus, self.alertmanager = free_port(), free_port()

    def apply(self, text: str) -> str:
        for path in ("/etc/prometheus", "/var/lib/prometheus"):
            text = re.sub(rf"(?<![\w/.]){re.escape(path)}(?=[/\s\"']|$)", f"{self.root}{path}", text, flags=re.M)
        for host in ("localhost", "127.0.0.1"):
            text = text.replace(f"{host}:9090", f"127.0.0.1:{self.prometheus}").replace(f"{host}:9093", f"127.0.0.1:{self.alertmanager}")
        return text

    def relocate_installed(self) -> None:
        """The installed configuration files, moved into the layout like the commands."""
        for path in (self.root / "etc" / "prometheus").glob("*.yml"):
            text = path.read_text()
            moved = self.apply(text)
            if moved != text:
                path.write_text(moved)


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.tools(*TOOLS_USED)
def test_the_section_runs_as_written(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    started: list[subprocess.Popen] = []
    logs = []
    try:
        for command in commands():
            words = shlex.split(command)
            if "apt-get" in words:
                packages = set(words[words.index("install") + 1:]) - {"-y"}
                assert packages == {TOOLS[t] for t in TOOLS_USED}, command
                continue
            if words[:2] == ["sudo", "systemctl"] or words[0] == "systemctl":
                units = [w for w in words[words.index("systemctl") + 2:]]
                assert units == list(DAEMONS), command
                assert all(Path(f"/lib/systemd/system/{u}.service").is_file() for u in units), units
                continue
            line = layout.apply(command)
            if line.startswith("sudo -b "):
                line = re.sub(r"^sudo -b (-u \w+ )?", "", line)
                log = (layout.logs / f"{shlex.split(line)[0]}.log").open("w")
                logs.append(log)
                started.append(subprocess.Popen(["bash", "-c", "exec " + line], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL))
                port = layout.alertmanager if "alertmanager" in line.split()[0] else layout.prometheus
                wait_until(lambda p=port, proc=started[-1]: _ready(p) or proc.poll() is not None, 30, f"{line.split()[0]} ready")
                assert started[-1].poll() is None, (layout.logs / f"{shlex.split(line)[0]}.log").read_text()
                continue
            line = re.sub(r"(^|\|\s*)sudo ", r"\1", line)
            result = subprocess.run(["bash", "-o", "pipefail", "-c", line], cwd=ROOT, capture_output=True, text=True, timeout=60)
            assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
            if words[:3] == ["promtool", "check", "config"]:
                assert f"SUCCESS: {len(mc.RULE_FILES)} rule files found" in result.stdout, result.stdout
            layout.relocate_installed()
        assert len(started) == len(DAEMONS), "the section starts Prometheus and Alertmanager without systemd"

        prom = f"http://127.0.0.1:{layout.prometheus}"
        # Every shipped rule is loaded.
        groups = _get(f"{prom}/api/v1/rules")["data"]["groups"]
        loaded = {r["name"] for g in groups for r in g["rules"]}
        rules = mc.load_rules(mc.RULE_FILES)
        assert loaded == set(rules.alerts) | set(rules.records)
        # Prometheus finds Alertmanager and the file-discovered target (service discovery hands
        # both over in 5 s batches).
        wanted = f"http://127.0.0.1:{layout.alertmanager}/api/v2/alerts"
        wait_until(lambda: [a["url"] for a in _get(f"{prom}/api/v1/alertmanagers")["data"]["activeAlertmanagers"]] == [wanted],
                   30, "Prometheus to see Alertmanager")
        wait_until(lambda: any(t["labels"].get("instance") == "localhost:19402" for t in _get(f"{prom}/api/v1/targets")["data"]["activeTargets"]),
                   30, "the demo target from gpu-alloc-targets/")
        # Alertmanager runs the shipped routing.
        status = _get(f"http://127.0.0.1:{layout.alertmanager}/api/v2/status")
        running, shipped = yaml.safe_load(status["config"]["original"]), yaml.safe_load(ALERTMANAGER_YML.read_text())
        assert [r["name"] for r in running["receivers"]] == [r["name"] for r in shipped["receivers"]]
        assert [(r["receiver"], r["matchers"]) for r in running["route"]["routes"]] == \
            [(r["receiver"], r["matchers"]) for r in shipped["route"]["routes"]]
    finally:
        for proc in started:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for log in logs:
            log.close()
