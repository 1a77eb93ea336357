"""The background sampler: calls a telemetry source under deadlines and publishes snapshots.

A *source* (``nvml``, ``mock`` or ``none``) reads devices; a :class:`TelemetrySampler` calls it
on a background thread every ``interval_s`` and publishes one immutable
:class:`TelemetrySnapshot`. Scrapes only ever read the last published snapshot, so a scrape
never waits for the driver.

NVML calls have no timeout and can block forever in the kernel (a wedged driver leaves them in
uninterruptible sleep, with no error). Every call
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
from collections.abc import Callable, Hashable
from typing import Any

from exporter.telemetry.model import (
    DeviceReading,
    SourceInfo,
    TelemetrySnapshot,
    TelemetrySource,
    TelemetryUnavailable,
)

__all__ = ["TelemetrySampler"]

log = logging.getLogger(__name__)

# Cap on the re-init backoff after the driver went away.
MAX_BACKOFF_S = 60.0


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
        self._listeners: tuple[Callable[[], None], ...] = ()
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

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` after each published snapshot (quick, non-blocking: an event's ``set``)."""
        self._listeners += (listener,)

    def published(self) -> tuple[int, TelemetrySnapshot]:
        """(version, snapshot) of the last publication, read together."""
        with self._cond:
            return self._version, self._snapshot

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
                    reading = self._last[key] = self._keep_energy(self._last.get(key), reading)
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
    def _keep_energy(last: DeviceReading | None, reading: DeviceReading) -> DeviceReading:
        """A GPU that stops answering (lost, reset required) keeps its energy counter at the last
        value read: a counter must not vanish with its device, or the joules read last before
        the loss, which the accounting already split among the kernels, never reach a scrape."""
        if (reading.up or reading.energy_joules is not None or last is None or last.energy_joules is None
                or last.uuid != reading.uuid or last.nvml_generation != reading.nvml_generation):
            return reading
        return dataclasses.replace(reading, energy_joules=last.energy_joules)

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
        for listener in self._listeners:
            listener()
