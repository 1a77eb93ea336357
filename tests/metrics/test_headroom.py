"""Headroom families from a read model built of an allocation view and a telemetry snapshot."""

from __future__ import annotations

import subprocess
from decimal import Decimal

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from exporter.analysis.agents import AgentLayout
from exporter.analysis.capacity import CapacityConfig, GpuInventory
from exporter.analysis.liveness import CgroupScan, KernelLiveness, Liveness, summarise
from exporter.analysis.model import Analysis
from exporter.analysis.node import (
    HeadroomParams,
    Inventory,
    MigInstanceDevice,
    NodeState,
    headroom_figures,
    inventory_from_snapshot,
    node_state,
)
from exporter.analysis.placement import NoFragRule, Request
from exporter.metrics.headroom import headroom_families
from exporter.scratch.allocation import AllocationBook
from exporter.scratch.resources import parse_resource
from exporter.telemetry.devices import DeviceResolver
from exporter.telemetry.mig import parse_hami_geometries
from exporter.telemetry.model import (
    DeviceReading,
    GpuInstanceReading,
    MigDeviceReading,
    MigPlacement,
    MigProfileCapacity,
    TelemetrySnapshot,
)

GiB = 1024**3
CID = "3b9e1c0d5f2a4e6b8c7d9f0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e"
A100 = "NVIDIA A100-SXM4-40GB"


def resource(shares: str, slot: str = "cuda.shares") -> str:
    total = sum(Decimal(e.split(":")[1]) for e in shares.split(","))
    return (
        "SCRATCH_SIZE=0m\nMOUNTS=\n"
        f'SLOTS={{"cpu":"1","mem":"1073741824","{slot}":"{total}"}}\n'
        f"{slot.upper()}_SHARES={shares}\nCPU_SHARES=0:1\nMEM_SHARES=root:1g\nCID={CID}\n"
    )


def view_of(**kernels: str):
    book = AllocationBook(clock=lambda: 1000.0)
    for kernel_id, text in kernels.items():
        book.apply(kernel_id, "/scratch", parse_resource(text))
    return book.view()


def gpu(uuid: str, index: int, **kw) -> DeviceReading:
    return DeviceReading(uuid=uuid, index=index, name=A100, memory_total_bytes=40 * GiB, multiprocessor_count=108, **kw)


def mig_gpu() -> DeviceReading:
    return DeviceReading(
        uuid="GPU-m",
        index=2,
        name=A100,
        mig_mode_current=True,
        mig_layout_readable=True,
        gpu_instances=(
            GpuInstanceReading(1, 19, "1g.5gb", MigPlacement(5, 1)),
            GpuInstanceReading(2, 19, "1g.5gb", MigPlacement(6, 1)),
            GpuInstanceReading(3, 14, "2g.10gb", MigPlacement(2, 2)),
        ),
        mig_devices=(
            MigDeviceReading(uuid="MIG-1", parent_uuid="GPU-m", index=0, profile="1g.5gb"),
            MigDeviceReading(uuid="MIG-2", parent_uuid="GPU-m", index=1, profile="1g.5gb"),
            MigDeviceReading(uuid="MIG-3", parent_uuid="GPU-m", index=2, profile="2g.10gb"),
        ),
    )


SNAPSHOT = TelemetrySnapshot(source="mock", devices=(gpu("GPU-a", 0), gpu("GPU-b", 1), mig_gpu()), success=True)
HAMI = tuple(
    parse_hami_geometries(
        """
- models: [A100-SXM4-40GB]
  allowedGeometries:
  - [{name: 3g.20gb, memory: 20480, count: 2}]
  - [{name: 1g.5gb, memory: 5120, count: 7}]
"""
    )
)


def by_uuid(snapshot: TelemetrySnapshot | None) -> DeviceResolver:
    return DeviceResolver(snapshot or TelemetrySnapshot(source="none"), scheme="uuid")


def registry(families) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)

    class _Collector:
        def collect(self):
            return iter(families)

    reg.register(_Collector())
    return reg


