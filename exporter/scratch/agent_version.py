"""Which release of the Backend.AI agent runs on this host, found without privilege.

The agent's allocator differs by release (``--headroom.nofrag-rule``); where the flag is not
given, the configuration room asks :func:`detect_agent_versions`. Everything read here is
world-readable on an ordinary host:

* ``/proc/<pid>/cmdline`` picks out the agent: a running agent retitles itself
  ``backend.ai: agent <namespace>`` (``setproctitle`` in its server's ``main``), which overwrites
  its argument list; before that, or where ``setproctitle`` cannot, the arguments name
  ``ai.backend.agent.server`` or ``ag start-server``;
* the interpreter that runs it: the un-retitled ``argv[0]``, else ``/proc/<pid>/exe`` (readable
  only for the exporter's own user or root), else the ``ExecStart=`` of the systemd unit the
  process runs in (``/proc/<pid>/cgroup`` names the unit; unit files are world-readable), with
  that unit's ``WorkingDirectory=``, ``VIRTUAL_ENV`` and ``PYTHONPATH``;
* where that interpreter imports the agent from: ``<dir>/ai/backend/agent/VERSION`` (the file the
  agent's own ``__version__`` reads; in a source checkout under ``src/``) or the wheel's
  ``backend_ai_agent-<version>.dist-info/METADATA`` in ``<prefix>/lib/python3.*/site-packages``.

Nothing is executed and no file is written; each file is read bounded by
:func:`exporter.files.read_bytes`. Paths (the procfs, the unit directories, the directory of the
agent.toml read) are passed in.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from exporter.files import FileReadError, read_bytes, read_text

__all__ = [
    "UNIT_DIRS",
    "AgentVersion",
    "VersionScan",
    "detect_agent_versions",
    "is_agent_cmdline",
    "parse_release",
    "parse_unit",
    "unit_of_cgroup",
    "version_from_metadata",
]

# Where systemd looks for unit files, highest precedence first (systemd.unit(5), system manager).
UNIT_DIRS = ("/etc/systemd/system", "/run/systemd/system", "/usr/local/lib/systemd/system",
             "/usr/lib/systemd/system", "/lib/systemd/system")
_TITLE = "backend.ai: agent "  # the agent server's setproctitle; "backend.ai: agent.cli" is its CLI
_CMDLINE_BYTES = 64 * 1024  # ARG_MAX-sized command lines exist; an agent's is short
_SMALL_FILE_BYTES = 256 * 1024  # a VERSION file is 7 bytes, METADATA about 30 KiB, a unit file a few KiB
_RELEASE = re.compile(r"(\d{1,4})\.(\d{1,4})(?:\.(\d{1,6}))?")
_DIST_INFO = re.compile(r"backend[._-]ai[._-]agent-([^-]+)\.dist-info", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class AgentVersion:
    """One agent release found.

    :param version: as the agent spells it (``26.8.3``).
    :param release: (year, month, patch) of :func:`parse_release`.
    :param source: the file it was read from.
    :param pid: the agent process it belongs to; None for the package next to agent.toml.
    """

    version: str
    release: tuple[int, int, int]
    source: str
    pid: int | None = None


@dataclass(frozen=True, slots=True)
class VersionScan:
    """What :func:`detect_agent_versions` found.

    :param found: one entry per agent process whose release was read (and the package next to
        agent.toml, where no process gave one).
    :param processes: the pids that look like a running agent.
    :param reason: why nothing was found, in words; None when something was.
    """

    found: tuple[AgentVersion, ...]
    processes: tuple[int, ...] = ()
    reason: str | None = None


def parse_release(text: str) -> tuple[int, int, int] | None:
    """``26.9.6`` (also ``26.9.0rc1``, ``26.4``) → (26, 9, 6); None when it is no release."""
    m = _RELEASE.match(text.strip())
    if m is None:
        return None
    return int(m[1]), int(m[2]), int(m[3] or 0)


def version_from_metadata(text: str) -> str | None:
    """The ``Version:`` header of a wheel's METADATA (the headers end at the first blank line)."""
    for line in text.splitlines():
        if not line.strip():
            break
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() == "version":
            return value.strip() or None
    return None


