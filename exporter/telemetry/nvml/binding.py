"""The NVML telemetry source; with the simulated library, the only module that imports ``pynvml``.

``pynvml`` (from ``nvidia-ml-py``) is imported inside functions, so importing this module never
touches a driver. :class:`NvmlSource` implements :class:`exporter.telemetry.TelemetrySource`;
:class:`exporter.telemetry.sampler.TelemetrySampler` calls it from worker threads under a deadline.

Error policy, by the NVML return code ``pynvml`` raises:

- ``NOT_SUPPORTED`` → that field is None; ``NO_PERMISSION`` and unexpected codes → None, logged
  once per device and call;
- ``FUNCTION_NOT_FOUND`` (an older driver) → the older call (``TemperatureV`` → ``Temperature``,
  memory v2 → v1, processes v3 → v2, clocks-event → clocks-throttle reasons); the decision is
  kept until the next ``nvmlInit``;
- ``GPU_IS_LOST``, ``RESET_REQUIRED`` (and ``UNKNOWN`` from ``GetHandleByIndex``) → that GPU is
  reported ``up=False`` with its last known identity; the others are unaffected;
- ``UNINITIALIZED``, ``DRIVER_NOT_LOADED``, ``LIB_RM_VERSION_MISMATCH``, ``LIBRARY_NOT_FOUND`` →
  :class:`~exporter.telemetry.TelemetryUnavailable`; the next ``prepare()`` shuts NVML down
  (unless a call is still stuck in it) and initialises again; the sampler backs off meanwhile.

MIG: the GPU-instance geometry (profiles, instances, placements, remaining capacity) needs the
``mig/monitor`` capability; without it ``mig_layout_readable`` is False and MIG devices are still
listed from their own handles, with profile names taken from the device name. Everything is
re-enumerated on every cycle, so a reconfiguration shows up without a restart.

XID events are read by a dedicated thread from an NVML event set (``nvmlEventSetWait`` with a
bounded timeout, so it can stop), counted per (GPU, XID) outside the sampling path.

Busy time: per GPU, one read of the driver's utilisation sample buffers per cycle, the
per-process samples first (``nvmlDeviceGetProcessesUtilizationInfo``, on older drivers
``nvmlDeviceGetProcessUtilization``), then the GPU's (``nvmlDeviceGetSamples``,
``NVML_GPU_UTILIZATION_SAMPLES``), each asked only for samples newer than the newest already read
(NVML's ``lastSeenTimeStamp``), so nothing counts twice and nothing is skipped whatever the read
interval. Each GPU sample adds value x (its timestamp - the GPU's previous sample) to
``busy_seconds``; each process sample adds its SM % x (its timestamp - the GPU sample before it) to
that process's ``process_busy_seconds`` (the GPU's samples are the time grid: the driver writes
process samples only for processes that ran, so an idle process adds nothing), and the mean of a
process's samples is ``process_utilization``. ``NOT_FOUND`` (nothing newer) reads as idle. The
driver's buffers are bounded: when the first new GPU sample lies more than 1.5 sampling periods
(as the samples are spaced) after the last one read and the read returned a full buffer (as many
samples as any read did), the samples between were dropped before this read; that span, the first
new sample's included, counts into ``busy_unmeasured_seconds`` and in neither busy counter (no
estimate is made). With room to spare in the buffer such a gap means the driver took no samples
(an idle GPU): the first new sample covers one period, as does any process sample. The first read of a GPU (or after a driver reload)
sets the starting point: counters at 0. Sums are kept in whole % x µs, so they are exact.

SM counts: NVML reports ``multiprocessorCount`` for MIG device handles only; whole GPUs take theirs
(and the memory CUDA can allocate) from the CUDA driver API (:mod:`exporter.telemetry.nvml.cuda`),
asked once per ``nvmlInit`` and matched to NVML's devices by UUID, then PCI bus id, so
``CUDA_VISIBLE_DEVICES`` and CUDA's own enumeration order do not matter; without it, from the
table of known models.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar

from exporter.telemetry.model import (
    XID_SCOPES_KEPT,
    DeviceReading,
    GpuInstanceReading,
    GpuProcess,
    MigDeviceReading,
    MigPlacement,
    MigProfileCapacity,
    SourceInfo,
    TelemetryUnavailable,
    XidCounter,
)
from exporter.telemetry.nvml import cuda
from exporter.telemetry.nvml.cuda import CudaDevice, CudaUnavailable, known_sm_count, normalize_pci_bus_id

__all__ = ["THROTTLE_REASONS", "NvmlSource", "binding_path", "normalize_pci_bus_id", "probe"]

log = logging.getLogger(__name__)
T = TypeVar("T")

# Clocks-event ("throttle") reason bits of nvmlDeviceGetCurrentClocksEventReasons.
THROTTLE_REASONS: tuple[tuple[int, str], ...] = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)
_ALL_REASONS = sum(bit for bit, _ in THROTTLE_REASONS)

# NVML return codes (nvml.h), spelled out so this module needs pynvml only at call time.
_UNINITIALIZED, _INVALID_ARGUMENT, _NOT_SUPPORTED, _NO_PERMISSION, _NOT_FOUND = 1, 2, 3, 4, 6
_DRIVER_NOT_LOADED, _TIMEOUT, _LIBRARY_NOT_FOUND, _FUNCTION_NOT_FOUND = 9, 10, 12, 13
_GPU_IS_LOST, _RESET_REQUIRED, _LIB_RM_VERSION_MISMATCH, _UNKNOWN = 15, 16, 18, 999
_SOURCE_GONE = frozenset({_UNINITIALIZED, _DRIVER_NOT_LOADED, _LIBRARY_NOT_FOUND, _LIB_RM_VERSION_MISMATCH})
_DEVICE_GONE = frozenset({_GPU_IS_LOST, _RESET_REQUIRED})
_NO_ID = 0xFFFFFFFF  # GI/CI id of a process when MIG is off
_PROFILE_REV1 = (7, 8)  # NVML_GPU_INSTANCE_PROFILE_*_SLICE_REV1: the "+me" profiles
_PCIE_KB = 1024  # nvmlDeviceGetPcieThroughput reports KB/s
_LOG_ONCE_LIMIT = 1024
_PCT_US_PER_SECOND = 100 * 1_000_000  # busy sums are kept in % x µs
_TICKS_KEPT = 4096  # GPU sample timestamps kept as the time grid of per-process samples still to come
# nvmlValue_t member by nvmlValueType_t (NVML_VALUE_TYPE_DOUBLE … UNSIGNED_SHORT)
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


def _pynvml() -> Any:
    import pynvml

    return pynvml


def binding_path() -> str:
    """Where ``pynvml`` was imported from (a stray old ``pynvml`` package can shadow the binding)."""
    return str(_pynvml().__file__)


def _check_binding(pynvml: Any) -> None:
    # The deprecated pynvml<12 package ships its own, older bindings under the same name.
    if not hasattr(pynvml, "_nvmlGetFunctionPointer"):
        raise TelemetryUnavailable(f"{pynvml.__file__} is not NVIDIA's nvidia-ml-py binding; uninstall the 'pynvml' package")


def probe(timeout_s: float = 5.0) -> str | None:
    """Check that ``nvmlInit`` works; returns why not, or None when it does.

    A call that does not return within ``timeout_s`` means a driver is there but wedged: that
    counts as available (the NVML source then reports the failure) and is logged.
    """
    outcome: list[str | None] = []

    def attempt() -> None:
        try:
            pynvml = _pynvml()
            _check_binding(pynvml)
            pynvml.nvmlInit()
            pynvml.nvmlShutdown()
            outcome.append(None)
        except Exception as exc:  # NVMLError, TelemetryUnavailable, an unloadable library
            outcome.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=attempt, name="nvml-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        log.warning("nvmlInit did not return within %gs; using NVML anyway", timeout_s)
        return None
    return outcome[0]


class _DeviceLost(Exception):
    """The GPU fell off the bus or needs a reset; its calls will keep failing."""


@dataclass(frozen=True, slots=True)
class _Identity:
    uuid: str
    name: str | None
    pci_bus_id: str | None
    serial: str | None


@dataclass(frozen=True, slots=True)
class _Profile:
    index: int
    profile_id: int
    name: str
    slice_count: int
    instance_count: int
    memory_bytes: int
    multiprocessor_count: int
    placements: tuple[MigPlacement, ...]


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _mig_id(value: int | None) -> int | None:
    return None if value is None or value == _NO_ID else int(value)


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


@dataclass(slots=True)
class _Usage:
    """One GPU's busy-time integration between reads (see "Busy time" above); timestamps in µs."""

    device_seen: int | None = None  # newest GPU sample integrated; None: not started
    process_seen: int = 0  # newest per-process sample read (lastSeenTimeStamp of the next read)
    period: int | None = None  # the driver's sampling period, as its samples are spaced
    capacity: int = 0  # the most samples one read returned: the driver's buffer, once it was full
    ticks: list[int] = field(default_factory=list)  # GPU sample times, ascending: the process grid
    lost: list[tuple[int, int]] = field(default_factory=list)  # (start, end] spans the buffer had dropped
    busy: int = 0  # % x µs
    unmeasured: int = 0  # µs
    processes: dict[int, int] = field(default_factory=dict)  # pid -> % x µs

    def add_device(self, samples: list[tuple[int, float]]) -> None:
        """Integrate the GPU's samples (timestamp, %) newer than the last read."""
        samples = sorted(x for x in samples if self.device_seen is None or x[0] > self.device_seen)
        if not samples:
            return
        spacing = [b[0] - a[0] for a, b in zip(samples, samples[1:], strict=False) if b[0] > a[0]]
        if spacing:
            self.period = statistics.median_low(spacing)
        full, self.capacity = len(samples) >= self.capacity, max(self.capacity, len(samples))
        previous, first = self.device_seen, 0
        if previous is None:  # the starting point: what came before is not counted
            self.ticks = [ts for ts, _ in samples][-_TICKS_KEPT:]
            self.device_seen = self.process_seen = samples[-1][0]
            return
        if self.period is not None and 2 * (samples[0][0] - previous) > 3 * self.period:
            if full:
                # A full buffer that does not reach back to the last read dropped the samples
                # between: that span is unmeasured.
                self.unmeasured += samples[0][0] - previous
                self.lost.append((previous, samples[0][0]))
                previous, first = samples[0][0], 1
            else:
                # Room to spare, yet nothing between: the driver took no samples, as for an idle
                # GPU; the first new sample covers one period.
                previous = samples[0][0] - self.period
        for ts, value in samples[first:]:
            self.busy += round(value * (ts - previous))
            previous = ts
        self.ticks.extend(ts for ts, _ in samples)
        del self.ticks[:-_TICKS_KEPT]
        self.device_seen = samples[-1][0]

    def add_processes(self, samples: list[tuple[int, int, float]]) -> None:
        """Integrate per-process samples (timestamp, pid, SM %) on the grid of the GPU's samples."""
        for ts, pid, value in sorted(samples):
            if ts <= self.process_seen:  # before the starting point, or read already
                continue
            i = bisect.bisect_left(self.ticks, ts)
            if i == 0 or any(start < ts <= end for start, end in self.lost):
                continue  # no GPU sample before it is known, or its span is unmeasured
            # At most one sampling period: no GPU sample between means no activity there.
            span = ts - self.ticks[i - 1] if self.period is None else min(ts - self.ticks[i - 1], self.period)
            self.processes[pid] = self.processes.get(pid, 0) + round(value * span)
        if samples:
            self.process_seen = max(self.process_seen, max(ts for ts, _, _ in samples))
        # Keep the grid a later process sample may need: from the GPU sample at or before the cursor.
        keep = max(0, bisect.bisect_right(self.ticks, self.process_seen) - 1)
        del self.ticks[:keep]
        self.lost = [span for span in self.lost if span[1] > self.process_seen]


