"""A fake ``libnvidia-ml`` under the real ``pynvml`` binding.

:class:`FakeNvml` is a named, realistic machine; ``with fake.installed():`` puts a library object
in ``pynvml.nvmlLib`` so that every ``pynvml`` function runs its real code (ctypes structs,
version fields, two-call size probes, error classes) and ends in a C-level call answered here:
``byref`` out-parameters are written through ``._obj``, handles are addresses, and a symbol the
fake lacks raises ``AttributeError``, which the binding turns into ``NVMLError_FunctionNotFound``
exactly as an older driver does.

Presets: :meth:`FakeNvml.dgx_a100` (8× A100-SXM4-40GB, driver 550.54.15, GPUs 6 and 7 in MIG
mode), :meth:`FakeNvml.h100_node` (8× H100 80GB HBM3, driver 570, GPU 0 in MIG mode) and
:meth:`FakeNvml.v100_old_driver` (4× V100, driver 470: no v2/v3/V calls, retired pages).
:meth:`FakeNvml.from_mock_file` builds the machine a mock device file describes
(:mod:`exporter.telemetry.nvml.mockfile`, ``--telemetry.source mock``): its values follow the
file's patterns on the machine's clock, quantised to NVML's units (%, °C, mW, MHz); what the file
does not describe (ECC, clocks-event reasons, PCIe counters, XID events, an unknown process list,
the geometry of a MIG layout it does not give) answers NOT_SUPPORTED or, for the geometry,
NO_PERMISSION.

The same machine also answers the CUDA driver API (``libcuda.so.1``) through
:class:`FakeCudaDriver`, which ``installed()`` puts where :mod:`exporter.telemetry.nvml.cuda` loads
the library: ``cuInit`` / ``cuDeviceGetCount`` / ``cuDeviceGet`` / ``cuDeviceGetAttribute`` (SM count) /
``cuDeviceGetPCIBusId`` / ``cuDeviceGetUuid[_v2]`` / ``cuDeviceTotalMem_v2``, with CUresult codes
and out-parameters written through ``byref``. CUDA enumerates the GPUs that are not in MIG mode,
ordered by PCI bus id (``CUDA_DEVICE_ORDER`` default ``FASTEST_FIRST`` may differ from NVML's
order on a real node; matching is by UUID or bus id, never by ordinal), and reports the memory
NVML does not keep for itself (total minus reserved). ``cuda_state``: ``"ok"``, ``"missing"``
(no ``libcuda.so.1``: loading raises ``OSError``), ``"no_device"`` (``cuInit`` answers
``CUDA_ERROR_NO_DEVICE``, as in a container without device nodes) or ``"insufficient_driver"``
(``CUDA_ERROR_INSUFFICIENT_DRIVER``); an unloaded driver also answers ``CUDA_ERROR_NO_DEVICE``.

Faults: :meth:`lose` (GPU_IS_LOST), :meth:`set_unsupported` (per call or ``"*"``),
:meth:`set_absent` (older driver), :meth:`hang` (blocks until released), :meth:`fail` (any code),
``unprivileged`` (NO_PERMISSION on MIG geometry and parent aggregates), :meth:`unload_driver` /
:meth:`load_driver`, ``driver_state = "rm_mismatch"``, :meth:`push_xid` (the event queue; an
event may name a GPU instance), :meth:`configure_mig` (runtime reconfiguration, legal placements
only), :meth:`reset` (a GPU reset: the device answers again with its energy and volatile state
restarted). A process whose PID no longer exists is just a :meth:`set_processes` entry: NVML
keeps listing a context whose process died until the driver tears it down.

Sampling: like a real driver, the machine samples each GPU once per ``sample_period_us``
(default 166,667 µs, the 1/6 s of datacenter GPUs; timestamps are µs of the machine's clock,
ticks at whole multiples of the period) into bounded ring buffers of ``sample_buffer`` periods
(default 120, 20 s): a GPU-utilisation sample per period (``nvmlDeviceGetSamples`` with
``NVML_GPU_UTILIZATION_SAMPLES``) and a per-process sample for each process that ran in it
(``nvmlDeviceGetProcessUtilization``, ``nvmlDeviceGetProcessesUtilizationInfo``). A GPU holds
its utilisation, power and per-process SM shares constant over each period at the value they have
at the period's start (a field set by :meth:`update` takes effect from the next period; a
pattern is evaluated at each period's start), so a sample's value times its period is exactly
the generated ∫ util dt. A reader later than the buffer finds the oldest samples gone; one that
asks for samples newer than the newest gets ``NOT_FOUND``. The buffers start full (the driver was
running before the reader came), and a driver reload empties them. The energy counter
(``nvmlDeviceGetTotalEnergyConsumption``) is ∫ power dt of the same signal, continuous,
monotonic, restarted by :meth:`reset` and by a driver reload (:meth:`load_driver`).
"""

from __future__ import annotations

import ctypes
import functools
import re
import threading
import time
import uuid as uuidlib
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pynvml

from exporter.telemetry.mig import BUILTIN_TABLES, GpuInstance, MigProfile, creatable_instances
from exporter.telemetry.nvml import cuda as cuda_module

if TYPE_CHECKING:
    from exporter.telemetry.nvml.mockfile import MockGpu, MockMachine, MockMigDevice

GIB = 1024**3
MIB = 1024**2
SUCCESS = pynvml.NVML_SUCCESS
UNINITIALIZED = pynvml.NVML_ERROR_UNINITIALIZED
INVALID_ARGUMENT = pynvml.NVML_ERROR_INVALID_ARGUMENT
NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
NO_PERMISSION = pynvml.NVML_ERROR_NO_PERMISSION
NOT_FOUND = pynvml.NVML_ERROR_NOT_FOUND
INSUFFICIENT_SIZE = pynvml.NVML_ERROR_INSUFFICIENT_SIZE
DRIVER_NOT_LOADED = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
TIMEOUT = pynvml.NVML_ERROR_TIMEOUT
GPU_IS_LOST = pynvml.NVML_ERROR_GPU_IS_LOST
LIB_RM_VERSION_MISMATCH = pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH
ARGUMENT_VERSION_MISMATCH = pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
UNKNOWN = pynvml.NVML_ERROR_UNKNOWN
NO_ID = 0xFFFFFFFF
NOT_AVAILABLE = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value  # a process's memory NVML cannot tell

# Calls that still work on a GPU whose every metric is NOT_SUPPORTED.
IDENTITY_CALLS = frozenset(
    {
        "nvmlDeviceGetHandleByIndex_v2",
        "nvmlDeviceGetHandleByUUID",
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetName",
        "nvmlDeviceGetPciInfo_v3",
        "nvmlDeviceGetIndex",
        "nvmlDeviceGetMinorNumber",
    }
)
# What a MIG device handle answers; anything else is NOT_SUPPORTED on it.
MIG_HANDLE_CALLS = frozenset(
    {
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetName",
        "nvmlDeviceGetIndex",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetMemoryInfo_v2",
        "nvmlDeviceGetGpuInstanceId",
        "nvmlDeviceGetComputeInstanceId",
        "nvmlDeviceGetAttributes_v2",
        "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
        "nvmlDeviceIsMigDeviceHandle",
    }
)
# Calls that need the mig/monitor capability (nvml.h: "Requires privileged user").
GEOMETRY_CALLS = frozenset(
    {
        "nvmlDeviceGetGpuInstanceProfileInfo",
        "nvmlDeviceGetGpuInstanceProfileInfoV",
        "nvmlDeviceGetGpuInstances",
        "nvmlDeviceGetGpuInstancePossiblePlacements_v2",
        "nvmlDeviceGetGpuInstanceRemainingCapacity",
        "nvmlGpuInstanceGetInfo",
    }
)
# Symbols a driver of that branch lacks (each call arrived in a later driver branch).
ABSENT_BEFORE_R570 = frozenset({"nvmlDeviceGetTemperatureV"})
ABSENT_IN_R470 = ABSENT_BEFORE_R570 | {
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetSupportedClocksEventReasons",
    "nvmlDeviceGetNumaNodeId",
    "nvmlDeviceGetProcessesUtilizationInfo",
}
SAMPLE_PERIOD_US = 166_667  # the driver's sampling period, µs (1/6 s)
SAMPLE_BUFFER = 120  # sampling periods the driver's ring buffers keep (20 s)
_NJ_PER_MJ = 1_000_000  # energy is kept in mW x µs = nJ, reported in mJ


class _Return(Exception):
    """Raised inside an implementation to answer with an NVML return code."""

    def __init__(self, code: int) -> None:
        self.code = code


# What NVML reports of a GPU-instance profile beyond its geometry (exporter.telemetry.mig):
# (MiB, SMs) by profile ID as `nvidia-smi mig -lgip` lists them.
_PROFILE_SIZES = {
    "A100-40GB": {19: (4864, 14), 20: (4864, 14), 15: (9856, 14), 14: (9856, 28), 9: (19968, 42), 5: (19968, 56), 0: (40192, 98)},
    "A100-80GB": {19: (9728, 14), 20: (9728, 14), 15: (19968, 14), 14: (19968, 28), 9: (40192, 42), 5: (40192, 56), 0: (81152, 98)},
    "H100-80GB": {19: (9984, 16), 20: (9984, 16), 15: (20096, 26), 14: (20096, 32), 9: (40448, 60), 5: (40448, 64), 0: (81152, 132)},
}
# NVML_GPU_INSTANCE_PROFILE_<n>_SLICE by compute slices; "+me" profiles are the *_REV1 ones, a
# one-slice profile with two memory slices is 1_SLICE_REV2.
_SLICE_INDEX = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}
_REV1_INDEX, _REV2_INDEX = {1: 7, 2: 8}, 9


