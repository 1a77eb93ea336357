"""The documentation says what the program does: every served metric and every flag is in the
reference (and nothing else is), the configuration examples load, and the README's commands work
against a running demo."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import GOLDEN, ROOT

from exporter.cli import COMMANDS, build_parser
from exporter.settings import FIELDS, Settings

DOCS = ROOT / "docs"
# Documented families no golden machine produces yet; each entry must say why, and the test fails
# once a golden file serves it (then the entry goes).
NOT_IN_GOLDEN = {
    "gpu_alloc_device_fan_speed_ratio": "the golden GPUs (DGX A100, V100, the demo's mock A100s) are passively cooled",
}


def served_families() -> set[str]:
    names: set[str] = set()
    for golden in GOLDEN.glob("*.prom"):
        names |= set(re.findall(r"^# TYPE (\w+) ", golden.read_text(), flags=re.M))
    return names


def documented_families() -> set[str]:
    return set(re.findall(r"^\| `(gpu_alloc_\w+)` \|", (DOCS / "metrics.md").read_text(), flags=re.M))


def test_every_served_family_is_documented() -> None:
    missing = sorted(served_families() - documented_families())
    assert not missing, f"docs/metrics.md lacks: {missing}"


def test_every_documented_family_is_served() -> None:
    served = served_families()
    extra = sorted(documented_families() - served - set(NOT_IN_GOLDEN))
    assert not extra, f"docs/metrics.md documents families nothing serves: {extra}"
    assert not sorted(set(NOT_IN_GOLDEN) & served), "served now: remove it from NOT_IN_GOLDEN"


def help_flags() -> set[str]:
    """Every option string of every command's parser, hidden ones included (argparse's own -h aside)."""
    flags: set[str] = set()
    for command in COMMANDS:
        for action in build_parser(command)._actions:
            if not isinstance(action, argparse._HelpAction):
                flags |= {f for f in action.option_strings if f.startswith("--")}
    return flags


def documented_flags() -> set[str]:
    text = (DOCS / "configuration.md").read_text()
    return {m for row in re.findall(r"^\|.*\|$", text, flags=re.M) for m in re.findall(r"`(--[\w.-]+)", row)}


def test_every_flag_is_in_the_configuration_reference_and_back() -> None:
    assert help_flags() - {"--help"} == documented_flags() - {"--help"}


def test_the_configuration_reference_names_every_environment_variable_and_default() -> None:
    text = (DOCS / "configuration.md").read_text()
    for name, field in FIELDS.items():
        flag = field.flag
        row = next((r for r in text.splitlines() if r.startswith(f"| `{flag}")), "")
        assert f"`GPU_ALLOC_EXPORTER_{name.upper()}`" in row, flag
        assert field.description in row, flag


@pytest.mark.parametrize("lang", ["toml", "yaml"])
def test_the_configuration_examples_load(lang: str, tmp_path: Path) -> None:
    text = (DOCS / "configuration.md").read_text()
    (block,) = re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)
    path = tmp_path / f"config.{lang}"
    path.write_text(block)
    settings = Settings.load({}, path)
    assert [str(p) for p in settings.scratch_roots] == ["/var/lib/backend.ai/scratches"]
    assert settings.web_listen_address == ":19402"


def readme_commands() -> list[str]:
    """The commands of the README's sh blocks that ask something of a running exporter (the ones
    that start a server or install packages are the reader's own)."""
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            words = shlex.split(line) if line else []
            if not words or words[0] not in ("curl", "gpu-alloc-exporter"):
                continue
            serves = words[0] == "gpu-alloc-exporter" and (
                len(words) == 1 or words[1] in ("demo", "serve") or (words[1].startswith("--") and "--help" not in words)
            )
            if not serves:
                commands.append(line)
    return commands


def test_the_readme_has_commands_to_try() -> None:
    commands = readme_commands()
    assert any(c.startswith("curl") for c in commands) and any(c.startswith("gpu-alloc-exporter simulate") for c in commands)


