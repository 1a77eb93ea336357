"""Device health that stays until it is fixed.

Each GPU is ``ok``, ``degraded``, ``needs_reset``, ``lost`` or ``unknown``. A fault *latches*:
a critical XID (:mod:`exporter.analysis.xid` says which and how bad), a new uncorrectable ECC
error, a pending or failed row remap, a pending page retirement, a GPU that stopped answering
(``GPU_IS_LOST``) or that the driver no longer lists. The latch holds, whatever later readings
say, until a remedy is seen:

* a GPU reset: the device re-enumerates (it was missing from the driver's list and is back, or
  its PCI bus id changed), its serial changes (another board), or its energy counter, which
  counts from the driver's initialisation of the GPU, goes back;
* a driver reload: the driver version changes, or the NVML session had to be initialised again;
* a reboot: ``/proc/sys/kernel/random/boot_id`` differs from the one the latch was taken under.

Latches are kept in a small state file (:class:`HealthStore`), so an exporter restart neither
forgets a broken GPU nor, after a reboot, keeps a fixed one. ``unknown`` is never latched: it
is a GPU whose telemetry call missed the sampler's deadline (``stale``) or a node whose driver
cannot be read, and it ends with the next good reading.

MIG: an XID that names a GPU instance reaches the kernels of that instance only (and kernels
that hold the whole GPU); any other fault reaches every kernel on the GPU.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from exporter.analysis.xid import CATALOGUE_VERSION, xid_info
from exporter.files import FileReadError, read_text
from exporter.scratch.allocation import Kernel
from exporter.telemetry.devices import DeviceResolver
from exporter.telemetry.model import DeviceReading, MigDeviceReading, TelemetrySnapshot

__all__ = [
    "MAX_STATE_BYTES",
    "DeviceHealth",
    "HealthReport",
    "HealthState",
    "HealthStore",
    "HealthTracker",
    "KernelRef",
    "parse_boot_id",
]

log = logging.getLogger(__name__)

MAX_STATE_BYTES = 64 * 1024  # the state file holds a few hundred bytes per latched GPU
_MAX_DEVICES = 64  # latches kept (a node has at most a few dozen GPUs)
_MAX_REASON = 200  # characters of a reason kept
_FORMAT = 1  # the state file's format version


class HealthState(str, Enum):
    """A device's health (the ``state`` label); the latched states in rising severity."""

    OK = "ok"
    DEGRADED = "degraded"
    NEEDS_RESET = "needs_reset"
    LOST = "lost"
    UNKNOWN = "unknown"


_SEVERITY = {HealthState.DEGRADED: 1, HealthState.NEEDS_RESET: 2, HealthState.LOST: 3}


def parse_boot_id(text: str) -> str | None:
    """The boot id in ``/proc/sys/kernel/random/boot_id``'s text, or None when it names none."""
    value = text.strip()
    return value if 0 < len(value) <= 64 and value.isprintable() else None


@dataclass(frozen=True, slots=True, order=True)
class KernelRef:
    """A kernel a device's fault reaches, with its session and owner (``undefined`` when unread)."""

    kernel_id: str
    session_id: str
    user_id: str


@dataclass(frozen=True, slots=True)
class DeviceHealth:
    """One GPU's health now.

    :param since: unix time the device entered ``state``.
    :param reason: what latched it (``"XID 79"``, ``"row remap pending"``); empty when ok.
    :param xid: the XID that latched it, when one did (its meaning: :func:`~exporter.analysis.xid.xid_info`).
    :param gpu_instances: the GPU instances an XID named; None: the whole GPU.
    :param kernels: the kernels the fault reaches (empty when ok).
    """

    device_id: str
    uuid: str
    state: HealthState
    since: float
    reason: str = ""
    xid: int | None = None
    gpu_instances: tuple[int, ...] | None = None
    kernels: tuple[KernelRef, ...] = ()


