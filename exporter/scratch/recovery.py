"""A kernel's ``config/recovery.json``: who it belongs to and which agent runs it (25.18+, Docker).

The agent's container-based kernel registry writes it as compact pydantic JSON after the
container started, and rewrites every kernel's file in place (``open("w")``, not atomic) on every
kernel start or stop. A reader therefore routinely sees a torn file, or ``{}`` left behind by a
save that raced a cleanup. :func:`parse_recovery` is pure and tolerant: it takes the text and
returns a :class:`Recovery` record, or None for anything that is not (yet) a usable file; it
never raises on content.

Only identity is read: ``id``, ``agent_id``, ``session_type`` and, from ``ownership_data``,
``kernel_id``, ``session_id``, ``agent_id``, ``owner_user_id``. Ids are returned lower-case, as
Backend.AI labels them; ``owner_project_id`` is always null today and not read. Nothing in the
file is secret, but other files beside it are (``environ.txt``, ``kconfig.dat``, ``cluster.json``,
``docker-creds.json``): this module is the only reader of that directory besides
``resource.txt``'s.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["RECOVERY_FILE", "SESSION_TYPES", "Recovery", "parse_recovery"]

RECOVERY_FILE = "recovery.json"
SESSION_TYPES = frozenset({"interactive", "batch", "inference", "system"})
_MAX_ID = 256  # agent ids are host names or cloud instance ids; anything longer is not one
_UUID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
_PRINTABLE = re.compile(r"^[\x21-\x7e]+$")


@dataclass(frozen=True, slots=True)
class Recovery:
    """Identity of one kernel as its agent recorded it; None where the file has no usable value."""

    kernel_id: str
    session_id: str | None
    owner_user_id: str | None
    agent_id: str | None
    session_type: str | None


def parse_recovery(text: str) -> Recovery | None:
    """The identity in a ``recovery.json`` text; None for a torn write, ``{}``, or a file without
    a kernel id (the next rewrite will complete it)."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    ownership = doc.get("ownership_data")
    ownership = ownership if isinstance(ownership, dict) else {}
    kernel_id = _uuid(doc.get("id")) or _uuid(ownership.get("kernel_id"))
    if kernel_id is None:
        return None
    session_type = doc.get("session_type")
    return Recovery(
        kernel_id=kernel_id,
        session_id=_uuid(ownership.get("session_id")),
        owner_user_id=_uuid(ownership.get("owner_user_id")),
        agent_id=_agent_id(doc.get("agent_id")) or _agent_id(ownership.get("agent_id")),
        session_type=session_type if session_type in SESSION_TYPES else None,
    )


def _uuid(value: Any) -> str | None:
    return value.lower() if isinstance(value, str) and _UUID.match(value) else None


def _agent_id(value: Any) -> str | None:
    if isinstance(value, str) and len(value) <= _MAX_ID and _PRINTABLE.match(value):
        return value
    return None
