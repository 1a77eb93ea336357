"""Exposition text kept as bytes: gzip members, text spliced from per-key segments, and the
OpenMetrics 1.0 form of text format 0.0.4.

Nothing here needs prometheus_client, so the JSON routes use it too, and importing it costs the
exporter's start nothing.
"""

from __future__ import annotations

import gzip
import re
from array import array
from collections.abc import Callable, Mapping, Sequence
from itertools import accumulate
from typing import TypeVar

__all__ = ["OPENMETRICS_EOF", "CreatedTimes", "SplicedText", "gzip_member", "openmetrics_text"]

T = TypeVar("T")


def gzip_member(text: bytes) -> bytes:
    """``text`` as one gzip member; members concatenated are one gzip stream (RFC 1952). Level 1:
    nearly level 6's size in well under half its time (BENCHMARKS.md, figures behind design decisions)."""
    return gzip.compress(text, compresslevel=1)


class SplicedText:
    """Text made of per-key segments in key order, one segment per key in each of ``sections``
    sections; a render encodes only the keys whose object changed and copies the rest from the
    previous output.

    The objects must be immutable, so that the same object always encodes to the same segments
    (the allocation book hands out the same :class:`~exporter.scratch.allocation.Kernel` while a
    kernel is unchanged). The previous output *is* the cache: a cache of each key's segments
    would hold the text twice, plus an object header per segment; here each key costs a 4-byte
    length per section. Unchanged
    neighbours are copied in runs, one slice per run, so after one change the new text is one
    join of a few pieces.

    Not thread-safe: the caller serialises renders.

    :param sections: segments per key (a key with nothing in a section encodes ``b""`` there).
    :param sep: written between neighbouring segments of a section.
    :param gzipped: keep the last text only as a gzip member (:func:`gzip_member`), and render
        that: an order of magnitude smaller, decompressed by the next render to copy from.
    """

    def __init__(self, sections: int, sep: bytes = b"", gzipped: bool = False) -> None:
        self._sections = sections
        self._sep = sep
        self._gzipped = gzipped
        self._last = b""  # the last render's output: the text, or its gzip member
        self._objects: Mapping[str, object] = {}  # what the last text was encoded from
        self._order: list[str] = []  # its keys, sorted
        self._section_starts: list[int] = []  # where each section begins in the last text
        # Per section, per key of ``_order``: its segment's length plus ``len(sep)``, as if every
        # segment were followed by a separator (bytes; "I": 4 bytes, far above one key's lines).
        self._strides = array("I")

    def render(self, objects: Mapping[str, T], encode: Callable[[str, T], Sequence[bytes]], frame: Sequence[bytes]) -> bytes:
        """``frame[0]``, section 0, ``frame[1]``, …, ``frame[sections]`` (as a gzip member if ``gzipped``).

        :param objects: key -> the object its segments are encoded from; keys sorted as ``str``.
        :param encode: ``(key, object)`` -> its segment in each section.
        """
        old_order, old_objects, n_old = self._order, self._objects, len(self._order)
        order = old_order if objects.keys() == old_objects.keys() else sorted(objects)
        # The new sections, key by key: [first, last] old positions of neighbours copied
        # together, or [None, the segments of a key encoded afresh].
        parts: list[list] = []
        i = 0
        for key in order:  # both orders are sorted: one merge walk finds every old position
            while i < n_old and old_order[i] < key:
                i += 1
            obj = objects[key]
            if i < n_old and old_order[i] == key and old_objects[key] is obj:
                if parts and parts[-1][0] is not None and parts[-1][1] == i - 1:
                    parts[-1][1] = i
                else:
                    parts.append([i, i])
            else:
                parts.append([None, encode(key, obj)])
        old = gzip.decompress(self._last) if self._gzipped and n_old else self._last
        sep, old, old_strides = self._sep, memoryview(old), self._strides
        pieces, strides, section_starts, pos = [], array("I"), [], 0
        for s in range(self._sections):
            pieces.append(frame[s])
            pos += len(frame[s])
            section_starts.append(pos)
            base = s * n_old
            # Where each old key's segment began (the last entry: the section's end + len(sep)).
            offsets = list(accumulate(old_strides[base:base + n_old], initial=self._section_starts[s])) if n_old else []
            for n, (first, last) in enumerate(parts):
                if n:
                    pieces.append(sep)
                    pos += len(sep)
                if first is None:
                    piece = last[s]
                    strides.append(len(piece) + len(sep))
                else:
                    piece = old[offsets[first]:offsets[last + 1] - len(sep)]
                    strides.extend(old_strides[base + first:base + last + 1])
                pieces.append(piece)
                pos += len(piece)
        pieces.append(frame[self._sections])
        text = b"".join(pieces)
        self._last = gzip_member(text) if self._gzipped else text
        self._objects, self._order, self._section_starts, self._strides = objects, order, section_starts, strides
        return self._last


