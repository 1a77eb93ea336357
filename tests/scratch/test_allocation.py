"""The allocation model and the scanner: states, last good allocation, exact totals, snapshots."""

from __future__ import annotations

import os
import random
import threading
from decimal import Decimal
from pathlib import Path

import pytest
from backendai_reference import WITH_CUDA_MEM, read_allocations, scan_gpu_alloc_map
from helpers import FIXTURES

from exporter.demo import write_kernel, write_recovery
from exporter.scratch import reader as reader_module
from exporter.scratch.allocation import AllocationBook, KernelState
from exporter.scratch.reader import Scanner, read_kernel
from exporter.scratch.resources import Pending, ResourceParseError, parse_resource

SAMPLES = sorted((FIXTURES / "resources").glob("*.txt"))
SAMPLES_26 = sorted((FIXTURES / "resources-26").glob("*.txt"))
GOOD = 'SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={"cuda.shares":"0.5"}\nCUDA.SHARES_SHARES=GPU-a:0.5\n'


def test_invalid_file_keeps_the_last_good_allocation_and_others_are_unaffected(tmp_path: Path) -> None:
    book = AllocationBook(clock=lambda: 100.0)
    scanner = Scanner(book)
    write_kernel(tmp_path, "k1", {"cuda.shares": {"GPU-a": Decimal("0.5")}})
    write_kernel(tmp_path, "k2", {"cuda.shares": {"GPU-a": Decimal("0.25")}})
    scanner.scan(str(tmp_path))
    assert book.view().alloc_map == {"GPU-a": "0.75"}

    (tmp_path / "k1/config/resource.txt").write_text(GOOD.replace("0.5\n", "NaN\n"))
    scanner.refresh(str(tmp_path), "k1")
    view = book.view()
    k1 = view.kernels["k1"]
    assert k1.state is KernelState.INVALID
    assert "resource.txt:4: CUDA.SHARES_SHARES entry 1: not a finite number" in k1.reason
    assert view.alloc_map == {"GPU-a": "0.75"}  # the last good 0.5 is still counted
    assert view.kernels["k2"].state is KernelState.OK
    assert view.parse_errors_total == 1

    (tmp_path / "k1/config/resource.txt").write_text(GOOD.replace("0.5\n", "0.125\n"))
    scanner.refresh(str(tmp_path), "k1")
    assert book.view().alloc_map == {"GPU-a": "0.375"}
    assert book.view().kernels["k1"].state is KernelState.OK


def test_removing_a_kernel_removes_its_allocation(tmp_path: Path) -> None:
    book = AllocationBook()
    scanner = Scanner(book)
    write_kernel(tmp_path, "k1", {"cuda.device": {"GPU-a": Decimal(1)}})
    scanner.scan(str(tmp_path))
    assert book.view().device_totals == {("GPU-a", "cuda.device"): Decimal(1)}
    (tmp_path / "k1/config/resource.txt").unlink()
    (tmp_path / "k1/config").rmdir()
    (tmp_path / "k1/work").rmdir()
    (tmp_path / "k1").rmdir()
    scanner.refresh(str(tmp_path), "k1")
    assert book.view().device_totals == {}
    assert book.view().kernels == {}


def test_views_are_immutable_snapshots() -> None:
    book = AllocationBook()
    book.apply("k1", "/r", parse_resource(GOOD))
    before = book.view()
    book.apply("k2", "/r", parse_resource(GOOD))
    after = book.view()
    assert len(before.kernels) == 1 and len(after.kernels) == 2
    assert before.alloc_map == {"GPU-a": "0.5"} and after.alloc_map == {"GPU-a": "1.0"}
    with pytest.raises(TypeError):
        before.kernels["x"] = None  # type: ignore[index]
    assert book.view() is after  # unchanged state: the same snapshot, no rebuild


def test_a_pending_kernel_without_history_counts_nothing() -> None:
    book = AllocationBook()
    book.apply("k1", "/r", Pending("missing SLOTS"))
    view = book.view()
    assert view.state_counts[KernelState.PENDING] == 1 and view.device_totals == {}


