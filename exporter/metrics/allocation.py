"""Allocation families from one :class:`~exporter.scratch.allocation.AllocationView`: per device,
per node and per kernel, plus allocations on device ids telemetry does not know.

Nothing here holds metric state between scrapes: a kernel whose directory disappears simply stops
appearing. Sample output::

    gpu_alloc_device_fgpu_allocated{device_id="GPU-5d2c…"} 1.2
    gpu_alloc_kernel_allocated{device_id="GPU-5d2c…",kernel_id="0b3f…",slot="cuda.shares"} 0.6
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal
from typing import TYPE_CHECKING

from exporter.metrics.collectors import Inputs, Part, register
from exporter.metrics.families import counter, escape_label, float_format, gauge
from exporter.metrics.status import Health
from exporter.metrics.text import ChunkedText, Deflated, Joiner, deflate, openmetrics_text
from exporter.scratch.allocation import AllocationView, Kernel, KernelState, is_accelerator_slot
from exporter.scratch.identity import Identity
from exporter.scratch.resources import SlotKind, slot_kind

if TYPE_CHECKING:
    from prometheus_client.core import Metric

__all__ = ["IDENTITY_LABELS", "KernelText", "allocation_families", "kernel_families", "kernel_identity", "unknown_device_families"]


def allocation_families(view: AllocationView) -> list[Metric]:
    """Per device, per kernel and per node allocation from one :class:`AllocationView`."""
    dev_count = gauge("gpu_alloc_device_allocated", "Amount of a count slot allocated on a device, summed over kernels (fGPU shares, GPUs, MIG instances)", ["device_id", "slot"])
    dev_bytes = gauge("gpu_alloc_device_allocated_bytes", "Amount of a bytes slot allocated on a device, summed over kernels", ["device_id", "slot"])
    fgpu = gauge("gpu_alloc_device_fgpu_allocated", "cuda.shares plus cuda.device allocated on a device, as Backend.AI's gpu_alloc_map reports it", ["device_id"])
    for (device_id, slot), amount in sorted(view.device_totals.items()):
        (dev_bytes if slot_kind(slot) is SlotKind.BYTES else dev_count).add_metric([device_id, slot], float(amount))
    for device_id, amount in view.alloc_map.items():
        fgpu.add_metric([device_id], float(Decimal(amount)))

    node_count = gauge("gpu_alloc_node_allocated", "Amount of an intrinsic count slot (cpu) allocated on the node, summed over kernels", ["slot"])
    node_bytes = gauge("gpu_alloc_node_allocated_bytes", "Amount of an intrinsic bytes slot (mem) allocated on the node, summed over kernels", ["slot"])
    for slot, amount in sorted(view.node_totals.items()):
        (node_bytes if slot_kind(slot) is SlotKind.BYTES else node_count).add_metric([slot], float(amount))

    states = gauge("gpu_alloc_kernels", "Kernel scratch directories by parse state", ["state"])
    for state in KernelState:
        states.add_metric([state.value], view.state_counts.get(state, 0))
    errors = counter("gpu_alloc_resource_parse_errors", "Reads of resource.txt that found a malformed file")
    errors.add_metric([], view.parse_errors_total)
    return [dev_count, dev_bytes, fgpu, node_count, node_bytes, states, errors, *agent_unreadable_families(view)]


def agent_unreadable_families(view: AllocationView) -> list[Metric]:
    """Kernels whose file this exporter reads but the agent's own reader rejects: the agent's
    ``gpu_alloc_map`` RPC stops at the first of them (a partial map in Backend.AI's UI)."""
    kernels = gauge("gpu_alloc_kernel_agent_unreadable",
                 "1 for a kernel whose resource.txt the agent's own reader rejects, by reason (the agent's alloc map stops there)",
                 ["kernel_id", "reason"])
    for kernel_id, reasons in sorted(view.agent_unreadable.items()):
        for reason in reasons:
            kernels.add_metric([kernel_id, reason], 1)
    partial = gauge("gpu_alloc_agent_alloc_map_partial",
                    "1 if some kernel's file would stop the agent's own gpu_alloc_map RPC (its map is partial)",
                    value=int(bool(kernels.samples)))
    return [kernels, partial]


# The per-kernel families: (name, HELP). One series per kernel (info) or per kernel, device and
# slot held; at 10,000 kernels they are nearly all of the exposition.
_KERNEL_FAMILIES = (
    ("gpu_alloc_kernel_allocated", "Amount of a count slot a kernel holds on a device"),
    ("gpu_alloc_kernel_allocated_bytes", "Amount of a bytes slot a kernel holds on a device"),
    ("gpu_alloc_kernel_info", "Kernel scratch directories seen, with their parse state (ok, pending, invalid)"),
    (
        "gpu_alloc_kernel_identity_info",
        "Backend.AI session, owner, project and agent of a kernel, from its recovery.json "
        "(undefined until read, or where Backend.AI leaves it unset); join on kernel_id",
    ),
)
# Label names and value formats of Backend.AI's own backendai_container_utilization.
IDENTITY_LABELS = ("agent_id", "kernel_id", "project_id", "session_id", "session_type", "user_id")


def kernel_identity(kernel_id: str, kernel: Kernel, agent_id: str | None) -> Identity:
    """The identity a kernel is exported with: the one read, else every field ``undefined``
    but the agent id the exporter was given."""
    return kernel.identity or Identity.unknown(kernel_id, agent_id)


def kernel_families(view: AllocationView, agent_id: str | None = None) -> list[Metric]:
    """What each kernel holds on each device (accelerator slots), each kernel's parse state and
    its identity (``agent_id``: ``--agent.id``, for kernels whose identity is not read yet)."""
    (count_name, count_doc), (bytes_name, bytes_doc), (info_name, info_doc), (id_name, id_doc) = _KERNEL_FAMILIES
    count = gauge(count_name, count_doc, ["kernel_id", "device_id", "slot"])
    nbytes = gauge(bytes_name, bytes_doc, ["kernel_id", "device_id", "slot"])
    info = gauge(info_name, info_doc, ["kernel_id", "state"])
    ident = gauge(id_name, id_doc, IDENTITY_LABELS)
    for kernel_id, kernel in sorted(view.kernels.items()):
        info.add_metric([kernel_id, kernel.state.value], 1)
        i = kernel_identity(kernel_id, kernel, agent_id)
        ident.add_metric([i.agent_id, kernel_id, i.project_id, i.session_id, i.session_type, i.user_id], 1)
        for a in kernel.allocations:
            if is_accelerator_slot(a.slot):
                fam = nbytes if slot_kind(a.slot) is SlotKind.BYTES else count
                fam.add_metric([kernel_id, a.device_id, a.slot], float(a.amount))
    return [count, nbytes, info, ident]


class KernelText:
    """:func:`kernel_families` as exposition text, in both formats, re-encoded only for the
    kernels whose chunk changed.

    The book hands out the same immutable :class:`Kernel` object while a kernel is unchanged, so
    a render encodes the changed kernel into the chunk of neighbouring kernels it is in
    (:class:`ChunkedText`) and hands out the others' text (or compressed pieces) as they were:
    after one file changes, a render encodes one kernel and compresses a few KiB, at any number of
    kernels. The samples of these gauges read the same in OpenMetrics; only the HELP, TYPE and UNIT lines
    between them differ, so the OpenMetrics form of a render shares its samples' bytes. The text
    equals ``generate_latest`` over :func:`kernel_families` (a test holds them together), and
    the OpenMetrics form :func:`~exporter.metrics.text.openmetrics_text` of it.

    :param gzipped: render (and keep) the text compressed only (:func:`~exporter.metrics.text.deflate`).
    """

    def __init__(self, agent_id: str | None = None, gzipped: bool = False) -> None:
        self._agent_id = agent_id
        self._gzipped = gzipped
        self._text = ChunkedText(len(_KERNEL_FAMILIES), gzipped=gzipped)
        self._version: int | None = None  # of the view last rendered
        headers = [f"# HELP {name} {doc}\n# TYPE {name} gauge\n".encode() for name, doc in _KERNEL_FAMILIES]
        # The first header is written after each render's head; the others never change.
        self._headers = (headers[0], *map(self._pack, headers[1:]))
        self._om_headers = (openmetrics_text(headers[0]), *(self._pack(openmetrics_text(h)) for h in headers[1:]))
        self._joiners = (Joiner(), Joiner())  # text, OpenMetrics: the chunks' pieces joined after a change
        self._last: tuple[bytes, list[list[bytes | Deflated]]] | None = None  # the last render's head and sections
        self._openmetrics: bytes | Deflated | None = b""  # None: not made for the last render yet

    def _pack(self, text: bytes) -> bytes | Deflated:
        return deflate(text) if self._gzipped else text

    def render(self, view: AllocationView, head: bytes = b"") -> bytes | Deflated:
        """The per-kernel families after ``head`` (the text of the families before them), as one
        :class:`~exporter.metrics.text.Deflated` piece if ``gzipped``; :meth:`openmetrics` then
        gives the same render's OpenMetrics form."""
        fmt = float_format()
        changed = view.changed_since(self._version) if self._version is not None else None
        sections = self._text.render(view.kernels, lambda kid, kernel: _encode(kid, kernel, self._agent_id, fmt), changed)
        self._version = view.version
        self._last, self._openmetrics = (head, sections), None
        return self._join(0, self._pack(head + self._headers[0]), self._headers[1:], sections)

    def openmetrics(self) -> bytes | Deflated:
        """The last render in OpenMetrics 1.0 (less ``# EOF``), in the same encoding, made on the
        first call after the render (scrapers that never ask for it never pay for it). No
        ``_created``: its head's counters are written without."""
        if self._openmetrics is None and self._last is not None:
            head, sections = self._last
            self._openmetrics = self._join(1, self._pack(openmetrics_text(head) + self._om_headers[0]), self._om_headers[1:],
                                           sections)
        return self._openmetrics

    def _join(self, form: int, first: bytes | Deflated, headers: Sequence[bytes | Deflated],
              sections: list[list[bytes | Deflated]]) -> bytes | Deflated:
        pieces = [first, *sections[0]]
        for header, section in zip(headers, sections[1:], strict=True):
            pieces.append(header)
            pieces += section
        return self._joiners[form](pieces) if self._gzipped else b"".join(pieces)


def _encode(kernel_id: str, kernel: Kernel, agent_id: str | None, fmt: Callable[[float], str]) -> tuple[bytes, ...]:
    """The kernel's lines in each of the :data:`_KERNEL_FAMILIES`."""
    kid = escape_label(kernel_id)
    count, nbytes = [], []
    for a in kernel.allocations:
        if is_accelerator_slot(a.slot):
            line = f'{{device_id="{escape_label(a.device_id)}",kernel_id="{kid}",slot="{escape_label(a.slot)}"}} {fmt(float(a.amount))}\n'
            (nbytes if slot_kind(a.slot) is SlotKind.BYTES else count).append(line)
    name_count, name_bytes, name_info, name_id = (name for name, _ in _KERNEL_FAMILIES)
    i = kernel_identity(kernel_id, kernel, agent_id)
    return (
        "".join(name_count + line for line in count).encode(),
        "".join(name_bytes + line for line in nbytes).encode(),
        f'{name_info}{{kernel_id="{kid}",state="{kernel.state.value}"}} 1.0\n'.encode(),
        # Identity values are UUIDs, a checked agent id and a session type: nothing to escape
        # but the agent id, which is escaped anyway.
        f'{name_id}{{agent_id="{escape_label(i.agent_id)}",kernel_id="{kid}",project_id="{i.project_id}",'
        f'session_id="{i.session_id}",session_type="{i.session_type}",user_id="{i.user_id}"}} 1.0\n'.encode(),
    )


def unknown_device_families(unknown: Mapping[tuple[str, str], Decimal] | None) -> list[Metric]:
    """GPU allocations on device ids that match no device in the telemetry inventory: a removed
    GPU, a wrong ``--device.id-scheme``, or a broken file. Never dropped silently; without an
    inventory (telemetry off or failing: ``None``) nothing can be judged, so nothing is reported."""
    if unknown is None:
        return []
    fam = gauge("gpu_alloc_device_unknown_allocated",
                "Amount of a GPU slot allocated on a device id that matches no device in the telemetry inventory",
                ["device_id", "slot"])
    for (device_id, slot), amount in unknown.items():
        fam.add_metric([device_id, slot], float(amount))
    return [fam]


@register("scratch", "allocation from the scratch tree: per device, node and kernel, parse states, identities", order=10)
def _scratch(inputs: Inputs) -> list[Part]:
    kernel_text = KernelText(inputs.agent_id, gzipped=True)

    def families() -> list[Metric]:
        view = inputs.view()
        return allocation_families(view) + kernel_families(view, inputs.agent_id)

    def text() -> Deflated:
        view = inputs.view()
        from exporter.metrics.registry import render_families  # prometheus_client: loaded to render only

        return kernel_text.render(view, head=render_families(allocation_families(view)))

    def health() -> Health:
        scans = inputs.watcher().last_scan
        return Health(bool(scans) and all(s.ok for s in scans), sum(s.duration_seconds for s in scans))

    return [Part("scratch", families, lambda: inputs.view().version, text, health, gzipped=True,
                 openmetrics=kernel_text.openmetrics)]
