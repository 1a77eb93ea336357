"""Files a setting names (config file, agent.toml, MIG geometries) are read as the scratch reader
reads: regular files only, never a blocking open, at most 1 MiB; a default the service user
cannot reach is one line and exit 2."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from exporter.cli import main
from exporter.files import MAX_FILE_BYTES
from exporter.settings import ConfigError, optional_file, read_config_text


def test_a_fifo_without_a_writer_is_refused_at_once(tmp_path: Path, capsys) -> None:
    fifo = tmp_path / "agent.toml"
    os.mkfifo(fifo)
    started = time.monotonic()
    assert main(["scan", "--agent.config", str(fifo)]) == 2
    assert time.monotonic() - started < 5
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{fifo}: not a regular file (set --agent.config)" in err


def test_a_link_to_a_device_and_an_oversized_file_are_refused(tmp_path: Path) -> None:
    link = tmp_path / "config.yaml"
    link.symlink_to("/dev/zero")
    with pytest.raises(ConfigError, match="not a regular file"):
        read_config_text(link, "--config.file")
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (MAX_FILE_BYTES + 1))
    with pytest.raises(ConfigError, match=f"larger than {MAX_FILE_BYTES} bytes"):
        read_config_text(big, "--config.file")
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match=r"bad.toml: not UTF-8 text \(set --agent.config\)"):
        read_config_text(bad, "--agent.config")
    good = tmp_path / "ok.toml"
    good.write_text("[agent]\nid = 'x'\n")
    assert read_config_text(good, "--agent.config") == "[agent]\nid = 'x'\n"


def test_a_missing_default_is_absent_and_an_unreachable_one_is_an_error(tmp_path: Path, monkeypatch) -> None:
    assert optional_file(tmp_path / "etc" / "agent.toml", "--agent.config") is None
    real_stat = os.stat

    def denied(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path / "locked")):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", denied)
    with pytest.raises(ConfigError) as caught:
        optional_file(tmp_path / "locked" / "agent.toml", "--agent.config")
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{tmp_path / 'locked' / 'agent.toml'}: cannot be read by uid")
    assert message.endswith("Permission denied (grant read access, or set --agent.config)")


@pytest.mark.parametrize("argv", [[], ["scan", "--scratch.root", "{tmp}"]], ids=["serve", "scan"])
def test_the_zero_flag_start_with_an_unreachable_default_is_one_line_and_exit_2(tmp_path: Path, monkeypatch, capsys, argv) -> None:
    """``/etc/backend.ai`` that the service user cannot enter: the default agent.toml cannot be
    looked at (EACCES at stat), which is not "absent"."""
    real_stat = os.stat
    default = tmp_path / "backend.ai" / "agent.toml"

    def denied(path, *args, **kwargs):
        if Path(path) == default:
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", denied)
    assert main([a.format(tmp=tmp_path) for a in argv], default_agent_config=default) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and f"{default}: cannot be read by uid" in err


def test_precedence_flags_then_environment_then_config_file_then_agent_toml_then_defaults(tmp_path: Path, monkeypatch) -> None:
    """The scratch roots at each level, as docs/configuration.md lists them."""
    from exporter.config import resolve
    from exporter.settings import Settings

    toml = tmp_path / "agent.toml"
    toml.write_text('[container]\nscratch-root = "/from/agent-toml"\n')
    config_file = tmp_path / "config.yaml"
    config_file.write_text("scratch.root: [/from/config-file]\n")

    def roots(flags: dict, env: str | None, file: Path | None, agent: Path | None) -> list[str]:
        if env is None:
            monkeypatch.delenv("GPU_ALLOC_EXPORTER_SCRATCH_ROOTS", raising=False)
        else:
            monkeypatch.setenv("GPU_ALLOC_EXPORTER_SCRATCH_ROOTS", env)
        config = resolve(Settings.load(flags, file), agent_config=agent, hostname="n")
        return [str(r) for r in config.settings.scratch_roots]

    assert roots({"scratch_roots": ["/from/flag"]}, "/from/env", config_file, toml) == ["/from/flag"]
    assert roots({}, "/from/env", config_file, toml) == ["/from/env"]
    assert roots({}, None, config_file, toml) == ["/from/config-file"]
    assert roots({}, None, None, toml) == ["/from/agent-toml"]
    assert roots({}, None, None, None) == ["/var/lib/backend.ai/scratches"]
