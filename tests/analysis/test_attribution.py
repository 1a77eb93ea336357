"""GPU processes attributed to kernels on the fake DGX A100 with a recorded /proc tree.

The devices are read through the real NVML source from ``exporter/telemetry/nvml/simulated.py`` (GPUs 6 and 7 in MIG
mode); ``PLACEMENT`` puts the fixture PIDs on them. ``tests/fixtures/proc`` holds one directory per
host PID (``stat``, ``cgroup``, ``mountinfo``); ``tests/helpers.py`` tabulates who each PID is.

Unreadable entries are made in a copy under ``tmp_path``; see the tests for how.
"""

from __future__ import annotations

import shutil

import pytest
from attribution_node import (
    CID,
    GPU,
    K1,
    K2,
    K3,
    K3_CID,
    K4,
    K5,
    K6,
    LEAKED_CID,
    LEAKED_MIG,
    MIG,
    PROC,
    Clock,
    dgx,
    kernel,
    node_kernels,
    run,
    tracker,
    unattributed,
    usage,
)

from exporter.analysis.attribution import (
    Attribution,
    KernelIndex,
    ProcessAttributor,
    ProcFS,
    Unattributed,
    container_id_from_cgroup,
    mount_roots,
    parse_start_time,
)
from exporter.telemetry.model import GpuProcess, TelemetrySnapshot
from exporter.telemetry.nvml.simulated import GIB as GiB


@pytest.fixture
def proc_copy(tmp_path):
    shutil.copytree(PROC, tmp_path / "proc")
    return tmp_path / "proc"


# -- pure parsers -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cgroup, expected",
    [
        ("12:memory:/docker/" + "a" * 64 + "\n", "a" * 64),  # v1, cgroupfs driver
        ("0::/system.slice/docker-" + "b" * 64 + ".scope\n", "b" * 64),  # v2, systemd driver
        ("0::/../../system.slice/docker-" + "b" * 64 + ".scope\n", "b" * 64),  # seen from a private cgroupns
        ("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1a2b_3c4d.slice/cri-containerd-" + "c" * 64 + ".scope\n", "c" * 64),
        ("0::/kubepods.slice/kubepods-pod9f.slice/crio-" + "d" * 64 + ".scope\n", "d" * 64),
        ("11:pids:/kubepods/burstable/pod1a2b3c4d-0000-4000-8000-000000000000/" + "e" * 64 + "\n", "e" * 64),
        ("0::/machine.slice/libpod-" + "f" * 64 + ".scope/container\n", "f" * 64),  # Podman, nested init cgroup
        ("0::/docker/" + "a" * 64 + "/docker/" + "b" * 64 + "\n", "b" * 64),  # Docker in Docker: the inner one
        ("0::/system.slice/docker-" + "b" * 64 + ".scope/init\n", "b" * 64),
        ("0::/user.slice/user-1000.slice/session-7.scope\n", None),
        ("0::/system.slice/crio-conmon-" + "d" * 64 + ".scope\n", None),  # conmon is not the container
        ("0::/\n", None),
        ("", None),
    ],
)
def test_container_id_from_cgroup_covers_every_driver(cgroup, expected):
    assert container_id_from_cgroup(cgroup) == expected


def test_start_time_is_field_22_even_with_parentheses_in_the_command():
    assert parse_start_time((PROC / "2001" / "stat").read_text()) == 51002311
    assert parse_start_time("7 (a) b) c) S " + " ".join(["0"] * 18) + " 99 0 0\n") == 99
    with pytest.raises(ValueError):
        parse_start_time("7 (cut")


def test_mount_roots_unescape_octal_sequences():
    roots = mount_roots((PROC / "4001" / "mountinfo").read_text())
    assert "/" in roots and "/export/team share" not in roots  # source is not the root
    assert mount_roots("98 22 0:96 /team\\040share /mnt rw - nfs4 x:/y rw\n") == {"/team share"}


def test_a_kernel_mount_point_on_the_host_is_not_its_mount_root():
    # The host shows K4's tmpfs scratch *mounted at* the scratch path; its root is "/".
    index = KernelIndex(node_kernels())
    assert index.by_mounts(mount_roots((PROC / "4001" / "mountinfo").read_text())) is None
    assert index.by_mounts({f"/scratches/{K3}/config"}) == K3  # filesystem mounted at /var/lib/backend.ai
    assert index.by_mounts({"/var/lib/backend.ai/scratches", f"/var/lib/backend.ai/scratches/{K3}_tmp"}) is None


# -- attribution on the whole node --------------------------------------------------------------


