"""Device telemetry: the readings, the snapshot and the source protocol (a leaf: no package imports).

A *source* (``nvml``, ``mock`` or ``none``) reads devices; the sampler
(:mod:`exporter.telemetry.sampler`) publishes one immutable :class:`TelemetrySnapshot` per cycle.

Units are base units throughout (bytes, watts, joules, hertz, degrees Celsius, 0-1 ratios).
``None`` means unsupported or unknown; it is never NaN and never 0.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

__all__ = [
    "DeviceReading",
    "GpuInstanceReading",
    "GpuProcess",
    "MigDeviceReading",
    "MigPlacement",
    "MigProfileCapacity",
    "NullSource",
    "SOURCE_KINDS",
    "SourceConfigError",
    "SourceInfo",
    "TelemetrySnapshot",
    "TelemetrySource",
    "TelemetryUnavailable",
    "XID_SCOPES_KEPT",
    "XidCounter",
]

SOURCE_KINDS = ("auto", "nvml", "mock", "none")


class SourceConfigError(Exception):
    """A source cannot be configured (a missing or invalid device file): the message is one
    line naming the file and the reason. The CLI exits with status 2."""


class TelemetryUnavailable(Exception):
    """The source cannot be read at all right now (no driver, library missing, driver unloaded).

    The sampler publishes a failed snapshot and retries ``prepare()`` with exponential backoff.
    """


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A compute process on a GPU or MIG device (``nvidia-smi --query-compute-apps=pid,used_memory``).

    ``pid`` is a host PID. ``gpu_instance_id``/``compute_instance_id`` are None when MIG is off.
    """

    pid: int
    used_memory_bytes: int | None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


@dataclass(frozen=True, slots=True)
class MigPlacement:
    """A GPU instance's span on the memory-slice axis: slices ``[start, start + size)``."""

    start: int
    size: int


@dataclass(frozen=True, slots=True)
class GpuInstanceReading:
    """One existing GPU instance (``nvidia-smi mig -lgi``), with or without compute instances."""

    gpu_instance_id: int
    profile_id: int | None  # None only for mock GPUs of an unknown MIG SKU
    profile: str | None  # "3g.40gb"
    placement: MigPlacement


