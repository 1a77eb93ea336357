"""Mock devices: Backend.AI's mock-accelerator TOML configures the simulated NVML library, and the
NVML binding reads it (exporter/telemetry/mock.py, exporter/telemetry/nvml/mockfile.py)."""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import fields
from pathlib import Path

import pynvml
import pytest
from helpers import FIXTURES

from exporter.files import MAX_FILE_BYTES
from exporter.telemetry.mock import DEMO_DEVICES_FILE, MockConfigError, MockSource
from exporter.telemetry.model import MigPlacement, SourceConfigError
from exporter.telemetry.nvml import NvmlSource, cuda
from exporter.telemetry.nvml.mockfile import parse_mock_file
from exporter.telemetry.nvml.simulated import FakeNvml

UPSTREAM = FIXTURES / "mock-accelerator.toml"
GIB = 1024**3
DEMO_MOTHER = "c59395cd-ac91-4cd3-a1b0-3d2568aa2d0"

# Backend.AI's older cuda-mock-mig.toml (configs/accelerator/): cuda_mock keys, MIG devices whose
# physical GPUs are not listed.
LEGACY_MIG = """
nvidia_driver = "450.0.0"
cuda_runtime = "11.0"
devices = [
  { mother_uuid = "c59395cd-ac91-4cd3-a1b0-3d2568aa2d01", model_name = "CUDA GPU", numa_node = 0, smp_count = 108, memory_size = "40G", is_mig_device = false },
  { mother_uuid = "c59395cd-ac91-4cd3-a1b0-3d2568aa2d03", model_name = "MIG-20g", numa_node = 0, smp_count = 56, memory_size = "20G", is_mig_device = true },
  { mother_uuid = "c59395cd-ac91-4cd3-a1b0-3d2568aa2d03", model_name = "MIG-10g", numa_node = 0, smp_count = 28, memory_size = "10G", is_mig_device = true },
  { mother_uuid = "c59395cd-ac91-4cd3-a1b0-3d2568aa2d03", model_name = "MIG-10g", numa_node = 0, smp_count = 28, memory_size = "10G", is_mig_device = true },
]
"""


def readings(source: MockSource) -> list:
    return [source.read_device(key) for key in source.prepare().device_keys]


def read_once(path: Path, clock=lambda: 1000.0) -> list:
    source = MockSource(path, clock=clock)
    try:
        return readings(source)
    finally:
        source.close()


def test_backend_ai_upstream_file_loads_unchanged() -> None:
    source = MockSource(UPSTREAM, clock=lambda: 1000.0)
    info = source.prepare()
    assert (info.driver_version, info.cuda_version, info.device_count) == ("450.0.0", "11.0", 4)
    devices = readings(source)
    source.close()
    assert [d.uuid for d in devices] == [f"GPU-{DEMO_MOTHER}{i}" for i in range(1, 5)]
    assert [d.index for d in devices] == [0, 1, 2, 3]
    assert [d.numa_node for d in devices] == [0, 1, 0, 1]
    assert [d.pci_bus_id for d in devices] == [f"0000:99:{i:02d}.0" for i in range(4)]  # the plugin's hw_location
    for d in devices:
        # SMs of a whole GPU come from the simulated CUDA driver, as on a real node.
        assert (d.name, d.memory_total_bytes, d.multiprocessor_count) == ("CUDA GPU", 40 * GIB, 108)
        assert 0 <= d.utilization_gpu_ratio <= 1 and 0 < d.memory_used_bytes < d.memory_total_bytes
        assert d.power_limit_watts == 250 and 0 < d.power_usage_watts <= 250
        assert d.mig_mode_current is None and d.mig_devices == () and d.processes is None
        # What the file does not describe is what a GPU without the feature reports.
        assert d.ecc_corrected_errors is None and d.remapped_rows_pending is None and d.fan_speed_ratio is None
        assert dict(d.throttle_reasons) == {} and d.pcie_rx_bytes_per_second is None
        for f in fields(d):
            value = getattr(d, f.name)
            assert not (isinstance(value, float) and math.isnan(value))


def test_values_are_what_nvml_reports_in_its_units() -> None:
    (d, *_) = read_once(UPSTREAM)
    # NVML counts utilisation in whole %, temperature in whole °C, power in mW, clocks in MHz.
    assert round(d.utilization_gpu_ratio * 100, 9) == round(d.utilization_gpu_ratio * 100)
    assert d.temperature_celsius == int(d.temperature_celsius)
    assert round(d.power_usage_watts * 1000, 6) == round(d.power_usage_watts * 1000)
    assert d.sm_clock_hz % 1e6 == 0 and d.memory_clock_hz == 1593e6


