"""Who really uses the GPU: GPU processes attributed to Backend.AI kernels, measured against allocation.

NVML lists the compute processes of each GPU and MIG device by **host PID**, with their memory
(telemetry's ``DeviceReading.processes`` / ``MigDeviceReading.processes``). This module finds the
kernel behind each PID from procfs (``--path.procfs``, the host's ``/proc``):

1. ``/proc/<pid>/cgroup``: the deepest container id in the cgroup path (Docker's cgroupfs and
   systemd drivers, containerd, CRI-O, Podman; cgroup v1 and v2) equal to a kernel's last ``CID=``;
2. otherwise ``/proc/<pid>/mountinfo``: a mount whose root lies in a kernel's scratch directory
   (the ``/home/config`` and ``/home/work`` bind mounts), for a container whose ``CID=`` the agent
   has not appended yet or a runtime whose cgroup names carry no id.

A process found by neither is *unattributed*, with a reason: ``host`` (no container),
``unknown_container`` (a container no kernel claims: leaked, or not Backend.AI's), or a procfs
failure (``vanished``, ``permission_denied``, ``unreadable``). A failure affects only that process.

What a PID resolves to is cached (bounded LRU) and re-checked on every update by the process start
time (``/proc/<pid>/stat`` field 22), so a reused PID is attributed afresh; PIDs that leave the
process lists are forgotten.

:class:`AttributionTracker` turns one telemetry sample plus the allocation view into an
:class:`AttributionResult`: per kernel × device the processes, their memory, their SM utilisation
where NVML samples it per process, how long the allocation has been idle or without any process,
and isolation breaches (a kernel's process on a device it was not allocated); per device the
unattributed processes. Devices NVML could not read are left out rather than reported as empty.
"""

from __future__ import annotations

import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType

from exporter.analysis.liveness import container_id_of
from exporter.scratch.allocation import Kernel
from exporter.telemetry.devices import DeviceResolver
from exporter.telemetry.model import DeviceReading, GpuProcess, TelemetrySnapshot

__all__ = [
    "Attribution",
    "AttributionResult",
    "AttributionTracker",
    "DeviceUnattributed",
    "KernelDeviceUsage",
    "KernelIndex",
    "ProcFS",
    "ProcessAttributor",
    "ProcessUsage",
    "Unattributed",
    "container_id_from_cgroup",
    "mount_roots",
    "parse_start_time",
]

# Allocations of these slots are NVIDIA devices that NVML can see (cuda.shares, cuda.device, MIG
# slots); ids of other plugins (rocm serials, tpu indices) must not be read as NVML ordinals.
_NVML_PLUGIN = "cuda"
# mountinfo escapes space, tab, newline and backslash as three octal digits.
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


class Unattributed(str, Enum):
    """Why a GPU process belongs to no kernel (the ``reason`` label)."""

    HOST = "host"  # no container in its cgroup path, no kernel mount: a host process
    UNKNOWN_CONTAINER = "unknown_container"  # a container that no kernel's CID= names: leaked, or not Backend.AI's
    VANISHED = "vanished"  # exited (or its PID was reused) between NVML's list and procfs
    PERMISSION_DENIED = "permission_denied"  # procfs refused to show it (hidepid, missing capability)
    UNREADABLE = "unreadable"  # procfs gave something unexpected (I/O error, malformed file)


@dataclass(frozen=True, slots=True)
class Attribution:
    """What one PID resolved to: a kernel (with the evidence used) or the reason there is none."""

    kernel_id: str | None
    via: str | None = None  # "cgroup" or "mountinfo" when kernel_id is set
    reason: Unattributed | None = None  # set when kernel_id is None
    # Evidence, not verdict (left out of equality): the container its cgroup names, and its
    # /proc/<pid>/stat field 22 (clock ticks after boot); None: none, or unread.
    container_id: str | None = field(default=None, compare=False)
    start_time: int | None = field(default=None, compare=False)


# -- procfs -------------------------------------------------------------------------------------


