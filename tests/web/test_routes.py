"""The JSON documents the routes serve: ``/api/v1/state`` encoded per change and shared while held,
the answers of ``/api/v1/simulate`` and ``/api/v1/alloc-map`` kept while their state is current, and
``/api/v1/placeable`` from the published shape figures."""

from __future__ import annotations

import dataclasses
import gc
import json
import weakref
from decimal import Decimal
from typing import NoReturn

from exporter.analysis.model import NodeState
from exporter.analysis.placement import DeviceFree
from exporter.analysis.shapes import Shape
from exporter.metrics import documents
from exporter.metrics.documents import StateText, json_default, state_document
from exporter.scratch.allocation import AllocationBook
from exporter.scratch.resources import Allocation, ResourceSpec
from exporter.web.routes import Routes, Served
from exporter.web.server import Request


def spec(*allocs: tuple[str, str, str]) -> ResourceSpec:
    return ResourceSpec(tuple(Allocation(s, d, Decimal(a)) for s, d, a in allocs), (("cuda.shares", Decimal("1")),), "c" * 64)


def expected(view, roots, node) -> bytes:
    return json.dumps(state_document(view, roots, node), indent=1, default=json_default).encode() + b"\n"


def test_state_text_equals_the_document_and_is_reused_until_something_moves() -> None:
    book = AllocationBook(clock=lambda: 1.0)
    text = StateText()
    roots = ["/r"]
    node = NodeState({"cuda.shares": (DeviceFree("GPU-a", Decimal("13.5"), Decimal("1.5")),)})
    assert text.render(book.view(), roots, None) == expected(book.view(), roots, None)  # no kernels
    book.apply("k1", "/r", spec(("cuda.shares", "GPU-a", "0.5"), ("cpu", "0", "1")))
    book.apply('k2"\\\n\u202e', "/r", spec(("cuda.shares", 'GPU-"b\\', "1.0")))
    book.apply("k3", "/r", ValueError("bad file"))
    first = text.render(book.view(), roots, node)
    assert first == expected(book.view(), roots, node)
    assert text.render(book.view(), roots, node) is first  # polling costs nothing
    book.apply("k1", "/r", spec(("cuda.shares", "GPU-a", "0.25")))
    book.remove("k3")
    second = text.render(book.view(), roots, node)
    assert second == expected(book.view(), roots, node)
    other = NodeState({"cuda.shares": (DeviceFree("GPU-a", Decimal("13.5"), Decimal("1.25")),)})
    assert text.render(book.view(), roots, other) == expected(book.view(), roots, other)



class _Kernels(dict):
    """A view's kernel table that a weak reference can follow."""


def test_state_text_keeps_neither_the_view_nor_the_document(monkeypatch) -> None:
    encoded = []
    entry = documents._entry
    monkeypatch.setattr(documents, "_entry", lambda kernel_id, kernel: encoded.append(kernel_id) or entry(kernel_id, kernel))
    book = AllocationBook(clock=lambda: 1.0)
    text = StateText()
    roots = ["/r"]
    book.apply("k1", "/r", spec(("cuda.shares", "GPU-a", "0.5")))
    book.apply("k2", "/r", spec(("cuda.shares", "GPU-b", "1.0")))
    view = dataclasses.replace(book.view(), kernels=_Kernels(book.view().kernels))
    want = expected(view, roots, None)
    document = text.render(view, roots, None)
    assert document == want and bytes(document) == want and encoded == ["k1", "k2"]
    view_gone, kernels_gone, document_gone = weakref.ref(view), weakref.ref(view.kernels), weakref.ref(document)
    assert text.render(view, roots, None) is document  # shared while a response still holds it
    del view
    gc.collect()
    assert view_gone() is None and kernels_gone() is None
    del document
    gc.collect()
    assert document_gone() is None  # dropped by every response: not kept
    again = text.render(book.view(), roots, None)  # the same version: from the compressed entries
    assert again == want and encoded == ["k1", "k2"]
    ended = weakref.ref(book.view().kernels["k1"])
    book.remove("k1")
    book.view()  # the book's own last view no longer holds it
    del again
    gc.collect()
    assert ended() is None  # an ended kernel is not kept alive by the entries kept for the next request
    assert text.render(book.view(), roots, None) == expected(book.view(), roots, None)
    assert encoded == ["k1", "k2"]  # k1 left its chunk: k2's entry is cut from the chunk's text, not encoded again


