"""The HTTP routes: ``/metrics`` from cached bytes, health and readiness, and the JSON API
(``/api/v1/alloc-map``, ``/api/v1/state``, ``/api/v1/simulate``, ``/api/v1/placeable``); schemas
in docs/metrics.md.

Every handler reads what :class:`Served` hands it: the allocation view, the published read
model and the rendered exposition; none computes analysis or reaches back into the wiring."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from exporter import __version__
from exporter.analysis.model import Analysis, ShapeFigures
from exporter.metrics.documents import StateText, json_bytes
from exporter.metrics.text import OPENMETRICS_CONTENT_TYPE, negotiate
from exporter.scratch.allocation import ALLOC_MAP_FORMATS, AllocationView
from exporter.scratch.watcher import WatcherStatus
from exporter.web.server import Request, Response, Route, Router

__all__ = ["Routes", "Served", "placeable_document"]

TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"
JSON = "application/json"


@dataclass(frozen=True)
class Served:
    """What the routes read.

    :param view: the allocation book's current view (the absolute alloc map: no analysis hop).
    :param model: the analysis pipeline's current read model.
    :param render: ``(gzipped, openmetrics)`` -> the exposition, rendering what changed
        (``gzipped``: gzip members; ``openmetrics``: OpenMetrics 1.0, else text format 0.0.4).
    :param render_cached: the same if nothing has to be rendered for it, else None (never waits).
    :param ready: whether the first scan and analysis are done.
    :param watcher: the scratch watcher's status (``/-/healthy``).
    :param roots: the scratch roots, as ``/api/v1/state`` names them.
    :param alloc_map_format: what ``/api/v1/alloc-map`` answers without ``?format=``.
    :param version: the allocation book's version (cheap, unlike :attr:`view` after a change);
        None: read from the view.
    """

    view: Callable[[], AllocationView]
    model: Callable[[], Analysis]
    render: Callable[[bool, bool], bytes]
    render_cached: Callable[[bool, bool], bytes | None]
    ready: Callable[[], bool]
    watcher: Callable[[], WatcherStatus]
    roots: tuple[str, ...] = ()
    alloc_map_format: str = "absolute"
    version: Callable[[], int] | None = None

    def book_version(self) -> int:
        return self.version() if self.version is not None else self.view().version


# Answers kept per route for one published state: enough for every question a node's clients ask
# (a few agents, dashboards, the idle checker), bounded against a client that varies its query.
_ANSWERS_KEPT = 64


class _Answers:
    """An offloaded route's answers for the state they were computed from (``basis``: a version
    that moves whenever that state is replaced): the same question asked again before it moves is
    answered on the serving loop from these bytes, not by the worker pool. A client polling the
    API so costs the exporter ~nothing between changes, and takes no time from the analysis
    thread when one lands.

    :param handler: computes the answer (on the worker pool).
    :param basis: the version the answer will be computed from, read before ``handler`` reads
        the state: an answer is never kept under a newer version than its own.
    :param question: what in the request the answer depends on.
    """

    def __init__(self, handler: Callable[[Request], Response], basis: Callable[[Request], Hashable],
                 question: Callable[[Request], Hashable]) -> None:
        self._handler, self._basis, self._question = handler, basis, question
        self._kept: tuple[Hashable, dict[Hashable, Response]] = (None, {})

    def answer(self, request: Request) -> Response:
        basis = self._basis(request)
        response = self._handler(request)
        kept_basis, answers = self._kept
        if kept_basis != basis:
            kept_basis, answers = self._kept = (basis, {})
        if len(answers) < _ANSWERS_KEPT:
            answers[self._question(request)] = response
        return response

    def cached(self, request: Request) -> Response | None:
        kept_basis, answers = self._kept
        if not answers or kept_basis != self._basis(request):
            return None
        response = answers.get(self._question(request))
        # Headers are the server's to extend per response (web config): never the kept ones.
        return dataclasses.replace(response, headers=dict(response.headers)) if response is not None else None


class Routes(Router):
    """Maps a request path to its handler; every handler only reads published snapshots.

    ``offload=True`` marks the routes that build a document (hundreds of ms at 10,000 kernels):
    :class:`~exporter.web.server.HttpServer` runs them on its worker pool, never on its loop.
    """

    def __init__(self, served: Served) -> None:
        self._served = served
        self._state_text = StateText()
        alloc_map = _Answers(self._alloc_map, self._alloc_map_basis, lambda r: (_param(r, "format"), _param(r, "agent")))
        simulate = _Answers(self._simulate, lambda _: served.model().headroom_version,
                            lambda r: (_param(r, "request"), _param(r, "policy")))
        super().__init__({
            "/": Route(self._landing),
            "/metrics": Route(self._metrics, cached=self._metrics_cached),
            "/-/healthy": Route(self._healthy),
            "/-/ready": Route(self._ready_route),
            "/api/v1/alloc-map": Route(alloc_map.answer, offload=True, cached=alloc_map.cached),
            "/api/v1/state": Route(self._state, offload=True),
            "/api/v1/simulate": Route(simulate.answer, offload=True, cached=simulate.cached),
            # A few shapes' published verdicts, formatted: cheap enough for the loop.
            "/api/v1/placeable": Route(self._placeable),
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
        gz, om = _wants(request)
        return _exposition(self._served.render(gz, om), gz, om)

    def _metrics_cached(self, request: Request) -> Response | None:
        gz, om = _wants(request)
        body = self._served.render_cached(gz, om)
        return _exposition(body, gz, om) if body is not None else None

    def _healthy(self, _: Request) -> Response:
        if self._served.ready() and not self._served.watcher().up:
            return Response(503, b"scratch watcher stopped\n")
        return Response(200, b"OK\n")

    def _ready_route(self, _: Request) -> Response:
        return Response(200, b"OK\n") if self._served.ready() else Response(503, b"first scan not finished\n")

    def _alloc_map_basis(self, request: Request) -> Hashable:
        """What ``/api/v1/alloc-map`` answers from: the book, or the read model."""
        model = self._served.model()
        if request.query.get("format", [self._served.alloc_map_format])[0] == "absolute" and not model.layout.multi_agent:
            return self._served.book_version()
        return model.version

    def _alloc_map(self, request: Request) -> Response:
        # absolute: agents before 26.4.8; ratio: 26.4.8+ / 26.8.x (every cuda.* slot / capacity).
        form = request.query.get("format", [self._served.alloc_map_format])[0]
        if form not in ALLOC_MAP_FORMATS:
            return Response(400, f"format must be one of {', '.join(ALLOC_MAP_FORMATS)}\n".encode())
        model = self._served.model()
        layout = model.layout
        agent = request.query.get("agent", [None])[0]
        if agent is not None and agent not in layout.agents:
            known = ", ".join(layout.agents) or "none known (set --agent.id or --agent.config)"
            return Response(404, f"parameter agent: no agent {agent!r} on this host (agents: {known})\n".encode())
        if not layout.multi_agent:
            if form == "absolute":  # straight from the book: a change is served before any analysis pass
                return _json(dict(self._served.view().alloc_map))
            return _json(model.ratio_map())
        # Several agents: each answers its own RPC over its own kernels, so the node-wide sum
        # matches none of them; without ?agent= every agent's map, keyed by agent id.
        def one(agent_id: str) -> dict[str, str]:
            view = model.agents[agent_id].view
            return dict(view.alloc_map) if form == "absolute" else model.ratio_map(view)

        if agent is not None:
            return _json(one(agent))
        return _json({a: one(a) for a in layout.agents})

    def _state(self, _: Request) -> Response:
        model = self._served.model()
        return Response(200, self._state_text.render(model.view, list(self._served.roots), model.state), JSON)

    def _simulate(self, request: Request) -> Response:
        try:
            document = self._served.model().what_if(request.query.get("request", [""])[0],
                                                    request.query.get("policy", ["evenly"])[0])
        except ValueError as exc:
            return Response(400, f"{exc}\n".encode())
        return _json(document)

    def _placeable(self, request: Request) -> Response:
        figures = self._served.model().shapes
        names = [s.name for s in figures.shapes]
        wanted = request.query.get("shape", [None])[0]
        if wanted is not None and wanted not in names:
            known = ", ".join(names) or "none"
            return Response(404, f"parameter shape: no shape {wanted[:64]!r} is configured (--fleet.shape; shapes: {known})\n".encode())
        return _json(placeable_document(figures, wanted))


def placeable_document(figures: ShapeFigures, shape: str | None = None) -> dict[str, Any]:
    """``/api/v1/placeable``: per configured request shape (or only ``shape``), whether this node's
    agent would place it with fragmentation allowed and disallowed and why not, what the manager
    sees left of its slot, HAMi's node score of that slot and the devices HAMi's device policies
    would take. Amounts are exact decimal strings, scores have four decimals."""
    verdicts = {(v.shape, v.fragmentation): v for v in figures.verdicts}
    picks: dict[str, dict[str, Any]] = {}
    for pick in figures.hami_picks:
        picks.setdefault(pick.shape, {})[pick.policy] = {
            "placed": pick.placement is not None,
            "placement": {d: str(a) for d, a in (pick.placement or {}).items()},
            "reason": pick.reason,
        }
    shapes = []
    for s in figures.shapes:
        if shape is not None and s.name != shape:
            continue
        slot, _ = s.accelerator
        modes = [m for m in ("allowed", "disallowed") if (s.name, m) in verdicts]
        score = figures.hami_scores.get(slot)
        shapes.append({
            "shape": s.name,
            "request": {k: str(a) for k, a in s.slots},
            "slot": slot,
            "remaining": _text(figures.remaining.get(slot)),
            "placeable": {m: verdicts[s.name, m].placeable for m in modes},
            "reason": {m: verdicts[s.name, m].reason for m in modes},
            "hami": {"node_score": None if score is None else _score(score), **picks.get(s.name, {})},
        })
    return {
        "remaining": {k: str(v) for k, v in sorted(figures.remaining.items())},
        "hami_node_scores": _scores(figures.hami_scores),
        "shapes": shapes,
    }


def _text(value: Decimal | None) -> str | None:
    return None if value is None else str(value)


def _score(value: Decimal) -> str:
    return str(value.quantize(Decimal("0.0001")))


def _scores(values: Mapping[str, Decimal]) -> dict[str, str]:
    return {k: _score(v) for k, v in sorted(values.items())}


def _param(request: Request, name: str) -> tuple[str, ...] | None:
    """Every value of one query parameter, as a key (None: absent)."""
    values = request.query.get(name)
    return tuple(values) if values is not None else None


def _wants(request: Request) -> tuple[bool, bool]:
    """(gzip, OpenMetrics): what the scraper's Accept-Encoding and Accept ask for."""
    return "gzip" in request.headers.get("accept-encoding", ""), negotiate(request.headers.get("accept", ""))


def _exposition(body: bytes, gzipped: bool, openmetrics: bool) -> Response:
    return Response(200, body, OPENMETRICS_CONTENT_TYPE if openmetrics else TEXT_FORMAT, {"Content-Encoding": "gzip"} if gzipped else {})


def _json(obj: object) -> Response:
    return Response(200, json_bytes(obj), JSON)
