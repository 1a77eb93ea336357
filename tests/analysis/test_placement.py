"""What-if placement: Backend.AI's EVENLY allocator (upstream's own test tables), its
fragmentation guard, go-gpuallocator and tensor-fusion policies, and properties."""

from __future__ import annotations

import math
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.analysis.placement import (
    AffinityPolicy,
    DeviceFree,
    NoFragRule,
    Placement,
    Policy,
    Rejection,
    Request,
    apply_placement,
    link_score,
    nofrag_rejection,
    numa_chain,
    place,
    round_down,
)

D = Decimal
SHARES = "cuda.shares"


def devices(*capacities: str, allocated: list[str] | None = None, prefix: str = "a") -> list[DeviceFree]:
    allocated = allocated or ["0"] * len(capacities)
    return [DeviceFree(f"{prefix}{i}", D(c), D(a)) for i, (c, a) in enumerate(zip(capacities, allocated, strict=True))]


def with_free(*free: str) -> list[DeviceFree]:
    """Capacity-1 devices gpu0… with the given free amounts (upstream's _make_map_with_remaining)."""
    return [DeviceFree(f"gpu{i}", D(1), D(1) - D(f)) for i, f in enumerate(free)]


def run(devs, amount: str, policy=Policy.EVENLY, quantum="0.01", slot=SHARES, **kw):
    return place(devs, Request(slot, D(amount)), policy, quantum=D(quantum), **kw)


def amounts(result) -> dict[str, str]:
    assert isinstance(result, Placement), result
    return {k: str(v.normalize()) for k, v in result.amounts.items()}


# --- the figures the exporter must reproduce ----------------------------------------------------


def test_evenly_splits_1_2_over_two_empty_devices_as_0_60_each() -> None:
    result = run(devices("1", "1"), "1.2")
    assert result.amounts == {"a0": D("0.60"), "a1": D("0.60")}


def test_26_4_guard_accepts_1_4_as_two_times_0_7() -> None:
    result = run(with_free("0.5", "1.0", "1.0", "1.0"), "1.4", Policy.EVENLY_NOFRAG, quantum="0.1")
    assert sorted(amounts(result).values()) == ["0.7", "0.7"]
    assert "gpu0" not in result.amounts


def test_guard_rejects_1_6_when_one_device_has_0_2_free() -> None:
    result = run(with_free("0.2", "1.0"), "1.6", Policy.EVENLY_NOFRAG, quantum="0.1")
    assert isinstance(result, Rejection) and result.reason == "fragmented"


def test_guard_before_26_4_rejects_any_multi_device_request() -> None:
    result = run(
        with_free("0.5", "1.0", "1.0", "1.0"), "1.4", Policy.EVENLY_NOFRAG, quantum="0.1", rule=NoFragRule.SINGLE_DEVICE
    )
    assert isinstance(result, Rejection) and result.reason == "fragmented"
    assert amounts(
        run(with_free("0.5", "1.0"), "0.9", Policy.EVENLY_NOFRAG, quantum="0.1", rule=NoFragRule.SINGLE_DEVICE)
    ) == {"gpu1": "0.9"}


# --- NUMA nodes (the affinity hint resources.allocate() always passes) --------------------------


def numa(*rows: tuple[str, str, int | None]) -> list[DeviceFree]:
    """Devices n0, n1, … given as (capacity, free, NUMA node)."""
    return [DeviceFree(f"n{i}", D(c), D(c) - D(f), node) for i, (c, f, node) in enumerate(rows)]


def test_numa_chain_puts_the_least_allocated_node_first_and_interleaves() -> None:
    devs = numa(("10", "2", 0), ("10", "9", 0), ("10", "5", 1), ("10", "4", 1), ("10", "3", 2))
    # Allocated: node 0 9, node 1 11, node 2 7 (node 2 first, then 0, then 1); free order within a node.
    assert [d.device_id for d in numa_chain(devs)] == ["n4", "n1", "n2", "n0", "n3"]
    assert [d.device_id for d in numa_chain(devs, AffinityPolicy.PREFER_SINGLE_NODE)] == ["n4", "n1", "n0", "n2", "n3"]
    # Equal allocations: the node with more devices first, then the one enumerated first.
    even = numa(("10", "10", 1), ("10", "10", 0), ("10", "10", 0))
    assert [d.device_id for d in numa_chain(even, AffinityPolicy.PREFER_SINGLE_NODE)] == ["n1", "n2", "n0"]
    assert [d.device_id for d in numa_chain(numa(("1", "0.5", None), ("1", "1", None)))] == ["n1", "n0"]