def test_reapplying_the_same_outcome_is_not_a_change() -> None:
    book = AllocationBook()
    assert book.apply("k1", "/r", parse_resource(GOOD)) is not None
    version = book.version
    assert book.apply("k1", "/r", parse_resource(GOOD)) is None
    assert book.version == version


def test_running_totals_equal_a_fresh_sum_after_random_churn() -> None:
    rng = random.Random(7)
    book = AllocationBook()
    live: dict[str, str] = {}
    for _ in range(3000):
        kid = f"k{rng.randrange(60)}"
        if rng.random() < 0.3:
            book.remove(kid)
            live.pop(kid, None)
            continue
        # Mixed exponents ("1", "1.50", "0.500", "8E+1") make trailing zeros matter in the output.
        amount = rng.choice(["1", "2", "1.50", "0.5", "0.500", "0.25", "8E+1", "0.01", "3.10"])
        dev = f"GPU-{rng.randrange(4)}"
        slot = rng.choice(["CUDA.SHARES", "CUDA.DEVICE"])
        text = f'SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={{"{slot.lower()}":"{amount}"}}\n{slot}_SHARES={dev}:{amount}\n'

        book.apply(kid, "/r", parse_resource(text))
        live[kid] = text
    view = book.view()
    assert dict(view.alloc_map) == dict(sorted(scan_gpu_alloc_map(list(live.values())).items()))
    fresh: dict = {}
    for text in live.values():
        for slot, per in read_allocations(text).items():
            for dev, amt in per.items():
                if "." in slot:
                    fresh[(dev, slot)] = fresh.get((dev, slot), Decimal(0)) + amt
    assert {k: v for k, v in view.device_totals.items()} == fresh
    assert book.view().alloc_map == view.alloc_map


def test_state_counts_kept_as_kernels_change_equal_a_recount() -> None:
    rng = random.Random(11)
    book = AllocationBook()
    outcomes = [parse_resource(GOOD), parse_resource(GOOD.replace("0.5", "0.25")), Pending("missing SLOTS")]
    for step in range(2000):
        kid = f"k{rng.randrange(40)}"
        roll = rng.random()
        if roll < 0.2:
            book.remove(kid)
        elif roll < 0.25:
            book.remove_many([f"k{rng.randrange(40)}" for _ in range(5)])
        elif roll < 0.35:
            book.apply(kid, "/r", ResourceParseError("/r/x", 1, "bad"))
        else:
            book.apply(kid, "/r", rng.choice(outcomes))
        if step % 97 == 0:
            view = book.view()
            recount = {s: sum(k.state is s for k in view.kernels.values()) for s in KernelState}
            assert dict(view.state_counts) == recount


def test_kernels_removed_together_are_one_change() -> None:
    book = AllocationBook()
    changes = []
    book.subscribe(lambda: changes.append(1))
    for i in range(5):
        book.apply(f"k{i}", "/r", parse_resource(GOOD))
    version, changes[:] = book.version, []
    assert book.remove_many(["k0", "k1", "k2", "gone", "k1"]) == 3
    assert book.version == version + 1 and changes == [1]
    assert sorted(book.view().kernels) == ["k3", "k4"] and book.view().alloc_map == {"GPU-a": "1.0"}
    assert book.remove_many(["gone"]) == 0 and book.version == version + 1 and changes == [1]


def test_kernels_landed_together_are_one_change_and_only_the_changed_are_returned() -> None:
    """A forced scan lands a batch at a time: one version and one notification for the batch,
    and the kernels that changed (for the log), as apply returns them one by one."""
    book = AllocationBook()
    changes = []
    book.subscribe(lambda: changes.append(1))
    book.apply("k0", "/r", parse_resource(GOOD))
    version, changes[:] = book.version, []
    bad = ResourceParseError("/r/k2/config/resource.txt", 3, "SLOTS is not valid JSON")
    landed = book.apply_many("/r", [("k0", parse_resource(GOOD), None), ("k1", parse_resource(GOOD), None), ("k2", bad, None)])
    assert [k.kernel_id for k in landed] == ["k1", "k2"]  # k0 read the same: not a change
    assert book.version == version + 1 and changes == [1]
    assert book.view().changed_since(version) == frozenset({"k1", "k2"})
    assert book.view().alloc_map == {"GPU-a": "1.0"} and book.view().parse_errors_total == 1
    assert book.apply_many("/r", [("k0", parse_resource(GOOD), None)]) == [] and book.version == version + 1