class ProcFS:
    """Reads per-process files under a procfs root (``--path.procfs``; ``/proc`` by default).

    NVML reports host PIDs, so the root must show the host's PID namespace: run on the host, in a
    container with ``hostPID: true``, or with the host's ``/proc`` mounted (``/host/proc``).
    """

    def __init__(self, root: str | os.PathLike[str] = "/proc") -> None:
        self.root = os.fspath(root)

    def read(self, pid: int, name: str) -> str:
        """The text of ``<root>/<pid>/<name>``; raises ``OSError`` as ``open`` does."""
        with open(os.path.join(self.root, str(pid), name), "rb") as f:
            return f.read().decode("utf-8", "surrogateescape")


def parse_start_time(stat: str) -> int:
    """Field 22 of ``/proc/<pid>/stat``: the process start time in clock ticks after boot.

    The command name (field 2) may contain spaces and parentheses, so fields are counted from the
    last ``)``. Raises ``ValueError`` on a malformed line.
    """
    _, sep, rest = stat.rpartition(")")
    fields = rest.split()
    if not sep or len(fields) < 20:
        raise ValueError("malformed stat line")
    return int(fields[19])  # fields[0] is field 3 (state)


def container_id_from_cgroup(text: str) -> str | None:
    """The container id in a ``/proc/<pid>/cgroup`` file, or None for a process in no container.

    Each line is ``hierarchy:controllers:path`` (v1 has one per hierarchy, v2 one ``0::`` line);
    the deepest path component naming a container wins, so a container nested in another (Docker
    in Docker, a Kubernetes pod's container under its pod slice) gives the inner one.
    """
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        ids = [cid for part in path.split("/") if (cid := container_id_of(part))]
        if ids:
            return ids[-1]
    return None


def mount_roots(text: str) -> frozenset[str]:
    """The mount roots (field 4) of a ``/proc/<pid>/mountinfo`` file, unescaped.

    For a bind mount the root is the source directory's path inside its filesystem; for the
    ``/home/config`` bind mount of a kernel on a ``hostdir`` scratch root that is
    ``<scratch_root>/<kernel_id>/config``, less the filesystem's own mount point.
    """
    roots = set()
    for line in text.splitlines():
        fields = line.split(" ", 4)
        if len(fields) > 4:
            roots.add(_OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), fields[3]))
    return frozenset(roots)


# -- kernels ------------------------------------------------------------------------------------


class KernelIndex:
    """Kernels looked up by container id and by scratch-directory mounts, built once per update."""

    def __init__(self, kernels: Collection[Kernel]) -> None:
        self._by_container = {k.container_id.lower(): k.kernel_id for k in kernels if k.container_id}
        self._ids = {k.kernel_id for k in kernels}

    def by_container(self, container_id: str | None) -> str | None:
        """The kernel whose last ``CID=`` is ``container_id``."""
        return self._by_container.get(container_id) if container_id else None

    def by_mounts(self, roots: Iterable[str]) -> str | None:
        """The kernel whose scratch directory one of the mount roots lies in.

        Matched by the kernel id as a path component, not by the whole scratch path: a root is
        relative to its filesystem (``/backend.ai/scratches/<kid>/config`` when ``/var/lib`` is its
        own disk), and a sidecar may see the scratch root under another path than the host does.
        Kernel ids are UUIDs, so a component cannot match by accident.
        """
        for root in sorted(roots):
            for part in root.split("/"):
                if part in self._ids:
                    return part
        return None