def families(view, snapshot, devices, params, liveness=None, cgroup_visible=None):
    """The headroom families of a read model built by hand: ``devices`` is the resolver (the
    inventory is what ``snapshot`` shows) or a ready inventory."""
    if isinstance(devices, Inventory):
        resolver, inventory = by_uuid(snapshot), devices
    else:
        resolver, inventory = devices, inventory_from_snapshot(snapshot, devices)
    state = node_state(view, inventory, params, liveness)
    cgroups = CgroupScan(cgroup_visible, frozenset(), "v2") if cgroup_visible is not None else None
    stale, counts = summarise(liveness or {})
    model = Analysis(view, snapshot or TelemetrySnapshot(source="none"), resolver, inventory, state,
                     headroom_figures(state, inventory, params), AgentLayout(roots=()), liveness=liveness or {},
                     stale_kernels=stale, liveness_counts=counts, cgroups=cgroups)
    return headroom_families(model)


def sample(reg: CollectorRegistry, name: str, **labels: str) -> float | None:
    return reg.get_sample_value(name, labels)


def test_headroom_families_of_a_fractional_node() -> None:
    view = view_of(k1=resource("GPU-a:0.60,GPU-b:0.60"), k2=resource("MIG-1:1", "cuda.device:1g.5gb-mig"))
    params = HeadroomParams(hami=HAMI)
    reg = registry(families(view, SNAPSHOT, by_uuid(SNAPSHOT), params))

    assert sample(reg, "gpu_alloc_device_capacity", device_id="GPU-a", slot="cuda.shares") == 13.5
    assert sample(reg, "gpu_alloc_device_free", device_id="GPU-a", slot="cuda.shares") == pytest.approx(12.9)
    assert sample(reg, "gpu_alloc_device_overcommitted", device_id="GPU-b", slot="cuda.shares") == 0
    assert sample(reg, "gpu_alloc_node_headroom", slot="cuda.shares", fragmentation="allowed") == pytest.approx(25.8)
    # 12.9 fits one device; two devices would need parts of 13.5 - 0.6 each at most → 25.8 as well
    assert sample(reg, "gpu_alloc_node_headroom", slot="cuda.shares", fragmentation="disallowed") == pytest.approx(25.8)
    assert sample(reg, "gpu_alloc_node_max_single_device_free", slot="cuda.shares") == pytest.approx(12.9)
    assert sample(reg, "gpu_alloc_node_whole_free_devices", slot="cuda.shares") == 0
    assert sample(reg, "gpu_alloc_node_fragmentation_ratio", slot="cuda.shares") == 1
    assert sample(reg, "gpu_alloc_request_fits", slot="cuda.shares", request="4", fragmentation="allowed") == 6
    assert sample(reg, "gpu_alloc_request_fits", slot="cuda.shares", request="4", fragmentation="disallowed") == 6
    assert sample(reg, "gpu_alloc_request_fits", slot="cuda.device", request="1", fragmentation="allowed") is None

    # MIG: each instance is a device of its profile's slot
    assert sample(reg, "gpu_alloc_node_whole_free_devices", slot="cuda.device:1g.5gb-mig") == 1
    assert sample(reg, "gpu_alloc_node_headroom", slot="cuda.device:1g.5gb-mig", fragmentation="allowed") == 1
    assert sample(reg, "gpu_alloc_node_headroom", slot="cuda.device:2g.10gb-mig", fragmentation="allowed") == 1
    assert sample(reg, "gpu_alloc_node_fragmentation_ratio", slot="cuda.device:1g.5gb-mig") is None
    # the MIG user guide's fragmented layout: 4 free slices, no 3g
    assert sample(reg, "gpu_alloc_mig_creatable_instances", device_id="GPU-m", profile="3g.20gb") == 0
    assert sample(reg, "gpu_alloc_mig_creatable_instances", device_id="GPU-m", profile="1g.5gb") == 3
    assert sample(reg, "gpu_alloc_mig_geometry_reachable", device_id="GPU-m", geometry="3g.20gb:2") == 0
    assert sample(reg, "gpu_alloc_mig_geometry_reachable", device_id="GPU-m", geometry="1g.5gb:7") == 0  # a 2g exists
    # staleness not judged: no kernel is stale, and the cgroup tree's visibility is not claimed
    assert sample(reg, "gpu_alloc_kernels_liveness", status="stale") == 0
    assert sample(reg, "gpu_alloc_cgroup_visible") is None


