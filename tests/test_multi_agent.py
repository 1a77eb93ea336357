"""Multi-agent hosts end to end: a real exporter on a node with two agents, and a real
``gpu-alloc-exporter`` process started from nothing but agent.toml."""

from __future__ import annotations

import json
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest
from helpers import GOLDEN
from processes import Running

from exporter.app import Exporter
from exporter.cli import main
from exporter.config import resolve
from exporter.demo import write_kernel, write_recovery
from exporter.settings import Settings
from exporter.web.server import Request

NOW = 1_700_000_000.0
GOLDEN_FILE = GOLDEN / "multi-agent.prom"
K = [f"{i}a000000-0000-4000-8000-00000000000{i}" for i in range(1, 5)]
SESSION = "b0a4e7c2-5d1f-4e6a-8c3b-2f9d7e1a6b4c"
DEV = ["GPU-0", "GPU-1"]


def agent_toml(shared: Path, own_b: Path, mode: str = "auto-split") -> str:
    return f"""
[agent]
backend = "docker"
[container]
scratch-root = "{shared}"
[resource]
allocation-mode = "{mode}"
[[agents]]
[agents.agent]
id = "i-node01-a"
[[agents]]
[agents.agent]
id = "i-node01-b"
[[agents]]
[agents.agent]
id = "i-node01-c"
[agents.container]
scratch-root = "{own_b}"
"""


def build(tmp: Path) -> tuple[Path, Path]:
    """Agents a and b share one root (split by recovery.json); agent c has its own root."""
    shared, own = tmp / "scratches", tmp / "scratches-c"
    write_kernel(shared, K[0], {"cuda.shares": {DEV[0]: Decimal("0.5")}})
    write_kernel(shared, K[1], {"cuda.shares": {DEV[0]: Decimal("0.25"), DEV[1]: Decimal(1)}})
    write_kernel(own, K[2], {"cuda.shares": {DEV[1]: Decimal("2")}})
    write_kernel(own, K[3], {"cuda.device": {DEV[0]: Decimal(1)}})
    write_recovery(shared, K[0], SESSION, None, agent_id="i-node01-a")
    write_recovery(shared, K[1], SESSION, None, agent_id="i-node01-b")
    return shared, own


def exporter_for(tmp: Path, **flags) -> Exporter:
    shared, own = build(tmp)
    settings = Settings.load({"telemetry_source": "none", "telemetry_interval": 3600, "path_cgroupfs": str(tmp / "none"),
                              "capacity_overrides": [f"{DEV[0]}=4", f"{DEV[1]}=4"], "headroom_mode": "fractional", **flags})
    (tmp / "agent.toml").write_text(agent_toml(shared, own))
    config = resolve(settings, agent_config=tmp / "agent.toml", hostname="node01")
    return Exporter(config, clock=lambda: NOW, monotonic=lambda: NOW)


def get(exporter: Exporter, query: str) -> tuple[int, object]:
    from urllib.parse import parse_qs

    r = exporter.handle(Request("GET", "/api/v1/alloc-map", parse_qs(query), {}))
    body = r.body.decode()
    return r.status, (json.loads(body) if r.status == 200 else body)


def test_each_agent_gets_its_own_alloc_map(tmp_path: Path) -> None:
    exporter = exporter_for(tmp_path)
    exporter.start()
    try:
        status, maps = get(exporter, "")
        assert status == 200
        # Keyed by agent id, each what that agent's own scan_gpu_alloc_map answers.
        assert maps == {"i-node01-a": {"GPU-0": "0.5"}, "i-node01-b": {"GPU-0": "0.25", "GPU-1": "1"},
                        "i-node01-c": {"GPU-0": "1", "GPU-1": "2"}}
        assert get(exporter, "agent=i-node01-c") == (200, {"GPU-0": "1", "GPU-1": "2"})
        assert get(exporter, "agent=i-node01-b&format=ratio") == (200, {"GPU-0": "0.0625", "GPU-1": "0.2500"})
        status, body = get(exporter, "agent=i-other")
        assert status == 404 and body.startswith("parameter agent:") and "i-node01-a" in body
        text = exporter.render().decode()
        assert 'gpu_alloc_agent_device_fgpu_allocated{agent_id="i-node01-c",device_id="GPU-1"} 2.0' in text
        assert 'gpu_alloc_device_fgpu_allocated{device_id="GPU-1"} 3.0' in text  # the node sums every agent
        # auto-split: 8 shares over three agents; c holds 2 of its 2.67, in a map with both GPUs whole.
        assert 'gpu_alloc_agent_slot_capacity{agent_id="i-node01-c",slot="cuda.shares"} 2.6666666666666665' in text
        assert 'gpu_alloc_agent_node_headroom{agent_id="i-node01-c",fragmentation="allowed",slot="cuda.shares"} 0.6666666666666666' in text
        # One whole GPU split three ways: the remainder goes to the first agent (divmod).
        assert 'gpu_alloc_agent_slot_capacity{agent_id="i-node01-a",slot="cuda.device"} 1.0' in text
        assert 'gpu_alloc_agent_slot_capacity{agent_id="i-node01-c",slot="cuda.device"} 0.0' in text
    finally:
        exporter.close()


