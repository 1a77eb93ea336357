"""Ghost memory: GPU memory held by dead processes, processes of no kernel and processes of ended
kernels, found from a procfs tree written under ``tmp_path``; and what it does to fGPU headroom."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from exporter.analysis.agents import AgentLayout
from exporter.analysis.attribution import AttributionTracker, ProcFS
from exporter.analysis.capacity import CapacityConfig, GpuInventory, usable_capacity
from exporter.analysis.ghost import GhostCause, GhostTracker
from exporter.analysis.liveness import KernelLiveness, Liveness
from exporter.analysis.node import HeadroomParams, Inventory, headroom_figures, inventory_from_snapshot, node_state
from exporter.analysis.pipeline import _allocation_stage
from exporter.scratch.allocation import Allocation, AllocationBook, Kernel, KernelState, ResourceSpec
from exporter.scratch.identity import Identity
from exporter.scratch.resources import parse_resource
from exporter.telemetry.devices import DeviceResolver
from exporter.telemetry.model import DeviceReading, GpuProcess, TelemetrySnapshot

GIB = 1024**3
GPU0, GPU1 = "GPU-00000000-0000-4000-8000-000000000000", "GPU-11111111-1111-4111-8111-111111111111"
KA, KB = "aaaaaaaa-0000-4000-8000-000000000001", "bbbbbbbb-0000-4000-8000-000000000002"
CA, CB = "a" * 64, "b" * 64


def write_proc(root: Path, pid: int, *, start: int, cid: str | None = None, comm: str = "python") -> None:
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    # Fields 3.. after the command: state, 18 fields, then field 22 (start time).
    (d / "stat").write_text(f"{pid} ({comm}) S " + " ".join(["0"] * 18) + f" {start} 0 0\n")
    (d / "cgroup").write_text(f"0::/system.slice/docker-{cid}.scope\n" if cid else "0::/user.slice/session-1.scope\n")
    (d / "mountinfo").write_text("22 1 8:1 / / rw - ext4 /dev/sda1 rw\n")
    (d / "comm").write_text(comm + "\n")


def remove_proc(root: Path, pid: int) -> None:
    for f in (root / str(pid)).iterdir():
        f.unlink()
    (root / str(pid)).rmdir()


def kernel(kid: str, cid: str | None, shares: dict[str, str], session: str, user: str) -> Kernel:
    allocs = tuple(Allocation("cuda.shares", d, Decimal(a)) for d, a in shares.items())
    return Kernel(kid, "/scratch", KernelState.OK, ResourceSpec(allocs, (), cid), None, 0.0,
                  Identity(kid, session_id=session, user_id=user))


def snapshot(processes: dict[str, list[tuple[int, int]]]) -> TelemetrySnapshot:
    devices = tuple(
        DeviceReading(uuid=uuid, index=i, memory_total_bytes=80 * GIB, multiprocessor_count=132,
                      processes=tuple(GpuProcess(pid, mem) for pid, mem in processes.get(uuid, [])))
        for i, uuid in enumerate((GPU0, GPU1))
    )
    return TelemetrySnapshot(source="nvml", devices=devices, success=True)


class Node:
    """Attribution and the ghost tracker over one procfs, as the pipeline's usage stage runs them."""

    def __init__(self, proc: Path, procfs: ProcFS | None = None, **kw) -> None:
        procfs = procfs or ProcFS(proc)
        self.attribution = AttributionTracker(procfs, lambda: 0.0)
        self.ghost = GhostTracker(procfs, **kw)

    def pass_(self, processes, kernels, liveness=None):
        snap = snapshot(processes)
        by_id = {k.kernel_id: k for k in kernels}
        ids = [a.device_id for k in kernels for a in k.allocations]
        result = self.attribution.update(snap, kernels, DeviceResolver(snap, ids))
        return self.ghost.update(result, by_id, liveness)


@pytest.fixture
def proc(tmp_path):
    root = tmp_path / "proc"
    root.mkdir()
    return root