@dataclass(frozen=True)
class FakeProfile:
    """A GPU-instance profile as NVML describes it (``nvmlDeviceGetGpuInstanceProfileInfoV``)."""

    index: int
    profile_id: int
    name: str
    slices: int  # compute slices
    memory_slices: int
    instance_count: int
    starts: tuple[int, ...]
    memory_mib: int
    multiprocessors: int


def _profile_index(p: MigProfile) -> int:
    if p.name.endswith("+me"):
        return _REV1_INDEX[p.compute_slices]
    if p.compute_slices == 1 and p.memory_slices == 2:
        return _REV2_INDEX
    return _SLICE_INDEX[p.compute_slices]


def _estimated_sizes(sku: str) -> dict[int, tuple[int, int]]:
    """(MiB, SMs) by profile ID of a SKU without a measured ``-lgip`` table: memory from the name's
    nominal GB (real sizes sit a few % below it), SMs as the H100's profile of the same ID on an
    8-slice SKU, else 14 per compute slice (A30)."""
    table, hopper = BUILTIN_TABLES[sku], _PROFILE_SIZES["H100-80GB"]
    sizes = {}
    for p in table.profiles:
        nominal_gb = int(re.search(r"\.(\d+)gb", p.name).group(1))  # type: ignore[union-attr]
        sms = hopper[p.profile_id][1] if table.memory_slices == 8 else 14 * p.compute_slices
        sizes[p.profile_id] = (int(nominal_gb * 1e9) // MIB, sms)
    return sizes


@functools.cache
def mig_profiles(sku: str) -> tuple[FakeProfile, ...]:
    """The GPU-instance profiles of a SKU of :data:`exporter.telemetry.mig.BUILTIN_TABLES`."""
    sizes = _PROFILE_SIZES.get(sku) or _estimated_sizes(sku)
    return tuple(
        FakeProfile(_profile_index(p), p.profile_id, p.name, p.compute_slices, p.memory_slices,
                    p.max_instances, p.starts, *sizes[p.profile_id])
        for p in BUILTIN_TABLES[sku].profiles
    )


@dataclass
class FakeCi:
    ci_id: int
    slices: int  # compute slices
    mig_index: int
    uuid: str
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, used bytes or None)
    profile: str | None = None  # the name's profile when it is not the GI's (a mock device file's)
    multiprocessors: int | None = None  # None: the GI profile's share


@dataclass
class FakeGi:
    gi_id: int
    spec: FakeProfile
    start: int
    memory_used: int
    cis: list[FakeCi] = field(default_factory=list)
    memory_total: int | None = None  # bytes; None: the profile's size
    patterns: dict[str, Callable[[float], int]] = field(default_factory=dict)  # as FakeGpu.patterns


@dataclass
class FakeGpu:
    index: int
    uuid: str
    name: str
    pci_bus_id: str
    pci_device_id: int
    serial: str | None
    numa_node: int
    memory_total: int
    memory_reserved: int
    memory_used: int  # excluding reserved (v2 semantics)
    util_gpu: int = 0  # %
    util_memory: int = 0
    temperature: int = 35  # °C
    power_mw: int = 60_000
    power_limit_mw: int = 400_000
    energy_mj: int = 1_000_000  # the counter at the fake's clock start
    sm_clock: int = 1410  # MHz
    mem_clock: int = 1215
    fan: int | None = None  # %; None: passively cooled
    pcie_rx_kbs: int = 1200
    pcie_tx_kbs: int = 800
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    remapped_rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)  # None: pre-Ampere
    retired_pages: tuple[list[int], list[int]] | None = None  # (single-bit, double-bit); None: Ampere+
    retired_pending: int = 0
    clocks_event: int = 0x1
    clocks_supported: int = 0x1FF
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, used bytes or None)
    process_sm: dict[int, int] = field(default_factory=dict)  # pid -> SM % it uses; sampled while above 0
    mig_sku: str | None = None  # a key of exporter.telemetry.mig.BUILTIN_TABLES; None: not MIG-capable
    mig_current: bool = False
    mig_pending: bool = False
    gis: list[FakeGi] = field(default_factory=list)
    multiprocessors: int | None = None  # SMs as CUDA reports them; None: CUDA does not list it
    lost: bool = False
    lost_handle_code: int = GPU_IS_LOST  # what GetHandleByIndex answers once lost
    unsupported: set[str] = field(default_factory=set)
    denied: set[str] = field(default_factory=set)  # C symbols answering NO_PERMISSION on this GPU
    registered_events: int = 0
    # Field name -> its value at a clock reading (seconds), in the field's unit: every call about
    # this GPU first brings these fields to the clock (a mock device file's patterns).
    patterns: dict[str, Callable[[float], Any]] = field(default_factory=dict)
    advanced_at: float | None = None
    # The driver's sampling (see "Sampling" above): the open period's start (in periods since the
    # clock's zero) and its (util %, power mW, pid -> SM % of the processes that ran) fixed then,
    # the ring buffers of (µs, %) and (µs, {pid: %}) samples, and the energy counter at the open
    # period's start in nJ (mW x µs).
    tick: int = 0
    period_values: tuple[int, int, dict[int, int]] = (0, 0, {})
    util_ring: deque[tuple[int, int]] = field(default_factory=deque)
    process_ring: deque[tuple[int, dict[int, int]]] = field(default_factory=deque)
    energy_nj: int = 0

    def cis(self) -> Iterator[tuple[FakeGi, FakeCi]]:
        for gi in self.gis:
            for ci in gi.cis:
                yield gi, ci


@dataclass
class Fault:
    """An injected error or hang on one call (on one GPU, or on all when ``index`` is None)."""

    symbol: str
    index: int | None
    code: int | None  # None: hang until released, then answer normally
    entered: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        self.released.set()


_GPU_BASE, _GPU_STRIDE, _MIG_OFFSET, _GI_OFFSET = 0x10000, 0x1000, 0x100, 0x400
_EVENT_SET = 0x900000


def _val(arg: Any) -> Any:
    return arg.value if hasattr(arg, "value") else arg


def _addr(handle: Any) -> int | None:
    return ctypes.cast(handle, ctypes.c_void_p).value


def _write_handle(ref: Any, address: int) -> None:
    ctypes.cast(ctypes.addressof(ref._obj), ctypes.POINTER(ctypes.c_void_p))[0] = address


def _pointer(kind: Any, address: int) -> Any:
    return ctypes.cast(ctypes.c_void_p(address), kind)


class _FakeLib:
    """What ``pynvml.nvmlLib`` holds: C symbols resolved by ``getattr``."""

    def __init__(self, machine: FakeNvml) -> None:
        self._machine = machine

    def __getattr__(self, symbol: str) -> Callable[..., int]:
        return self._machine._symbol(symbol)