def is_agent_cmdline(raw: bytes) -> bool:
    """Whether ``/proc/<pid>/cmdline`` is the agent server's: retitled ``backend.ai: agent …``
    (not its CLI, ``backend.ai: agent.cli``), or ``… -m ai.backend.agent.server`` or
    ``… ag start-server`` before the title is set."""
    argv = _argv(raw)
    if not argv:
        return False
    if argv[0].startswith(_TITLE):
        return True
    if "ai.backend.agent.server" in argv:
        return True
    return any(a == "ag" and b == "start-server" for a, b in zip(argv, argv[1:], strict=False))


def unit_of_cgroup(text: str) -> str | None:
    """The systemd service a process runs in, from ``/proc/<pid>/cgroup`` (v2 ``0::/path``, or
    v1's ``name=systemd`` hierarchy): the innermost ``*.service`` of the path; None outside one."""
    paths = []
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" or controllers == "name=systemd":
            paths.append(path)
    for path in paths:
        units = [part for part in path.split("/") if part.endswith(".service")]
        if units:
            return units[-1]
    return None


@dataclass(frozen=True, slots=True)
class Unit:
    """What a unit file says about the process it starts."""

    exec_start: tuple[str, ...] = ()
    working_directory: str | None = None
    environment: tuple[tuple[str, str], ...] = ()


def parse_unit(text: str) -> Unit:
    """The ``[Service]`` lines of a unit file that say where the agent is imported from: the last
    ``ExecStart=`` (its command split as a shell would; the ``-@:+!`` prefixes dropped), the
    ``WorkingDirectory=`` and the ``Environment=`` assignments. A line that cannot be split is
    skipped: a unit file this does not understand only means nothing is found through it."""
    exec_start: tuple[str, ...] = ()
    working_dir = None
    env: list[tuple[str, str]] = []
    section = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        if section != "Service" or line.startswith(("#", ";")):
            continue
        key, sep, value = line.partition("=")
        key, value = key.strip(), value.strip()
        try:
            if key == "ExecStart":
                exec_start = tuple(shlex.split(value.lstrip("-@:+!"))) if value else ()
            elif key == "WorkingDirectory":
                working_dir = value.lstrip("-") or None
            elif key == "Environment":
                env += [(k, v) for k, sep, v in (w.partition("=") for w in shlex.split(value)) if sep and k]
        except ValueError:
            continue
    return Unit(exec_start, working_dir, tuple(env))


def detect_agent_versions(proc: str | os.PathLike[str], *, unit_dirs: Sequence[str | os.PathLike[str]] = UNIT_DIRS,
                          config_dir: str | os.PathLike[str] | None = None, max_processes: int = 32768) -> VersionScan:
    """The release of each running agent this user can see, read without privilege.

    :param proc: the host's procfs (``--path.procfs``).
    :param unit_dirs: where systemd unit files are looked up.
    :param config_dir: the directory of the agent.toml read, if any: a source checkout there
        (``src/ai/backend/agent/VERSION``) is used where no process gave a release.
    :param max_processes: stop after this many processes (a bound on the start's work).
    """
    proc = Path(proc)
    pids = []
    try:
        entries = os.listdir(proc)
    except OSError as exc:
        return VersionScan((), (), f"{proc} cannot be listed: {exc.strerror or 'unreadable'}")
    for name in entries[:max_processes]:
        if not name.isdigit():
            continue
        try:
            raw = read_bytes(proc / name / "cmdline", _CMDLINE_BYTES)
        except FileReadError:  # gone meanwhile, a kernel thread, or hidden
            continue
        if is_agent_cmdline(raw):
            pids.append(int(name))
    found = []
    for pid in sorted(pids):
        version = _process_version(proc, pid, unit_dirs)
        if version is not None:
            found.append(version)
    if not found and config_dir is not None:
        version = _first_version(_site_dirs((), None, Path(config_dir)), None)
        if version is not None:
            found.append(version)
    if found:
        return VersionScan(tuple(found), tuple(sorted(pids)))
    if not pids:
        return VersionScan((), (), f"no Backend.AI agent process is visible under {proc}")
    listed = ", ".join(map(str, sorted(pids)[:4]))
    return VersionScan((), tuple(sorted(pids)),
                       f"the agent process ({listed}) does not show this user where its package is installed")


