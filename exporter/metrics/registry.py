"""The collector registry: named parts, each producing metric families, rendered part by part.

A *part* (scratch, watcher, telemetry, headroom, attribution, build) builds its families fresh
from published, immutable snapshots; :class:`ExporterCollector` renders each part only when its
token changed and serves the rest from cached text, so a scrape never recomputes what did not move.

The registry alone reports on the parts, as node_exporter's ``execute()`` does: every render has
exactly one ``gpu_alloc_collector_success``, ``_duration_seconds`` and ``_last_success_timestamp_seconds``
sample per part, under a ``collector`` name fixed when the registry is built. A part that raises is
logged, shows ``success 0`` and contributes no series of its own (its last good output is dropped,
not served stale); it is never cached, so the next scrape tries it again.
"""

from __future__ import annotations

import gzip
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from exporter.metrics.collectors import Part
from exporter.metrics.status import Health, PartStatus, status_families
from exporter.metrics.text import gzip_member

__all__ = ["ExporterCollector", "merge", "render_families"]

log = logging.getLogger(__name__)


def merge(families: Iterable[Metric]) -> list[Metric]:
    """Families of the same name joined into one (several parts may add to one family).
    Builds new families, so cached ones are never mutated."""
    by_name: dict[str, Metric] = {}
    for fam in families:
        if fam.name not in by_name:
            by_name[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
        by_name[fam.name].samples.extend(fam.samples)
    return list(by_name.values())


@dataclass(frozen=True, slots=True)
class _Cached:
    token: Hashable
    text: bytes | None  # None for a part that gives a gzip member (Part.gzipped)
    gzipped: bytes | None  # else computed on the first gzip request
    duration_seconds: float  # the render that produced the text
    rendered_at: float  # unix time of that render: the part's last successful run

    def plain(self) -> bytes:
        return self.text if self.text is not None else gzip.decompress(self.gzipped)

    @property
    def source(self) -> bytes:
        """What this render of the part produced, the same object in either encoding: its text,
        or its gzip member for a part that gives only that."""
        return self.text if self.text is not None else self.gzipped


@dataclass(frozen=True, slots=True)
class _Body:
    """One exposition body and what it was joined from: each part's :attr:`_Cached.source` (None
    for a part that failed) and every status row."""

    sources: tuple[bytes | None, ...]
    rows: tuple[PartStatus, ...]
    body: bytes

    def joins(self, sources: list[bytes | None], rows: list[PartStatus]) -> bool:
        """Whether it is the body of these sources and rows (sources compared by identity: the
        same render of a part is the same bytes object)."""
        return (len(sources) == len(self.sources) and all(a is b for a, b in zip(sources, self.sources, strict=True))
                and tuple(rows) == self.rows)


def render_families(families: list[Metric]) -> bytes:
    """Families as text format 0.0.4, exactly as prometheus_client writes them."""
    return generate_latest(_Families(families))


class _Families:
    """The ``collect()`` protocol over a ready list, for ``generate_latest``."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


class ExporterCollector(Collector):
    """Every family of every part: a custom collector, plus cached rendering.

    Parts are independent, so adding one (telemetry, headroom, attribution) never touches this
    class. :meth:`render` renders each part only when its token changed and serves the rest from
    cached text (plain and gzip, or gzip alone: :attr:`Part.gzipped`): at 10,000 kernels the per-kernel families are ~20,000 samples,
    ~150 ms to render, and they change only with the scratch tree, not every telemetry sample.

    The body of each encoding is joined once per render and then handed out as that same bytes
    object to every scrape until a part or a status row changes (then it is dropped): a scrape
    costs no copy of the exposition, however many clients are still being sent it (2.2 MB plain
    at 5,000 kernels), and a plain scrape decompresses a gzip-only part once per render, not once
    per request.

    :param parts: the parts, in exposition order; their names are the ``collector`` label values.
    :param clock: unix time, for the last-success timestamp of parts that report none themselves.
    """

    def __init__(self, parts: Iterable[Part], clock: Callable[[], float] = time.time) -> None:
        self._parts = list(parts)
        names = [p.name for p in self._parts]
        if len(set(names)) != len(names):
            raise ValueError(f"collector part names repeat: {names}")
        self._clock = clock
        self._lock = threading.Lock()
        self._cache: dict[str, _Cached] = {}
        self._bodies: dict[bool, _Body] = {}  # gzipped -> the body of the current render in that encoding
        self._last_success: dict[str, float] = {}
        self._failing: set[str] = set()

    def collect(self) -> list[Metric]:
        """The prometheus_client protocol: every part's families built fresh, then the status families."""
        families, rows = [], []
        for part in self._parts:
            start = time.perf_counter()
            try:
                built = list(part.families())
                health = self._health(part)
            except Exception:
                self._failed(part)
                rows.append(self._row(part, False, time.perf_counter() - start, None, None))
                continue
            families += built
            rows.append(self._row(part, health.success, time.perf_counter() - start, health, self._clock()))
        return merge([*families, *status_families(rows)])

    def render(self, gzipped: bool = False) -> bytes:
        """The exposition in text format 0.0.4 (gzip members concatenated when ``gzipped``)."""
        with self._lock:
            body = self._render(gzipped)
        assert body is not None  # it may decompress
        return body

    def render_cached(self, gzipped: bool = False) -> bytes | None:
        """:meth:`render`'s bytes when every part's text in that encoding is current, else None,
        never waiting: None also while a render runs. What the serving loop calls; a None sends
        the request to a thread that renders. The body of an unchanged render is handed out as
        is (well under 1 ms); after a change it is joined once (~1 ms at 10,000 kernels), except
        a plain body that needs a gzip-only part decompressed (~15 ms): that is left to the
        render thread."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            for part in self._parts:
                cached = self._cache.get(part.name)
                if cached is None or cached.token != part.token():
                    return None
                if (cached.gzipped if gzipped else cached.source) is None:
                    return None
            return self._render(gzipped, decompress=gzipped)
        except Exception:  # a part's token failed: the render records it as the part's failure
            return None
        finally:
            self._lock.release()

    def _render(self, gzipped: bool, decompress: bool = True) -> bytes | None:
        """The body in one encoding; None if it would have to decompress a part and may not."""
        cached_parts: list[_Cached | None] = []
        rows: list[PartStatus] = []
        for part in self._parts:
            start = time.perf_counter()
            try:
                cached = self._current(part)
                if gzipped and cached.gzipped is None:
                    cached = _Cached(cached.token, cached.text, gzip_member(cached.text),
                                     cached.duration_seconds, cached.rendered_at)
                    self._cache[part.name] = cached
                health = self._health(part)
            except Exception:
                self._cache.pop(part.name, None)  # never serve a failed part's old series
                self._failed(part)
                cached_parts.append(None)
                rows.append(self._row(part, False, time.perf_counter() - start, None, None))
                continue
            cached_parts.append(cached)
            rows.append(self._row(part, health.success, cached.duration_seconds, health, cached.rendered_at))
        sources = [c.source if c is not None else None for c in cached_parts]
        for encoding, known in list(self._bodies.items()):
            if not known.joins(sources, rows):  # the render changed: release the old body
                del self._bodies[encoding]
        known = self._bodies.get(gzipped)
        if known is not None:
            return known.body
        if not gzipped and not decompress and any(c is not None and c.text is None for c in cached_parts):
            return None
        pieces = [(c.gzipped if gzipped else c.plain()) for c in cached_parts if c is not None]
        # The status families change with every change of a part and are tiny: rendered with the body.
        tail = render_families(status_families(rows))
        pieces.append(gzip_member(tail) if gzipped else tail)
        body = b"".join(pieces)
        self._bodies[gzipped] = _Body(tuple(sources), tuple(rows), body)
        return body

    def _current(self, part: Part) -> _Cached:
        token = part.token()
        cached = self._cache.get(part.name)
        if cached is None or cached.token != token:
            start = time.perf_counter()
            text = part.text() if part.text is not None else render_families(list(part.families()))
            plain, member = (None, text) if part.gzipped else (text, None)
            cached = _Cached(token, plain, member, time.perf_counter() - start, self._clock())
            self._cache[part.name] = cached
        return cached

    def _health(self, part: Part) -> Health:
        health = part.health() if part.health is not None else Health(True)
        if part.name in self._failing:
            self._failing.discard(part.name)
            log.info("collector %s recovered", part.name)
        return health

    def _failed(self, part: Part) -> None:
        # One traceback per failure streak: a part that fails on every scrape must not flood the log.
        if part.name not in self._failing:
            self._failing.add(part.name)
            log.exception("collector %s failed", part.name)

    def _row(self, part: Part, success: bool, duration: float, health: Health | None, ran_at: float | None) -> PartStatus:
        """The status row; a part's own figures (``health``) win over the registry's render figures."""
        if health is not None and health.duration_seconds is not None:
            duration = health.duration_seconds
        if health is not None and health.last_success_timestamp is not None:
            self._last_success[part.name] = health.last_success_timestamp
        elif success and ran_at is not None:
            self._last_success[part.name] = ran_at
        return PartStatus(part.name, success, duration, self._last_success.get(part.name))