class FakeNvml:
    """A machine with GPUs, answering NVML's C calls. Thread-safe; hangs block outside the lock."""

    def __init__(
        self,
        gpus: list[FakeGpu],
        *,
        driver_version: str | None,
        cuda_version: int | None,
        absent: frozenset[str] = frozenset(),
        clock: Callable[[], float] = time.monotonic,
        sample_period_us: int = SAMPLE_PERIOD_US,
        sample_buffer: int = SAMPLE_BUFFER,
    ) -> None:
        self.gpus = gpus
        self.driver_version = driver_version
        self.cuda_version = cuda_version
        self.absent = set(absent)
        self.driver_state = "ok"  # "ok", "not_loaded", "rm_mismatch"
        self.cuda_state = "ok"  # "ok", "missing", "no_device", "insufficient_driver"
        self.unprivileged = False
        self.max_event_wait_ms = 20  # clamps nvmlEventSetWait so tests stay fast
        self.calls: Counter[str] = Counter()
        self._clock = clock
        self._epoch = clock()
        self._refcount = 0
        self._faults: list[Fault] = []
        self._lock = threading.RLock()
        self._events = threading.Condition()
        self._event_queue: list[tuple[int, int, int | None]] = []  # (gpu index, xid, GPU instance)
        self._mig_serial = 0
        if sample_period_us < 1 or sample_buffer < 1:
            raise ValueError("sample_period_us and sample_buffer must be at least 1")
        self.sample_period_us, self.sample_buffer = sample_period_us, sample_buffer
        for gpu in gpus:
            self._start_sampling(gpu, self._epoch, gpu.energy_mj, history=True)

    # -- presets ---------------------------------------------------------------------------

    @classmethod
    def dgx_a100(cls, clock: Callable[[], float] = time.monotonic) -> FakeNvml:
        """8× A100-SXM4-40GB as in a DGX A100; GPU 6 MIG 3g.20gb@0 + 2g.10gb@4 + 1g.5gb@6,
        GPU 7 MIG 7× 1g.5gb@0…6 (slice 7 stranded)."""
        buses = ("07", "0F", "47", "4E", "87", "90", "B7", "BD")
        numa = (3, 3, 1, 1, 7, 7, 5, 5)
        gpus = []
        for i in range(8):
            busy = i in (0, 1, 2)
            gpus.append(
                FakeGpu(
                    index=i,
                    uuid=_uuid("dgx-a100", i),
                    name="NVIDIA A100-SXM4-40GB",
                    pci_bus_id=f"00000000:{buses[i]}:00.0",
                    pci_device_id=0x20B010DE,
                    serial=f"15639200{i:05d}",
                    numa_node=numa[i],
                    memory_total=40 * GIB,
                    memory_reserved=512 * MIB,
                    memory_used=(12 + 3 * i) * GIB if busy else 4 * MIB,
                    util_gpu=(97, 64, 31)[i] if busy else 0,
                    util_memory=(58, 40, 12)[i] if busy else 0,
                    temperature=(61, 52, 44)[i] if busy else 31 + i,
                    power_mw=(362_000, 251_000, 148_000)[i] if busy else 52_000 + 1000 * i,
                    sm_clock=1410 if busy else 210,
                    ecc_corrected=12 if i == 5 else 0,
                    remapped_rows=(2, 0, 0, 0) if i == 3 else (0, 0, 0, 0),
                    clocks_event=0x4 if i == 2 else (0x0 if busy else 0x1),
                    processes={0: [(4101, 12 * GIB), (4102, 3 * GIB)], 1: [(5120, 15 * GIB)]}.get(i, []),
                    process_sm={0: {4101: 61, 4102: 33}, 1: {5120: 64}}.get(i, {}),
                    mig_sku="A100-40GB",
                    multiprocessors=108,
                )
            )
        fake = cls(gpus, driver_version="550.54.15", cuda_version=12040, absent=ABSENT_BEFORE_R570, clock=clock)
        fake.configure_mig(6, [("3g.20gb", 0), ("2g.10gb", 4), ("1g.5gb", 6)])
        fake.configure_mig(7, [("1g.5gb", start) for start in range(7)])
        fake.set_processes(6, [(6100, 8 * GIB)], mig_index=0)
        return fake

    @classmethod
    def h100_node(cls, clock: Callable[[], float] = time.monotonic) -> FakeNvml:
        """8× H100 80GB HBM3 as in a DGX H100, driver 570; GPU 0 MIG 1g.10gb@0, 1g.10gb@1,
        2g.20gb@2, 3g.40gb@4."""
        buses = ("18", "2A", "3A", "5D", "9A", "AB", "BA", "DB")
        gpus = [
            FakeGpu(
                index=i,
                uuid=_uuid("h100", i),
                name="NVIDIA H100 80GB HBM3",
                pci_bus_id=f"00000000:{buses[i]}:00.0",
                pci_device_id=0x233010DE,
                serial=f"16522230{i:05d}",
                numa_node=i // 4,
                memory_total=81559 * MIB,
                memory_reserved=569 * MIB,
                memory_used=(40 + i) * GIB if i % 2 else 2 * MIB,
                util_gpu=88 if i % 2 else 0,
                util_memory=51 if i % 2 else 0,
                temperature=58 if i % 2 else 30,
                power_mw=612_000 if i % 2 else 71_000,
                power_limit_mw=700_000,
                sm_clock=1980 if i % 2 else 345,
                mem_clock=2619,
                clocks_event=0x0 if i % 2 else 0x1,
                processes=[(7000 + i, (40 + i) * GIB)] if i % 2 else [],
                mig_sku="H100-80GB",
                multiprocessors=132,
            )
            for i in range(8)
        ]
        fake = cls(gpus, driver_version="570.124.06", cuda_version=12080, clock=clock)
        fake.configure_mig(0, [("1g.10gb", 0), ("1g.10gb", 1), ("2g.20gb", 2), ("3g.40gb", 4)])
        return fake

    @classmethod
    def v100_old_driver(cls, clock: Callable[[], float] = time.monotonic) -> FakeNvml:
        """4× Tesla V100-SXM2-32GB on driver 470: no MIG, no remapped rows, retired pages instead,
        and none of the v2/v3/V calls newer drivers have."""
        gpus = [
            FakeGpu(
                index=i,
                uuid=_uuid("v100", i),
                name="Tesla V100-SXM2-32GB",
                pci_bus_id=f"00000000:{0x15 + i:02X}:00.0",
                pci_device_id=0x1DB510DE,
                serial=f"03231180{i:05d}",
                numa_node=i // 2,
                memory_total=32 * GIB,
                memory_reserved=0,
                memory_used=(9 * GIB if i == 0 else 300 * MIB),
                util_gpu=71 if i == 0 else 0,
                power_limit_mw=300_000,
                sm_clock=1530,
                mem_clock=877,
                remapped_rows=None,
                retired_pages=([0x1F000, 0x2A000], [0x3B000]) if i == 1 else ([], []),
                retired_pending=1 if i == 1 else 0,
                processes=[(3100, 9 * GIB)] if i == 0 else [],
                multiprocessors=80,
            )
            for i in range(4)
        ]
        return cls(gpus, driver_version="470.82.01", cuda_version=11040, absent=ABSENT_IN_R470, clock=clock)

    @classmethod
    def from_mock_file(
        cls,
        machine: MockMachine,
        clock: Callable[[], float] = time.time,
        *,
        sample_period_us: int = SAMPLE_PERIOD_US,
        sample_buffer: int = SAMPLE_BUFFER,
    ) -> FakeNvml:
        """The machine a mock device file describes (:func:`exporter.telemetry.nvml.mockfile.parse_mock_file`).

        Each GPU's values follow the file's patterns on ``clock`` (seconds since the epoch), read
        at each call and quantised as NVML reports them; its energy counter starts at 0 now and
        integrates the power drawn. A GPU with MIG devices is in MIG mode with one GPU instance
        per ``gpu_instance_id``; its geometry is readable only where the file places every device
        on a SKU whose profiles this library knows, else it answers NO_PERMISSION, as to a reader
        without the mig/monitor capability. The driver has no XID events to report.
        """
        gpus = [_mock_gpu(index, gpu) for index, gpu in enumerate(machine.gpus)]
        cuda = None
        if machine.cuda_version is not None:  # "12.4" -> 12040, as cudaDriverGetVersion counts
            major, minor = machine.cuda_version.split(".")[:2]
            cuda = int(major) * 1000 + int(minor) * 10
        fake = cls(gpus, driver_version=machine.driver_version, cuda_version=cuda, clock=clock,
                   sample_period_us=sample_period_us, sample_buffer=sample_buffer)
        for gpu in gpus:
            fake._advance(gpu, fake._epoch)  # the values at the epoch, before any energy is drawn
        return fake

    # -- installation and controls ---------------------------------------------------------

    @contextmanager
    def installed(self) -> Iterator[FakeNvml]:
        """Make this machine the ``libnvidia-ml`` behind ``pynvml`` for the duration."""
        saved, saved_cuda = pynvml.nvmlLib, cuda_module._load_libcuda
        pynvml.nvmlLib = _FakeLib(self)
        pynvml._nvmlGetFunctionPointer_cache.clear()
        cuda_module._load_libcuda = self.load_libcuda
        try:
            yield self
        finally:
            for fault in self._faults:
                fault.release()  # lets threads stuck in a hang finish
            pynvml.nvmlLib = saved
            pynvml._nvmlGetFunctionPointer_cache.clear()
            cuda_module._load_libcuda = saved_cuda

    def load_libcuda(self) -> FakeCudaDriver:
        """What ``ctypes.CDLL("libcuda.so.1")`` gives on this machine."""
        if self.cuda_state == "missing":
            raise OSError("libcuda.so.1: cannot open shared object file: No such file or directory")
        return FakeCudaDriver(self)

    def lose(self, index: int, handle_code: int = GPU_IS_LOST) -> None:
        """GPU ``index`` falls off the bus: every call on it fails from now on."""
        with self._lock:
            self.gpus[index].lost = True
            self.gpus[index].lost_handle_code = handle_code

    def recover(self, index: int) -> None:
        with self._lock:
            self.gpus[index].lost = False

    def set_unsupported(self, index: int, *symbols: str) -> None:
        """Answer NOT_SUPPORTED for these C symbols on GPU ``index``; ``"*"``: every metric call."""
        with self._lock:
            self.gpus[index].unsupported.update(symbols)

    def set_absent(self, *symbols: str) -> None:
        """Remove symbols from the library (an older driver)."""
        with self._lock:
            self.absent.update(symbols)
        pynvml._nvmlGetFunctionPointer_cache.clear()

    def fail(self, symbol: str, code: int, index: int | None = None) -> Fault:
        """Answer ``code`` for ``symbol`` (on GPU ``index``) until :meth:`clear_faults`."""
        fault = Fault(symbol, index, code)
        with self._lock:
            self._faults.append(fault)
        return fault

    def hang(self, symbol: str, index: int | None = None) -> Fault:
        """Block calls of ``symbol`` (on GPU ``index``) until ``fault.release()``."""
        fault = Fault(symbol, index, None)
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self._lock:
            for fault in self._faults:
                fault.release()
            self._faults.clear()

    def unload_driver(self) -> None:
        """The kernel module goes away: open sessions end, ``nvmlInit`` fails until reloaded."""
        with self._lock:
            self.driver_state = "not_loaded"
            self._refcount = 0
        with self._events:
            self._events.notify_all()

    def load_driver(self) -> None:
        """The kernel module is back: its sample buffers start empty and the energy counters at 0."""
        with self._lock:
            reloaded = self.driver_state == "not_loaded"
            self.driver_state = "ok"
            if reloaded:
                now = self._clock()
                for gpu in self.gpus:
                    self._start_sampling(gpu, now, 0, history=False)

    def push_xid(self, index: int, xid: int, gpu_instance_id: int | None = None) -> None:
        """Queue an XID critical-error event from GPU ``index``; ``gpu_instance_id``: the GPU
        instance it concerns (None: the whole GPU)."""
        with self._events:
            self._event_queue.append((index, xid, gpu_instance_id))
            self._events.notify_all()

    def reset(self, index: int) -> None:
        """Reset GPU ``index`` (``nvidia-smi -r``): it answers again, its energy counter and the
        volatile state restart (pending row remaps take effect, pending retirements are done)."""
        with self._lock:
            gpu = self.gpus[index]
            gpu.lost = False
            now = self._clock()
            self._generate(gpu, now)
            gpu.energy_nj -= self._energy_nj(gpu, now)  # the counter reads 0 now
            if gpu.remapped_rows is not None:
                correctable, uncorrectable, _, failure = gpu.remapped_rows
                gpu.remapped_rows = (correctable, uncorrectable, 0, failure)
            gpu.retired_pending = 0

    def set_processes(self, index: int, processes: list[tuple[int, int]], mig_index: int | None = None) -> None:
        with self._lock:
            gpu = self.gpus[index]
            if mig_index is None:
                gpu.processes = list(processes)
            else:
                ci = next(ci for _, ci in gpu.cis() if ci.mig_index == mig_index)
                ci.processes = list(processes)

    def configure_mig(self, index: int, layout: list[tuple[str, int]]) -> None:
        """Enable MIG on GPU ``index`` and replace its GPU instances by ``(profile, start)`` pairs,
        each with one full-width compute instance. Rejects illegal or overlapping placements."""
        with self._lock:
            gpu = self.gpus[index]
            assert gpu.mig_sku is not None, f"{gpu.name} is not MIG-capable"
            specs = {spec.name: spec for spec in mig_profiles(gpu.mig_sku)}
            gis: list[FakeGi] = []
            occupied = 0
            for gi_id, (profile, start) in enumerate(layout, start=1):
                spec = specs[profile]
                mask = ((1 << spec.memory_slices) - 1) << start
                if start not in spec.starts or occupied & mask:
                    raise ValueError(f"{profile} does not fit at {start}")
                occupied |= mask
                self._mig_serial += 1
                ci = FakeCi(0, spec.slices, gi_id - 1, _uuid(f"mig/{gpu.uuid}/{self._mig_serial}", gi_id, "MIG-"))
                gis.append(FakeGi(gi_id, spec, start, spec.memory_mib * MIB // 4, [ci]))
            gpu.gis = gis
            gpu.mig_current = gpu.mig_pending = True

    def disable_mig(self, index: int) -> None:
        with self._lock:
            gpu = self.gpus[index]
            gpu.gis = []
            gpu.mig_current = gpu.mig_pending = False

    def update(self, index: int, **values: Any) -> None:
        """Set fields of GPU ``index`` (``util_gpu``, ``memory_used``, ``temperature``, ``power_mw``,
        ``clocks_event``, ``ecc_corrected``, ``remapped_rows``, ``process_sm``…) in one step, so no
        call sees half a change. Calls answer the new values at once; the samples and the energy
        counter take ``util_gpu``, ``power_mw`` and ``process_sm`` from the next sampling period on
        (the period under way keeps the value it started with), so the counter stays continuous."""
        with self._lock:
            gpu = self.gpus[index]
            unknown = [name for name in values if not hasattr(gpu, name)]
            if unknown:
                raise AttributeError(f"FakeGpu has no field {unknown[0]!r}")
            self._set(gpu, values, self._clock())

    def _set(self, gpu: FakeGpu, values: dict[str, Any], now: float) -> None:
        self._generate(gpu, now)  # the periods that ended so far keep the values they had
        for name, value in values.items():
            setattr(gpu, name, value)

    # -- sampling --------------------------------------------------------------------------

    def _period_values(self, gpu: FakeGpu, t: float) -> tuple[int, int, dict[int, int]]:
        """(util %, power mW, pid -> SM % of the processes that ran) for a period starting at ``t``
        seconds: each field's pattern at ``t``, else its value now."""
        p = gpu.patterns
        util = p["util_gpu"](t) if "util_gpu" in p else gpu.util_gpu
        power = p["power_mw"](t) if "power_mw" in p else gpu.power_mw
        sm = p["process_sm"](t) if "process_sm" in p else gpu.process_sm
        return util, power, {pid: value for pid, value in sm.items() if value > 0}

    def _start_sampling(self, gpu: FakeGpu, now: float, energy_mj: int, *, history: bool) -> None:
        """(Re)start a GPU's sampling at ``now`` with the energy counter reading ``energy_mj`` then;
        ``history``: the buffers hold the periods before ``now`` as if the driver had sampled them."""
        period = self.sample_period_us
        gpu.tick = _microseconds(now) // period
        gpu.util_ring = deque(maxlen=self.sample_buffer)
        gpu.process_ring = deque(maxlen=self.sample_buffer)
        if history:
            for k in range(gpu.tick - self.sample_buffer + 1, gpu.tick + 1):
                util, _, sm = self._period_values(gpu, (k - 1) * period / 1e6)
                gpu.util_ring.append((k * period, util))
                gpu.process_ring.append((k * period, sm))
        gpu.period_values = self._period_values(gpu, gpu.tick * period / 1e6)
        gpu.energy_nj = 0
        gpu.energy_nj = energy_mj * _NJ_PER_MJ - self._energy_nj(gpu, now)

    def _generate(self, gpu: FakeGpu, now: float) -> None:
        """Sample every period that ended by ``now`` into the ring buffers and the energy counter."""
        period, last = self.sample_period_us, _microseconds(now) // self.sample_period_us
        # Periods older than the buffers keep only count for energy; without patterns their values
        # are the current ones, so they are skipped in one step.
        oldest_kept = last - self.sample_buffer + 1
        steady = not any(name in gpu.patterns for name in ("util_gpu", "power_mw", "process_sm"))
        util, power, sm = gpu.period_values
        k = gpu.tick
        while k < last:
            if steady and k + 1 < oldest_kept:
                skipped = oldest_kept - 1 - k
                gpu.energy_nj += power * period * skipped
                k += skipped
                continue
            k += 1
            gpu.energy_nj += power * period
            if k >= oldest_kept:
                gpu.util_ring.append((k * period, util))
                gpu.process_ring.append((k * period, sm))
            util, power, sm = self._period_values(gpu, k * period / 1e6)
        if last > gpu.tick:
            gpu.tick, gpu.period_values = last, (util, power, sm)

    def _energy_nj(self, gpu: FakeGpu, now: float) -> int:
        """The energy counter at ``now`` (after :meth:`_generate`): the open period's power so far."""
        elapsed = max(0, _microseconds(now) - gpu.tick * self.sample_period_us)
        return gpu.energy_nj + gpu.period_values[1] * elapsed

    def samples(self, index: int) -> tuple[list[tuple[int, int]], list[tuple[int, dict[int, int]]]]:
        """What GPU ``index``'s sample buffers hold now: [(µs, util %)], [(µs, {pid: SM %})], oldest first."""
        with self._lock:
            gpu = self.gpus[index]
            self._generate(gpu, self._clock())
            return list(gpu.util_ring), [(ts, dict(sm)) for ts, sm in gpu.process_ring]

    def _advance(self, gpu: FakeGpu, now: float | None = None) -> None:
        """Bring the sample buffers and the fields that follow patterns to the clock (under the lock)."""
        now = self._clock() if now is None else now
        self._generate(gpu, now)
        if not gpu.patterns and not any(gi.patterns for gi in gpu.gis):
            return
        if now == gpu.advanced_at:
            return
        self._set(gpu, {name: value(now) for name, value in gpu.patterns.items()}, now)
        for gi in gpu.gis:
            for name, value in gi.patterns.items():
                setattr(gi, name, value(now))
        gpu.advanced_at = now

    def set_mig_memory(self, index: int, mig_index: int, used: int) -> None:
        """Memory used in the GPU instance of MIG device ``mig_index`` of GPU ``index``, in bytes."""
        with self._lock:
            gi = next(gi for gi, ci in self.gpus[index].cis() if ci.mig_index == mig_index)
            gi.memory_used = used

    # -- dispatch --------------------------------------------------------------------------

    def _symbol(self, symbol: str) -> Callable[..., int]:
        impl = getattr(self, f"_c_{symbol}", None)
        if impl is None or symbol in self.absent:
            raise AttributeError(symbol)

        def call(*args: Any) -> Any:
            return self._dispatch(symbol, impl, args)

        call.__name__ = symbol
        return call

    def _dispatch(self, symbol: str, impl: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        with self._lock:
            self.calls[symbol] += 1
            if symbol not in ("nvmlInitWithFlags", "nvmlErrorString") and self._refcount == 0:
                return UNINITIALIZED
            gpu, on_mig = self._target(symbol, args)
            if gpu is not None:
                self._advance(gpu)
            faults = [f for f in self._faults if f.symbol == symbol and (f.index is None or (gpu and gpu.index == f.index))]
        for fault in faults:
            if fault.code is not None:
                return fault.code
            fault.entered.set()
            fault.released.wait()
        try:
            if symbol == "nvmlEventSetWait_v2":  # waits on its own condition, not the machine lock
                return impl(*args) or SUCCESS
            with self._lock:
                if gpu is not None:
                    if gpu.lost:
                        return gpu.lost_handle_code if symbol == "nvmlDeviceGetHandleByIndex_v2" else GPU_IS_LOST
                    if symbol in gpu.unsupported or ("*" in gpu.unsupported and symbol not in IDENTITY_CALLS):
                        return NOT_SUPPORTED
                    if on_mig and symbol not in MIG_HANDLE_CALLS:
                        return NOT_SUPPORTED
                    if symbol in gpu.denied or (self.unprivileged and symbol in GEOMETRY_CALLS):
                        return NO_PERMISSION
                return impl(*args) or SUCCESS
        except _Return as answer:
            return answer.code

    def _target(self, symbol: str, args: tuple[Any, ...]) -> tuple[FakeGpu | None, bool]:
        """The GPU a call is about, and whether it came through a MIG device handle."""
        if symbol == "nvmlDeviceGetHandleByIndex_v2":
            index = _val(args[0])
            return (self.gpus[index] if index < len(self.gpus) else None), False
        if symbol.startswith(("nvmlDevice", "nvmlGpuInstance")) and symbol not in (
            "nvmlDeviceGetCount_v2",
            "nvmlDeviceGetHandleByUUID",
        ):
            found = self._resolve(_addr(args[0]))
            if found is not None:
                return found[0], found[1] is not None and not symbol.startswith("nvmlGpuInstance")
        return None, False

    def _resolve(self, address: int | None) -> tuple[FakeGpu, FakeCi | None, FakeGi | None] | None:
        if address is None or address < _GPU_BASE:
            return None
        index, offset = divmod(address - _GPU_BASE, _GPU_STRIDE)
        if index >= len(self.gpus):
            return None
        gpu = self.gpus[index]
        if offset == 0:
            return gpu, None, None
        for gi, ci in gpu.cis():
            if offset == _MIG_OFFSET + ci.mig_index:
                return gpu, ci, gi
        for gi in gpu.gis:
            if offset == _GI_OFFSET + gi.gi_id:
                return gpu, None, gi
        return None

    def _device(self, handle: Any) -> tuple[FakeGpu, FakeCi | None, FakeGi | None]:
        found = self._resolve(_addr(handle))
        if found is None:
            raise _Return(INVALID_ARGUMENT)
        return found

    @staticmethod
    def _address(gpu: FakeGpu, ci: FakeCi | None = None) -> int:
        return _GPU_BASE + gpu.index * _GPU_STRIDE + (_MIG_OFFSET + ci.mig_index if ci else 0)

    def _gpu_only(self, handle: Any) -> FakeGpu:
        gpu, ci, _ = self._device(handle)
        if ci is not None:
            raise _Return(NOT_SUPPORTED)
        return gpu

    def _aggregate_allowed(self, gpu: FakeGpu) -> None:
        # A MIG-enabled parent's memory and processes are aggregates over every GPU instance.
        if gpu.mig_current and self.unprivileged:
            raise _Return(NO_PERMISSION)

    # -- system ----------------------------------------------------------------------------

    def _c_nvmlInitWithFlags(self, flags: Any) -> int:
        if self.driver_state == "not_loaded":
            return DRIVER_NOT_LOADED
        if self.driver_state == "rm_mismatch":
            return LIB_RM_VERSION_MISMATCH
        self._refcount += 1
        return SUCCESS

    def _c_nvmlShutdown(self) -> int:
        self._refcount -= 1
        return SUCCESS

    def _c_nvmlErrorString(self, code: Any) -> bytes:
        return b"Unknown Error"  # the binding has its own strings for every code it raises here

    def _c_nvmlSystemGetDriverVersion(self, buf: Any, size: Any) -> int:
        if self.driver_version is None:
            return NOT_SUPPORTED
        buf.value = self.driver_version.encode()
        return SUCCESS

    def _c_nvmlSystemGetNVMLVersion(self, buf: Any, size: Any) -> int:
        if self.driver_version is None or self.cuda_version is None:
            return NOT_SUPPORTED
        buf.value = f"{self.cuda_version // 1000}.{self.driver_version}".encode()
        return SUCCESS

    def _c_nvmlSystemGetCudaDriverVersion(self, ref: Any) -> int:
        if self.cuda_version is None:
            return NOT_SUPPORTED
        ref._obj.value = self.cuda_version
        return SUCCESS

    def _c_nvmlDeviceGetCount_v2(self, ref: Any) -> None:
        ref._obj.value = len(self.gpus)

    # -- identity --------------------------------------------------------------------------

    def _c_nvmlDeviceGetHandleByIndex_v2(self, index: Any, ref: Any) -> int:
        index = _val(index)
        if index >= len(self.gpus):
            return INVALID_ARGUMENT
        _write_handle(ref, self._address(self.gpus[index]))
        return SUCCESS

    def _c_nvmlDeviceGetHandleByUUID(self, uuid: Any, ref: Any) -> int:
        wanted = _val(uuid).decode()
        for gpu in self.gpus:
            if gpu.uuid == wanted:
                _write_handle(ref, self._address(gpu))
                return SUCCESS
            for _, ci in gpu.cis():
                if ci.uuid == wanted:
                    _write_handle(ref, self._address(gpu, ci))
                    return SUCCESS
        return NOT_FOUND

    def _c_nvmlDeviceGetUUID(self, handle: Any, buf: Any, size: Any) -> None:
        gpu, ci, _ = self._device(handle)
        buf.value = (ci.uuid if ci else gpu.uuid).encode()

    def _c_nvmlDeviceGetName(self, handle: Any, buf: Any, size: Any) -> None:
        gpu, ci, gi = self._device(handle)
        if ci is None or gi is None:
            buf.value = gpu.name.encode()
        else:  # nvidia-smi's MIG device names: "<GPU> MIG 3g.20gb", or "1c.3g.20gb" for a partial CI
            profile = gi.spec.name if ci.slices == gi.spec.slices else f"{ci.slices}c.{gi.spec.name}"
            buf.value = f"{gpu.name} MIG {ci.profile or profile}".encode()

    def _c_nvmlDeviceGetPciInfo_v3(self, handle: Any, ref: Any) -> None:
        gpu = self._gpu_only(handle)
        info = ref._obj
        info.busId = gpu.pci_bus_id.encode()
        info.busIdLegacy = gpu.pci_bus_id[4:].encode()
        info.domain, info.bus = 0, int(gpu.pci_bus_id.split(":")[1], 16)
        info.pciDeviceId = gpu.pci_device_id

    def _c_nvmlDeviceGetSerial(self, handle: Any, buf: Any, size: Any) -> int:
        gpu = self._gpu_only(handle)
        if gpu.serial is None:
            return NOT_SUPPORTED
        buf.value = gpu.serial.encode()
        return SUCCESS

    def _c_nvmlDeviceGetIndex(self, handle: Any, ref: Any) -> None:
        gpu, ci, _ = self._device(handle)
        ref._obj.value = ci.mig_index if ci else gpu.index

    def _c_nvmlDeviceGetMinorNumber(self, handle: Any, ref: Any) -> None:
        ref._obj.value = self._gpu_only(handle).index

    def _c_nvmlDeviceGetNumaNodeId(self, handle: Any, ref: Any) -> None:
        ref._obj.value = self._gpu_only(handle).numa_node

    # -- metrics ---------------------------------------------------------------------------

    def _memory(self, handle: Any) -> tuple[int, int, int]:
        """(total, reserved, used excluding reserved) of a GPU, MIG device or MIG parent."""
        gpu, _, gi = self._device(handle)
        if gi is not None:
            return self._gi_memory(gi), 0, gi.memory_used
        self._aggregate_allowed(gpu)
        used = sum(gi.memory_used for gi in gpu.gis) if gpu.mig_current else gpu.memory_used
        return gpu.memory_total, gpu.memory_reserved, used

    @staticmethod
    def _gi_memory(gi: FakeGi) -> int:
        return gi.spec.memory_mib * MIB if gi.memory_total is None else gi.memory_total

    def _c_nvmlDeviceGetMemoryInfo(self, handle: Any, ref: Any) -> None:
        total, reserved, used = self._memory(handle)
        # The v1 struct counts the reserved memory as used (gpustat#141).
        ref._obj.total, ref._obj.used, ref._obj.free = total, used + reserved, total - used - reserved

    def _c_nvmlDeviceGetMemoryInfo_v2(self, handle: Any, ref: Any) -> int:
        if ref._obj.version != pynvml.nvmlMemory_v2:
            return ARGUMENT_VERSION_MISMATCH
        total, reserved, used = self._memory(handle)
        ref._obj.total, ref._obj.reserved, ref._obj.used = total, reserved, used
        ref._obj.free = total - reserved - used
        return SUCCESS

    def _c_nvmlDeviceGetUtilizationRates(self, handle: Any, ref: Any) -> int:
        gpu = self._gpu_only(handle)
        if gpu.mig_current:  # not supported on MIG-enabled GPUs
            return NOT_SUPPORTED
        ref._obj.gpu, ref._obj.memory = gpu.util_gpu, gpu.util_memory
        return SUCCESS

    def _c_nvmlDeviceGetTemperatureV(self, handle: Any, ref: Any) -> int:
        if ref._obj.version != pynvml.nvmlTemperature_v1:
            return ARGUMENT_VERSION_MISMATCH
        if ref._obj.sensorType != pynvml.NVML_TEMPERATURE_GPU:
            return NOT_SUPPORTED
        ref._obj.temperature = self._gpu_only(handle).temperature
        return SUCCESS

    def _c_nvmlDeviceGetTemperature(self, handle: Any, sensor: Any, ref: Any) -> int:
        if _val(sensor) != pynvml.NVML_TEMPERATURE_GPU:
            return NOT_SUPPORTED
        ref._obj.value = self._gpu_only(handle).temperature
        return SUCCESS

    def _c_nvmlDeviceGetPowerUsage(self, handle: Any, ref: Any) -> None:
        ref._obj.value = self._gpu_only(handle).power_mw

    def _c_nvmlDeviceGetEnforcedPowerLimit(self, handle: Any, ref: Any) -> None:
        ref._obj.value = self._gpu_only(handle).power_limit_mw

    def _c_nvmlDeviceGetPowerManagementLimit(self, handle: Any, ref: Any) -> None:
        ref._obj.value = self._gpu_only(handle).power_limit_mw

    def _c_nvmlDeviceGetTotalEnergyConsumption(self, handle: Any, ref: Any) -> None:
        gpu = self._gpu_only(handle)
        # ∫ power dt of the sampled signal (nJ), floored to whole mJ as the counter counts.
        ref._obj.value = self._energy_nj(gpu, self._clock()) // _NJ_PER_MJ

    def _c_nvmlDeviceGetClockInfo(self, handle: Any, clock_type: Any, ref: Any) -> int:
        gpu = self._gpu_only(handle)
        clocks = {pynvml.NVML_CLOCK_GRAPHICS: gpu.sm_clock, pynvml.NVML_CLOCK_SM: gpu.sm_clock, pynvml.NVML_CLOCK_MEM: gpu.mem_clock}
        if _val(clock_type) not in clocks:
            return INVALID_ARGUMENT
        ref._obj.value = clocks[_val(clock_type)]
        return SUCCESS

    def _c_nvmlDeviceGetFanSpeed(self, handle: Any, ref: Any) -> int:
        gpu = self._gpu_only(handle)
        if gpu.fan is None:
            return NOT_SUPPORTED
        ref._obj.value = gpu.fan
        return SUCCESS

    def _c_nvmlDeviceGetPcieThroughput(self, handle: Any, counter: Any, ref: Any) -> None:
        gpu = self._gpu_only(handle)
        ref._obj.value = gpu.pcie_tx_kbs if _val(counter) == pynvml.NVML_PCIE_UTIL_TX_BYTES else gpu.pcie_rx_kbs

    def _c_nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: Any, counter_type: Any, ref: Any) -> None:
        gpu = self._gpu_only(handle)
        corrected = _val(error_type) == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
        ref._obj.value = gpu.ecc_corrected if corrected else gpu.ecc_uncorrected

    def _c_nvmlDeviceGetRemappedRows(self, handle: Any, *refs: Any) -> int:
        gpu = self._gpu_only(handle)
        if gpu.remapped_rows is None or (gpu.mig_current and gpu.gis):  # unsupported with active instances
            return NOT_SUPPORTED
        for ref, value in zip(refs, gpu.remapped_rows, strict=True):
            ref._obj.value = value
        return SUCCESS

    def _c_nvmlDeviceGetRetiredPages(self, handle: Any, cause: Any, count: Any, pages: Any) -> int:
        gpu = self._gpu_only(handle)
        if gpu.retired_pages is None:
            return NOT_SUPPORTED
        addresses = gpu.retired_pages[_val(cause)]
        if pages is None:  # the size probe
            count._obj.value = len(addresses)
            return INSUFFICIENT_SIZE if addresses else SUCCESS
        if count._obj.value < len(addresses):
            return INSUFFICIENT_SIZE
        for k, address in enumerate(addresses):
            pages[k] = address
        count._obj.value = len(addresses)
        return SUCCESS

    def _c_nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any, ref: Any) -> int:
        gpu = self._gpu_only(handle)
        if gpu.retired_pages is None:
            return NOT_SUPPORTED
        ref._obj.value = gpu.retired_pending
        return SUCCESS

    def _c_nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any, ref: Any) -> None:
        ref._obj.value = self._gpu_only(handle).clocks_event

    _c_nvmlDeviceGetCurrentClocksThrottleReasons = _c_nvmlDeviceGetCurrentClocksEventReasons

    def _c_nvmlDeviceGetSupportedClocksEventReasons(self, handle: Any, ref: Any) -> None:
        ref._obj.value = self._gpu_only(handle).clocks_supported

    _c_nvmlDeviceGetSupportedClocksThrottleReasons = _c_nvmlDeviceGetSupportedClocksEventReasons

    def _processes(self, handle: Any) -> list[tuple[int, int | None, int, int]]:
        gpu, ci, gi = self._device(handle)
        if ci is not None and gi is not None:
            return [(pid, used, gi.gi_id, ci.ci_id) for pid, used in ci.processes]
        self._aggregate_allowed(gpu)
        if gpu.mig_current:
            return [(pid, used, gi.gi_id, ci.ci_id) for gi, ci in gpu.cis() for pid, used in ci.processes]
        return [(pid, used, NO_ID, NO_ID) for pid, used in gpu.processes]

    def _c_nvmlDeviceGetComputeRunningProcesses_v3(self, handle: Any, count: Any, infos: Any) -> int:
        processes = self._processes(handle)
        if infos is None or count._obj.value < len(processes):  # the size probe
            count._obj.value = len(processes)
            return INSUFFICIENT_SIZE if processes else SUCCESS
        for k, (pid, used, gi_id, ci_id) in enumerate(processes):
            infos[k].pid, infos[k].usedGpuMemory = pid, NOT_AVAILABLE if used is None else used
            infos[k].gpuInstanceId, infos[k].computeInstanceId = gi_id, ci_id
        count._obj.value = len(processes)
        return SUCCESS

    _c_nvmlDeviceGetComputeRunningProcesses_v2 = _c_nvmlDeviceGetComputeRunningProcesses_v3

    def _sampled(self, handle: Any) -> FakeGpu:
        gpu = self._gpu_only(handle)
        if gpu.mig_current:  # NVML keeps no utilisation samples of MIG-enabled GPUs
            raise _Return(NOT_SUPPORTED)
        return gpu

    def _process_samples(self, handle: Any, since: Any, room: int | None) -> list[tuple[int, int, int]]:
        """(µs, pid, SM %) newer than ``since``, oldest first, whole periods only, at most ``room``
        (None: the size probe, raising INSUFFICIENT_SIZE with the count to allocate)."""
        gpu = self._sampled(handle)
        fresh = [(ts, pid, sm[pid]) for ts, sm in gpu.process_ring if ts > _val(since) for pid in sorted(sm)]
        if not fresh:
            raise _Return(NOT_FOUND)
        if room is None or room < len(fresh):
            # A period ended between the probe and this call: the oldest periods that fit, so the
            # caller's lastSeenTimeStamp never passes a sample it did not get.
            fit = 0 if room is None else room
            while 0 < fit < len(fresh) and fresh[fit][0] == fresh[fit - 1][0]:
                fit -= 1
            if fit == 0:
                raise _Return(INSUFFICIENT_SIZE)
            fresh = fresh[:fit]
        return fresh

    def _c_nvmlDeviceGetProcessUtilization(self, handle: Any, samples: Any, count: Any, since: Any) -> int:
        try:
            fresh = self._process_samples(handle, since, None if samples is None else count._obj.value)
        except _Return as answer:
            if answer.code == INSUFFICIENT_SIZE:
                count._obj.value = len(self._process_samples(handle, since, 1 << 30))
            raise
        for k, (ts, pid, sm) in enumerate(fresh):
            samples[k].pid, samples[k].timeStamp, samples[k].smUtil = pid, ts, sm
            samples[k].memUtil = samples[k].encUtil = samples[k].decUtil = 0
        count._obj.value = len(fresh)
        return SUCCESS

    def _c_nvmlDeviceGetProcessesUtilizationInfo(self, handle: Any, ref: Any) -> int:
        info = ref._obj
        if info.version != pynvml.ProcessesUtilizationInfo_v1:
            return ARGUMENT_VERSION_MISMATCH
        array = info.procUtilArray if info.procUtilArray else None
        try:
            fresh = self._process_samples(handle, info.lastSeenTimeStamp, None if array is None else info.processSamplesCount)
        except _Return as answer:
            if answer.code == INSUFFICIENT_SIZE:
                info.processSamplesCount = len(self._process_samples(handle, info.lastSeenTimeStamp, 1 << 30))
            raise
        for k, (ts, pid, sm) in enumerate(fresh):
            array[k].timeStamp, array[k].pid, array[k].smUtil = ts, pid, sm
        info.processSamplesCount = len(fresh)
        return SUCCESS

    def _c_nvmlDeviceGetSamples(self, handle: Any, kind: Any, since: Any, value_type: Any, count: Any, samples: Any) -> int:
        gpu = self._sampled(handle)
        if _val(kind) != pynvml.NVML_GPU_UTILIZATION_SAMPLES:
            return NOT_SUPPORTED  # the fake keeps utilisation samples only
        fresh = [(ts, util) for ts, util in gpu.util_ring if ts > _val(since)]
        if not fresh:
            return NOT_FOUND
        value_type._obj.value = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
        if samples is None:  # the size probe
            count._obj.value = len(fresh)
            return SUCCESS
        fresh = fresh[: count._obj.value]  # the oldest that fit: nothing newer is skipped
        for k, (ts, util) in enumerate(fresh):
            samples[k].timeStamp, samples[k].sampleValue.uiVal = ts, util
        count._obj.value = len(fresh)
        return SUCCESS

    # -- MIG -------------------------------------------------------------------------------

    def _c_nvmlDeviceGetMigMode(self, handle: Any, current: Any, pending: Any) -> int:
        gpu = self._gpu_only(handle)
        if gpu.mig_sku is None and not gpu.mig_current:  # MIG-enabled: a SKU without a table here
            return NOT_SUPPORTED
        current._obj.value, pending._obj.value = int(gpu.mig_current), int(gpu.mig_pending)
        return SUCCESS

    def _c_nvmlDeviceGetMaxMigDeviceCount(self, handle: Any, ref: Any) -> int:
        gpu = self._gpu_only(handle)
        if gpu.mig_sku is None and not gpu.mig_current:
            return NOT_SUPPORTED
        ref._obj.value = max(7, sum(1 for _ in gpu.cis())) if gpu.mig_current else 0
        return SUCCESS

    def _c_nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: Any, ref: Any) -> int:
        gpu = self._gpu_only(handle)
        for _, ci in gpu.cis():
            if ci.mig_index == _val(index):
                _write_handle(ref, self._address(gpu, ci))
                return SUCCESS
        return NOT_FOUND

    def _c_nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: Any, ref: Any) -> None:
        _write_handle(ref, self._address(self._device(handle)[0]))

    def _c_nvmlDeviceIsMigDeviceHandle(self, handle: Any, ref: Any) -> None:
        ref._obj.value = int(self._device(handle)[1] is not None)

    def _mig_device(self, handle: Any) -> tuple[FakeGi, FakeCi]:
        _, ci, gi = self._device(handle)
        if ci is None or gi is None:
            raise _Return(INVALID_ARGUMENT)
        return gi, ci

    def _c_nvmlDeviceGetGpuInstanceId(self, handle: Any, ref: Any) -> None:
        ref._obj.value = self._mig_device(handle)[0].gi_id

    def _c_nvmlDeviceGetComputeInstanceId(self, handle: Any, ref: Any) -> None:
        ref._obj.value = self._mig_device(handle)[1].ci_id

    def _c_nvmlDeviceGetAttributes_v2(self, handle: Any, ref: Any) -> int:
        _, ci, gi = self._device(handle)
        if ci is None or gi is None:  # nvml.h: only MIG device handles
            return NOT_SUPPORTED
        attrs = ref._obj
        shared = gi.spec.multiprocessors * ci.slices // gi.spec.slices  # the CI's share of its GI
        attrs.multiprocessorCount = shared if ci.multiprocessors is None else ci.multiprocessors
        attrs.gpuInstanceSliceCount, attrs.computeInstanceSliceCount = gi.spec.slices, ci.slices
        attrs.memorySizeMB = self._gi_memory(gi) // MIB
        return SUCCESS

    def _profile(self, gpu: FakeGpu, profile_id: int) -> FakeProfile:
        for spec in mig_profiles(gpu.mig_sku) if gpu.mig_sku else ():
            if spec.profile_id == profile_id:
                return spec
        raise _Return(INVALID_ARGUMENT)

    def _profile_info(self, handle: Any, index: Any, info: Any) -> FakeProfile:
        gpu = self._gpu_only(handle)
        if gpu.mig_sku is None:
            raise _Return(NOT_SUPPORTED)
        if _val(index) >= pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise _Return(INVALID_ARGUMENT)
        spec = next((s for s in mig_profiles(gpu.mig_sku) if s.index == _val(index)), None)
        if spec is None:  # a profile this SKU does not have
            raise _Return(NOT_SUPPORTED)
        info.id, info.isP2pSupported, info.sliceCount = spec.profile_id, 0, spec.slices
        info.instanceCount, info.multiprocessorCount = spec.instance_count, spec.multiprocessors
        info.copyEngineCount, info.decoderCount, info.encoderCount = spec.slices, spec.slices // 2, 0
        info.memorySizeMB = spec.memory_mib
        return spec

    def _c_nvmlDeviceGetGpuInstanceProfileInfoV(self, handle: Any, index: Any, ref: Any) -> int:
        if ref._obj.version != pynvml.nvmlGpuInstanceProfileInfo_v2:
            return ARGUMENT_VERSION_MISMATCH
        spec = self._profile_info(handle, index, ref._obj)
        ref._obj.name = f"MIG {spec.name}".encode()
        return SUCCESS

    def _c_nvmlDeviceGetGpuInstanceProfileInfo(self, handle: Any, index: Any, ref: Any) -> None:
        self._profile_info(handle, index, ref._obj)

    def _c_nvmlDeviceGetGpuInstances(self, handle: Any, profile_id: Any, instances: Any, count: Any) -> int:
        gpu = self._gpu_only(handle)
        if not gpu.mig_current:
            return NOT_SUPPORTED
        spec = self._profile(gpu, _val(profile_id))
        found = [gi for gi in gpu.gis if gi.spec.profile_id == spec.profile_id]
        if len(found) > len(instances):
            return INSUFFICIENT_SIZE
        for k, gi in enumerate(found):
            instances[k] = _pointer(pynvml.c_nvmlGpuInstance_t, self._address(gpu) + _GI_OFFSET + gi.gi_id)
        count._obj.value = len(found)
        return SUCCESS

    def _c_nvmlGpuInstanceGetInfo(self, handle: Any, ref: Any) -> None:
        gpu, _, gi = self._device(handle)
        if gi is None:
            raise _Return(INVALID_ARGUMENT)
        info = ref._obj
        info.device = _pointer(pynvml.c_nvmlDevice_t, self._address(gpu))
        info.id, info.profileId = gi.gi_id, gi.spec.profile_id
        info.placement.start, info.placement.size = gi.start, gi.spec.memory_slices

    def _c_nvmlDeviceGetGpuInstancePossiblePlacements_v2(self, handle: Any, profile_id: Any, placements: Any, count: Any) -> int:
        gpu = self._gpu_only(handle)
        spec = self._profile(gpu, _val(profile_id))
        if placements is None:  # the size probe
            count._obj.value = len(spec.starts)
            return SUCCESS
        for k, start in enumerate(spec.starts[: len(placements)]):
            placements[k].start, placements[k].size = start, spec.memory_slices
        count._obj.value = min(len(spec.starts), len(placements))
        return SUCCESS

    def _c_nvmlDeviceGetGpuInstanceRemainingCapacity(self, handle: Any, profile_id: Any, ref: Any) -> int:
        gpu = self._gpu_only(handle)
        if not gpu.mig_current:
            return NOT_SUPPORTED
        spec = self._profile(gpu, _val(profile_id))
        existing = [GpuInstance(gi.spec.name, gi.start) for gi in gpu.gis]
        ref._obj.value = creatable_instances(BUILTIN_TABLES[gpu.mig_sku], existing)[spec.name]  # type: ignore[index]
        return SUCCESS

    # -- events ----------------------------------------------------------------------------

    def _c_nvmlEventSetCreate(self, ref: Any) -> None:
        _write_handle(ref, _EVENT_SET)

    def _c_nvmlEventSetFree(self, event_set: Any) -> None:
        pass

    def _c_nvmlDeviceGetSupportedEventTypes(self, handle: Any, ref: Any) -> None:
        self._gpu_only(handle)
        ref._obj.value = pynvml.nvmlEventTypeXidCriticalError

    def _c_nvmlDeviceRegisterEvents(self, handle: Any, types: Any, event_set: Any) -> None:
        self._gpu_only(handle).registered_events |= _val(types)

    def _c_nvmlEventSetWait_v2(self, event_set: Any, ref: Any, timeout_ms: Any) -> int:
        deadline = time.monotonic() + min(_val(timeout_ms), self.max_event_wait_ms) / 1000
        with self._events:
            while True:
                if self._refcount == 0:
                    return UNINITIALIZED
                for k, (index, xid, gi) in enumerate(self._event_queue):
                    gpu = self.gpus[index]
                    if gpu.registered_events & pynvml.nvmlEventTypeXidCriticalError:
                        del self._event_queue[k]
                        data = ref._obj
                        data.device = _pointer(pynvml.c_nvmlDevice_t, self._address(gpu))
                        data.eventType, data.eventData = pynvml.nvmlEventTypeXidCriticalError, xid
                        data.gpuInstanceId = NO_ID if gi is None else gi
                        data.computeInstanceId = NO_ID if gi is None else 0
                        return SUCCESS
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return TIMEOUT
                self._events.wait(remaining)


