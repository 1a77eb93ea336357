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
from functools import lru_cache, wraps
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
_REQUIRED = frozenset(REQUIRED_KEYS)
UNTERMINATED = "last line not yet terminated"  # the Pending reason of a file cut mid-line
_SHARES_SUFFIX = "_SHARES"
_SHARES_CUT = -len(_SHARES_SUFFIX)  # key[:_SHARES_CUT] is the slot
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

    def __reduce__(self):  # pickled by the scan's helper process: rebuilt from the three parts, not from args
        return type(self), (self.source, self.line, self.reason)


def _amount(slot: str, text: str) -> Decimal:
    """Counts are plain decimals; bytes may carry a BinarySize suffix. Either falls back to the other,
    so an agent plugin we have not heard of cannot make a valid file unreadable."""
    return _parse_amount(slot_kind(slot) is SlotKind.BYTES, text)


# The same few amounts ("1", "0.5", "4g") recur in every file: sharing the immutable Decimals
# saves memory for every kernel and most of the parsing time.
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
        if in_mounts:
            if key != "SLOTS":
                # Every writer puts SLOTS right after MOUNTS: anything between is a mount path that
                # held a newline. Never read it as keys: its text would reach labels.
                mounts_continued = True
                continue
            in_mounts = False
        if not sep or not key:
            continue  # the agent ignores lines without "=" (and an empty key names nothing)
        if key == "CID":
            container_id = value.strip() or None
        elif key.endswith(_SHARES_SUFFIX) and key != _SHARES_SUFFIX:
            shares[key[:_SHARES_CUT].lower()] = (lineno, value)
        else:
            values[key] = (lineno, value)
            in_mounts = key == "MOUNTS"

    if not values.keys() >= _REQUIRED:
        return Pending(f"missing {', '.join(k for k in REQUIRED_KEYS if k not in values)}", container_id)
    if unterminated.strip() and not unterminated.startswith("CID="):
        return Pending(UNTERMINATED, container_id)

    unreadable: list[str] = []
    slots = _parse_slots(source, *values["SLOTS"])
    if slots.unreadable:
        unreadable.append("slots-value")
    unified: tuple[tuple[str, str], ...] = ()
    if "UNIFIED_DEVICES" in values:
        unified = _parse_unified(source, *values["UNIFIED_DEVICES"])
    allocations: list[Allocation] = []
    for slot, (lineno, value) in shares.items():
        parsed = _parse_shares(source, lineno, value, slot, slot not in agent_bytes_slots)
        allocations.extend(parsed.allocations)
        if parsed.unreadable:
            unreadable.append("shares-amount")
    if mounts_continued or not _agent_reads_mounts(source, *values["MOUNTS"]):
        unreadable.append("mounts")
    if not _agent_reads_scratch_size(source, *values["SCRATCH_SIZE"]):
        unreadable.append("scratch-size")

    # SLOTS is written before the _SHARES lines: a requested accelerator slot without its line
    # means the writer has not got there yet. Unified devices have no _SHARES line by design.
    # Slot names compare case-insensitively, as the agent lower-cases the _SHARES key.
    unified_slots = {slot.lower() for _, slot in unified}
    for slot, folded in slots.awaited:
        if folded not in shares and folded not in unified_slots:
            return Pending(f"SLOTS requests {slot} but no {slot.upper()}{_SHARES_SUFFIX} line yet", container_id)
    return ResourceSpec(
        tuple(allocations), slots.requested, container_id, unified, tuple(sorted(set(unreadable))) if unreadable else ()
    )


# The value parsers below are memoised on the text of one value: a node's kernels repeat the same
# few SLOTS objects, share lines ("root:4g", "GPU-…:0.5") and MOUNTS. Only successful results are
# cached (lru_cache never stores a raised exception) and they are immutable, so kernels share
# them. A refusal is an _Invalid, without a location: the caller's file and line are added to it
# outside the cache. Values longer than _MEMO_MAX_CHARS skip the cache: at most _MEMO_SIZE
# values of at most that many characters are kept, however large a hostile file's lines are.
_MEMO_SIZE = 1024
_MEMO_MAX_CHARS = 1024


class _Invalid(Exception):
    """Why a value is malformed, before the file and line are known."""


def _value_parser(parse):
    """Memoise ``parse(value, *args)``, and call it as ``parser(source, lineno, value, *args)``:
    an :class:`_Invalid` it raises becomes the :class:`ResourceParseError` of that file and line."""
    cached = lru_cache(maxsize=_MEMO_SIZE)(parse)

    @wraps(parse)
    def parser(source: str, lineno: int, value: str, *args):
        try:
            return (cached if len(value) <= _MEMO_MAX_CHARS else parse)(value, *args)
        except _Invalid as exc:
            raise ResourceParseError(source, lineno, str(exc)) from None

    parser.cached = cached  # for tests: cache_info(), cache_clear()
    return parser


@_value_parser
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


