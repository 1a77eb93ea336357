"""A large forced scan's reads, made by a forked helper: the same answers as reading in-process,
whatever the helper does (dies, cannot be forked, is abandoned), and nothing left behind."""

from __future__ import annotations

import errno
import os
import time
from decimal import Decimal
from pathlib import Path

import pytest

from exporter.demo import write_kernel, write_recovery
from exporter.scratch import prefetch
from exporter.scratch.allocation import AllocationBook
from exporter.scratch.reader import Scanner

KERNELS = [f"k{i:04d}" for i in range(300)]
PARENT = os.getpid()


@pytest.fixture
def helper(monkeypatch) -> list[int]:
    """The helper for any number of kernels, as on a machine with a second CPU; the pids forked."""
    monkeypatch.setattr(prefetch, "MIN_KERNELS", 1)
    monkeypatch.setattr(prefetch, "_cpus", lambda: 2)
    pids, fork = [], os.fork

    def forked() -> int:
        pid = fork()
        if pid:
            pids.append(pid)
        return pid

    monkeypatch.setattr(prefetch.os, "fork", forked)
    return pids


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def reaped(pids: list[int]) -> bool:
    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    return bool(pids)


def by_whom(kernel_id: str) -> tuple[str, int]:
    return kernel_id, os.getpid()


def paced(kernel_id: str) -> tuple[str, int]:
    """A read that takes 1 ms in the helper and 5 ms here: the helper gets ahead of this process."""
    time.sleep(0.005 if os.getpid() == PARENT else 0.001)
    return by_whom(kernel_id)


def flatten(batches) -> list[tuple[str, int]]:
    out = []
    for ids, reads in batches:
        assert [k for k, _ in reads] == list(ids)
        out += reads
    return out


def test_the_helper_reads_from_the_front_this_process_from_the_back_each_kernel_once(helper) -> None:
    fds = open_fds()
    reads = dict(flatten(prefetch.read_batches(paced, KERNELS, 8)))
    assert sorted(reads) == KERNELS  # each exactly once: a dict would hide a repeat, the list below not
    assert reads[KERNELS[0]] != PARENT  # the helper's first batch
    assert reads[KERNELS[-1]] == PARENT  # read here while no batch of the helper's was waiting
    assert open_fds() == fds
    assert reaped(helper)


def test_each_kernel_is_read_once_where_the_two_meet(helper) -> None:
    reads = flatten(prefetch.read_batches(paced, KERNELS, 7))  # batches that straddle the meeting point
    assert sorted(k for k, _ in reads) == KERNELS


def test_small_scans_and_one_cpu_read_in_process(monkeypatch) -> None:
    reads = [r for _, rs in prefetch.read_batches(by_whom, KERNELS[:10], 4) for r in rs]
    assert reads == [(k, os.getpid()) for k in KERNELS[:10]]  # under MIN_KERNELS
    monkeypatch.setattr(prefetch, "MIN_KERNELS", 1)
    monkeypatch.setattr(prefetch, "_cpus", lambda: 1)
    assert [r for _, rs in prefetch.read_batches(by_whom, KERNELS, 64) for r in rs] == [(k, os.getpid()) for k in KERNELS]


def large_files(kernel_id: str) -> tuple[str, int, tuple[bytes, tuple[int, int]]]:
    """A kernel whose files are just under the 1 MiB cap (700 KiB here and 100 KiB), read as the
    scanner reads them: ``(bytes, stat)`` pairs; paced as :func:`paced`, so both sides read."""
    time.sleep(0.004 if os.getpid() == PARENT else 0.0005)
    return kernel_id, os.getpid(), ((b"S" * (700 << 10), (1, 2)), (b"R" * (100 << 10), (3, 4)))


@pytest.mark.parametrize("shared", [True, False], ids=["helper", "in-process"])
def test_batches_are_bounded_in_bytes_not_only_in_kernels(helper, monkeypatch, shared: bool) -> None:
    """64 kernels of ~800 KiB of files were one 51 MiB batch, held three times over in the helper
    while it pickled and sent it, and twice here while it arrived. A batch now closes at
    BATCH_BYTES (one kernel's files more at most), from the helper and from this process alike."""
    if not shared:
        monkeypatch.setattr(prefetch, "MIN_KERNELS", 10**9)
    batches = list(prefetch.read_batches(large_files, KERNELS[:120], 64))
    assert sorted(k for ids, _ in batches for k in ids) == KERNELS[:120]
    per_kernel = (700 + 100) << 10
    for ids, reads in batches:
        assert [k for k, _, _ in reads] == list(ids)
        assert prefetch.weight(reads) <= prefetch.BATCH_BYTES + per_kernel - 1
        assert len(ids) <= prefetch.BATCH_BYTES // per_kernel + 1
    pids = {pid for _, reads in batches for _, pid, _ in reads}
    assert (len(pids) == 2) == shared and PARENT in pids  # both sides batch by bytes
    assert prefetch.weight(("x", 7, None, ValueError("e"), [b"ab", (bytearray(3), memoryview(b"c"))])) == 6


SHARED = (Decimal("0.5"), "GPU-00000001-0000-4000-8000-00000000be01")


def shares_parts(kernel_id: str) -> tuple[str, int, tuple[Decimal, str]]:
    """A result holding the same objects as every other, as the parser's memos give: the amounts,
    ids and allocations that kernels share."""
    return (*paced(kernel_id), SHARED)


