"""Processes and loopback servers for the end-to-end monitoring test (tests/test_e2e_prometheus.py).

Everything binds 127.0.0.1 on ports the kernel picks; every process is started by this module
and stopped by its PID (SIGTERM, then SIGKILL after a timeout); the in-process HTTP servers run
one thread each and are joined on exit, so the suite's thread-leak check holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml
from processes import require_tool


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running() -> Iterator[list]:
    """What an end-to-end fixture starts, appended in order: stopped in reverse order when the
    fixture ends, whatever failed in between (a server is closed, a process stopped)."""
    things: list = []
    try:
        yield things
    finally:
        for thing in reversed(things):
            thing.close() if hasattr(thing, "close") else thing.stop()


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


class Process:
    """A child process with its output in a log file; stopped by PID."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})}, cwd=log_dir)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def start_checked(self, ready: Callable[[], bool], what: str, timeout: float = 20) -> None:
        """Wait until ``ready()``; on failure stop the process before raising (no leaked child)."""
        try:
            wait_until(ready, timeout, what)
        except BaseException:
            self.stop()
            raise

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode


class Exporter(Process):
    """``python -m exporter [command]`` on ``listen`` (port 0 by default); the port comes from its
    'serving on' log line (as in test_cli)."""

    def __init__(self, args: list[str], log_dir: Path, *, command: tuple[str, ...] = (), listen: str = "127.0.0.1:0") -> None:
        super().__init__("exporter", [sys.executable, "-m", "exporter", *command, "--web.listen-address", listen, *args], log_dir)
        try:
            m = wait_until(lambda: re.search(r"serving on http://\S+:(\d+)/metrics", self.log()) or (not self.alive() and "exited"),
                           15, "the exporter to serve")
            if not isinstance(m, re.Match):
                raise AssertionError("exporter did not start:\n" + self.log())
        except BaseException:
            self.stop()
            raise
        self.port = int(m.group(1))
        self.address = f"127.0.0.1:{self.port}"

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://{self.address}/metrics", timeout=5) as r:
            return r.read().decode()