def test_a_live_kernel_process_is_no_ghost_and_every_read_device_reports(proc):
    write_proc(proc, 100, start=5, cid=CA)
    ghost = Node(proc).pass_({GPU0: [(100, 4 * GIB)]}, [kernel(KA, CA, {GPU0: "1"}, "s-a", "u-a")])
    assert ghost.bytes == {} and ghost.holders == ()
    assert ghost.devices == {GPU0, GPU1}


def test_a_dead_process_counts_with_the_kernel_it_last_belonged_to(proc):
    write_proc(proc, 100, start=5, cid=CA)
    node = Node(proc)
    kernels = [kernel(KA, CA, {GPU0: "1"}, "s-a", "u-a")]
    node.pass_({GPU0: [(100, 4 * GIB)]}, kernels)
    remove_proc(proc, 100)
    ghost = node.pass_({GPU0: [(100, 4 * GIB)]}, kernels)
    assert ghost.bytes == {(GPU0, GhostCause.DEAD_PROCESS): 4 * GIB}
    (holder,) = ghost.holders
    assert (holder.pid, holder.cause, holder.kernel.kernel_id, holder.kernel.session_id, holder.kernel.user_id) == (
        100, GhostCause.DEAD_PROCESS, KA, "s-a", "u-a")


def test_a_reused_pid_is_the_dead_holder_not_the_new_process(proc):
    write_proc(proc, 100, start=5, cid=CA)
    node = Node(proc)
    kernels = [kernel(KA, CA, {GPU0: "1"}, "s-a", "u-a")]
    node.pass_({GPU0: [(100, 4 * GIB)]}, kernels)
    write_proc(proc, 100, start=9000, comm="sshd")  # the PID now names an unrelated host process
    ghost = node.pass_({GPU0: [(100, 4 * GIB)]}, kernels)
    assert ghost.bytes == {(GPU0, GhostCause.DEAD_PROCESS): 4 * GIB}
    assert ghost.holders[0].kernel.kernel_id == KA


def test_a_pid_that_left_nvml_lists_is_a_new_process_when_it_returns(proc):
    write_proc(proc, 100, start=5, cid=CA)
    node = Node(proc)
    kernels = [kernel(KA, CA, {GPU0: "1"}, "s-a", "u-a")]
    node.pass_({GPU0: [(100, GIB)]}, kernels)
    node.pass_({}, kernels)
    write_proc(proc, 100, start=9000, cid=CA)
    assert node.pass_({GPU0: [(100, GIB)]}, kernels).bytes == {}


def test_a_host_process_is_a_ghost_unless_it_is_a_known_host_service(proc):
    write_proc(proc, 200, start=5, comm="rogue-trainer")
    write_proc(proc, 201, start=5, comm="nvidia-persiste")
    ghost = Node(proc).pass_({GPU1: [(200, 2 * GIB), (201, GIB)]}, [])
    assert ghost.bytes == {(GPU1, GhostCause.UNATTRIBUTED_PROCESS): 2 * GIB}
    assert [(h.pid, h.kernel) for h in ghost.holders] == [(200, None)]


def test_a_process_of_a_kernel_whose_scratch_directory_is_gone_is_named_by_its_last_identity(proc):
    write_proc(proc, 300, start=5, cid=CB)
    node = Node(proc)
    node.pass_({GPU0: [(300, 3 * GIB)]}, [kernel(KB, CB, {GPU0: "1"}, "s-b", "u-b")])
    ghost = node.pass_({GPU0: [(300, 3 * GIB)]}, [])  # the kernel's directory was removed
    assert ghost.bytes == {(GPU0, GhostCause.ENDED_KERNEL): 3 * GIB}
    k = ghost.holders[0].kernel
    assert (k.kernel_id, k.session_id, k.user_id) == (KB, "s-b", "u-b")


def test_a_process_of_a_kernel_whose_container_is_gone_is_ended_kernel(proc):
    write_proc(proc, 300, start=5, cid=CB)
    kernels = [kernel(KB, CB, {GPU0: "1"}, "s-b", "u-b")]
    stale = {KB: KernelLiveness(Liveness.STALE, "container-gone")}
    ghost = Node(proc).pass_({GPU0: [(300, 3 * GIB)]}, kernels, stale)
    assert ghost.bytes == {(GPU0, GhostCause.ENDED_KERNEL): 3 * GIB}