def test_single_agent_alloc_map_answers_per_agent_too(tmp_path: Path) -> None:
    root = tmp_path / "s"
    write_kernel(root, K[0], {"cuda.shares": {DEV[0]: Decimal("0.5")}})
    settings = Settings.load({"scratch_roots": [str(root)], "telemetry_source": "none", "agent_id": "i-solo",
                              "path_cgroupfs": str(tmp_path / "none")})
    exporter = Exporter(resolve(settings), clock=lambda: NOW)
    exporter.start()
    try:
        assert get(exporter, "") == get(exporter, "agent=i-solo") == (200, {"GPU-0": "0.5"})
        assert get(exporter, "agent=i-other")[0] == 404
        assert "gpu_alloc_agent_info" not in exporter.render().decode()
    finally:
        exporter.close()


def test_multi_agent_golden(tmp_path: Path, update_golden: bool) -> None:
    exporter = exporter_for(tmp_path)
    exporter.start()
    try:
        text = exporter.render().decode().replace(str(tmp_path), "/tmp")
    finally:
        exporter.close()
    import re

    text = re.sub(r"^(gpu_alloc_\w*duration_seconds(?:\{[^}]*\})?) .*$", r"\1 0", text, flags=re.M)
    text = re.sub(r'python_version="[^"]*"', 'python_version="X"', text)
    # Only the per-agent families: the node-wide ones are frozen in full.prom.
    blocks = re.findall(r"(# HELP gpu_alloc_agent_(?!alloc_map)\w+ .*?)(?=# HELP |\Z)", text, flags=re.S)
    text = "".join(blocks)
    if update_golden:
        GOLDEN_FILE.write_text(text)
    assert text == GOLDEN_FILE.read_text(), "exposition changed; review and run pytest --update-golden"


@pytest.mark.tools("promtool")
def test_multi_agent_golden_is_promtool_clean() -> None:
    result = subprocess.run(["promtool", "check", "metrics"], input=GOLDEN_FILE.read_bytes(), capture_output=True)
    assert result.returncode == 0, result.stderr.decode()


def test_zero_flag_start_from_agent_toml(tmp_path: Path) -> None:
    shared, own = build(tmp_path)
    config = tmp_path / "agent.toml"
    config.write_text(agent_toml(shared, own))
    run = Running("--agent.config", str(config), "--web.listen-address", "127.0.0.1:0", "--telemetry.source", "none",
                  "--path.cgroupfs", str(tmp_path / "none"))
    try:
        status, body, _ = run.get("/api/v1/alloc-map?agent=i-node01-a")
        assert (status, json.loads(body)) == (200, {"GPU-0": "0.5"})
        status, body, _ = run.get("/metrics")
        text = body.decode()
        for agent, root in (("i-node01-a", shared), ("i-node01-b", shared), ("i-node01-c", own)):
            assert f'gpu_alloc_agent_info{{agent_id="{agent}",allocation_mode="auto-split",scratch_root="{root}"}} 1.0' in text
        # Several agents: build_info names each, so a dashboard's agent variable lists them all.
        for agent in ("i-node01-a", "i-node01-b", "i-node01-c"):
            assert f'gpu_alloc_build_info{{agent_id="{agent}"' in text
        assert 'gpu_alloc_build_info{agent_id=""' not in text
    finally:
        assert run.stop() == 0


def test_explicit_flags_win_over_agent_toml(tmp_path: Path) -> None:
    shared, own = build(tmp_path)
    config = tmp_path / "agent.toml"
    config.write_text(agent_toml(shared, own))
    # --scratch.agent replaces [[agents]]: only the own root, as one agent.
    run = Running("--agent.config", str(config), "--scratch.agent", f"{own}=i-solo", "--web.listen-address", "127.0.0.1:0",
                  "--telemetry.source", "none", "--path.cgroupfs", str(tmp_path / "none"))
    try:
        status, body, _ = run.get("/api/v1/alloc-map")
        assert (status, json.loads(body)) == (200, {"GPU-0": "1", "GPU-1": "2"})
        assert 'agent_id="i-solo"' in run.get("/metrics")[1].decode()
    finally:
        assert run.stop() == 0


def test_default_agent_toml_is_read_when_present(tmp_path: Path, capsys) -> None:
    shared, own = build(tmp_path)
    config = tmp_path / "etc-agent.toml"
    config.write_text(agent_toml(shared, own))
    assert main(["scan", "--output", "json"], default_agent_config=config) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["scratch_roots"] == [str(shared), str(own)]


@pytest.mark.parametrize(
    ("text", "reason"),
    [("[agent\nid = 1\n", "not valid TOML"), ('[resource]\nallocation-mode = "halves"\n', "allocation-mode must be one of"),
     ('[[agents]]\n[agents.container]\nscratch-root = "/x"\n', "has no agent id")],
)
def test_bad_agent_toml_is_one_line_and_exit_2(tmp_path: Path, text: str, reason: str) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "exporter", "--agent.config", str(config), "--web.listen-address", "127.0.0.1:0"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(config) in lines[0] and reason in lines[0], proc.stderr


def test_missing_agent_toml_named_by_flag_is_exit_2(tmp_path: Path, capsys) -> None:
    assert main(["--agent.config", str(tmp_path / "nope.toml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "nope.toml: cannot be read" in err
