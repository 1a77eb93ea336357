"""The ``config/resource.txt`` grammar of Backend.AI kernels: a pure parser from text to a typed spec.

Every agent version since 22.03 writes the same ``KEY=VALUE`` lines, in varying order::

    CID=3b9e...                      # first line before 24.12; appended last (and again per restart) since
    SCRATCH_SIZE=0m
    MOUNTS=/src:/home/config:ro,...   # never exported: host paths
    SLOTS={"cpu":"4","mem":"17179869184","cuda.shares":"1.2"}   # spaced JSON before 25.6
    UNIFIED_DEVICES=[]               # 25.18+
    CUDA.SHARES_SHARES=GPU-5d2c...:0.60,GPU-a81e...:0.60
    CPU_SHARES=0:1,1:1
    MEM_SHARES=root:16g              # BinarySize for bytes slots
    CUDA_GLOBAL_DEVICE_IDS=...        # plugin lines: ignored

Lines are read as the newest agent's ``KernelResourceSpec.read_from_string`` reads them: each
line is stripped, a line without ``=`` is ignored, the key is everything before the first ``=``
(so ``KEY =value`` is another key, and ignored), and later duplicates win (so the last ``CID``
wins). Every ``*_SHARES`` key is a slot (``key[:-7].lower()``, spaces inside kept), so slots
nobody has seen before need no code change; slot names compare case-insensitively. Device ids are
kept exactly as written, a leading space included (``a:0.5, b:0.5`` names `` b``), as the agent
keeps them. A ``null`` value in ``SLOTS`` is skipped.

The agent writes the file in place (truncate, then write), so a reader can see a prefix of it.
A file missing ``SCRATCH_SIZE``, ``MOUNTS`` or ``SLOTS``, one whose ``SLOTS`` asks for an
accelerator slot with no ``_SHARES`` line yet, or one whose last line is not yet terminated while
the writer may still have it open, is *pending*, not malformed. Once the writer has closed the
file (``closed=True``), an unterminated last line is read like any other, as the agent reads it.
Anything that would put nonsense into a metric (NaN, negative amounts, control characters in
ids) is a :class:`ResourceParseError` naming the file, the line and the reason.

Some files this parser reads make the agent's own reader raise, and so stop the agent's
``scan_gpu_alloc_map`` at that file: :attr:`ResourceSpec.agent_unreadable` says why
(:data:`AGENT_UNREADABLE_REASONS`).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from enum import Enum
from functools import lru_cache
from pathlib import PurePosixPath

from exporter.units import parse_binary_size, parse_decimal

__all__ = [
    "AGENT_BYTES_SLOTS",
    "AGENT_UNREADABLE_REASONS",
    "UNTERMINATED",
    "Allocation",
    "Pending",
    "ResourceParseError",
    "ResourceSpec",
    "SlotKind",
    "parse_resource",
    "slot_kind",
]

REQUIRED_KEYS = ("SCRATCH_SIZE", "MOUNTS", "SLOTS")
UNTERMINATED = "last line not yet terminated"  # the Pending reason of a file cut mid-line
_SHARES_SUFFIX = "_SHARES"
# Device ids and slot names reach metric labels and logs; a control character there is never
# legitimate. A plain space is kept, as the agent keeps it; any other whitespace is refused.
_BAD_ID = re.compile(r"[\x00-\x1f\x7f]|[^\S ]")
# Slots the newest open-source agent registers as ``bytes`` (the intrinsic ``mem``); any other
# slot is read with ``Decimal()``, which refuses a BinarySize such as ``10g``.
AGENT_BYTES_SLOTS = frozenset({"mem"})
AGENT_UNREADABLE_REASONS = {
    "mounts": "a MOUNTS entry the agent's Mount.from_str rejects (not source:target:perm)",
    "scratch-size": "SCRATCH_SIZE is not a finite BinarySize",
    "slots-value": "a SLOTS value that is not a plain decimal (a BinarySize string such as 1g)",
    "shares-amount": "a _SHARES amount with a size suffix in a slot the agent does not register as bytes",
}
"""Why the agent's own reader raises on a file this parser reads (``ResourceSpec.agent_unreadable``)."""
_MOUNT_PERMS = frozenset({"ro", "rw", "wd"})


class SlotKind(str, Enum):
    """How a slot's amounts are measured: a plain count (cores, GPUs, fGPU) or bytes."""

    COUNT = "count"
    BYTES = "bytes"


def slot_kind(slot: str) -> SlotKind:
    """Backend.AI's own guess (``ResourceSlot._guess_slot_type``): any slot naming ``mem`` is bytes."""
    return SlotKind.BYTES if "mem" in slot else SlotKind.COUNT


@dataclass(frozen=True, slots=True)
class Allocation:
    """An amount of one slot on one device, exactly as the kernel's file states it."""

    slot: str
    device_id: str
    amount: Decimal  # bytes for BYTES slots, else a count (fGPU shares, GPUs, cores)


