"""The simulate entry points: figures, rendering, state files, errors."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import pytest

from exporter.analysis.capacity import GpuInventory
from exporter.analysis.node import HeadroomParams, Inventory, NodeState, node_state
from exporter.analysis.pipeline import analyse
from exporter.analysis.simulate import (
    POLICIES,
    HamiPolicy,
    format_table,
    hami_device_order,
    hami_score,
    load_state,
    parse_policy,
    parse_state,
    result_document,
    simulate,
)
from exporter.scratch.allocation import AllocationBook
from exporter.scratch.resources import parse_resource
from exporter.telemetry.model import DeviceReading, TelemetrySnapshot


def state_doc(*free: str, capacity: str = "1", quantum: str = "0.01", rule: str = "26.4") -> dict:
    devices = [
        {"device_id": f"gpu{i}", "capacity": capacity, "allocated": str(Decimal(capacity) - Decimal(f))}
        for i, f in enumerate(free)
    ]
    return {"quantum": quantum, "nofrag_rule": rule, "slots": {"cuda.shares": devices}}


def test_1_2_lands_as_0_60_twice() -> None:
    result = simulate(state_doc("1", "1"), "cuda.shares=1.2", "evenly")
    doc = result_document(result)
    assert doc["placed"] and doc["placement"] == {"gpu0": "0.60", "gpu1": "0.60"} and doc["total"] == "1.20"
    assert doc["headroom"]["before"]["headroom"] == "2.00" and doc["headroom"]["after"]["headroom"] == "0.80"
    table = format_table(result)
    assert "placed 1.20 on 2 device(s): gpu0 0.60, gpu1 0.60" in table
    assert "gpu0    -     1         0          1     0.60    0.40" in table
    assert "agent    rule 26.4, affinity-policy INTERLEAVED" in table
    assert (doc["nofrag_rule"], doc["affinity_policy"]) == ("26.4", "INTERLEAVED")


def numa_doc(*devices: tuple[str, str, int | None], rule: str | None = None, affinity: str | None = None) -> dict:
    """A state of 13.5/10-share devices given as (capacity, free, NUMA node)."""
    rows = [{"device_id": f"gpu{i}", "capacity": c, "allocated": str(Decimal(c) - Decimal(f)), "numa_node": n}
            for i, (c, f, n) in enumerate(devices)]
    doc = {"quantum": "0.1", "slots": {"cuda.shares": rows}}
    doc |= {"nofrag_rule": rule} if rule else {}
    doc |= {"affinity_policy": affinity} if affinity else {}
    return doc


def test_on_two_numa_nodes_12_8_shares_split_in_three_as_the_26_9_agent_does() -> None:
    # 7.5/13.5 and 4.2/10 free on NUMA node 0, 4.9/10 on node 1, fragmentation disallowed: the
    # guard's capacity is node 1's first device (10), so 12.8 may be split; the default rule is 26.9.
    doc = numa_doc(("13.5", "7.5", 0), ("10", "4.2", 0), ("10", "4.9", 1))
    result = result_document(simulate(doc, "cuda.shares=12.8", "evenly-nofrag"))
    assert result["placement"] == {"gpu0": "4.30", "gpu1": "4.20", "gpu2": "4.30"}
    assert (result["nofrag_rule"], result["affinity_policy"]) == ("26.9", "INTERLEAVED")
    assert [d["numa_node"] for d in result["devices"]] == [0, 0, 1]
    assert "gpu2    1     10" in format_table(simulate(doc, "cuda.shares=12.8", "evenly-nofrag"))
    # Without NUMA nodes the freest device's 13.5 is the guard's capacity: 12.8 must fit on one device.
    flat = numa_doc(("13.5", "7.5", None), ("10", "4.2", None), ("10", "4.9", None))
    assert result_document(simulate(flat, "cuda.shares=12.8", "evenly-nofrag"))["rejection"]["reason"] == "fragmented"


def test_the_rule_and_affinity_policy_come_from_the_state() -> None:
    # Free 3/10 on node 0, 10/10 and 2.5/10 on node 1: node 0 holds less, so its device comes first.
    doc = numa_doc(("10", "3", 0), ("10", "10", 1), ("10", "2.5", 1))
    # 26.9 keeps a request that fits on one device there (the tightest fit); before 26.9 only
    # when the chain's first device holds it, so 4 goes over the chain's windows instead.
    assert result_document(simulate(doc, "cuda.shares=2"))["placement"] == {"gpu2": "2.00"}
    assert result_document(simulate(doc, "cuda.shares=4"))["placement"] == {"gpu1": "4.00"}
    split = {"gpu1": "2.00", "gpu2": "2.00"}
    assert result_document(simulate(doc | {"nofrag_rule": "26.4"}, "cuda.shares=4"))["placement"] == split
    # Before 26.4 the guard wants the request on the chain's first device (gpu0 here, 3 free).
    assert simulate(doc | {"nofrag_rule": "before-26.4"}, "cuda.shares=4", "evenly-nofrag").outcome.reason == "fragmented"
    assert simulate(doc | {"nofrag_rule": "before-26.4"}, "cuda.shares=3", "evenly-nofrag").placed
    # Whole devices: one from each node in turn (INTERLEAVED), or one node first.
    whole = {"slots": {"cuda.device": [{"device_id": f"d{i}", "capacity": "1", "allocated": "0", "numa_node": n}
                                       for i, n in enumerate([0, 0, 1, 1])]}}
    assert list(result_document(simulate(whole, "cuda.device=2"))["placement"]) == ["d0", "d2"]
    single = whole | {"affinity_policy": "PREFER_SINGLE_NODE"}
    assert list(result_document(simulate(single, "cuda.device=2"))["placement"]) == ["d0", "d1"]


def test_1_4_is_accepted_as_two_times_0_7_without_fragmentation() -> None:
    result = simulate(state_doc("0.5", "1", "1", "1", quantum="0.1"), "cuda.shares=1.4", "evenly-nofrag")
    assert sorted(result_document(result)["placement"].values()) == ["0.70", "0.70"]


def test_1_6_is_rejected_without_fragmentation() -> None:
    result = simulate(state_doc("0.2", "1", quantum="0.1"), "cuda.shares=1.6", "evenly-nofrag")
    doc = result_document(result)
    assert not doc["placed"] and doc["rejection"]["reason"] == "fragmented"
    assert doc["headroom"]["after"] is None
    assert "rejected (fragmented)" in format_table(result)


def test_before_26_4_rule_comes_from_the_state() -> None:
    result = simulate(
        state_doc("0.5", "1", "1", "1", quantum="0.1", rule="before-26.4"), "cuda.shares=1.4", "evenly-nofrag"
    )
    assert result_document(result)["rejection"]["reason"] == "fragmented"


def test_quantum_note_is_reported() -> None:
    result = simulate(state_doc("1", "1", quantum="0.25"), "cuda.shares=1.75")
    assert result.outcome.total == Decimal("1.50")
    assert "note     quantum 0.25 rounds 1.75 down to 1.50" in format_table(result)


def test_every_policy_answers() -> None:
    assert POLICIES == ("evenly", "evenly-nofrag", "simple", "besteffort", "compact-first", "low-load-first",
                        "hami-binpack", "hami-spread")
    for policy in POLICIES:
        assert simulate(state_doc("1", "0.5"), "cuda.shares=0.5", policy).placed


def test_slot_without_devices() -> None:
    result = simulate(state_doc("1"), "cuda.device=1")
    doc = result_document(result)
    assert doc["rejection"] == {"reason": "no-devices", "detail": "no device of slot cuda.device on this node (its slots: cuda.shares)"}
    assert doc["devices"] == [] and doc["headroom"] == {"before": None, "after": None}
    assert "rejected (no-devices)" in format_table(result)


@pytest.mark.parametrize(
    ("state", "request_", "policy"),
    [
        (state_doc("1"), "cuda.shares", "evenly"),
        (state_doc("1"), "cuda.shares=1", "fastest"),
        ({"slots": 3}, "cuda.shares=1", "evenly"),
    ],
)
def test_bad_input_raises_value_error(state, request_, policy) -> None:
    with pytest.raises(ValueError):
        simulate(state, request_, policy)


def test_state_file_from_a_live_view(tmp_path: Path) -> None:
    book = AllocationBook(clock=lambda: 0.0)
    text = 'SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={"cuda.shares":"1.2"}\nCUDA.SHARES_SHARES=GPU-a:0.60,GPU-b:0.60\n'
    book.apply("k1", "/scratch", parse_resource(text))
    inventory = Inventory(gpus=(GpuInventory("GPU-a", 40 * 1024**3, 108), GpuInventory("GPU-b", 40 * 1024**3, 108)))
    state = node_state(book.view(), inventory, HeadroomParams())
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state.to_json()))
    loaded = load_state(path)
    assert loaded == state
    result = simulate(loaded, "cuda.shares=20")
    assert result_document(result)["placement"] == {"GPU-a": "10.00", "GPU-b": "10.00"}
    assert simulate(state, "cuda.shares=25.8").outcome.total == Decimal("25.8")
    assert simulate(state, "cuda.shares=25.81").outcome.reason == "insufficient"


def test_documents_are_json_serialisable() -> None:
    doc = result_document(simulate(state_doc("1", "0.3", "0.25"), "cuda.shares=0.9"))
    assert json.loads(json.dumps(doc)) == doc
    assert doc["headroom"]["after"]["fragmentation_ratio"] == "1"
    assert NodeState.from_json(
        json.loads(json.dumps(NodeState.from_json(state_doc("1")).to_json()))
    ) == NodeState.from_json(state_doc("1"))


def test_live_state_from_a_snapshot() -> None:
    book = AllocationBook(clock=lambda: 0.0)
    text = 'SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={"cuda.device":"1"}\nCUDA.DEVICE_SHARES=0:1\n'
    book.apply("k1", "/scratch", parse_resource(text))
    view = book.view()
    readings = tuple(DeviceReading(uuid=f"GPU-{i}", index=i) for i in range(4))
    snapshot = TelemetrySnapshot(source="nvml", devices=readings, success=True)
    state = analyse(view, snapshot, HeadroomParams()).state
    assert [d.device_id for d in state.slots["cuda.device"]] == ["0", "1", "2", "3"]
    doc = result_document(simulate(state, "cuda.device=2", "evenly"))
    assert doc["placement"] == {"1": "1", "2": "1"}


def test_mig_request_takes_one_free_instance() -> None:
    slot = "cuda.device:1g.10gb-mig"
    doc = {"slots": {slot: [{"device_id": f"MIG-{i}", "capacity": "1", "allocated": a} for i, a in enumerate("100")]}}
    result = result_document(simulate(doc, f"{slot}=1"))
    assert result["placement"] == {"MIG-1": "1"}
    assert result["headroom"]["before"]["headroom"] == "1" and result["headroom"]["before"]["whole_free_devices"] == "2"
    assert result["headroom"]["after"]["whole_free_devices"] == "1"
    assert result_document(simulate(doc, f"{slot}=2"))["rejection"]["reason"] == "invalid-request"


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("{", "not JSON (Expecting property name enclosed in double quotes at line 1, column 2)"),
        ("[]", "no slots"),
        ('{"node_state": {"slots": []}}', "node_state.slots is not an object"),
        ('{"slots": {"cuda.shares": {}}}', "slots['cuda.shares'] is not a list of devices"),
        ('{"slots": {"cuda.shares": [{"device_id": "a", "capacity": "1", "allocated": "-1"}]}}', "slots['cuda.shares'][0].allocated is not"),
        ('{"slots": {"cuda.shares": [{"device_id": "a", "capacity": true, "allocated": "0"}]}}', "slots['cuda.shares'][0].capacity is not"),
        ('{"slots": {}, "quantum": "0"}', "quantum must be positive"),
        ('{"slots": {}, "nofrag_rule": "27"}', "nofrag_rule must be one of before-26.4, 26.4, 26.9"),
        ('{"slots": {}, "affinity_policy": "nearest"}', "affinity_policy must be one of INTERLEAVED, PREFER_SINGLE_NODE"),
        ('{"slots": {"cuda.shares": [{"device_id": "a", "capacity": "1", "allocated": "0", "numa_node": -1}]}}',
         "slots['cuda.shares'][0].numa_node is not a non-negative integer or null"),
        ('{"slots": {"cuda.shares": [{"device_id": "a", "capacity": "1", "allocated": "0", "numa_node": "0"}]}}',
         "slots['cuda.shares'][0].numa_node is not"),
        ('{"slots": {}, "links": [{"devices": ["a"], "score": 1}]}', "links[0].devices is not a pair"),
        ('{"slots": {}, "stale": [{"device_id": "a", "slot": "cuda.shares"}]}', "stale[0] has no 'allocated'"),
    ],
)
def test_a_malformed_state_says_where_and_why(text: str, reason: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_state(text)
    assert reason in str(exc.value) and "Error" not in str(exc.value)


def test_a_saved_state_round_trips(tmp_path) -> None:
    state = parse_state(json.dumps({"node_state": state_doc("0.5", "1")}))
    assert simulate(state, "cuda.shares=1").placed
    numa = parse_state(json.dumps(numa_doc(("10", "3", 0), ("10", "10", None), affinity="PREFER_SINGLE_NODE")))
    assert [d.numa_node for d in numa.slots["cuda.shares"]] == [0, None]
    assert parse_state(json.dumps(numa.to_json())) == numa
    # A document from before NUMA nodes and the 26.9 rule: nodes unknown, the defaults apply.
    old = parse_state(json.dumps({"quantum": "0.01", "slots": state_doc("0.5")["slots"]}))
    assert (old.slots["cuda.shares"][0].numa_node, old.rule.value, old.affinity.value) == (None, "26.9", "INTERLEAVED")
    with pytest.raises(ValueError, match=r"--state .*missing.json: cannot read the file \(No such file or directory\)"):
        load_state(tmp_path / "missing.json")


def test_quotients_are_written_without_their_trailing_zeros() -> None:
    from exporter.analysis.simulate import _amount_text as _amount

    assert _amount(Decimal("11.96000000000000000000000000")) == "11.96"
    assert _amount(Decimal("40.00000000000000000000000000")) == "40"
    assert _amount(Decimal("12.00")) == "12.00" and _amount(Decimal("13.5")) == "13.5"  # as written


# -- HAMi's device policies -------------------------------------------------------------------------


def hami_doc(*devices: tuple[str, str, int | None]) -> dict:
    """Devices given as (capacity, allocated, NUMA node)."""
    rows = [{"device_id": f"gpu{i}", "capacity": c, "allocated": a, "numa_node": n} for i, (c, a, n) in enumerate(devices)]
    return {"quantum": "0.01", "slots": {"cuda.shares": rows}}


def test_hami_score_is_ten_times_the_core_and_memory_ratios() -> None:
    assert hami_score(Decimal(1), Decimal(4)) == Decimal(5)  # 10 × (0.25 + 0.25)
    assert hami_score(Decimal(4), Decimal(4)) == Decimal(20)
    assert hami_score(Decimal(1), Decimal(0)) == 0  # no capacity: HAMi scores 0


def test_binpack_counts_the_request_in_each_devices_score() -> None:
    # gpu0 is 40 % used, gpu1 (1.5 shares) empty. The used ratio alone (compact-first) packs onto
    # gpu0; with the request's 1 share counted, gpu1 would be 67 % used and gpu0 50 %: HAMi's
    # binpack takes gpu1, spread gpu0.
    doc = hami_doc(("10", "4", 0), ("1.5", "0", 0))
    assert simulate(doc, "cuda.shares=1", "compact-first").outcome.amounts == {"gpu0": Decimal("1.00")}
    binpack = result_document(simulate(doc, "cuda.shares=1", "hami-binpack"))
    assert binpack["placement"] == {"gpu1": "1.00"} and binpack["policy"] == "hami-binpack"
    assert binpack["hami_scores"] == {"gpu0": "10.00", "gpu1": "13.3333"}
    assert result_document(simulate(doc, "cuda.shares=1", "hami-spread"))["placement"] == {"gpu0": "1.00"}
    assert "hami     device scores, the request's part counted: gpu0 10.00, gpu1 13.3333" in format_table(
        simulate(doc, "cuda.shares=1", HamiPolicy.BINPACK))
    assert "hami_scores" not in result_document(simulate(doc, "cuda.shares=1", "evenly"))


def test_equal_scores_go_to_the_higher_numa_node_first_then_inventory_order() -> None:
    doc = hami_doc(("4", "1", 0), ("4", "1", 1), ("4", "1", None), ("4", "1", 1))
    for policy in ("hami-binpack", "hami-spread"):
        assert result_document(simulate(doc, "cuda.shares=1", policy))["placement"] == {"gpu1": "1.00"}
    devices = parse_state(json.dumps(doc)).slots["cuda.shares"]
    order = [d.device_id for d in hami_device_order(devices, Decimal(1), HamiPolicy.SPREAD)]
    assert order == ["gpu1", "gpu3", "gpu0", "gpu2"]  # unknown NUMA counts as node 0


def test_hami_cuts_a_large_request_into_equal_parts_and_skips_devices_too_full() -> None:
    # 3 shares: no device has 3 free, so two parts of 1.5; gpu2 (1 free) would score highest but
    # cannot hold one. Scores with 1.5 counted: gpu1 100 % > gpu0 87.5 % > gpu3 75 %.
    doc = hami_doc(("4", "2", 0), ("4", "2.5", 0), ("4", "3", 0), ("4", "1.5", 0))
    binpack = simulate(doc, "cuda.shares=3", "hami-binpack")
    assert binpack.outcome.amounts == {"gpu1": Decimal("1.50"), "gpu0": Decimal("1.50")}
    spread = simulate(doc, "cuda.shares=3", "hami-spread")
    assert spread.outcome.amounts == {"gpu3": Decimal("1.50"), "gpu0": Decimal("1.50")}
    rejected = result_document(simulate(doc, "cuda.shares=7.5", "hami-binpack"))
    assert rejected["rejection"]["reason"] == "insufficient" and rejected["hami_scores"]["gpu2"] == "15"


def test_hami_takes_whole_free_devices_for_cuda_device() -> None:
    rows = [{"device_id": str(i), "capacity": "1", "allocated": a, "numa_node": n} for i, (a, n) in enumerate([("1", 1), ("0", 0), ("0", 1)])]
    doc = {"slots": {"cuda.device": rows}}
    assert result_document(simulate(doc, "cuda.device=1", "hami-binpack"))["placement"] == {"2": "1"}


def test_a_policy_name_outside_the_list_names_the_choices() -> None:
    assert parse_policy("hami-spread") is HamiPolicy.SPREAD and parse_policy("evenly").value == "evenly"
    with pytest.raises(ValueError, match="expected one of evenly, .*, hami-binpack, hami-spread$"):
        parse_policy("binpack")