@_value_parser
def _agent_reads_scratch_size(value: str) -> bool:
    try:
        parse_binary_size(value)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class _Slots:
    """One SLOTS value, parsed."""

    requested: tuple[tuple[str, Decimal], ...]
    unreadable: bool  # a value the agent's Decimal() refuses ("slots-value")
    # (slot, slot.lower()) of each requested accelerator slot with a non-zero amount: the file is
    # pending until it has that slot's _SHARES line (or names it a unified device's slot).
    awaited: tuple[tuple[str, str], ...]


@_value_parser
def _parse_slots(value: str) -> _Slots:
    try:
        obj = json.loads(value)
    except ValueError as exc:
        raise _Invalid(f"SLOTS is not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise _Invalid("SLOTS is nested too deeply") from None
    if not isinstance(obj, dict):
        raise _Invalid("SLOTS is not a JSON object")
    out = []
    unreadable = False
    # Errors name the entry by position, never by its text: a file's content may hold secrets.
    for position, (slot, amount) in enumerate(obj.items(), start=1):
        if amount is None:
            continue  # ResourceSlot.from_json skips null values
        if not isinstance(amount, (str, int, float)) or isinstance(amount, bool):
            raise _Invalid(f"SLOTS entry {position}: the amount is not a number")
        try:
            out.append((sys.intern(slot), _amount(slot, str(amount))))
        except ValueError as exc:
            raise _Invalid(f"SLOTS entry {position}: {exc}") from None
        if isinstance(amount, str) and not _is_plain_decimal(amount):
            unreadable = True  # ResourceSlot.from_json does Decimal(value)
    awaited = tuple((slot, slot.lower()) for slot, amount in out if amount and "." in slot)
    return _Slots(tuple(out), unreadable, awaited)


def _is_plain_decimal(text: str) -> bool:
    try:
        Decimal(text)
    except InvalidOperation:
        return False
    return True


@_value_parser
def _parse_unified(value: str) -> tuple[tuple[str, str], ...]:
    try:
        obj = json.loads(value or "[]")
    except ValueError as exc:
        raise _Invalid(f"UNIFIED_DEVICES is not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise _Invalid("UNIFIED_DEVICES is nested too deeply") from None
    if not isinstance(obj, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(s, str) for s in p) for p in obj
    ):
        raise _Invalid("UNIFIED_DEVICES is not a list of [device, slot] pairs")
    return tuple((d, s) for d, s in obj)


@dataclass(frozen=True, slots=True)
class _Shares:
    """One ``*_SHARES`` value, parsed."""

    allocations: tuple[Allocation, ...]
    unreadable: bool  # a size suffix the agent's Decimal() refuses in a count slot ("shares-amount")


@_value_parser
def _parse_shares(value: str, slot: str, agent_counts: bool) -> _Shares:
    """:param agent_counts: the agent reads this slot's amounts with ``Decimal()`` (not as bytes)."""
    if _BAD_ID.search(slot):
        raise _Invalid("the slot name in the key contains whitespace or control characters")
    per_device: dict[str, Allocation] = {}
    unreadable = False
    for position, entry in enumerate(value.split(","), start=1):
        try:
            parsed = (_share_entry_cached if len(entry) <= _ENTRY_MAX_CHARS else _share_entry)(entry, slot, agent_counts)
        except _Invalid as exc:
            raise _Invalid(f"{slot.upper()}{_SHARES_SUFFIX} entry {position}: {exc}") from None
        if parsed is not None:
            # A repeated device id overwrites, as upstream's dict assignment does.
            per_device[parsed[0].device_id] = parsed[0]
            unreadable = unreadable or parsed[1]
    return _Shares(tuple(per_device.values()), unreadable)


# The entries of share lines ("GPU-…:0.5", "root:4g") repeat across kernels far more than whole
# lines do: a kernel holding several devices makes a line of its own, from entries many others hold.
_ENTRY_MEMO_SIZE = 4096
_ENTRY_MAX_CHARS = 256  # a device id and an amount; longer entries are parsed every time


def _share_entry(entry: str, slot: str, agent_counts: bool) -> tuple[Allocation, bool] | None:
    """One ``device:amount`` entry of a share line: its allocation, and whether the agent's
    ``Decimal()`` refuses its amount (None: an entry the agent skips)."""
    # The agent keeps the device id as written (a space after a comma stays in the id).
    device_id, _, amount = entry.partition(":")
    # Upstream skips entries with an empty side; so do we, so both read the same totals.
    if not device_id or not amount:
        return None
    if _BAD_ID.search(device_id):
        raise _Invalid("the device id contains whitespace or control characters")
    amount = amount.strip()
    try:
        value = _amount(slot, amount)
    except ValueError as exc:
        raise _Invalid(str(exc)) from None
    # Ids and slots repeat across kernels ("0", "root", a GPU's uuid): interned, they are shared.
    return Allocation(sys.intern(slot), sys.intern(device_id), value), agent_counts and not _is_plain_decimal(amount)


_share_entry_cached = lru_cache(maxsize=_ENTRY_MEMO_SIZE)(_share_entry)