def test_what_the_helpers_batches_share_arrives_once(helper) -> None:
    """One unpickler for all of the helper's batches: an object every batch holds is one object
    here too (sharing the parser gave it, and unpickled once), not one copy per batch."""
    reads = [r for _, rs in prefetch.read_batches(shares_parts, KERNELS, 8) for r in rs]
    from_helper = [parts for _, pid, parts in reads if pid != PARENT]
    assert len(from_helper) > 16  # several batches
    assert len({id(parts) for parts in from_helper}) == 1 and from_helper[0] == SHARED


def test_a_helper_that_dies_midway_costs_nothing(helper) -> None:
    def dies_at_k0100(kernel_id: str) -> tuple[str, int]:
        if kernel_id == "k0100" and os.getpid() != PARENT:
            os._exit(9)  # killed (OOM, a signal) in the middle of a batch
        return paced(kernel_id)

    reads = flatten(prefetch.read_batches(dies_at_k0100, KERNELS, 8))
    assert sorted(k for k, _ in reads) == KERNELS
    by_helper = {k for k, pid in reads if pid != PARENT}
    assert by_helper and max(by_helper) < "k0096"  # whole batches before the torn one
    assert reaped(helper)


def test_a_helper_whose_read_raises_hands_the_rest_back(helper) -> None:
    def raises(kernel_id: str) -> tuple[str, int]:
        if os.getpid() != PARENT:
            raise MemoryError
        return by_whom(kernel_id)

    assert sorted(flatten(prefetch.read_batches(raises, KERNELS, 64))) == [(k, PARENT) for k in KERNELS]


def test_no_fork_no_helper(helper, monkeypatch) -> None:
    def refused() -> int:
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.setattr(prefetch.os, "fork", refused)
    fds = open_fds()
    assert sorted(flatten(prefetch.read_batches(by_whom, KERNELS, 64))) == [(k, PARENT) for k in KERNELS]
    assert open_fds() == fds


def test_a_caller_that_stops_early_leaves_no_child_or_descriptor(helper) -> None:
    fds = open_fds()
    batches = prefetch.read_batches(by_whom, KERNELS * 40, 64)  # ~12,000 reads: more than the pipe holds
    next(batches)
    batches.close()
    assert reaped(helper)
    assert open_fds() == fds


def test_a_caller_that_stops_early_does_not_wait_for_a_stuck_helper(helper) -> None:
    def hangs_at_k0100(kernel_id: str) -> tuple[str, int]:
        if kernel_id == "k0100" and os.getpid() != PARENT:
            time.sleep(3600)  # a read on a hung network mount
        return by_whom(kernel_id)

    batches = prefetch.read_batches(hangs_at_k0100, KERNELS, 64)
    next(batches)
    started = time.monotonic()
    batches.close()
    assert time.monotonic() - started < 30  # killed and reaped, not waited for (an hour)
    assert reaped(helper)


def mixed_tree(root: Path, outside: Path) -> None:
    """Every kind of kernel a scan meets, with recovery.json where 25.18+ writes it."""
    for i in range(40):
        kid = f"{i:08x}-0000-4000-8000-000000000000"
        write_kernel(root, kid, {"cuda.shares": {f"GPU-{i % 3}": Decimal(i % 7 + 1) / 10}}, container_id=f"{i:064x}")
        if i % 2:
            write_recovery(root, kid, "5f4c5a0a-0000-4000-8000-000000000001", "7a8e5c9f-0000-4000-8000-000000000002")
    outside.mkdir()
    (outside / "resource.txt").write_text("SECRET=1\n")
    (root / "alias").mkdir()
    (root / "alias/config").symlink_to(root / "00000001-0000-4000-8000-000000000000/config")
    (root / "escape").mkdir()
    (root / "escape/config").symlink_to(outside)
    (root / "fifo/config").mkdir(parents=True)
    os.mkfifo(root / "fifo/config/resource.txt")
    (root / "big/config").mkdir(parents=True)
    (root / "big/config/resource.txt").write_bytes(b"x" * (2 << 20))
    (root / "unreadable/config").mkdir(parents=True)
    (root / "unreadable/config/resource.txt").write_bytes(b"SLOTS={\xff}\n")
    (root / "torn/config").mkdir(parents=True)
    (root / "torn/config/resource.txt").write_text("SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={\"cuda.sha")
    (root / "starting/config").mkdir(parents=True)


def test_a_scan_through_the_helper_books_what_an_in_process_scan_books(tmp_path, monkeypatch) -> None:
    root = tmp_path / "root"
    mixed_tree(root, tmp_path / "outside")

    def scan(min_kernels: int) -> AllocationBook:
        monkeypatch.setattr(prefetch, "MIN_KERNELS", min_kernels)
        monkeypatch.setattr(prefetch, "_cpus", lambda: 2)
        book = AllocationBook(clock=lambda: 1.0)
        Scanner(book, clock=lambda: 2e9).scan(str(root))
        return book

    here, helped = scan(10**9).view(), scan(1).view()
    assert len(here.kernels) == 47
    assert helped.kernels == here.kernels  # states, reasons, allocations and identities alike
    assert helped.alloc_map == here.alloc_map and helped.parse_errors_total == here.parse_errors_total == 6
    assert sum(k.identity is not None for k in helped.kernels.values()) == 20