CUDA_SUCCESS, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_INITIALIZED = 0, 1, 3
CUDA_ERROR_INSUFFICIENT_DRIVER, CUDA_ERROR_NO_DEVICE, CUDA_ERROR_INVALID_DEVICE = 35, 100, 101
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16


class FakeCudaDriver:
    """``libcuda.so.1`` of a :class:`FakeNvml` machine: C calls answering CUresult codes."""

    def __init__(self, machine: FakeNvml) -> None:
        self._machine = machine
        self._initialised = False
        self.calls: Counter[str] = Counter()

    def _visible(self) -> list[FakeGpu]:
        gpus = [g for g in self._machine.gpus if g.multiprocessors is not None and not g.mig_current and not g.lost]
        return sorted(gpus, key=lambda g: g.pci_bus_id)

    def _gpu(self, dev: Any) -> FakeGpu:
        ordinal = _val(dev)
        visible = self._visible()
        if not self._initialised:
            raise _Return(CUDA_ERROR_NOT_INITIALIZED)
        if not 0 <= ordinal < len(visible):
            raise _Return(CUDA_ERROR_INVALID_DEVICE)
        return visible[ordinal]

    def __getattr__(self, symbol: str) -> Callable[..., int]:
        impl = getattr(type(self), f"_c_{symbol}", None)
        if impl is None:
            raise AttributeError(symbol)

        def call(*args: Any) -> int:
            self.calls[symbol] += 1
            with self._machine._lock:
                try:
                    return impl(self, *args) or CUDA_SUCCESS
                except _Return as answer:
                    return answer.code

        return call

    def _c_cuInit(self, flags: Any) -> int:
        m = self._machine
        if _val(flags) != 0:
            return CUDA_ERROR_INVALID_VALUE
        if m.cuda_state == "insufficient_driver":
            return CUDA_ERROR_INSUFFICIENT_DRIVER
        if m.cuda_state == "no_device" or m.driver_state != "ok" or not self._visible():
            return CUDA_ERROR_NO_DEVICE
        self._initialised = True
        return CUDA_SUCCESS

    def _c_cuDeviceGetCount(self, ref: Any) -> int:
        if not self._initialised:
            return CUDA_ERROR_NOT_INITIALIZED
        ref._obj.value = len(self._visible())
        return CUDA_SUCCESS

    def _c_cuDeviceGet(self, ref: Any, ordinal: Any) -> None:
        self._gpu(ordinal)
        ref._obj.value = _val(ordinal)

    def _c_cuDeviceGetAttribute(self, ref: Any, attribute: Any, dev: Any) -> int:
        gpu = self._gpu(dev)
        if _val(attribute) != CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT:
            return CUDA_ERROR_INVALID_VALUE  # the fake knows one attribute
        ref._obj.value = gpu.multiprocessors
        return CUDA_SUCCESS

    def _c_cuDeviceGetPCIBusId(self, buf: Any, size: Any, dev: Any) -> int:
        gpu = self._gpu(dev)
        domain, bus, rest = gpu.pci_bus_id.split(":")
        text = f"{int(domain, 16):04x}:{bus}:{rest}".encode()  # CUDA prints a 4-digit domain
        if len(text) >= _val(size):
            return CUDA_ERROR_INVALID_VALUE
        buf.value = text
        return CUDA_SUCCESS

    def _c_cuDeviceGetUuid(self, ref: Any, dev: Any) -> None:
        gpu = self._gpu(dev)
        digits = gpu.uuid.removeprefix("GPU-").replace("-", "")
        # CUDA's uuid is 16 bytes; a mock device's id need not be a UUID, then it matches by bus id.
        if re.fullmatch(r"[0-9a-fA-F]{32}", digits):
            raw = bytes.fromhex(digits)
        else:
            raw = uuidlib.uuid5(uuidlib.NAMESPACE_URL, gpu.uuid).bytes
        ctypes.memmove(ctypes.addressof(ref._obj), raw, 16)

    def _c_cuDeviceGetUuid_v2(self, ref: Any, dev: Any) -> None:
        self._c_cuDeviceGetUuid(ref, dev)  # differs only for MIG devices, which the fake never lists

    def _c_cuDeviceTotalMem_v2(self, ref: Any, dev: Any) -> None:
        gpu = self._gpu(dev)
        ref._obj.value = gpu.memory_total - gpu.memory_reserved