def test_a_proc_that_changes_during_the_read_counts_as_dead(proc):
    write_proc(proc, 100, start=5, cid=CA)

    class Changing(ProcFS):
        """The PID exits and is reused between the cgroup read and the confirmation."""

        def read(self, pid, name):
            text = super().read(pid, name)
            if name == "cgroup":
                write_proc(proc, 100, start=777)
            return text

    ghost = Node(proc, Changing(proc)).pass_({GPU0: [(100, GIB)]}, [kernel(KA, CA, {GPU0: "1"}, "s", "u")])
    assert ghost.bytes == {(GPU0, GhostCause.DEAD_PROCESS): GIB}


def test_unreadable_processes_are_not_counted(proc):
    (proc / "400").mkdir()
    (proc / "400" / "stat").write_text("garbage")
    assert Node(proc).pass_({GPU0: [(400, GIB)]}, []).bytes == {}


def test_holders_are_bounded_per_device_largest_first(proc):
    ghost = Node(proc, holders_per_device=2).pass_({GPU0: [(10, GIB), (11, 3 * GIB), (12, 2 * GIB)]}, [])
    assert [h.pid for h in ghost.holders] == [11, 12]
    assert ghost.bytes == {(GPU0, GhostCause.DEAD_PROCESS): 6 * GIB}  # the sum keeps every holder


def test_the_kernel_memory_is_bounded_and_holds_the_kernels_that_left(proc):
    node = Node(proc, kernel_memory=2)
    everyone = {f"k-{i}": kernel(f"k-{i}", f"{i:064x}", {}, "s", "u") for i in range(5)}
    node.ghost.remember(everyone)
    assert not node.ghost._by_id  # present kernels are read from the view, not memorised
    node.ghost.remember({})
    assert len(node.ghost._kernels) == 2 and len(node.ghost._by_id) == 2


def test_told_which_kernels_changed_it_looks_at_them_only(proc):
    """With the book's record of changes, a pass after a kernel left memorises it from the
    changes alone (no difference of every kernel's id), as the difference would."""
    from exporter.analysis.pipeline import _changes
    from exporter.scratch.allocation import AllocationBook
    from exporter.scratch.resources import ResourceSpec

    book = AllocationBook(clock=lambda: 0.0)
    for i in range(5):
        book.apply(f"k-{i}", "/scratch", ResourceSpec((), (), f"{i:064x}"))
    told, walked = Node(proc).ghost, Node(proc).ghost
    for ghost in (told, walked):
        view = book.view()
        ghost.remember(view.kernels, view.version, lambda v, view=view: _changes(view, v))
    book.remove("k-3")
    view = book.view()
    asked = []

    class Table(dict):  # the view's kernels, with their key set watched
        def keys(self):
            asked.append(True)
            return super().keys()

    told._current = Table(told._current)
    told.remember(view.kernels, view.version, lambda v: _changes(view, v))
    walked.remember(view.kernels)
    assert not asked
    assert told._by_id.keys() == walked._by_id.keys() == {"k-3"} and told._kernels.keys() == walked._kernels.keys()


# -- usable memory in the node state --------------------------------------------------------------


def test_usable_capacity_takes_spare_memory_first_then_shares():
    cfg = CapacityConfig()
    # 40 GiB, 108 SMs: 13.5 shares (SM-bound) use 27 GiB; 13 GiB are spare.
    assert usable_capacity(Decimal("13.5"), 40 * GIB, 0, cfg) == Decimal("13.5")
    assert usable_capacity(Decimal("13.5"), 40 * GIB, 13 * GIB, cfg) == Decimal("13.5")
    assert usable_capacity(Decimal("13.5"), 40 * GIB, 14 * GIB, cfg) == Decimal("13.0")
    assert usable_capacity(Decimal("13.5"), 40 * GIB, 14 * GIB + 1, cfg) == Decimal("12.99")  # rounded up
    assert usable_capacity(Decimal("13.5"), None, 14 * GIB, cfg) == Decimal("13.5")  # memory unknown
    assert usable_capacity(Decimal("1"), 2 * GIB, 10 * GIB, cfg) == Decimal(0)