@dataclass(frozen=True, slots=True)
class ResourceSpec:
    """A complete ``resource.txt``: what a kernel requested and what it holds on which device."""

    allocations: tuple[Allocation, ...]
    requested: tuple[tuple[str, Decimal], ...]  # the SLOTS object, in file order
    container_id: str | None  # the last CID= line; None before the agent appends one (and always on Kubernetes)
    unified_devices: tuple[tuple[str, str], ...] = ()
    # Keys of AGENT_UNREADABLE_REASONS: why the agent's own reader would raise on this file.
    agent_unreadable: tuple[str, ...] = ()

    def slots(self) -> frozenset[str]:
        return frozenset(a.slot for a in self.allocations)


@dataclass(frozen=True, slots=True)
class Pending:
    """The agent is still writing the file; try again on the next event or rescan."""

    reason: str
    container_id: str | None = None


class ResourceParseError(ValueError):
    """A malformed ``resource.txt``; ``str()`` reads ``path:line: reason``."""

    def __init__(self, source: str, line: int | None, reason: str) -> None:
        self.source, self.line, self.reason = source, line, reason
        where = f"{source}:{line}" if line else source
        super().__init__(f"{where}: {reason}")


def _amount(slot: str, text: str) -> Decimal:
    """Counts are plain decimals; bytes may carry a BinarySize suffix. Either falls back to the other,
    so an agent plugin we have not heard of cannot make a valid file unreadable."""
    return _parse_amount(slot_kind(slot) is SlotKind.BYTES, text)


# The same few amounts ("1", "0.5", "4g") recur in every file: sharing the immutable Decimals
# saves ~1 KiB per kernel at 10,000 kernels and most of the parsing time.
@lru_cache(maxsize=4096)
def _parse_amount(is_bytes: bool, text: str) -> Decimal:
    if is_bytes:
        try:
            return Decimal(parse_binary_size(text))
        except ValueError as exc:
            try:
                return parse_decimal(text)
            except ValueError:
                raise exc from None
    try:
        return parse_decimal(text)
    except ValueError as exc:
        try:
            return Decimal(parse_binary_size(text))
        except ValueError:
            raise exc from None


def parse_resource(
    text: str,
    source: str = "<resource.txt>",
    *,
    closed: bool = False,
    agent_bytes_slots: frozenset[str] = AGENT_BYTES_SLOTS,
) -> ResourceSpec | Pending:
    """Parse the text of one ``resource.txt``.

    :param text: the file's content, already decoded.
    :param source: the file's path, used only in error messages.
    :param closed: the writer has closed the file (a close-after-write event was seen, or nothing
        changed it for the settle time): an unterminated last line is then complete.
    :param agent_bytes_slots: slots the agent on this node registers as ``bytes``; only used to
        tell whether the agent's own reader would fail (``agent_unreadable``).
    :returns: a :class:`ResourceSpec`, or :class:`Pending` while the agent is still writing.
    :raises ResourceParseError: for a malformed file.
    """
    if "\x00" in text:
        raise ResourceParseError(source, None, "contains NUL bytes (binary data)")
    lines = text.split("\n")
    # A file written in place can be cut anywhere; an unterminated last line may be half a line,
    # until the writer has closed the file.
    unterminated = "" if closed else (lines.pop() if lines else "")
    values: dict[str, tuple[int, str]] = {}
    shares: dict[str, tuple[int, str]] = {}
    container_id: str | None = None
    mounts_continued = False
    in_mounts = False
    for lineno, raw in enumerate(lines, start=1):
        # The agent strips the whole line, then splits once on "=": "KEY =v" is the key "KEY ".
        key, sep, value = raw.strip().partition("=")
        if in_mounts and key != "SLOTS":
            # Every writer puts SLOTS right after MOUNTS: anything between is a mount path that
            # held a newline. Never read it as keys: its text would reach labels.
            mounts_continued = True
            continue
        in_mounts = key == "MOUNTS" and bool(sep)
        if not sep or not key:
            continue  # the agent ignores lines without "=" (and an empty key names nothing)
        if key == "CID":
            container_id = value.strip() or None
        elif key.endswith(_SHARES_SUFFIX) and len(key) > len(_SHARES_SUFFIX):
            shares[key[: -len(_SHARES_SUFFIX)].lower()] = (lineno, value)
        else:
            values[key] = (lineno, value)

    missing = [k for k in REQUIRED_KEYS if k not in values]
    if missing:
        return Pending(f"missing {', '.join(missing)}", container_id)
    if unterminated.strip() and not unterminated.startswith("CID="):
        return Pending(UNTERMINATED, container_id)

    unreadable: list[str] = []
    requested = _parse_slots(source, *values["SLOTS"], unreadable)
    unified = _parse_unified(source, *values["UNIFIED_DEVICES"]) if "UNIFIED_DEVICES" in values else ()
    allocations: list[Allocation] = []
    for slot, (lineno, value) in shares.items():
        allocations.extend(_parse_shares(source, lineno, slot, value, agent_bytes_slots, unreadable))
    if mounts_continued or not _agent_reads_mounts(values["MOUNTS"][1]):
        unreadable.append("mounts")
    if not _agent_reads_scratch_size(values["SCRATCH_SIZE"][1]):
        unreadable.append("scratch-size")

    # SLOTS is written before the _SHARES lines: a requested accelerator slot without its line
    # means the writer has not got there yet. Unified devices have no _SHARES line by design.
    # Slot names compare case-insensitively, as the agent lower-cases the _SHARES key.
    unified_slots = {slot.lower() for _, slot in unified}
    for slot, amount in requested:
        folded = slot.lower()
        if amount and "." in slot and folded not in shares and folded not in unified_slots:
            return Pending(f"SLOTS requests {slot} but no {slot.upper()}{_SHARES_SUFFIX} line yet", container_id)
    return ResourceSpec(tuple(allocations), requested, container_id, unified, tuple(sorted(set(unreadable))))


