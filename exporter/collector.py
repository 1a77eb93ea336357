"""Metric families built fresh from published snapshots (a custom prometheus_client collector).

Nothing here holds metric state between scrapes: a kernel whose directory disappears simply stops
appearing. Sample output::

    gpu_alloc_device_fgpu_allocated{device_id="GPU-5d2c…"} 1.2
    gpu_alloc_kernel_allocated{device_id="GPU-5d2c…",kernel_id="0b3f…",slot="cuda.shares"} 0.6
"""

from __future__ import annotations

import gzip
import logging
import platform
import threading
from dataclasses import dataclass
from collections.abc import Callable, Hashable, Iterable
from decimal import Decimal

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from exporter import __version__
from exporter.allocation import AllocationView, Kernel, KernelState, is_accelerator_slot
from exporter.devices import DeviceResolver
from exporter.resources import SlotKind, slot_kind
from exporter.telemetry import TelemetrySnapshot
from exporter.watcher import WatcherStatus

__all__ = ["ExporterCollector", "KernelText", "Source", "allocation_families", "kernel_families", "render_families", "build_info", "collector_status", "unknown_device_families", "watcher_families"]

log = logging.getLogger(__name__)


def _g(name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def allocation_families(view: AllocationView) -> list[Metric]:
    """Per device, per kernel and per node allocation from one :class:`AllocationView`."""
    dev_count = _g("gpu_alloc_device_allocated", "Amount of a count slot allocated on a device, summed over kernels (fGPU shares, GPUs, MIG instances)", ["device_id", "slot"])
    dev_bytes = _g("gpu_alloc_device_allocated_bytes", "Amount of a bytes slot allocated on a device, summed over kernels", ["device_id", "slot"])
    fgpu = _g("gpu_alloc_device_fgpu_allocated", "cuda.shares plus cuda.device allocated on a device, as Backend.AI's gpu_alloc_map reports it", ["device_id"])
    for (device_id, slot), amount in sorted(view.device_totals.items()):
        (dev_bytes if slot_kind(slot) is SlotKind.BYTES else dev_count).add_metric([device_id, slot], float(amount))
    for device_id, amount in view.alloc_map.items():
        fgpu.add_metric([device_id], float(Decimal(amount)))

    node_count = _g("gpu_alloc_node_allocated", "Amount of an intrinsic count slot (cpu) allocated on the node, summed over kernels", ["slot"])
    node_bytes = _g("gpu_alloc_node_allocated_bytes", "Amount of an intrinsic bytes slot (mem) allocated on the node, summed over kernels", ["slot"])
    for slot, amount in sorted(view.node_totals.items()):
        (node_bytes if slot_kind(slot) is SlotKind.BYTES else node_count).add_metric([slot], float(amount))

    states = _g("gpu_alloc_kernels", "Kernel scratch directories by parse state", ["state"])
    for state in KernelState:
        states.add_metric([state.value], view.state_counts.get(state, 0))
    errors = CounterMetricFamily("gpu_alloc_resource_parse_errors", "Reads of resource.txt that found a malformed file")
    errors.add_metric([], view.parse_errors_total)
    return [dev_count, dev_bytes, fgpu, node_count, node_bytes, states, errors]


# The per-kernel families: (name, HELP). One series per kernel (info) or per kernel, device and
# slot held; at 10,000 kernels they are nearly all of the exposition.
_KERNEL_FAMILIES = (
    ("gpu_alloc_kernel_allocated", "Amount of a count slot a kernel holds on a device"),
    ("gpu_alloc_kernel_allocated_bytes", "Amount of a bytes slot a kernel holds on a device"),
    ("gpu_alloc_kernel_info", "Kernel scratch directories seen, with their parse state (ok, pending, invalid)"),
)


def kernel_families(view: AllocationView) -> list[Metric]:
    """What each kernel holds on each device (accelerator slots), and each kernel's parse state."""
    (count_name, count_doc), (bytes_name, bytes_doc), (info_name, info_doc) = _KERNEL_FAMILIES
    count = _g(count_name, count_doc, ["kernel_id", "device_id", "slot"])
    nbytes = _g(bytes_name, bytes_doc, ["kernel_id", "device_id", "slot"])
    info = _g(info_name, info_doc, ["kernel_id", "state"])
    for kernel_id, kernel in sorted(view.kernels.items()):
        info.add_metric([kernel_id, kernel.state.value], 1)
        for a in kernel.allocations:
            if is_accelerator_slot(a.slot):
                fam = nbytes if slot_kind(a.slot) is SlotKind.BYTES else count
                fam.add_metric([kernel_id, a.device_id, a.slot], float(a.amount))
    return [count, nbytes, info]


class KernelText:
    """:func:`kernel_families` as exposition text, re-encoded only for kernels that changed.

    The book hands out the same immutable :class:`Kernel` object while a kernel is unchanged, so
    each kernel's lines are cached against that object: after one file changes at 10,000 kernels,
    a render encodes one kernel and joins the rest (~10 ms instead of ~200 ms through
    ``generate_latest``). The text equals ``generate_latest`` over :func:`kernel_families` (a test
    holds them together).
    """

    def __init__(self) -> None:
        self._chunks: dict[str, tuple[Kernel, tuple[str, str, str]]] = {}
        self._order: list[str] = []

    def render(self, view: AllocationView) -> bytes:
        chunks = {}
        for kernel_id, kernel in view.kernels.items():
            cached = self._chunks.get(kernel_id)
            chunks[kernel_id] = cached if cached is not None and cached[0] is kernel else (kernel, _encode(kernel_id, kernel))
        if chunks.keys() != self._chunks.keys():  # kernels came or went: sort again
            self._order = sorted(chunks)
        self._chunks = chunks
        order = self._order
        out = []
        for i, (name, doc) in enumerate(_KERNEL_FAMILIES):
            out.append(f"# HELP {name} {doc}\n# TYPE {name} gauge\n")
            out.extend(chunks[k][1][i] for k in order)
        return "".join(out).encode()


def _encode(kernel_id: str, kernel: Kernel) -> tuple[str, str, str]:
    kid = _label(kernel_id)
    count, nbytes = [], []
    for a in kernel.allocations:
        if is_accelerator_slot(a.slot):
            line = f'{{device_id="{_label(a.device_id)}",kernel_id="{kid}",slot="{_label(a.slot)}"}} {floatToGoString(float(a.amount))}\n'
            (nbytes if slot_kind(a.slot) is SlotKind.BYTES else count).append(line)
    name_count, name_bytes, name_info = (name for name, _ in _KERNEL_FAMILIES)
    return (
        "".join(name_count + line for line in count),
        "".join(name_bytes + line for line in nbytes),
        f'{name_info}{{kernel_id="{kid}",state="{kernel.state.value}"}} 1.0\n',
    )


def _label(value: str) -> str:
    """A label value escaped as the text format (and prometheus_client) escapes it."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def unknown_device_families(view: AllocationView, snapshot: TelemetrySnapshot, resolver: DeviceResolver) -> list[Metric]:
    """GPU allocations on device ids that match no device in the telemetry inventory: a removed
    GPU, a wrong ``--device.id-scheme``, or a broken file. Never dropped silently; without an
    inventory (telemetry off or failing) nothing can be judged, so nothing is reported."""
    if not snapshot.devices:
        return []
    fam = _g("gpu_alloc_device_unknown_allocated", "Amount of a GPU slot allocated on a device id that matches no device in the telemetry inventory", ["device_id", "slot"])
    for (device_id, slot), amount in sorted(view.device_totals.items()):
        if slot.startswith("cuda.") and resolver.resolve(device_id) is None:
            fam.add_metric([device_id, slot], float(amount))
    return [fam]


def watcher_families(status: WatcherStatus) -> list[Metric]:
    """The scratch watcher's own health, and the scratch collector's success and duration."""
    scan_ok = all(s.ok for s in status.last_scan)
    out = [
        _one("gpu_alloc_watcher_up", "1 if the scratch watcher's threads are alive", int(status.up)),
        _one("gpu_alloc_watcher_degraded", "1 if events may be missed (inotify watch limit, unreadable root); rescans then run at the poll interval", int(status.degraded is not None)),
        _one("gpu_alloc_watcher_watches", "inotify watches held (one per kernel plus one per scratch root)", status.watches),
        _counter("gpu_alloc_watcher_events", "inotify events handled", status.events_total),
        _counter("gpu_alloc_watcher_overflows", "inotify queue overflows (each triggers a full rescan)", status.overflows_total),
        _counter("gpu_alloc_watcher_errors", "Errors while watching or handling events", status.watch_errors_total),
        _counter("gpu_alloc_watcher_rescans", "Full rescans of the scratch roots (start, periodic, after overflow)", status.rescans_total),
    ]
    if status.last_event_timestamp is not None:
        out.append(_one("gpu_alloc_watcher_last_event_timestamp_seconds", "Unix time of the last inotify event", status.last_event_timestamp))
    roots = _g("gpu_alloc_scratch_root_up", "1 if the scratch root could be listed at the last scan", ["scratch_root"])
    for s in status.last_scan:
        roots.add_metric([s.root], int(s.ok))
    out.append(roots)
    out += collector_status("scratch", scan_ok and bool(status.last_scan), sum(s.duration_seconds for s in status.last_scan))
    return out


def collector_status(
    collector: str, success: bool, duration_seconds: float | None = None, last_success: float | None = None
) -> list[Metric]:
    """The self-metrics every source reports, labelled ``{collector}``; :func:`merge` joins the
    families of all sources into one per name."""
    out = [_g("gpu_alloc_collector_success", "1 if the collector's last run succeeded", ["collector"])]
    out[0].add_metric([collector], int(success))
    if duration_seconds is not None:
        out.append(_g("gpu_alloc_collector_duration_seconds", "Duration of the collector's last run", ["collector"]))
        out[-1].add_metric([collector], duration_seconds)
    if last_success is not None:
        out.append(_g("gpu_alloc_collector_last_success_timestamp_seconds", "Unix time of the collector's last successful run", ["collector"]))
        out[-1].add_metric([collector], last_success)
    return out


def build_info(agent_id: str | None) -> Metric:
    info = _g("gpu_alloc_build_info", "Exporter build and runtime identity", ["version", "python_version", "agent_id"])
    info.add_metric([__version__, platform.python_version(), agent_id or ""], 1)
    return info


def _one(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def merge(families: Iterable[Metric]) -> list[Metric]:
    """Families of the same name joined into one (every source reports gpu_alloc_collector_success).
    Builds new families, so cached ones are never mutated."""
    by_name: dict[str, Metric] = {}
    for fam in families:
        if fam.name not in by_name:
            by_name[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
        by_name[fam.name].samples.extend(fam.samples)
    return list(by_name.values())


@dataclass(frozen=True)
class Source:
    """A named producer of metric families.

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
    """Every family of every source: a custom collector, plus cached rendering.

    Sources are independent, so adding one (telemetry, headroom, attribution) never touches this
    class. A source that raises is logged and reported as ``gpu_alloc_collector_success{collector}
    0``; the scrape itself still succeeds with everything else.

    :meth:`render` renders each source only when its token changed and serves the rest from
    cached text (plain and gzip): at 10,000 kernels the per-kernel families are ~20,000 samples,
    ~150 ms to render, and they change only with the scratch tree, not every telemetry sample.
    """

    def __init__(self, sources: Iterable[Source]) -> None:
        self._sources = list(sources)
        self._lock = threading.Lock()
        # name -> (token, text, gzipped text or None until asked for, status families)
        self._parts: dict[str, tuple[Hashable, bytes, bytes | None, list[Metric]]] = {}

    def collect(self) -> list[Metric]:
        return merge(fam for source in self._sources for fam in self._run(source))

    def render(self, gzipped: bool = False) -> bytes:
        """The exposition in text format 0.0.4 (gzip members concatenated when ``gzipped``)."""
        with self._lock:
            body, status = [], []
            for source in self._sources:
                token = source.token()
                part = self._parts.get(source.name)
                if part is None or part[0] != token:
                    text, status_families = self._render_part(source)
                    part = (token, text, None, status_families)
                if gzipped and part[2] is None:
                    part = (part[0], part[1], gzip.compress(part[1], compresslevel=1), part[3])
                self._parts[source.name] = part
                body.append(part[2] if gzipped else part[1])
                status += part[3]
            # Status families come from every source and are tiny: merged and rendered each time.
            tail = render_families(merge(status))
            body.append(gzip.compress(tail, compresslevel=1) if gzipped else tail)
            return b"".join(body)

    def _render_part(self, source: Source) -> tuple[bytes, list[Metric]]:
        if source.text is not None:
            try:
                return source.text(), []
            except Exception:
                log.exception("collector %s failed", source.name)
                return b"", collector_status(source.name, False)
        families = self._run(source)
        own = [f for f in families if not f.name.startswith(_STATUS_PREFIX)]
        return render_families(own), [f for f in families if f.name.startswith(_STATUS_PREFIX)]

    def _run(self, source: Source) -> list[Metric]:
        try:
            return list(source.families())
        except Exception:
            log.exception("collector %s failed", source.name)
            return collector_status(source.name, False)


_STATUS_PREFIX = "gpu_alloc_collector_"
