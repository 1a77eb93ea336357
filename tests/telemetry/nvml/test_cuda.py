"""SM counts of whole GPUs from the CUDA driver API (exporter/telemetry/nvml/cuda.py) and the model
table, on the simulated driver and, marked ``gpu``, on a real one; and the fGPU capacity they give."""

from __future__ import annotations

import ctypes
from decimal import Decimal

import pytest

from exporter.analysis.capacity import CapacityConfig, fractional_capacity
from exporter.telemetry.nvml import (
    CudaUnavailable,
    NvmlSource,
    cuda_devices,
    known_sm_count,
    normalize_pci_bus_id,
    probe,
)
from exporter.telemetry.nvml.simulated import FakeNvml


def read_all(source: NvmlSource):
    info = source.prepare()
    try:
        return [r for r in map(source.read_device, info.device_keys) if r is not None]
    finally:
        source.close()


def test_cuda_lists_every_gpu_not_in_mig_mode_with_its_sms_uuid_and_bus_id() -> None:
    fake = FakeNvml.dgx_a100()
    with fake.installed():
        devices = cuda_devices()  # loads libcuda at call time: the installed machine's
    assert len(devices) == 6  # GPUs 6 and 7 are in MIG mode
    assert {d.multiprocessor_count for d in devices} == {108}
    by_uuid = {g.uuid: g for g in fake.gpus}
    for d in devices:
        gpu = by_uuid[d.uuid]
        assert d.pci_bus_id == normalize_pci_bus_id(gpu.pci_bus_id)
        assert d.memory_total_bytes == gpu.memory_total - gpu.memory_reserved


@pytest.mark.parametrize(
    ("state", "why"),
    [("missing", "not loadable"), ("no_device", "no CUDA device visible"), ("insufficient_driver", "CUresult 35")],
)
def test_cuda_failures_say_why(state: str, why: str) -> None:
    fake = FakeNvml.dgx_a100()
    fake.cuda_state = state
    with fake.installed(), pytest.raises(CudaUnavailable, match=why):
        cuda_devices()


def test_an_unloaded_driver_answers_no_device() -> None:
    fake = FakeNvml.dgx_a100()
    fake.unload_driver()
    with fake.installed(), pytest.raises(CudaUnavailable, match="no CUDA device"):
        cuda_devices()


def test_calls_before_cuinit_are_refused_as_the_driver_does() -> None:
    lib = FakeNvml.dgx_a100().load_libcuda()
    count = ctypes.c_int(0)
    assert lib.cuDeviceGetCount(ctypes.byref(count)) == 3  # CUDA_ERROR_NOT_INITIALIZED
    assert lib.cuInit(ctypes.c_uint(0)) == 0
    assert lib.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value == 6
    dev = ctypes.c_int(0)
    assert lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(6)) == 101  # CUDA_ERROR_INVALID_DEVICE


def test_whole_gpus_get_cuda_sm_counts_and_memory_mig_devices_keep_nvmls() -> None:
    fake = FakeNvml.dgx_a100()
    with fake.installed():
        readings = read_all(NvmlSource())
    whole = [r for r in readings if not r.mig_mode_current]
    assert len(whole) == 6
    assert {r.multiprocessor_count for r in whole} == {108}
    assert {r.allocatable_memory_bytes for r in whole} == {40 * 1024**3 - 512 * 1024**2}
    mig_parents = [r for r in readings if r.mig_mode_current]
    assert all(r.multiprocessor_count is None for r in mig_parents)
    assert all(m.multiprocessor_count for r in mig_parents for m in r.mig_devices)


@pytest.mark.parametrize("state", ["missing", "no_device"])
def test_without_libcuda_the_model_table_gives_the_sm_count(state: str) -> None:
    fake = FakeNvml.dgx_a100()
    fake.cuda_state = state
    with fake.installed():
        readings = read_all(NvmlSource())
    whole = [r for r in readings if not r.mig_mode_current]
    assert {r.multiprocessor_count for r in whole} == {108}
    assert {r.allocatable_memory_bytes for r in whole} == {None}


def test_gpus_are_matched_by_uuid_even_when_cuda_orders_them_differently() -> None:
    fake = FakeNvml.h100_node()
    for i, gpu in enumerate(fake.gpus):  # a heterogeneous node, CUDA ordered by bus id
        gpu.multiprocessors = 100 + i
    fake.gpus[3].pci_bus_id, fake.gpus[5].pci_bus_id = fake.gpus[5].pci_bus_id, fake.gpus[3].pci_bus_id
    with fake.installed():
        readings = read_all(NvmlSource())
    got = {r.index: r.multiprocessor_count for r in readings if not r.mig_mode_current}
    assert got == {i: 100 + i for i in range(1, 8)}


@pytest.mark.parametrize(
    ("name", "sms"),
    [("NVIDIA A100-SXM4-40GB", 108), ("NVIDIA H100 PCIe", 114), ("NVIDIA H100 80GB HBM3", 132),
     ("Tesla V100-SXM2-32GB", 80), ("NVIDIA L40S", 142), ("NVIDIA L4", 58), ("NVIDIA A10", 72),
     ("NVIDIA A10G", 80), ("NVIDIA GeForce RTX 4090", 128), ("Quadro P400", None), (None, None)],
)
def test_model_table(name: str | None, sms: int | None) -> None:
    assert known_sm_count(name) == sms


def test_a_fractional_dgx_a100_capacity_is_the_plugins_rule_without_overrides() -> None:
    """A100-SXM4-40GB: min(39.5 GiB / 2 GiB, 108 / 8) = 13.5 shares, as the plugin registers."""
    fake = FakeNvml.dgx_a100()
    with fake.installed():
        readings = read_all(NvmlSource())
    for r in readings:
        if not r.mig_mode_current:
            cap = fractional_capacity(r.allocatable_memory_bytes, r.multiprocessor_count, CapacityConfig())
            assert cap == Decimal("13.5")


def test_pci_bus_ids_normalise_across_cuda_and_nvml_spellings() -> None:
    assert normalize_pci_bus_id("0000:07:00.0") == normalize_pci_bus_id(b"00000000:07:00.0") == "00000000:07:00.0"
    assert normalize_pci_bus_id("0000:B7:00.0") == "00000000:b7:00.0"
    assert normalize_pci_bus_id(None) is None


@pytest.mark.gpu
def test_real_gpus_get_an_sm_count_from_cuda() -> None:
    problem = probe()
    if problem is not None:
        pytest.skip(f"NVML unavailable: {problem}")
    try:
        devices = cuda_devices()
    except CudaUnavailable as exc:
        pytest.skip(f"libcuda unavailable: {exc}")
    readings = read_all(NvmlSource())
    by_uuid = {d.uuid: d for d in devices}
    whole = [r for r in readings if not r.mig_mode_current]
    assert whole, "no whole GPU on this host"
    for r in whole:
        assert r.multiprocessor_count and r.multiprocessor_count > 0
        if r.uuid in by_uuid:
            d = by_uuid[r.uuid]
            assert r.multiprocessor_count == d.multiprocessor_count
            assert normalize_pci_bus_id(r.pci_bus_id) == d.pci_bus_id
            assert 0 < d.memory_total_bytes <= r.memory_total_bytes
            table = known_sm_count(r.name)
            assert table in (None, d.multiprocessor_count)
