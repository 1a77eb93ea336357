"""The collector registry: named parts, each producing metric families, rendered part by part.

A *part* (scratch, watcher, telemetry, headroom, attribution, build) builds its families fresh
from published, immutable snapshots; :class:`ExporterCollector` renders each part only when its
token changed and serves the rest from cached text, so a scrape never recomputes what did not move.

The registry alone reports on the parts, as node_exporter's ``execute()`` does: every render has
exactly one ``gpu_alloc_collector_success``, ``_duration_seconds`` and ``_last_success_timestamp_seconds``
sample per part, under a ``collector`` name fixed when the registry is built. A part that raises is
logged, shows ``success 0`` and contributes no series of its own (its last good output is dropped,
not served stale); it is never cached, so the next scrape tries it again.

Two formats: text format 0.0.4 for every scraper that does not ask otherwise, and OpenMetrics 1.0
(:func:`~exporter.metrics.text.openmetrics_text`) made from each part's cached text the first
time a scraper asks for it after the part changed, so that a fleet of text scrapers never pays
for it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from exporter.metrics.collectors import Part
from exporter.metrics.families import escape_label, float_format
from exporter.metrics.status import Health, PartStatus, status_families
from exporter.metrics.text import OPENMETRICS_EOF, CreatedTimes, Deflated, deflate, gzip_body, inflate, openmetrics_text

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
    """One render of a part: its text format 0.0.4 and, once asked for, its OpenMetrics form
    (``om_*``), each kept as plain text and compressed piece, or as the piece alone."""

    token: Hashable
    text: bytes | None  # None for a part that gives a compressed piece (Part.gzipped)
    gzipped: Deflated | None  # else computed on the first gzip request
    duration_seconds: float  # the render that produced the text
    rendered_at: float  # unix time of that render: the part's last successful run
    # The OpenMetrics form, made from the text on the first request for it; a gzipped part keeps
    # only its piece (om_text None), as it does for the text.
    om_text: bytes | None = None
    om_gzipped: Deflated | None = None

    def plain(self, openmetrics: bool = False) -> bytes:
        text, piece = (self.om_text, self.om_gzipped) if openmetrics else (self.text, self.gzipped)
        return text if text is not None else inflate(piece)

    def held(self, openmetrics: bool, gzipped: bool) -> bytes | Deflated | None:
        """The bytes of one form in one encoding if they are kept, else None."""
        if openmetrics:
            return self.om_gzipped if gzipped else self.om_text
        return self.gzipped if gzipped else self.text

    def has(self, openmetrics: bool) -> bool:
        """Whether the form is made (in either encoding)."""
        return not openmetrics or self.om_text is not None or self.om_gzipped is not None

    @property
    def source(self) -> bytes | Deflated:
        """What this render of the part produced, the same object in either encoding: its text,
        or its piece for a part that gives only that."""
        return self.text if self.text is not None else self.gzipped


@dataclass(frozen=True, slots=True)
class _Body:
    """One exposition body and what it was joined from: each part's :attr:`_Cached.source` (None
    for a part that failed) and every status row (the same for both formats: the OpenMetrics form
    of a part is made from its text)."""

    sources: tuple[bytes | Deflated | None, ...]
    rows: tuple[PartStatus, ...]
    body: bytes

    def joins(self, sources: list[bytes | Deflated | None], rows: list[PartStatus]) -> bool:
        """Whether it is the body of these sources and rows (sources compared by identity: the
        same render of a part is the same object)."""
        return (len(sources) == len(self.sources) and all(a is b for a, b in zip(sources, self.sources, strict=True))
                and tuple(rows) == self.rows)


def render_families(families: list[Metric]) -> bytes:
    """Families as text format 0.0.4, exactly as prometheus_client's ``generate_latest`` writes them.

    Every part that is not a text renderer of its own is written here after each change of its
    inputs, so after a kernel change a scrape writes a few hundred samples here. The library
    checks and escapes every metric and label name of every sample (Unicode names), and moves
    OpenMetrics-only samples aside: several times the cost of writing the line (BENCHMARKS.md,
    figures behind design decisions). This exporter's names are all legacy names, checked once
    each here; a family with anything else (a name that needs escaping, a timestamp, a
    ``_created``, ``_gsum`` or ``_gcount`` sample) is written by the library itself. A property
    test holds the two together.
    """
    fmt = float_format()
    out: list[str] = []
    for family in families:
        name, kind = family.name, family.type
        special = (name + "_created", name + "_gsum", name + "_gcount")
        if not _legacy_name(name) or any(
                s.timestamp is not None or s.name in special or not _legacy_name(s.name)
                or not all(map(_legacy_label, s.labels)) for s in family.samples):
            out.append(generate_latest(_Families([family])).decode())
            continue
        shown = name + _SHOWN_SUFFIX.get(kind, "")
        doc = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
        out.append(f"# HELP {shown} {doc}\n# TYPE {shown} {_SHOWN_TYPE.get(kind, kind)}\n")
        for s in family.samples:
            if s.labels:
                labels = ",".join([f'{k}="{escape_label(v)}"' for k, v in sorted(s.labels.items())])
                out.append(f"{s.name}{{{labels}}} {fmt(s.value)}\n")
            else:
                out.append(f"{s.name} {fmt(s.value)}\n")
    return "".join(out).encode()


# How generate_latest names and types a family in text format 0.0.4.
_SHOWN_SUFFIX = {"counter": "_total", "info": "_info"}
_SHOWN_TYPE = {"info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram", "unknown": "untyped"}


@functools.lru_cache(maxsize=4096)
def _legacy_name(name: str) -> bool:
    return re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", name) is not None


@functools.lru_cache(maxsize=4096)
def _legacy_label(name: str) -> bool:
    return re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", name) is not None and not name.startswith("__")


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
    cached text (plain and compressed, or compressed alone: :attr:`Part.gzipped`): the per-kernel families
    are most of the exposition and of its render time, and they change only with the scratch
    tree, not every telemetry sample.

    The body of each format and encoding is joined once per render and then handed out as that
    same bytes object to every scrape until a part or a status row changes (then it is dropped):
    a scrape costs no copy of the exposition, however many clients are still being sent it, and
    a plain scrape inflates a compressed-only part once per render, not once per request. A gzip
    body is one gzip member: the parts' compressed pieces and the status families' joined
    (:func:`~exporter.metrics.text.gzip_body`), with no part compressed again.

    :param parts: the parts, in exposition order; their names are the ``collector`` label values.
    :param clock: unix time, for the last-success timestamp of parts that report none themselves.
    :param openmetrics_created: write ``_created`` after the counter samples of the OpenMetrics
        form whose start is known (:class:`~exporter.metrics.text.CreatedTimes`). Off by default:
        Prometheus 2.42 and VictoriaMetrics store each as a series of its own.
    :param monotonic: seconds, for when scrapes came (:meth:`render_ahead`).
    """

    def __init__(self, parts: Iterable[Part], clock: Callable[[], float] = time.time, *,
                 openmetrics_created: bool = False, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._parts = list(parts)
        names = [p.name for p in self._parts]
        if len(set(names)) != len(names):
            raise ValueError(f"collector part names repeat: {names}")
        self._clock = clock
        self._lock = threading.Lock()
        # The parts a render ahead is making (outside the lock) and its end: meanwhile a scrape
        # serves their last render, or waits for the next where that lacks its form.
        self._ahead: set[str] = set()
        self._ahead_done = threading.Condition(self._lock)
        self._cache: dict[str, _Cached] = {}
        self._bodies: dict[tuple[bool, bool], _Body] = {}  # (openmetrics, gzipped) -> the current render's body
        self._created: dict[str, CreatedTimes] | None = {} if openmetrics_created else None  # part name -> its counters
        self._last_success: dict[str, float] = {}
        self._failing: set[str] = set()
        self._monotonic = monotonic
        self._scraped: deque[float] = deque(maxlen=4)  # when the last scrapes came (monotonic seconds)
        self._form = (False, False)  # the last scrape's (openmetrics, gzipped)

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

    def render(self, gzipped: bool = False, openmetrics: bool = False) -> bytes:
        """The exposition in text format 0.0.4, or in OpenMetrics 1.0 (one gzip member when
        ``gzipped``)."""
        with self._lock:
            body = self._render(gzipped, openmetrics=openmetrics)
            self._scrape(openmetrics, gzipped)
        assert body is not None  # it may decompress
        return body

    def render_cached(self, gzipped: bool = False, openmetrics: bool = False) -> bytes | None:
        """:meth:`render`'s bytes when every part's text in that format and encoding is current,
        else None, never waiting: None also while a render runs. What the serving loop calls; a
        None sends the request to a thread that renders. The body of an unchanged render is
        handed out as is; after a change it is joined once here, a copy of bytes at hand. What
        takes longer is left to the render thread: a plain body that needs a compressed-only part
        inflated, and a part's OpenMetrics form not made yet."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            for part in self._parts:
                cached = self._cache.get(part.name)
                if cached is None or (cached.token != part.token() and part.name not in self._ahead):
                    return None
                if not cached.has(openmetrics) or (gzipped and cached.held(openmetrics, True) is None):
                    return None
            body = self._render(gzipped, decompress=gzipped, openmetrics=openmetrics)
            if body is not None:
                self._scrape(openmetrics, gzipped)
            return body
        except Exception:  # a part's token failed: the render records it as the part's failure
            return None
        finally:
            self._lock.release()

    def render_ahead(self, next_pass_in: float) -> bool:
        """Render the parts marked :attr:`Part.ahead` whose token moved (a usage pass was just
        published), if the next scrape is expected before the next pass, ``next_pass_in`` seconds
        from now: that scrape reads this pass's result, and finds it rendered instead of waiting
        for it (the ledger's render is the longest of a scrape's). Scrapes are expected at the
        median interval of the last ones after the last (a late one any moment); none expected
        (fewer than three scrapes, or none for two intervals): nothing is rendered ahead, so a
        node nobody scrapes renders nothing, and one scraped every 15 s with a pass every 5 s
        renders once per scrape, as it would in the scrape. Returns whether it rendered. Called
        on the analysis thread.

        The parts are rendered outside the registry's lock: a scrape meanwhile serves their last
        render (one pass older: the ledger's counters as of the pass before, still monotonic)
        instead of waiting for the new one (~20-35 ms at 10,000 kernels, BENCHMARKS.md i10), or
        waits for it where the last render lacks the form it asks for. A part's render may step
        aside while kernels change (:attr:`~exporter.metrics.collectors.Inputs.aside`): scrapes
        are then served the same way."""
        scraped, now = list(self._scraped), self._monotonic()
        if len(scraped) < 3:
            return False
        gap = sorted(b - a for a, b in itertools.pairwise(scraped))[(len(scraped) - 1) // 2]
        if gap <= 0.0 or now - scraped[-1] > 2 * gap:
            return False
        expected = scraped[-1] + gap  # past: a late scrape, expected any moment
        if expected > now + next_pass_in:
            return False
        with self._lock:
            parts = [part for part in self._parts if part.ahead]
            kept = {part.name: self._cache.get(part.name) for part in parts}
            form = self._form  # the last scrape's format and encoding
            self._ahead.update(kept)
        made: dict[str, _Cached | None] = {}
        try:
            for part in parts:  # only this thread renders these parts until they are unmarked
                try:
                    made[part.name] = self._make(part, kept[part.name], *form)
                except Exception:  # the scrape renders it again, and reports the failure
                    made[part.name] = None
        finally:
            with self._lock:
                for name, cached in made.items():
                    if cached is None:
                        self._cache.pop(name, None)
                    elif cached is not kept[name]:  # else a scrape may have added a form to it meanwhile
                        self._cache[name] = cached
                self._ahead.difference_update(kept)
                self._ahead_done.notify_all()
        return True

    def _scrape(self, openmetrics: bool, gzipped: bool) -> None:
        self._scraped.append(self._monotonic())
        self._form = (openmetrics, gzipped)

    def _render(self, gzipped: bool, decompress: bool = True, openmetrics: bool = False) -> bytes | None:
        """The body in one format and encoding; None if it would have to inflate a part and may not."""
        cached_parts: list[_Cached | None] = []
        rows: list[PartStatus] = []
        for part in self._parts:
            start = time.perf_counter()
            try:
                cached = self._made(part, openmetrics, gzipped)
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
        known = self._bodies.get((openmetrics, gzipped))
        if known is not None:
            return known.body
        if not gzipped and not decompress and any(c is not None and c.held(openmetrics, False) is None for c in cached_parts):
            return None
        pieces = [(c.held(openmetrics, True) if gzipped else c.plain(openmetrics)) for c in cached_parts if c is not None]
        # The status families change with every change of a part and are tiny: rendered with the body.
        tail = render_families(status_families(rows))
        if openmetrics:
            tail = openmetrics_text(tail) + OPENMETRICS_EOF
        pieces.append(deflate(tail) if gzipped else tail)
        body = gzip_body(pieces) if gzipped else b"".join(pieces)
        self._bodies[(openmetrics, gzipped)] = _Body(tuple(sources), tuple(rows), body)
        return body

    def _made(self, part: Part, openmetrics: bool, gzipped: bool) -> _Cached:
        """The part's current render, with its form in that format and encoding made (under the
        lock). A part being rendered ahead: its last render, or the next where that lacks the form."""
        cached = self._cache.get(part.name)
        while part.name in self._ahead:
            if cached is not None and cached.has(openmetrics):
                made = self._formed(part, cached, openmetrics, gzipped)  # at most a deflate of its text
                break
            self._ahead_done.wait()
            cached = self._cache.get(part.name)
        else:
            made = self._make(part, cached, openmetrics, gzipped)
        if made is not cached:
            self._cache[part.name] = made
        return made

    def _make(self, part: Part, cached: _Cached | None, openmetrics: bool, gzipped: bool) -> _Cached:
        """``cached`` if it is the part's current render, else a new render, with the form made;
        stores nothing."""
        token = part.token()  # read before the render it names
        if cached is None or cached.token != token:
            start = time.perf_counter()
            text = part.text() if part.text is not None else render_families(list(part.families()))
            plain, piece = (None, text) if part.gzipped else (text, None)
            cached = _Cached(token, plain, piece, time.perf_counter() - start, self._clock())
        return self._formed(part, cached, openmetrics, gzipped)

    def _formed(self, part: Part, cached: _Cached, openmetrics: bool, gzipped: bool) -> _Cached:
        """``cached`` with its form in that format and encoding made; stores nothing."""
        if openmetrics and not cached.has(True):
            cached = self._openmetrics(part, cached)
        if gzipped and cached.held(openmetrics, True) is None:
            piece = deflate(cached.plain(openmetrics))
            cached = dataclasses.replace(cached, **{"om_gzipped" if openmetrics else "gzipped": piece})
        return cached

    def _openmetrics(self, part: Part, cached: _Cached) -> _Cached:
        """``cached`` with the OpenMetrics form of its text, kept in the same encoding as the text."""
        if self._created is None and part.openmetrics is not None:
            form = part.openmetrics()  # made with the text ``cached`` holds (both under this lock)
        else:
            created = None
            if self._created is not None:
                created = self._created.setdefault(part.name, CreatedTimes())
            form = openmetrics_text(cached.plain(), created, cached.rendered_at)
            if cached.text is None:
                form = deflate(form)
        return dataclasses.replace(cached, **{"om_gzipped" if cached.text is None else "om_text": form})

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