class ProcessAttributor:
    """Resolves PIDs to kernels through procfs, with a bounded cache of what each PID showed.

    The cache holds evidence (container id, mount roots), not verdicts: kernels come and go and
    a ``CID=`` may be appended later, so evidence is matched against the current kernels on
    every call. An entry is reused only while the PID's start time is unchanged.

    :param procfs: where to read ``/proc/<pid>/…``.
    :param cache_size: most PIDs remembered (least recently used evicted first).
    """

    def __init__(self, procfs: ProcFS, cache_size: int = 4096) -> None:
        if cache_size < 1:
            raise ValueError("cache_size must be at least 1")
        self._procfs = procfs
        self._cache_size = cache_size
        self._cache: OrderedDict[int, _Evidence] = OrderedDict()

    def __len__(self) -> int:
        return len(self._cache)

    def attribute(self, pid: int, kernels: KernelIndex) -> Attribution:
        """Which kernel ``pid`` belongs to. Never raises for procfs trouble: that is a reason."""
        try:
            return self._attribute(pid, kernels)
        except (FileNotFoundError, ProcessLookupError):
            reason = Unattributed.VANISHED
        except PermissionError:
            reason = Unattributed.PERMISSION_DENIED
        except (OSError, ValueError):
            reason = Unattributed.UNREADABLE
        self._cache.pop(pid, None)
        return Attribution(None, reason=reason)

    def retain(self, pids: Iterable[int]) -> None:
        """Forget every PID not in ``pids`` (processes that left the GPU)."""
        keep = set(pids)
        for pid in [p for p in self._cache if p not in keep]:
            del self._cache[pid]

    def _attribute(self, pid: int, kernels: KernelIndex) -> Attribution:
        started = self._start_time(pid)
        evidence = self._cache.get(pid)
        if evidence is None or evidence.start_time != started:
            evidence = _Evidence(started, container_id_from_cgroup(self._procfs.read(pid, "cgroup")))
            self._confirm(pid, started)
            self._cache[pid] = evidence
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        self._cache.move_to_end(pid)
        cid = evidence.container_id
        kernel_id = kernels.by_container(cid)
        if kernel_id:
            return Attribution(kernel_id, via="cgroup", container_id=cid, start_time=started)
        if evidence.mount_roots is None:
            # Read only when the cgroup did not tell: mountinfo is the larger file.
            roots = mount_roots(self._procfs.read(pid, "mountinfo"))
            self._confirm(pid, started)
            evidence.mount_roots = roots
        kernel_id = kernels.by_mounts(evidence.mount_roots)
        if kernel_id:
            return Attribution(kernel_id, via="mountinfo", container_id=cid, start_time=started)
        reason = Unattributed.UNKNOWN_CONTAINER if cid else Unattributed.HOST
        return Attribution(None, reason=reason, container_id=cid, start_time=started)

    def _start_time(self, pid: int) -> int:
        return parse_start_time(self._procfs.read(pid, "stat"))

    def _confirm(self, pid: int, started: int) -> None:
        # The PID may have exited and been reused while its files were read; then what was read
        # may describe another process.
        if self._start_time(pid) != started:
            raise ProcessLookupError(pid)


@dataclass(slots=True)
class _Evidence:
    start_time: int
    container_id: str | None
    mount_roots: frozenset[str] | None = None  # None: not read yet


# -- devices ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Unit:
    """A device that runs processes: a GPU without MIG devices, or one MIG device."""

    uuid: str
    label: str  # its device_id label
    processes: tuple[GpuProcess, ...] | None  # None: unknown
    utilization: Mapping[int, float] | None  # pid -> SM ratio; None: not sampled per process
    parent_uuid: str | None = None


def _units(devices: Iterable[DeviceReading], resolver: DeviceResolver) -> list[_Unit]:
    units = []
    for d in devices:
        fresh = d.up and not d.stale  # a stale list would hide processes that started or ended
        if d.mig_devices:
            # With MIG on, every compute process runs in a MIG device, and NVML has no per-process
            # utilisation there; the parent's own list (when privileged) repeats the MIG lists.
            units += [_Unit(m.uuid, resolver.label(m), m.processes if fresh else None, None, d.uuid) for m in d.mig_devices]
        else:
            # process_utilization: requested from telemetry (nvmlDeviceGetProcessUtilization).
            util = getattr(d, "process_utilization", None)
            units.append(_Unit(d.uuid, resolver.label(d), d.processes if fresh else None, util if fresh else None))
    return units


# -- results ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KernelDeviceUsage:
    """Measured use of one device by one kernel.

    ``device_id`` is the allocation's own id when the kernel holds the device (a process on a MIG
    device of an allocated GPU counts against the GPU), else the device the process runs on.

    :param allocated: the kernel holds the device; False means an isolation breach.
    :param processes: the kernel's compute processes there.
    :param memory_used_bytes: their GPU memory; None when NVML withheld any process's figure.
    :param utilization_ratio: their summed SM utilisation, 0–1 (capped at 1); None where NVML does
        not sample per process (MIG, unsupported GPUs).
    :param idle_seconds: allocated pairs with utilisation only: how long utilisation has stayed
        below the idle threshold (0 while busy).
    :param no_process_seconds: allocated pairs only: how long the kernel has had no process on
        the device (0 while it has one); counts from when the tracker first saw the allocation.
    """

    kernel_id: str
    device_id: str
    allocated: bool
    processes: int
    memory_used_bytes: int | None
    utilization_ratio: float | None
    idle_seconds: float | None
    no_process_seconds: float | None