@dataclass(frozen=True, slots=True)
class _BusyReading:
    process_utilization: Mapping[int, float] | None
    process_busy_seconds: Mapping[int, float] | None
    busy_seconds: float | None
    busy_unmeasured_seconds: float | None


_NO_USAGE = _BusyReading(None, None, None, None)


class NvmlSource:
    """Reads every GPU through NVML.

    :param pcie: also read PCIe throughput; NVML samples a counter for 20 ms per direction and
        GPU, so each cycle takes 40 ms longer per GPU (``--telemetry.pcie``).
    :param clock: wall clock for timestamps.
    :param event_wait_ms: longest single ``nvmlEventSetWait``; bounds how long the XID thread
        takes to stop.
    :param xid_events: count XID events in a thread; off where the library raises none (the
        mock devices), so no thread is started.
    """

    name = "nvml"
    may_block = True

    def __init__(
        self, *, pcie: bool = False, clock: Callable[[], float] = time.time, event_wait_ms: int = 500, xid_events: bool = True
    ) -> None:
        self._xid_events = xid_events
        self._pcie = pcie
        self._clock = clock
        self._event_wait_ms = event_wait_ms
        self._lock = threading.Lock()
        self._initialised = False
        self._generation = 0  # nvmlInit calls that succeeded: a new one follows a driver reload
        self._broken = False  # a call saw the driver go away: re-initialise on the next prepare()
        self._inflight = 0  # device reads under way, possibly stuck in the driver
        self._versions: tuple[str | None, str | None] = (None, None)
        self._missing: set[str] = set()  # calls this driver lacks
        self._noted: set[tuple[str, str, int | None]] = set()
        self._identity: dict[int, _Identity] = {}
        self._usage: dict[str, _Usage] = {}  # GPU uuid -> its busy-time integration
        self._profiles: dict[str, tuple[_Profile, ...]] = {}
        self._xids: dict[tuple[str, int], XidCounter] = {}
        self._xid_thread: threading.Thread | None = None
        self._xid_stop = threading.Event()
        self._cuda: dict[str, CudaDevice] = {}  # "uuid:<GPU-…>" / "pci:<bus id>" -> CUDA's view

    # -- TelemetrySource -------------------------------------------------------------------

    def prepare(self) -> SourceInfo:
        """Initialise NVML if needed and list the GPUs (``nvidia-smi -L``)."""
        pynvml = _pynvml()
        _check_binding(pynvml)
        if self._broken:
            self._teardown()
        if not self._initialised:
            self._missing.clear()
            self._identity.clear()
            self._usage.clear()  # a new driver session: the busy counters restart
            self._profiles.clear()
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError as exc:
                raise TelemetryUnavailable(f"nvmlInit failed: {exc}") from None
            self._initialised = True
            self._generation += 1
            self._versions = (
                self._get("system", pynvml.nvmlSystemGetDriverVersion),
                self._cuda_version(self._get("system", pynvml.nvmlSystemGetCudaDriverVersion)),
            )
            log.info("NVML initialised: driver %s, CUDA %s", *self._versions)
            self._cuda = self._cuda_inventory()
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            self._raise_if_gone(exc, "nvmlDeviceGetCount")
            raise TelemetryUnavailable(f"nvmlDeviceGetCount failed: {exc}") from None
        if self._xid_thread is None and self._xid_events:
            self._xid_stop = threading.Event()
            self._xid_thread = threading.Thread(
                target=self._watch_xids, args=(self._xid_stop,), name="nvml-xid-events", daemon=True
            )
            self._xid_thread.start()
        return SourceInfo(tuple(range(count)), *self._versions, device_count=count)

    def read_device(self, key: Hashable) -> DeviceReading | None:
        """Read one GPU by NVML index; None when it cannot even be identified."""
        index = int(key)  # type: ignore[call-overload]
        with self._active():
            try:
                return self._read(index)
            except _DeviceLost as exc:
                known = self._identity.get(index)
                if known is None:
                    self._note(f"GPU {index}", "lost before it was identified", exc)
                    return None
                self._note(known.uuid, "GPU lost", exc)
                return DeviceReading(
                    uuid=known.uuid,
                    index=index,
                    name=known.name,
                    pci_bus_id=known.pci_bus_id,
                    serial=known.serial,
                    up=False,
                    nvml_generation=self._generation,
                    last_update_timestamp=self._clock(),
                )

    def xid_counters(self) -> tuple[XidCounter, ...]:
        with self._lock:
            return tuple(self._xids[k] for k in sorted(self._xids))

    def close(self) -> None:
        """Stop the XID thread and shut NVML down."""
        self._teardown()

    # -- session ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _active(self) -> Iterator[None]:
        with self._lock:
            self._inflight += 1
        try:
            yield
        finally:
            with self._lock:
                self._inflight -= 1

    def _teardown(self) -> None:
        if self._xid_thread is not None:
            self._xid_stop.set()
            self._xid_thread.join(self._event_wait_ms / 1000 + 1.0)
            self._xid_thread = None
        with self._lock:
            # nvmlShutdown under a call stuck in the driver could hang too, or free what it uses.
            shutdown = self._initialised and self._inflight == 0
        if shutdown:
            pynvml = _pynvml()
            with contextlib.suppress(pynvml.NVMLError):  # the driver may already be gone
                pynvml.nvmlShutdown()
        self._initialised = self._broken = False

    @staticmethod
    def _cuda_inventory() -> dict[str, CudaDevice]:
        try:
            found = cuda.cuda_devices()  # loads the library at call time: the simulated driver replaces it
        except CudaUnavailable as exc:
            log.info("SM counts of whole GPUs from the model table: %s", exc)
            return {}
        index: dict[str, CudaDevice] = {}
        for d in found:
            if d.uuid:
                index[f"uuid:{d.uuid.lower()}"] = d
            if d.pci_bus_id:
                index[f"pci:{d.pci_bus_id}"] = d
        log.info("SM counts of %d GPU(s) from libcuda", len(found))
        return index

    def _cuda_device(self, uuid: str, pci_bus_id: str | None) -> CudaDevice | None:
        found = self._cuda.get(f"uuid:{uuid.lower()}")
        if found is None and pci_bus_id:
            found = self._cuda.get(f"pci:{normalize_pci_bus_id(pci_bus_id)}")
        return found

    def _raise_if_gone(self, exc: Any, call: str) -> None:
        if exc.value in _SOURCE_GONE:
            self._broken = True
            raise TelemetryUnavailable(f"{call}: {exc}") from None
        if exc.value in _DEVICE_GONE:
            raise _DeviceLost(f"{call}: {exc}") from None

    def _note(self, where: str, what: str, exc: Any, level: int = logging.WARNING) -> None:
        """Log a problem once per (device, call, code)."""
        key = (where, what, getattr(exc, "value", None))
        if key not in self._noted and len(self._noted) < _LOG_ONCE_LIMIT:
            self._noted.add(key)
            log.log(level, "%s: %s: %s", where, what, exc)

    def _query(self, where: str, *calls: tuple[str, Callable[[], T]]) -> T | None:
        """The first call this driver has; None when unsupported or failing."""
        pynvml = _pynvml()
        for name, call in calls:
            if name in self._missing:
                continue
            try:
                return call()
            except pynvml.NVMLLibraryMismatchError as exc:  # the unversioned process list, v3 missing
                self._missing.add(name)
                self._note("driver", f"{name} missing, trying an older call", exc, logging.INFO)
            except pynvml.NVMLError as exc:
                if exc.value == _FUNCTION_NOT_FOUND:
                    self._missing.add(name)
                    self._note("driver", f"{name} missing, trying an older call", exc, logging.INFO)
                    continue
                self._raise_if_gone(exc, name)
                if exc.value != _NOT_SUPPORTED:
                    self._note(where, name, exc, logging.INFO if exc.value == _NO_PERMISSION else logging.WARNING)
                return None
        return None

    def _get(self, where: str, fn: Callable[..., T], *args: Any) -> T | None:
        return self._query(where, (fn.__name__, lambda: fn(*args)))

    @staticmethod
    def _cuda_version(version: int | None) -> str | None:
        return None if version is None else f"{version // 1000}.{version % 1000 // 10}"

    # -- one GPU ---------------------------------------------------------------------------

    def _read(self, index: int) -> DeviceReading | None:
        pynvml = _pynvml()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError as exc:
            self._raise_if_gone(exc, "nvmlDeviceGetHandleByIndex")
            if exc.value == _UNKNOWN:  # what broken GPUs often answer here (gpustat#125)
                raise _DeviceLost(str(exc)) from None
            self._note(f"GPU {index}", "nvmlDeviceGetHandleByIndex", exc)  # e.g. hidden by cgroups
            return None
        where = f"GPU {index}"
        uuid = self._get(where, pynvml.nvmlDeviceGetUUID, h)
        if uuid is None:
            return None
        pci = self._get(uuid, pynvml.nvmlDeviceGetPciInfo, h)
        identity = _Identity(
            uuid=uuid,
            name=self._get(uuid, pynvml.nvmlDeviceGetName, h),
            pci_bus_id=_text(pci.busId) if pci is not None else None,
            serial=self._get(uuid, pynvml.nvmlDeviceGetSerial, h),
        )
        self._identity[index] = identity
        total, used, reserved = self._memory(uuid, h)
        util = self._get(uuid, pynvml.nvmlDeviceGetUtilizationRates, h)
        mig_mode = self._get(uuid, pynvml.nvmlDeviceGetMigMode, h)
        mig_on = bool(mig_mode and mig_mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE)
        remapped = self._get(uuid, pynvml.nvmlDeviceGetRemappedRows, h)
        numa = self._get(uuid, pynvml.nvmlDeviceGetNumaNodeId, h)
        attributes = self._get(uuid, pynvml.nvmlDeviceGetAttributes_v2, h)  # MIG handles only, per nvml.h
        readable, instances, capacity, migs = self._mig(uuid, h) if mig_on else (None, (), None, ())
        processes = self._processes(uuid, h)
        # NVML keeps no utilisation samples of a MIG-enabled GPU.
        usage = _NO_USAGE if mig_on else self._busy(uuid, h, processes)
        # Whole GPUs: NVML has no SM count; take CUDA's (and its memory size), else the model table.
        cuda = None if mig_on else self._cuda_device(uuid, identity.pci_bus_id)
        sms = attributes.multiprocessorCount if attributes is not None else None
        if sms is None and not mig_on:
            sms = cuda.multiprocessor_count if cuda is not None else known_sm_count(identity.name)
        pcie_rx = pcie_tx = None
        if self._pcie:
            pcie_rx = _scaled(self._get(uuid, pynvml.nvmlDeviceGetPcieThroughput, h, pynvml.NVML_PCIE_UTIL_RX_BYTES), _PCIE_KB)
            pcie_tx = _scaled(self._get(uuid, pynvml.nvmlDeviceGetPcieThroughput, h, pynvml.NVML_PCIE_UTIL_TX_BYTES), _PCIE_KB)
        return DeviceReading(
            uuid=uuid,
            index=index,
            name=identity.name,
            pci_bus_id=identity.pci_bus_id,
            serial=identity.serial,
            last_update_timestamp=self._clock(),
            nvml_generation=self._generation,
            memory_total_bytes=total,
            memory_used_bytes=used,
            memory_reserved_bytes=reserved,
            utilization_gpu_ratio=util.gpu / 100 if util is not None else None,
            utilization_memory_ratio=util.memory / 100 if util is not None else None,
            temperature_celsius=self._query(
                uuid,
                ("nvmlDeviceGetTemperatureV", lambda: pynvml.nvmlDeviceGetTemperatureV(h, pynvml.NVML_TEMPERATURE_GPU)),
                ("nvmlDeviceGetTemperature", lambda: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),
            ),
            power_usage_watts=_scaled(self._get(uuid, pynvml.nvmlDeviceGetPowerUsage, h), 1e-3),
            power_limit_watts=_scaled(self._get(uuid, pynvml.nvmlDeviceGetEnforcedPowerLimit, h), 1e-3),
            energy_joules=_scaled(self._get(uuid, pynvml.nvmlDeviceGetTotalEnergyConsumption, h), 1e-3),
            sm_clock_hz=_scaled(self._get(uuid, pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM), 1e6),
            memory_clock_hz=_scaled(self._get(uuid, pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_MEM), 1e6),
            fan_speed_ratio=_scaled(self._get(uuid, pynvml.nvmlDeviceGetFanSpeed, h), 1e-2),
            pcie_rx_bytes_per_second=pcie_rx,
            pcie_tx_bytes_per_second=pcie_tx,
            ecc_corrected_errors=self._ecc(uuid, h, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
            ecc_uncorrected_errors=self._ecc(uuid, h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
            remapped_rows_correctable=remapped[0] if remapped else None,
            remapped_rows_uncorrectable=remapped[1] if remapped else None,
            remapped_rows_pending=bool(remapped[2]) if remapped else None,
            remapped_rows_failure=bool(remapped[3]) if remapped else None,
            retired_pages_single_bit=self._retired(
                uuid, h, pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
            ),
            retired_pages_double_bit=self._retired(uuid, h, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR),
            retired_pages_pending=self._flag(self._get(uuid, pynvml.nvmlDeviceGetRetiredPagesPendingStatus, h)),
            throttle_reasons=self._throttle_reasons(uuid, h),
            mig_mode_current=bool(mig_mode[0]) if mig_mode else None,
            mig_mode_pending=bool(mig_mode[1]) if mig_mode else None,
            mig_layout_readable=readable,
            mig_devices=migs,
            gpu_instances=instances,
            mig_profile_capacity=capacity,
            processes=processes,
            process_utilization=usage.process_utilization,
            process_busy_seconds=usage.process_busy_seconds,
            busy_seconds=usage.busy_seconds,
            busy_unmeasured_seconds=usage.busy_unmeasured_seconds,
            multiprocessor_count=sms,
            allocatable_memory_bytes=cuda.memory_total_bytes if cuda is not None else None,
            numa_node=numa if numa is not None and numa >= 0 else None,
        )

    @staticmethod
    def _flag(value: int | None) -> bool | None:
        return None if value is None else bool(value)

    def _memory(self, where: str, h: Any) -> tuple[int | None, int | None, int | None]:
        """(total, used, reserved) bytes; v1 (old drivers) has no reserved and counts it as used."""
        pynvml = _pynvml()
        memory = self._query(
            where,
            ("nvmlDeviceGetMemoryInfo_v2", lambda: pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)),
            ("nvmlDeviceGetMemoryInfo", lambda: pynvml.nvmlDeviceGetMemoryInfo(h)),
        )
        if memory is None:
            return None, None, None
        return memory.total, memory.used, getattr(memory, "reserved", None)

    def _ecc(self, where: str, h: Any, error_type: int) -> int | None:
        # Aggregate (lifetime) counts: volatile ones reset whenever the driver reloads.
        pynvml = _pynvml()
        return self._get(where, pynvml.nvmlDeviceGetTotalEccErrors, h, error_type, pynvml.NVML_AGGREGATE_ECC)

    def _retired(self, where: str, h: Any, cause: int) -> int | None:
        pages = self._get(where, _pynvml().nvmlDeviceGetRetiredPages, h, cause)
        return None if pages is None else len(pages)

    def _throttle_reasons(self, where: str, h: Any) -> MappingProxyType[str, bool]:
        pynvml = _pynvml()
        current = self._query(
            where,
            ("nvmlDeviceGetCurrentClocksEventReasons", lambda: pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)),
            ("nvmlDeviceGetCurrentClocksThrottleReasons", lambda: pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)),
        )
        if current is None:
            return MappingProxyType({})
        supported = self._query(
            where,
            ("nvmlDeviceGetSupportedClocksEventReasons", lambda: pynvml.nvmlDeviceGetSupportedClocksEventReasons(h)),
            ("nvmlDeviceGetSupportedClocksThrottleReasons", lambda: pynvml.nvmlDeviceGetSupportedClocksThrottleReasons(h)),
        )
        mask = _ALL_REASONS if supported is None else supported
        return MappingProxyType({name: bool(current & bit) for bit, name in THROTTLE_REASONS if mask & bit})

    def _processes(self, where: str, h: Any) -> tuple[GpuProcess, ...] | None:
        """Compute processes (``nvidia-smi --query-compute-apps``); None when unreadable."""
        pynvml = _pynvml()
        processes = self._query(
            where,
            ("nvmlDeviceGetComputeRunningProcesses_v3", lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(h)),
            ("nvmlDeviceGetComputeRunningProcesses_v2", lambda: pynvml.nvmlDeviceGetComputeRunningProcesses_v2(h)),
        )
        if processes is None:
            return None
        return tuple(
            GpuProcess(
                pid=int(p.pid),
                used_memory_bytes=None if p.usedGpuMemory is None else int(p.usedGpuMemory),
                gpu_instance_id=_mig_id(p.gpuInstanceId),
                compute_instance_id=_mig_id(p.computeInstanceId),
            )
            for p in processes
        )

    def _samples(self, call: Callable[[], T], empty: T) -> T:
        """A sample-buffer read; NOT_FOUND (nothing newer than asked) is ``empty``: nothing ran."""
        pynvml = _pynvml()
        try:
            return call()
        except pynvml.NVMLError as exc:
            # SUCCESS from a size probe (raised as an error by the binding): no samples at all.
            if exc.value in (pynvml.NVML_SUCCESS, _NOT_FOUND):
                return empty
            raise

    def _process_samples(self, uuid: str, h: Any, since: int) -> list[tuple[int, int, float]] | None:
        """(µs, pid, SM %) of the per-process samples newer than ``since``; None when unreadable."""
        pynvml = _pynvml()
        found = self._query(
            uuid,
            ("nvmlDeviceGetProcessesUtilizationInfo", lambda: self._samples(lambda: pynvml.nvmlDeviceGetProcessesUtilizationInfo(h, since), [])),
            ("nvmlDeviceGetProcessUtilization", lambda: self._samples(lambda: pynvml.nvmlDeviceGetProcessUtilization(h, since), [])),
        )
        return None if found is None else [(int(x.timeStamp), int(x.pid), float(x.smUtil)) for x in found]

    def _device_samples(self, uuid: str, h: Any, since: int) -> list[tuple[int, float]] | None:
        """(µs, %) of the GPU-utilisation samples newer than ``since``; None when unreadable."""
        pynvml = _pynvml()
        found = self._query(
            uuid,
            ("nvmlDeviceGetSamples",
             lambda: self._samples(lambda: pynvml.nvmlDeviceGetSamples(h, pynvml.NVML_GPU_UTILIZATION_SAMPLES, since), (0, []))),
        )
        if found is None:
            return None
        value_type, samples = found
        member = _VALUE_MEMBERS[value_type] if 0 <= value_type < len(_VALUE_MEMBERS) else "uiVal"
        return [(int(x.timeStamp), float(getattr(x.sampleValue, member))) for x in samples]

    def _busy(self, uuid: str, h: Any, processes: tuple[GpuProcess, ...] | None) -> _BusyReading:
        """Busy time and per-process utilisation from one read of the GPU's sample buffers."""
        usage = self._usage.setdefault(uuid, _Usage())
        # Processes first: a process sample is never newer than the GPU samples read after it.
        proc = self._process_samples(uuid, h, usage.process_seen)
        device = self._device_samples(uuid, h, usage.device_seen or 0)
        utilization = None
        if proc is not None:
            per_pid: dict[int, list[float]] = {}
            for _, pid, value in proc:
                per_pid.setdefault(pid, []).append(value)
            utilization = MappingProxyType({pid: sum(v) / len(v) / 100 for pid, v in per_pid.items()})
        if device is None:
            # No time grid this cycle: both cursors stay, so the next read integrates these samples.
            return _BusyReading(utilization, None, None, None)
        usage.add_device(device)
        busy, unmeasured = usage.busy / _PCT_US_PER_SECOND, usage.unmeasured / 1_000_000
        if proc is None:
            return _BusyReading(None, None, busy, unmeasured)
        usage.add_processes(proc)
        # Processes NVML lists (idle ones at their count) and those sampled; the others are gone.
        current = {pid for _, pid, _ in proc} | ({p.pid for p in processes} if processes is not None else set(usage.processes))
        usage.processes = {pid: usage.processes.get(pid, 0) for pid in current}
        per_process = MappingProxyType({pid: count / _PCT_US_PER_SECOND for pid, count in sorted(usage.processes.items())})
        return _BusyReading(utilization, per_process, busy, unmeasured)

    # -- MIG -------------------------------------------------------------------------------

    def _mig(
        self, uuid: str, h: Any
    ) -> tuple[bool | None, tuple[GpuInstanceReading, ...], tuple[MigProfileCapacity, ...] | None, tuple[MigDeviceReading, ...]]:
        """(layout readable, GPU instances, profile capacity, MIG devices) of a MIG-enabled GPU."""
        pynvml = _pynvml()
        readable, instances, capacity = self._geometry(uuid, h)
        by_id = {gi.gpu_instance_id: gi for gi in instances}
        devices = []
        for mig_index in range(self._get(uuid, pynvml.nvmlDeviceGetMaxMigDeviceCount, h) or 0):
            try:
                m = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, mig_index)
            except pynvml.NVMLError as exc:
                if exc.value not in (_NOT_FOUND, _INVALID_ARGUMENT):  # indices can be sparse
                    self._raise_if_gone(exc, "nvmlDeviceGetMigDeviceHandleByIndex")
                    self._note(uuid, f"MIG device {mig_index}", exc)
                continue
            device = self._mig_device(uuid, m, mig_index, by_id)
            if device is not None:
                devices.append(device)
        return readable, instances, capacity, tuple(devices)

    def _mig_device(self, parent: str, m: Any, mig_index: int, instances: dict[int, GpuInstanceReading]) -> MigDeviceReading | None:
        pynvml = _pynvml()
        where = f"{parent} MIG {mig_index}"
        uuid = self._get(where, pynvml.nvmlDeviceGetUUID, m)
        if uuid is None:
            return None
        name = self._get(uuid, pynvml.nvmlDeviceGetName, m) or ""
        gi_id = self._get(uuid, pynvml.nvmlDeviceGetGpuInstanceId, m)
        gi = instances.get(gi_id) if gi_id is not None else None
        total, used, _ = self._memory(uuid, m)
        attributes = self._get(uuid, pynvml.nvmlDeviceGetAttributes_v2, m)
        # The name ends in the profile ("… MIG 1g.10gb", or "1c.3g.20gb" with several CIs per GI),
        # as nvidia-smi shows it; the GI's profile is the fallback.
        profile = name.rpartition(" MIG ")[2] if " MIG " in name else (gi.profile if gi else None)
        return MigDeviceReading(
            uuid=uuid,
            parent_uuid=parent,
            index=mig_index,
            profile=profile,
            gpu_instance_id=gi_id,
            compute_instance_id=self._get(uuid, pynvml.nvmlDeviceGetComputeInstanceId, m),
            placement=gi.placement if gi else None,
            memory_total_bytes=total,
            memory_used_bytes=used,
            multiprocessor_count=attributes.multiprocessorCount if attributes is not None else None,
            processes=self._processes(uuid, m),
        )

    def _geometry(
        self, uuid: str, h: Any
    ) -> tuple[bool | None, tuple[GpuInstanceReading, ...], tuple[MigProfileCapacity, ...] | None]:
        """GPU instances and per-profile capacity (``nvidia-smi mig -lgi``, ``-lgip``, ``-lgipp``).

        Needs the mig/monitor capability: NO_PERMISSION gives (False, (), None).
        """
        pynvml = _pynvml()
        try:
            profiles = self._profiles.get(uuid)
            if profiles is None:
                profiles = self._profiles[uuid] = self._read_profiles(h)
            instances: list[GpuInstanceReading] = []
            capacity: list[MigProfileCapacity] = []
            for p in profiles:
                handles = (pynvml.c_nvmlGpuInstance_t * p.instance_count)()
                count = ctypes.c_uint(0)
                pynvml.nvmlDeviceGetGpuInstances(h, p.profile_id, handles, ctypes.byref(count))
                for k in range(count.value):
                    info = pynvml.nvmlGpuInstanceGetInfo(handles[k])
                    placement = MigPlacement(info.placement.start, info.placement.size)
                    instances.append(GpuInstanceReading(info.id, info.profileId, p.name, placement))
                capacity.append(
                    MigProfileCapacity(
                        profile_id=p.profile_id,
                        name=p.name,
                        slice_count=p.slice_count,
                        instance_count=p.instance_count,
                        memory_bytes=p.memory_bytes,
                        multiprocessor_count=p.multiprocessor_count,
                        remaining=pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h, p.profile_id),
                        placements=p.placements,
                    )
                )
        except pynvml.NVMLError as exc:
            self._raise_if_gone(exc, "MIG geometry")
            if exc.value == _NO_PERMISSION:
                self._note(uuid, "MIG layout unreadable (needs the mig/monitor capability)", exc, logging.INFO)
                return False, (), None
            self._note(uuid, "MIG geometry", exc)
            return None, (), None
        instances.sort(key=lambda gi: gi.gpu_instance_id)
        return True, tuple(instances), tuple(capacity)

    def _read_profiles(self, h: Any) -> tuple[_Profile, ...]:
        """The GPU-instance profiles this GPU offers, with their legal placements (static per GPU)."""
        pynvml = _pynvml()
        profiles = []
        for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                info, name = self._profile_info(h, index)
            except pynvml.NVMLError as exc:
                if exc.value in (_NOT_SUPPORTED, _INVALID_ARGUMENT):  # no such profile on this SKU
                    continue
                raise
            count = ctypes.c_uint(0)
            pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, info.id, None, ctypes.byref(count))
            placements = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
            pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, info.id, placements, ctypes.byref(count))
            profiles.append(
                _Profile(
                    index=index,
                    profile_id=info.id,
                    name=name,
                    slice_count=info.sliceCount,
                    instance_count=info.instanceCount,
                    memory_bytes=info.memorySizeMB * 1024**2,
                    multiprocessor_count=info.multiprocessorCount,
                    placements=tuple(MigPlacement(p.start, p.size) for p in placements[: count.value]),
                )
            )
        return tuple(profiles)

    def _profile_info(self, h: Any, index: int) -> tuple[Any, str]:
        """Profile info and its name ("1g.10gb"); drivers without the V call get a computed name."""
        pynvml = _pynvml()
        if "nvmlDeviceGetGpuInstanceProfileInfoV" not in self._missing:
            try:
                info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, index)
                return info, _text(info.name).removeprefix("MIG ")
            except pynvml.NVMLError as exc:
                if exc.value != _FUNCTION_NOT_FOUND:
                    raise
                self._missing.add("nvmlDeviceGetGpuInstanceProfileInfoV")
        info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, index, version=1)
        # What nvidia-smi prints: compute slices, memory rounded up to whole GB, "+me" variants.
        name = f"{info.sliceCount}g.{math.ceil(info.memorySizeMB / 1024)}gb{'+me' if index in _PROFILE_REV1 else ''}"
        return info, name

    # -- XID events ------------------------------------------------------------------------

    def _watch_xids(self, stop: threading.Event) -> None:
        """Count XID events until ``stop`` is set or the driver goes away."""
        pynvml = _pynvml()
        try:
            events = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            self._note("driver", "XID events unavailable", exc)
            return
        try:
            uuids = self._register_xids(events)
            while uuids and not stop.is_set():
                try:
                    data = pynvml.nvmlEventSetWait(events, self._event_wait_ms)
                except pynvml.NVMLError as exc:
                    if exc.value == _TIMEOUT:
                        continue
                    if exc.value in _SOURCE_GONE:
                        return  # prepare() re-initialises and starts a new watcher
                    self._note("driver", "nvmlEventSetWait", exc)
                    stop.wait(self._event_wait_ms / 1000)  # no busy loop on a persistent error
                    continue
                if data.eventType & pynvml.nvmlEventTypeXidCriticalError:
                    # By handle address: a lost GPU (XID 79) can no longer tell its UUID.
                    uuid = uuids.get(ctypes.cast(data.device, ctypes.c_void_p).value)
                    if uuid is not None:
                        gi = getattr(data, "gpuInstanceId", _NO_ID)
                        self._count_xid(uuid, int(data.eventData), None if gi in (_NO_ID, None) else int(gi))
        finally:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlEventSetFree(events)

    def _register_xids(self, events: Any) -> dict[int | None, str]:
        pynvml = _pynvml()
        uuids: dict[int | None, str] = {}
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError:
            return uuids
        for index in range(count):
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(index)
                uuid = pynvml.nvmlDeviceGetUUID(h)
                pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, events)
            except pynvml.NVMLError as exc:
                level = logging.DEBUG if exc.value == _NOT_SUPPORTED else logging.WARNING
                self._note(f"GPU {index}", "XID event registration", exc, level)
                continue
            uuids[ctypes.cast(h, ctypes.c_void_p).value] = uuid
        return uuids

    def _count_xid(self, uuid: str, xid: int, gpu_instance_id: int | None = None) -> None:
        with self._lock:
            previous = self._xids.get((uuid, xid))
            count = previous.count + 1 if previous else 1
            scopes = ((previous.gpu_instance_ids if previous else ()) + (gpu_instance_id,))[-XID_SCOPES_KEPT:]
            self._xids[(uuid, xid)] = XidCounter(uuid, xid, count, self._clock(), scopes)