def test_empty_node_defaults_to_whole_devices_until_shares_appear() -> None:
    reg = registry(families(view_of(), SNAPSHOT, by_uuid(SNAPSHOT), HeadroomParams()))
    assert sample(reg, "gpu_alloc_device_capacity", device_id="GPU-a", slot="cuda.device") == 1
    assert sample(reg, "gpu_alloc_node_headroom", slot="cuda.device", fragmentation="allowed") == 2
    assert sample(reg, "gpu_alloc_request_fits", slot="cuda.device", request="2", fragmentation="allowed") == 1
    # MIG requests are exactly one instance: two free instances, headroom 1
    assert sample(reg, "gpu_alloc_node_whole_free_devices", slot="cuda.device:1g.5gb-mig") == 2
    assert sample(reg, "gpu_alloc_node_headroom", slot="cuda.device:1g.5gb-mig", fragmentation="allowed") == 1
    fractional = registry(families(view_of(), SNAPSHOT, by_uuid(SNAPSHOT), HeadroomParams(mode="fractional")))
    assert sample(fractional, "gpu_alloc_node_headroom", slot="cuda.shares", fragmentation="allowed") == 27
    assert sample(fractional, "gpu_alloc_node_whole_free_devices", slot="cuda.shares") == 2


def test_stale_kernels_are_counted_apart() -> None:
    view = view_of(k1=resource("GPU-a:0.60,GPU-b:0.60"), k2=resource("GPU-a:2"))
    liveness = {
        "k1": KernelLiveness(Liveness.LIVE, "container-running"),
        "k2": KernelLiveness(Liveness.STALE, "container-gone"),
    }
    reg = registry(
        families(view, SNAPSHOT, by_uuid(SNAPSHOT), HeadroomParams(), liveness, cgroup_visible=True)
    )
    assert sample(reg, "gpu_alloc_device_free", device_id="GPU-a", slot="cuda.shares") == pytest.approx(12.9)
    assert sample(reg, "gpu_alloc_device_stale_allocated", device_id="GPU-a", slot="cuda.shares") == 2
    assert sample(reg, "gpu_alloc_kernel_stale", kernel_id="k2", reason="container-gone") == 1
    assert sample(reg, "gpu_alloc_kernels_liveness", status="stale") == 1
    assert sample(reg, "gpu_alloc_kernels_liveness", status="unknown") == 0
    assert sample(reg, "gpu_alloc_cgroup_visible") == 1
    counted = registry(
        families(view, SNAPSHOT, by_uuid(SNAPSHOT), HeadroomParams(exclude_stale=False), liveness)
    )
    assert sample(counted, "gpu_alloc_device_free", device_id="GPU-a", slot="cuda.shares") == pytest.approx(10.9)


def test_overcommit_is_flagged_and_free_never_negative() -> None:
    view = view_of(k1=resource("GPU-a:10"), k2=resource("GPU-a:10"))
    reg = registry(families(view, SNAPSHOT, by_uuid(SNAPSHOT), HeadroomParams()))
    assert sample(reg, "gpu_alloc_device_overcommitted", device_id="GPU-a", slot="cuda.shares") == 1
    assert sample(reg, "gpu_alloc_device_free", device_id="GPU-a", slot="cuda.shares") == 0


