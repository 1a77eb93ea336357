"""The configuration room: every piece of user input read, checked and resolved once, into one
frozen :class:`Config` that the wiring reads and never questions.

Where a value comes from, highest precedence first:

1. command-line flags (``--scratch.root``, ``--collector.NAME`` ...);
2. environment variables (``GPU_ALLOC_EXPORTER_*``);
3. the ``--config.file`` (YAML or TOML);
4. the Backend.AI agent's agent.toml (``--agent.config``, else ``/etc/backend.ai/agent.toml``
   when present): scratch roots, agent ids and allocation mode, for what 1-3 leave unset;
5. built-in defaults.

Flags, environment and config file are merged by :meth:`Settings.load`; this module adds the
files they name (agent.toml, MIG geometries, the web config and its certificates), the values
with a grammar of their own (capacity overrides, headroom requests, ``--scratch.agent``) and the
collector switches. Every mistake is a :class:`ConfigError`: one line naming the flag or file
and the reason (the command line prints it and exits 2). A default path that does not exist is
absent; one the service user cannot reach is an error, never a traceback.

The agent release whose allocator headroom follows (``--headroom.nofrag-rule``) is, where the
flag is not given, read from the running agent (:mod:`exporter.scratch.agent_version`);
:attr:`Config.nofrag_rule_source` says where the rule came from. Scratch roots that are one
directory under two spellings (a symlink, ``..``) are read once, as one root shared by the agents
that name either.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from exporter.analysis.agents import AgentLayout
from exporter.analysis.capacity import CapacityConfig
from exporter.analysis.node import DEFAULT_REQUESTS, HeadroomParams
from exporter.analysis.placement import DEFAULT_AFFINITY, AffinityPolicy, NoFragRule
from exporter.analysis.placement import Request as PlacementRequest
from exporter.analysis.shapes import DEFAULT_SHAPES, Shape
from exporter.scratch.agent_config import AgentConfigError, AgentToml, parse_agent_config
from exporter.scratch.agent_version import UNIT_DIRS, VersionScan, detect_agent_versions
from exporter.settings import ConfigError, Settings, optional_file, read_config_text
from exporter.telemetry.mig import parse_hami_geometries
from exporter.telemetry.model import SourceConfigError
from exporter.telemetry.sources import SourceChoice, choose_source
from exporter.units import bounded, parse_decimal

if TYPE_CHECKING:
    from exporter.web.webconfig import WebConfigFile

__all__ = [
    "DEFAULT_AGENT_CONFIG",
    "Config",
    "agent_layout",
    "check_roots",
    "fleet_shapes",
    "headroom_params",
    "nofrag_rule",
    "resolve",
    "rule_of_release",
]

log = logging.getLogger(__name__)

DEFAULT_AGENT_CONFIG = Path("/etc/backend.ai/agent.toml")
# Stands for the agent's working directory where flags name the roots: never an absolute path, so
# never one of the roots read.
_UNKNOWN_DIR = "<agent working directory>"


@dataclass(frozen=True)
class Config:
    """Everything the exporter was told, resolved.

    :param settings: flags, environment and config file, typed and bounded; ``scratch_roots``
        are the roots the layout reads.
    :param layout: the host's agents and scratch roots.
    :param headroom: capacity, reference requests, fragmentation rule, MIG geometries.
    :param collectors: collector name -> on/off, for those switched explicitly.
    :param web: the web config (TLS, basic auth), loaded and checked; None without one.
    :param shapes: the request shapes judged per node (``--fleet.shape``).
    :param telemetry: the telemetry source, decided and checked (NVML probed, the mock file read
        and parsed); None where the command reads no telemetry (``scan``).
    :param nofrag_rule_source: where ``headroom.rule`` came from: ``flag``, ``default``, or
        ``agent VERSION (FILE)`` when read from the running agent.
    """

    settings: Settings
    layout: AgentLayout
    headroom: HeadroomParams
    collectors: Mapping[str, bool] = field(default_factory=dict)
    web: WebConfigFile | None = None
    shapes: tuple[Shape, ...] = DEFAULT_SHAPES  # --fleet.shape
    telemetry: SourceChoice | None = None
    nofrag_rule_source: str = "default"

    @property
    def health_state_file(self) -> Path:
        """Where latched GPU faults are kept (``--health.state-file``)."""
        return self.settings.health_state_file

    @property
    def boot_id_file(self) -> Path:
        """The host's boot id, under the host procfs (``--path.procfs``): a new one clears latches."""
        return Path(self.settings.path_procfs) / "sys" / "kernel" / "random" / "boot_id"