@dataclass(frozen=True, slots=True)
class DeviceUnattributed:
    """Processes of one device that belong to no kernel, for one reason (only reasons that occur)."""

    device_id: str
    reason: Unattributed
    processes: int
    memory_used_bytes: int | None  # None when NVML withheld any process's figure


@dataclass(frozen=True, slots=True)
class ProcessUsage:
    """One process on one device (the opt-in per-process detail)."""

    device_id: str
    pid: int
    kernel_id: str | None
    memory_used_bytes: int | None
    utilization_ratio: float | None
    reason: Unattributed | None = None  # why it belongs to no kernel (kernel_id None)
    container_id: str | None = None  # the container its cgroup names, when one does
    start_time: int | None = None  # /proc/<pid>/stat field 22; None: procfs could not tell


@dataclass(frozen=True, slots=True)
class AttributionResult:
    """One update's outcome; immutable, safe to hand to concurrent scrapes.

    :param devices: per device (label) whose process list was read: whether per-process
        utilisation exists there.
    :param duration_seconds: wall time the update took (mostly procfs reads).
    """

    kernels: tuple[KernelDeviceUsage, ...]
    unattributed: tuple[DeviceUnattributed, ...]
    processes: tuple[ProcessUsage, ...]
    devices: Mapping[str, bool]
    duration_seconds: float


# -- tracker ------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Streaks:
    idle_since: float | None = None
    no_process_since: float | None = None


@dataclass(slots=True)
class _Pair:
    allocated: bool
    covered: list[_Unit]  # the units whose processes count for this pair
    pids: list[tuple[_Unit, GpuProcess]]