def test_changed_since_names_every_kernel_that_changed_after_a_version(monkeypatch) -> None:
    """Against a diff of the views themselves: every kernel that came, went or was replaced
    (an identity too) after any version the book still records, and None past its record."""
    from exporter.scratch import allocation
    from exporter.scratch.identity import Identity

    monkeypatch.setattr(allocation, "_CHANGES_KEPT", 40)
    rng = random.Random(3)
    book = AllocationBook()
    outcomes = [parse_resource(GOOD), parse_resource(GOOD.replace("0.5", "0.25")), Pending("missing SLOTS")]
    views = [book.view()]
    for _ in range(400):
        kid = f"k{rng.randrange(30)}"
        roll = rng.random()
        if roll < 0.15:
            book.remove(kid)
        elif roll < 0.2:
            book.remove_many([f"k{rng.randrange(30)}" for _ in range(rng.choice([3, 60]))])
        elif roll < 0.3:
            book.set_identity(kid, Identity(kid, session_id=f"s{rng.randrange(3)}"))
        else:
            book.apply(kid, "/r", rng.choice(outcomes))
        view = book.view()
        if view.version != views[-1].version:
            views.append(view)
    now, known = views[-1], 0
    for old in views:
        changed = now.changed_since(old.version)
        if changed is None:
            assert now.changes_from is not None and old.version < now.changes_from
            continue
        known += 1
        diff = {k for k in old.kernels.keys() | now.kernels.keys() if old.kernels.get(k) is not now.kernels.get(k)}
        assert diff <= changed  # a kernel changed and changed back is named too: never one missed
        assert changed <= old.kernels.keys() | now.kernels.keys() | {k for _, k in now.changes}
    assert known > 10 and now.changed_since(now.version) == frozenset()
    assert now.changed_since(now.version + 1) is None and views[0].changed_since(-5) is None


def test_a_scratch_tree_of_backendai_samples_matches_what_the_agent_reads_back(tmp_path: Path) -> None:
    samples = SAMPLES + SAMPLES_26
    for i, sample in enumerate(samples):
        config = tmp_path / f"kernel-{i}" / "config"
        config.mkdir(parents=True)
        (config / "resource.txt").write_text(sample.read_text())
    book = AllocationBook()
    Scanner(book).scan(str(tmp_path))
    view = book.view()
    texts = [s.read_text() for s in samples]
    # Every file counts, as an agent whose plugins register cuda.mem reads them all ...
    assert dict(view.alloc_map) == dict(sorted(scan_gpu_alloc_map(texts, WITH_CUDA_MEM).items()))
    # ... while the newest open-source agent stops at the first cuda.mem file, and those are flagged.
    first_bad = next(i for i, t in enumerate(texts) if "CUDA.MEM_SHARES" in t)
    assert scan_gpu_alloc_map(texts) == scan_gpu_alloc_map(texts[:first_bad])
    flagged = {k for k, v in view.kernels.items() if v.spec.agent_unreadable}
    assert flagged == {f"kernel-{i}" for i, t in enumerate(texts) if "CUDA.MEM_SHARES" in t}
    for i, sample in enumerate(samples):
        expected = {(slot, d, a) for slot, per in read_allocations(sample.read_text(), WITH_CUDA_MEM).items() for d, a in per.items()}
        got = {(a.slot, a.device_id, a.amount) for a in view.kernels[f"kernel-{i}"].allocations}
        assert got == expected


def test_non_kernel_siblings_are_skipped(tmp_path: Path) -> None:
    write_kernel(tmp_path, "k1", {})
    (tmp_path / "k1_tmp").mkdir()
    (tmp_path / "k1.img").write_bytes(b"\0" * 16)
    (tmp_path / ".hidden").mkdir()
    book = AllocationBook()
    assert Scanner(book).scan(str(tmp_path)).kernels == 1
    assert set(book.view().kernels) == {"k1"}