def resolve(
    settings: Settings,
    *,
    agent_config: Path | None = None,
    hostname: str | None = None,
    collectors: Mapping[str, bool] | None = None,
    web: bool = False,
    telemetry: bool = True,
    roots: str | None = None,
    detect_agent: bool | None = None,
    unit_dirs: tuple[str, ...] = UNIT_DIRS,
) -> Config:
    """Resolve ``settings`` and the files they name into a :class:`Config`.

    :param agent_config: the agent.toml read when present and ``--agent.config`` is not given
        (the command line passes :data:`DEFAULT_AGENT_CONFIG`; None: none).
    :param hostname: for agents without an id (``i-<hostname>``, as the agent does off a cloud).
    :param collectors: ``--collector.NAME`` switches; an unknown name is an error.
    :param web: load ``--web.config.file`` (only a server needs it).
    :param telemetry: decide and check the telemetry source (``scan`` reads none).
    :param roots: check the scratch roots: ``exist`` (each a directory this user can list) or
        ``may-be-missing`` (one that does not exist yet is waited for); None: not checked.
    :param detect_agent: without ``--headroom.nofrag-rule``, read the running agent's release
        under ``--path.procfs`` (None: where a real node's agent.toml is looked for, that is
        ``agent_config`` or ``--agent.config`` is given; the demo's node has no agent).
    :param unit_dirs: where the agent's systemd unit is looked up.
    :raises ConfigError: one line naming the flag or file and the reason.
    """
    path = settings.agent_config_file or (optional_file(agent_config, "--agent.config") if agent_config else None)
    text = read_config_text(path, "--agent.config") if path is not None else None
    layout = agent_layout(settings, text, str(path) if path else None, hostname or socket.gethostname())
    if layout.source:
        log.info("agents from %s: %s", layout.source, ", ".join(layout.agents) or "none")
    headroom = headroom_params(settings, layout.affinity_policy)
    settings = dataclasses.replace(settings, scratch_roots=[Path(r) for r in layout.roots])
    if roots is not None:
        check_roots(settings, allow_missing=roots == "may-be-missing")
    config = Config(settings, layout, headroom, MappingProxyType(_collectors(collectors or {})),
                    _web_config(settings) if web else None, shapes=fleet_shapes(settings.fleet_shapes),
                    telemetry=_telemetry(settings) if telemetry else None)
    # Last: every mistake above is one line and exit 2 without a log line before it.
    if detect_agent is None:
        detect_agent = agent_config is not None or settings.agent_config_file is not None
    rule, source = _nofrag_rule(settings, path, detect_agent, unit_dirs)
    return dataclasses.replace(
        config, settings=dataclasses.replace(settings, headroom_nofrag_rule=rule.value),
        headroom=dataclasses.replace(headroom, rule=rule), nofrag_rule_source=source)


def _collectors(switches: Mapping[str, bool]) -> dict[str, bool]:
    if not switches:
        return {}
    from exporter.metrics.collectors import collectors  # light: no prometheus_client

    known = collectors()
    unknown = sorted(set(switches) - set(known))
    if unknown:
        raise ConfigError(f"--collector.{unknown[0]}: no such collector (collectors: {', '.join(known)})")
    return dict(switches)


def _telemetry(settings: Settings) -> SourceChoice:
    try:
        return choose_source(settings.telemetry_source, mock_file=settings.telemetry_mock_file)
    except SourceConfigError as exc:
        raise ConfigError(str(exc)) from None


def _web_config(settings: Settings) -> WebConfigFile | None:
    if settings.web_config_file is None:
        return None
    from exporter.web.webconfig import WebConfigError, WebConfigFile

    web = WebConfigFile(settings.web_config_file)
    try:
        web.load()  # unknown keys, bad hashes, unreadable certificates: exit 2
    except WebConfigError as exc:
        raise ConfigError(str(exc).replace("\n", " ")) from None
    return web


