"""The command line, end to end: a real process on port 0, real HTTP, friendly errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from decimal import Decimal
from pathlib import Path

import pytest
from backendai_reference import WITH_CUDA_MEM, scan_gpu_alloc_map
from helpers import wait_for

from exporter.cli import main
from exporter.demo import write_kernel

SAMPLES = sorted((Path(__file__).parent / "fixtures" / "resources").glob("*.txt"))


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


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    root = tmp_path / "scratch"
    for i, sample in enumerate(SAMPLES):
        d = root / f"{i:08d}-0000-4000-8000-000000000000" / "config"
        d.mkdir(parents=True)
        (d / "resource.txt").write_text(sample.read_text())
    return root


def test_serve_end_to_end_matches_backendai_and_follows_live_changes(scratch: Path) -> None:
    ex = Running("--scratch.root", str(scratch), "--web.listen-address", "127.0.0.1:0", "--telemetry.source", "none")
    try:
        assert ex.get("/-/ready")[0] == 200
        assert ex.get("/-/healthy")[0] == 200
        status, body, _ = ex.get("/api/v1/alloc-map")
        texts = [s.read_text() for s in SAMPLES]
        assert status == 200 and json.loads(body) == scan_gpu_alloc_map(texts, WITH_CUDA_MEM)

        write_kernel(scratch, "new-kernel", {"cuda.shares": {"GPU-c59395cd-ac91-4cd3-a1b0-3d2568aa2d04": Decimal("0.25")}})
        wait_for(lambda: json.loads(ex.get("/api/v1/alloc-map")[1]).get("GPU-c59395cd-ac91-4cd3-a1b0-3d2568aa2d04") == "0.58")
        shutil.rmtree(scratch / "new-kernel")
        wait_for(lambda: json.loads(ex.get("/api/v1/alloc-map")[1]) == scan_gpu_alloc_map(texts, WITH_CUDA_MEM))

        status, body, headers = ex.get("/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
        assert b'gpu_alloc_kernels{state="ok"} 13.0' in body
        if shutil.which("promtool"):
            lint = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True)
            assert lint.returncode == 0, lint.stderr.decode()
        status, gz, headers = ex.get("/metrics", {"Accept-Encoding": "gzip"})
        assert headers.get("Content-Encoding") == "gzip"
        import gzip as _gz
        assert _gz.decompress(gz) == ex.get("/metrics")[1]

        state = json.loads(ex.get("/api/v1/state")[1])
        assert len(state["kernels"]) == 13 and state["alloc_map"] == scan_gpu_alloc_map(texts, WITH_CUDA_MEM)
        assert all("MOUNTS" not in json.dumps(k) for k in state["kernels"])
        assert ex.get("/nope")[0] == 404
    finally:
        assert ex.stop() == 0


def test_a_silent_client_does_not_block_scrapes(scratch: Path) -> None:
    ex = Running("--scratch.root", str(scratch), "--web.listen-address", "127.0.0.1:0", "--telemetry.source", "none")
    silent = socket.create_connection(("127.0.0.1", ex.port))
    try:
        for _ in range(20):
            assert ex.get("/metrics")[0] == 200
    finally:
        silent.close()
        assert ex.stop() == 0


def test_environment_variables_configure_the_exporter(scratch: Path) -> None:
    ex = Running(env={"GPU_ALLOC_EXPORTER_SCRATCH_ROOTS": str(scratch), "GPU_ALLOC_EXPORTER_WEB_LISTEN_ADDRESS": "127.0.0.1:0",
                      "GPU_ALLOC_EXPORTER_TELEMETRY_SOURCE": "none", "GPU_ALLOC_EXPORTER_AGENT_ID": "i-agent"})
    try:
        assert b'agent_id="i-agent"' in ex.get("/metrics")[1]
    finally:
        assert ex.stop() == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--scratch.root", "/nonexistent/scratch"], "scratch root /nonexistent/scratch is not a directory"),
        (["--telemetry.source", "bogus"], "--telemetry.source: Input should be 'auto', 'nvml', 'mock' or 'none'"),
        (["--telemetry.source", "mock"], "--telemetry.source=mock needs --telemetry.mock-file"),
        (["--web.listen-address", "nonsense"], "listen address 'nonsense' is not host:port"),
        (["--scratch.rescan-interval", "-1"], "--scratch.rescan-interval: Input should be greater than 0"),
    ],
)
def test_bad_configuration_is_one_line_and_exit_2(argv, message, capsys, tmp_path: Path) -> None:
    if "--scratch.root" not in argv:
        argv = ["--scratch.root", str(tmp_path), *argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_port_in_use_is_exit_2(tmp_path: Path, capsys) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["--scratch.root", str(tmp_path), "--web.listen-address", f"127.0.0.1:{port}", "--telemetry.source", "none"]) == 2
    assert "is already in use" in capsys.readouterr().err


def test_config_file_and_precedence(tmp_path: Path, capsys, monkeypatch) -> None:
    cfg = tmp_path / "exporter.yml"
    cfg.write_text(f"scratch.root: [{tmp_path}]\nlog.level: debug\ntelemetry.source: none\n")
    monkeypatch.setenv("GPU_ALLOC_EXPORTER_LOG_LEVEL", "warning")
    from exporter.settings import Settings

    s = Settings.load({"telemetry_source": "mock", "telemetry_mock_file": "x.toml"}, cfg)
    assert s.scratch_roots == [tmp_path] and s.log_level == "warning" and s.telemetry_source == "mock"
    cfg.write_text("no.such.setting: 1\n")
    assert main(["--config.file", str(cfg)]) == 2
    assert "unknown setting 'no.such.setting'" in capsys.readouterr().err


def test_help_shows_every_flag_with_its_environment_variable(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for flag, env in [("--scratch.root", "GPU_ALLOC_EXPORTER_SCRATCH_ROOTS"), ("--web.listen-address", "GPU_ALLOC_EXPORTER_WEB_LISTEN_ADDRESS"),
                      ("--telemetry.source", "GPU_ALLOC_EXPORTER_TELEMETRY_SOURCE"), ("--log.format", "GPU_ALLOC_EXPORTER_LOG_FORMAT")]:
        assert flag in out and env in out


def test_scan_prints_a_table_and_json(scratch: Path, capsys) -> None:
    assert main(["scan", "--scratch.root", str(scratch)]) == 0
    out = capsys.readouterr().out
    assert "GPU-c59395cd-ac91-4cd3-a1b0-3d2568aa2d07" in out and "kernels: ok 13" in out
    assert main(["scan", "--scratch.root", str(scratch), "--output", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["alloc_map"] == scan_gpu_alloc_map([s.read_text() for s in SAMPLES], WITH_CUDA_MEM)


def _run_demo(*args: str) -> tuple[list[str], dict, dict, str]:
    """Start ``demo``, read what it prints until it is ready, fetch the alloc map, state and
    metrics, stop it. Returns (printed lines, alloc map, state, metrics)."""
    proc = subprocess.Popen([sys.executable, "-m", "exporter", "demo", "--web.listen-address", "127.0.0.1:0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        printed = []
        for line in proc.stdout:
            printed.append(line.rstrip("\n"))
            if line.startswith("Press Ctrl-C"):
                break
        urls = [line.strip() for line in printed if line.strip().startswith("http://")]
        get = lambda suffix: urllib.request.urlopen(next(u for u in urls if u.endswith(suffix)), timeout=5).read()  # noqa: E731
        alloc, state, metrics = json.loads(get("/alloc-map")), json.loads(get("/state")), get("/metrics").decode()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        proc.stdout.close()
    return printed, alloc, state, metrics


def test_demo_is_a_living_node_and_says_what_will_happen(tmp_path: Path) -> None:
    printed, alloc, state, metrics = _run_demo("--demo.dir", str(tmp_path / "d"), "--seed", "3")
    text = "\n".join(printed)
    assert "seed 3" in text and "planned:" in text and "+1:00  GPU 5 falls off the bus" in text
    assert len(alloc) >= 3 and state["kernel_states"]["ok"] >= 10
    slots = {a["slot"] for k in state["kernels"] for a in k["allocations"]}
    assert {"cuda.shares", "cuda.mem", "cpu", "mem"} <= slots and any(s.endswith("-mig") for s in slots)
    # Devices through NVML (the simulated library), processes attributed through the simulated /proc.
    assert 'gpu_alloc_collector_success{collector="nvml"} 1.0' in metrics
    assert "gpu_alloc_kernel_utilization_ratio{" in metrics and 'reason="host"' in metrics
    assert (tmp_path / "d" / "proc").is_dir() and list((tmp_path / "d" / "cgroup" / "system.slice").glob("docker-*.scope"))
    recovery = next((tmp_path / "d" / "scratches").glob("*/config/recovery.json"))
    assert json.loads(recovery.read_text())["agent_id"] == "i-demo-dgx01"


def test_demo_with_mock_devices_builds_a_still_tree_and_serves_it(tmp_path: Path) -> None:
    from exporter.telemetry.mock import DEMO_DEVICES_FILE

    _, alloc, state, _ = _run_demo("--demo.dir", str(tmp_path / "d"), "--telemetry.mock-file", str(DEMO_DEVICES_FILE))
    assert len(alloc) >= 4
    states = state["kernel_states"]
    assert states["ok"] >= 10 and states["pending"] == 1
    slots = {a["slot"] for k in state["kernels"] for a in k["allocations"]}
    assert {"cuda.shares", "cpu", "mem"} <= slots and any(s.endswith("-mig") for s in slots)
    assert any(a["amount"] == "13.50" for k in state["kernels"] for a in k["allocations"])  # a whole GPU
    assert any(not [a for a in k["allocations"] if "." in a["slot"]] and k["state"] == "ok" for k in state["kernels"])


def test_simulate_on_a_saved_state_reproduces_the_evenly_allocator(tmp_path: Path, capsys) -> None:
    state = {"node_state": {"quantum": "0.01", "nofrag_rule": "26.4", "slots": {"cuda.shares": [
        {"device_id": "GPU-a", "capacity": "1", "allocated": "0"},
        {"device_id": "GPU-b", "capacity": "1", "allocated": "0"}]}}}
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state))
    assert main(["simulate", "--state", str(path), "--request", "cuda.shares=1.2", "--output", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["placement"] == {"GPU-a": "0.60", "GPU-b": "0.60"}
    assert main(["simulate", "--state", str(path), "--request", "cuda.shares=2.5"]) == 1
    assert "rejected" in capsys.readouterr().out
    assert main(["simulate", "--state", str(path), "--request", "nonsense"]) == 2


def test_simulate_live_and_over_http(tmp_path: Path, capsys) -> None:
    from exporter.demo import build_demo_tree
    from exporter.telemetry.mock import DEMO_DEVICES_FILE

    build_demo_tree(tmp_path / "s")
    argv = ["--scratch.root", str(tmp_path / "s"), "--telemetry.source", "mock", "--telemetry.mock-file", str(DEMO_DEVICES_FILE)]
    assert main(["simulate", *argv, "--request", "cuda.shares=2", "--output", "json"]) == 0
    live = json.loads(capsys.readouterr().out)
    ex = Running(*argv, "--web.listen-address", "127.0.0.1:0")
    try:
        status, body, _ = ex.get("/api/v1/simulate?request=cuda.shares=2")
        assert status == 200 and json.loads(body)["placement"] == live["placement"]
        assert ex.get("/api/v1/simulate?request=bogus")[0] == 400
        saved = tmp_path / "saved.json"
        saved.write_bytes(ex.get("/api/v1/state")[1])
    finally:
        assert ex.stop() == 0
    assert main(["simulate", "--state", str(saved), "--request", "cuda.shares=2", "--output", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["placement"] == live["placement"]


def test_a_root_that_cannot_be_stat_ed_is_one_line_and_exit_2(tmp_path: Path, monkeypatch, capsys) -> None:
    """EACCES on a parent directory (root itself is exempt, so the denial is injected at os.stat)."""
    import os

    from exporter import cli

    root = tmp_path / "locked" / "scratches"
    real_stat = os.stat

    def stat(path, *args, **kwargs):
        if Path(path) == root:
            raise PermissionError(13, "Permission denied", str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    assert cli.main(["--scratch.root", str(root), "--telemetry.source", "none", "--web.listen-address", "127.0.0.1:0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"gpu-alloc-exporter: scratch root {root} cannot be read: Permission denied (set --scratch.root)"]