def test_state_text_renders_each_view_whole_whatever_came_before() -> None:
    book = AllocationBook(clock=lambda: 1.0)
    text = StateText()
    roots = ["/r", "/s"]
    book.apply("k1", "/r", spec(("cuda.shares", "GPU-a", "0.5")))
    book.apply("k2", "/s", spec(("cuda.shares", "GPU-b", "1.0")))
    first_view = book.view()
    book.remove("k1")
    book.apply("k2", "/s", spec(("cuda.shares", "GPU-b", "0.75")))
    book.apply("k0", "/r", ValueError("bad file"))
    second_view = book.view()
    first = text.render(first_view, roots, None)
    second = text.render(second_view, roots, None)
    assert first == expected(first_view, roots, None) and second == expected(second_view, roots, None)
    assert first != second
    assert text.render(first_view, roots, None) == first  # back to an older version: encoded anew
    book.remove_many(["k0", "k2"])
    empty = text.render(book.view(), roots, None)
    assert empty == expected(book.view(), roots, None) and json.loads(bytes(empty))["kernels"] == []

# -- /api/v1/placeable -------------------------------------------------------------------------------


def placeable_routes(shapes: tuple) -> Routes:
    from exporter.analysis.node import HeadroomParams
    from exporter.analysis.pipeline import analyse
    from exporter.telemetry.model import DeviceReading, TelemetrySnapshot

    book = AllocationBook(clock=lambda: 1.0)
    # GPU-0 holds 1.5 of its 2 shares, GPU-1 1.25: 1.25 free in all, at most 0.75 in one piece.
    book.apply("k1", "/r", spec(("cuda.shares", "GPU-0", "1.5"), ("cuda.shares", "GPU-1", "1.25")))
    snapshot = TelemetrySnapshot(source="mock", success=True, devices=tuple(
        DeviceReading(uuid=f"GPU-{i}", index=i, memory_total_bytes=4 << 30, multiprocessor_count=16) for i in range(2)))
    model = analyse(book.view(), snapshot, HeadroomParams(), shapes=shapes)

    def unread(*_: object) -> NoReturn:
        raise AssertionError("/api/v1/placeable reads only the read model")

    return Routes(Served(view=unread, model=lambda: model, render=unread, render_cached=unread, ready=unread, watcher=unread))


def test_placeable_answers_per_shape_with_reasons_and_hami_figures() -> None:
    shapes = (Shape.parse("half=cuda.shares:0.5,cpu:2"), Shape.parse("one=cuda.shares:1"))
    routes = placeable_routes(shapes)
    response = routes.handle(Request("GET", "/api/v1/placeable", {}, {}))
    assert response.status == 200 and response.content_type == "application/json"
    doc = json.loads(response.body)
    assert doc["remaining"] == {"cuda.shares": "1.25"}
    assert doc["hami_node_scores"] == {"cuda.shares": "13.7500"}  # 10 × 2 × 2.75 / 4
    half, one = doc["shapes"]
    assert half["request"] == {"cuda.shares": "0.5", "cpu": "2"} and half["slot"] == "cuda.shares"
    assert half["placeable"] == {"allowed": True, "disallowed": True} and half["reason"] == {"allowed": None, "disallowed": None}
    assert half["hami"]["binpack"] == {"placed": True, "placement": {"GPU-0": "0.50"}, "reason": None}
    assert half["hami"]["spread"]["placement"] == {"GPU-1": "0.50"} and half["hami"]["node_score"] == "13.7500"
    # 1.25 left covers 1 in total; no device holds 1, the guard refuses a split.
    assert one["remaining"] == "1.25" and one["placeable"] == {"allowed": True, "disallowed": False}
    assert one["reason"]["disallowed"] == "fragmented"
    only = json.loads(routes.handle(Request("GET", "/api/v1/placeable", {"shape": ["one"]}, {})).body)
    assert [s["shape"] for s in only["shapes"]] == ["one"]
    missing = routes.handle(Request("GET", "/api/v1/placeable", {"shape": ["two"]}, {}))
    assert missing.status == 404
    assert missing.body == b"parameter shape: no shape 'two' is configured (--fleet.shape; shapes: half, one)\n"
    assert not routes.routes["/api/v1/placeable"].offload  # formats published figures only


