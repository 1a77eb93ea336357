"""Headroom figures by the agent's rules; closed forms and shortcuts against brute force."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.analysis.headroom import (
    contiguous_headroom,
    count_fits,
    fragmentation_ratio,
    headroom,
    max_single_device_free,
    nofrag_bound,
    summarize,
    whole_free_devices,
)
from exporter.analysis.placement import (
    DeviceFree,
    NoFragRule,
    Placement,
    Policy,
    Request,
    apply_placement,
    evenly,
    nofrag_rejection,
    place,
    round_down,
)

D = Decimal
Q = D("0.1")
MULTI, SINGLE, NUMA = NoFragRule.MULTI_DEVICE, NoFragRule.SINGLE_DEVICE, NoFragRule.NUMA_CANDIDATES
RULES = [NUMA, MULTI, SINGLE]


def frees(*values: str, capacity: str = "1") -> list[DeviceFree]:
    """Devices of one capacity with the given free amounts, named gpu0, gpu1, …"""
    return [DeviceFree(f"gpu{i}", D(capacity), D(capacity) - D(v)) for i, v in enumerate(values)]


def test_headroom_with_fragmentation_allowed_ignores_slivers_below_min_memory() -> None:
    devices = frees("0.5", "0.005", "0.25")
    assert headroom(devices, D("0.01")) == D("0.75")
    # 0.7 and 0.6 would be split 0.25 + rest, and 0.25 rounds down to 0.2: only 0.5 arrives whole.
    assert headroom(devices, Q) == D("0.5")
    assert max_single_device_free(devices) == D("0.5")
    assert max_single_device_free([]) == 0
    assert max_single_device_free(frees("-0.5")) == 0


def test_headroom_counts_only_what_is_received_in_full() -> None:
    # Σ free 0.48 rounds to one quantum of 0.25, but EVENLY splits it 0.13 + 0.12 and both round
    # to 0: nothing can be handed out.
    assert headroom(frees("0.24", "0.24", capacity="0.5"), D("0.25")) == 0
    # 0.75 would be split 0.30 + 0.45 → 0.25 + 0.25; 0.5 fits on one device.
    assert headroom(frees("0.5", "0.3"), D("0.25")) == D("0.5")


@pytest.mark.parametrize(
    ("free", "allowed", "multi", "single"),
    [
        (["0.5", "1.0", "1.0", "1.0"], "3.5", "3.0", "1.0"),  # three whole devices, not 3.5
        (["0.2", "1.0"], "1.2", "1.0", "1.0"),  # 1.6 is rejected upstream, so is 1.2
        (["0.9", "1.0"], "1.9", "1.9", "1.0"),  # 0.9 + 1.0: parts may differ by one quantum
        (["0.55", "0.55"], "1.0", "0.5", "0.5"),  # 1.1 arrives as 0.5 + 0.5; guarded, R <= C must fit one device
        ([], "0", "0", "0"),
        (["0", "0"], "0", "0", "0"),
    ],
)
def test_headroom_figures(free: list[str], allowed: str, multi: str, single: str) -> None:
    devices = frees(*free)
    for rule in RULES:  # one NUMA node: the releases differ only in the guard
        assert headroom(devices, Q, rule) == D(allowed)
    assert headroom(devices, Q, MULTI, guarded=True) == headroom(devices, Q, NUMA, guarded=True) == D(multi)
    assert headroom(devices, Q, SINGLE, guarded=True) == D(single)


def test_nofrag_bound_is_what_the_guard_accepts() -> None:
    assert nofrag_bound(frees("0.9", "1.0"), Q, MULTI) == D("1.9")
    assert nofrag_bound(frees("0.5", "1.0", "1.0", "1.0"), Q, SINGLE) == D("1.0")


def test_on_two_numa_nodes_the_guard_takes_its_capacity_from_the_least_allocated_node() -> None:
    # 7.5/13.5 and 4.2/10 free on node 0, 4.9/10 on node 1: node 1 is the less allocated, so the
    # guard's C is 10 and 12.8 may be split 4.3 + 4.2 + 4.3 (as the agent does, quantum 0.1).
    devices = [DeviceFree("a", D("13.5"), D("6"), 0), DeviceFree("b", D(10), D("5.8"), 0), DeviceFree("c", D(10), D("5.1"), 1)]
    assert nofrag_bound(devices, Q, NUMA) == headroom(devices, Q, NUMA, guarded=True) == D("12.8")
    # Without NUMA nodes C would be the freest device's 13.5: nothing above 7.5 up to 13.5 fits.
    flat = [DeviceFree(d.device_id, d.capacity, d.allocated) for d in devices]
    assert headroom(flat, Q, NUMA, guarded=True) == D("7.5")


def test_whole_devices_count_in_ones() -> None:
    devices = [DeviceFree(f"d{i}", D(1), D(a)) for i, a in enumerate("0101")]
    s = summarize(devices, D(1), MULTI)
    assert (s.headroom, s.headroom_nofrag, s.whole_free_devices) == (2, 2, 2)
    mig = summarize(devices, D(1), MULTI, unique=True)  # MIG: exactly one instance per request
    assert (mig.headroom, mig.headroom_nofrag, mig.whole_free_devices) == (1, 1, 2)
    assert summarize(devices[1:2] + devices[3:], D(1), MULTI, unique=True).headroom == 0


def test_whole_free_devices_and_fragmentation_ratio() -> None:
    assert whole_free_devices(frees("1.0", "0.4", "1.0", "0")) == 2
    assert fragmentation_ratio(frees("1.0", "1.0")) == 0  # empty node: nothing fragmented
    assert fragmentation_ratio(frees("0", "0")) == 0  # full node: nothing free to fragment
    assert fragmentation_ratio(frees("0.3", "0.2")) == 1  # only remainders left
    assert fragmentation_ratio(frees("1.0", "0.5", "0.5")) == D("0.5")


def test_summarize() -> None:
    devices = [*frees("1.0", "0.4"), DeviceFree("gpu2", D(1), D("1.5"))]
    s = summarize(devices, Q, MULTI)
    assert (s.capacity, s.allocated, s.free) == (D(3), D("2.1"), D("1.4"))
    assert (s.headroom, s.headroom_nofrag, s.max_single_device_free) == (D("1.4"), D("1.0"), D("1.0"))
    assert s.whole_free_devices == 1
    assert s.overcommitted_devices == ("gpu2",)


def test_count_fits() -> None:
    devices = frees("0.2", "1.0")
    shares = Request("cuda.shares", D("0.3"))
    # three on gpu1 alone, then one split over the 0.2 + 0.1 remainders
    assert count_fits(devices, shares, Policy.EVENLY, quantum=Q) == 4
    assert count_fits(devices, shares, Policy.EVENLY_NOFRAG, quantum=Q) == 3
    whole = [DeviceFree(f"d{i}", D(1), D(0)) for i in range(3)]
    assert count_fits(whole, Request("cuda.device", D(2)), Policy.EVENLY) == 1
    assert count_fits(devices, Request("cuda.shares", D("0.01")), Policy.EVENLY, limit=5) == 5


# --- properties --------------------------------------------------------------------------------

hundredths = st.integers(min_value=-20, max_value=150).map(lambda n: D(n) / 100)
quanta = st.sampled_from([D("0.01"), D("0.05"), D("0.1"), D("0.25")])


numa_nodes = st.sampled_from([None, 0, 1, 2])


@st.composite
def nodes(draw, homogeneous: bool = False):
    count = draw(st.integers(min_value=1, max_value=5))
    caps = (
        [D(1)] * count
        if homogeneous
        else draw(st.lists(st.sampled_from([D("0.5"), D(1), D("1.5")]), min_size=count, max_size=count))
    )
    devices = [DeviceFree(f"gpu{i}", c, c - min(draw(hundredths), c), draw(numa_nodes)) for i, c in enumerate(caps)]
    return devices, draw(quanta)


def _largest(devices, quantum, accepts) -> Decimal:
    best, request = D(0), quantum
    while request <= sum((d.free for d in devices if d.free > 0), D(0)):
        if accepts(request):
            best = request
        request += quantum
    return best


@settings(max_examples=300, deadline=None)
@given(nodes(), st.sampled_from(list(NoFragRule)))
def test_nofrag_bound_equals_search(node, rule) -> None:
    devices, quantum = node
    total = round_down(sum((d.free for d in devices if d.free >= D("0.01")), D(0)), quantum)
    search = _largest(devices, quantum, lambda r: r <= total and nofrag_rejection(devices, r, quantum, rule) is None)
    assert nofrag_bound(devices, quantum, rule) == search


@settings(max_examples=300, deadline=None)
@given(nodes(), st.sampled_from(RULES), st.booleans())
def test_headroom_equals_largest_request_received_in_full(node, rule, guarded) -> None:
    devices, quantum = node

    def full(request: Decimal) -> bool:
        result = evenly(devices, request, quantum, rule, guarded=guarded)
        return isinstance(result, Placement) and result.total == request

    assert headroom(devices, quantum, rule, guarded=guarded) == _largest(devices, quantum, full)


@settings(max_examples=200, deadline=None)
@given(nodes())
def test_figures_are_ordered(node) -> None:
    devices, quantum = node
    for rule in RULES:
        s = summarize(devices, quantum, rule)
        assert 0 <= s.headroom_nofrag <= s.headroom <= s.free
        assert 0 <= s.contiguous_nofrag <= s.headroom_nofrag and 0 <= s.contiguous <= s.headroom
        assert 0 <= s.fragmentation_ratio <= 1
    assert headroom(devices, quantum, SINGLE, guarded=True) <= s.max_single_device_free


@settings(max_examples=200, deadline=None)
@given(nodes(), st.sampled_from([Policy.EVENLY, Policy.EVENLY_NOFRAG]), st.integers(1, 40), st.sampled_from(RULES))
def test_count_fits_shortcut_equals_replaying_requests(node, policy, steps, rule) -> None:
    devices, quantum = node
    request = Request("cuda.shares", steps * quantum)
    replayed, current = 0, devices
    while isinstance(result := place(current, request, policy, quantum=quantum, rule=rule), Placement):
        current = apply_placement(current, result)
        replayed += 1
    assert count_fits(devices, request, policy, quantum=quantum, rule=rule) == replayed


def _gapless(devices, quantum, accepts) -> Decimal:
    """Brute force: the last size before the first one that does not fit."""
    request = quantum
    while request <= sum((d.free for d in devices if d.free > 0), D(0)) and accepts(request):
        request += quantum
    return request - quantum


@settings(max_examples=300, deadline=None)
@given(nodes(), st.sampled_from(RULES), st.booleans())
def test_contiguous_headroom_is_where_the_first_gap_starts(node, rule, guarded) -> None:
    devices, quantum = node

    def full(request: Decimal) -> bool:
        result = evenly(devices, request, quantum, rule, guarded=guarded)
        return isinstance(result, Placement) and result.total == request

    gapless = contiguous_headroom(devices, quantum, rule, guarded=guarded)
    assert gapless == _gapless(devices, quantum, full)
    assert gapless <= headroom(devices, quantum, rule, guarded=guarded)


def test_with_fragmentation_disallowed_the_sizes_that_fit_have_gaps() -> None:
    # Two 13.5-share A100s with 7.26 and 7.25 free: 14.51 is split 7.26 + 7.25, but 10.01 and 12
    # are no larger than one device and no device has them free.
    devices = [DeviceFree("GPU-a", D("13.5"), D("6.24")), DeviceFree("GPU-b", D("13.5"), D("6.25"))]
    q = D("0.01")
    assert headroom(devices, q, guarded=True) == D("14.51")
    assert contiguous_headroom(devices, q, guarded=True) == D("7.26")
    for request, fits in [("7.26", True), ("7.27", False), ("10.01", False), ("12", False), ("13.5", False),
                          ("13.51", True), ("14.51", True), ("14.52", False)]:
        assert isinstance(evenly(devices, D(request), q, guarded=True), Placement) is fits, request
    assert contiguous_headroom(devices, q) == headroom(devices, q) == D("14.51")  # fragmentation allowed: no gaps
    s = summarize(devices, q)
    assert (s.headroom_nofrag, s.contiguous_nofrag, s.contiguous) == (D("14.51"), D("7.26"), D("14.51"))
