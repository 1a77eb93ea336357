"""Request shapes: parsing, remaining totals, per-node verdicts and the manager's ranking model."""

from __future__ import annotations

from decimal import Decimal

import pytest

from exporter.analysis.node import NodeState
from exporter.analysis.placement import DeviceFree, NoFragRule
from exporter.analysis.shapes import (
    DEFAULT_SHAPES,
    MANAGER_PRIORITY,
    Shape,
    hami_node_scores,
    hami_rank,
    rank_agents,
    remaining_totals,
    shape_figures,
)
from exporter.config import ConfigError, fleet_shapes

D = Decimal
SHARES = "cuda.shares"


def node(*rows: tuple[str, str, int | None], quantum: str = "0.01", stale: dict | None = None) -> NodeState:
    """Devices given as (capacity, allocated, NUMA node)."""
    devices = tuple(DeviceFree(f"GPU-{i}", D(c), D(a), n) for i, (c, a, n) in enumerate(rows))
    return NodeState({SHARES: devices}, quantum=D(quantum), rule=NoFragRule.NUMA_CANDIDATES, stale=stale or {})


def verdicts(state: NodeState, *texts: str, exclude_stale: bool = True) -> dict[tuple[str, str], str | None]:
    figures = shape_figures(state, [Shape.parse(t) for t in texts], exclude_stale)
    return {(v.shape, v.fragmentation): ("placed" if v.placeable else v.reason) for v in figures.verdicts}


def test_default_shapes_are_the_documented_ones() -> None:
    assert [s.name for s in DEFAULT_SHAPES] == ["fgpu-0.5", "fgpu-1", "fgpu-2", "fgpu-4", "fgpu-8"]
    one = DEFAULT_SHAPES[1]
    assert one.accelerator == (SHARES, D(1))
    assert one.request == {SHARES: D(1), "cpu": D(4), "mem": D(16 * 2**30)}
    assert fleet_shapes([]) == DEFAULT_SHAPES


def test_the_accelerator_slot_comes_first_and_mem_takes_binary_sizes() -> None:
    shape = Shape.parse("big = cpu:8, mem:1.5g, cuda.device:2")
    assert shape.slots == (("cuda.device", D(2)), ("cpu", D(8)), ("mem", D(3 * 2**29)))
    assert str(shape) == "big=cuda.device:2,cpu:8,mem:1610612736"


@pytest.mark.parametrize(("text", "why"), [
    ("fgpu-1", "expected NAME=SLOT:AMOUNT"),
    ("a b=cuda.shares:1", "NAME must be"),
    ("x=cpu:4,mem:1g", "exactly one accelerator slot"),
    ("x=cuda.shares:1,cuda.device:1", "exactly one accelerator slot"),
    ("x=cuda.shares:0", "must be positive"),
    ("x=cuda.shares:-1", "negative"),
    ("x=cuda.shares:1,cpu", "expected SLOT:AMOUNT"),
    ("x=cuda.shares:1,cpu:1,cpu:2", "given twice"),
    ("x=cuda.shares:1,mem:lots", "mem:"),
])
def test_bad_shapes_are_one_line_errors_naming_the_flag(text: str, why: str) -> None:
    with pytest.raises(ConfigError) as err:
        fleet_shapes([text])
    message = str(err.value)
    assert message.startswith("--fleet.shape ") and why in message and "\n" not in message


def test_a_repeated_shape_name_is_refused() -> None:
    with pytest.raises(ConfigError, match="shape a is given twice"):
        fleet_shapes(["a=cuda.shares:1", "a=cuda.shares:2"])


def test_remaining_is_the_registered_total_minus_what_is_occupied() -> None:
    state = node(("13.5", "4", 0), ("13.5", "13.5", 0), ("10", "11", 1))  # the last one overcommitted
    assert remaining_totals(state) == {SHARES: D("8.5")}
    # Memory nobody can get is taken off a row's capacity but still registered by the agent.
    blocked = NodeState(state.slots, blocked={("GPU-0", SHARES): D("1.5")})
    assert remaining_totals(blocked) == {SHARES: D(10)}


def test_totals_that_fit_and_pieces_that_do_not() -> None:
    # 3 free on each of four devices: 12 in total, no device with 4 free.
    state = node(("13.5", "10.5", 0), ("13.5", "10.5", 0), ("13.5", "10.5", 0), ("13.5", "10.5", 0))
    got = verdicts(state, "s2=cuda.shares:2", "s4=cuda.shares:4", "s13=cuda.shares:13")
    assert got == {
        ("s2", "allowed"): "placed", ("s2", "disallowed"): "placed",
        # Fragmentation allowed: 4 is spread over two devices; disallowed, 4 <= 13.5 must fit one device.
        ("s4", "allowed"): "placed", ("s4", "disallowed"): "fragmented",
        ("s13", "allowed"): "capacity", ("s13", "disallowed"): "capacity",
    }