def test_a_question_asked_again_before_the_state_moves_is_answered_from_the_kept_bytes(monkeypatch) -> None:
    """``/api/v1/simulate`` and ``/api/v1/alloc-map`` keep their answers while the state they read
    is current: the loop answers a repeated question (``Route.cached``); a newer state, another
    question, or more questions than are kept go to the handler."""
    from exporter.analysis.model import Analysis
    from exporter.analysis.node import HeadroomParams
    from exporter.analysis.pipeline import analyse
    from exporter.web import routes as routes_module

    book = AllocationBook()
    book.apply("k1", "/r", spec(("cuda.shares", "GPU-0", "1.5")))
    published = [analyse(book.view(), params=HeadroomParams())]
    asked = []
    real_what_if = Analysis.what_if
    monkeypatch.setattr(Analysis, "what_if", lambda self, *a: asked.append(a) or real_what_if(self, *a))
    routes = Routes(Served(view=book.view, model=lambda: published[0], render=None, render_cached=None, ready=None,
                           watcher=None, version=lambda: book.version))
    simulate, alloc_map = routes.routes["/api/v1/simulate"], routes.routes["/api/v1/alloc-map"]

    def ask(route, **query: str):
        """(the kept answer, then the handler's) to one question."""
        request = Request("GET", "/", {k: [v] for k, v in query.items()}, {})
        return route.cached(request), route.handler(request)

    kept, fresh = ask(simulate, request="cuda.shares=0.5")
    assert kept is None and fresh.status == 200 and len(asked) == 1
    again = simulate.cached(Request("GET", "/", {"request": ["cuda.shares=0.5"]}, {}))
    assert again.body == fresh.body and again.headers is not fresh.headers and len(asked) == 1
    assert simulate.cached(Request("GET", "/", {"request": ["cuda.shares=0.25"]}, {})) is None  # another question
    # A new node state (its headroom version moves): the kept answer is not served.
    published[0] = dataclasses.replace(published[0], headroom_version=published[0].headroom_version + 1)
    assert simulate.cached(Request("GET", "/", {"request": ["cuda.shares=0.5"]}, {})) is None

    # The absolute alloc map reads the book: it moves with the book's version, before any pass.
    kept, fresh = ask(alloc_map)
    assert kept is None and json.loads(fresh.body) == {"GPU-0": "1.5"}
    assert alloc_map.cached(Request("GET", "/", {}, {})).body == fresh.body
    book.apply("k2", "/r", spec(("cuda.shares", "GPU-0", "0.5")))
    assert alloc_map.cached(Request("GET", "/", {}, {})) is None
    assert json.loads(alloc_map.handler(Request("GET", "/", {}, {})).body) == {"GPU-0": "2.0"}

    # At most _ANSWERS_KEPT answers per state: a client that varies its query keeps nothing more.
    monkeypatch.setattr(routes_module, "_ANSWERS_KEPT", 2)
    for amount in ("0.1", "0.2", "0.3"):
        simulate.handler(Request("GET", "/", {"request": [f"cuda.shares={amount}"]}, {}))
    assert [simulate.cached(Request("GET", "/", {"request": [f"cuda.shares={a}"]}, {})) is not None
            for a in ("0.1", "0.2", "0.3")] == [True, True, False]