def test_values_follow_the_injected_clock_deterministically() -> None:
    now = [1000.0]
    a, b = MockSource(UPSTREAM, clock=lambda: now[0]), MockSource(UPSTREAM, clock=lambda: now[0])
    first = readings(a)
    assert readings(b) == first  # same seed, same clock: same values, each source its own machine
    assert readings(a) == first  # a frozen clock gives frozen values
    assert len({d.temperature_celsius for d in first}) == 4  # devices differ in phase
    now[0] = 1060.0
    later = readings(a)
    assert later[0].utilization_gpu_ratio != first[0].utilization_gpu_ratio
    # The energy counter starts at 0 and integrates the power pattern, each 1/6 s sampling period
    # at its value at the period's start, whenever it is read.
    assert first[0].energy_joules == 0
    power = parse_mock_file(UPSTREAM.read_text(), "x").gpus[0].patterns["power_watts"]
    period = 166_667  # µs
    start, end = 1000 * 10**6 // period, 1060 * 10**6 // period
    drawn = sum(round(1000 * power.at(k * period / 1e6)) * period for k in range(start, end))  # mW x µs
    drawn += round(1000 * power.at(end * period / 1e6)) * (1060 * 10**6 - end * period)
    drawn -= round(1000 * power.at(start * period / 1e6)) * (1000 * 10**6 - start * period)
    assert later[0].energy_joules == drawn // 10**6 / 1000
    assert readings(a)[0].energy_joules == later[0].energy_joules  # a frozen clock adds nothing
    a.close()
    b.close()


def test_the_demo_node_has_four_fractional_gpus_and_a_mig_gpu() -> None:
    source = MockSource(DEMO_DEVICES_FILE, clock=lambda: 1000.0)
    info = source.prepare()
    assert (info.driver_version, info.cuda_version) == ("550.54.15", "12.4")
    devices = readings(source)
    source.close()
    assert [d.uuid for d in devices] == [f"GPU-{DEMO_MOTHER}{i}" for i in range(1, 6)]
    for d in devices:
        assert (d.name, d.memory_total_bytes) == ("NVIDIA A100-SXM4-80GB", 80 * GIB)
    assert all(d.mig_mode_current is False and d.utilization_gpu_ratio is not None for d in devices[:4])
    assert [d.multiprocessor_count for d in devices] == [108] * 4 + [None]  # CUDA lists no MIG-enabled GPU
    mig = devices[4]
    assert mig.mig_mode_current is True and mig.utilization_gpu_ratio is None and mig.mig_layout_readable is True
    assert mig.temperature_celsius is not None and mig.power_usage_watts is not None
    assert [(m.uuid, m.profile, m.placement, m.gpu_instance_id, m.compute_instance_id) for m in mig.mig_devices] == [
        (f"MIG-{DEMO_MOTHER}5/4/0", "3g.40gb", MigPlacement(4, 4), 1, 0),
        (f"MIG-{DEMO_MOTHER}5/5/0", "2g.20gb", MigPlacement(0, 2), 2, 0),
        (f"MIG-{DEMO_MOTHER}5/6/0", "1g.10gb", MigPlacement(2, 1), 3, 0),
    ]
    assert [(m.memory_total_bytes, m.multiprocessor_count) for m in mig.mig_devices] == [
        (int(39.25 * GIB), 42), (int(19.5 * GIB), 28), (int(9.5 * GIB), 14)]
    assert mig.memory_used_bytes == sum(m.memory_used_bytes for m in mig.mig_devices)  # NVML's aggregate
    assert [(gi.gpu_instance_id, gi.profile_id) for gi in mig.gpu_instances] == [(1, 9), (2, 14), (3, 19)]
    remaining = {p.name: p.remaining for p in mig.mig_profile_capacity}
    assert remaining == {"1g.10gb": 1, "1g.10gb+me": 1, "1g.20gb": 0, "2g.20gb": 0, "3g.40gb": 0, "4g.40gb": 0, "7g.80gb": 0}


