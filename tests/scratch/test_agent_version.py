"""The running agent's release, read without privilege from a fake host: its ``/proc`` entries,
systemd unit files, and the package where its interpreter imports it from."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
from backendai_wheels import fetch_wheel, wheels_folder

from exporter.scratch.agent_version import (
    detect_agent_versions,
    is_agent_cmdline,
    parse_release,
    parse_unit,
    unit_of_cgroup,
    version_from_metadata,
)

TITLE = b"backend.ai: agent local\0\0\0\0"  # what setproctitle leaves in /proc/<pid>/cmdline
CGROUP_V2 = "0::/system.slice/backendai-agent.service\n"


def process(proc: Path, pid: int, cmdline: bytes, cgroup: str = "0::/user.slice/session-1.scope\n") -> None:
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "cmdline").write_bytes(cmdline)
    (proc / str(pid) / "cgroup").write_text(cgroup)


def venv(prefix: Path, version: str, python: str = "python3.13") -> Path:
    """A virtual environment with the agent's wheel installed as pip lays it out."""
    site = prefix / "lib" / python / "site-packages"
    dist = site / f"backend_ai_agent-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.4\nName: backend.ai-agent\nVersion: {version}\n\nBackend.AI Agent\nVersion: 0\n")
    (prefix / "bin").mkdir()
    (prefix / "bin" / "python").touch()
    return site


def test_release_metadata_and_command_line_parsers() -> None:
    assert parse_release("26.9.6\n") == (26, 9, 6)
    assert parse_release("26.4.0rc1") == (26, 4, 0) and parse_release("25.15") == (25, 15, 0)
    assert parse_release("dev") is None and parse_release("") is None
    assert version_from_metadata("Name: backend.ai-agent\nVersion: 26.8.3\n\nVersion: 1\n") == "26.8.3"
    assert version_from_metadata("Name: x\n\nVersion: 26.8.3\n") is None  # the body is not a header
    assert is_agent_cmdline(TITLE) and is_agent_cmdline(b"backend.ai: agent worker-0\0")
    assert is_agent_cmdline(b"/opt/venv/bin/python\0-m\0ai.backend.agent.server\0-f\0/etc/agent.toml\0")
    assert is_agent_cmdline(b"/opt/venv/bin/python\0-m\0ai.backend.cli\0ag\0start-server\0")
    for other in (b"backend.ai: agent.cli\0", b"backend.ai: watcher local\0", b"/usr/bin/python3\0-m\0ai.backend.agent.watcher\0",
                  b"vim\0ai.backend.agent.server.py\0", b"", b"\0\0"):
        assert not is_agent_cmdline(other), other


def test_cgroup_and_unit_parsers() -> None:
    assert unit_of_cgroup(CGROUP_V2) == "backendai-agent.service"
    assert unit_of_cgroup("12:pids:/x\n1:name=systemd:/system.slice/bai-agent@2.service\n") == "bai-agent@2.service"
    assert unit_of_cgroup("0::/user.slice/user-1000.slice/session-3.scope\n") is None
    assert unit_of_cgroup("0::/\n") is None
    unit = parse_unit("[Unit]\nExecStart=/not/this\n[Service]\nUser=bai\nWorkingDirectory=-/home/bai/backend.ai\n"
                      "ExecStart=-/home/bai/venv/bin/python -m ai.backend.cli ag start-server\n"
                      'Environment="PYTHONPATH=/home/bai/backend.ai/src" VIRTUAL_ENV=/home/bai/venv\n'
                      "Environment=BROKEN 'quote\n")
    assert unit.exec_start == ("/home/bai/venv/bin/python", "-m", "ai.backend.cli", "ag", "start-server")
    assert unit.working_directory == "/home/bai/backend.ai"
    assert dict(unit.environment) == {"PYTHONPATH": "/home/bai/backend.ai/src", "VIRTUAL_ENV": "/home/bai/venv"}


def test_an_agent_started_by_its_interpreter_path_is_read_from_its_site_packages(tmp_path: Path) -> None:
    proc, prefix = tmp_path / "proc", tmp_path / "opt" / "venv"
    site = venv(prefix, "26.8.3")
    process(proc, 1, b"/sbin/init\0")
    process(proc, 812, f"{prefix}/bin/python\0-m\0ai.backend.agent.server\0".encode())
    scan = detect_agent_versions(proc, unit_dirs=())
    assert scan.reason is None and scan.processes == (812,)
    (found,) = scan.found
    assert (found.version, found.release, found.pid) == ("26.8.3", (26, 8, 3), 812)
    assert found.source == str(site / "backend_ai_agent-26.8.3.dist-info" / "METADATA")