# Mock device file keys -> (FakeGpu field, value in NVML's unit from the pattern's value).
_MOCK_FIELDS: dict[str, tuple[str, Callable[[float], float]]] = {
    "utilization_ratio": ("util_gpu", lambda v: 100 * v),  # %
    "memory_utilization_ratio": ("util_memory", lambda v: 100 * v),
    "temperature_celsius": ("temperature", lambda v: v),  # °C
    "power_watts": ("power_mw", lambda v: 1000 * v),  # mW
    "sm_clock_mhz": ("sm_clock", lambda v: v),  # MHz
    "memory_clock_mhz": ("mem_clock", lambda v: v),
    "fan_speed_ratio": ("fan", lambda v: 100 * v),  # %
}
# What a mock device file does not describe: NOT_SUPPORTED, as on a GPU without the feature.
_UNDESCRIBED = frozenset(
    {
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetCurrentClocksThrottleReasons",
        "nvmlDeviceGetSupportedClocksEventReasons",
        "nvmlDeviceGetSupportedClocksThrottleReasons",
        "nvmlDeviceGetPcieThroughput",
        "nvmlDeviceGetSupportedEventTypes",
        "nvmlDeviceRegisterEvents",
    }
)
_PROCESS_CALLS = frozenset(
    {
        "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetProcessUtilization",
        "nvmlDeviceGetProcessesUtilizationInfo",
    }
)


