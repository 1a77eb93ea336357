"""Backend.AI's ``agent.toml``, read for what a sidecar needs: which agents run on this host, their
ids, their scratch roots, their backend and how they split the node's resources.

A pure parser: :func:`parse_agent_config` takes the file's text. The schema is the agent's own
(``src/ai/backend/agent/config/unified.py``; kebab-case keys, snake_case accepted as aliases):

* ``[agent] id`` (unset: the agent derives one at start, see :func:`derived_agent_id`),
  ``[agent] backend`` (alias ``mode``: ``docker``, ``kubernetes``, ``dummy``);
* ``[container] scratch-root`` (default ``./scratches``, relative to the agent's working
  directory), ``scratch-type``;
* ``[resource] allocation-mode`` (``shared``, ``auto-split``, ``manual``) and
  ``[resource.allocations]`` (``cpu``, ``mem``, ``devices = {slot = amount}``);
* since 25.17, ``[[agents]]``: with two or more entries, several agents run in one process.
  Each entry has ``[agents.agent]`` (``id`` required, other keys override ``[agent]``), an
  optional ``[agents.container]`` (its own ``scratch-root``) and an optional
  ``[agents.resource]`` (its manual allocations). The global tables are then defaults only.

An agent without an ``id`` takes the cloud instance id on AWS, Azure or GCP (from the metadata
service, which a sidecar does not query) or ``i-<hostname>``: :func:`derived_agent_id` gives the
latter; on a cloud instance set ``[agent] id`` (or ``--agent.id``) so both agree.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from types import MappingProxyType
from typing import Any

from exporter.units import parse_binary_size

__all__ = [
    "ALLOCATION_MODES",
    "DEFAULT_AGENT_CONFIG",
    "DEFAULT_SCRATCH_ROOT",
    "AgentConfigError",
    "AgentEntry",
    "AgentToml",
    "derived_agent_id",
    "parse_agent_config",
]

DEFAULT_AGENT_CONFIG = "/etc/backend.ai/agent.toml"
DEFAULT_SCRATCH_ROOT = "./scratches"
ALLOCATION_MODES = ("shared", "auto-split", "manual")
_BACKENDS = ("docker", "kubernetes", "dummy")


class AgentConfigError(ValueError):
    """agent.toml cannot be used; ``str()`` names the file and the reason."""


@dataclass(frozen=True, slots=True)
class AgentEntry:
    """One agent on this host.

    :param agent_id: ``[agent] id``; None when unset (see :func:`derived_agent_id`).
    :param scratch_root: its scratch root, absolute (a relative value is resolved against the
        ``working_dir`` given to the parser).
    :param allocations: manual mode: slot → amount this agent owns (``cpu``, ``mem`` in bytes,
        and every ``devices`` slot); empty otherwise.
    """

    agent_id: str | None
    scratch_root: str
    backend: str = "docker"
    scratch_type: str = "hostdir"
    allocations: Mapping[str, Decimal] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True, slots=True)
class AgentToml:
    """What agent.toml says about the agents of this host, in the order the agent enumerates them
    (the order matters for ``auto-split`` remainders)."""

    agents: tuple[AgentEntry, ...]
    allocation_mode: str = "shared"
    affinity_policy: str | None = None  # [resource] affinity-policy; None: unset (the agent's default)

    @property
    def multi_agent(self) -> bool:
        return len(self.agents) > 1

    def roots(self) -> dict[str, tuple[str | None, ...]]:
        """Scratch root → the ids of the agents that write there (several share a root by default)."""
        out: dict[str, tuple[str | None, ...]] = {}
        for a in self.agents:
            out[a.scratch_root] = (*out.get(a.scratch_root, ()), a.agent_id)
        return out

    def with_default_ids(self, hostname: str) -> AgentToml:
        """The same agents, an unset id replaced by :func:`derived_agent_id` (a single agent only:
        the agent requires ids in multi-agent mode)."""
        agents = tuple(
            a if a.agent_id is not None else AgentEntry(derived_agent_id(hostname), a.scratch_root, a.backend, a.scratch_type, a.allocations)
            for a in self.agents
        )
        return AgentToml(agents, self.allocation_mode, self.affinity_policy)


AFFINITY_POLICIES = ("INTERLEAVED", "PREFER_SINGLE_NODE")


def _affinity(resource: dict, source: str) -> str | None:
    """``[resource] affinity-policy``, spelled as the agent's enum (any case); None when unset."""
    value = _str(resource, ("affinity-policy", "affinity_policy"), None, f"{source}: [resource] affinity-policy")
    if value is None:
        return None
    if value.upper() not in AFFINITY_POLICIES:
        raise AgentConfigError(f"{source}: [resource] affinity-policy must be one of {', '.join(AFFINITY_POLICIES)}, not {value!r}")
    return value.upper()


def derived_agent_id(hostname: str) -> str:
    """The id an agent without ``[agent] id`` takes off a cloud: ``i-<hostname>``."""
    return f"i-{hostname}"