def _state_of(inventory, shares: str, ghost=None):
    book = AllocationBook(lambda: 0.0)
    book.apply(KA, "/scratch", parse_resource(f"SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={{}}\nCUDA.SHARES_SHARES={shares}\n",
                                              "resource.txt"))
    view = book.view()
    return view, node_state(view, inventory, HeadroomParams(), {}, None, ghost)


def test_ghost_memory_lowers_fgpu_headroom_and_flags_the_shares_that_lose_memory():
    inventory = Inventory(gpus=(GpuInventory(GPU0, 40 * GIB, 108), GpuInventory(GPU1, 40 * GIB, 108)))
    kernels = f"{GPU0}:13"
    view, clean = _state_of(inventory, kernels)
    _, same = _state_of(inventory, kernels, {GPU0: 0})
    assert same == clean and not clean.blocked
    params = HeadroomParams()
    assert headroom_figures(same, inventory, params) == headroom_figures(clean, inventory, params)

    _, ghosted = _state_of(inventory, kernels, {GPU0: 20 * GIB})
    row = ghosted.slots["cuda.shares"][0]
    assert row.capacity == Decimal("10.0") and ghosted.blocked == {(GPU0, "cuda.shares"): Decimal("3.5")}
    assert headroom_figures(ghosted, inventory, params).summaries["cuda.shares"].free < (
        headroom_figures(clean, inventory, params).summaries["cuda.shares"].free)

    snap = TelemetrySnapshot(source="nvml")
    fields = _allocation_stage(view, snap, DeviceResolver(snap, [GPU0]), inventory, params, AgentLayout(roots=()),
                               {}, {GPU0: 20 * GIB})
    assert fields["short_shares"] == ((KA, GPU0),)
    # The ratio map's divisors stay the registered capacity.
    assert fields["ratio_capacities"][("cuda.shares", GPU0)] == Decimal("13.5")


def test_reserved_memory_counts_only_where_the_total_still_includes_it():
    reading = DeviceReading(uuid=GPU0, index=0, memory_total_bytes=80 * GIB, memory_reserved_bytes=GIB,
                            allocatable_memory_bytes=79 * GIB, multiprocessor_count=132)
    snap = TelemetrySnapshot(source="nvml", devices=(reading,))
    assert inventory_from_snapshot(snap, DeviceResolver(snap, [])).gpus[0].memory_reserved_bytes == 0
    bare = TelemetrySnapshot(source="nvml", devices=(DeviceReading(uuid=GPU0, index=0, memory_total_bytes=80 * GIB,
                                                                   memory_reserved_bytes=GIB, multiprocessor_count=132),))
    assert inventory_from_snapshot(bare, DeviceResolver(bare, [])).gpus[0].memory_reserved_bytes == GIB


def test_the_pipeline_takes_ghost_memory_out_of_headroom_in_the_same_pass(proc):
    from exporter.analysis.pipeline import AnalysisPipeline, PipelineConfig

    book = AllocationBook(lambda: 0.0)
    book.apply(KA, "/scratch", parse_resource(f"SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={{}}\nCUDA.SHARES_SHARES={GPU0}:13\n",
                                              "resource.txt"))
    reading = DeviceReading(uuid=GPU0, index=0, memory_total_bytes=40 * GIB, multiprocessor_count=108,
                            processes=(GpuProcess(999, 20 * GIB),))  # PID 999 has no /proc entry: dead
    snap = TelemetrySnapshot(source="nvml", devices=(reading,), success=True)
    procfs = ProcFS(proc)
    pipeline = AnalysisPipeline(PipelineConfig(), book.view, lambda: (1, snap),
                                tracker=AttributionTracker(procfs, lambda: 0.0), ghost=GhostTracker(procfs))
    model = pipeline.step()
    assert model.ghost_totals == {GPU0: 20 * GIB}
    assert model.state.slots["cuda.shares"][0].capacity == Decimal("10.0")
    assert model.short_shares == ((KA, GPU0),)
    assert model.ratio_capacities[("cuda.shares", GPU0)] == Decimal("13.5")
