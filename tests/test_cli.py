"""The command line, end to end: a real process on port 0, real HTTP, friendly errors."""

from __future__ import annotations

import dataclasses
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
from processes import Running, require_tool

from exporter.cli import main
from exporter.demo import write_kernel

SAMPLES = sorted((Path(__file__).parent / "fixtures" / "resources").glob("*.txt"))


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
        lint = subprocess.run([require_tool("promtool"), "check", "metrics"], input=body, capture_output=True)
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


GEOMETRIES_BAD_YAML = "knownMigGeometries: [unclosed\n"
GEOMETRIES_BAD_COUNT = "- models: [A30]\n  allowedGeometries: [[{name: 1g.6gb, memory: 5836, count: lots}]]\n"
STATE_BAD_CAPACITY = json.dumps({"slots": {"cuda.shares": [{"device_id": "GPU-a", "capacity": "abc", "allocated": "0"}]}})
STATE_NO_CAPACITY = json.dumps({"node_state": {"slots": {"cuda.shares": [{"device_id": "GPU-a", "allocated": "0"}]}}})
STATE_EMPTY = json.dumps({"slots": {}})

# Every mistake a newcomer makes on the command line: (argv, files to write, what the one line must say).
# {root} is an empty scratch root, {tmp} a directory for the files.
MISTAKES = [
    (["scan", "--capacity.override", "GPU-x=abc"], {}, ["--capacity.override 'GPU-x=abc'", "SHARES must be a finite, non-negative number"]),
    (["scan", "--capacity.override", "GPU-x=-1"], {}, ["--capacity.override 'GPU-x=-1'", "non-negative"]),
    (["serve", "--capacity.override", "GPU-x"], {}, ["--capacity.override 'GPU-x'", "expected DEVICE_ID=SHARES"]),
    (["scan", "--headroom.request", "cuda.shares"], {}, ["--headroom.request 'cuda.shares'", "expected SLOT=AMOUNT"]),
    (["scan", "--headroom.request", "cuda.shares=abc"], {}, ["--headroom.request 'cuda.shares=abc'", "not a number"]),
    (["serve", "--headroom.request", "cuda.shares=-2"], {}, ["--headroom.request 'cuda.shares=-2'", "positive"]),
    (["scan", "--headroom.request", "cuda.shares=1e30"], {}, ["--headroom.request 'cuda.shares=1e30'", "out of range"]),
    (["scan", "--mig.geometries-file", "{tmp}/missing.yaml"], {}, ["{tmp}/missing.yaml: cannot be read", "(set --mig.geometries-file)"]),
    (["serve", "--mig.geometries-file", "{tmp}/g.yaml"], {"g.yaml": GEOMETRIES_BAD_YAML}, ["--mig.geometries-file {tmp}/g.yaml", "not valid YAML at line 2"]),
    (["scan", "--mig.geometries-file", "{tmp}/g.yaml"], {"g.yaml": GEOMETRIES_BAD_COUNT}, ["entry 1, allowed geometry 1", "whole numbers"]),
    (["scan", "--mig.geometries-file", "{tmp}/g.yaml"], {"g.yaml": "nvidia: {}\n"}, ["{tmp}/g.yaml", "no knownMigGeometries list"]),
    (["simulate", "--request", "cuda.shares=1", "--state", "{tmp}/s.json"], {"s.json": "{}"}, ["--state {tmp}/s.json", "no slots"]),
    (["simulate", "--request", "cuda.shares=1", "--state", "{tmp}/s.json"], {"s.json": "{"}, ["--state {tmp}/s.json", "not JSON"]),
    (["simulate", "--request", "cuda.shares=1", "--state", "{tmp}/s.json"], {"s.json": STATE_BAD_CAPACITY}, ["--state {tmp}/s.json", "slots['cuda.shares'][0].capacity is not"]),
    (["simulate", "--request", "cuda.shares=1", "--state", "{tmp}/s.json"], {"s.json": STATE_NO_CAPACITY}, ["--state {tmp}/s.json", "has no 'capacity'"]),
    (["simulate", "--request", "cuda.shares=1", "--state", "{tmp}/s.json"], {"s.json": STATE_EMPTY}, ["--state {tmp}/s.json", "no devices"]),
    (["simulate", "--request", "cuda.shares=1", "--state", "{tmp}/missing.json"], {}, ["--state {tmp}/missing.json", "cannot read the file"]),
    (["simulate", "--request", "nonsense", "--state", "{tmp}/missing.json"], {}, ["--request 'nonsense'", "expected SLOT=AMOUNT"]),
    (["simulate", "--request", "cuda.shares=1", "--telemetry.source", "none"], {},
     ["no devices to place cuda.shares", "--telemetry.source mock --telemetry.mock-file FILE", "--capacity.override DEVICE_ID=SHARES", "--state FILE"]),
    (["simulate", "--state", "{tmp}/s.json"], {}, ["--request", "required"]),
    (["simulate", "--request", "cuda.shares=1", "--policy", "fastest"], {}, ["--policy: invalid choice: 'fastest'", "evenly"]),
    (["scan", "--output", "xml"], {}, ["--output: invalid choice: 'xml'", "table"]),
    (["scan", "--no-such-flag"], {}, ["unrecognized arguments: --no-such-flag"]),
    (["scna"], {}, ["unknown command 'scna'", "serve, demo, scan, simulate"]),
    (["serve", "--scratch.root", "/nonexistent/scratch"], {}, ["scratch root /nonexistent/scratch is not a directory", "--scratch.root"]),
    (["serve", "--telemetry.source", "bogus"], {}, ["--telemetry.source: Input should be 'auto', 'nvml', 'mock' or 'none'"]),
    (["serve", "--telemetry.source", "mock"], {}, ["--telemetry.source=mock needs --telemetry.mock-file"]),
    (["serve", "--telemetry.source", "mock", "--telemetry.mock-file", "{tmp}/missing.toml"], {}, ["{tmp}/missing.toml", "cannot read"]),
    (["serve", "--web.listen-address", "nonsense"], {}, ["--web.listen-address", "listen address 'nonsense' is not host:port"]),
    (["serve", "--scratch.rescan-interval", "-1"], {}, ["--scratch.rescan-interval: Input should be greater than 0"]),
    (["scan", "--capacity.quantum", "abc"], {}, ["--capacity.quantum", "decimal"]),
    (["scan", "--scratch.max-file-bytes"], {}, ["--scratch.max-file-bytes: expected one argument"]),
    (["scan", "--config.file", "{tmp}/c.toml"], {"c.toml": "[scratch]\nrescan-interval = -1\n"}, ["{tmp}/c.toml: --scratch.rescan-interval", "greater than 0"]),
    (["scan", "--config.file", "{tmp}/c.toml"], {"c.toml": "[scratch]\nrooot = 1\n"}, ["{tmp}/c.toml", "unknown setting 'scratch.rooot'"]),
    (["scan", "--config.file", "{tmp}/c.yml"], {"c.yml": "scratch: [\n"}, ["{tmp}/c.yml", "not valid YAML"]),
    (["scan", "--config.file", "{tmp}/missing.yml"], {}, ["{tmp}/missing.yml", "No such file"]),
]