def check_roots(settings: Settings, allow_missing: bool) -> None:
    """Each scratch root is a directory this user can list (``allow_missing``: one that does not
    exist yet is waited for, with a warning)."""
    for root in settings.scratch_roots:
        try:
            is_dir = stat.S_ISDIR(os.stat(root).st_mode)
        except FileNotFoundError:
            if allow_missing:
                log.warning("scratch root %s does not exist yet; waiting for it", root)
                continue
            is_dir = False
        except OSError as exc:  # EACCES on a parent, ELOOP, EIO: the root cannot even be looked at
            raise ConfigError(f"scratch root {root} cannot be read: {exc.strerror} (set --scratch.root)") from None
        if not is_dir:
            raise ConfigError(f"scratch root {root} is not a directory (set --scratch.root)")
        if not os.access(root, os.R_OK | os.X_OK):
            raise ConfigError(f"scratch root {root} is not readable by uid {os.getuid()}")


# -- headroom ---------------------------------------------------------------------------------


def rule_of_release(release: tuple[int, int, int]) -> NoFragRule | None:
    """The allocator an agent release runs: 26.9.0+ ``26.9``; 26.4.0 to 26.8.x ``26.4``; older
    ``before-26.4``. None for the 25.15, 26.2 and 26.3 lines: the 26.4 guard (#10477) was
    backported to them in a patch release, so the line alone does not say which guard runs."""
    line = release[:2]
    if line >= (26, 9):
        return NoFragRule.NUMA_CANDIDATES
    if line >= (26, 4):
        return NoFragRule.MULTI_DEVICE
    if line in ((25, 15), (26, 2), (26, 3)):
        return None
    return NoFragRule.SINGLE_DEVICE


def nofrag_rule(scan: VersionScan) -> tuple[NoFragRule | None, str]:
    """The rule the agents found run, and where it came from; (None, why) when the scan gives
    no single rule (nothing found, a release line with a backport, agents that disagree)."""
    if not scan.found:
        return None, scan.reason or "no Backend.AI agent found"
    rules = {v.version: rule_of_release(v.release) for v in scan.found}
    first = scan.found[0]
    if len(set(rules.values())) > 1:
        return None, "agents of releases that allocate differently run here: " + ", ".join(
            f"{v.version} ({v.source})" for v in scan.found)
    rule = rules[first.version]
    if rule is None:
        return None, (f"agent {first.version} ({first.source}) is of a release line that got the 26.4 "
                      "fragmentation guard in a patch release")
    return rule, f"agent {first.version} ({first.source})"


def _nofrag_rule(settings: Settings, agent_toml: Path | None, detect: bool, unit_dirs: tuple[str, ...]) -> tuple[NoFragRule, str]:
    """``--headroom.nofrag-rule`` where given, else the running agent's, else the default (with
    one log line saying why)."""
    given = NoFragRule(settings.headroom_nofrag_rule)
    if "headroom_nofrag_rule" in settings.given or not detect:
        return given, "flag" if "headroom_nofrag_rule" in settings.given else "default"
    scan = detect_agent_versions(settings.path_procfs, unit_dirs=unit_dirs,
                                 config_dir=agent_toml.parent if agent_toml is not None else None)
    rule, why = nofrag_rule(scan)
    if rule is None:
        # Nothing visible is ordinary (hidepid, a container without the host's PIDs); agents seen
        # but not usable are worth a warning.
        level = logging.WARNING if scan.found or scan.processes else logging.INFO
        log.log(level, "headroom follows the %s allocator, the default: %s; set --headroom.nofrag-rule", given.value, why)
        return given, "default"
    log.info("headroom follows the %s allocator: %s", rule.value, why)
    return rule, why


def _cut(text: str, limit: int = 80) -> str:
    # A flag's value, quoted back to the person who typed it: cut, so one line stays one line.
    return text if len(text) <= limit else text[:limit] + "…"