def test_unsafe_files_become_invalid_with_a_reason(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text(GOOD)
    root = tmp_path / "root"
    (root / "link/config").mkdir(parents=True)
    (root / "link/config/resource.txt").symlink_to(outside)
    (root / "fifo/config").mkdir(parents=True)
    os.mkfifo(root / "fifo/config/resource.txt")
    (root / "dir/config/resource.txt").mkdir(parents=True)
    (root / "big/config").mkdir(parents=True)
    (root / "big/config/resource.txt").write_text(GOOD + "X=" + "y" * 5000 + "\n")
    (root / "latin/config").mkdir(parents=True)
    (root / "latin/config/resource.txt").write_bytes(GOOD.encode() + b"X=\xff\xfe\n")
    (root / "empty/config").mkdir(parents=True)
    reasons = {k: read_kernel(str(root), k, max_bytes=4096) for k in ("link", "fifo", "dir", "big", "latin", "empty")}
    assert "resource.txt is a symlink" in str(reasons["link"])
    assert "not a regular file" in str(reasons["fifo"])
    assert "not a regular file" in str(reasons["dir"])
    assert "over the 4096-byte limit" in str(reasons["big"])
    assert "not UTF-8" in str(reasons["latin"])
    assert isinstance(reasons["empty"], Pending)
    for name in ("link", "fifo", "dir", "big", "latin"):
        assert str(root / name / "config/resource.txt") in str(reasons[name])


def test_a_missing_root_empties_it_and_reports_the_error(tmp_path: Path) -> None:
    book = AllocationBook()
    scanner = Scanner(book)
    write_kernel(tmp_path / "root", "k1", {"cuda.shares": {"GPU-a": Decimal(1)}})
    assert scanner.scan(str(tmp_path / "root")).ok
    (tmp_path / "root").rename(tmp_path / "gone")
    stats = scanner.scan(str(tmp_path / "root"))
    assert not stats.ok and "No such file" in stats.error
    assert book.view().kernels == {}


def test_symlinks_are_refused_inside_the_root_as_outside(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write_kernel(root, "real", {"cuda.shares": {"GPU-a": Decimal("0.5")}})
    (root / "alias").mkdir()
    (root / "alias/config").symlink_to(root / "real/config")
    write_kernel(tmp_path / "elsewhere", "k", {"cuda.shares": {"GPU-a": Decimal("0.5")}})
    (root / "escape").mkdir()
    (root / "escape/config").symlink_to(tmp_path / "elsewhere/k/config")
    assert "config/ is a symlink" in str(read_kernel(str(root) + "/", "alias"))  # would count "real" twice
    assert "config/ is a symlink" in str(read_kernel(str(root), "escape"))
    assert read_kernel(str(root), "real").allocations


def test_an_unterminated_last_line_is_read_once_the_file_has_settled(tmp_path: Path) -> None:
    config = tmp_path / "k1" / "config"
    config.mkdir(parents=True)
    res = config / "resource.txt"
    res.write_text('SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={"cuda.shares":"0.5"}\nCUDA.SHARES_SHARES=GPU-a:0.5')
    now = [res.stat().st_mtime + 1.0]
    book = AllocationBook()
    scanner = Scanner(book, clock=lambda: now[0], settle_seconds=5.0)
    scanner.scan(str(tmp_path), force=False)
    assert book.view().kernels["k1"].state is KernelState.PENDING
    now[0] += 10.0  # nothing touched it since: the writer is done; an unchanged file is re-read
    scanner.scan(str(tmp_path), force=False)
    assert book.view().kernels["k1"].state is KernelState.OK
    assert book.view().alloc_map == {"GPU-a": "0.5"}


def test_a_close_write_event_completes_an_unterminated_file(tmp_path: Path) -> None:
    config = tmp_path / "k1" / "config"
    config.mkdir(parents=True)
    (config / "resource.txt").write_text('SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={"cuda.shares":"0.5"}\nCUDA.SHARES_SHARES=GPU-a:0.5')
    book = AllocationBook()
    scanner = Scanner(book)
    scanner.refresh(str(tmp_path), "k1")
    assert book.view().kernels["k1"].state is KernelState.PENDING
    scanner.refresh(str(tmp_path), "k1", closed=True)
    assert book.view().kernels["k1"].state is KernelState.OK


def _uuid_kernel(root: Path, i: int, amount: str, identity: bool) -> str:
    kid = f"00000000-0000-4000-8000-{i:012x}"
    write_kernel(root, kid, {"cuda.shares": {"GPU-a": Decimal(amount)}})
    if identity:
        write_recovery(root, kid, f"11111111-0000-4000-8000-{i:012x}", None)
    return kid


def test_a_forced_scan_signs_files_by_their_reads_and_a_rescan_reads_only_changes(tmp_path: Path, monkeypatch) -> None:
    kids = [_uuid_kernel(tmp_path, i, "0.25", identity=i < 2) for i in range(3)]
    reads, stats = [], []
    real_read, real_stat = reader_module._read_config, os.stat
    monkeypatch.setattr(reader_module, "_read_config", lambda root, kid, files, root_fd=None: reads.append(
        (kid, tuple(name for name, _ in files))) or real_read(root, kid, files, root_fd))
    monkeypatch.setattr(os, "stat", lambda path, *a, **kw: stats.append(os.fspath(path)) or real_stat(path, *a, **kw))
    book = AllocationBook()
    scanner = Scanner(book)

    scanner.scan(str(tmp_path))
    # One walk per kernel for both files; no stat, whether recovery.json is there or not.
    assert sorted(reads) == [(k, ("resource.txt", "recovery.json")) for k in kids] and stats == []
    assert book.view().alloc_map == {"GPU-a": "0.75"}
    assert [book.view().kernels[k].identity is not None for k in kids] == [True, True, False]

    reads.clear()
    scanner.scan(str(tmp_path), force=False)
    assert reads == [] and len(stats) == 2 * len(kids)  # the signatures taken from the reads match

    (tmp_path / kids[0] / "config/resource.txt").write_text(
        (tmp_path / kids[0] / "config/resource.txt").read_text().replace("0.25", "0.5"))
    # Another size too: a rewrite within the filesystem's timestamp granularity keeps the mtime.
    write_recovery(tmp_path, kids[1], "22222222-0000-4000-8000-000000000001", "33333333-0000-4000-8000-000000000001")
    scanner.scan(str(tmp_path), force=False)
    assert sorted(reads) == [(kids[0], ("resource.txt",)), (kids[1], ("recovery.json",))]
    assert book.view().alloc_map == {"GPU-a": "1.00"}
    assert book.view().kernels[kids[1]].identity.session_id == "22222222-0000-4000-8000-000000000001"


def test_a_new_kernel_enters_the_book_with_its_owner_in_one_version(tmp_path: Path) -> None:
    """A kernel whose recovery.json is there when its resource.txt is read enters the book with its
    identity: no version (and so no analysis pass) sees it without an owner."""
    kid = _uuid_kernel(tmp_path, 1, "0.25", identity=True)
    book = AllocationBook()
    scanner = Scanner(book)

    def session() -> str:
        return book.view().kernels[kid].identity.session_id

    scanner.refresh(str(tmp_path), kid)
    assert book.version == 1 and session() == "11111111-0000-4000-8000-000000000001"
    scanner.refresh_identity(str(tmp_path), kid)  # its event, after: the same file changes nothing
    scanner.scan(str(tmp_path), force=False)  # nor does a rescan: its signature was taken
    assert book.version == 1
    write_recovery(tmp_path, kid, "22222222-0000-4000-8000-000000000001", None)
    scanner.refresh(str(tmp_path), kid)  # a known kernel's resource.txt read: its identity is its event's
    assert book.version == 1
    scanner.refresh_identity(str(tmp_path), kid)
    assert book.version == 2 and session() == "22222222-0000-4000-8000-000000000001"
    # Both files rewritten, their events in one read: one change, the new allocation with its owner.
    write_recovery(tmp_path, kid, "33333333-0000-4000-8000-000000000001", None)
    (tmp_path / kid / "config/resource.txt").write_text((tmp_path / kid / "config/resource.txt").read_text().replace("0.25", "0.5"))
    scanner.refresh(str(tmp_path), kid, identity=True)
    assert book.version == 3 and session() == "33333333-0000-4000-8000-000000000001"
    assert book.view().alloc_map == {"GPU-a": "0.5"}


def test_a_file_that_cannot_be_read_is_not_read_again_by_a_rescan(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "outside.txt").write_text(GOOD)
    (tmp_path / "root/k1/config").mkdir(parents=True)
    (tmp_path / "root/k1/config/resource.txt").symlink_to(tmp_path / "outside.txt")
    reads = []
    real_read = reader_module._read_config
    monkeypatch.setattr(reader_module, "_read_config", lambda root, kid, files, root_fd=None: reads.append(kid) or real_read(root, kid, files, root_fd))
    book = AllocationBook()
    scanner = Scanner(book)
    scanner.scan(str(tmp_path / "root"))
    assert "resource.txt is a symlink" in book.view().kernels["k1"].reason and len(reads) == 1
    scanner.scan(str(tmp_path / "root"), force=False)  # unchanged: stat'ed, not read again
    assert len(reads) == 1
    (tmp_path / "outside.txt").write_text(GOOD + "X=1\n")  # what a stat of the link sees changed
    scanner.scan(str(tmp_path / "root"), force=False)
    assert len(reads) == 2 and "resource.txt is a symlink" in book.view().kernels["k1"].reason


def test_an_event_during_a_scan_never_lands_before_the_scans_older_read(tmp_path: Path) -> None:
    """A forced scan reads and parses kernels ahead of landing them. An event's refresh of one of
    them in between must wait for the scan: else the scan's older read would land after the newer one."""
    kids = [_uuid_kernel(tmp_path, i, "0.25", identity=False) for i in range(8)]
    book = AllocationBook()

    class RewriteDuringTheBatch(Scanner):
        event: threading.Thread | None = None

        def _note(self, kernel_id: str, parsed):
            if self.event is None:
                other = next(k for k in kids if k != kernel_id)  # not landed yet: this is the first
                path = tmp_path / other / "config/resource.txt"
                path.write_text(path.read_text().replace("0.25", "0.5"))
                self.event = threading.Thread(target=self.refresh, args=(str(tmp_path), other, True), name="event")
                self.event.start()
                self.event.join(0.2)  # it waits for the batch (it would be done by now otherwise)
            return super()._note(kernel_id, parsed)

    applied = []  # (thread, the amount applied)
    real_apply = book.apply
    book.apply = lambda kid, root, outcome, *identity: applied.append(
        (threading.current_thread().name, outcome.allocations[0].amount)) or real_apply(kid, root, outcome, *identity)
    scanner = RewriteDuringTheBatch(book)
    scanner.scan(str(tmp_path))
    scanner.event.join(5)
    assert [amount for thread, amount in applied if thread == "event"] == [Decimal("0.5")]  # it read the new file
    assert book.view().alloc_map == {"GPU-a": "2.25"}  # 7 × 0.25 + the rewritten 0.5


def test_a_scan_that_fails_mid_batch_leaves_no_read_behind(tmp_path: Path) -> None:
    kids = [_uuid_kernel(tmp_path, i, "0.25", identity=False) for i in range(4)]
    book = AllocationBook()

    class FailsAtOnce(Scanner):
        fail = True

        def _note(self, *args):
            if self.fail:
                raise RuntimeError("boom")
            return super()._note(*args)

    scanner = FailsAtOnce(book)
    with pytest.raises(RuntimeError):
        scanner.scan(str(tmp_path))
    scanner.fail = False
    path = tmp_path / kids[0] / "config/resource.txt"
    path.write_text(path.read_text().replace("0.25", "0.5"))
    scanner.refresh(str(tmp_path), kids[0])  # an event: reads the file now, not what the scan read
    assert book.view().alloc_map == {"GPU-a": "0.5"}
