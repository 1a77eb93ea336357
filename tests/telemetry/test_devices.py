"""Device-id resolution and the device_id label scheme."""

from __future__ import annotations

import pytest

from exporter.telemetry.devices import DeviceResolver
from exporter.telemetry.mock import DEMO_DEVICES_FILE, MockSource
from exporter.telemetry.model import DeviceReading, MigDeviceReading, TelemetrySnapshot

U0 = "GPU-5d2c0b0e-1f3a-4c6d-9e8f-0a1b2c3d4e50"
U1 = "GPU-a81e7f6d-2b4c-4d5e-8f9a-1b2c3d4e5f61"
MIG = "MIG-0f3e2d1c-4b5a-5968-a7b6-c5d4e3f2a1b0"


def nvml_snapshot() -> TelemetrySnapshot:
    mig = MigDeviceReading(uuid=MIG, parent_uuid=U1, index=0, profile="3g.20gb", gpu_instance_id=2, compute_instance_id=0)
    return TelemetrySnapshot(
        source="nvml",
        devices=(DeviceReading(uuid=U0, index=0), DeviceReading(uuid=U1, index=1, mig_devices=(mig,))),
        success=True,
    )


def mock_snapshot() -> TelemetrySnapshot:
    source = MockSource(DEMO_DEVICES_FILE, clock=lambda: 0.0)
    return TelemetrySnapshot(source="mock", devices=tuple(map(source.read_device, source.prepare().device_keys)))


@pytest.mark.parametrize(
    ("alloc_id", "expected"),
    [
        ("0", U0),
        ("1", U1),
        (U0, U0),
        (U0.removeprefix("GPU-"), U0),  # cuda_open's UUID and the mock's mother_uuid are bare
        (U1.upper().replace("GPU-", "gpu-"), U1),
        (f"  {U1}\n", U1),
        (MIG, MIG),
        (f"MIG-{U1}/2/0", MIG),  # the pre-R470 MIG spelling
        ("7", None),
        ("GPU-00000000-0000-0000-0000-000000000000", None),
        ("", None),
    ],
)
def test_every_backend_ai_spelling_resolves(alloc_id: str, expected: str | None) -> None:
    device = DeviceResolver(nvml_snapshot()).resolve(alloc_id)
    assert (device.uuid if device else None) == expected


def test_mock_ids_resolve_as_the_mock_plugin_writes_them() -> None:
    resolver = DeviceResolver(mock_snapshot())
    mother = "c59395cd-ac91-4cd3-a1b0-3d2568aa2d0"
    assert resolver.resolve(f"{mother}1").uuid == f"GPU-{mother}1"  # mock plugin: the mother_uuid
    assert resolver.resolve(f"GPU-{mother}2").uuid == f"GPU-{mother}2"  # fractional plugin
    mig = resolver.resolve(f"MIG-{mother}5/6/0")
    assert isinstance(mig, MigDeviceReading) and mig.profile == "1g.10gb"


@pytest.mark.parametrize(
    ("alloc_ids", "scheme", "label"),
    [
        ([U0, U1], "uuid", U0),
        (["0", "1"], "index", "0"),
        ([U0.removeprefix("GPU-")], "bare-uuid", U0.removeprefix("GPU-")),
        ([U0, "1", U1], "uuid", U0),  # the majority wins
        (["0", U1], "uuid", U0),  # a tie goes to the unambiguous spelling
        ([MIG, "rocm-17", "9"], "uuid", U0),  # ids of no GPU here, and MIG ids, do not vote
        ([], "uuid", U0),  # NVML's default
    ],
)
def test_the_auto_scheme_follows_the_allocations_on_this_node(alloc_ids: list[str], scheme: str, label: str) -> None:
    snapshot = nvml_snapshot()
    resolver = DeviceResolver(snapshot, alloc_ids)
    assert resolver.scheme == scheme
    assert resolver.label(snapshot.devices[0]) == label


def test_mock_devices_default_to_the_mock_plugins_bare_ids() -> None:
    snapshot = mock_snapshot()
    resolver = DeviceResolver(snapshot)
    assert resolver.scheme == "bare-uuid"
    assert resolver.label(snapshot.devices[0]) == "c59395cd-ac91-4cd3-a1b0-3d2568aa2d01"
    assert DeviceResolver(snapshot, ["GPU-c59395cd-ac91-4cd3-a1b0-3d2568aa2d03"]).scheme == "uuid"


@pytest.mark.parametrize("scheme", ["index", "uuid", "bare-uuid"])
def test_an_explicit_scheme_wins_and_mig_devices_keep_their_own_id(scheme: str) -> None:
    snapshot = nvml_snapshot()
    resolver = DeviceResolver(snapshot, ["0", "1"], scheme=scheme)
    assert resolver.scheme == scheme
    assert resolver.label(snapshot.devices[1]) == {"index": "1", "uuid": U1, "bare-uuid": U1[4:]}[scheme]
    assert resolver.label(snapshot.devices[1].mig_devices[0]) == MIG


def test_label_for_uuid_falls_back_to_the_uuid() -> None:
    resolver = DeviceResolver(nvml_snapshot(), scheme="index")
    assert resolver.label_for_uuid(U1) == "1"
    assert resolver.label_for_uuid("GPU-gone") == "GPU-gone"


def test_an_unknown_scheme_is_rejected() -> None:
    with pytest.raises(ValueError, match="device id scheme"):
        DeviceResolver(nvml_snapshot(), scheme="serial")