def test_unknown_capacity_is_left_out_not_guessed() -> None:
    view = view_of(k1=resource("GPU-z:0.5"))
    reg = registry(families(view, None, by_uuid(None), HeadroomParams()))
    assert sample(reg, "gpu_alloc_device_capacity", device_id="GPU-z", slot="cuda.shares") is None
    override = HeadroomParams(capacity=CapacityConfig(overrides={"GPU-z": Decimal(2)}))
    reg = registry(families(view, None, by_uuid(None), override))
    assert sample(reg, "gpu_alloc_device_free", device_id="GPU-z", slot="cuda.shares") == 1.5


def test_nvml_mig_capacity_is_preferred_and_unreadable_layouts_skipped() -> None:
    capacity = (MigProfileCapacity(9, "3g.20gb", 3, 2, None, None, 1, (MigPlacement(0, 4), MigPlacement(4, 4))),)
    reading = gpu("GPU-m", 0, mig_mode_current=True, mig_profile_capacity=capacity)
    snapshot = TelemetrySnapshot(source="nvml", devices=(reading,))
    inventory = inventory_from_snapshot(snapshot, by_uuid(snapshot))
    assert inventory.mig_layouts[0].remaining == {"3g.20gb": 1}
    reg = registry(families(view_of(), None, inventory, HeadroomParams()))
    assert sample(reg, "gpu_alloc_mig_creatable_instances", device_id="GPU-m", profile="3g.20gb") == 1
    hidden = gpu("GPU-m", 0, mig_mode_current=True, mig_layout_readable=False)
    snapshot = TelemetrySnapshot(source="nvml", devices=(hidden,))
    assert inventory_from_snapshot(snapshot, by_uuid(snapshot)).mig_layouts == ()


def test_device_ids_follow_the_resolvers_scheme() -> None:
    view = view_of(k1=resource("0:1", "cuda.device"))
    resolver = DeviceResolver(SNAPSHOT, view.device_ids())
    reg = registry(families(view, SNAPSHOT, resolver, HeadroomParams()))
    assert sample(reg, "gpu_alloc_device_free", device_id="0", slot="cuda.device") == 0
    assert sample(reg, "gpu_alloc_device_free", device_id="1", slot="cuda.device") == 1
    assert sample(reg, "gpu_alloc_mig_creatable_instances", device_id="2", profile="3g.20gb") == 0


def test_node_state_json_round_trip() -> None:
    view = view_of(k1=resource("GPU-a:0.60,GPU-b:0.60"))
    inventory = Inventory(
        gpus=(GpuInventory("GPU-a", 40 * GiB, 108), GpuInventory("GPU-b", 40 * GiB, 108)),
        mig_devices=(MigInstanceDevice("MIG-9", "cuda.device:1g.5gb-mig"),),
    )
    params = HeadroomParams(rule=NoFragRule.SINGLE_DEVICE, links={frozenset({"GPU-a", "GPU-b"}): 200})
    state = node_state(view, inventory, params)
    assert list(state.slots) == ["cuda.shares", "cuda.device:1g.5gb-mig"]
    assert NodeState.from_json(state.to_json()) == state
    with pytest.raises(ValueError):
        NodeState.from_json({"slots": {"cuda.shares": [{"device_id": "a"}]}})


def test_params_validation() -> None:
    with pytest.raises(ValueError):
        HeadroomParams(mode="fancy")
    assert Request.parse("cuda.shares=0.5") in HeadroomParams().requests


@pytest.mark.tools("promtool")
def test_exposition_passes_promtool() -> None:
    view = view_of(k1=resource("GPU-a:0.60,GPU-b:0.60"), k2=resource("GPU-a:2"))
    liveness = {
        "k1": KernelLiveness(Liveness.LIVE, "container-running"),
        "k2": KernelLiveness(Liveness.STALE, "container-gone"),
    }
    text = generate_latest(
        registry(families(view, SNAPSHOT, by_uuid(SNAPSHOT), HeadroomParams(hami=HAMI), liveness, True))
    )
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, check=False)
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    assert result.stdout.decode() + result.stderr.decode() == ""
