"""MIG geometry: creatable instances from real placements, NVML overrides, HAMi geometries."""

from __future__ import annotations

import itertools

import pytest
from helpers import FIXTURES
from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.telemetry.mig import (
    BUILTIN_TABLES,
    GpuInstance,
    HamiGeometry,
    MigLayoutError,
    creatable_instances,
    hami_geometries_for,
    parse_hami_geometries,
    reachable_geometries,
    table_for_product,
)

A100 = BUILTIN_TABLES["A100-40GB"]
HAMI_FILE = FIXTURES / "mig" / "hami-device-config.yaml"


def gi(profile: str | int, start: int) -> GpuInstance:
    return GpuInstance(profile, start)


# Expected counts on an A100-40GB: a greedy pass over each profile's legal starts, capped by its
# instance limit (docs/headroom.md, *MIG*).
@pytest.mark.parametrize(
    ("instances", "expected"),
    [
        ([], {"1g.5gb": 7, "1g.5gb+me": 1, "1g.10gb": 4, "2g.10gb": 3, "3g.20gb": 2, "4g.20gb": 1, "7g.40gb": 1}),
        ([gi("3g.20gb", 0)], {"1g.5gb": 3, "2g.10gb": 1, "3g.20gb": 1, "4g.20gb": 0, "7g.40gb": 0}),
        ([gi("3g.20gb", 4)], {"1g.5gb": 4, "2g.10gb": 2, "3g.20gb": 1, "4g.20gb": 1, "7g.40gb": 0}),
    ],
)
def test_creatable_instances_on_an_a100(instances, expected) -> None:
    counts = creatable_instances(A100, instances)
    assert {k: counts[k] for k in expected} == expected


def test_mig_user_guide_fragmentation_example() -> None:
    # 1g, 1g, 2g created without placements land at 5, 6 and 2: four slices (0, 1, 4, 7) stay
    # free, yet no 3g (4 slices at 0 or 4) fits any more.
    instances = [gi("1g.5gb", 5), gi("1g.5gb", 6), gi(14, 2)]
    counts = creatable_instances(A100, instances)
    assert counts["3g.20gb"] == 0
    assert counts["1g.5gb"] == 3
    assert counts["4g.20gb"] == counts["7g.40gb"] == 0


def test_instance_limits_cap_the_count() -> None:
    assert creatable_instances(A100, [gi("1g.5gb+me", 0)])["1g.5gb+me"] == 0
    seven = [gi("1g.5gb", s) for s in range(7)]
    assert creatable_instances(A100, seven) == dict.fromkeys(creatable_instances(A100, seven), 0)


def test_a30_has_four_slices() -> None:
    a30 = BUILTIN_TABLES["A30-24GB"]
    assert creatable_instances(a30, []) == {"1g.6gb": 4, "1g.6gb+me": 1, "2g.12gb": 2, "2g.12gb+me": 1, "4g.24gb": 1}
    assert creatable_instances(a30, [gi("2g.12gb", 0)])["2g.12gb"] == 1
    assert creatable_instances(a30, [gi(5, 2)])["4g.24gb"] == 0


def test_nvml_answers_win() -> None:
    counts = creatable_instances(A100, [], remaining={"3g.20gb": 1})
    assert counts["3g.20gb"] == 1 and counts["1g.5gb"] == 7
    # a driver listing only the upper half for 2g
    assert creatable_instances(A100, [], placements={"2g.10gb": [(4, 2)]})["2g.10gb"] == 1


@pytest.mark.parametrize(
    ("instances", "message"),
    [
        ([gi("3g.20gb", 0), gi("1g.5gb", 2)], "overlaps"),
        ([gi("3g.20gb", 6)], "runs past"),
        ([gi("9g.90gb", 0)], "no MIG profile"),
        ([GpuInstance("2g.10gb", 0, size=1)], "reports size"),
    ],
)
def test_impossible_layouts_are_refused(instances, message) -> None:
    with pytest.raises(MigLayoutError, match=message):
        creatable_instances(A100, instances)


@pytest.mark.parametrize(
    ("product", "sku"),
    [
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB"),
        ("NVIDIA A30", "A30-24GB"),
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),
        ("NVIDIA H100 PCIe", "H100-80GB"),
        ("NVIDIA H100 NVL", "H100-94GB"),
        ("NVIDIA GH200 480GB", "H100-96GB"),
        ("NVIDIA H200", "H200-141GB"),
        ("NVIDIA H200 NVL", "H200-141GB"),
    ],
)
def test_table_for_product(product: str, sku: str) -> None:
    assert table_for_product(product).sku == sku


def test_unknown_product_has_no_table() -> None:
    assert table_for_product("NVIDIA GeForce RTX 4090") is None


def test_h100_and_h200_share_the_a100_geometry() -> None:
    for sku in ("H100-80GB", "H100-94GB", "H100-96GB", "H200-141GB"):
        table = BUILTIN_TABLES[sku]
        assert [(p.profile_id, p.memory_slices, p.max_instances, p.starts) for p in table.profiles] == [
            (p.profile_id, p.memory_slices, p.max_instances, p.starts) for p in A100.profiles
        ]
    assert BUILTIN_TABLES["H200-141GB"].profile(0).name == "7g.141gb"
    assert BUILTIN_TABLES["H100-80GB"].profile("1g.20gb").profile_id == 15


# --- HAMi knownMigGeometries ---------------------------------------------------------------------


