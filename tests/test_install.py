"""docs/install.md's recipe, as a node runs it: a wheel built from the checkout, installed in a
fresh virtual environment with its dependencies, runs; and the systemd unit runs what it installs."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

from helpers import ROOT

from exporter import __version__

UNIT = ROOT / "deploy" / "systemd" / "gpu-alloc-exporter.service"
INSTALL = ROOT / "docs" / "install.md"


def run(*argv: str | Path, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{argv}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc


def test_a_wheel_built_from_the_checkout_installs_and_runs_in_a_fresh_venv(tmp_path: Path) -> None:
    # pip wheel, as docs/install.md builds it (pip's cache serves the build backend and dependencies).
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp_path / "dist", ROOT)
    (wheel,) = (tmp_path / "dist").glob("gpu_alloc_exporter-*-py3-none-any.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "exporter/data/demo-devices.toml" in names, "the demo's device file is not packaged"
    assert not [n for n in names if n.startswith("tests/")]
    venv = tmp_path / "venv"
    run("python3", "-m", "venv", venv)  # the system's Python, as on a node
    run(venv / "bin" / "pip", "install", "-q", "--disable-pip-version-check", wheel)
    command = venv / "bin" / "gpu-alloc-exporter"
    assert run(command, "--version").stdout.strip() == f"gpu-alloc-exporter {__version__}"
    # The packaged data is there: the demo's scratch tree and devices, scanned and simulated.
    root = tmp_path / "scratches"
    run(venv / "bin" / "python", "-c", f"from pathlib import Path; from exporter.demo import build_demo_tree; build_demo_tree(Path({str(root)!r}))")
    devices = run(venv / "bin" / "python", "-c", "from exporter.telemetry.mock import DEMO_DEVICES_FILE; print(DEMO_DEVICES_FILE)").stdout.strip()
    assert "kernels: ok" in run(command, "scan", "--scratch.root", root).stdout
    out = run(command, "simulate", "--scratch.root", root, "--telemetry.source", "mock", "--telemetry.mock-file", devices,
              "--request", "cuda.shares=1").stdout
    assert "result   placed 1" in out


def test_the_unit_runs_the_command_the_install_guide_installs() -> None:
    exec_start = re.search(r"(?m)^ExecStart=(\S+)", UNIT.read_text()).group(1)
    venv = str(Path(exec_start).parent.parent)
    guide = INSTALL.read_text()
    assert f"python3 -m venv {venv}\n" in guide and f"{venv}/bin/pip install .\n" in guide
    assert "docs/install.md" in UNIT.read_text() and "pip install ." in UNIT.read_text()
    # The README's one-line version installs into the same place.
    assert f"python3 -m venv {venv} && sudo {venv}/bin/pip install ." in (ROOT / "README.md").read_text()
