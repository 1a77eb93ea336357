"""Exposition text kept as bytes: compressed pieces that join into one gzip stream, text kept in
chunks of per-key segments, and the OpenMetrics 1.0 form of text format 0.0.4.

Nothing here needs prometheus_client, so the JSON routes use it too, and importing it costs the
exporter's start nothing.
"""

from __future__ import annotations

import functools
import re
import struct
import weakref
from array import array
from bisect import bisect_right, insort
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain
from operator import is_
from types import ModuleType
from typing import TypeVar

__all__ = ["EMPTY", "OPENMETRICS_EOF", "ChunkedText", "CreatedTimes", "Deflated", "Joiner", "deflate", "gzip_body",
           "inflate", "joined", "openmetrics_text"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Deflated:
    """Text compressed into raw deflate blocks (RFC 1951) that are not the stream's last and end on
    a byte boundary (a sync flush), with the text's CRC-32 and size: pieces concatenated are one
    deflate stream, and :func:`gzip_body` frames them as one gzip member (RFC 1952).

    A body is then one member, which every gzip reader takes whole: gzip members concatenated
    are valid gzip too, but libcurl (``curl --compressed``) stops after the first. False when it
    holds no text.

    A piece joined from others keeps their data as they are, in order (``blocks``), not copied
    into one bytes object: the body is the only copy made (:func:`gzip_body`), so a part of
    hundreds of pieces costs no copy of its text per render, and no memory beyond its pieces'.
    """

    blocks: tuple[bytes, ...]  # the deflate data, in order
    crc: int  # CRC-32 of the text
    size: int  # bytes of text

    def __bool__(self) -> bool:
        return self.size > 0

    @property
    def data(self) -> bytes:
        """The deflate data as one bytes object."""
        return self.blocks[0] if len(self.blocks) == 1 else b"".join(self.blocks)


EMPTY = Deflated((), 0, 0)
# A gzip member's head: deflate, no name, no mtime (0: a body says nothing of when it was made),
# no extra flags, OS unknown (255).
_GZIP_HEAD = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
# The last block of every body: a final, empty block with the fixed codes (BFINAL 1, BTYPE 01,
# then end-of-block), two bytes.
_LAST_BLOCK = b"\x03\x00"


def _isal() -> ModuleType:
    """python-isal's zlib module, loaded by the first render (after readiness)."""
    from isal import isal_zlib

    return isal_zlib


def deflate(text: bytes) -> Deflated:
    """``text`` as a :class:`Deflated` piece, at ISA-L's level 1 (python-isal): several times
    zlib's level 1 speed on exposition text, and smaller output (BENCHMARKS.md, figures behind
    design decisions)."""
    if not text:
        return EMPTY
    z = _isal()
    compressor = z.compressobj(1, z.DEFLATED, -15)  # -15: raw deflate, a 32 KiB window
    return Deflated((compressor.compress(text) + compressor.flush(z.Z_SYNC_FLUSH),), z.crc32(text), len(text))


def joined(pieces: Iterable[Deflated]) -> Deflated:
    """Pieces as one piece: their blocks one after another, the CRC-32s combined without the text."""
    pieces = [piece for piece in pieces if piece.size]
    if len(pieces) < 2:
        return pieces[0] if pieces else EMPTY
    crc, size = _combined([(piece.crc, piece.size) for piece in pieces])
    return Deflated(_blocks(pieces), crc, size)


def _blocks(pieces: list[Deflated]) -> tuple[bytes, ...]:
    return tuple(chain.from_iterable([piece.blocks for piece in pieces]))


def gzip_body(pieces: Iterable[Deflated]) -> bytes:
    """Pieces as one gzip member: a head, their deflate blocks, a final empty block, the trailer
    (CRC-32 and size modulo 2**32, little-endian)."""
    pieces = [piece for piece in pieces if piece.size]
    crc, size = _combined([(piece.crc, piece.size) for piece in pieces])
    return b"".join((_GZIP_HEAD, *_blocks(pieces), _LAST_BLOCK, struct.pack("<II", crc, size & 0xFFFFFFFF)))


class Joiner:
    """:func:`joined` for a caller that joins a long sequence of pieces again and again, most of
    them the same objects as the last time (the chunks of a part after a change).

    The CRC-32 of each run of ``run`` neighbouring pieces is kept while the run holds the same
    objects, so a join after one change combines about ``n / run + run`` CRCs instead of ``n``
    (the per-kernel families at 10,000 kernels are ~630 pieces; BENCHMARKS.md, figures behind
    design decisions). Not thread-safe: the caller serialises joins.
    """

    def __init__(self, run: int = 32) -> None:
        self._run = run
        self._runs: list[tuple[list[Deflated], int, int]] = []  # per run: its pieces, their CRC-32 and size

    def __call__(self, pieces: Iterable[Deflated]) -> Deflated:
        pieces = [piece for piece in pieces if piece.size]
        kept, runs = self._runs, []
        for n, start in enumerate(range(0, len(pieces), self._run)):
            run = pieces[start:start + self._run]
            old = kept[n] if n < len(kept) else None
            if old is None or len(old[0]) != len(run) or not all(map(is_, old[0], run)):
                old = (run, *_combined([(piece.crc, piece.size) for piece in run]))
            runs.append(old)
        self._runs = runs
        crc, size = _combined([(crc, size) for _, crc, size in runs])
        return Deflated(_blocks(pieces), crc, size) if pieces else EMPTY


def _combined(parts: list[tuple[int, int]]) -> tuple[int, int]:
    """The CRC-32 and size of texts one after another, from each one's CRC-32 and size
    (crc32_combine: without the text, in O(log size) each)."""
    if not parts:
        return 0, 0
    combine = _isal().crc32_combine
    crc, size = parts[0]
    for next_crc, next_size in parts[1:]:
        crc, size = combine(crc, next_crc, next_size), size + next_size
    return crc, size


def inflate(piece: Deflated) -> bytes:
    """The text of a piece."""
    if not piece:
        return b""
    z = _isal()
    return z.decompressobj(-15).decompress(piece.data)  # no final block: a one-shot decompress would refuse it


class ChunkedText:
    """Sections of per-key segments in key order, kept in chunks of neighbouring keys, so that a
    render encodes, joins and compresses only the chunks whose keys changed.

    Each section's text is every key's segment in that section, in key order. The keys are kept
    in chunks of about ``chunk_keys`` neighbours (bounded by their first keys, as a B-tree's
    leaves are, so a new key joins the chunk it sorts into and the others keep their contents);
    each chunk keeps its own text per section, or that text as a :class:`Deflated` piece (join them
    with a :class:`Joiner`). After one key changes a render encodes that key, splices its
    segments into its chunk's text at the offsets kept for each key, compresses that chunk again,
    and hands out the same bytes objects for the rest: the cost of a change is one key's and one
    chunk's compression, not the whole text's, at any number of keys.

    The objects must be immutable, so that an unchanged object encodes to the same segments (the
    allocation book hands out the same :class:`~exporter.scratch.allocation.Kernel` while a
    kernel is unchanged); objects compare with ``==``, which is identity first.

    Not thread-safe: the caller serialises renders.

    :param sections: segments per key (a key with nothing in a section encodes ``b""`` there).
    :param gzipped: keep (and hand out) each chunk's sections as :class:`Deflated` pieces
        (:func:`deflate`): an order of magnitude smaller than the text.
    :param weak: keep weak references to the objects a chunk was encoded from, not the objects:
        for a renderer called rarely, which must not keep ended objects alive until its next call.
    :param chunk_keys: the chunk size aimed at. A chunk is split past twice this and merged into
        its neighbour below a quarter of it. 64, for the per-kernel families at 10,000 kernels:
        the pieces take about a fifth more than the text compressed whole (16 keys: nearly
        twice), and a render after one change costs one chunk, not every kernel (BENCHMARKS.md,
        figures behind design decisions).
    """

    def __init__(self, sections: int, *, gzipped: bool = False, weak: bool = False, chunk_keys: int = 64) -> None:
        if chunk_keys < 4:
            raise ValueError("chunk_keys must be at least 4")
        self._sections = sections
        self._gzipped = gzipped
        self._weak = weak
        self._target = chunk_keys
        self._chunks: list[_Chunk] = []  # in key order
        self._firsts: list[str] = []  # each chunk's first key, for bisect
        self._keys: set[str] = set()  # every key of the last render

    def render(self, objects: Mapping[str, T], encode: Callable[[str, T], Sequence[bytes]],
               changed: Collection[str] | None = None) -> list[list[bytes | Deflated]]:
        """Per section, its pieces in key order (:class:`Deflated` if ``gzipped``; empty ones left
        out): ``b"".join`` (or :func:`joined`) of a section's pieces is its text (or its piece).

        :param objects: key -> the object its segments are encoded from.
        :param encode: ``(key, object)`` -> its segment in each section.
        :param changed: every key whose object may differ from the last render's (came, went or
            was replaced), where the caller knows them: only their chunks are compared, so a
            render after one change costs one chunk, not a look at every key (10,000 kernels:
            ~1.6 ms). None: every chunk is compared.
        """
        touched: set[int] = set()
        candidates: Iterable[int] | None = None
        if not self._chunks:
            order = sorted(objects)
            self._chunks = [_Chunk(order[i:i + self._target]) for i in range(0, len(order), self._target)]
            self._keys = set(order)
        elif changed is not None:
            gone = [k for k in changed if k in self._keys and k not in objects]
            came = [k for k in changed if k in objects and k not in self._keys]
            if gone or came:
                touched = self._move_keys(gone, came)
                self._keys.difference_update(gone)
                self._keys.update(came)
                self._firsts = [c.keys[0] for c in self._chunks]
            firsts = self._firsts
            candidates = sorted(touched.union(max(bisect_right(firsts, k) - 1, 0) for k in changed if k in objects))
        elif (keys := objects.keys()) != self._keys:  # a set comparison, no copy: keys come and go far less often than they change
            new = set(keys)
            touched = self._move_keys(self._keys - new, new - self._keys)
            self._keys = new
        get = objects.__getitem__
        for n in range(len(self._chunks)) if candidates is None else candidates:
            chunk = self._chunks[n]
            current = list(map(get, chunk.keys))
            kept = chunk.objects
            if self._weak and kept is not None:
                kept = list(map(_dereference, kept))  # None for an object gone since
            if kept is None:
                self._encode(chunk, current, encode)
            elif n in touched or current != kept:
                self._patch(chunk, current, kept, encode)
        self._firsts = [c.keys[0] for c in self._chunks]
        return [[c.pieces[s] for c in self._chunks if c.pieces[s]] for s in range(self._sections)]

    def _move_keys(self, gone: Iterable[str], came: Iterable[str]) -> set[int]:
        """Keys that went leave their chunks and keys that came join the chunks they sort into;
        chunks grown past twice the target are split, those shrunk below a quarter of it merged
        into their lower neighbour and empty ones dropped. The indexes of the chunks whose keys
        moved."""
        firsts, chunks = self._firsts, self._chunks
        moved: set[int] = set()
        for key in gone:
            n = max(bisect_right(firsts, key) - 1, 0)
            chunks[n].keys.remove(key)
            moved.add(n)
        for key in came:
            n = max(bisect_right(firsts, key) - 1, 0)
            insort(chunks[n].keys, key)
            moved.add(n)
        rebuilt: list[_Chunk] = []
        touched: set[int] = set()
        for n, chunk in enumerate(chunks):
            if n not in moved:
                rebuilt.append(chunk)
                continue
            if not chunk.keys:
                continue
            if rebuilt and len(chunk.keys) < self._target // 4:
                # Too small to be worth members of its own: joins its lower neighbour.
                chunk, low = rebuilt.pop(), chunk
                chunk.keys.extend(low.keys)
                chunk.objects = None
            if len(chunk.keys) > 2 * self._target:
                for i in range(0, len(chunk.keys), self._target):
                    touched.add(len(rebuilt))
                    rebuilt.append(_Chunk(chunk.keys[i:i + self._target]))
            else:
                touched.add(len(rebuilt))
                rebuilt.append(chunk)
        self._chunks = rebuilt
        return touched

    def _encode(self, chunk: _Chunk, current: list, encode: Callable[[str, T], Sequence[bytes]]) -> None:
        segments = [encode(k, o) for k, o in zip(chunk.keys, current, strict=True)]
        pieces, ends = [], []
        for s in range(self._sections):
            texts = [seg[s] for seg in segments]
            ends.append(array("I", accumulate(map(len, texts))))
            text = b"".join(texts)
            pieces.append(deflate(text) if self._gzipped else text)
        self._keep(chunk, current, pieces, ends)

    def _patch(self, chunk: _Chunk, current: list, kept: list, encode: Callable[[str, T], Sequence[bytes]]) -> None:
        """Encode only the keys that came or whose object changed; every other key's segments are
        cut from the chunk's text (inflated first if kept compressed) at the offsets kept for
        them: after one kernel changes, starts or ends, a render encodes one key, not its
        chunk's (BENCHMARKS.md, figures behind design decisions)."""
        at = {key: i for i, key in enumerate(chunk.encoded)}  # where each key was (keys may have come or gone)
        source = [i if (i := at.get(key, -1)) >= 0 and (new is kept[i] or new == kept[i]) else -1
                  for key, new in zip(chunk.keys, current, strict=True)]
        fresh = [j for j, i in enumerate(source) if i < 0]
        if len(fresh) > len(current) // 8:  # many: encoding the chunk whole costs about the same
            self._encode(chunk, current, encode)
            return
        segments = dict(zip(fresh, (encode(chunk.keys[j], current[j]) for j in fresh), strict=True))
        pieces, ends = [], []
        for s, (piece, bounds) in enumerate(zip(chunk.pieces, chunk.ends, strict=True)):
            text = inflate(piece) if self._gzipped else piece
            starts = [0, *bounds[:-1]]
            out = [text[starts[i]:bounds[i]] if i >= 0 else segments[j][s] for j, i in enumerate(source)]
            ends.append(array("I", accumulate(map(len, out))))
            text = b"".join(out)
            pieces.append(deflate(text) if self._gzipped else text)
        self._keep(chunk, current, pieces, ends)

    def _keep(self, chunk: _Chunk, current: list, pieces: list[bytes | Deflated], ends: list[array]) -> None:
        chunk.objects = list(map(weakref.ref, current)) if self._weak else current
        chunk.pieces, chunk.ends, chunk.encoded = pieces, ends, list(chunk.keys)


_dereference = weakref.ref.__call__


class _Chunk:
    """Neighbouring keys (sorted), the keys and objects its text was encoded from, and that text
    per section (or its :class:`Deflated` piece), with where each key's segment ends in it."""

    __slots__ = ("encoded", "ends", "keys", "objects", "pieces")

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self.encoded: list[str] = []  # the keys ``objects`` and the text are of (``keys`` moves first)
        self.objects: list | None = None  # None: not encoded yet
        self.pieces: list[bytes | Deflated] = []
        self.ends: list[array] = []  # per section, each key's segment's end offset in its text (bytes)


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


@functools.lru_cache(maxsize=1024)
def _metadata(run: bytes) -> tuple[bytes, bytes, bytes]:
    """One run of HELP and TYPE lines in OpenMetrics, with the name and type of its last family
    (the one the samples after the run belong to). Kept per run: the families' heads are the same
    at every render (a few hundred runs in all; ~36 per scrape after a kernel change, ~0.5 ms)."""
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