def headroom_params(settings: Settings, affinity: str | None = None) -> HeadroomParams:
    """Headroom settings from the flags and agent.toml's ``affinity-policy`` (None: the agent's
    default); raises ConfigError naming the flag (or file) and the reason."""
    return HeadroomParams(
        capacity=CapacityConfig(
            unit_mem_bytes=settings.capacity_unit_mem, unit_proc=settings.capacity_unit_proc,
            quantum=settings.capacity_quantum, overrides=_overrides(settings.capacity_overrides),
        ),
        mode=settings.headroom_mode,
        rule=NoFragRule(settings.headroom_nofrag_rule),
        requests=_requests(settings.headroom_requests) or DEFAULT_REQUESTS,
        exclude_stale=settings.headroom_exclude_stale,
        hami=_hami(settings.mig_geometries_file),
        affinity=AffinityPolicy(affinity) if affinity else DEFAULT_AFFINITY,
    )


def _overrides(items: list[str]) -> dict[str, Decimal]:
    overrides: dict[str, Decimal] = {}
    for item in items:
        device_id, sep, shares = item.rpartition("=")
        if not sep or not device_id.strip() or not shares.strip():
            raise ConfigError(f"--capacity.override {_cut(item)!r}: expected DEVICE_ID=SHARES, e.g. GPU-8e3c…=13.5")
        try:
            overrides[device_id.strip()] = parse_decimal(shares.strip())
        except ValueError:
            raise ConfigError(
                f"--capacity.override {_cut(item)!r}: SHARES must be a finite, non-negative number of shares"
            ) from None
    return overrides


def _requests(items: list[str]) -> tuple[PlacementRequest, ...]:
    requests = []
    for item in items:
        try:
            request = PlacementRequest.parse(item)
            bounded(request.amount, item)
        except ValueError as exc:
            raise ConfigError(f"--headroom.request {_cut(item)!r}: {exc}") from None
        requests.append(request)
    return tuple(requests)


def fleet_shapes(items: list[str]) -> tuple[Shape, ...]:
    """``--fleet.shape`` values, or the default shapes when none is given; raises ConfigError
    naming the flag, the value and the reason (a repeated name too)."""
    shapes: dict[str, Shape] = {}
    for item in items:
        try:
            shape = Shape.parse(item)
        except ValueError as exc:
            raise ConfigError(f"--fleet.shape {_cut(item)!r}: {exc}") from None
        if shape.name in shapes:
            raise ConfigError(f"--fleet.shape {_cut(item)!r}: shape {shape.name} is given twice")
        shapes[shape.name] = shape
    return tuple(shapes.values()) or DEFAULT_SHAPES


def _hami(path: Path | None) -> tuple:
    if path is None:
        return ()
    text = read_config_text(path, "--mig.geometries-file")
    try:
        return tuple(parse_hami_geometries(text))
    except ValueError as exc:
        raise ConfigError(f"--mig.geometries-file {path}: {exc}") from None


# -- agents -------------------------------------------------------------------------------------


def agent_layout(settings: Settings, agent_toml: str | None, source: str | None, hostname: str) -> AgentLayout:
    """The host's agents from the flags and agent.toml's text. Precedence, highest first:

    * ``--scratch.agent ROOT=AGENT_ID`` (repeatable): the host's agents and their roots,
      replacing agent.toml's ``[[agents]]``;
    * ``--scratch.root``: the roots to read (agent.toml's agents keep their ids; a root no agent
      names alone is split by each kernel's ``recovery.json``);
    * ``--agent.id``: the id of the host's one agent (with several, ``--scratch.agent`` names them);
    * agent.toml: roots, ids, allocation mode; an agent without ``id`` takes ``i-<hostname>``.

    :raises ConfigError: one line naming the flag or file and the reason.
    """
    roots_given = "scratch_roots" in settings.given
    explicit = _bindings(settings.scratch_agents)
    # A relative scratch-root (the agent's default ./scratches) cannot be located from outside the
    # agent; that only matters when no flag names the roots.
    toml = _agent_toml(agent_toml, source, hostname, unknown_dir=bool(explicit) or roots_given)
    pairs, allocations = _agent_pairs(explicit, toml)
    agents = tuple(dict.fromkeys(i for _, i in pairs))
    if settings.agent_id is not None:
        if len(agents) > 1:
            where = "--scratch.agent" if explicit else (source or "agent.toml")
            raise ConfigError(f"--agent.id names one agent but {where} names {len(agents)}; "
                              "tie roots to agents with --scratch.agent ROOT=AGENT_ID")
        agents = (settings.agent_id,)
        pairs = [(root, settings.agent_id) for root, _ in pairs]
    roots = [str(r) for r in settings.scratch_roots] if roots_given or not pairs else []
    roots += [root for root in dict.fromkeys(r for r, _ in pairs)
              if root not in roots and Path(root).is_absolute() and (explicit or not roots_given)]
    named = [r for r, _ in pairs]
    same = _aliases([*roots, *named])
    for alias, first in same.items():
        # Said where one source names both spellings: a flag's root that is agent.toml's by
        # another name is only the flag winning.
        if {alias, first} <= set(roots) or {alias, first} <= set(named):
            log.warning("scratch roots %s and %s are the same directory; read once as %s, shared by the agents naming either",
                        first, alias, first)
    roots = list(dict.fromkeys(same.get(r, r) for r in roots))
    pairs = [(same.get(r, r), i) for r, i in pairs]
    return AgentLayout(
        roots=tuple(roots),
        bindings=MappingProxyType(_root_owners(pairs, roots, agents)),
        agents=agents,
        allocation_mode=toml.allocation_mode if toml else "shared",
        allocations=MappingProxyType(allocations),
        source=source if toml else None,
        affinity_policy=toml.affinity_policy if toml else None,
    )