def parse_agent_config(text: str, source: str = "agent.toml", *, working_dir: str | None = None) -> AgentToml:
    """Parse agent.toml.

    :param source: the file's path, used only in error messages.
    :param working_dir: the agent's working directory, which a relative ``scratch-root`` (the
        default ``./scratches``) is relative to; None refuses a relative root, since the sidecar
        cannot know where the agent was started.
    :raises AgentConfigError: invalid TOML, a wrong type, an unknown mode or backend, a relative
        scratch root without ``working_dir``, a missing or repeated id in ``[[agents]]``.
    """
    import tomllib  # here: a start that reads no agent.toml need not import it

    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise AgentConfigError(f"{source}: not valid TOML ({exc})") from None
    agent = _table(doc, "agent", source)
    container = _table(doc, "container", source)
    resource = _table(doc, "resource", source)
    mode = _str(resource, ("allocation-mode", "allocation_mode"), "shared", f"{source}: [resource] allocation-mode")
    if mode not in ALLOCATION_MODES:
        raise AgentConfigError(f"{source}: [resource] allocation-mode must be one of {', '.join(ALLOCATION_MODES)}, not {mode!r}")
    default_allocations = _table(resource, "allocations", source)
    affinity = _affinity(resource, source)

    entries = doc.get("agents", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise AgentConfigError(f"{source}: [[agents]] must be a list of tables")
    if not entries:
        return AgentToml((_entry(agent, container, default_allocations, source, "[agent]", working_dir, mode),), mode, affinity)
    agents, seen = [], set()
    for i, e in enumerate(entries, start=1):
        where = f"[[agents]] #{i}"
        own_agent = {**agent, **_table(e, "agent", source)}
        own_container = {**container, **_table(e, "container", source)}
        own_alloc = {**default_allocations, **_table(e, "resource", source)}
        entry = _entry(own_agent, own_container, own_alloc, source, where, working_dir, mode)
        if not isinstance(_table(e, "agent", source).get("id"), str):
            raise AgentConfigError(f"{source}: {where} has no agent id (each agent of a multi-agent host needs one)")
        if entry.agent_id in seen:
            raise AgentConfigError(f"{source}: {where} repeats agent id {entry.agent_id!r}")
        seen.add(entry.agent_id)
        agents.append(entry)
    return AgentToml(tuple(agents), mode, affinity)


def _entry(
    agent: Mapping[str, Any],
    container: Mapping[str, Any],
    allocations: Mapping[str, Any],
    source: str,
    where: str,
    working_dir: str | None,
    mode: str,
) -> AgentEntry:
    agent_id = agent.get("id")
    if agent_id is not None and (not isinstance(agent_id, str) or not agent_id.strip()):
        raise AgentConfigError(f"{source}: {where} id must be a non-empty string")
    backend = _str(agent, ("backend", "mode"), "docker", f"{source}: {where} backend")
    if backend not in _BACKENDS:
        raise AgentConfigError(f"{source}: {where} backend must be one of {', '.join(_BACKENDS)}, not {backend!r}")
    root = _str(container, ("scratch-root", "scratch_root"), DEFAULT_SCRATCH_ROOT, f"{source}: {where} scratch-root")
    if not posixpath.isabs(root):
        if working_dir is None:
            raise AgentConfigError(
                f"{source}: {where} scratch-root {root!r} is relative to the agent's working directory; "
                "give the scratch root explicitly"
            )
        root = posixpath.join(working_dir, root)
    scratch_type = _str(container, ("scratch-type", "scratch_type"), "hostdir", f"{source}: {where} scratch-type")
    return AgentEntry(
        agent_id,
        posixpath.normpath(root),
        backend,
        scratch_type,
        MappingProxyType(_allocations(allocations, source, where) if mode == "manual" else {}),
    )


def _allocations(table: Mapping[str, Any], source: str, where: str) -> dict[str, Decimal]:
    out: dict[str, Decimal] = {}
    devices = table.get("devices", {})
    if not isinstance(devices, dict):
        raise AgentConfigError(f"{source}: {where} allocations.devices must be a table of slot = amount")
    items = [("cpu", table.get("cpu")), ("mem", table.get("mem")), *devices.items()]
    for slot, raw in items:
        if raw is None:
            continue
        try:
            if slot == "mem" and isinstance(raw, str):
                value = Decimal(parse_binary_size(raw))
            elif isinstance(raw, (int, float, str)) and not isinstance(raw, bool):
                value = Decimal(str(raw))
            else:
                raise InvalidOperation
        except (InvalidOperation, ValueError):
            raise AgentConfigError(f"{source}: {where} allocation of {slot!r} is not an amount") from None
        if not value.is_finite() or value < 0:
            raise AgentConfigError(f"{source}: {where} allocation of {slot!r} is not an amount")
        out[str(slot)] = value
    return out


def _table(doc: Mapping[str, Any], key: str, source: str) -> dict[str, Any]:
    value = doc.get(key, {})
    if not isinstance(value, dict):
        raise AgentConfigError(f"{source}: [{key}] must be a table")
    return value


def _str(table: Mapping[str, Any], keys: tuple[str, ...], default: str, what: str) -> str:
    for key in keys:
        if key in table:
            value = table[key]
            if not isinstance(value, str):
                raise AgentConfigError(f"{what} must be a string")
            return value
    return default