def test_guard_capacity_comes_from_the_first_device_of_the_numa_chain() -> None:
    devs = numa(("13.5", "7.5", 0), ("10", "4.2", 0), ("10", "4.9", 1))
    for rule in (NoFragRule.NUMA_CANDIDATES, NoFragRule.MULTI_DEVICE):
        assert nofrag_rejection(devs, D("12.8"), D("0.1"), rule) is None
    assert amounts(run(devs, "12.8", Policy.EVENLY_NOFRAG, quantum="0.1")) == {"n0": "4.3", "n1": "4.2", "n2": "4.3"}
    flat = [DeviceFree(d.device_id, d.capacity, d.allocated) for d in devs]
    assert "no device has 12.8 free" in nofrag_rejection(flat, D("12.8"), D("0.1"))
    # Before 26.4 the first device of the chain must hold it: node 1's, with 4.9 free.
    assert "n2, 4.9 free" in nofrag_rejection(devs, D("5"), D("0.1"), NoFragRule.SINGLE_DEVICE)


def test_guard_within_one_device_wants_the_rounded_up_part() -> None:
    # 1.25 with quantum 0.1 is one part of 1.2 that must be 1.3: a device with 1.25 free is not enough.
    assert nofrag_rejection(devices("2", allocated=["0.75"]), D("1.25"), D("0.1")) is not None
    assert nofrag_rejection(devices("2", allocated=["0.7"]), D("1.25"), D("0.1")) is None


def test_26_9_never_overfills_a_device_where_the_26_4_allocator_does() -> None:
    # Node 0 (5 free) holds less than node 1 (8 and 1 free), so the chain is 5, 8, 1 and 12 does
    # not fit on its first device.
    devs = numa(("10", "5", 0), ("10", "8", 1), ("10", "1", 1))
    old = run(devs, "12", rule=NoFragRule.MULTI_DEVICE)
    assert amounts(old) == {"n0": "6", "n1": "6"} and "n0 receives 6.00 with 5 free" in old.note
    assert amounts(run(devs, "12")) == {"n0": "5", "n1": "7"}


def test_26_9_prefers_a_candidate_on_one_numa_node_on_a_tie() -> None:
    # 6 over two devices is as even on node 0 (4 + 4 free) as across nodes: node 0 (less allocated) wins.
    devs = numa(("10", "4", 1), ("10", "4", 0), ("10", "4", 0), ("10", "4", 1), ("10", "5", 1))
    assert amounts(run(devs, "6")) == {"n1": "3", "n2": "3"}


def test_26_9_fits_on_any_device_that_holds_the_request() -> None:
    devs = numa(("10", "3", 0), ("10", "10", 1), ("10", "2.5", 1))
    assert amounts(run(devs, "4")) == {"n1": "4"}
    assert amounts(run(devs, "4", rule=NoFragRule.MULTI_DEVICE)) == {"n1": "2", "n2": "2"}


# --- upstream FractionAllocMap EVENLY tables (tests/unit/agent/test_alloc_map.py) --------------


def test_even_allocation_table() -> None:  # test_fraction_alloc_map_even_allocation
    devs = devices("0.05", "0.1", "0.2", "0.3", "0.0")
    assert run(devs, "0.66").reason == "insufficient"
    current = devs
    for _ in range(20):
        current = apply_placement(current, run(current, "0.01"))
    assert [str(d.allocated.normalize()) for d in current[:3]] == ["0.05", "0.1", "0.05"]
    assert amounts(run(devs, "0.2")) == {"a2": "0.2"}
    assert amounts(run(devs, "0.5")) == {"a2": "0.2", "a3": "0.3"}
    assert amounts(run(devs, "0.65")) == {"a0": "0.05", "a1": "0.1", "a2": "0.2", "a3": "0.3"}
    assert amounts(run(devices("0.3", "0.3", "0.9"), "1")) == {"a0": "0.3", "a1": "0.3", "a2": "0.4"}


def test_even_allocation_fractions() -> None:  # test_fraction_alloc_map_even_allocation_fractions
    devs = devices("0.8", "0.75", "0.7", "0.3", "0.0")
    assert amounts(run(devs, "2.31")) == {"a0": "0.67", "a1": "0.67", "a2": "0.67", "a3": "0.3"}
    assert amounts(run(devs, "2")) == {"a0": "0.67", "a1": "0.67", "a2": "0.66"}