# -- OpenMetrics ---------------------------------------------------------------------------------

TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"
OPENMETRICS_EOF = b"# EOF\n"  # the last line of an OpenMetrics body

# Base units a family name may end in (Prometheus naming); OpenMetrics requires a family's UNIT to
# be a suffix of its name, so the name says it.
_UNITS = (b"seconds", b"bytes", b"joules", b"watts", b"celsius", b"hertz", b"volts", b"amperes", b"meters", b"grams",
          b"ratio")
_METADATA = re.compile(rb"^(?:# (?:HELP|TYPE) [^\n]*\n)+", re.M)  # a run of HELP and TYPE lines


def negotiate(accept: str) -> bool:
    """Whether a scraper's ``Accept`` header asks for OpenMetrics 1.0 before text format 0.0.4,
    as the Prometheus Go client negotiates: media ranges by falling q-value (ties in header
    order); the first that is ``application/openmetrics-text`` (version 1.0.0 or none) wins
    OpenMetrics, the first that is ``text/plain`` (version 0.0.4 or none), ``text/*`` or ``*/*``
    wins text. Other ranges (OpenMetrics 0.0.1, which this exporter does not write, other types)
    and ranges with ``q=0`` or a malformed q-value are passed over; with none left, text."""
    ranges = []
    for n, item in enumerate(accept.split(",")):
        media, *params = (p.strip() for p in item.split(";"))
        q, version = 1.0, None
        for param in params:
            key, _, value = param.partition("=")
            key, value = key.strip().lower(), value.strip().strip('"')
            if key == "q":
                try:
                    q = min(float(value), 1.0)
                except ValueError:
                    q = 0.0
            elif key == "version":
                version = value
        if media and q > 0:
            ranges.append((-q, n, media.lower(), version))
    for _, _, media, version in sorted(ranges):
        if media == "application/openmetrics-text" and version in (None, "1.0.0"):
            return True
        if media == "text/plain" and version in (None, "0.0.4") or media in ("*/*", "text/*"):
            return False
    return False


class CreatedTimes:
    """Since when each counter series of one part counts, where that can be told, for the
    ``_created`` samples of its OpenMetrics form.

    A series' start is known only when the series was seen at 0: from then on its ``_created`` is
    that time, while the value never falls. A series first seen above 0 (a device's lifetime
    counter, one that counted before this exporter converted it) or seen falling (a reset at an
    unknown time) gets no ``_created`` until it is seen at 0 again: a wrong start would make a
    consumer that injects a zero at ``_created`` count the whole value again.

    Holds one entry per counter series with a known start, replaced at each conversion (a series
    gone from the text is forgotten).
    """

    def __init__(self) -> None:
        self._known: dict[bytes, tuple[float, float]] = {}  # series (name, labels) -> (start, last value); unix seconds

    def __len__(self) -> int:
        return len(self._known)


