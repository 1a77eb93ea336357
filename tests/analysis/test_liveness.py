"""Stale kernels: container ids from cgroup trees, and the live/stale/unknown verdicts."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest
from helpers import FIXTURES

from exporter.analysis.liveness import CgroupScan, Liveness, classify, classify_kernels, container_id_of, scan_cgroups
from exporter.scratch.allocation import Kernel, KernelState
from exporter.scratch.resources import Allocation, ResourceSpec

TREES = FIXTURES / "cgroup"
DOCKER = "3b9e1c0d5f2a4e6b8c7d9f0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e"
CONTAINERD = "a81e5d2c00000000000000000000000000000000000000000000000000000b0b"
CRIO = "c0ffee0000000000000000000000000000000000000000000000000000000c0c"
GRACE = 300.0
NOW = 10_000.0


@pytest.mark.parametrize(
    ("tree", "layout", "ids"),
    [
        ("v2-systemd", "v2", {DOCKER}),
        ("v2-cgroupfs", "v2", {DOCKER}),
        ("v1-systemd", "v1:memory", {DOCKER}),
        ("v1-cgroupfs", "v1:memory", {DOCKER}),
        ("v2-kubepods", "v2", {CONTAINERD, CRIO}),
        ("v1-kubepods-cgroupfs", "v1:memory", {CONTAINERD}),
    ],
)
def test_host_trees_show_their_containers(tree: str, layout: str, ids: set[str]) -> None:
    scan = scan_cgroups(TREES / tree)
    assert scan == CgroupScan(True, frozenset(ids), layout)


@pytest.mark.parametrize(("tree", "layout"), [("v2-private", "v2"), ("v1-sandbox", "v1:memory"), ("none", "none")])
def test_private_or_foreign_trees_are_not_visible(tree: str, layout: str) -> None:
    scan = scan_cgroups(TREES / tree)
    assert (scan.visible, scan.container_ids, scan.layout) == (False, frozenset(), layout)


def test_missing_root_is_not_visible(tmp_path: Path) -> None:
    assert not scan_cgroups(tmp_path / "nope").visible


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (f"docker-{DOCKER}.scope", DOCKER),
        (DOCKER, DOCKER),
        (f"cri-containerd-{CONTAINERD}.scope", CONTAINERD),
        (f"libpod-{CRIO}.scope", CRIO),
        (f"crio-conmon-{CRIO}.scope", None),  # the monitor, not the container
        ("docker.service", None),
        ("42f7f8f11525a4c5095c3e0506df93f1", None),
    ],
)
def test_container_id_of(name: str, expected: str | None) -> None:
    assert container_id_of(name) == expected


def kernel(state=KernelState.OK, cid: str | None = DOCKER, since: float = 0.0) -> Kernel:
    spec = ResourceSpec((Allocation("cuda.shares", "GPU-a", Decimal("0.5")),), (), cid)
    return Kernel("k1", "/scratch", state, spec if cid is not None or state is KernelState.OK else None, None, since)


VISIBLE = CgroupScan(True, frozenset({DOCKER}), "v2")
HIDDEN = CgroupScan(False, frozenset(), "v2")


@pytest.mark.parametrize(
    ("k", "scan", "status", "reason"),
    [
        (kernel(), VISIBLE, Liveness.LIVE, "container-running"),
        (kernel(cid=DOCKER[:12]), VISIBLE, Liveness.LIVE, "container-running"),  # short id
        (kernel(cid=DOCKER.upper()), VISIBLE, Liveness.LIVE, "container-running"),
        (kernel(cid=CRIO), VISIBLE, Liveness.STALE, "container-gone"),
        (kernel(cid=CRIO, since=NOW - 10), VISIBLE, Liveness.LIVE, "starting"),  # created, not started yet
        (kernel(cid=CRIO), HIDDEN, Liveness.UNKNOWN, "cgroup-not-visible"),  # never guess
        (kernel(KernelState.INVALID, cid=CRIO), VISIBLE, Liveness.STALE, "container-gone"),  # last good spec
        (kernel(cid=None), HIDDEN, Liveness.UNKNOWN, "no-container-id"),  # Kubernetes writes no CID: never stale
        (kernel(cid=None), VISIBLE, Liveness.UNKNOWN, "no-container-id"),
        (kernel(cid=None, since=NOW - 10), VISIBLE, Liveness.LIVE, "starting"),
        (kernel(KernelState.PENDING, cid=None), HIDDEN, Liveness.STALE, "pending-too-long"),
        (kernel(KernelState.PENDING, cid=None, since=NOW - GRACE), HIDDEN, Liveness.LIVE, "starting"),
    ],
)
def test_classify(k: Kernel, scan: CgroupScan, status: Liveness, reason: str) -> None:
    verdict = classify(k, scan, NOW, GRACE)
    assert (verdict.status, verdict.reason) == (status, reason)


def test_classify_kernels_against_a_fixture_tree() -> None:
    scan = scan_cgroups(TREES / "v1-systemd")
    kernels = {"live": kernel(cid=DOCKER), "gone": kernel(cid=CRIO)}
    verdicts = classify_kernels(kernels, scan, NOW, GRACE)
    assert {k: v.status for k, v in verdicts.items()} == {"live": Liveness.LIVE, "gone": Liveness.STALE}


@pytest.mark.parametrize(
    ("kwargs", "scan", "status", "reason"),
    [
        ({"pod_running": True}, VISIBLE, Liveness.LIVE, "pod-running"),
        ({"pod_running": False}, VISIBLE, Liveness.STALE, "pod-gone"),
        ({"pod_running": False}, HIDDEN, Liveness.UNKNOWN, "no-container-id"),  # a hidden tree proves nothing
        ({"recovery_agent_id": "i-a", "host_agents": frozenset({"i-a", "i-b"})}, HIDDEN, Liveness.LIVE, "in-agent-registry"),
        ({"recovery_agent_id": "i-other", "host_agents": frozenset({"i-a"})}, VISIBLE, Liveness.UNKNOWN, "no-container-id"),
        ({}, VISIBLE, Liveness.UNKNOWN, "no-container-id"),
    ],
)
def test_a_complete_file_without_cid_is_judged_by_a_real_signal_or_unknown(kwargs, scan, status, reason) -> None:
    verdict = classify(kernel(cid=None), scan, NOW, GRACE, **kwargs)
    assert (verdict.status, verdict.reason) == (status, reason)


def test_the_kubernetes_sample_is_never_stale() -> None:
    from helpers import FIXTURES

    from exporter.scratch.resources import parse_resource

    spec = parse_resource((FIXTURES / "resources-26" / "kubernetes-no-cid.txt").read_text())
    k = Kernel("f4de2c08-9aea-4429-b149-1e243192b704", "/scratch", KernelState.OK, spec, None, 0.0)
    for scan in (VISIBLE, HIDDEN, scan_cgroups(TREES / "v2-kubepods")):
        for later in (NOW, NOW * 10):
            assert classify(k, scan, later, GRACE).status is not Liveness.STALE
    verdicts = classify_kernels({k.kernel_id: k}, VISIBLE, NOW, GRACE, pods={k.kernel_id: True})
    assert verdicts[k.kernel_id].reason == "pod-running"