def test_even_allocation_many_devices() -> None:  # …_even_allocation_many_devices(_2)
    assert amounts(run(devices("2", "3", "3", "5"), "6")) == {"a1": "3", "a2": "3"}
    result = amounts(run(devices(*["1.0"] * 8), "6"))
    # "the even allocator favors the tail of device list when it fills up"
    assert sorted(result) == ["a2", "a3", "a4", "a5", "a6", "a7"] and set(result.values()) == {"1"}


@pytest.mark.parametrize(
    ("amount", "expected"),
    [
        ("0.5", {"a1": "0.5"}),
        ("1.5", {"a0": "0.75", "a1": "0.75"}),
        ("1.75", {"a0": "0.75", "a1": "0.75"}),  # split 0.88 + 0.87, each rounded down: less than asked
        ("0.52", {"a1": "0.5"}),
        ("0.42", {"a1": "0.25"}),
    ],
)
def test_quantum_size_table(amount: str, expected: dict) -> None:  # test_quantum_size, EVENLY
    result = run(devices("1", "1"), amount, quantum="0.25")
    assert amounts(result) == expected
    assert ("rounds" in result.note) == (result.total != D(amount))


def test_quantum_size_rejections() -> None:
    assert run(devices("1", "1"), "0.24", quantum="0.25").reason == "below-quantum"
    assert run(devices("1", "1"), "3.99", quantum="0.25").reason == "insufficient"


# BA-3308 table (TestDefragAllocationStrategy): 8 devices of 1.0, quantum 0.1, requests 0.1…8.0.
DEFRAG_REQUESTS = [D(n) / 10 for n in range(1, 81)]


@pytest.mark.parametrize("requested", DEFRAG_REQUESTS, ids=str)
def test_defrag_table_evenly_uses_at_least_ceil_devices(requested: Decimal) -> None:
    result = run(devices(*["1.0"] * 8), str(requested), Policy.EVENLY_NOFRAG, quantum="0.1")
    assert isinstance(result, Placement)
    assert all(v % D("0.1") == 0 for v in result.amounts.values())
    assert len(result.amounts) >= math.ceil(requested)


@pytest.mark.parametrize(
    ("requested", "density"),
    [
        ("1.1", "0.5"),
        ("1.3", "0.6"),
        ("1.5", "0.7"),
        ("2.2", "0.7"),
        ("3.1", "0.7"),
        ("5.2", "0.8"),
        ("6.1", "0.8"),
        ("7.9", "0.9"),
    ],
)
def test_defrag_quantized_density(requested: str, density: str) -> None:  # TestDefragDensityCalculation
    r = D(requested)
    assert round_down(r / math.ceil(r), D("0.1")) == D(density)


@pytest.mark.parametrize("requested", ["1.5", "2.5", "1.1", "1.2"])
def test_shortfall_remainder_cases_are_accepted(requested: str) -> None:  # TestShortfallRemainder
    assert isinstance(run(devices(*["1.0"] * 8), requested, Policy.EVENLY_NOFRAG, quantum="0.1"), Placement)


def test_single_device_requests_stay_on_one_device() -> None:  # test_single_device_regression
    for requested in ("0.1", "0.5", "1.0"):
        assert len(run(devices(*["1.0"] * 8), requested, Policy.EVENLY_NOFRAG, quantum="0.1").amounts) == 1


def test_evenly_best_fit_prefers_the_smallest_device_that_fits() -> None:  # issue #85
    devs = devices("0.3", "0.2", "0.1")
    assert amounts(run(devs, "0.1")) == {"a2": "0.1"}
    assert amounts(run(devs, "0.15")) == {"a1": "0.15"}
    assert amounts(run(devs, "0.3")) == {"a0": "0.3"}
    assert amounts(run(devices("0.3", "0.3"), "0.4")) == {"a0": "0.2", "a1": "0.2"}
    assert run(devs, "0.7").reason == "insufficient"


# --- ensure_slot_not_fragmented (TestDefragWithOccupiedDevices, TestDefragEdgeCases) ----------

