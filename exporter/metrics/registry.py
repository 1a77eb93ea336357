"""The collector registry: named parts, each producing metric families, rendered part by part.

A *part* (scratch, watcher, telemetry, headroom, attribution, build) builds its families fresh
from published, immutable snapshots; :class:`ExporterCollector` renders each part only when its
token changed and serves the rest from cached text, so a scrape never recomputes what did not move.
"""

from __future__ import annotations

import gzip
import logging
import threading
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from exporter.metrics.status import collector_status

__all__ = ["ExporterCollector", "Part", "merge", "render_families"]

log = logging.getLogger(__name__)


def merge(families: Iterable[Metric]) -> list[Metric]:
    """Families of the same name joined into one (every part reports gpu_alloc_collector_success).
    Builds new families, so cached ones are never mutated."""
    by_name: dict[str, Metric] = {}
    for fam in families:
        if fam.name not in by_name:
            by_name[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
        by_name[fam.name].samples.extend(fam.samples)
    return list(by_name.values())


@dataclass(frozen=True)
class Part:
    """A named producer of metric families (one per concern: scratch, telemetry, headroom…).

    :param token: returns a value that changes whenever the families would; it is read *before*
        the families are built, so a cached rendering is never older than its token.
    """

    name: str
    families: Callable[[], Iterable[Metric]]
    token: Callable[[], Hashable]
    # A faster renderer of the same families as text, for render(); None: generate_latest.
    text: Callable[[], bytes] | None = None


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
    class. A part that raises is logged and reported as ``gpu_alloc_collector_success{collector}
    0``; the scrape itself still succeeds with everything else.

    :meth:`render` renders each part only when its token changed and serves the rest from
    cached text (plain and gzip): at 10,000 kernels the per-kernel families are ~20,000 samples,
    ~150 ms to render, and they change only with the scratch tree, not every telemetry sample.
    """

    def __init__(self, parts: Iterable[Part]) -> None:
        self._parts = list(parts)
        self._lock = threading.Lock()
        # name -> (token, text, gzipped text or None until asked for, status families)
        self._cache: dict[str, tuple[Hashable, bytes, bytes | None, list[Metric]]] = {}

    def collect(self) -> list[Metric]:
        return merge(fam for part in self._parts for fam in self._run(part))

    def render(self, gzipped: bool = False) -> bytes:
        """The exposition in text format 0.0.4 (gzip members concatenated when ``gzipped``)."""
        with self._lock:
            body, status = [], []
            for part in self._parts:
                token = part.token()
                cached = self._cache.get(part.name)
                if cached is None or cached[0] != token:
                    text, status_families = self._render_part(part)
                    cached = (token, text, None, status_families)
                if gzipped and cached[2] is None:
                    cached = (cached[0], cached[1], gzip.compress(cached[1], compresslevel=1), cached[3])
                self._cache[part.name] = cached
                body.append(cached[2] if gzipped else cached[1])
                status += cached[3]
            # Status families come from every part and are tiny: merged and rendered each time.
            tail = render_families(merge(status))
            body.append(gzip.compress(tail, compresslevel=1) if gzipped else tail)
            return b"".join(body)

    def _render_part(self, part: Part) -> tuple[bytes, list[Metric]]:
        if part.text is not None:
            try:
                return part.text(), []
            except Exception:
                log.exception("collector %s failed", part.name)
                return b"", collector_status(part.name, False)
        families = self._run(part)
        own = [f for f in families if not f.name.startswith(_STATUS_PREFIX)]
        return render_families(own), [f for f in families if f.name.startswith(_STATUS_PREFIX)]

    def _run(self, part: Part) -> list[Metric]:
        try:
            return list(part.families())
        except Exception:
            log.exception("collector %s failed", part.name)
            return collector_status(part.name, False)


_STATUS_PREFIX = "gpu_alloc_collector_"
