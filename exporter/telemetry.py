"""Device telemetry: the data model, the source protocol and the background sampler.

A *source* (``nvml``, ``mock`` or ``none``) reads devices; a :class:`TelemetrySampler` calls it
on a background thread every ``interval_s`` and publishes one immutable
:class:`TelemetrySnapshot`. Scrapes only ever read the last published snapshot, so a scrape
never waits for the driver.

NVML calls have no timeout and can block forever in the kernel (nvml-mig.md §6). Every call
path of a blocking source therefore runs on a worker thread under a deadline:

- ``prepare()`` (init, versions, device list) and each ``read_device(key)`` are separate jobs;
- a job that misses its deadline is *abandoned*: its worker stays stuck in C (Python cannot
  kill it) and a fresh worker takes the next job, so the other devices keep flowing;
- the stuck device is published as its last reading with ``up=False, stale=True`` and is not
  asked again until the stuck call returns (never two calls stuck on one device);
- at most ``max_blocked_calls`` abandoned workers may exist at once; beyond that the sampler
  stops starting threads and reports every device stale, so the thread count stays bounded
  (normally: the sampler loop, one worker, and the NVML source's XID thread).

Units are base units throughout (bytes, watts, joules, hertz, degrees Celsius, 0-1 ratios).
``None`` means unsupported or unknown; it is never NaN and never 0.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

__all__ = [
    "DeviceReading",
    "GpuInstanceReading",
    "GpuProcess",
    "MigDeviceReading",
    "MigPlacement",
    "MigProfileCapacity",
    "NullSource",
    "SourceInfo",
    "TelemetrySampler",
    "TelemetrySnapshot",
    "TelemetrySource",
    "TelemetryUnavailable",
    "XidCounter",
    "open_source",
]

log = logging.getLogger(__name__)

SOURCE_KINDS = ("auto", "nvml", "mock", "none")
# Cap on the re-init backoff after the driver went away.
MAX_BACKOFF_S = 60.0


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
    multiprocessor_count: int | None = None  # SMs; NVML reports it for MIG devices only
    numa_node: int | None = None


@dataclass(frozen=True, slots=True)
class XidCounter:
    """How many XID events of one code a GPU raised since the exporter started, and when last."""

    device_uuid: str
    xid: int
    count: int
    last_seen_timestamp: float


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


def open_source(
    kind: str,
    *,
    mock_file: Path | None = None,
    pcie: bool = False,
    log: logging.Logger = log,
) -> TelemetrySource:
    """Create the telemetry source named by ``--telemetry.source``.

    :param kind: ``auto`` (NVML when ``nvmlInit`` works, else ``none``), ``nvml``, ``mock`` or ``none``.
    :param mock_file: the device TOML for ``mock`` (Backend.AI's mock-accelerator.toml format).
    :param pcie: read PCIe throughput (NVML blocks ~20 ms per counter and GPU to sample it).
    :raises exporter.mock_source.MockConfigError: the mock file is missing or invalid (a
        ``ConfigError``: the CLI exits with status 2).
    :raises ValueError: unknown kind, or ``mock`` without a file (settings validation prevents both).
    """
    if kind not in SOURCE_KINDS:
        raise ValueError(f"unknown telemetry source {kind!r} (expected one of {', '.join(SOURCE_KINDS)})")
    if kind == "mock":
        if mock_file is None:
            raise ValueError("telemetry source 'mock' needs a device file")
        from exporter.mock_source import MockSource

        source: TelemetrySource = MockSource(mock_file)
        log.info("telemetry source: mock devices from %s", mock_file)
        return source
    if kind == "none":
        log.info("telemetry source: none")
        return NullSource()

    from exporter import nvml

    if kind == "auto":
        problem = nvml.probe()
        if problem is not None:
            log.info("telemetry source: none (NVML unavailable: %s)", problem)
            return NullSource()
    log.info("telemetry source: nvml (%s)", nvml.binding_path())
    return nvml.NvmlSource(pcie=pcie)


class _Blocked(Exception):
    """A call path missed its deadline, or an earlier call on it is still stuck."""


class _Job:
    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.result: Any = None
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except Exception as exc:  # handed to the waiting caller, re-raised there
            self.error = exc
        finally:
            self.done.set()


class _Worker(threading.Thread):
    """Runs jobs one at a time; exits on a ``None`` job (queued on close or abandonment)."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name, daemon=True)  # daemon: a thread stuck in C must not block exit
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()

    def run(self) -> None:
        while (job := self.jobs.get()) is not None:
            job.run()


class _DeadlineRunner:
    """Runs calls on a worker thread and gives up on them after ``timeout_s``."""

    def __init__(self, timeout_s: float, max_blocked: int, name: str) -> None:
        self._timeout = timeout_s
        self._max_blocked = max_blocked
        self._name = name
        self._worker: _Worker | None = None
        self._abandoned: list[_Worker] = []
        self._spawned = 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> _Job:
        """Run ``fn(*args)``; returns the job once done, or raises :class:`_Blocked` with the
        stuck job as its argument when the deadline passes."""
        if self._worker is None:
            self._abandoned = [w for w in self._abandoned if w.is_alive()]
            if len(self._abandoned) >= self._max_blocked:
                raise _Blocked(None)
            self._spawned += 1
            self._worker = _Worker(f"{self._name}-{self._spawned}")
            self._worker.start()
        job = _Job(fn, args)
        self._worker.jobs.put(job)
        if not job.done.wait(self._timeout):
            # The worker exits by itself once the stuck call returns.
            self._worker.jobs.put(None)
            self._abandoned.append(self._worker)
            self._worker = None
            raise _Blocked(job)
        return job

    def close(self, join_timeout: float) -> None:
        workers = [*self._abandoned, *([self._worker] if self._worker else [])]
        if self._worker is not None:
            self._worker.jobs.put(None)
            self._worker = None
        for worker in workers:
            worker.join(join_timeout)
            if worker.is_alive():
                log.warning("telemetry worker %s is still blocked in a driver call", worker.name)


class TelemetrySampler:
    """Samples a source on a background thread and publishes immutable snapshots.

    Sampling starts at construction; the first cycle runs at once. The sampler owns the source
    and closes it in :meth:`close`. Use as a context manager in tests.

    :param source: what to sample.
    :param interval_s: seconds between cycle starts (``--telemetry.interval``).
    :param timeout_s: deadline per call path: ``prepare`` and each device (``--telemetry.timeout``).
    :param clock: wall clock for timestamps (injectable).
    :param max_blocked_calls: abandoned, still-stuck workers tolerated before giving up threads.
    """

    def __init__(
        self,
        source: TelemetrySource,
        interval_s: float = 5.0,
        timeout_s: float = 2.0,
        clock: Callable[[], float] = time.time,
        *,
        max_blocked_calls: int = 2,
    ) -> None:
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError("interval and timeout must be positive")
        self._source = source
        self._interval = interval_s
        self._timeout = timeout_s
        self._clock = clock
        self._runner = _DeadlineRunner(timeout_s, max_blocked_calls, f"telemetry-{source.name}")
        self._stuck: dict[Hashable, _Job] = {}  # call path -> the job still blocked on it
        self._last: dict[Hashable, DeviceReading] = {}
        self._failures = 0
        self._last_success: float | None = None
        self._last_error: str | None = None
        self._cond = threading.Condition()
        self._snapshot = TelemetrySnapshot(source=source.name, error="not sampled yet")
        self._version = 0
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"telemetry-sampler-{source.name}", daemon=True)
        self._thread.start()

    @property
    def source_name(self) -> str:
        return self._source.name

    @property
    def version(self) -> int:
        """Incremented on every published snapshot."""
        return self._version

    def latest(self) -> TelemetrySnapshot:
        """The last published snapshot; never blocks on the source."""
        return self._snapshot

    def wait_for_version(self, version: int, timeout: float) -> bool:
        """Wait until a snapshot newer than ``version`` is published; False on timeout or when
        the sampler is closed (so a waiting thread can stop promptly)."""
        with self._cond:
            self._cond.wait_for(lambda: self._version > version or self._stop.is_set(), timeout)
            return self._version > version

    def close(self) -> None:
        """Stop sampling, close the source and join every thread this sampler started."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join()
        try:
            self._call("close", self._source.close)
        except _Blocked:
            log.warning("telemetry source %s: close() blocked; left behind", self._source.name)
        except Exception:
            log.exception("telemetry source %s: close() failed", self._source.name)
        self._runner.close(join_timeout=self._timeout)

    def __enter__(self) -> TelemetrySampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                ok = self._cycle()
            except Exception:  # a bug must not end the thread and freeze the metrics
                log.exception("telemetry cycle failed")
                ok = False
            delay = self._interval
            if not ok:
                delay = min(self._interval * 2 ** min(self._failures, 16), max(MAX_BACKOFF_S, self._interval))
            self._stop.wait(max(0.0, started + delay - time.monotonic()))

    def _call(self, path: Hashable, fn: Callable[..., Any], *args: Any) -> Any:
        if not self._source.may_block:
            return fn(*args)
        stuck = self._stuck.get(path)
        if stuck is not None:
            if not stuck.done.is_set():
                raise _Blocked(stuck)
            del self._stuck[path]
        try:
            job = self._runner.submit(fn, *args)
        except _Blocked as exc:
            if exc.args[0] is not None:
                self._stuck[path] = exc.args[0]
            raise
        if job.error is not None:
            raise job.error
        return job.result

    def _cycle(self) -> bool:
        """One sampling cycle; returns False when the source was unavailable."""
        started = time.perf_counter()
        try:
            self._sample(started)
        except TelemetryUnavailable as exc:
            self._last.clear()
            self._failures += 1
            self._publish(started, success=False, error=str(exc))
            return False
        return True

    def _sample(self, started: float) -> None:
        try:
            info: SourceInfo = self._call("prepare", self._source.prepare)
        except _Blocked:
            # Not a failure to back off from: the stuck call is not retried until it returns.
            self._publish(
                started,
                success=False,
                error=f"driver calls blocked for more than {self._timeout:g}s",
                devices=tuple(self._stale(r) for r in self._last.values()),
            )
            return
        devices: list[DeviceReading] = []
        for key in info.device_keys:
            if self._stop.is_set():  # close() waits for this cycle; each stuck device costs a timeout
                return
            try:
                reading = self._call(key, self._source.read_device, key)
            except _Blocked:
                reading = self._stale(self._last[key]) if key in self._last else None
            except TelemetryUnavailable:
                raise
            except Exception:
                log.exception("telemetry source %s: reading device %s failed", self._source.name, key)
                reading = self._stale(self._last[key]) if key in self._last else None
            else:
                if reading is not None:
                    self._last[key] = reading
            if reading is not None:
                devices.append(reading)
        for gone in set(self._last) - set(info.device_keys):
            del self._last[gone]
        self._failures = 0
        self._last_success = self._clock()
        self._publish(
            started,
            success=True,
            devices=tuple(devices),
            driver_version=info.driver_version,
            cuda_version=info.cuda_version,
            device_count=info.device_count,
        )

    @staticmethod
    def _stale(reading: DeviceReading) -> DeviceReading:
        return dataclasses.replace(reading, up=False, stale=True)

    def _publish(self, started: float, *, success: bool, **fields: Any) -> None:
        error = fields.get("error")
        if error != self._last_error:  # log transitions, not every failed cycle
            if error is not None:
                log.warning("telemetry source %s: %s", self._source.name, error)
            elif self._last_error is not None:
                log.info("telemetry source %s: sampling again", self._source.name)
            self._last_error = error
        snapshot = TelemetrySnapshot(
            source=self._source.name,
            success=success,
            duration_seconds=time.perf_counter() - started,
            timestamp=self._clock(),
            last_success_timestamp=self._last_success,
            xid_errors=self._source.xid_counters(),
            **fields,
        )
        with self._cond:
            self._snapshot = snapshot
            self._version += 1
            self._cond.notify_all()