def test_a_retitled_agent_is_traced_through_its_systemd_unit_to_a_source_checkout(tmp_path: Path) -> None:
    """The unit Backend.AI's installer writes: a venv's python, the checkout as working directory
    and ``PYTHONPATH=src`` (which the interpreter searches before site-packages)."""
    proc, units, checkout, prefix = tmp_path / "proc", tmp_path / "units", tmp_path / "backend.ai", tmp_path / "venv"
    venv(prefix, "26.1.0")  # an older wheel left in the venv: PYTHONPATH wins, as in the interpreter
    marker = checkout / "src" / "ai" / "backend" / "agent" / "VERSION"
    marker.parent.mkdir(parents=True)
    marker.write_text("26.9.6\n")
    units.mkdir()
    (units / "backendai-agent.service").write_text(
        f"[Service]\nWorkingDirectory={checkout}\nExecStart={prefix}/bin/python -m ai.backend.cli ag start-server\n"
        f"Environment=VIRTUAL_ENV={prefix}\nEnvironment=PYTHONPATH={checkout}/src\n")
    process(proc, 4242, TITLE, CGROUP_V2)
    (found,) = detect_agent_versions(proc, unit_dirs=(tmp_path / "none", units)).found
    assert (found.version, found.source, found.pid) == ("26.9.6", str(marker), 4242)


def test_nothing_visible_and_an_agent_without_a_trace_say_why(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    process(proc, 1, b"/sbin/init\0")
    process(proc, 77, b"backend.ai: agent.cli\0")
    scan = detect_agent_versions(proc, unit_dirs=())
    assert scan.found == () and scan.reason == f"no Backend.AI agent process is visible under {proc}"
    process(proc, 900, TITLE, CGROUP_V2)  # retitled, and no unit file to follow
    scan = detect_agent_versions(proc, unit_dirs=(tmp_path,))
    assert scan.found == () and scan.processes == (900,)
    assert scan.reason == "the agent process (900) does not show this user where its package is installed"
    scan = detect_agent_versions(tmp_path / "no-proc", unit_dirs=())
    assert scan.found == () and "cannot be listed" in scan.reason and "\n" not in scan.reason


def test_the_package_next_to_agent_toml_is_used_where_no_process_tells(tmp_path: Path) -> None:
    proc, checkout = tmp_path / "proc", tmp_path / "checkout"
    process(proc, 1, b"/sbin/init\0")
    marker = checkout / "src" / "ai" / "backend" / "agent" / "VERSION"
    marker.parent.mkdir(parents=True)
    marker.write_text("26.4.2\n")
    (found,) = detect_agent_versions(proc, unit_dirs=(), config_dir=checkout).found
    assert (found.version, found.pid) == ("26.4.2", None)


def test_hostile_files_are_skipped_not_fatal(tmp_path: Path) -> None:
    """A FIFO where METADATA should be, an oversized VERSION, a non-release: nothing hangs or raises."""
    import os

    proc, prefix = tmp_path / "proc", tmp_path / "venv"
    site = prefix / "lib" / "python3.13" / "site-packages"
    (site / "backend_ai_agent-26.9.6.dist-info").mkdir(parents=True)
    os.mkfifo(site / "backend_ai_agent-26.9.6.dist-info" / "METADATA")
    (site / "ai" / "backend" / "agent").mkdir(parents=True)
    (site / "ai" / "backend" / "agent" / "VERSION").write_text("not-a-release\n")
    process(proc, 5, f"{prefix}/bin/python\0-m\0ai.backend.agent.server\0".encode())
    scan = detect_agent_versions(proc, unit_dirs=())
    assert scan.found == () and scan.processes == (5,)


@pytest.fixture(scope="module")
def wheels(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return wheels_folder(request, tmp_path_factory, "GPU_ALLOC_AGENT_WHEELS", "backendai-agent-wheels")


def test_the_released_wheels_layout_is_read(tmp_path: Path, wheels: Path) -> None:
    """The files the released 26.8.3 wheel installs (its dist-info and ``ai/backend/agent/VERSION``)."""
    wheel = fetch_wheel(wheels, "backend.ai-agent==26.8.3", "backend_ai_agent-26.8.3-*.whl", "GPU_ALLOC_SKIP_AGENT_DIFFERENTIAL")
    prefix = tmp_path / "venv"
    site = prefix / "lib" / "python3.13" / "site-packages"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site, [n for n in z.namelist() if ".dist-info/" in n or n == "ai/backend/agent/VERSION"])
    process(tmp_path / "proc", 31, f"{prefix}/bin/python3.13\0-m\0ai.backend.agent.server\0".encode())
    (found,) = detect_agent_versions(tmp_path / "proc", unit_dirs=()).found
    assert found.version == "26.8.3" and found.source == str(site / "ai" / "backend" / "agent" / "VERSION")
    (site / "ai" / "backend" / "agent" / "VERSION").unlink()  # the dist-info alone says it too
    (found,) = detect_agent_versions(tmp_path / "proc", unit_dirs=()).found
    assert found.version == "26.8.3" and found.source.endswith("backend_ai_agent-26.8.3.dist-info/METADATA")