def _follow(pattern: Any, unit: Callable[[float], float], whole: bool = False) -> Callable[[float], int]:
    """A field's value at a clock reading: the pattern's, in the field's unit, rounded (``whole``:
    truncated, for byte counts)."""
    if whole:
        return lambda t: int(unit(pattern.at(t)))
    return lambda t: round(unit(pattern.at(t)))


def _mock_gpu(index: int, gpu: MockGpu) -> FakeGpu:
    patterns = {field_: _follow(gpu.patterns[key], unit) for key, (field_, unit) in _MOCK_FIELDS.items() if key in gpu.patterns}
    if "memory_used_ratio" in gpu.patterns:
        total = gpu.memory_bytes
        patterns["memory_used"] = _follow(gpu.patterns["memory_used_ratio"], lambda v: total * v, whole=True)
    processes = gpu.processes or ()
    sampled = [(p.pid, p.sm_util) for p in processes if p.sm_util is not None]
    if sampled:  # SM % of each process, from its pattern
        patterns["process_sm"] = lambda t: {pid: round(100 * util.at(t)) for pid, util in sampled}
    fake = FakeGpu(
        index=index,
        uuid=gpu.uuid,
        name=gpu.model_name,
        pci_bus_id=gpu.pci_bus_id,
        pci_device_id=0,
        serial=gpu.serial,
        numa_node=gpu.numa_node,
        memory_total=gpu.memory_bytes,
        memory_reserved=0,
        memory_used=0,
        power_limit_mw=round(gpu.power_limit_watts * 1000),
        energy_mj=0,
        remapped_rows=None,
        processes=[(p.pid, p.used_memory_bytes) for p in processes],
        mig_sku=gpu.mig_sku.sku if gpu.mig_sku is not None else None,
        multiprocessors=gpu.multiprocessors,
        unsupported=set(_UNDESCRIBED) | (set(_PROCESS_CALLS) if gpu.processes is None else set()),
        patterns=patterns,
    )
    if gpu.mig_devices:
        fake.gis = _mock_instances(gpu)
        fake.mig_current = fake.mig_pending = True
        if gpu.mig_sku is None or any(m.placement is None for m in gpu.mig_devices):
            fake.denied |= GEOMETRY_CALLS
    return fake