class AttributionTracker:
    """Attributes each telemetry sample's processes and tracks idle and no-process streaks.

    Not thread-safe: call :meth:`update` from one thread (the telemetry loop) and publish the
    result; scrapes read only results.

    :param procfs: the host's procfs.
    :param clock: monotonic seconds, injected for tests.
    :param idle_threshold_ratio: utilisation (0–1) below which an allocation counts as idle.
    :param cache_size: most PIDs whose evidence is cached.
    """

    def __init__(
        self,
        procfs: ProcFS,
        clock: Callable[[], float] = time.monotonic,
        *,
        idle_threshold_ratio: float = 0.05,
        cache_size: int = 4096,
    ) -> None:
        if not 0 <= idle_threshold_ratio <= 1:
            raise ValueError("idle_threshold_ratio must be within 0-1")
        self._attributor = ProcessAttributor(procfs, cache_size)
        self._clock = clock
        self._idle_threshold = idle_threshold_ratio
        self._streaks: dict[tuple[str, str], _Streaks] = {}

    def update(self, snapshot: TelemetrySnapshot, kernels: Collection[Kernel], devices: DeviceResolver) -> AttributionResult:
        """Attribute the processes of one telemetry sample.

        :param snapshot: the sample; only its devices' process lists (and per-process
            utilisation) are used.
        :param kernels: the kernels of the current allocation view (``AllocationView.kernels.values()``).
        :param devices: the resolver for this sample (allocation ids → readings, ``device_id`` labels).
        """
        started = time.perf_counter()
        units = _units(snapshot.devices, devices)
        read = [u for u in units if u.processes is not None]
        if not read:
            # No process list at all (telemetry off, mock devices, NVML down): nothing to measure,
            # and every streak restarts, as for any unread device. Skips a pass over all kernels.
            self._streaks = {}
            self._attributor.retain({})
            return AttributionResult((), (), (), MappingProxyType({}), time.perf_counter() - started)
        index = KernelIndex(kernels)
        pairs, holder = _allocated_pairs(kernels, units, devices)

        unattributed: dict[tuple[str, Unattributed], list[GpuProcess]] = {}
        processes: list[ProcessUsage] = []
        seen: dict[int, Attribution] = {}
        for u in read:
            for p in u.processes:
                if p.pid not in seen:
                    seen[p.pid] = self._attributor.attribute(p.pid, index)
                who = seen[p.pid]
                processes.append(ProcessUsage(u.label, p.pid, who.kernel_id, p.used_memory_bytes, _ratio(u.utilization, p.pid),
                                              who.reason, who.container_id, who.start_time))
                if who.kernel_id is None:
                    unattributed.setdefault((u.label, who.reason), []).append(p)
                    continue
                device_id = holder.get((who.kernel_id, u.uuid))
                if device_id is None:  # isolation breach: count it where it runs
                    device_id = u.label
                    pairs.setdefault((who.kernel_id, device_id), _Pair(False, [u], []))
                pairs[(who.kernel_id, device_id)].pids.append((u, p))
        self._attributor.retain(seen)

        return AttributionResult(
            kernels=self._measure(pairs),
            unattributed=tuple(
                DeviceUnattributed(label, reason, len(procs), _memory(procs))
                for (label, reason), procs in sorted(unattributed.items())
            ),
            processes=tuple(processes),
            devices=MappingProxyType({u.label: u.utilization is not None for u in read}),
            duration_seconds=time.perf_counter() - started,
        )

    def _measure(self, pairs: dict[tuple[str, str], _Pair]) -> tuple[KernelDeviceUsage, ...]:
        now = self._clock()
        usages = []
        streaks: dict[tuple[str, str], _Streaks] = {}
        for key, pair in sorted(pairs.items()):
            # A pair is measured only when every device it covers was read.
            if not pair.covered or any(u.processes is None for u in pair.covered):
                continue
            util = None
            if all(u.utilization is not None for u in pair.covered):
                util = min(1.0, sum(_ratio(u.utilization, p.pid) for u, p in pair.pids))
            idle = no_process = None
            if pair.allocated:
                s = streaks[key] = self._streaks.get(key) or _Streaks()
                s.no_process_since = _since(s.no_process_since, now) if not pair.pids else None
                s.idle_since = _since(s.idle_since, now) if util is not None and util < self._idle_threshold else None
                no_process = now - s.no_process_since if s.no_process_since is not None else 0.0
                if util is not None:
                    idle = now - s.idle_since if s.idle_since is not None else 0.0
            usages.append(
                KernelDeviceUsage(
                    kernel_id=key[0],
                    device_id=key[1],
                    allocated=pair.allocated,
                    processes=len(pair.pids),
                    memory_used_bytes=_memory(p for _, p in pair.pids),
                    utilization_ratio=util,
                    idle_seconds=idle,
                    no_process_seconds=no_process,
                )
            )
        # Pairs that ended, or whose device went unread, start their streaks afresh.
        self._streaks = streaks
        return tuple(usages)


def _allocated_pairs(
    kernels: Iterable[Kernel], units: list[_Unit], devices: DeviceResolver
) -> tuple[dict[tuple[str, str], _Pair], dict[tuple[str, str], str]]:
    """Every allocated (kernel, device id) pair with the units its processes may run on, and
    (kernel, unit uuid) -> the allocation's device id covering that unit."""
    by_uuid = {u.uuid: u for u in units}
    children: dict[str, list[_Unit]] = {}
    for u in units:
        if u.parent_uuid:
            children.setdefault(u.parent_uuid, []).append(u)
    pairs: dict[tuple[str, str], _Pair] = {}
    holder: dict[tuple[str, str], str] = {}
    for k in kernels:
        for a in k.allocations:
            if a.slot.partition(".")[0] != _NVML_PLUGIN or not a.amount:
                continue
            reading = devices.resolve(a.device_id)
            uuid = reading.uuid if reading is not None else None
            covered = children.get(uuid) or ([by_uuid[uuid]] if uuid in by_uuid else [])
            pairs[(k.kernel_id, a.device_id)] = _Pair(True, covered, [])
            for u in covered:
                holder[(k.kernel_id, u.uuid)] = a.device_id
    return pairs, holder


def _since(since: float | None, now: float) -> float:
    return now if since is None else since


def _ratio(utilization: Mapping[int, float] | None, pid: int) -> float | None:
    """A process's SM ratio; a process NVML sampled nothing for was idle over the window."""
    return None if utilization is None else min(1.0, utilization.get(pid, 0.0))


def _memory(processes: Iterable[GpuProcess]) -> int | None:
    total = 0
    for p in processes:
        if p.used_memory_bytes is None:
            return None
        total += p.used_memory_bytes
    return total
