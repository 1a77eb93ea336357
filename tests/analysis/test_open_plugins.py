"""Every open accelerator plugin's whole-device slot counts: capacity 1 per device, its own
headroom, device ids as the plugin writes them; cuda_open's CUDA ordinals join with telemetry."""

from __future__ import annotations

from decimal import Decimal

import pytest
from helpers import FIXTURES

from exporter.analysis.capacity import OPEN_PLUGIN_DEVICE_SLOTS, CapacityConfig, device_capacity, is_device_slot
from exporter.analysis.node import HeadroomParams, Inventory, node_state
from exporter.scratch.allocation import AllocationBook
from exporter.scratch.resources import parse_resource
from exporter.telemetry.devices import DeviceResolver
from exporter.telemetry.model import DeviceReading, TelemetrySnapshot

HEADER = 'SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={{"cpu":"1","{slot}":"{n}"}}\nUNIFIED_DEVICES=[]\n'
IDS = {
    "rocm.device": ["RX7900-4C0A1B2C3D", "RX7900-4C0A1B2C3E"],  # serial numbers
    "ipu.device": ["17", "18"],
    "atom.device": ["rbln0", "rbln1"],
    "atom-max.device": ["S24Y1234", "S24Y1235"],
}


@pytest.mark.parametrize("slot", OPEN_PLUGIN_DEVICE_SLOTS)
def test_every_open_plugin_slot_has_capacity_one_per_device(slot: str) -> None:
    assert is_device_slot(slot)
    assert device_capacity(slot, "whatever-id", None, CapacityConfig()) == Decimal(1)


@pytest.mark.parametrize("slot", [s for s in OPEN_PLUGIN_DEVICE_SLOTS if s != "cuda.device"])
def test_each_plugin_gets_its_own_headroom_over_known_and_held_devices(slot: str) -> None:
    ids = IDS.get(slot, ["0", "1"])
    book = AllocationBook(clock=lambda: 0.0)
    text = HEADER.format(slot=slot, n=1) + f"{slot.upper()}_SHARES={ids[0]}:1\n"
    book.apply("k1", "/s", parse_resource(text))
    inventory = Inventory(other_devices=tuple((slot, d) for d in [*ids, "spare"]))
    state = node_state(book.view(), inventory, HeadroomParams())
    rows = {d.device_id: (d.capacity, d.allocated) for d in state.slots[slot]}
    assert rows == {ids[0]: (1, 1), ids[1]: (1, 0), "spare": (1, 0)}
    summary = state.summary(slot)
    assert (summary.capacity, summary.allocated, summary.headroom, summary.whole_free_devices) == (3, 1, 2, 2)
    assert set(state.slots) == {slot}  # no cuda slot invented on a node without GPUs


def test_the_newest_agents_samples_count_per_plugin() -> None:
    book = AllocationBook(clock=lambda: 0.0)
    for path in sorted((FIXTURES / "resources-26").glob("*.txt")):
        book.apply(path.stem, "/s", parse_resource(path.read_text()))
    state = node_state(book.view(), Inventory(), HeadroomParams(mode="discrete"))
    assert {d.device_id for d in state.slots["tt-n300.device"]} == {"1", "3"}
    assert {d.device_id for d in state.slots["atom.device"]} == {"rbln1"}
    assert all(d.capacity == 1 and d.allocated == 1 for s in ("tt-n300.device", "atom.device") for d in state.slots[s])


def _gpu(index: int) -> DeviceReading:
    return DeviceReading(uuid=f"GPU-0000000{index}-0000-4000-8000-000000000000", index=index, name="NVIDIA A100")


def test_cuda_open_ordinals_with_gaps_join_with_telemetry() -> None:
    # GPU 1 is in the plugin's device_mask: the ids stay CUDA ordinals "0", "2", "3".
    snap = TelemetrySnapshot(source="nvml", devices=tuple(_gpu(i) for i in range(4)))
    resolver = DeviceResolver(snap, ["0", "2", "3"])
    assert resolver.scheme == "index"
    assert resolver.resolve("2") is snap.devices[2]
    assert [resolver.label(d) for d in snap.devices] == ["0", "1", "2", "3"]


def test_ratio_capacities_are_the_one_slot_each_device_registers(caplog) -> None:
    from exporter.analysis.capacity import GpuInventory
    from exporter.analysis.node import MigInstanceDevice, ratio_capacities
    from exporter.scratch.allocation import ratio_alloc_map

    GiB = 2**30
    text = (
        'SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={"cuda.shares":"1.5","cuda.device":"1","cuda.mem":"1073741824"}\n'
        "CUDA.SHARES_SHARES=GPU-ratio-a:1.5\nCUDA.DEVICE_SHARES=GPU-ratio-a:1\nCUDA.MEM_SHARES=GPU-ratio-a:1073741824\n"
        "CUDA.DEVICE:1G.10GB-MIG_SHARES=MIG-ratio-9:1\n"
    )
    book = AllocationBook(clock=lambda: 0.0)
    book.apply("k1", "/scratch", parse_resource(text))
    book.apply("k2", "/scratch", parse_resource(text))
    view = book.view()
    inventory = Inventory((GpuInventory("GPU-ratio-a", 40 * GiB, 108, 0), GpuInventory("GPU-ratio-b", None, None)),
                          (MigInstanceDevice("MIG-ratio-9", "cuda.device:1g.10gb-mig", 1),))
    state = node_state(view, inventory, HeadroomParams(mode="fractional"))
    assert [d.numa_node for d in state.slots["cuda.shares"]] == [0]
    # A GPU handed out as shares registers cuda.shares only (not the cuda.device row a kernel's
    # allocation adds), a MIG device its profile's slot, and nothing registers cuda.mem.
    capacities = ratio_capacities(state, inventory)
    assert capacities == {("cuda.shares", "GPU-ratio-a"): Decimal("13.5"), ("cuda.device:1g.10gb-mig", "MIG-ratio-9"): 1}
    # As the 26.9.6 agent sums it: 3/13.5 shares, plus 2 devices and 2 GiB of memory added raw.
    with caplog.at_level("WARNING", logger="exporter.scratch.allocation"):
        ratio = view.alloc_map_ratio(capacities)
        assert view.alloc_map_ratio(capacities) == ratio  # the next request logs nothing new
    assert ratio == {"GPU-ratio-a": str((Decimal(3) / Decimal("13.5") + 2 + 2 * GiB).quantize(Decimal("0.0001"))),
                     "MIG-ratio-9": "2.0000"}
    raw = [r.getMessage() for r in caplog.records if "raw amount" in r.getMessage()]
    assert len(raw) == 2 and {"cuda.device on device GPU-ratio-a", "cuda.mem on device GPU-ratio-a"} == {
        m.split(" is added")[0].removeprefix("ratio alloc map: ") for m in raw}
    assert ratio_alloc_map([], capacities) == {}