@dataclass(frozen=True, slots=True)
class HealthReport:
    """Every known GPU's health (the read model's ``health``)."""

    devices: tuple[DeviceHealth, ...]
    catalogue_version: str = CATALOGUE_VERSION


@dataclass(slots=True)
class _Latch:
    state: HealthState
    since: float
    reason: str
    device_id: str
    xid: int | None = None
    scopes: tuple[int, ...] | None = None  # GPU instances; None: the whole GPU
    driver: str | None = None
    energy: float | None = None  # joules when latched (or last seen before): lower later = reset
    pci_bus_id: str | None = None
    serial: str | None = None
    generation: int | None = None  # NVML initialisation, this process only (never persisted)

    def document(self) -> dict[str, Any]:
        return {
            "state": self.state.value, "since": self.since, "reason": self.reason, "device_id": self.device_id,
            "xid": self.xid, "scopes": list(self.scopes) if self.scopes is not None else None,
            "driver": self.driver, "energy": self.energy, "pci_bus_id": self.pci_bus_id, "serial": self.serial,
        }

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> _Latch:
        state = HealthState(doc["state"])
        if state not in _SEVERITY:
            raise ValueError("not a latched state")
        scopes = doc.get("scopes")
        return cls(
            state, float(doc["since"]), str(doc.get("reason", ""))[:_MAX_REASON], str(doc["device_id"]),
            None if doc.get("xid") is None else int(doc["xid"]),
            None if scopes is None else tuple(int(s) for s in scopes[:16]),
            _opt_str(doc.get("driver")), None if doc.get("energy") is None else float(doc["energy"]),
            _opt_str(doc.get("pci_bus_id")), _opt_str(doc.get("serial")),
        )


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)[:_MAX_REASON]


class HealthStore:
    """The state file of latched faults: JSON, at most :data:`MAX_STATE_BYTES`, written to a
    temporary file beside it and renamed over it, so a crash leaves the old or the new one.

    A missing file is a fresh start; a corrupt, oversized or unreadable one is one log line and
    a fresh start; a failed write is one log line (repeated only after a write succeeded again),
    and the exporter carries on with what it holds in memory.

    :param path: the file (``--health.state-file``); None: latches live in memory only.
    """

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = None if path is None else os.fspath(path)
        self._write_failed = False

    def load(self) -> dict[str, Any] | None:
        """The stored document, or None (none, or not usable)."""
        if self.path is None or not os.path.lexists(self.path):
            return None
        try:
            doc = json.loads(read_text(self.path, MAX_STATE_BYTES))
            if not isinstance(doc, dict) or doc.get("format") != _FORMAT or not isinstance(doc.get("devices"), dict):
                raise ValueError("not a health state document")
            return doc
        except FileReadError as exc:
            log.warning("health state file %s; starting afresh", exc)
        except ValueError as exc:  # json.JSONDecodeError too
            log.warning("health state file %s: unreadable (%s); starting afresh", self.path, str(exc).split(":")[0])
        return None

    def save(self, doc: Mapping[str, Any]) -> bool:
        """Write ``doc`` atomically; False when it could not be written (logged once)."""
        if self.path is None:
            return True
        data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        tmp = None
        try:
            if len(data) > MAX_STATE_BYTES:
                raise OSError("state larger than the limit")
            directory = os.path.dirname(self.path) or "."
            fd, tmp = tempfile.mkstemp(prefix=".health-", suffix=".tmp", dir=directory)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            tmp = None
        except OSError as exc:
            if not self._write_failed:
                log.warning("health state file %s: cannot be written (%s); latches are kept in memory only",
                            self.path, exc.strerror or exc)
            self._write_failed = True
            return False
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        self._write_failed = False
        return True


@dataclass(slots=True)
class _Seen:
    """What this process last saw of a GPU (never persisted)."""

    device_id: str
    since: float
    energy: float | None = None
    ecc_uncorrected: int | None = None
    absent: bool = False
    xids: dict[int, int] = field(default_factory=dict)
    state: HealthState | None = None  # the unlatched state last reported