def _argv(raw: bytes) -> list[str]:
    # NUL-separated; a retitled process has one string padded with NULs or spaces.
    return [a for a in raw.decode("utf-8", "replace").split("\0") if a]


def _process_version(proc: Path, pid: int, unit_dirs: Sequence[str | os.PathLike[str]]) -> AgentVersion | None:
    interpreters: list[str] = []
    try:
        argv = _argv(read_bytes(proc / str(pid) / "cmdline", _CMDLINE_BYTES))
    except FileReadError:
        return None
    if argv and not argv[0].startswith(_TITLE) and os.path.isabs(argv[0]):
        interpreters.append(argv[0])
    try:
        interpreters.append(os.readlink(proc / str(pid) / "exe"))  # EACCES for another user's process
    except OSError:
        pass
    unit = _unit(proc, pid, unit_dirs)
    env = dict(unit.environment) if unit else {}
    if unit and unit.exec_start and os.path.isabs(unit.exec_start[0]):
        interpreters.insert(0, unit.exec_start[0])
    prefixes = [Path(env["VIRTUAL_ENV"])] if os.path.isabs(env.get("VIRTUAL_ENV", "")) else []
    prefixes += [Path(i).parent.parent for i in interpreters if Path(i).parent.name == "bin"]
    pythonpath = [Path(p) for p in env.get("PYTHONPATH", "").split(":") if os.path.isabs(p)]
    working = Path(unit.working_directory) if unit and unit.working_directory and os.path.isabs(unit.working_directory) else None
    return _first_version(_site_dirs(prefixes, working, None, pythonpath), pid)


def _unit(proc: Path, pid: int, unit_dirs: Sequence[str | os.PathLike[str]]) -> Unit | None:
    try:
        name = unit_of_cgroup(read_text(proc / str(pid) / "cgroup", _SMALL_FILE_BYTES))
    except FileReadError:
        return None
    if name is None:
        return None
    stem, at, _ = name.partition("@")
    names = [name] + ([f"{stem}@.service"] if at else [])
    for directory in unit_dirs:
        for candidate in names:
            try:
                return parse_unit(read_text(Path(directory) / candidate, _SMALL_FILE_BYTES))
            except FileReadError:
                continue
    return None


def _site_dirs(prefixes: Iterable[Path], working: Path | None, config_dir: Path | None,
               pythonpath: Iterable[Path] = ()) -> Iterator[Path]:
    """The directories the agent's package may be imported from, in the interpreter's order:
    ``PYTHONPATH``, then a source checkout (``src/``), then each prefix's site-packages."""
    yield from pythonpath
    for base in (working, config_dir):
        if base is not None:
            yield base / "src"
    for prefix in dict.fromkeys(prefixes):
        for lib in ("lib", "lib64"):
            try:
                pythons = sorted(n for n in os.listdir(prefix / lib) if n.startswith("python3"))
            except OSError:
                continue
            for python in pythons:
                yield prefix / lib / python / "site-packages"
                yield prefix / lib / python / "dist-packages"


def _first_version(dirs: Iterable[Path], pid: int | None) -> AgentVersion | None:
    for directory in dict.fromkeys(dirs):
        version = _version_in(directory, pid)
        if version is not None:
            return version
    return None


def _version_in(directory: Path, pid: int | None) -> AgentVersion | None:
    marker = directory / "ai" / "backend" / "agent" / "VERSION"
    try:
        text = read_text(marker, _SMALL_FILE_BYTES).strip()
    except FileReadError:
        pass
    else:
        release = parse_release(text)
        if release is not None:
            return AgentVersion(text, release, str(marker), pid)
    try:
        names = sorted(n for n in os.listdir(directory) if _DIST_INFO.fullmatch(n))
    except OSError:
        return None
    for name in names:
        metadata = directory / name / "METADATA"
        try:
            text = version_from_metadata(read_text(metadata, _SMALL_FILE_BYTES)) or ""
        except FileReadError:
            continue
        release = parse_release(text)
        if release is not None:
            return AgentVersion(text, release, str(metadata), pid)
    return None