def _agent_toml(text: str | None, source: str | None, hostname: str, unknown_dir: bool) -> AgentToml | None:
    if text is None:
        return None
    try:
        return parse_agent_config(text, source or "agent.toml",
                                  working_dir=_UNKNOWN_DIR if unknown_dir else None).with_default_ids(hostname)
    except AgentConfigError as exc:
        raise ConfigError(str(exc).replace("\n", " ")) from None


def _agent_pairs(explicit: list[tuple[str, str]], toml: AgentToml | None
                 ) -> tuple[list[tuple[str, str]], dict[str, Mapping[str, Decimal]]]:
    """(root, agent id) pairs, and each agent's ``manual`` allocations from agent.toml."""
    if not toml:
        return explicit, {}
    if explicit:
        named = {i for _, i in explicit}
        return explicit, {a.agent_id: a.allocations for a in toml.agents if a.agent_id in named}
    return [(a.scratch_root, a.agent_id) for a in toml.agents], {a.agent_id: a.allocations for a in toml.agents}


def _aliases(paths: list[str]) -> dict[str, str]:
    """Spelling -> the first spelling of the same directory (device and inode), for each root
    that another spelling names too (a symlink, ``..``). A root that cannot be looked at yet is
    left alone: :func:`check_roots` reports it, or it is waited for."""
    first: dict[tuple[int, int], str] = {}
    out: dict[str, str] = {}
    for path in dict.fromkeys(paths):
        if not os.path.isabs(path):  # the agent's working directory is unknown here
            continue
        try:
            st = os.stat(path)
        except OSError:
            continue
        key = (st.st_dev, st.st_ino)
        if key not in first:
            first[key] = path
            continue
        out[path] = first[key]
    return out


def _root_owners(pairs: list[tuple[str, str]], roots: list[str], agents: tuple[str, ...]) -> dict[str, str]:
    """Root -> the one agent writing there; a root shared by several agents has none."""
    if len(agents) == 1:  # one agent: every root is its own
        return dict.fromkeys(roots, agents[0])
    by_root: dict[str, set[str]] = {}
    for root, agent_id in pairs:
        by_root.setdefault(root, set()).add(agent_id)
    return {r: next(iter(ids)) for r, ids in by_root.items() if len(ids) == 1 and r in roots}


def _bindings(items: list[str]) -> list[tuple[str, str]]:
    out = []
    for item in items:
        root, sep, agent_id = item.rpartition("=")
        if not sep or not root or not agent_id.strip() or any(c.isspace() for c in agent_id):
            raise ConfigError(f"--scratch.agent expects ROOT=AGENT_ID, got {item!r}")
        if not Path(root).is_absolute():
            raise ConfigError(f"--scratch.agent root {root!r} must be an absolute path")
        out.append((str(Path(root)), agent_id))
    return out
