"""The JSON documents the exporter serves and prints: ``/api/v1/state`` (and ``scan --output
json``), and the JSON encoding every document shares (exact decimal strings). Schemas in
docs/metrics.md. Kept out of ``web/`` so the command line prints them without the web layer.
"""

from __future__ import annotations

import json
import threading
from decimal import Decimal
from typing import Any

from exporter.analysis.model import NodeState
from exporter.metrics.text import SplicedText
from exporter.scratch.allocation import AllocationView, Kernel

__all__ = ["StateText", "json_bytes", "json_default", "state_document"]


def json_default(o: Any) -> Any:
    """``json.dumps``' ``default``: a Decimal as its exact string."""
    if isinstance(o, Decimal):
        return str(o)
    raise TypeError(type(o).__name__)


def json_bytes(obj: Any) -> bytes:
    """A document as the API serves it: indented JSON and a final newline."""
    return json.dumps(obj, indent=1, default=json_default).encode() + b"\n"


def state_document(view: AllocationView, roots: list[str], node: NodeState | None = None) -> dict[str, Any]:
    """The ``/api/v1/state`` document (schema in docs/metrics.md). Amounts are decimal strings, exact.

    ``node_state`` (devices with capacity, allocation and stale amounts) is what
    ``gpu-alloc-exporter simulate --state FILE`` reads back.
    """
    return {**_head(view, roots, node), "kernels": [_kernel(k) for k in sorted(view.kernels.values(), key=lambda k: k.kernel_id)]}


class StateText:
    """:func:`state_document` as JSON text, built once per change and per kernel.

    The text is cached against the view's version and the node state, so a client polling
    ``/api/v1/state`` costs nothing until something moves; each kernel's entry is encoded again
    only when its immutable :class:`~exporter.scratch.allocation.Kernel` object changed, the
    others copied from the last text (:class:`~exporter.metrics.text.SplicedText`), so a
    change re-encodes one kernel, not all of them. The bytes equal
    ``json.dumps(state_document(...), indent=1)`` (a test holds them together).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries = SplicedText(1, sep=b",\n")
        self._last: tuple[tuple[int, NodeState | None, tuple[str, ...]], bytes] | None = None

    def render(self, view: AllocationView, roots: list[str], node: NodeState | None = None) -> bytes:
        key = (view.version, node, tuple(roots))
        with self._lock:
            if self._last is not None and self._last[0] == key:
                return self._last[1]
            head = json.dumps({**_head(view, roots, node), "kernels": []}, indent=1, default=json_default)
            # "kernels" is the last key, so the document ends with its empty list: splice the entries in.
            frame = (head[: -len("[]\n}")] + "[\n", "\n ]\n}\n") if view.kernels else (head + "\n", "")
            text = self._entries.render(view.kernels, _entry, [f.encode() for f in frame])
            self._last = (key, text)
            return text


def _entry(_: str, kernel: Kernel) -> tuple[bytes]:
    # Entries sit at depth 2 of the document: indent every line by two more spaces.
    return (("  " + json.dumps(_kernel(kernel), indent=1, default=json_default).replace("\n", "\n  ")).encode(),)


def _head(view: AllocationView, roots: list[str], node: NodeState | None) -> dict[str, Any]:
    devices: dict[str, dict[str, str]] = {}
    for (device_id, slot), amount in sorted(view.device_totals.items()):
        devices.setdefault(device_id, {})[slot] = str(amount)
    return {
        "version": view.version,
        "generated_at": view.created_at,
        "scratch_roots": roots,
        "alloc_map": dict(view.alloc_map),
        "devices": devices,
        "node": {slot: str(v) for slot, v in sorted(view.node_totals.items())},
        "kernel_states": {s.value: n for s, n in view.state_counts.items()},
        "node_state": node.to_json() if node is not None else None,
    }


def _kernel(k: Kernel) -> dict[str, Any]:
    return {
        "kernel_id": k.kernel_id,
        "scratch_root": k.scratch_root,
        "state": k.state.value,
        "reason": k.reason,
        "since": k.since,
        "container_id": k.container_id,
        "requested": {s: str(v) for s, v in k.spec.requested} if k.spec else {},
        "allocations": [{"slot": a.slot, "device_id": a.device_id, "amount": str(a.amount)} for a in k.allocations],
    }
