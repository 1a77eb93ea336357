"""The JSON documents the exporter serves and prints: ``/api/v1/state`` (and ``scan --output
json``), and the JSON encoding every document shares (exact decimal strings). Schemas in
docs/metrics.md. Kept out of ``web/`` so the command line prints them without the web layer.
"""

from __future__ import annotations

import io
import json
import threading
import weakref
from decimal import Decimal
from typing import Any

from exporter.analysis.model import NodeState
from exporter.metrics.text import ChunkedText, Deflated, inflate
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
    """:func:`state_document` as JSON text, each kernel's entry encoded again only when its
    kernel changed, and kept only compressed between requests.

    The entries are kept per chunk of neighbouring kernels, compressed
    (:class:`~exporter.metrics.text.ChunkedText`, with weak references to the kernels, so that
    ended kernels are not kept alive until the next request): a document after a change encodes
    that kernel's entry and inflates the rest (10,000 kernels: a 7.3 MiB document, its entries
    kept as 0.39 MiB; ~0.05 s after one change against ~0.8 s for the first; BENCHMARKS.md,
    "50,000 kernels: peaks and deletion"). Neither the view nor the last document is kept.

    :meth:`render` hands out a read-only :class:`memoryview` of the document and keeps a weak
    reference to it, with the view's version and node state it was built from: while a response
    is still writing that document, another request for the same version gets the same object
    (the server counts one body once against its held-bytes budget). The pieces are inflated
    into one :class:`io.BytesIO`, whose buffer becomes the document without a copy, so a
    render's peak is the document and one chunk. The bytes equal ``json.dumps(state_document(...),
    indent=1)`` and a newline (a test holds them together).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one render at a time: a second request for it waits and shares it
        self._entries = ChunkedText(1, gzipped=True, weak=True)
        self._version: int | None = None  # of the view whose kernels _entries last encoded
        # (version, node state, roots) -> the document while a response holds it.
        self._last: tuple[tuple[int, NodeState | None, tuple[str, ...]], weakref.ref[memoryview]] | None = None

    def render(self, view: AllocationView, roots: list[str], node: NodeState | None = None) -> memoryview:
        """The document of ``view``: a read-only memoryview of its bytes (bytes-like; ``bytes()`` copies)."""
        key = (view.version, node, tuple(roots))
        with self._lock:
            last = self._last
            document = last[1]() if last is not None and last[0] == key else None
            if document is None:
                self._last = None
                changed = view.changed_since(self._version) if self._version is not None else None
                pieces = self._entries.render(view.kernels, _entry, changed)[0]
                self._version = view.version
                document = memoryview(_document(view, roots, node, pieces))  # of bytes: read-only
                self._last = (key, weakref.ref(document))
            return document


def _document(view: AllocationView, roots: list[str], node: NodeState | None, pieces: list[Deflated]) -> bytes:
    head = json.dumps({**_head(view, roots, node), "kernels": []}, indent=1, default=json_default)
    if not pieces:
        return (head + "\n").encode()
    out = io.BytesIO()
    # "kernels" is the last key, so the head ends with its empty list: write the entries there.
    out.write((head[: -len("[]\n}")] + "[\n").encode())
    for n, piece in enumerate(pieces):
        entries = inflate(piece)
        out.write(memoryview(entries)[len(_SEP):] if n == 0 else entries)  # no separator before the first
    out.write(b"\n ]\n}\n")
    # getvalue() trims BytesIO's buffer in place and hands it over (no export of it is open):
    # the document is never copied.
    return out.getvalue()


_SEP = b",\n"  # written before every entry; the first one's is left out
_ENTRY = json.JSONEncoder(indent=1, default=json_default)  # json.dumps' encoder, built once


def _entry(kernel_id: str, kernel: Kernel) -> tuple[bytes]:
    # Entries sit at depth 2 of the document: indent every line by two more spaces.
    return (_SEP + ("  " + _ENTRY.encode(_kernel(kernel)).replace("\n", "\n  ")).encode(),)


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
