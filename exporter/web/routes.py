"""The HTTP routes: ``/metrics`` from cached bytes, health and readiness, and the JSON API
(``/api/v1/alloc-map``, ``/api/v1/state``, ``/api/v1/simulate``); schemas in docs/metrics.md."""

from __future__ import annotations

import json
import threading
from decimal import Decimal
from typing import Any, Protocol

from exporter import __version__
from exporter.analysis.agents import AgentLayout
from exporter.analysis.node import NodeState
from exporter.analysis.placement import Policy
from exporter.analysis.simulate import parse_request, result_document, simulate
from exporter.metrics.text import SplicedText
from exporter.scratch.allocation import ALLOC_MAP_FORMATS, AllocationBook, AllocationView, Kernel
from exporter.scratch.watcher import ScratchWatcher
from exporter.web.server import Request, Response, Route, Router

__all__ = ["Routes", "ServedNode", "StateText", "state_document"]

TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"
JSON = "application/json"


class ServedNode(Protocol):
    """What the routes read of a running node (the app's ``Exporter`` satisfies it)."""

    book: AllocationBook
    watcher: ScratchWatcher
    layout: AgentLayout

    @property
    def ready(self) -> bool: ...

    def agent_views(self) -> dict[str, AllocationView]: ...

    def render(self, gzipped: bool = False) -> bytes: ...

    def render_cached(self, gzipped: bool = False) -> bytes | None: ...

    def node_state(self) -> NodeState: ...

    def ratio_capacities(self) -> dict[tuple[str, str], Decimal]: ...


class Routes(Router):
    """Maps a request path to its handler; every handler only reads published snapshots.

    ``offload=True`` marks the routes that build a document (hundreds of ms at 10,000 kernels):
    :class:`~exporter.web.server.HttpServer` runs them on its worker pool, never on its loop.

    :param node: the node being served.
    :param roots: the scratch roots, as ``/api/v1/state`` names them.
    :param alloc_map_format: what ``/api/v1/alloc-map`` answers without ``?format=``.
    """

    def __init__(self, node: ServedNode, roots: list[str], alloc_map_format: str = "absolute") -> None:
        self._node = node
        self._roots = roots
        self._alloc_map_format = alloc_map_format
        self._state_text = StateText()
        super().__init__({
            "/": Route(self._landing),
            "/metrics": Route(self._metrics, cached=self._metrics_cached),
            "/-/healthy": Route(self._healthy),
            "/-/ready": Route(self._ready_route),
            "/api/v1/alloc-map": Route(self._alloc_map, offload=True),
            "/api/v1/state": Route(self._state, offload=True),
            "/api/v1/simulate": Route(self._simulate, offload=True),
        })

    def handle(self, request: Request) -> Response:
        """The response to ``request``: 404 for unknown paths, 405 for methods other than GET and HEAD."""
        return self(request)

    def _landing(self, _: Request) -> Response:
        links = "".join(f'<li><a href="{p}">{p}</a></li>' for p in self.routes if p != "/")
        body = (
            f"<html><head><title>gpu-alloc-exporter</title></head><body><h1>gpu-alloc-exporter {__version__}</h1>"
            f"<p>GPU allocation of Backend.AI kernels.</p><ul>{links}</ul></body></html>"
        )
        return Response(200, body.encode(), "text/html; charset=utf-8")

    def _metrics(self, request: Request) -> Response:
        gz = "gzip" in request.headers.get("accept-encoding", "")
        return _exposition(self._node.render(gzipped=gz), gz)

    def _metrics_cached(self, request: Request) -> Response | None:
        gz = "gzip" in request.headers.get("accept-encoding", "")
        body = self._node.render_cached(gzipped=gz)
        return _exposition(body, gz) if body is not None else None

    def _healthy(self, _: Request) -> Response:
        status = self._node.watcher.status()
        if self._node.ready and not status.up:
            return Response(503, b"scratch watcher stopped\n")
        return Response(200, b"OK\n")

    def _ready_route(self, _: Request) -> Response:
        return Response(200, b"OK\n") if self._node.ready else Response(503, b"first scan not finished\n")

    def _alloc_map(self, request: Request) -> Response:
        # absolute: agents before 26.4.8; ratio: 26.4.8+ / 26.8.x (every cuda.* slot / capacity).
        form = request.query.get("format", [self._alloc_map_format])[0]
        if form not in ALLOC_MAP_FORMATS:
            return Response(400, f"format must be one of {', '.join(ALLOC_MAP_FORMATS)}\n".encode())
        layout = self._node.layout
        agent = request.query.get("agent", [None])[0]
        if agent is not None and agent not in layout.agents:
            known = ", ".join(layout.agents) or "none known (set --agent.id or --agent.config)"
            return Response(404, f"parameter agent: no agent {agent!r} on this host (agents: {known})\n".encode())
        if not layout.multi_agent:
            return _json(self._one_map(self._node.book.view(), form))
        # Several agents: each answers its own RPC over its own kernels, so the node-wide sum
        # matches none of them; without ?agent= every agent's map, keyed by agent id.
        views = self._node.agent_views()
        if agent is not None:
            return _json(self._one_map(views[agent], form))
        return _json({a: self._one_map(views[a], form) for a in layout.agents})

    def _one_map(self, view: AllocationView, form: str) -> dict[str, str]:
        if form == "absolute":
            return dict(view.alloc_map)
        # Every agent registers each device whole: one set of divisors serves them all.
        return view.alloc_map_ratio(self._node.ratio_capacities())

    def _state(self, _: Request) -> Response:
        return Response(200, self._state_text.render(self._node.book.view(), self._roots, self._node.node_state()), JSON)

    def _simulate(self, request: Request) -> Response:
        try:
            want = parse_request(request.query.get("request", [""])[0])
        except ValueError as exc:
            return Response(400, f"parameter request: {exc}\n".encode())
        try:
            policy = Policy(request.query.get("policy", ["evenly"])[0])
        except ValueError:
            return Response(400, f"parameter policy: expected one of {', '.join(p.value for p in Policy)}\n".encode())
        return _json(result_document(simulate(self._node.node_state(), want, policy)))


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
    change re-encodes one kernel, not 10,000 (~360 ms). The bytes equal
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
            head = json.dumps({**_head(view, roots, node), "kernels": []}, indent=1, default=_default)
            # "kernels" is the last key, so the document ends with its empty list: splice the entries in.
            frame = (head[: -len("[]\n}")] + "[\n", "\n ]\n}\n") if view.kernels else (head + "\n", "")
            text = self._entries.render(view.kernels, _entry, [f.encode() for f in frame])
            self._last = (key, text)
            return text


def _exposition(body: bytes, gzipped: bool) -> Response:
    return Response(200, body, TEXT_FORMAT, {"Content-Encoding": "gzip"} if gzipped else {})


def _entry(_: str, kernel: Kernel) -> tuple[bytes]:
    # Entries sit at depth 2 of the document: indent every line by two more spaces.
    return (("  " + json.dumps(_kernel(kernel), indent=1, default=_default).replace("\n", "\n  ")).encode(),)


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


def _json(obj: Any) -> Response:
    return Response(200, json.dumps(obj, indent=1, default=_default).encode() + b"\n", JSON)


def _default(o: Any) -> Any:
    if isinstance(o, Decimal):
        return str(o)
    raise TypeError(type(o).__name__)
