"""Who a kernel belongs to: ``config/recovery.json`` (Backend.AI 25.18+) parsed into an :class:`Identity`.

The agent's container-based kernel registry writes the file as compact pydantic JSON after the
container starts, and rewrites every kernel's file in place (``open("w")``, not atomic) on every
kernel start and stop. So a reader sees, besides the whole document, a prefix of it (a torn
write) or ``{}`` (a save that raced a cleanup). Neither is an error: :func:`parse_recovery`
returns None and the caller keeps the last identity it had. Only these fields are read::

    {"id": "<kernel uuid>", "agent_id": "i-node01", "session_type": "interactive",
     "ownership_data": {"kernel_id": …, "session_id": …, "agent_id": …,
                        "owner_user_id": "<uuid or null>", "owner_project_id": null}, …}

Values are spelled as Backend.AI spells its own metric labels (docs/backendai.md, *Identity*):
UUIDs in lower-case hyphenated form, and a missing value as the literal ``undefined``, so series
join with the agent's ``backendai_container_utilization`` and Backend.AI's query presets match
both alike.
A value that is not what its field should hold (a session id that is no UUID, a control
character in an agent id) is ``undefined`` too: nothing unchecked reaches a label.

Without ``recovery.json`` (older agents, Kubernetes) the same record comes from the container's
Docker labels (:func:`identity_from_labels`), never from its environment.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DOCKER_LABELS",
    "RECOVERY_FILE",
    "UNDEFINED",
    "Identity",
    "identity_from_labels",
    "parse_recovery",
]

RECOVERY_FILE = "recovery.json"
# Backend.AI's own spelling of a label whose value is unknown (agent metrics, query presets).
UNDEFINED = "undefined"
# The Docker labels the agent puts on every kernel container: field -> label.
DOCKER_LABELS = {
    "kernel_id": "ai.backend.kernel-id",
    "session_id": "ai.backend.session-id",
    "agent_id": "ai.backend.agent-id",
    "user_id": "ai.backend.owner-user-id",
    "session_type": "ai.backend.session-type",
}
# Agent ids are config strings (``[agent] id``, a cloud instance id, ``i-<hostname>``): printable,
# no whitespace, bounded so a hostile file cannot blow up a label.
_AGENT_ID = re.compile(r"[\x21-\x7e]{1,256}")
_SESSION_TYPE = re.compile(r"[a-z][a-z0-9_-]{0,31}")


@dataclass(frozen=True, slots=True)
class Identity:
    """A kernel's session, owner and agent, as label values (never None: ``undefined``)."""

    kernel_id: str
    session_id: str = UNDEFINED
    user_id: str = UNDEFINED
    project_id: str = UNDEFINED
    agent_id: str = UNDEFINED
    session_type: str = UNDEFINED

    @classmethod
    def unknown(cls, kernel_id: str, agent_id: str | None = None) -> Identity:
        """A kernel whose identity has not been read (yet): every field ``undefined`` but the
        kernel id, and the agent id when the exporter is told it (``--agent.id``)."""
        return cls(kernel_id, agent_id=_agent(agent_id))

    @property
    def known(self) -> bool:
        """True once a session id has been read: a readable recovery.json always names one."""
        return self.session_id != UNDEFINED


def parse_recovery(text: str) -> Identity | None:
    """The identity in one ``recovery.json``'s text, or None while the file is unusable (a torn
    write, ``{}``, not a JSON object, no kernel or session id): keep the last one then."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):  # torn, or nested beyond reason
        return None
    if not isinstance(doc, dict):
        return None
    own = doc.get("ownership_data")
    own = own if isinstance(own, dict) else {}
    kernel_id = _uuid(own.get("kernel_id")) or _uuid(doc.get("id"))
    session_id = _uuid(own.get("session_id"))
    if kernel_id is None or session_id is None:
        return None
    return Identity(
        kernel_id=kernel_id,
        session_id=session_id,
        user_id=_uuid(own.get("owner_user_id")) or UNDEFINED,
        project_id=_uuid(own.get("owner_project_id")) or UNDEFINED,
        agent_id=_agent(own.get("agent_id") or doc.get("agent_id")),
        session_type=_session_type(doc.get("session_type")),
    )


def identity_from_labels(labels: Mapping[str, str]) -> Identity | None:
    """The identity in a kernel container's Docker labels (``ai.backend.*``), or None when they
    name no kernel and session."""
    kernel_id = _uuid(labels.get(DOCKER_LABELS["kernel_id"]))
    session_id = _uuid(labels.get(DOCKER_LABELS["session_id"]))
    if kernel_id is None or session_id is None:
        return None
    return Identity(
        kernel_id=kernel_id,
        session_id=session_id,
        user_id=_uuid(labels.get(DOCKER_LABELS["user_id"])) or UNDEFINED,
        agent_id=_agent(labels.get(DOCKER_LABELS["agent_id"])),
        session_type=_session_type(labels.get(DOCKER_LABELS["session_type"])),
    )


def _uuid(value: Any) -> str | None:
    """A UUID as ``str(uuid.UUID(...))`` writes it (lower case, hyphenated), else None."""
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        return str(uuid.UUID(value))
    except ValueError:
        return None


def _agent(value: Any) -> str:
    return value if isinstance(value, str) and _AGENT_ID.fullmatch(value) else UNDEFINED


def _session_type(value: Any) -> str:
    # SessionTypes values are lower case (interactive, batch, inference, system); the enum's
    # member name would be upper case, so normalise the case before checking the shape.
    if isinstance(value, str) and _SESSION_TYPE.fullmatch(value.lower()):
        return value.lower()
    return UNDEFINED
