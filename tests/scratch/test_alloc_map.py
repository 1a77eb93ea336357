"""Both forms of Backend.AI's gpu_alloc_map against the reference re-implementation of the agent:
absolute (before 26.4.8) and the 0-1 ratio of lablup/backend.ai#14327 (26.4.8+, 26.8.x)."""

from __future__ import annotations

from decimal import Decimal

import pytest
from backendai_reference import scan_gpu_alloc_map, scan_gpu_alloc_map_ratio
from helpers import FIXTURES
from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.scratch.allocation import AllocationBook, absolute_alloc_map, ratio_alloc_map
from exporter.scratch.resources import ResourceSpec, parse_resource

HEAD = 'SCRATCH_SIZE=0\nMOUNTS=\nSLOTS={"cpu":"1","mem":"1024"}\n'
A100 = Decimal("13.5")  # min(40 GiB / 2 GiB, 108 SMs / 8): what the fractional plugin registers
G0, G1 = "GPU-5d2c0000-0000-4000-8000-000000000000", "GPU-a81e0000-0000-4000-8000-000000000000"
MIG = "MIG-c59395cd-ac91-4cd3-a1b0-3d2568aa2d03/2/0"
CAPS = {
    ("cuda.shares", G0): A100,
    ("cuda.shares", G1): A100,
    ("cuda.device", G0): Decimal(1),
    ("cuda.device", G1): Decimal(1),
    ("cuda.device:3g.20gb-mig", MIG): Decimal(1),
}


def specs(texts: list[str]) -> list[ResourceSpec]:
    out = []
    for t in texts:
        s = parse_resource(t)
        assert isinstance(s, ResourceSpec)
        out.append(s)
    return out


def allocations(texts: list[str]):
    return [a for s in specs(texts) for a in s.allocations]


# The agent's own unit tests for #14327, as resource.txt files.
@pytest.mark.parametrize(
    ("lines", "caps", "expected"),
    [
        (["CUDA.SHARES_SHARES=0:0.5"], {("cuda.shares", "0"): Decimal(2)}, {"0": "0.2500"}),
        (["CUDA.SHARES_SHARES=0:0.5", "CUDA.SHARES_SHARES=0:0.25,1:1", "CUDA.SHARES_SHARES=1:0.5"],
         {("cuda.shares", "0"): Decimal(1), ("cuda.shares", "1"): Decimal(2)}, {"0": "0.7500", "1": "0.7500"}),
        (["CUDA.SHARES_SHARES=0:0.5"], {}, {"0": "0.5000"}),
        (["CUDA.SHARES_SHARES=0:0.5"], {("cuda.shares", "0"): Decimal(0)}, {"0": "0.5000"}),
        (["CPU_SHARES=0:2\nMEM_SHARES=root:1024"], {("cpu", "0"): Decimal(4)}, {}),
        (["CUDA.SHARES_SHARES=0:1"], {("cuda.shares", "0"): Decimal(3)}, {"0": "0.3333"}),
        ([], {}, {}),
    ],
)
def test_ratio_matches_the_agents_own_cases(lines: list[str], caps: dict, expected: dict) -> None:
    texts = [HEAD + line + "\n" for line in lines]
    assert ratio_alloc_map(allocations(texts), caps) == expected == scan_gpu_alloc_map_ratio(texts, caps)


FGPU = [HEAD + f"CUDA.SHARES_SHARES={G0}:0.50\n", HEAD + f"CUDA.SHARES_SHARES={G0}:0.60,{G1}:0.60\n"]
WHOLE = [HEAD + f"CUDA.DEVICE_SHARES={G1}:1\n"]
MIGS = [HEAD + f"CUDA.DEVICE:3G.20GB-MIG_SHARES={MIG}:1\n"]


@pytest.mark.parametrize(
    ("texts", "absolute", "ratio"),
    [
        # 0.5 shares on an A100: old "0.50", new 0.5 / 13.5.
        (FGPU[:1], {G0: "0.50"}, {G0: "0.0370"}),
        (FGPU, {G0: "1.10", G1: "0.60"}, {G0: "0.0815", G1: "0.0444"}),
        (WHOLE, {G1: "1"}, {G1: "1.0000"}),
        # Old agents leave MIG slots out; new ones count them, each against its own capacity.
        (MIGS, {}, {MIG: "1.0000"}),
        # Old agents add a share count and a device count into one number; new ones divide each.
        (FGPU + WHOLE + MIGS, {G0: "1.10", G1: "1.60"}, {G0: "0.0815", G1: "1.0444", MIG: "1.0000"}),
    ],
)
def test_both_forms_on_fgpu_whole_gpu_and_mig_devices(texts: list[str], absolute: dict, ratio: dict) -> None:
    allocs = allocations(texts)
    assert absolute_alloc_map(allocs) == absolute == scan_gpu_alloc_map(texts)
    assert ratio_alloc_map(allocs, CAPS) == ratio == scan_gpu_alloc_map_ratio(texts, CAPS)
    book = AllocationBook(clock=lambda: 0.0)
    for i, t in enumerate(texts):
        book.apply(f"k{i}", "/s", parse_resource(t))
    view = book.view()
    assert dict(view.alloc_map) == absolute
    assert view.alloc_map_ratio(CAPS) == ratio


def test_the_newest_agents_samples_in_both_forms() -> None:
    texts = [p.read_text() for p in sorted((FIXTURES / "resources-26").glob("*.txt"))]
    allocs = allocations(texts)
    caps = {(a.slot, a.device_id): Decimal("13.5") if a.slot == "cuda.shares" else Decimal(1) for a in allocs}
    assert absolute_alloc_map(allocs) == scan_gpu_alloc_map(texts)
    assert ratio_alloc_map(allocs, caps) == scan_gpu_alloc_map_ratio(texts, caps)
    # The upper-case mock MIG slot counts in the ratio form, not in the absolute one.
    assert ratio_alloc_map(allocs, caps)["c59395cd-ac91-4cd3-a1b0-3d2568aa3000"] == "1.0000"
    assert "c59395cd-ac91-4cd3-a1b0-3d2568aa3000" not in absolute_alloc_map(allocs)


_amount = st.decimals(min_value=0, max_value=14, places=2, allow_nan=False, allow_infinity=False)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([G0, G1]), _amount, st.sampled_from(["CUDA.SHARES_SHARES", "CUDA.DEVICE_SHARES"])), max_size=12))
def test_running_totals_give_the_agents_ratio(entries: list) -> None:
    texts = [HEAD + f"{key}={dev}:{amt}\n" for dev, amt, key in entries]
    book = AllocationBook(clock=lambda: 0.0)
    for i, t in enumerate(texts):
        book.apply(f"k{i}", "/s", parse_resource(t))
    assert book.view().alloc_map_ratio(CAPS) == scan_gpu_alloc_map_ratio(texts, CAPS)
    assert dict(book.view().alloc_map) == scan_gpu_alloc_map(texts)