def test_numa_is_the_reason_when_the_chain_sets_a_smaller_guard_capacity() -> None:
    # NUMA node 1 holds less (14 against 21), so the chain starts there and its 10-share device
    # sets C = 10: 11 must split evenly (5.5 + 5.5) and no two devices have 5.5 free. Judged by
    # the freest device first (C = 16), 11 would fit on GPU-0 alone.
    state = node(("16", "5", 0), ("16", "16", 0), ("10", "5", 1), ("10", "9", 1))
    got = verdicts(state, "s11=cuda.shares:11")
    assert got[("s11", "allowed")] == "placed"
    assert got[("s11", "disallowed")] == "numa"


def test_stale_allocations_are_the_reason_only_when_they_are_counted() -> None:
    stale = {("GPU-0", SHARES): D(8)}
    # Counted (--no-headroom.exclude-stale): GPU-0 holds 8 of a stale kernel; without it 4 fits there.
    counted = node(("13.5", "10", 0), ("13.5", "12", 0), stale=stale)
    assert verdicts(counted, "s4=cuda.shares:4", exclude_stale=False)[("s4", "disallowed")] == "stale_allocation"
    assert verdicts(counted, "s4=cuda.shares:4", exclude_stale=True)[("s4", "disallowed")] == "fragmented"


def test_a_missing_mig_profile_and_a_missing_slot() -> None:
    state = node(("13.5", "0", 0))
    got = verdicts(state, "mig=cuda.device:1g.10gb-mig:1", "whole=cuda.device:1")
    assert got[("mig", "allowed")] == "mig_profile_missing"
    assert got[("whole", "disallowed")] == "capacity"


def test_the_ranking_follows_the_priority_list_exactly() -> None:
    remaining = {
        "a": {SHARES: D(8), "cpu": D(10), "mem": D(100)},
        "b": {SHARES: D(2), "cpu": D(60), "mem": D(100)},
        "c": {SHARES: D(1), "cpu": D(60), "mem": D(100)},  # does not cover 2 shares
    }
    want = {SHARES: D(2), "cpu": D(4), "mem": D(16)}
    # The default priority names "cuda", which no cuda.* slot is: CPU ranks first.
    assert rank_agents(remaining, want, "concentrated", MANAGER_PRIORITY) == ("a",)
    assert rank_agents(remaining, want, "dispersed", MANAGER_PRIORITY) == ("b",)
    # The accelerator slot named first: GPU shares rank first.
    assert rank_agents(remaining, want, "concentrated", (SHARES, "cpu", "mem")) == ("b",)
    assert rank_agents(remaining, want, "legacy", (SHARES, "cpu", "mem")) == ("a",)
    # Ties are all returned (the manager takes the first in its own agent order).
    tied = {"x": {SHARES: D(4)}, "y": {SHARES: D(4)}}
    assert rank_agents(tied, {SHARES: D(1)}, "dispersed") == ("x", "y")
    assert rank_agents(tied, {SHARES: D(5)}, "dispersed") == ()
    with pytest.raises(ValueError, match="roundrobin"):
        rank_agents(tied, {SHARES: D(1)}, "roundrobin")


# -- HAMi's node score and policies -------------------------------------------------------------------


def test_hami_node_score_is_ten_times_core_and_memory_ratio_over_registered_capacity() -> None:
    # 1 + 3 of 8 shares occupied: 10 × (0.5 + 0.5). Blocked shares count in the registered total,
    # as the agent registers the device whole.
    state = node(("4", "1", 0), ("4", "3", 0))
    assert hami_node_scores(state) == {SHARES: D(10)}
    blocked = NodeState({SHARES: (DeviceFree("GPU-0", D(3), D(1)), DeviceFree("GPU-1", D(4), D(3)))},
                        blocked={("GPU-0", SHARES): D(1)})
    assert hami_node_scores(blocked) == {SHARES: D(10)}
    assert hami_node_scores(NodeState({SHARES: (DeviceFree("GPU-0", D(0), D(0)),)})) == {}
    figures = shape_figures(state, [Shape.parse("one=cuda.shares:1")])
    assert figures.hami_scores == {SHARES: D(10)}


def test_each_shape_gets_hamis_device_picks() -> None:
    state = node(("4", "1", 0), ("4", "3", 0), ("4", "0", 1))
    figures = shape_figures(state, [Shape.parse("one=cuda.shares:1"), Shape.parse("nine=cuda.shares:9"),
                                    Shape.parse("mig=cuda.device:1g.10gb-mig:1")])
    picks = {(p.shape, p.policy): (p.placement, p.reason) for p in figures.hami_picks}
    assert picks[("one", "binpack")] == ({"GPU-1": D(1)}, None)
    assert picks[("one", "spread")] == ({"GPU-2": D(1)}, None)
    assert picks[("nine", "binpack")] == (None, "insufficient")
    assert picks[("mig", "spread")] == (None, "no-devices")


def test_binpack_sends_a_request_to_the_fullest_node_that_places_it_spread_to_the_emptiest() -> None:
    scores = {"a": D(5), "b": D(15), "c": D(15), "d": D(2)}
    assert hami_rank(scores, "binpack") == ("b", "c", "a", "d")
    assert hami_rank(scores, "spread") == ("d", "a", "b", "c")
    assert hami_rank({}, "spread") == ()
    with pytest.raises(ValueError, match="policy must be one of binpack, spread"):
        hami_rank(scores, "hami-binpack")