def test_every_process_lands_on_its_kernel_or_unattributed():
    result = run(tracker())

    k1 = usage(result, K1, GPU[0])
    assert (k1.allocated, k1.processes, k1.memory_used_bytes) == (True, 2, 6 * GiB)
    assert k1.utilization_ratio == 1.0  # 0.6 + 0.7, capped: samples of two processes overlap
    assert usage(result, K1, GPU[1]).memory_used_bytes == 4 * GiB  # one process, two GPUs

    assert (usage(result, K2, GPU[2]).processes, usage(result, K2, GPU[2]).utilization_ratio) == (1, 0.5)
    k3 = usage(result, K3, GPU[3])
    assert (k3.processes, k3.memory_used_bytes, k3.utilization_ratio) == (1, 6 * GiB, 0.3)  # via mountinfo

    assert unattributed(result, GPU[5]) == {Unattributed.HOST: (1, GiB // 2), Unattributed.VANISHED: (1, GiB // 4)}
    assert unattributed(result, LEAKED_MIG) == {Unattributed.UNKNOWN_CONTAINER: (1, 3 * GiB)}
    assert {u.device_id for u in result.unattributed if u.processes} == {GPU[5], LEAKED_MIG}
    # Every listed process is accounted for once per device; MIG parents' aggregate lists are not
    # counted again.
    assert len(result.processes) == 11
    by_pid = {(p.pid, p.device_id): p.kernel_id for p in result.processes}
    assert by_pid[(1001, GPU[1])] == K1 and by_pid[(3001, GPU[3])] == K3 and by_pid[(6001, LEAKED_MIG)] is None
    assert not any(p.device_id in (GPU[6], GPU[7]) for p in result.processes)


def test_a_kernel_on_a_foreign_device_is_an_isolation_breach():
    result = run(tracker())
    breach = usage(result, K2, GPU[3])
    assert (breach.allocated, breach.processes, breach.memory_used_bytes) == (False, 1, 1 * GiB)
    assert breach.utilization_ratio == 0.0  # sampled, and 2002 had no sample: idle
    assert (breach.idle_seconds, breach.no_process_seconds) == (None, None)  # only allocations have streaks
    assert [u for u in result.kernels if not u.allocated] == [breach, usage(result, K5, MIG[1])]


def test_mig_processes_count_against_the_mig_device_and_utilisation_is_not_isolable():
    result = run(tracker())
    k5 = usage(result, K5, MIG[0])
    assert (k5.allocated, k5.processes, k5.memory_used_bytes, k5.utilization_ratio, k5.idle_seconds) == (True, 1, 8 * GiB, None, None)
    assert usage(result, K5, MIG[1]).allocated is False  # the 2g.10gb device belongs to nobody
    k6 = usage(result, K6, MIG[2])
    assert (k6.processes, k6.no_process_seconds, k6.utilization_ratio) == (0, 0.0, None)
    assert result.devices[MIG[0]] is False and result.devices[GPU[0]] is True
    assert GPU[6] not in result.devices  # its processes run in its MIG devices


def test_an_allocation_of_the_parent_gpu_covers_its_mig_devices():
    result = run(tracker(), kernels=[kernel(K5, {"cuda.device": {GPU[6]: "1"}}, CID[K5])])
    whole = usage(result, K5, GPU[6])
    assert (whole.allocated, whole.processes, whole.memory_used_bytes) == (True, 2, 9 * GiB)
    assert [u for u in result.kernels if not u.allocated] == []


def test_cuda_open_ordinals_resolve_and_cpu_ids_are_not_gpus():
    result = run(tracker(), kernels=node_kernels(gpu=[str(i) for i in range(8)]))
    assert usage(result, K1, "0").processes == 2  # labelled with the allocation's own id
    assert usage(result, K2, "2").processes == 1
    assert usage(result, K1, "1").allocated  # CPU core 1 of K1 did not shadow GPU 1
    # The breach is labelled as this node spells devices: by index.
    assert {(u.kernel_id, u.device_id) for u in result.kernels if u.kernel_id == K2} == {(K2, "2"), (K2, "3")}
    assert unattributed(result, "5") == {Unattributed.HOST: (1, GiB // 2), Unattributed.VANISHED: (1, GiB // 4)}


def test_mock_plugin_ids_resolve():
    # The mock plugin writes bare mother_uuids for whole GPUs.
    bare = [g.removeprefix("GPU-") for g in GPU]
    result = run(tracker(), kernels=node_kernels(gpu=bare))
    assert usage(result, K1, bare[0]).processes == 2 and usage(result, K2, bare[3]).allocated is False


def test_an_unread_device_is_left_out_not_reported_empty():
    snapshot = dgx(gpu={4: {"processes": None}, 0: {"up": False, "stale": True}}, mig={(6, 2): {"processes": None}})
    result = run(tracker(), snapshot)
    assert usage(result, K4, GPU[4]) is None and usage(result, K1, GPU[0]) is None and usage(result, K6, MIG[2]) is None
    assert GPU[4] not in result.devices and not [u for u in result.unattributed if u.device_id == GPU[4]]
    assert usage(result, K1, GPU[1]).processes == 1  # other devices carry on


def test_a_process_with_no_memory_figure_makes_the_sum_unknown():
    snapshot = dgx(gpu={0: {"processes": (GpuProcess(1001, 4 * GiB), GpuProcess(1002, None))}})
    k1 = usage(run(tracker(), snapshot), K1, GPU[0])
    assert (k1.processes, k1.memory_used_bytes) == (2, None)


def test_a_failed_sample_measures_nothing():
    result = run(tracker(), TelemetrySnapshot(source="nvml", success=False, error="nvmlInit failed"))
    assert (result.kernels, result.unattributed, result.processes) == ((), (), ())


# -- streaks with a fake clock ------------------------------------------------------------------


def test_no_process_and_idle_streaks_follow_the_clock():
    clock = Clock(1000.0)
    t = tracker(clock=clock)

    r = run(t)
    assert (usage(r, K4, GPU[4]).no_process_seconds, usage(r, K4, GPU[4]).idle_seconds) == (0.0, 0.0)
    assert usage(r, K1, GPU[1]).idle_seconds == 0.0  # 2 % is below the 5 % threshold: idle from now
    assert (usage(r, K1, GPU[0]).idle_seconds, usage(r, K1, GPU[0]).no_process_seconds) == (0.0, 0.0)

    clock.now = 1600.0
    r = run(t)
    assert usage(r, K4, GPU[4]).no_process_seconds == 600.0
    assert usage(r, K4, GPU[4]).idle_seconds == 600.0  # no process, so nothing ran
    assert usage(r, K1, GPU[1]).idle_seconds == 600.0
    assert usage(r, K1, GPU[0]).idle_seconds == 0.0  # busy throughout
    assert usage(r, K6, MIG[2]).no_process_seconds == 600.0 and usage(r, K6, MIG[2]).idle_seconds is None

    # K1 gets busy on GPU 1; K4 starts a process.
    clock.now = 1700.0
    busy = dgx(gpu={1: {"process_utilization": {1001: 0.4}}, 4: {"processes": (GpuProcess(7001, GiB),), "process_utilization": {7001: 0.9}}})
    r = run(t, busy)
    assert usage(r, K1, GPU[1]).idle_seconds == 0.0
    assert (usage(r, K4, GPU[4]).no_process_seconds, usage(r, K4, GPU[4]).idle_seconds) == (0.0, 0.0)

    clock.now = 1800.0
    assert usage(run(t), K1, GPU[1]).idle_seconds == 0.0  # a new streak starts now
    clock.now = 1860.0
    assert usage(run(t), K1, GPU[1]).idle_seconds == 60.0


def test_a_streak_restarts_after_its_kernel_or_device_went_away():
    clock = Clock(0.0)
    t = tracker(clock=clock)
    run(t)
    clock.now = 100.0
    assert usage(run(t), K4, GPU[4]).no_process_seconds == 100.0

    clock.now = 200.0
    run(t, kernels=[k for k in node_kernels() if k.kernel_id != K4])
    clock.now = 300.0
    assert usage(run(t), K4, GPU[4]).no_process_seconds == 0.0

    clock.now = 400.0
    assert usage(run(t, dgx(gpu={4: {"processes": None}})), K4, GPU[4]) is None
    clock.now = 500.0
    assert usage(run(t), K4, GPU[4]).no_process_seconds == 0.0


# -- cache, PID reuse, unreadable entries --------------------------------------------------------


class CountingProcFS(ProcFS):
    """Counts reads per (pid, file); overrides raise an exception or return a callable's text."""

    def __init__(self, root, overrides=None):
        super().__init__(root)
        self.reads: dict[tuple[int, str], int] = {}
        self.overrides = overrides or {}

    def read(self, pid, name):
        self.reads[(pid, name)] = self.reads.get((pid, name), 0) + 1
        override = self.overrides.get((pid, name))
        if isinstance(override, BaseException):
            raise override
        if callable(override):
            return override()
        return super().read(pid, name)


def test_the_cache_is_bounded_and_evicts_the_least_recently_used():
    procfs = CountingProcFS(PROC)
    attributor = ProcessAttributor(procfs, cache_size=2)
    index = KernelIndex(node_kernels())
    for pid in (1001, 2001, 1001, 5001):  # 2001 is least recently used when 5001 arrives
        attributor.attribute(pid, index)
    assert len(attributor) == 2
    assert procfs.reads[(1001, "cgroup")] == 1  # the second look was a cache hit
    attributor.attribute(1001, index)
    attributor.attribute(2001, index)
    assert procfs.reads[(1001, "cgroup")] == 1 and procfs.reads[(2001, "cgroup")] == 2
    # Only stat is read on a hit, and mountinfo only when the cgroup does not tell.
    assert (1001, "mountinfo") not in procfs.reads
    assert attributor.attribute(3001, index).via == "mountinfo"


def test_pids_that_leave_the_gpu_are_forgotten():
    procfs = CountingProcFS(PROC)
    t = tracker(procfs)
    run(t)
    run(t)
    assert procfs.reads[(6001, "cgroup")] == 1
    run(t, dgx(mig={(7, 3): {"processes": ()}}))
    run(t)  # back: read afresh, nothing was kept for it
    assert procfs.reads[(6001, "cgroup")] == 2 and procfs.reads[(2001, "cgroup")] == 1


def test_a_reused_pid_is_attributed_afresh(proc_copy):
    t = tracker(proc_copy)
    assert usage(run(t), K1, GPU[0]).processes == 2

    # PID 1002 exits and the kernel hands the number to a host process started later.
    for name in ("cgroup", "mountinfo"):
        shutil.copy(proc_copy / "4001" / name, proc_copy / "1002" / name)
    stat = proc_copy / "1002" / "stat"
    stat.write_text(stat.read_text().replace(" 48231877 ", " 48399000 "))
    r = run(t)
    assert usage(r, K1, GPU[0]).processes == 1
    assert unattributed(r, GPU[0]) == {Unattributed.HOST: (1, 2 * GiB)}


def test_a_pid_reused_while_being_read_counts_as_vanished():
    starts = iter(["1002 (x) S" + " 0" * 18 + " 48231877 0\n", "1002 (x) S" + " 0" * 18 + " 50000000 0\n"])
    attributor = ProcessAttributor(CountingProcFS(PROC, {(1002, "stat"): lambda: next(starts)}))
    got = attributor.attribute(1002, KernelIndex(node_kernels()))
    assert (got.kernel_id, got.reason) == (None, Unattributed.VANISHED)
    assert len(attributor) == 0


def test_unreadable_entries_are_counted_with_a_reason_and_never_stop_the_others(proc_copy):
    # Tests may run as root, where chmod 000 does not deny reads. A directory where the cgroup file
    # should be gives EISDIR (an unexpected procfs answer); denial is injected as PermissionError,
    # which is what open() raises under hidepid=2 or without CAP_SYS_PTRACE.
    (proc_copy / "2001" / "cgroup").unlink()
    (proc_copy / "2001" / "cgroup").mkdir()
    r = run(tracker(CountingProcFS(proc_copy, {(3001, "stat"): PermissionError(13, "Permission denied")})))
    assert unattributed(r, GPU[2]) == {Unattributed.UNREADABLE: (1, 10 * GiB)}
    assert unattributed(r, GPU[3]) == {Unattributed.PERMISSION_DENIED: (1, 6 * GiB)}
    assert usage(r, K2, GPU[3]).processes == 1  # its sibling 2002 still read fine
    assert (usage(r, K2, GPU[2]).processes, usage(r, K2, GPU[2]).no_process_seconds) == (0, 0.0)
    assert usage(r, K1, GPU[0]).processes == 2


def test_malformed_stat_is_unreadable(proc_copy):
    (proc_copy / "1002" / "stat").write_text("1002 (truncated\n")
    assert unattributed(run(tracker(proc_copy)), GPU[0]) == {Unattributed.UNREADABLE: (1, 2 * GiB)}


def test_a_cid_appended_later_is_picked_up_from_the_cached_cgroup():
    # K3's container runs before the agent appends CID=: found by its mounts, then by its cgroup.
    procfs = CountingProcFS(PROC)
    attributor = ProcessAttributor(procfs)
    assert attributor.attribute(3001, KernelIndex(node_kernels())).via == "mountinfo"
    later = [kernel(K3, {"cuda.shares": {GPU[3]: "1.0"}}, K3_CID)]
    assert attributor.attribute(3001, KernelIndex(later)) == Attribution(K3, via="cgroup")
    assert procfs.reads[(3001, "cgroup")] == 1


def test_a_leaked_container_keeps_its_mounts_of_a_vanished_kernel():
    got = ProcessAttributor(ProcFS(PROC)).attribute(6001, KernelIndex(node_kernels()))
    assert (got.kernel_id, got.reason) == (None, Unattributed.UNKNOWN_CONTAINER)
    assert container_id_from_cgroup((PROC / "6001" / "cgroup").read_text()) == LEAKED_CID