class HealthTracker:
    """Latches faults per GPU from each telemetry sample and clears them on a remedy.

    Not thread-safe: the analysis pipeline's usage stage calls :meth:`update`.

    :param store: the state file.
    :param boot_id: this boot's id (:func:`parse_boot_id` of ``/proc/sys/kernel/random/boot_id``);
        None: unknown, so a reboot cannot be told and stored latches are kept.
    :param clock: unix time.
    """

    def __init__(self, store: HealthStore, boot_id: str | None, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._boot_id = boot_id
        self._clock = clock
        self._latches: dict[str, _Latch] = {}
        self._seen: dict[str, _Seen] = {}
        self._holders = _HolderCache({}, None)
        doc = store.load()
        if doc is not None:
            if boot_id is not None and doc.get("boot_id") not in (None, boot_id):
                log.info("health: a new boot since the state file was written; latched faults are cleared")
                self._save()
            else:
                self._latches = _read_latches(doc["devices"])

    @property
    def latched(self) -> Mapping[str, HealthState]:
        """GPU uuid -> latched state (for logs and tests)."""
        return {uuid: latch.state for uuid, latch in self._latches.items()}

    def update(self, snapshot: TelemetrySnapshot, kernels: Mapping[str, Kernel], resolver: DeviceResolver) -> HealthReport:
        """The health of every GPU this sample shows or a latch remembers."""
        now = self._clock()
        changed = False
        present = {r.uuid: r for r in snapshot.devices}
        xids: dict[str, dict[int, tuple[int, tuple[int | None, ...]]]] = {}
        for x in snapshot.xid_errors:
            xids.setdefault(x.device_uuid, {})[x.xid] = (x.count, x.gpu_instance_ids)
        for uuid, reading in present.items():
            changed |= self._observe(reading, resolver.label(reading), snapshot.driver_version, xids.get(uuid, {}), now)
        if snapshot.success:
            # Off the list only when every GPU the driver counts was identified: one it counts but
            # cannot identify is lost, not gone, and its return is no re-enumeration.
            enumerated = snapshot.device_count is None or snapshot.device_count <= len(present)
            for uuid, seen in self._seen.items():
                if uuid not in present and not seen.absent:
                    seen.absent = enumerated
                    reason = "the driver no longer lists the GPU" if enumerated else "the GPU cannot be identified"
                    changed |= self._latch(uuid, HealthState.LOST, reason, seen.device_id, now, None, None, None, None)
            for uuid, latch in self._latches.items():
                if uuid not in present and uuid not in self._seen:  # latched before a restart, missing since
                    self._seen[uuid] = _Seen(latch.device_id, latch.since, absent=enumerated)
        if changed:
            self._save()
        return HealthReport(self._report(snapshot, present, kernels, resolver, now))

    # -- per device ---------------------------------------------------------------------------

    def _observe(self, r: DeviceReading, label: str, driver: str | None, xids: Mapping[int, tuple[int, tuple]],
                 now: float) -> bool:
        seen = self._seen.get(r.uuid)
        fresh = r.up and not r.stale
        changed = False
        latch = self._latches.get(r.uuid)
        if latch is not None and fresh:
            remedy = self._remedy(latch, r, driver, seen)
            if remedy:
                log.info("health: GPU %s %s was %s (%s) since %s: cleared by %s", label, r.uuid, latch.state.value,
                         latch.reason, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(latch.since)), remedy)
                del self._latches[r.uuid]
                changed = True
                if seen is not None:
                    seen.since, seen.xids = now, {x: c for x, (c, _) in xids.items()}
        if seen is None:
            seen = self._seen[r.uuid] = _Seen(label, now)
        seen.device_id, seen.absent = label, False
        if r.energy_joules is not None and fresh:
            seen.energy = r.energy_joules
        # XID counters count since the exporter started: any increase is a new event.
        for xid, (count, scopes) in sorted(xids.items()):
            new = count - seen.xids.get(xid, 0)
            seen.xids[xid] = count
            info = xid_info(xid)
            if new <= 0 or info.effect == "none":
                continue
            recent = scopes[-new:] if scopes else ()
            scope = None if not recent or any(s is None for s in recent) else tuple(sorted(set(recent)))  # type: ignore[arg-type]
            changed |= self._latch(r.uuid, HealthState(info.effect), f"XID {xid}", label, now, xid, scope, r, driver)
        if fresh:
            faults = []
            if r.ecc_uncorrected_errors is not None:
                if seen.ecc_uncorrected is not None and r.ecc_uncorrected_errors > seen.ecc_uncorrected:
                    faults.append("uncorrectable ECC error")
                seen.ecc_uncorrected = r.ecc_uncorrected_errors
            if r.remapped_rows_failure:
                faults.append("row remap failed")
            if r.remapped_rows_pending:
                faults.append("row remap pending")
            if r.retired_pages_pending:
                faults.append("page retirement pending")
            for reason in faults:
                changed |= self._latch(r.uuid, HealthState.NEEDS_RESET, reason, label, now, None, None, r, driver)
        elif not r.up and not r.stale:
            changed |= self._latch(r.uuid, HealthState.LOST, "the GPU does not answer (GPU is lost)", label, now,
                                   None, None, r, driver)
        return changed

    def _remedy(self, latch: _Latch, r: DeviceReading, driver: str | None, seen: _Seen | None) -> str | None:
        if latch.driver is not None and driver is not None and driver != latch.driver:
            return f"a driver reload (driver {latch.driver} -> {driver})"
        if latch.generation is not None and r.nvml_generation is not None and r.nvml_generation != latch.generation:
            return "a driver reload (NVML initialised again)"
        if seen is not None and seen.absent:
            return "a GPU reset (the GPU was enumerated again)"
        if latch.pci_bus_id is not None and r.pci_bus_id is not None and r.pci_bus_id != latch.pci_bus_id:
            return "a GPU reset (new PCI bus id)"
        if latch.serial is not None and r.serial is not None and r.serial != latch.serial:
            return "a board replacement (new serial)"
        before = seen.energy if seen is not None and seen.energy is not None else latch.energy
        if before is not None and r.energy_joules is not None and r.energy_joules < before:
            return "a GPU reset (the energy counter restarted)"
        return None

    def _latch(self, uuid: str, state: HealthState, reason: str, label: str, now: float, xid: int | None,
               scope: tuple[int, ...] | None, r: DeviceReading | None, driver: str | None) -> bool:
        old = self._latches.get(uuid)
        if old is not None and _SEVERITY[state] <= _SEVERITY[old.state]:
            # No worse than what holds: the first cause stays named; the fault may reach further.
            merged = None if old.scopes is None or scope is None else tuple(sorted(set(old.scopes) | set(scope)))
            if merged == old.scopes:
                return False
            old.scopes = merged
            return True
        if old is None and len(self._latches) >= _MAX_DEVICES:
            return False
        seen = self._seen.get(uuid)
        energy = (r.energy_joules if r is not None and r.energy_joules is not None
                  else seen.energy if seen is not None else old.energy if old is not None else None)
        since = old.since if old is not None and old.state is state else now
        self._latches[uuid] = _Latch(
            state, since, reason[:_MAX_REASON], label, xid, scope,
            driver or (old.driver if old else None), energy,
            (r.pci_bus_id if r is not None else None) or (old.pci_bus_id if old else None),
            (r.serial if r is not None else None) or (old.serial if old else None),
            (r.nvml_generation if r is not None else None) or (old.generation if old else None),
        )
        if old is None or old.state is not state:
            log.warning("health: GPU %s %s is %s: %s", label, uuid, state.value, reason)
        return True

    # -- output -------------------------------------------------------------------------------

    def _report(self, snapshot: TelemetrySnapshot, present: Mapping[str, DeviceReading],
                kernels: Mapping[str, Kernel], resolver: DeviceResolver, now: float) -> tuple[DeviceHealth, ...]:
        if not self._holders.covers(kernels, resolver):
            self._holders = _HolderCache(kernels, resolver)
        holders = self._holders
        out = []
        for uuid in sorted(set(self._seen) | set(self._latches)):
            latch = self._latches.get(uuid)
            seen = self._seen.get(uuid)
            label = latch.device_id if latch else seen.device_id  # type: ignore[union-attr]
            if latch is not None:
                refs = tuple(sorted({ref for ref, gi in holders().get(uuid, ())
                                     if latch.scopes is None or gi is None or gi in latch.scopes}))
                out.append(DeviceHealth(label, uuid, latch.state, latch.since, latch.reason, latch.xid, latch.scopes, refs))
                continue
            reading = present.get(uuid)
            readable = snapshot.success and reading is not None and not reading.stale
            state = HealthState.OK if readable else HealthState.UNKNOWN
            why = "" if readable else ("telemetry calls missed their deadline" if reading is not None and reading.stale
                                       else "telemetry cannot be read")
            since = now
            if seen is not None:
                if seen.state is not None and seen.state is not state:
                    seen.since = now  # ok <-> unknown
                seen.state = state
                since = seen.since
            refs = tuple(sorted({ref for ref, _ in holders().get(uuid, ())})) if state is HealthState.UNKNOWN else ()
            out.append(DeviceHealth(label, uuid, state, since, why, None, None, refs))
        return tuple(out)

    def _save(self) -> None:
        devices = {uuid: latch.document() for uuid, latch in sorted(self._latches.items())}
        self._store.save({"format": _FORMAT, "boot_id": self._boot_id, "devices": devices})