def test_the_readme_examples_work_against_the_demo(tmp_path: Path) -> None:
    demo = subprocess.Popen(
        [sys.executable, "-m", "exporter", "demo", "--web.listen-address", "127.0.0.1:0", "--demo.dir", str(tmp_path / "demo")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        port = None
        for line in demo.stdout:
            if m := re.search(r"http://127\.0\.0\.1:(\d+)/", line):
                port = m.group(1)
            if line.startswith("Press Ctrl-C"):
                break
        assert port, "the demo did not start"
        # The README's commands, as a reader runs them: in bash, with the installed command on PATH.
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        for command in readme_commands():
            line = command.replace("localhost:19402", f"127.0.0.1:{port}")
            line = re.sub(r"^curl ", "curl --fail ", line)  # an HTTP error status fails the example too
            proc = subprocess.run(["bash", "-o", "pipefail", "-c", line], cwd=tmp_path, env=env, capture_output=True,
                                  text=True, timeout=60)
            # simulate answers 1 for a request the node would reject: an answer, not a failure.
            ok = (0, 1) if command.startswith("gpu-alloc-exporter simulate") else (0,)
            assert proc.returncode in ok, f"{command}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
            assert proc.stderr == "" or command.startswith("curl"), f"{command}\n{proc.stderr[-2000:]}"
            assert proc.stdout.strip() or ">" in command, f"{command} printed nothing"
    finally:
        demo.terminate()
        assert demo.wait(10) == 0
        demo.stdout.close()


def test_the_documented_mistakes_print_what_the_docs_say(tmp_path: Path) -> None:
    """docs/configuration.md quotes the one-line answers to mistakes: they are the real ones."""
    text = (DOCS / "configuration.md").read_text()
    block = text[text.index("## Mistakes and exit status"):]
    block = re.search(r"```\n(.*?)```", block, flags=re.S).group(1)
    pairs = re.findall(r"^\$ (.+?)(?:\s+#.*)?\n(.+)$", block, flags=re.M)
    assert len(pairs) >= 3
    (tmp_path / "saved.json").write_text("{}")
    (tmp_path / "root").mkdir()
    checked = 0
    for command, answer in pairs:
        argv = shlex.split(command)
        if "nvml" in argv:
            continue  # depends on this machine's driver; tests/test_cli.py covers it with the simulated library
        argv = [sys.executable, "-m", "exporter", *argv[1:], "--scratch.root", str(tmp_path / "root"),
                "--web.listen-address", "127.0.0.1:0"]
        proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert (proc.returncode, proc.stderr) == (2, answer + "\n"), command
        checked += 1
    assert checked >= 2


def test_the_readme_installs_every_rule_file_the_shipped_config_loads() -> None:
    import yaml

    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    installed = set(re.findall(r"alerts/([\w.-]+\.yml)", (ROOT / "README.md").read_text()))
    assert set(config["rule_files"]) <= installed, set(config["rule_files"]) - installed
    assert all((ROOT / "alerts" / name).is_file() for name in config["rule_files"])


def test_the_agent_toml_examples_resolve_as_documented() -> None:
    from exporter.config import agent_layout

    text = (DOCS / "configuration.md").read_text()
    one, several = re.findall(r"```toml /etc/backend.ai/agent.toml \([^)]*\)\n(.*?)```", text, flags=re.S)
    layout = agent_layout(Settings.load({}), one, "agent.toml", "gpu-node07")
    assert layout.roots == ("/data/backend.ai/scratches",) and layout.agents == ("i-gpu-node07",)
    layout = agent_layout(Settings.load({}), several, "agent.toml", "gpu-node07")
    assert layout.agents == ("i-gpu-node07-a", "i-gpu-node07-b") and layout.allocation_mode == "auto-split"
    assert layout.roots == ("/var/lib/backend.ai/scratches", "/var/lib/backend.ai/scratches-b")
    assert layout.bindings == {"/var/lib/backend.ai/scratches": "i-gpu-node07-a",
                               "/var/lib/backend.ai/scratches-b": "i-gpu-node07-b"}