def test_parse_hami_device_config() -> None:
    models = parse_hami_geometries(HAMI_FILE.read_text())
    assert [m.models[0] for m in models] == ["A30", "A100-SXM4-40GB", "A100-SXM4-80GB"]
    a100 = hami_geometries_for(models, "NVIDIA A100-SXM4-40GB")
    assert [g.label for g in a100] == ["1g.5gb:7", "2g.10gb:3,1g.5gb:1", "3g.20gb:2", "7g.40gb:1"]
    assert hami_geometries_for(models, "NVIDIA H100 80GB HBM3") == ()


def test_parse_volcano_group_format_and_bare_list() -> None:
    text = """
knownMigGeometries:
- models: ["A30"]
  allowedGeometries:
  - group: group1
    geometries:
    - {name: 1g.6gb, memory: 6144, count: 4}
"""
    (model,) = parse_hami_geometries(text)
    assert model.geometries == (HamiGeometry("group1", (("1g.6gb", 6144, 4),)),)
    bare = parse_hami_geometries("- models: [A30]\n  allowedGeometries: []\n")
    assert bare[0].geometries == ()


@pytest.mark.parametrize(
    "text", ["nvidia: {}", "- {allowedGeometries: []}", "- models: [A30]\n  allowedGeometries: [[{memory: 1}]]", "42"]
)
def test_parse_rejects_other_shapes(text: str) -> None:
    with pytest.raises(ValueError):
        parse_hami_geometries(text)


def test_reachable_geometries_on_an_a100() -> None:
    geometries = hami_geometries_for(parse_hami_geometries(HAMI_FILE.read_text()), "NVIDIA A100-SXM4-40GB")
    labels = ["1g.5gb:7", "2g.10gb:3,1g.5gb:1", "3g.20gb:2", "7g.40gb:1"]
    assert reachable_geometries(A100, [], geometries) == dict.fromkeys(labels, True)
    assert reachable_geometries(A100, [gi("3g.20gb", 4)], geometries) == dict(zip(labels, [False, False, True, False], strict=True))
    # 2g at 6 is illegal, so 2g at 4 + 1g at 6: the second 2g still fits at 0 or 2
    assert reachable_geometries(A100, [gi("2g.10gb", 4), gi("1g.5gb", 6)], geometries)["2g.10gb:3,1g.5gb:1"] is True
    # 1g at 1 blocks slots 0-1, so three 2g (at 0, 2, 4) can no longer all be placed
    assert reachable_geometries(A100, [gi("1g.5gb", 1)], geometries)["2g.10gb:3,1g.5gb:1"] is False
    assert reachable_geometries(A100, [gi("1g.5gb", 6)], geometries)["2g.10gb:3,1g.5gb:1"] is True


def test_hami_names_are_resolved_to_the_skus_profiles() -> None:
    a100_80 = BUILTIN_TABLES["A100-80GB"]
    geometries = hami_geometries_for(parse_hami_geometries(HAMI_FILE.read_text()), "NVIDIA A100-SXM4-80GB")
    # HAMi spells the full GPU 7g.79gb; NVIDIA's name is 7g.80gb
    assert reachable_geometries(a100_80, [], geometries)["7g.79gb:1"] is True
    assert reachable_geometries(a100_80, [gi("7g.80gb", 0)], geometries)["7g.79gb:1"] is True
    unknown = HamiGeometry("odd", (("5g.50gb", 0, 1),))
    assert reachable_geometries(a100_80, [], [unknown]) == {"odd": None}
    # two 1g on an 80GB card: 1g.10gb (1 slice) or 1g.20gb (2 slices), told apart by memory
    by_memory = HamiGeometry("m", (("1g.19gb", 20480, 4),))
    assert reachable_geometries(a100_80, [gi("1g.20gb", 0)], [by_memory]) == {"m": True}


# --- properties ----------------------------------------------------------------------------------


@st.composite
def layouts(draw):
    """A valid set of GPU instances on an A100, built by creating random profiles at random legal starts."""
    occupied, instances = 0, []
    for _ in range(draw(st.integers(0, 7))):
        profile = draw(st.sampled_from(A100.profiles))
        start = draw(st.sampled_from(profile.starts))
        mask = ((1 << profile.memory_slices) - 1) << start
        count = sum(1 for i in instances if i.profile == profile.name)
        if not occupied & mask and count < profile.max_instances:
            occupied |= mask
            instances.append(GpuInstance(profile.name, start))
    return instances


def _most_placeable(profile, occupied: int) -> int:
    """Brute force: the largest set of pairwise disjoint legal placements on the free slices."""
    masks = [((1 << profile.memory_slices) - 1) << s for s in profile.starts]
    masks = [m for m in masks if not occupied & m]
    for size in range(len(masks), 0, -1):
        for combo in itertools.combinations(masks, size):
            if sum(combo) == _or(combo):  # disjoint
                return size
    return 0


def _or(masks) -> int:
    out = 0
    for m in masks:
        out |= m
    return out


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_greedy_equals_brute_force(instances) -> None:
    occupied = _or(((1 << A100.profile(i.profile).memory_slices) - 1) << i.start for i in instances)
    counts = creatable_instances(A100, instances)
    for p in A100.profiles:
        existing = sum(1 for i in instances if i.profile == p.name)
        assert counts[p.name] == min(_most_placeable(p, occupied), p.max_instances - existing)