def _mock_instances(gpu: MockGpu) -> list[FakeGi]:
    """GPU instances of a mock GPU's MIG devices, one compute instance per device."""
    specs = {spec.name: spec for spec in mig_profiles(gpu.mig_sku.sku)} if gpu.mig_sku is not None else {}
    instances: dict[int, FakeGi] = {}
    for mig_index, m in enumerate(gpu.mig_devices):
        gi = instances.get(m.gpu_instance_id)
        if gi is None:
            spec = specs.get(m.profile) if m.placement is not None else None
            gi = instances[m.gpu_instance_id] = FakeGi(
                gi_id=m.gpu_instance_id,
                spec=spec or _described_profile(m),
                start=m.placement.start if m.placement is not None else 0,
                memory_used=0,
                memory_total=m.memory_bytes,
                patterns={"memory_used": _follow(m.memory_used, lambda v, total=m.memory_bytes: total * v, whole=True)},
            )
        ci = FakeCi(m.compute_instance_id, gi.spec.slices, mig_index, m.uuid, profile=m.profile, multiprocessors=m.multiprocessors)
        gi.cis.append(ci)
    return list(instances.values())


def _described_profile(m: MockMigDevice) -> FakeProfile:
    """A GPU-instance profile as far as the file describes it (no geometry is answered for it)."""
    size = m.placement.size if m.placement is not None else 1
    return FakeProfile(-1, -1, m.profile, 1, size, 1, (), m.memory_bytes // MIB, m.multiprocessors)


def _microseconds(t: float) -> int:
    """A clock reading in whole µs, NVML's sample timestamps."""
    return int(t * 1_000_000)


def _uuid(scope: str, index: int, prefix: str = "GPU-") -> str:
    return f"{prefix}{uuidlib.uuid5(uuidlib.NAMESPACE_URL, f'fake-nvml/{scope}/{index}')}"
