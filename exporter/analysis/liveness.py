"""Stale kernels: scratch directories that no longer belong to a running container.

Nothing sweeps the scratch root (the agent removes a kernel's directory only in its own cleanup of
that kernel; docs/headroom.md, *Stale kernels*): a container removed out of band, a
failed creation or a cleanup race leaves a directory whose ``resource.txt`` still claims devices.
A kernel is judged by the last ``CID=`` of its file against the host's cgroup tree, where every
running container has a directory:

* cgroup v2, systemd driver: ``system.slice/docker-<cid>.scope``; cgroupfs driver: ``docker/<cid>``;
* cgroup v1: the same below a controller (``memory/system.slice/docker-<cid>.scope``,
  ``memory/docker/<cid>``);
* Kubernetes: ``kubepods.slice/…/cri-containerd-<cid>.scope`` (also ``crio-``, ``docker-``),
  ``kubepods/<qos>/pod<uid>/<cid>``; Podman: ``libpod-<cid>.scope``.

:func:`scan_cgroups` is the only I/O: it walks the tree once and collects every container id it
sees. :func:`classify` is pure and never says "stale" on a guess: when the tree does not show the
host's containers (a private cgroup namespace) the answer is "unknown". A container between
``docker create`` and ``start`` has no cgroup yet, so a kernel younger than the grace age is live.

Liveness by backend (the scratch root's agent, from agent.toml):

* Docker: the last ``CID=`` against the cgroup tree, as above.
* Kubernetes: the backend never writes ``CID=``; a complete file without one is normal. The pod's
  cgroup (``kubepods…/pod<uid>``) is the signal where the caller can tie the kernel to its pod
  (``pod_running``); otherwise the answer is "unknown".
* Any backend, a complete file without ``CID=``: a ``recovery.json`` naming one of this host's
  agents (the agent rewrites it for every kernel in its registry) makes it live; without a real
  signal it is "unknown" (``no-container-id``), never stale: a missing ``CID=`` is not evidence
  that the container is gone.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from exporter.scratch.allocation import Kernel, KernelState

__all__ = [
    "CgroupScan",
    "KernelLiveness",
    "Liveness",
    "classify",
    "classify_kernels",
    "container_id_of",
    "scan_cgroups",
    "summarise",
    "time_moves",
]

# Directories under the cgroup root (v2) or a v1 controller that only a host-wide view shows; a
# container with its own cgroup namespace sees none of them.
_HOST_MARKERS = ("system.slice", "docker", "kubepods", "kubepods.slice", "machine.slice", "user.slice", "init.scope")
# v1 controllers to read, in order of preference; any one has every container.
_V1_CONTROLLERS = ("memory", "pids", "cpu,cpuacct", "cpuacct", "devices", "systemd")
# docker-<id>.scope, cri-containerd-<id>.scope, crio-<id>.scope, libpod-<id>.scope or a bare id.
_CONTAINER_DIR = re.compile(r"^(?:(?:docker|cri-containerd|containerd|crio|libpod)-)?([0-9a-f]{64})(?:\.scope)?$")
_MAX_DEPTH = 8  # kubepods.slice/kubepods-burstable.slice/…-pod<uid>.slice/cri-containerd-<id>.scope is 4 deep


class Liveness(str, Enum):
    LIVE = "live"
    STALE = "stale"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class KernelLiveness:
    """A verdict and why: live ``container-running`` / ``pod-running`` / ``in-agent-registry`` /
    ``starting``; stale ``container-gone`` / ``pod-gone`` / ``pending-too-long``; unknown
    ``cgroup-not-visible`` / ``no-container-id``."""

    status: Liveness
    reason: str


# Every verdict classify() gives, made once: a node of 10,000 kernels holds one reference per
# kernel, not one new object per kernel and analysis pass.
_CONTAINER_RUNNING = KernelLiveness(Liveness.LIVE, "container-running")
_POD_RUNNING = KernelLiveness(Liveness.LIVE, "pod-running")
_IN_AGENT_REGISTRY = KernelLiveness(Liveness.LIVE, "in-agent-registry")
_STARTING = KernelLiveness(Liveness.LIVE, "starting")
_CONTAINER_GONE = KernelLiveness(Liveness.STALE, "container-gone")
_POD_GONE = KernelLiveness(Liveness.STALE, "pod-gone")
_PENDING_TOO_LONG = KernelLiveness(Liveness.STALE, "pending-too-long")
_CGROUP_NOT_VISIBLE = KernelLiveness(Liveness.UNKNOWN, "cgroup-not-visible")
_NO_CONTAINER_ID = KernelLiveness(Liveness.UNKNOWN, "no-container-id")


@dataclass(frozen=True, slots=True)
class CgroupScan:
    """What one walk of the cgroup tree showed.

    :param visible: the tree shows the host's containers (a host marker directory exists).
    :param container_ids: 64-hex ids of every container cgroup found.
    :param layout: ``v2``, ``v1:<controller>`` or ``none``.
    """

    visible: bool
    container_ids: frozenset[str]
    layout: str


def container_id_of(name: str) -> str | None:
    """The container id a cgroup directory name stands for, or None."""
    m = _CONTAINER_DIR.match(name)
    return m.group(1) if m else None


def scan_cgroups(root: str | os.PathLike[str]) -> CgroupScan:
    """Walk the cgroup tree below ``root`` (``--path.cgroupfs``, normally ``/sys/fs/cgroup``).

    Unreadable directories are skipped; an unreadable root gives ``visible=False``.
    """
    root = Path(root)
    if (root / "cgroup.controllers").is_file():
        base, layout = root, "v2"
    else:
        found = next((c for c in _V1_CONTROLLERS if (root / c).is_dir()), None)
        if found is None:
            return CgroupScan(False, frozenset(), "none")
        base, layout = root / found, f"v1:{found}"
    visible = any((base / marker).is_dir() for marker in _HOST_MARKERS)
    return CgroupScan(visible, frozenset(_walk(base, 0)), layout)


def _walk(directory: Path, depth: int) -> set[str]:
    ids: set[str] = set()
    try:
        entries = [e for e in os.scandir(directory) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return ids
    for entry in entries:
        cid = container_id_of(entry.name)
        if cid is not None:
            ids.add(cid)  # its sub-cgroups belong to the container: no need to descend
        elif depth < _MAX_DEPTH:
            ids |= _walk(Path(entry.path), depth + 1)
    return ids


def classify(
    kernel: Kernel,
    scan: CgroupScan,
    now: float,
    grace_seconds: float,
    *,
    pod_running: bool | None = None,
    recovery_agent_id: str | None = None,
    host_agents: frozenset[str] = frozenset(),
) -> KernelLiveness:
    """Judge one kernel.

    :param now: unix time in seconds (injected clock).
    :param grace_seconds: how long a kernel may stay pending, or run without a visible container,
        before it counts as stale.
    :param pod_running: Kubernetes: whether the kernel's pod has a cgroup (None: not known).
    :param recovery_agent_id: the agent its ``recovery.json`` names, if any.
    :param host_agents: the agent ids of this host.
    """
    young = now - kernel.since <= grace_seconds
    if kernel.state is KernelState.PENDING:
        return _STARTING if young else _PENDING_TOO_LONG
    cid = (kernel.container_id or "").lower()
    if not cid:
        if pod_running is not None and scan.visible:
            if pod_running:
                return _POD_RUNNING
            return _STARTING if young else _POD_GONE
        if recovery_agent_id is not None and recovery_agent_id in host_agents:
            return _IN_AGENT_REGISTRY
        return _STARTING if young else _NO_CONTAINER_ID
    if not scan.visible:
        return _CGROUP_NOT_VISIBLE
    if cid in scan.container_ids or (len(cid) < 64 and any(c.startswith(cid) for c in scan.container_ids)):
        return _CONTAINER_RUNNING
    return _STARTING if young else _CONTAINER_GONE


def time_moves(verdict: KernelLiveness, kernel: Kernel, now: float, grace_seconds: float) -> bool:
    """Whether time alone has changed ``verdict`` by ``now`` (unix seconds), the same kernel and
    scan given: only a kernel in its grace period (:func:`classify` says "starting") turns into
    another verdict, once that period is over."""
    return verdict is _STARTING and now - kernel.since > grace_seconds


def classify_kernels(
    kernels: Mapping[str, Kernel],
    scan: CgroupScan,
    now: float,
    grace_seconds: float,
    *,
    pods: Mapping[str, bool] | None = None,
    recovery_agents: Mapping[str, str] | None = None,
    host_agents: frozenset[str] = frozenset(),
) -> dict[str, KernelLiveness]:
    """:func:`classify` for every kernel of a view (``AllocationView.kernels``).

    :param pods: kernel id → whether its pod runs (Kubernetes kernels the caller could tie to a pod).
    :param recovery_agents: kernel id → the agent id its ``recovery.json`` names.
    """
    pods, recovery_agents = pods or {}, recovery_agents or {}
    return {
        kid: classify(
            k, scan, now, grace_seconds,
            pod_running=pods.get(kid), recovery_agent_id=recovery_agents.get(kid), host_agents=host_agents,
        )
        for kid, k in kernels.items()
    }


def summarise(liveness: Mapping[str, KernelLiveness]) -> tuple[dict[str, KernelLiveness], dict[Liveness, int]]:
    """The stale verdicts of ``liveness`` and the number of verdicts per status, from every
    verdict (the pipeline keeps both as kernels change instead)."""
    counts: dict[Liveness, int] = {}
    for verdict in liveness.values():
        counts[verdict.status] = counts.get(verdict.status, 0) + 1
    return {k: v for k, v in liveness.items() if v.status is Liveness.STALE}, counts
