"""Ghost memory: GPU memory NVML still lists for holders that no longer should hold it.

NVML lists each compute process by host PID with its memory; a process that died in the
driver's view only when its context is torn down, a process that leaked out of its container,
or a process of a kernel that Backend.AI already ended, keeps that memory out of reach of the
next session. This module reads the attribution of one telemetry sample
(:class:`~exporter.analysis.attribution.AttributionResult`, whose process rows carry the
container id and the start time procfs showed) and sorts such memory into causes:

* ``dead_process``: ``/proc/<pid>`` is gone, or the PID now names another process (its start
  time, ``/proc/<pid>/stat`` field 22, differs from the one first seen while NVML listed it);
* ``unattributed_process``: a live process in no kernel's cgroup or scratch mount that is not a
  known host service (``/proc/<pid>/comm`` in :data:`HOST_SERVICES`);
* ``ended_kernel``: a process of a kernel whose scratch directory is gone (its container id is
  one a recently seen kernel wrote in ``CID=``) or whose container is gone (liveness ``stale``).

The tracker keeps a bounded memory of recently seen kernels' identities (container id ->
kernel, session, user) so an ended kernel's holder can still be named, and a bounded memory of
the PIDs NVML lists (start time and kernel first seen), so a PID's death or reuse is told apart
from a new process. Processes that procfs refused to show are never counted: they are not
known to be ghosts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum

from exporter.analysis.attribution import AttributionResult, ProcessUsage, ProcFS, Unattributed
from exporter.analysis.liveness import KernelLiveness, Liveness
from exporter.scratch.allocation import Kernel

__all__ = [
    "GHOST_HOLDERS_PER_DEVICE",
    "HOST_SERVICES",
    "GhostCause",
    "GhostHolder",
    "GhostMemory",
    "GhostTracker",
    "KernelMemo",
]

# Host processes that legitimately hold GPU memory outside any kernel (``comm``, which the
# kernel truncates to 15 characters): the persistence daemon, DCGM, MPS, a display server.
HOST_SERVICES = frozenset({
    "nvidia-persiste",
    "nv-hostengine",
    "nvidia-cuda-mps",
    "Xorg",
    "Xwayland",
    "gnome-shell",
    "dcgm-exporter",
})
GHOST_HOLDERS_PER_DEVICE = 5  # holders named per device (largest first): bounds the info family
_KERNEL_MEMORY = 1024  # recently seen kernels remembered (container id -> identity)
_PID_MEMORY = 8192  # PIDs remembered while NVML lists them (start time, kernel)
_COMM_LIMIT = 64  # bytes of /proc/<pid>/comm looked at (the kernel writes at most 16)


class GhostCause(str, Enum):
    """Why memory counts as ghost (the ``cause`` label)."""

    DEAD_PROCESS = "dead_process"
    UNATTRIBUTED_PROCESS = "unattributed_process"
    ENDED_KERNEL = "ended_kernel"


@dataclass(frozen=True, slots=True)
class KernelMemo:
    """What was last known of a kernel, kept after its scratch directory is gone."""

    kernel_id: str
    session_id: str = ""
    user_id: str = ""


@dataclass(frozen=True, slots=True)
class GhostHolder:
    """One process holding ghost memory on one device (device label as attribution's)."""

    device_id: str
    pid: int
    cause: GhostCause
    memory_bytes: int
    kernel: KernelMemo | None  # the kernel it last belonged to, when known


@dataclass(frozen=True, slots=True)
class GhostMemory:
    """One sample's ghost memory: per (device, cause) bytes and the largest holders per device.

    :param devices: device labels whose process lists were read: a device there without a
        ``bytes`` entry has no ghost memory (0), one absent was not read (unknown).
    """

    bytes: Mapping[tuple[str, GhostCause], int]
    holders: tuple[GhostHolder, ...]
    devices: frozenset[str]

    def device_total(self, device_id: str) -> int:
        """Ghost bytes on ``device_id``, all causes."""
        return sum(v for (d, _), v in self.bytes.items() if d == device_id)

    def totals(self) -> dict[str, int]:
        """Device label -> ghost bytes, all causes (devices without ghost memory left out)."""
        out: dict[str, int] = {}
        for (d, _), v in self.bytes.items():
            out[d] = out.get(d, 0) + v
        return out


EMPTY = GhostMemory({}, (), frozenset())


@dataclass(slots=True)
class _Seen:
    start_time: int | None
    kernel: KernelMemo | None


class GhostTracker:
    """Sorts each sample's GPU processes into ghost causes; keeps the bounded memories.

    Not thread-safe: the analysis pipeline's usage stage calls :meth:`update`.

    :param procfs: the host's procfs (``comm`` of unattributed processes).
    :param host_services: ``comm`` names of host processes that may hold GPU memory.
    :param holders_per_device: holders named per device.
    """

    def __init__(
        self,
        procfs: ProcFS,
        *,
        host_services: Iterable[str] = HOST_SERVICES,
        holders_per_device: int = GHOST_HOLDERS_PER_DEVICE,
        kernel_memory: int = _KERNEL_MEMORY,
        pid_memory: int = _PID_MEMORY,
    ) -> None:
        self._procfs = procfs
        self._host = frozenset(host_services)
        self._top = holders_per_device
        self._kernel_cap = kernel_memory
        self._pid_cap = pid_memory
        # Kernels that went away, by container id and by kernel id (most recent last; the oldest
        # forgotten first); the current ones are read from the view itself.
        self._kernels: OrderedDict[str, KernelMemo] = OrderedDict()
        self._by_id: OrderedDict[str, KernelMemo] = OrderedDict()
        self._current: Mapping[str, Kernel] = {}
        self._version: Hashable | None = None  # the version of ``_current``, where told
        self._pids: OrderedDict[int, _Seen] = OrderedDict()

    def remember(self, kernels: Mapping[str, Kernel], version: Hashable | None = None,
                 changes: Callable[[Hashable], Mapping[str, Kernel | None] | None] | None = None) -> None:
        """Note the identities of kernels that left since the last call. The view's mapping is
        the same object while nothing changed, so a quiet pass costs nothing; a change costs a
        look at the changed kernels, where ``changes`` tells them (as for
        :meth:`~exporter.analysis.accounting.Accountant.update`: an earlier ``version`` -> the
        kernels changed since, None where they went), else one difference of the two views' keys
        (each new table's key set is built for it), never a walk that memorises every kernel."""
        if kernels is self._current:
            return
        changed = changes(self._version) if changes is not None and self._version is not None else None
        if changed is not None:
            gone: Iterable[str] = [kid for kid, kernel in changed.items() if kernel is None and kid in self._current]
        else:
            gone = self._current.keys() - kernels.keys()
        for kernel_id in gone:
            k = self._current[kernel_id]
            memo = _memo(k)
            _put(self._by_id, kernel_id, memo, self._kernel_cap)
            if k.container_id:
                _put(self._kernels, k.container_id.lower(), memo, self._kernel_cap)
        self._current, self._version = kernels, version

    def update(
        self,
        attribution: AttributionResult | None,
        kernels: Mapping[str, Kernel],
        liveness: Mapping[str, KernelLiveness] | None = None,
        version: Hashable | None = None,
        changes: Callable[[Hashable], Mapping[str, Kernel | None] | None] | None = None,
    ) -> GhostMemory:
        """Ghost memory of one attributed sample; ``kernels`` the current view's (``version``
        and ``changes``: see :meth:`remember`)."""
        self.remember(kernels, version, changes)
        if attribution is None:
            return EMPTY
        liveness = liveness or {}
        found: dict[tuple[str, GhostCause], int] = {}
        holders: list[GhostHolder] = []
        listed: set[int] = set()
        for p in attribution.processes:
            listed.add(p.pid)
            verdict = self._judge(p, kernels, liveness)
            if verdict is None or not p.memory_used_bytes:
                continue
            cause, memo = verdict
            found[(p.device_id, cause)] = found.get((p.device_id, cause), 0) + p.memory_used_bytes
            holders.append(GhostHolder(p.device_id, p.pid, cause, p.memory_used_bytes, memo))
        for pid in [pid for pid in self._pids if pid not in listed]:
            del self._pids[pid]  # left NVML's lists: a later PID of that number is a new process
        top: list[GhostHolder] = []
        per_device: dict[str, int] = {}
        for h in sorted(holders, key=lambda h: (h.device_id, -h.memory_bytes, h.pid)):
            if per_device.get(h.device_id, 0) < self._top:
                per_device[h.device_id] = per_device.get(h.device_id, 0) + 1
                top.append(h)
        return GhostMemory(found, tuple(top), frozenset(attribution.devices))

    def _judge(
        self, p: ProcessUsage, kernels: Mapping[str, Kernel], liveness: Mapping[str, KernelLiveness]
    ) -> tuple[GhostCause, KernelMemo | None] | None:
        seen = self._pids.get(p.pid)
        if p.reason is Unattributed.VANISHED:
            return GhostCause.DEAD_PROCESS, seen.kernel if seen else None
        if p.reason in (Unattributed.PERMISSION_DENIED, Unattributed.UNREADABLE):
            return None  # not known to be a ghost
        if seen is not None and seen.start_time is not None and p.start_time is not None and p.start_time != seen.start_time:
            # NVML still lists the PID, but procfs shows another process under it: the holder
            # NVML means has exited and its context was never torn down.
            return GhostCause.DEAD_PROCESS, seen.kernel
        memo = None
        if p.kernel_id:
            memo = _memo(kernels[p.kernel_id]) if p.kernel_id in kernels else self._by_id.get(p.kernel_id)
        if seen is None:
            seen = self._pids[p.pid] = _Seen(p.start_time, memo)
            while len(self._pids) > self._pid_cap:
                self._pids.popitem(last=False)
        elif memo is not None:
            seen.kernel = memo
        self._pids.move_to_end(p.pid)
        if p.kernel_id is not None:
            verdict = liveness.get(p.kernel_id)
            if verdict is not None and verdict.status is Liveness.STALE:
                return GhostCause.ENDED_KERNEL, memo  # its container is gone
            return None
        if p.container_id and p.container_id.lower() in self._kernels:
            return GhostCause.ENDED_KERNEL, self._kernels[p.container_id.lower()]  # its scratch directory is gone
        if seen.kernel is not None and seen.kernel.kernel_id not in kernels:
            return GhostCause.ENDED_KERNEL, seen.kernel  # attributed once, by mount, to a kernel now gone
        if p.reason is Unattributed.HOST and self._comm(p.pid) in self._host:
            return None
        return GhostCause.UNATTRIBUTED_PROCESS, None

    def _comm(self, pid: int) -> str | None:
        try:
            return self._procfs.read(pid, "comm")[:_COMM_LIMIT].strip()
        except (OSError, ValueError):
            return None


def _memo(k: Kernel) -> KernelMemo:
    identity = k.identity
    return KernelMemo(k.kernel_id, identity.session_id if identity else "", identity.user_id if identity else "")


def _put(memory: OrderedDict, key: object, value: object, cap: int) -> None:
    memory[key] = value
    memory.move_to_end(key)
    while len(memory) > cap:
        memory.popitem(last=False)
