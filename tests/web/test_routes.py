"""The JSON documents the routes serve: ``/api/v1/state`` text cached per change and per kernel."""

from __future__ import annotations

import json
from decimal import Decimal

from exporter.analysis.model import NodeState
from exporter.analysis.placement import DeviceFree
from exporter.metrics.documents import StateText, json_default, state_document
from exporter.scratch.allocation import AllocationBook
from exporter.scratch.resources import Allocation, ResourceSpec


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
