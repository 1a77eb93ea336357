"""Processes the tests run: the exporter as a child process, Debian's node_exporter, and the one
gate for the Debian tools the tests need (a loud skip, or a failure under ``scripts/test``)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import wait_for

NODE_EXPORTER = shutil.which("prometheus-node-exporter")


# Each Debian tool the tests run and the package that ships it.
TOOLS = {
    "promtool": "prometheus",
    "prometheus": "prometheus",
    "prometheus-alertmanager": "prometheus-alertmanager",
    "amtool": "prometheus-alertmanager",
    "prometheus-node-exporter": "prometheus-node-exporter",
    "victoria-metrics": "victoria-metrics",
    "vmalert": "victoria-metrics",
}


REQUIRE_TOOLS = "GPU_ALLOC_EXPORTER_TEST_REQUIRE_TOOLS"


SKIPPED_FOR_TOOLS: list[str] = []  # listed at the end of the run (tests/conftest.py)


def require_tool(name: str, who: str = "") -> str:
    """The tool's path. Missing: the test fails under ``scripts/test`` (which installs every
    tool and sets GPU_ALLOC_EXPORTER_TEST_REQUIRE_TOOLS=1), else it is skipped, loudly."""
    path = shutil.which(name)
    if path is not None:
        return path
    why = f"{name} not installed (Debian: apt-get install {TOOLS.get(name, name)})"
    if os.environ.get(REQUIRE_TOOLS) == "1":
        pytest.fail(f"{why}; {REQUIRE_TOOLS}=1 forbids skipping", pytrace=False)
    SKIPPED_FOR_TOOLS.append(f"{who or os.environ.get('PYTEST_CURRENT_TEST', '?')}: {why}")
    pytest.skip(f"LOUD SKIP: {why}")


@contextlib.contextmanager
def node_exporter(web_config: Path | None = None) -> Iterator[int]:
    """Debian's node_exporter (loadavg collector only) on a free loopback port; yields the port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [NODE_EXPORTER, f"--web.listen-address=127.0.0.1:{port}", "--collector.disable-defaults", "--collector.loadavg"]
    if web_config is not None:
        args.append(f"--web.config.file={web_config}")
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def up() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return True
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode()
                return False

        wait_for(up, timeout=10)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stderr.close()


class Running:
    """A ``python -m exporter`` child process; the port comes from its 'serving on' log line."""

    def __init__(self, *args: str, env: dict | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "exporter", *args], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})},
        )
        self.log: list[str] = []
        for line in self.proc.stderr:
            self.log.append(line)
            m = re.search(r"serving on http://\S+:(\d+)/metrics", line)
            if m:
                self.port = int(m.group(1))
                break
        else:
            raise AssertionError("exporter did not start:\n" + "".join(self.log))

    def get(self, path: str, headers: dict | None = None) -> tuple[int, bytes, dict]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, r.read(), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, e.read(), dict(e.headers)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(10)
        self.proc.stderr.close()
        self.proc.stdout.close()
        return rc