def openmetrics_text(text: bytes, created: CreatedTimes | None = None, at: float = 0.0) -> bytes:
    """``text`` (format 0.0.4 as prometheus_client writes it: each family's HELP and TYPE lines
    before its samples, no sample timestamps) in OpenMetrics 1.0, less the final line (append
    :data:`OPENMETRICS_EOF` to the body).

    Sample lines are kept as they are (labels and values are written alike in both formats); a
    counter family loses the ``_total`` of its name in HELP and TYPE, HELP escapes ``"``, ``untyped``
    becomes ``unknown``, and a family whose name ends in a base unit gets a ``# UNIT`` line.

    :param created: the part's :class:`CreatedTimes`, to write ``_created`` after each counter
        sample whose start is known, and to update; None: no ``_created``.
    :param at: when ``text`` was rendered (unix seconds): the start of a counter seen at 0 now.
    """
    runs = list(_METADATA.finditer(text))
    view = memoryview(text)
    pieces: list[bytes | memoryview] = [view[:runs[0].start()] if runs else view]
    known: dict[bytes, tuple[float, float]] = {}
    for n, run in enumerate(runs):
        end = runs[n + 1].start() if n + 1 < len(runs) else len(text)
        metadata, family, typ = _metadata(run.group())
        pieces.append(metadata)
        if created is not None and typ == b"counter":
            pieces.append(_with_created(bytes(view[run.end():end]), family, created._known, known, at))
        else:
            pieces.append(view[run.end():end])
    if created is not None:
        created._known = known
    return b"".join(pieces)


def _metadata(run: bytes) -> tuple[bytes, bytes, bytes]:
    """One run of HELP and TYPE lines in OpenMetrics, with the name and type of its last family
    (the one the samples after the run belong to)."""
    families: dict[bytes, dict[bytes, bytes]] = {}
    for line in run.splitlines():
        _, kind, name, rest = (line.split(b" ", 3) + [b""])[:4]
        families.setdefault(name, {})[kind] = rest
    out, family, typ = [], b"", b"unknown"
    for name, meta in families.items():
        family, typ = name, meta.get(b"TYPE", b"untyped")
        if typ == b"untyped":
            typ = b"unknown"
        elif typ == b"counter":
            if name.endswith(b"_total"):
                family = name[:-len(b"_total")]
            else:  # its samples are not named *_total: OpenMetrics has no counter for them
                typ = b"unknown"
        if b"HELP" in meta:
            out.append(b"# HELP %s %s\n" % (family, meta[b"HELP"].replace(b'"', b'\\"')))
        out.append(b"# TYPE %s %s\n" % (family, typ))
        unit = next((u for u in _UNITS if family.endswith(b"_" + u)), None)
        if unit is not None and typ in (b"gauge", b"counter", b"unknown", b"summary", b"histogram"):
            out.append(b"# UNIT %s %s\n" % (family, unit))
    return b"".join(out), family, typ


def _with_created(block: bytes, family: bytes, old: dict[bytes, tuple[float, float]],
                  new: dict[bytes, tuple[float, float]], at: float) -> bytes:
    """A counter family's samples, each followed by its ``_created`` where its start is known."""
    total, created_name = family + b"_total", family + b"_created"
    out = []
    for line in block.splitlines(keepends=True):
        out.append(line)
        if not line.startswith(total):
            continue
        series, _, value = line.rstrip(b"\n").rpartition(b" ")  # the exposition writes no timestamps
        try:
            v = float(value)
        except ValueError:
            continue
        prev = old.get(series)
        if prev is not None and v >= prev[1]:
            start = prev[0]  # still counting up from its known start
        elif v == 0:
            start = at  # new, or reset since: it counts from now
        else:
            continue  # first seen above 0, or fell (reset at an unknown time): start unknown
        new[series] = (start, v)
        out.append(b"%s%s %s\n" % (created_name, series[len(total):], repr(float(start)).encode()))
    return b"".join(out)