class _Server:
    """A ThreadingHTTPServer on a loopback port, served by one thread until :meth:`close`."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, name=f"http-{self.port}")
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


class StaticExpositions(_Server):
    """Serves fixed expositions (the golden files) as scrape targets: GET /<name> → text 0.0.4."""

    def __init__(self, files: Mapping[str, bytes]) -> None:
        bodies = dict(files)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                body = bodies.get(self.path.lstrip("/"))
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(Handler)


class Webhook(_Server):
    """Alertmanager's webhook receiver: records every POSTed notification (``http.server`` answers
    POST with 501, so it cannot be the receiver)."""

    def __init__(self) -> None:
        self.notifications: list[dict[str, Any]] = []
        self.cond = threading.Condition()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with outer.cond:
                    outer.notifications.append({"recv": time.monotonic(), "payload": json.loads(body)})
                    outer.cond.notify_all()
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(Handler)

    def alerts(self, status: str, alertname: str, **labels: str) -> list[dict[str, Any]]:
        """Alerts with this status and alertname (and labels) in any notification so far."""
        with self.cond:
            found = []
            for n in self.notifications:
                for a in n["payload"].get("alerts", []):
                    if a.get("status") == status and a["labels"].get("alertname") == alertname and \
                            all(a["labels"].get(k) == v for k, v in labels.items()):
                        found.append(a)
            return found

    def wait_for(self, status: str, alertname: str, timeout: float, **labels: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self.cond:  # an RLock: alerts() takes it again
            while not (found := self.alerts(status, alertname, **labels)):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {status} {alertname} {labels} notification within {timeout:.0f}s; got: "
                                         f"{[n['payload'].get('status') for n in self.notifications]}")
                self.cond.wait(left)
            return found[0]


def e2e_rules(dest: Path, rule_files: list[Path]) -> list[Path]:
    """Copies of the rule files for a fast loop: every ``for:`` set to 0s. Expressions, labels
    and annotations stay as they are; the durations are covered by the promtool unit tests."""
    out = []
    for src in rule_files:
        doc = yaml.safe_load(src.read_text())
        for group in doc["groups"]:
            group.pop("interval", None)
            for rule in group["rules"]:
                if "alert" in rule:
                    rule["for"] = "0s"
        path = dest / src.name
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        out.append(path)
    return out


class QueryAPI:
    """The Prometheus HTTP query API, which VictoriaMetrics serves too."""

    url: str

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}" + (("?" + urllib.parse.urlencode(params)) if params else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                doc = json.loads(r.read())
        except urllib.error.HTTPError as e:
            doc = json.loads(e.read() or b"{}") or {"status": "error", "error": str(e)}
        if doc.get("status") != "success":
            raise PromQLError(f"{doc.get('errorType')}: {doc.get('error')}")
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        result = data["result"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": result}]
        return result


class PromQLError(Exception):
    pass


def _http_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


class Prometheus(Process, QueryAPI):
    """Debian's Prometheus on a loopback port. Either the parts of a config (rule files, scrape
    targets, an Alertmanager) or a whole ``config`` document; checked with promtool first."""

    def __init__(self, work: Path, rule_files: list[Path] | None = None, targets: list[dict[str, Any]] | None = None,
                 alertmanager: str | None = None, interval: str = "500ms", *, config: dict[str, Any] | None = None,
                 name: str = "prometheus") -> None:
        self.port = free_port()
        if config is None:
            config = {
                "global": {"scrape_interval": interval, "evaluation_interval": interval, "scrape_timeout": interval},
                "rule_files": [str(p) for p in rule_files or []],
                "scrape_configs": targets or [],
            }
            if alertmanager:
                config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
        path = work / f"{name}.yml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        check = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True, timeout=30)
        if check.returncode != 0:
            raise AssertionError(f"promtool check config:\n{check.stdout}{check.stderr}")
        super().__init__(name, ["prometheus", f"--config.file={path}", f"--storage.tsdb.path={work / (name + '-data')}",
                                f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"], work)
        self.url = f"http://127.0.0.1:{self.port}"
        self.address = f"127.0.0.1:{self.port}"
        self.start_checked(self._ready, f"{name} to be ready")

    def _ready(self) -> bool:
        if not self.alive():
            raise AssertionError(f"{self.name} exited:\n" + self.log())
        return _http_ready(self.url + "/-/ready")


class VictoriaMetrics(Process, QueryAPI):
    """Debian's single-node VictoriaMetrics: a remote-write receiver with the Prometheus query API.
    Data is visible to queries at once (``-search.latencyOffset=0s``; the default hides the last 30 s)."""

    def __init__(self, work: Path, name: str = "victoria-metrics") -> None:
        self.port = free_port()
        super().__init__(name, ["victoria-metrics", f"-storageDataPath={work / (name + '-data')}", f"-httpListenAddr=127.0.0.1:{self.port}",
                                "-retentionPeriod=1", "-search.latencyOffset=0s", "-search.disableCache", "-loggerLevel=WARN"], work)
        self.url = f"http://127.0.0.1:{self.port}"
        self.write_url = f"{self.url}/api/v1/write"
        self.start_checked(self._ready, f"{name} to be ready")

    def _ready(self) -> bool:
        if not self.alive():
            raise AssertionError(f"{self.name} exited:\n" + self.log())
        return _http_ready(self.url + "/health")


class VMAlert(Process):
    """Debian's vmalert: evaluates rule files against a VictoriaMetrics and writes recorded series
    and alert state (ALERTS) back to it."""

    def __init__(self, work: Path, rule_files: list[Path], vm: VictoriaMetrics, notifier: str, interval: str = "1s") -> None:
        self.port = free_port()
        super().__init__("vmalert", ["vmalert", *(f"-rule={p}" for p in rule_files), f"-datasource.url={vm.url}",
                                     f"-remoteWrite.url={vm.url}", f"-notifier.url={notifier}", f"-evaluationInterval={interval}",
                                     "-remoteWrite.flushInterval=500ms", f"-httpListenAddr=127.0.0.1:{self.port}", "-loggerLevel=WARN"], work)
        self.url = f"http://127.0.0.1:{self.port}"
        self.start_checked(self._ready, "vmalert to be ready")

    def _ready(self) -> bool:
        if not self.alive():
            raise AssertionError("vmalert exited:\n" + self.log())
        return _http_ready(self.url + "/health")

    def groups(self) -> list[dict[str, Any]]:
        try:
            with urllib.request.urlopen(self.url + "/api/v1/rules", timeout=5) as r:
                return json.loads(r.read())["data"]["groups"]
        except urllib.error.HTTPError as e:
            raise AssertionError(f"vmalert /api/v1/rules: {e.code}: {e.read().decode(errors='replace')[:500]}") from None

    def alerts(self) -> list[dict[str, Any]]:
        """Active (pending and firing) alerts with labels and expanded annotations."""
        with urllib.request.urlopen(self.url + "/api/v1/alerts", timeout=5) as r:
            return json.loads(r.read())["data"]["alerts"]


class Alertmanager(Process):
    def __init__(self, work: Path, webhook_url: str) -> None:
        self.port = free_port()
        config = {
            "route": {"receiver": "hook", "group_by": ["alertname", "instance", "device_id"], "group_wait": "0s",
                      "group_interval": "1s", "repeat_interval": "1h"},
            "receivers": [{"name": "hook", "webhook_configs": [{"url": webhook_url, "send_resolved": True}]}],
        }
        path = work / "alertmanager.yml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        check = subprocess.run([require_tool("amtool"), "check-config", str(path)], capture_output=True, text=True, timeout=30)
        if check.returncode != 0:
            raise AssertionError(f"amtool check-config:\n{check.stdout}{check.stderr}")
        # --cluster.listen-address= (empty) disables HA gossip, which would bind 0.0.0.0:9094.
        super().__init__("alertmanager", ["prometheus-alertmanager", f"--config.file={path}", f"--storage.path={work / 'am-data'}",
                                          f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address=",
                                          "--log.level=warn"], work)
        self.address = f"127.0.0.1:{self.port}"
        self.start_checked(self._ready, "Alertmanager to be ready")

    def _ready(self) -> bool:
        if not self.alive():
            raise AssertionError("alertmanager exited:\n" + self.log())
        try:
            with urllib.request.urlopen(f"http://{self.address}/-/ready", timeout=1) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False