def test_legacy_mig_file_groups_mig_devices_under_a_synthesised_gpu(tmp_path: Path) -> None:
    path = tmp_path / "cuda-mock-mig.toml"
    path.write_text(LEGACY_MIG)
    devices = read_once(path)
    assert [d.uuid for d in devices] == [f"GPU-{DEMO_MOTHER}1", f"GPU-{DEMO_MOTHER}3"]
    parent = devices[1]
    assert (parent.name, parent.memory_total_bytes, parent.mig_mode_current) == ("CUDA GPU", 40 * GIB, True)
    assert parent.utilization_gpu_ratio is None
    assert [(m.uuid, m.profile, m.memory_total_bytes, m.multiprocessor_count) for m in parent.mig_devices] == [
        (f"MIG-{DEMO_MOTHER}3/1/0", "20g", 20 * GIB, 56),
        (f"MIG-{DEMO_MOTHER}3/2/0", "10g", 10 * GIB, 28),
        (f"MIG-{DEMO_MOTHER}3/3/0", "10g", 10 * GIB, 28),
    ]
    # No placements in the file: the layout cannot be read (never guessed); GPU instances in order.
    assert parent.mig_layout_readable is False
    assert parent.gpu_instances == () and parent.mig_profile_capacity is None
    assert [(m.placement, m.gpu_instance_id) for m in parent.mig_devices] == [(None, 1), (None, 2), (None, 3)]


def test_other_slots_need_no_mig_flag(tmp_path: Path) -> None:
    path = tmp_path / "rocm-mock.toml"
    path.write_text(
        'slot_name = "rocm"\ndevice_plugin_name = "MockDevice"\n'
        'devices = [{ mother_uuid = "d1", model_name = "MI250", numa_node = 0, subproc_count = 104, memory_size = "64g" }]\n'
    )
    source = MockSource(path)
    info = source.prepare()
    (device,) = readings(source)
    source.close()
    assert device.uuid == "GPU-d1" and device.memory_total_bytes == 64 * GIB
    assert device.multiprocessor_count == 104  # matched to CUDA's device by bus id: "d1" is no UUID
    assert (info.driver_version, info.cuda_version) == (None, None)


def test_processes_and_their_sm_samples_come_through_nvml(tmp_path: Path) -> None:
    path = tmp_path / "devices.toml"
    path.write_text(device(processes='[{ pid = 1001, used_memory = "4G", sm_util = 0.6 }, { pid = 1002 }]',
                           fan_speed_ratio="0.42"))
    now = [1000.0]
    source = MockSource(path, clock=lambda: now[0])
    (d,) = readings(source)
    assert [(p.pid, p.used_memory_bytes) for p in d.processes] == [(1001, 4 * GIB), (1002, None)]
    assert dict(d.process_utilization) == {1001: 0.6}
    assert d.fan_speed_ratio == 0.42
    (d,) = readings(source)
    assert dict(d.process_utilization) == {}  # no new sample at a frozen clock, as NVML answers
    now[0] += 1
    (d,) = readings(source)
    assert dict(d.process_utilization) == {1001: 0.6}
    source.close()


def test_one_library_answers_and_the_binding_reads() -> None:
    """The mock source is the NVML source over the machine the file describes, nothing more."""
    clock = lambda: 1000.0  # noqa: E731
    mock = read_once(DEMO_DEVICES_FILE, clock)
    machine = FakeNvml.from_mock_file(parse_mock_file(DEMO_DEVICES_FILE.read_text(), "demo"), clock=clock)
    with machine.installed():
        nvml = NvmlSource(clock=clock, xid_events=False)
        direct = [nvml.read_device(k) for k in nvml.prepare().device_keys]
        nvml.close()
    assert mock == direct


def test_nothing_stays_installed_and_no_thread_is_left() -> None:
    saved_lib, saved_cuda = pynvml.nvmlLib, cuda._load_libcuda
    before = set(threading.enumerate())
    source = MockSource(DEMO_DEVICES_FILE)
    assert len(readings(source)) == 5
    assert pynvml.nvmlLib is saved_lib and cuda._load_libcuda is saved_cuda
    assert set(threading.enumerate()) == before
    source.close()


def test_a_read_before_prepare_initialises_first() -> None:
    source = MockSource(UPSTREAM, clock=lambda: 1000.0)
    assert source.read_device(0).uuid == f"GPU-{DEMO_MOTHER}1"
    source.close()


def test_the_parser_takes_text_and_names_the_file_in_errors() -> None:
    machine = parse_mock_file(UPSTREAM.read_text(), "upstream.toml")
    assert [(g.uuid, g.listed, g.multiprocessors) for g in machine.gpus] == [(f"GPU-{DEMO_MOTHER}{i}", True, 108) for i in range(1, 5)]
    assert (machine.driver_version, machine.cuda_version) == ("450.0.0", "11.0")
    with pytest.raises(MockConfigError, match=r"^upstream\.toml: devices: missing required key"):
        parse_mock_file('slot_name = "cuda"\n', "upstream.toml")