GUARD_ACCEPTS = [
    (["0.5", "1.0", "1.0", "1.0"], "1.4"),
    (["0.7", "0.7", "1.0", "1.0"], "2.0"),
    (["0.9", "1.0"], "1.4"),
    (["1.0"] * 4, "1.0"),
    (["1.0"] * 4, "4.0"),
    (["1.0"], "0.7"),
]
GUARD_REJECTS = [
    (["0.5", "0.5", "1.0", "1.0"], "2.8"),
    (["0.8", "0.8", "0.8", "0.8"], "3.6"),
    (["0.2", "1.0"], "1.6"),
    (["1.0", "1.0"], "3.0"),
    (["1.0"], "1.1"),
]


@pytest.mark.parametrize(("free", "requested"), GUARD_ACCEPTS)
def test_guard_accepts_like_upstream(free: list[str], requested: str) -> None:
    assert nofrag_rejection(with_free(*free), D(requested), D("0.1"), NoFragRule.MULTI_DEVICE) is None
    result = run(with_free(*free), requested, Policy.EVENLY_NOFRAG, quantum="0.1")
    assert isinstance(result, Placement) and result.total == D(requested)


@pytest.mark.parametrize(("free", "requested"), GUARD_REJECTS)
def test_guard_rejects_like_upstream(free: list[str], requested: str) -> None:
    assert nofrag_rejection(with_free(*free), D(requested), D("0.1"), NoFragRule.MULTI_DEVICE) is not None
    assert run(with_free(*free), requested, Policy.EVENLY_NOFRAG, quantum="0.1").reason == "fragmented"


# --- whole devices and MIG (DiscretePropertyAllocMap) ------------------------------------------


def test_whole_devices_evenly() -> None:  # test_heterogeneous_resource_slots_with_discrete_alloc_map
    devs = devices("1", "1")
    assert amounts(run(devs, "2", slot="cuda.device")) == {"a0": "1", "a1": "1"}
    assert run(devs, "3", slot="cuda.device").reason == "insufficient"
    taken = devices("1", "1", "1", allocated=["1", "0", "0"])
    assert amounts(run(taken, "1", slot="cuda.device")) == {"a1": "1"}
    assert run(devs, "1.5", slot="cuda.device").reason == "invalid-request"


def test_mig_slots_are_unique() -> None:
    slot = "cuda.device:1g.5gb-mig"
    migs = devices("1", "1", prefix="MIG-")
    first = run(migs, "1", slot=slot)
    assert amounts(first) == {"MIG-0": "1"}
    second = run(apply_placement(migs, first), "1", slot=slot)
    assert amounts(second) == {"MIG-1": "1"}
    assert run(apply_placement(apply_placement(migs, first), second), "1", slot=slot).reason == "insufficient"
    for amount in ("2", "1.1", "0.3"):
        assert run(migs, amount, slot=slot).reason == "invalid-request"


def test_slots_without_capacity_are_refused() -> None:
    assert run(devices("1"), "1", slot="cpu").reason == "invalid-request"


# --- other policies ------------------------------------------------------------------------------


def test_policies_choose_different_devices_for_a_fraction() -> None:
    devs = devices("1", "1", "1", allocated=["0.5", "0", "0.2"])
    assert amounts(run(devs, "0.3", Policy.EVENLY)) == {"a0": "0.3"}  # best fit
    assert amounts(run(devs, "0.3", Policy.SIMPLE)) == {"a0": "0.3"}  # first eligible
    assert amounts(run(devs, "0.3", Policy.COMPACT_FIRST)) == {"a0": "0.3"}  # most used
    assert amounts(run(devs, "0.3", Policy.LOW_LOAD_FIRST)) == {"a1": "0.3"}  # least used
    assert amounts(run(devs, "0.6", Policy.COMPACT_FIRST)) == {"a2": "0.6"}  # a0 cannot hold it


def test_equal_parts_on_the_fewest_devices() -> None:
    devs = devices("1", "1", "1")
    assert amounts(run(devs, "1.5", Policy.SIMPLE, quantum="0.1")) == {"a0": "0.8", "a1": "0.7"}
    result = run(devs, "1.55", Policy.LOW_LOAD_FIRST, quantum="0.1")
    assert result.total == D("1.5") and "rounds 1.55 down to 1.5" in result.note
    assert run(devices("1", "1", allocated=["0.8", "0"]), "1.1", Policy.SIMPLE).reason == "fragmented"
    assert run(devs, "3.5", Policy.SIMPLE).reason == "insufficient"


def test_link_score_is_go_gpuallocators() -> None:
    assert link_score("PIX") == 50
    assert link_score("sys", nvlinks=2) == 210
    assert link_score(None, nvlinks=12) == 1200