@dataclass(frozen=True, slots=True)
class MigProfileCapacity:
    """One GPU-instance profile of a MIG-enabled GPU (``nvidia-smi mig -lgip`` / ``-lgipp``).

    ``remaining`` is the driver's count of instances of this profile that can still be created
    (``nvmlDeviceGetGpuInstanceRemainingCapacity``, "Instances Free"); per profile, not jointly
    achievable. ``placements`` lists every legal placement, occupied or not.
    """

    profile_id: int
    name: str  # "1g.10gb"
    slice_count: int  # compute slices (the "1" in 1g)
    instance_count: int  # most instances of this profile a GPU can hold
    memory_bytes: int | None
    multiprocessor_count: int | None
    remaining: int | None
    placements: tuple[MigPlacement, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class MigDeviceReading:
    """One MIG device (a compute instance inside a GPU instance), read through its own handle.

    ``uuid`` is ``MIG-<uuid>`` (NVML) or Backend.AI's mock id ``MIG-<mother_uuid>/<idx>/0``.
    Memory is that of its GPU instance (compute instances of one GI share it).
    """

    uuid: str
    parent_uuid: str
    index: int  # NVML MIG index under the parent; the mock's position in its device list
    profile: str | None  # "1g.10gb", or "1c.3g.20gb" when a GI holds several compute instances
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    placement: MigPlacement | None = None  # None when the layout is unreadable (no privilege)
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    multiprocessor_count: int | None = None
    processes: tuple[GpuProcess, ...] | None = None  # None: could not be read


def _no_reasons() -> Mapping[str, bool]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceReading:
    """One physical GPU.

    Fields follow ``nvidia-smi --query-gpu`` where one exists (named in the comments). ``up`` is
    False for a lost GPU (``GPU_IS_LOST``) and for a GPU whose calls are stuck; ``stale`` is True
    when the values are the last good reading rather than a fresh one.
    """

    uuid: str  # "GPU-…" (uuid); mock devices: "GPU-<mother_uuid>"
    index: int | None  # NVML index (index); mock: position among physical GPUs
    name: str | None = None  # name
    pci_bus_id: str | None = None  # pci.bus_id
    serial: str | None = None  # serial
    up: bool = True
    stale: bool = False
    last_update_timestamp: float | None = None  # seconds since the epoch, of the values below
    memory_total_bytes: int | None = None  # memory.total
    memory_used_bytes: int | None = None  # memory.used (v2 semantics: excludes reserved)
    memory_reserved_bytes: int | None = None  # memory.reserved
    utilization_gpu_ratio: float | None = None  # utilization.gpu / 100; None on MIG-enabled GPUs
    utilization_memory_ratio: float | None = None  # utilization.memory / 100
    temperature_celsius: float | None = None  # temperature.gpu
    power_usage_watts: float | None = None  # power.draw
    power_limit_watts: float | None = None  # enforced.power.limit
    energy_joules: float | None = None  # total energy since the driver loaded (a counter)
    sm_clock_hz: float | None = None  # clocks.sm
    memory_clock_hz: float | None = None  # clocks.mem
    fan_speed_ratio: float | None = None  # fan.speed / 100 (may exceed 1); None when passively cooled
    pcie_rx_bytes_per_second: float | None = None  # opt-in: a 20 ms sample per call
    pcie_tx_bytes_per_second: float | None = None
    ecc_corrected_errors: int | None = None  # ecc.errors.corrected.aggregate.total
    ecc_uncorrected_errors: int | None = None  # ecc.errors.uncorrected.aggregate.total
    remapped_rows_correctable: int | None = None  # remapped_rows.correctable (Ampere+)
    remapped_rows_uncorrectable: int | None = None  # remapped_rows.uncorrectable
    remapped_rows_pending: bool | None = None  # remapped_rows.pending
    remapped_rows_failure: bool | None = None  # remapped_rows.failure
    retired_pages_single_bit: int | None = None  # retired_pages.sbe (pre-Ampere)
    retired_pages_double_bit: int | None = None  # retired_pages.dbe
    retired_pages_pending: bool | None = None  # retired_pages.pending
    throttle_reasons: Mapping[str, bool] = field(default_factory=_no_reasons)  # clocks_event_reasons.*
    mig_mode_current: bool | None = None  # mig.mode.current; None: not MIG-capable
    mig_mode_pending: bool | None = None  # mig.mode.pending
    mig_layout_readable: bool | None = None  # False: NO_PERMISSION on the MIG geometry; None: n/a
    mig_devices: tuple[MigDeviceReading, ...] = ()
    gpu_instances: tuple[GpuInstanceReading, ...] = ()  # includes GIs without compute instances
    mig_profile_capacity: tuple[MigProfileCapacity, ...] | None = None
    processes: tuple[GpuProcess, ...] | None = None  # None: could not be read
    # pid -> SM utilisation 0-1, mean of the samples since the last reading (nvidia-smi pmon "sm");
    # a running process without samples was idle. None: not sampled (MIG-enabled or unsupported GPU).
    process_utilization: Mapping[int, float] | None = None
    # Busy time integrated from the driver's utilisation sample buffers (nvmlDeviceGetSamples and
    # the per-process samples above, read once): each sample's utilisation x the span since the
    # device's previous sample. Counters in seconds since this source first read the GPU (0 at that
    # reading; they restart with a new nvml_generation). ``busy_seconds``: the whole GPU;
    # ``process_busy_seconds``: pid -> SM-busy seconds, kept while NVML lists the process or has
    # samples of it (a PID seen again after that starts at 0). None: not measurable (MIG-enabled or
    # unsupported GPU, a failed call); an idle GPU reads as measured, adding 0.
    busy_seconds: float | None = None
    process_busy_seconds: Mapping[int, float] | None = None
    # Seconds the integration could not cover (a counter, as busy_seconds): the driver's bounded
    # sample buffer had already dropped the samples of that span when the GPU was read. Neither
    # counter above includes that span's busy time; None where busy_seconds is None.
    busy_unmeasured_seconds: float | None = None
    # SMs: NVML reports it for MIG devices only; for a whole GPU it comes from the CUDA driver
    # (cuDeviceGetAttribute) or, failing that, a table of known models.
    multiprocessor_count: int | None = None
    # Bytes CUDA reports for the device (cuDeviceTotalMem, cudaDeviceProp.totalGlobalMem), which
    # the fractional plugin divides into shares; a little less than memory.total. None: unknown.
    allocatable_memory_bytes: int | None = None
    numa_node: int | None = None
    # Counts NVML initialisations of this source (1 for the first): a new one after the driver
    # went away and came back means the driver was reloaded. None: the source has no such notion.
    nvml_generation: int | None = None


@dataclass(frozen=True, slots=True)
class XidCounter:
    """How many XID events of one code a GPU raised since the exporter started, and when last."""

    device_uuid: str
    xid: int
    count: int
    last_seen_timestamp: float
    # The GPU instance of each of the latest events (at most XID_SCOPES_KEPT, oldest first); None:
    # the event concerned the whole GPU (NVML's 0xFFFFFFFF), as every event of a GPU without MIG.
    gpu_instance_ids: tuple[int | None, ...] = ()


XID_SCOPES_KEPT = 8


@dataclass(frozen=True, slots=True)
class TelemetrySnapshot:
    """Everything one sampling cycle learnt; published atomically by the sampler."""

    source: str  # "nvml", "mock", "none"
    devices: tuple[DeviceReading, ...] = ()
    driver_version: str | None = None
    cuda_version: str | None = None  # "12.4"
    device_count: int | None = None  # GPUs the driver reports, including unreadable ones
    success: bool = False
    error: str | None = None
    duration_seconds: float | None = None
    timestamp: float | None = None  # when this snapshot was taken
    last_success_timestamp: float | None = None
    xid_errors: tuple[XidCounter, ...] = ()


@dataclass(frozen=True, slots=True)
class SourceInfo:
    """What ``prepare()`` learnt: the devices to read this cycle and system-wide facts."""

    device_keys: tuple[Hashable, ...]
    driver_version: str | None = None
    cuda_version: str | None = None
    device_count: int | None = None


class TelemetrySource(Protocol):
    """A device reader driven by :class:`TelemetrySampler`.

    ``prepare`` and ``read_device`` may block when ``may_block`` is True; the sampler then runs
    them on worker threads under a deadline. Both raise :class:`TelemetryUnavailable` when the
    whole source is gone. ``read_device`` returns None for a device it cannot even identify.
    """

    name: str
    may_block: bool

    def prepare(self) -> SourceInfo: ...

    def read_device(self, key: Hashable) -> DeviceReading | None: ...

    def xid_counters(self) -> tuple[XidCounter, ...]: ...

    def close(self) -> None: ...


class NullSource:
    """The ``none`` source: telemetry disabled or no driver; yields no devices."""

    name = "none"
    may_block = False

    def prepare(self) -> SourceInfo:
        return SourceInfo(device_keys=())

    def read_device(self, key: Hashable) -> DeviceReading | None:
        return None

    def xid_counters(self) -> tuple[XidCounter, ...]:
        return ()

    def close(self) -> None:
        pass