def device(**extra: str) -> str:
    fields_ = {
        "mother_uuid": '"m1"',
        "model_name": '"CUDA GPU"',
        "numa_node": "0",
        "subproc_count": "108",
        "memory_size": '"40G"',
        "is_mig_device": "false",
    }
    fields_.update(extra)
    return "[[devices]]\n" + "".join(f"{k} = {v}\n" for k, v in fields_.items() if v is not None)


MIG_PARENT = '[mig_parents.m9]\nmodel_name = "NVIDIA A100-SXM4-80GB"\nmemory_size = "80G"\n'


def mig(start: int, profile: str = "3g.40gb") -> str:
    return device(mother_uuid='"m9"', model_name=f'"MIG-{profile}"', is_mig_device="true", placement_start=str(start))


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("devices = [", "invalid TOML"),
        ('slot_name = "cuda"\n', "devices: missing required key"),
        (device(memory_size=None), "devices[0]: missing required key 'memory_size'"),
        (device(memory_size='"forty"'), "devices[0].memory_size"),
        (device(numa_node="-1"), "devices[0].numa_node: must be at least 0"),
        (device(subproc_count="true"), "devices[0].subproc_count: expected int"),
        (device(is_mig_device=None), "devices[0]: missing required key 'is_mig_device'"),
        (device() + device(), "devices[1].mother_uuid: duplicate device 'm1'"),
        (device(mother_uuid='"a b"'), "not a usable device id"),
        (device(utilization_ratio='{ pattern = "sine", min = 0, max = 2 }'), "utilization_ratio: out of range 0..1"),
        (device(power_watts='{ pattern = "zigzag", min = 0, max = 2 }'), "power_watts.pattern: expected sine, ramp or square"),
        (device(model_name='"MIGGPU"', is_mig_device="true"), "needs a '-<profile>' suffix"),
        (mig(2) + MIG_PARENT, "3g.40gb cannot be placed at 2:4"),
        (mig(0, "20g") + MIG_PARENT, "'20g' is not a MIG profile of NVIDIA A100-SXM4-80GB"),
        (mig(0) + mig(0, "2g.20gb") + MIG_PARENT, "conflicts with GPU instance 1"),
        (mig(0) + device(mother_uuid='"m9"', model_name='"MIG-1g.10gb"', is_mig_device="true") + MIG_PARENT,
         "placement_start is needed"),
        (device() + '[mig_parents.m1]\nmodel_name = "x"\n', "mig_parents.m1: not the mother_uuid of MIG devices"),
        (device(pci_bus_id='"slot 7"'), "devices[0].pci_bus_id: expected domain:bus:device.function"),
        (device(serial='"' + "9" * 40 + '"'), "devices[0].serial: at most 29 printable characters"),
        ('[attributes]\ncuda_runtime = "twelve"\n' + device(), "attributes.cuda_runtime: expected a version like 12.4"),
        (mig(0) + MIG_PARENT + 'processes = [{ pid = 1 }]\n', "mig_parents.m9.processes: a MIG-enabled GPU's processes run in"),
    ],
)
def test_a_bad_file_is_an_error_naming_the_file_and_the_reason(tmp_path: Path, text: str, reason: str) -> None:
    path = tmp_path / "devices.toml"
    path.write_text(text)
    with pytest.raises(MockConfigError) as caught:
        MockSource(path)
    assert isinstance(caught.value, SourceConfigError)  # the CLI exits with status 2
    assert caught.value.path == path
    assert str(caught.value).startswith(f"{path}: ")
    assert reason in str(caught.value)


def test_a_missing_file_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(MockConfigError, match=r"nope\.toml: cannot read the file"):
        MockSource(tmp_path / "nope.toml")


def test_the_mock_file_is_read_as_every_named_file_is_read(tmp_path: Path) -> None:
    """A FIFO nobody writes (an open would wait for a writer), a link to ``/dev/zero`` (a read
    without end), a file over 1 MiB or not UTF-8: one line naming the file, at once."""
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.toml"
    zero.symlink_to("/dev/zero")
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (MAX_FILE_BYTES + 1))
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe")
    cases = {fifo: "not a regular file", zero: "not a regular file", big: f"larger than {MAX_FILE_BYTES} bytes",
             binary: "not UTF-8 text", tmp_path / "nope.toml": "cannot read the file (No such file or directory)"}
    started = time.monotonic()
    for path, reason in cases.items():
        with pytest.raises(MockConfigError) as caught:
            MockSource(path)
        assert str(caught.value) == f"{path}: {reason}"
    assert time.monotonic() - started < 5