def test_besteffort_takes_the_best_linked_pair_of_the_best_partition() -> None:
    links = {frozenset(p): s for p, s in [(("a0", "a1"), 200), (("a2", "a3"), 200)]}
    links |= {frozenset(p): 10 for p in [("a0", "a2"), ("a0", "a3"), ("a1", "a2"), ("a1", "a3")]}
    devs = devices("1", "1", "1", "1")
    assert amounts(run(devs, "2", Policy.BESTEFFORT, slot="cuda.device", links=links)) == {"a0": "1", "a1": "1"}
    # a0 taken: simple would pair a1 with a2; best effort keeps the NVLink pair a2-a3 together.
    taken = devices("1", "1", "1", "1", allocated=["1", "0", "0", "0"])
    assert amounts(run(taken, "2", Policy.SIMPLE, slot="cuda.device")) == {"a1": "1", "a2": "1"}
    assert amounts(run(taken, "2", Policy.BESTEFFORT, slot="cuda.device", links=links)) == {"a2": "1", "a3": "1"}
    # fractional requests use the same choice
    assert sorted(amounts(run(taken, "1.2", Policy.BESTEFFORT, links=links))) == ["a2", "a3"]


def test_besteffort_without_links_falls_back_to_simple() -> None:
    result = run(devices("1", "1", "1"), "2", Policy.BESTEFFORT, slot="cuda.device")
    assert amounts(result) == {"a0": "1", "a1": "1"} and "fell back to simple" in result.note


def test_besteffort_on_many_devices_scores_single_sets() -> None:
    devs = devices(*["1"] * 12)
    links = {frozenset(("a10", "a11")): 400}
    result = run(devs, "2", Policy.BESTEFFORT, slot="cuda.device", links=links)
    assert amounts(result) == {"a10": "1", "a11": "1"} and "best single set" in result.note


def test_request_parse() -> None:
    assert Request.parse(" cuda.shares = 1.5 ") == Request(SHARES, D("1.5"))
    assert str(Request.parse("cuda.device=2")) == "cuda.device=2"
    for bad in (
        "cuda.shares",
        "=1",
        "cuda.shares=x",
        "cuda.shares=0",
        "cuda.shares=-1",
        "cuda.shares=NaN",
        "cuda.shares=inf",
    ):
        with pytest.raises(ValueError):
            Request.parse(bad)


# --- properties ----------------------------------------------------------------------------------

POLICIES = list(Policy)


@st.composite
def node_and_request(draw, quantum=None):
    count = draw(st.integers(min_value=1, max_value=6))
    capacity = draw(st.sampled_from([D(1), D("13.5"), D("0.5")]))
    allocated = [min(D(draw(st.integers(0, int(capacity * 100)))) / 100, capacity) for _ in range(count)]
    nodes = draw(st.lists(st.sampled_from([None, 0, 1]), min_size=count, max_size=count))
    devs = [DeviceFree(f"gpu{i}", capacity, a, n) for i, (a, n) in enumerate(zip(allocated, nodes, strict=True))]
    q = quantum or draw(st.sampled_from([D("0.01"), D("0.1"), D("0.25")]))
    amount = D(draw(st.integers(1, int(capacity * 100 * count)))) / 100
    return devs, q, amount


def _check_placement(devs, result, amount, quantum):
    by_id = {d.device_id: d for d in devs}
    for device_id, value in result.amounts.items():
        assert value > 0
        assert value <= by_id[device_id].free
        assert value % quantum == 0
    assert result.total <= amount


@settings(max_examples=300, deadline=None)
@given(node_and_request(), st.sampled_from(POLICIES))
def test_placements_never_exceed_free_or_request(node, policy) -> None:
    devs, quantum, amount = node
    before = list(devs)
    result = place(devs, Request(SHARES, amount), policy, quantum=quantum)
    assert devs == before  # nothing mutated
    if isinstance(result, Placement):
        _check_placement(devs, result, amount, quantum)
        if policy not in (Policy.EVENLY, Policy.EVENLY_NOFRAG):
            assert result.total == round_down(amount, quantum)


@settings(max_examples=300, deadline=None)
@given(node_and_request(quantum=D("0.01")))
def test_evenly_gives_exactly_the_request_with_the_default_quantum(node) -> None:
    devs, quantum, amount = node
    result = place(devs, Request(SHARES, amount), Policy.EVENLY, quantum=quantum)
    if isinstance(result, Placement):
        assert result.total == amount
    else:
        assert result.reason == "insufficient"