def _exit_status(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own errors
        return int(exc.code)


def assert_one_clear_line(err: str, *needles: str) -> None:
    """Exactly one line on stderr, naming the flag or file and the reason, and no Python in it."""
    assert err.endswith("\n") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, (needle, err)
    for python in ("class", "Error(", "Traceback", "Errno", "<class", "KeyError", "ValueError"):
        assert python not in err, (python, err)


@pytest.mark.parametrize(("argv", "files", "needles"), MISTAKES, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_every_mistake_is_one_line_and_exit_2(argv, files, needles, capsys, tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if "--scratch.root" not in argv and "--config.file" not in argv and argv[0] != "scna":
        argv = [argv[0], "--scratch.root", str(root), *argv[1:]]
    if argv[0] == "serve" or argv[0] == "scna":
        argv = argv[1:] if argv[0] == "serve" else argv
        argv += ["--web.listen-address", "127.0.0.1:0"] if "--web.listen-address" not in argv else []
    capsys.readouterr()
    assert _exit_status(argv) == 2
    assert_one_clear_line(capsys.readouterr().err, *(n.replace("{tmp}", str(tmp_path)) for n in needles))


def test_a_bad_environment_variable_is_named(capsys, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPU_ALLOC_EXPORTER_TELEMETRY_PCIE", "maybe")
    assert main(["scan", "--scratch.root", str(tmp_path)]) == 2
    assert_one_clear_line(capsys.readouterr().err, "GPU_ALLOC_EXPORTER_TELEMETRY_PCIE: --telemetry.pcie", "valid boolean")


def test_a_forced_nvml_source_that_cannot_start_is_exit_2_and_auto_falls_back(capsys, tmp_path: Path) -> None:
    from exporter.telemetry.model import NullSource
    from exporter.telemetry.nvml.simulated import FakeNvml
    from exporter.telemetry.sources import open_source

    with FakeNvml.dgx_a100().installed() as machine:
        machine.unload_driver()  # the kernel module is not loaded: nvmlInit fails
        argv = ["--scratch.root", str(tmp_path), "--web.listen-address", "127.0.0.1:0", "--telemetry.source", "nvml"]
        assert main(argv) == 2
        assert_one_clear_line(capsys.readouterr().err, "--telemetry.source nvml: NVML does not start", "use auto")
        assert main(["simulate", "--scratch.root", str(tmp_path), "--telemetry.source", "nvml", "--request", "cuda.shares=1"]) == 2
        assert_one_clear_line(capsys.readouterr().err, "--telemetry.source nvml: NVML does not start")
        assert isinstance(open_source("auto"), NullSource)


def test_a_closed_output_pipe_is_not_an_error(tmp_path: Path) -> None:
    # Enough kernels that the JSON is far larger than a pipe's buffer: the writer meets a closed pipe.
    for i in range(400):
        write_kernel(tmp_path, f"{i:08d}-0000-4000-8000-000000000000",
                     {"cuda.shares": {"GPU-c59395cd-ac91-4cd3-a1b0-3d2568aa2d04": Decimal("0.01")}})
    proc = subprocess.Popen([sys.executable, "-m", "exporter", "scan", "--scratch.root", str(tmp_path), "--output", "json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()  # what `| head -1` does: read a little, then go away
    proc.stdout.close()
    err = proc.stderr.read()
    proc.stderr.close()
    assert proc.wait(30) == 0 and err == b""


def test_nested_config_keys_are_settings(tmp_path: Path, capsys) -> None:
    from exporter.settings import Settings, load_config_file

    toml = tmp_path / "exporter.toml"
    toml.write_text(f'[scratch]\nroot = ["{tmp_path}"]\nrescan-interval = 30\n[web.config]\nfile = "/etc/web.yml"\n[log]\nlevel = "debug"\n')
    yml = tmp_path / "exporter.yml"
    yml.write_text(f"scratch:\n  root: [{tmp_path}]\n  rescan-interval: 30\nweb.config.file: /etc/web.yml\nlog: {{level: debug}}\n")
    for path in (toml, yml):
        s = Settings.load({}, path)
        assert (s.scratch_roots, s.scratch_rescan_interval, s.log_level) == ([tmp_path], 30.0, "debug")
        assert str(s.web_config_file) == "/etc/web.yml"
        assert load_config_file(path)["scratch_roots"] == [str(tmp_path)]
    toml.write_text(f'[scratch]\nroot = ["{tmp_path}"]\n')
    assert main(["scan", "--config.file", str(toml)]) == 0
    assert "kernels: ok 0" in capsys.readouterr().out


def test_help_names_the_commands_whole_placeholders_and_allowed_values(capsys) -> None:
    from exporter.cli import COMMANDS, literal_choices
    from exporter.settings import FIELDS

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    usage = out.split("\n\n")[0]
    flat = " ".join(out.split())  # help lines wrap at the terminal's width
    for command in COMMANDS:
        assert f"gpu-alloc-exporter {command}" in usage or f"[{command}]" in usage
    for name, field in FIELDS.items():
        flag = field.flag
        assert flag in out and f"env {name.upper()}" in flat, flag
        choices = literal_choices(field.annotation)
        if choices:
            assert f"{flag} {{{','.join(choices)}}}" in out
    pairs = re.findall(r"^ +(--[\w.-]+) ([A-Z[][A-Z_=:\[\]]*)", out, re.MULTILINE)
    assert {"DIR", "FILE", "SECONDS", "BYTES", "[HOST]:PORT", "DEVICE_ID=SHARES", "SLOT=AMOUNT"} <= {m for _, m in pairs}
    # No placeholder is a word cut short (ADDRE, BYTE, PROCF).
    cut = [(f, m) for f, m in pairs if (w := f.rsplit(".", 1)[-1].upper().replace("-", "_")).startswith(m) and w != m]
    assert not cut
    assert "GPU_ALLOC_EXPORTER_SCRATCH_ROOTS" in flat  # the rule for environment variables, with an example


@pytest.mark.parametrize(("command", "shown", "hidden"), [
    ("scan", ["--output", "--scratch.root"], ["--capacity.override", "--web.listen-address"]),
    ("simulate", ["--request", "--policy {evenly,", "--state FILE", "--capacity.override"], ["--web.config.file", "--attribution.process-detail"]),
    ("demo", ["--demo.dir DIR", "--web.listen-address"], ["--capacity.override", "--scratch.root"]),
])
def test_each_command_has_short_help_of_its_own_flags(command, shown, hidden, capsys) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert out.startswith(f"usage: gpu-alloc-exporter {command}")
    assert all(s in out for s in shown) and not any(h in out for h in hidden)
    assert out.count("\n") < 90
    # Hidden flags are still accepted: one config file serves every command.
    with pytest.raises(SystemExit):
        main(["help", command])
    assert capsys.readouterr().out == out


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


# -- settings: the coercion and checks that Settings.load does by hand --------------------------


@pytest.mark.parametrize(("variable", "text", "field", "expected"), [
    ("TELEMETRY_PCIE", "yes", "telemetry_pcie", True),
    ("TELEMETRY_PCIE", "Off", "telemetry_pcie", False),
    ("TELEMETRY_PCIE", "1", "telemetry_pcie", True),
    ("STALE_GRACE", " 12.5 ", "stale_grace", 12.5),
    ("TELEMETRY_INTERVAL", "1e1", "telemetry_interval", 10.0),
    ("SCRATCH_MAX_FILE_BYTES", "2.0", "scratch_max_file_bytes", 2),
    ("CAPACITY_QUANTUM", "0.05", "capacity_quantum", Decimal("0.05")),
    ("SCRATCH_ROOTS", "/a,,/b", "scratch_roots", [Path("/a"), Path("/b")]),
    ("SCRATCH_ROOTS", '["/a", "/b,c"]', "scratch_roots", [Path("/a"), Path("/b,c")]),
    ("HEADROOM_REQUESTS", "cuda.shares=1,cuda.device=2", "headroom_requests", ["cuda.shares=1", "cuda.device=2"]),
    ("AGENT_CONFIG_FILE", "/etc/agent.toml", "agent_config_file", Path("/etc/agent.toml")),
])
def test_environment_values_are_coerced(variable, text, field, expected, monkeypatch) -> None:
    from exporter.settings import Settings

    monkeypatch.setenv(f"GPU_ALLOC_EXPORTER_{variable}", text)
    settings = Settings.load({})
    assert getattr(settings, field) == expected and type(getattr(settings, field)) is type(expected)
    assert settings.given == {field}


@pytest.mark.parametrize(("variable", "text", "message"), [
    ("TELEMETRY_PCIE", "maybe", "--telemetry.pcie: Input should be a valid boolean, unable to interpret input"),
    ("STALE_GRACE", "soon", "--stale.grace: Input should be a valid number, unable to parse string as a number"),
    ("STALE_GRACE", "-1", "--stale.grace: Input should be greater than or equal to 0"),
    ("ATTRIBUTION_IDLE_THRESHOLD_RATIO", "2", "--attribution.idle-threshold-ratio: Input should be less than or equal to 1"),
    ("SCRATCH_MAX_FILE_BYTES", "1.5", "--scratch.max-file-bytes: Input should be a valid integer, unable to parse string as an integer"),
    ("CAPACITY_QUANTUM", "nan", "--capacity.quantum: Input should be a finite number"),
    ("LOG_LEVEL", "loud", "--log.level: Input should be 'debug', 'info', 'warning' or 'error'"),
    ("SCRATCH_ROOTS", "[/a", "--scratch.root: Input should be a JSON list or comma-separated values"),
    ("SCRATCH_ROOTS", "[1]", "--scratch.root: Input is not a valid path"),
])
def test_a_bad_environment_value_names_the_variable_flag_and_reason(variable, text, message, monkeypatch) -> None:
    from exporter.settings import ConfigError, Settings

    monkeypatch.setenv(f"GPU_ALLOC_EXPORTER_{variable}", text)
    with pytest.raises(ConfigError) as caught:
        Settings.load({})
    assert str(caught.value).startswith(f"GPU_ALLOC_EXPORTER_{variable}: {message}")
    assert "\n" not in str(caught.value) and "class" not in str(caught.value)


def test_every_bad_value_is_reported_in_declaration_order_naming_its_source(tmp_path: Path, monkeypatch) -> None:
    from exporter.settings import ConfigError, Settings

    cfg = tmp_path / "c.yml"
    cfg.write_text("scratch.max-file-bytes: 3.5\nagent.id: 123\nweb.listen-address: nonsense\n")
    monkeypatch.setenv("GPU_ALLOC_EXPORTER_STALE_GRACE", "-1")
    with pytest.raises(ConfigError) as caught:
        Settings.load({"telemetry_source": "bogus"}, cfg)
    assert str(caught.value) == "; ".join([
        f"{cfg}: --scratch.max-file-bytes: Input should be a valid integer, got a number with a fractional part",
        f"{cfg}: --web.listen-address: listen address 'nonsense' is not host:port",
        "--telemetry.source: Input should be 'auto', 'nvml', 'mock' or 'none'",
        "GPU_ALLOC_EXPORTER_STALE_GRACE: --stale.grace: Input should be greater than or equal to 0",
        f"{cfg}: --agent.id: Input should be a valid string",
    ])


def test_precedence_is_flags_then_environment_then_file_then_defaults(tmp_path: Path, monkeypatch) -> None:
    from exporter.settings import Settings

    cfg = tmp_path / "c.toml"
    cfg.write_text('[stale]\ngrace = 5\n[telemetry]\ninterval = 7\ntimeout = 0.5\n[log]\nlevel = "debug"\n')
    monkeypatch.setenv("GPU_ALLOC_EXPORTER_TELEMETRY_INTERVAL", "8")
    monkeypatch.setenv("gpu_alloc_exporter_stale_grace", "6")  # variable names match in any case
    s = Settings.load({"stale_grace": "9", "log_level": "error"}, cfg)
    assert (s.stale_grace, s.telemetry_interval, s.telemetry_timeout, s.log_level, s.scratch_poll_interval) == (9.0, 8.0, 0.5, "error", 2.0)
    assert s.given == {"stale_grace", "telemetry_interval", "telemetry_timeout", "log_level"}
    # A value the environment overrides is not checked: only the one used can be wrong.
    cfg.write_text("[telemetry]\ninterval = -1\n")
    assert Settings.load({}, cfg).telemetry_interval == 8.0


def test_unknown_config_keys_and_combinations_are_refused(tmp_path: Path) -> None:
    from exporter.settings import ConfigError, Settings

    cfg = tmp_path / "c.yml"
    for text, message in [
        ("scratch:\n  root: [/x]\n  bogus: 1\n", f"{cfg}: unknown setting 'scratch.bogus'"),
        ("scratch.root: []\n", "at least one --scratch.root is needed"),
        ("telemetry.source: mock\n", "--telemetry.source=mock needs --telemetry.mock-file"),
    ]:
        cfg.write_text(text)
        with pytest.raises(ConfigError) as caught:
            Settings.load({}, cfg)
        assert str(caught.value) == message


def test_copies_and_direct_construction_record_what_was_given() -> None:
    from exporter.settings import Settings

    s = Settings(scratch_roots=[Path("/q")], telemetry_source="none")
    assert s.given == {"scratch_roots", "telemetry_source"} and s.telemetry_interval == 5.0
    c = dataclasses.replace(s, stale_grace=1.0, given=s.given | {"stale_grace"})
    assert c.stale_grace == 1.0 and s.stale_grace == 300.0 and c.scratch_roots == [Path("/q")]
    assert c.given == {"scratch_roots", "telemetry_source", "stale_grace"}
    assert Settings().scratch_roots is not Settings().scratch_roots  # a default list is never shared
    with pytest.raises(TypeError, match="no_such"):
        Settings(no_such=1)


def test_starting_does_not_import_pydantic() -> None:
    """pydantic (~20 MiB, ~0.15 s) is imported only to read a --web.config.file."""
    code = ("import sys, exporter.cli, exporter.app, exporter.web.server; assert 'pydantic' not in sys.modules; "
            "from exporter.web.webconfig import parse_web_config; parse_web_config('{}'); assert 'pydantic' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


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
    assert {"cuda.shares", "cpu", "mem"} <= slots and any(s.endswith("-mig") for s in slots)
    assert "cuda.mem" not in slots  # no current plugin writes it
    # Devices through NVML (the simulated library), processes attributed through the simulated /proc.
    assert 'gpu_alloc_collector_success{collector="nvml"} 1.0' in metrics
    assert "gpu_alloc_kernel_utilization_ratio{" in metrics and 'reason="host"' in metrics
    assert (tmp_path / "d" / "proc").is_dir() and list((tmp_path / "d" / "cgroup" / "system.slice").glob("docker-*.scope"))
    recovery = next((tmp_path / "d" / "scratches").glob("*/config/recovery.json"))
    assert json.loads(recovery.read_text())["agent_id"] == "i-demo-dgx01"


def test_demo_with_mock_devices_builds_a_still_tree_and_serves_it(tmp_path: Path) -> None:
    from exporter.telemetry.mock import DEMO_DEVICES_FILE

    _, alloc, state, metrics = _run_demo("--demo.dir", str(tmp_path / "d"), "--telemetry.mock-file", str(DEMO_DEVICES_FILE))
    assert len(alloc) >= 4
    # The device file is served (no --telemetry.source needed): capacity and the gaps in headroom.
    assert 'gpu_alloc_node_headroom{fragmentation="disallowed",slot="cuda.shares"} 14.51' in metrics
    assert 'gpu_alloc_node_headroom_contiguous{fragmentation="disallowed",slot="cuda.shares"} 9.5' in metrics
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