def _agent_reads_mounts(value: str) -> bool:
    """Whether every entry passes the agent's ``Mount.from_str`` (``source:target:perm``)."""
    for entry in value.split(","):
        if not entry:
            continue
        parts = entry.split(":")
        if len(parts) != 3:
            return False
        source, target, perm = parts
        if not source.startswith("/") and len(PurePosixPath(source).parts) != 1:
            return False  # a relative source is a volume name: one path component only
        if not target.startswith("/") or perm not in _MOUNT_PERMS:
            return False
    return True


def _agent_reads_scratch_size(value: str) -> bool:
    try:
        parse_binary_size(value)
    except ValueError:
        return False
    return True


def _parse_slots(source: str, lineno: int, value: str, unreadable: list[str]) -> tuple[tuple[str, Decimal], ...]:
    try:
        obj = json.loads(value)
    except ValueError as exc:
        raise ResourceParseError(source, lineno, f"SLOTS is not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise ResourceParseError(source, lineno, "SLOTS is nested too deeply") from None
    if not isinstance(obj, dict):
        raise ResourceParseError(source, lineno, "SLOTS is not a JSON object")
    out = []
    # Errors name the entry by position, never by its text: a file's content may hold secrets.
    for position, (slot, amount) in enumerate(obj.items(), start=1):
        if amount is None:
            continue  # ResourceSlot.from_json skips null values
        if not isinstance(amount, (str, int, float)) or isinstance(amount, bool):
            raise ResourceParseError(source, lineno, f"SLOTS entry {position}: the amount is not a number")
        try:
            out.append((sys.intern(slot), _amount(slot, str(amount))))
        except ValueError as exc:
            raise ResourceParseError(source, lineno, f"SLOTS entry {position}: {exc}") from None
        if isinstance(amount, str) and not _is_plain_decimal(amount):
            unreadable.append("slots-value")  # ResourceSlot.from_json does Decimal(value)
    return tuple(out)


def _is_plain_decimal(text: str) -> bool:
    try:
        Decimal(text)
    except InvalidOperation:
        return False
    return True


def _parse_unified(source: str, lineno: int, value: str) -> tuple[tuple[str, str], ...]:
    try:
        obj = json.loads(value or "[]")
    except ValueError as exc:
        raise ResourceParseError(source, lineno, f"UNIFIED_DEVICES is not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise ResourceParseError(source, lineno, "UNIFIED_DEVICES is nested too deeply") from None
    if not isinstance(obj, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(s, str) for s in p) for p in obj
    ):
        raise ResourceParseError(source, lineno, "UNIFIED_DEVICES is not a list of [device, slot] pairs")
    return tuple((d, s) for d, s in obj)


def _parse_shares(
    source: str, lineno: int, slot: str, value: str, agent_bytes_slots: frozenset[str], unreadable: list[str]
) -> list[Allocation]:
    key = slot.upper() + _SHARES_SUFFIX
    if _BAD_ID.search(slot):
        raise ResourceParseError(source, lineno, "the slot name in the key contains whitespace or control characters")
    per_device: dict[str, Decimal] = {}
    agent_counts = slot not in agent_bytes_slots
    for position, entry in enumerate(value.split(","), start=1):
        # The agent keeps the device id as written (a space after a comma stays in the id).
        device_id, _, amount = entry.partition(":")
        # Upstream skips entries with an empty side; so do we, so both read the same totals.
        if not device_id or not amount:
            continue
        if _BAD_ID.search(device_id):
            raise ResourceParseError(source, lineno, f"{key} entry {position}: the device id contains whitespace or control characters")
        amount = amount.strip()
        try:
            # A repeated device id overwrites, as upstream's dict assignment does. Ids repeat
            # across kernels ("0", "root", a GPU's uuid): intern them.
            per_device[sys.intern(device_id)] = _amount(slot, amount)
        except ValueError as exc:
            raise ResourceParseError(source, lineno, f"{key} entry {position}: {exc}") from None
        if agent_counts and not _is_plain_decimal(amount):
            unreadable.append("shares-amount")
    slot = sys.intern(slot)
    return [Allocation(slot, d, a) for d, a in per_device.items()]
