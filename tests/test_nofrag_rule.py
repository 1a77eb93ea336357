"""Which agent release headroom follows: ``--headroom.nofrag-rule`` where given, else the running
agent's release read from the host, else the default with one log line saying why."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from exporter.analysis.placement import NoFragRule
from exporter.config import nofrag_rule, resolve, rule_of_release
from exporter.scratch.agent_version import AgentVersion, VersionScan
from exporter.settings import Settings


@pytest.mark.parametrize(
    ("version", "rule"),
    [((26, 9, 0), NoFragRule.NUMA_CANDIDATES), ((26, 9, 6), NoFragRule.NUMA_CANDIDATES), ((27, 1, 0), NoFragRule.NUMA_CANDIDATES),
     ((26, 8, 3), NoFragRule.MULTI_DEVICE), ((26, 4, 0), NoFragRule.MULTI_DEVICE),
     ((26, 1, 0), NoFragRule.SINGLE_DEVICE), ((25, 18, 4), NoFragRule.SINGLE_DEVICE), ((25, 14, 9), NoFragRule.SINGLE_DEVICE),
     ((25, 15, 2), None), ((26, 2, 1), None), ((26, 3, 0), None)],
)
def test_each_release_maps_to_its_allocator(version: tuple[int, int, int], rule: NoFragRule | None) -> None:
    assert rule_of_release(version) is rule


def found(*versions: str) -> VersionScan:
    return VersionScan(tuple(AgentVersion(v, tuple(map(int, v.split("."))), f"/v/{v}/VERSION", 10 + i)  # type: ignore[arg-type]
                             for i, v in enumerate(versions)), (10,))


def test_agents_that_agree_give_one_rule_and_others_none_with_the_reason() -> None:
    assert nofrag_rule(found("26.8.3")) == (NoFragRule.MULTI_DEVICE, "agent 26.8.3 (/v/26.8.3/VERSION)")
    assert nofrag_rule(found("26.4.1", "26.8.3"))[0] is NoFragRule.MULTI_DEVICE  # one allocator
    rule, why = nofrag_rule(found("26.8.3", "26.9.6"))
    assert rule is None and "26.8.3 (/v/26.8.3/VERSION), 26.9.6 (/v/26.9.6/VERSION)" in why
    rule, why = nofrag_rule(found("26.3.2"))
    assert rule is None and why.startswith("agent 26.3.2 (/v/26.3.2/VERSION) is of a release line")
    assert nofrag_rule(VersionScan((), (), "nothing here")) == (None, "nothing here")


def host(tmp_path: Path, version: str | None) -> Path:
    """A host's /proc with one agent process run from a venv holding ``version`` (None: no agent)."""
    proc = tmp_path / "proc"
    (proc / "1").mkdir(parents=True)
    (proc / "1" / "cmdline").write_bytes(b"/sbin/init\0")
    if version is not None:
        prefix = tmp_path / "venv"
        marker = prefix / "lib" / "python3.13" / "site-packages" / "ai" / "backend" / "agent" / "VERSION"
        marker.parent.mkdir(parents=True)
        marker.write_text(version + "\n")
        (proc / "700").mkdir()
        (proc / "700" / "cmdline").write_bytes(f"{prefix}/bin/python\0-m\0ai.backend.agent.server\0".encode())
    return proc


def configure(tmp_path: Path, proc: Path, **flags) -> object:
    settings = Settings.load({"scratch_roots": [str(tmp_path)], "path_procfs": str(proc), **flags})
    return resolve(settings, agent_config=tmp_path / "no-agent.toml", hostname="n", telemetry=False, unit_dirs=())


def test_the_running_agents_release_sets_the_rule(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, "exporter.config")
    config = configure(tmp_path, host(tmp_path, "26.8.3"))
    assert config.headroom.rule is NoFragRule.MULTI_DEVICE and config.settings.headroom_nofrag_rule == "26.4"
    marker = tmp_path / "venv" / "lib" / "python3.13" / "site-packages" / "ai" / "backend" / "agent" / "VERSION"
    assert config.nofrag_rule_source == f"agent 26.8.3 ({marker})"
    assert [r.getMessage() for r in caplog.records if "allocator" in r.getMessage()] == [
        f"headroom follows the 26.4 allocator: agent 26.8.3 ({marker})"]


def test_the_flag_wins_over_the_running_agent(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, "exporter.config")
    config = configure(tmp_path, host(tmp_path, "26.8.3"), headroom_nofrag_rule="before-26.4")
    assert config.headroom.rule is NoFragRule.SINGLE_DEVICE and config.nofrag_rule_source == "flag"
    assert not [r for r in caplog.records if "allocator" in r.getMessage()]  # nothing was looked for


@pytest.mark.parametrize(
    ("version", "level", "reason"),
    [(None, logging.INFO, "no Backend.AI agent process is visible under"),
     ("26.3.1", logging.WARNING, "is of a release line that got the 26.4 fragmentation guard in a patch release")],
)
def test_without_a_usable_release_the_default_with_one_line_saying_why(tmp_path: Path, caplog, version, level, reason) -> None:
    caplog.set_level(logging.INFO, "exporter.config")
    config = configure(tmp_path, host(tmp_path, version))
    assert config.headroom.rule is NoFragRule.NUMA_CANDIDATES and config.nofrag_rule_source == "default"
    (line,) = [r for r in caplog.records if "allocator" in r.getMessage()]
    assert line.levelno == level and reason in line.getMessage()
    assert line.getMessage().startswith("headroom follows the 26.9 allocator, the default: ")
    assert line.getMessage().endswith("; set --headroom.nofrag-rule")


def test_no_detection_where_no_real_nodes_agent_toml_is_looked_for(tmp_path: Path) -> None:
    """The demo resolves its own node without agent.toml: the host's agent is not its."""
    settings = Settings.load({"scratch_roots": [str(tmp_path)], "path_procfs": str(host(tmp_path, "26.8.3"))})
    config = resolve(settings, hostname="n", telemetry=False, unit_dirs=())
    assert config.headroom.rule is NoFragRule.NUMA_CANDIDATES and config.nofrag_rule_source == "default"
    assert resolve(settings, hostname="n", telemetry=False, unit_dirs=(), detect_agent=True).headroom.rule is NoFragRule.MULTI_DEVICE
