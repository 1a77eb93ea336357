"""systemd's readiness protocol: READY=1 as /-/ready turns 200, STOPPING=1 on the way out."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import uuid
from decimal import Decimal
from pathlib import Path

import pytest

from exporter.demo import write_kernel
from exporter.sdnotify import notify


@pytest.fixture
def manager(tmp_path: Path):
    """A unix datagram socket standing in for systemd's notify socket."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(30)
    yield sock, str(tmp_path / "notify")
    sock.close()


def test_a_message_reaches_the_socket_by_path_or_abstract_name(manager) -> None:
    sock, path = manager
    assert notify("READY=1", {"NOTIFY_SOCKET": path})
    assert sock.recv(100) == b"READY=1"
    name = f"gpu-alloc-test-{uuid.uuid4()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as abstract:
        abstract.bind("\0" + name)
        assert notify("STOPPING=1", {"NOTIFY_SOCKET": "@" + name})
        assert abstract.recv(100) == b"STOPPING=1"


def test_no_manager_or_a_gone_one_costs_nothing(tmp_path: Path) -> None:
    assert not notify("READY=1", {})
    assert not notify("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "gone")})  # nobody listens: no exception
    assert not notify("READY=1", {"NOTIFY_SOCKET": "vsock:2:1234"})  # a transport this exporter does not speak


def test_the_exporter_says_ready_once_ready_answers_200_and_stopping_on_sigterm(manager, tmp_path: Path) -> None:
    sock, path = manager
    root = tmp_path / "scratch"
    for i in range(3):
        write_kernel(root, f"k{i}", {"cuda.shares": {"GPU-a": Decimal("0.25")}})
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "exporter", "--scratch.root", str(root), "--telemetry.source", "none",
         "--web.listen-address", f"127.0.0.1:{port}"],
        env={**os.environ, "NOTIFY_SOCKET": path}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        message = sock.recv(4096).decode().split("\n")
        assert message[0] == "READY=1" and message[1].startswith("STATUS=serving on port") and "3 kernels" in message[1]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/-/ready")
        assert conn.getresponse().status == 200  # already, with no wait
        conn.close()
        proc.send_signal(signal.SIGTERM)
        assert sock.recv(4096) == b"STOPPING=1"
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