def _read_latches(devices: Mapping[str, Any]) -> dict[str, _Latch]:
    out: dict[str, _Latch] = {}
    for uuid, doc in list(devices.items())[:_MAX_DEVICES]:
        try:
            out[str(uuid)] = _Latch.from_document(doc)
        except (KeyError, TypeError, ValueError):
            log.warning("health state file: an unreadable entry for GPU %s is ignored", str(uuid)[:64])
    return out


class _HolderCache:
    """:func:`_holders`, computed only when a GPU's health needs its kernels named (a latch, or
    an unknown state) and kept while the view and the device join are the same objects: a
    healthy node's pass never walks its kernels."""

    def __init__(self, kernels: Mapping[str, Kernel], resolver: DeviceResolver | None) -> None:
        self._kernels, self._resolver = kernels, resolver
        self._value: dict[str, set[tuple[KernelRef, int | None]]] | None = None

    def covers(self, kernels: Mapping[str, Kernel], resolver: DeviceResolver) -> bool:
        return kernels is self._kernels and resolver is self._resolver

    def __call__(self) -> dict[str, set[tuple[KernelRef, int | None]]]:
        if self._value is None:
            self._value = _holders(self._kernels, self._resolver)
        return self._value


def _holders(kernels: Mapping[str, Kernel], resolver: DeviceResolver) -> dict[str, set[tuple[KernelRef, int | None]]]:
    """GPU uuid -> (kernel, GPU instance it holds; None: the whole GPU) for every cuda allocation."""
    out: dict[str, set[tuple[KernelRef, int | None]]] = {}
    for k in kernels.values():
        ident = k.identity
        ref = KernelRef(k.kernel_id, ident.session_id if ident else "undefined", ident.user_id if ident else "undefined")
        for a in k.allocations:
            if not a.slot.startswith("cuda.") or not a.amount:
                continue
            reading = resolver.resolve(a.device_id)
            if isinstance(reading, MigDeviceReading):
                out.setdefault(reading.parent_uuid, set()).add((ref, reading.gpu_instance_id))
            elif reading is not None:
                out.setdefault(reading.uuid, set()).add((ref, None))
    return out

