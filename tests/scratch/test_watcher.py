"""The watcher against real inotify in temporary directories (bounded waits, no fixed sleeps)."""

from __future__ import annotations

import shutil
import threading
import time
from decimal import Decimal
from pathlib import Path

import pytest
from helpers import wait_for

from exporter.demo import write_kernel
from exporter.foreground import Foreground
from exporter.scratch.allocation import AllocationBook, KernelState
from exporter.scratch.reader import Scanner
from exporter.scratch.watcher import ScratchWatcher

FULL = 'SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={"cpu":"1","mem":"1073741824","cuda.shares":"0.5"}\nUNIFIED_DEVICES=[]\nCUDA.SHARES_SHARES=GPU-a:0.5\nCPU_SHARES=0:1\nMEM_SHARES=root:1g\n'


@pytest.fixture
def watched(tmp_path: Path):
    book = AllocationBook()
    counter = CountingScanner(book)
    watcher = ScratchWatcher(counter, [str(tmp_path)], rescan_interval=3600)
    watcher.start()
    try:
        yield tmp_path, book, counter, watcher
    finally:
        watcher.close()


class CountingScanner(Scanner):
    """A real scanner that counts reads, so tests can prove work/ activity costs nothing."""

    def __init__(self, book: AllocationBook) -> None:
        super().__init__(book)
        self.reads = 0

    def refresh(self, root: str, kernel_id: str, closed: bool = False, identity: bool = False) -> None:
        self.reads += 1
        super().refresh(root, kernel_id, closed, identity)


def test_new_kernel_appears_and_removed_kernel_disappears(watched) -> None:
    root, book, _, _ = watched
    write_kernel(root, "k1", {"cuda.shares": {"GPU-a": Decimal("0.5")}})
    wait_for(lambda: book.view().alloc_map == {"GPU-a": "0.5"})
    shutil.rmtree(root / "k1")
    wait_for(lambda: "k1" not in book.view().kernels)
    assert book.view().alloc_map == {}


def test_in_place_partial_write_then_completion_then_cid_append(watched) -> None:
    root, book, _, watcher = watched
    (root / "k1" / "config").mkdir(parents=True)
    wait_for(lambda: "k1" in book.view().kernels)
    path = root / "k1" / "config" / "resource.txt"
    with open(path, "w") as f:  # the agent truncates and writes in place, no rename
        f.write(FULL[:40])
        f.flush()
        # The only event until the close is the IN_CREATE of open(), whose read may come before
        # this write: a rescan (stat, then read what changed) sees the partial file for certain.
        watcher.request_rescan()
        wait_for(lambda: book.view().kernels["k1"].reason == "missing SLOTS")
        f.write(FULL[40:])
    wait_for(lambda: book.view().kernels["k1"].state is KernelState.OK)
    assert book.view().alloc_map == {"GPU-a": "0.5"}
    with open(path, "a") as f:
        f.write("CID=" + "ab" * 32 + "\n")
    wait_for(lambda: book.view().kernels["k1"].container_id == "ab" * 32)


def test_kernel_dir_created_before_config_dir(watched) -> None:
    root, book, _, watcher = watched
    (root / "k1").mkdir()
    wait_for(lambda: "k1" in book.view().kernels)
    (root / "k1" / "config").mkdir()
    (root / "k1" / "config" / "resource.txt").write_text(FULL)
    wait_for(lambda: book.view().alloc_map == {"GPU-a": "0.5"})


def test_writes_under_work_cause_no_read(watched) -> None:
    root, book, counter, _ = watched
    write_kernel(root, "k1", {"cuda.shares": {"GPU-a": Decimal("0.5")}})
    wait_for(lambda: book.view().alloc_map == {"GPU-a": "0.5"})
    reads = counter.reads
    work = root / "k1" / "work"
    for i in range(500):
        (work / f"f{i}").write_text("x")
    (work / "sub").mkdir()
    (work / "sub" / "deep").write_text("y")
    # A marker write after the burst proves the burst was processed before we compare.
    (root / "k1" / "config" / "resource.txt").write_text(FULL.replace("0.5", "0.25"))
    wait_for(lambda: book.view().alloc_map == {"GPU-a": "0.25"})
    # The marker's truncate, write and close events, plus any of k1's own creation events still
    # queued when we took the baseline; 500 files under work/ would have meant 500+ reads.
    assert counter.reads - reads <= 6, counter.reads - reads


def test_burst_of_a_thousand_kernels(watched) -> None:
    root, book, _, watcher = watched
    for i in range(1000):
        write_kernel(root, f"k{i:04d}", {"cuda.shares": {f"GPU-{i % 8}": Decimal("0.01")}}, cpus=1)
    wait_for(lambda: len(book.view().kernels) == 1000 and all(
        k.state is KernelState.OK for k in book.view().kernels.values()), timeout=30)
    assert book.view().alloc_map == {f"GPU-{d}": "1.25" for d in range(8)}
    assert watcher.status().watches == 1001
    assert threading.active_count() <= 10


def test_overflow_triggers_a_rescan(tmp_path: Path) -> None:
    """Shrink the kernel's queue while the watcher's inotify instance is created, then stall the
    reader inside a handler while 400 kernels appear: the 16-event queue must overflow."""
    limit = Path("/proc/sys/fs/inotify/max_queued_events")
    try:
        original = limit.read_text()
        limit.write_text("16\n")
    except OSError:
        pytest.skip("needs root to lower fs.inotify.max_queued_events")
    book = AllocationBook()
    release = threading.Event()

    class Stalling(Scanner):
        def refresh(self, root, kernel_id, closed=False, identity=False):
            if kernel_id == "stall":
                release.wait(10)
            super().refresh(root, kernel_id, closed, identity)

    watcher = ScratchWatcher(Stalling(book), [str(tmp_path)], rescan_interval=3600)
    try:
        watcher.start()
    finally:
        limit.write_text(original)
    try:
        (tmp_path / "stall").mkdir()
        wait_for(lambda: watcher.status().events_total >= 1)
        for i in range(400):
            write_kernel(tmp_path, f"k{i:03d}", {"cuda.shares": {"GPU-a": Decimal("0.01")}}, cpus=1)
        release.set()
        wait_for(lambda: watcher.status().overflows_total >= 1)
        wait_for(lambda: len(book.view().kernels) == 401 and book.view().alloc_map == {"GPU-a": "4.00"}, timeout=10)
        wait_for(lambda: watcher.status().rescans_total >= 2 and watcher.status().watches == 402)
    finally:
        release.set()
        watcher.close()


def test_poll_mode_sees_changes_without_inotify(tmp_path: Path) -> None:
    book = AllocationBook()
    with ScratchWatcher(Scanner(book), [str(tmp_path)], mode="poll", poll_interval=0.05) as watcher:
        write_kernel(tmp_path, "k1", {"cuda.shares": {"GPU-a": Decimal("0.5")}})
        wait_for(lambda: book.view().alloc_map == {"GPU-a": "0.5"})
        (tmp_path / "k1/config/resource.txt").write_text(FULL.replace("0.5", "0.75") + "X=padding\n")
        wait_for(lambda: book.view().alloc_map == {"GPU-a": "0.75"})
        assert watcher.status().watches == 0


def test_root_deleted_and_recreated(tmp_path: Path) -> None:
    root = tmp_path / "scratch"
    write_kernel(root, "k1", {"cuda.shares": {"GPU-a": Decimal("0.5")}})
    book = AllocationBook()
    with ScratchWatcher(Scanner(book), [str(root)], rescan_interval=3600, poll_interval=0.05) as watcher:
        assert book.view().alloc_map == {"GPU-a": "0.5"}
        shutil.rmtree(root)
        wait_for(lambda: book.view().kernels == {} and watcher.status().degraded is not None)
        write_kernel(root, "k2", {"cuda.shares": {"GPU-b": Decimal("0.25")}})
        wait_for(lambda: book.view().alloc_map == {"GPU-b": "0.25"})
        wait_for(lambda: watcher.status().degraded is None)
        # Events flow again on the recreated root.
        write_kernel(root, "k3", {"cuda.shares": {"GPU-b": Decimal("0.25")}})
        wait_for(lambda: book.view().alloc_map == {"GPU-b": "0.50"})


def test_a_handler_error_is_counted_and_the_watcher_keeps_running(tmp_path: Path) -> None:
    book = AllocationBook()

    class Flaky(Scanner):
        fail = True

        def refresh(self, root, kernel_id, closed=False, identity=False):
            if self.fail and kernel_id == "bad":
                raise RuntimeError("boom")
            super().refresh(root, kernel_id, closed, identity)

    with ScratchWatcher(Flaky(book), [str(tmp_path)], rescan_interval=3600) as watcher:
        (tmp_path / "bad").mkdir()
        wait_for(lambda: watcher.status().watch_errors_total >= 1)
        write_kernel(tmp_path, "good", {"cuda.shares": {"GPU-a": Decimal("0.5")}})
        wait_for(lambda: book.view().alloc_map == {"GPU-a": "0.5"})
        assert watcher.status().up


def test_close_joins_every_thread(tmp_path: Path) -> None:
    before = threading.active_count()
    watcher = ScratchWatcher(Scanner(AllocationBook()), [str(tmp_path)])
    watcher.start()
    assert threading.active_count() == before + 2
    watcher.close()
    assert threading.active_count() == before


def test_a_filesystem_mounted_over_a_kernel_directory_is_followed(tmp_path: Path) -> None:
    """scratch-type=memory/hostfile: the agent mounts over {root}/{kernel} after creating it."""
    import subprocess

    book = AllocationBook()
    with ScratchWatcher(Scanner(book), [str(tmp_path)], rescan_interval=3600) as watcher:
        (tmp_path / "k1").mkdir()
        wait_for(lambda: "k1" in book.view().kernels)
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(tmp_path / "k1")],
                          capture_output=True).returncode != 0:
            pytest.skip("mounting tmpfs needs root")
        try:
            write_kernel(tmp_path, "k1", {"cuda.shares": {"GPU-a": Decimal("0.5")}})
            wait_for(lambda: book.view().alloc_map == {"GPU-a": "0.5"})
            (tmp_path / "k1/config/resource.txt").write_text(FULL.replace("0.5", "0.25"))
            wait_for(lambda: book.view().alloc_map == {"GPU-a": "0.25"})
            assert watcher.status().rescans_total == 1  # events and the mount table, not a rescan
        finally:
            subprocess.run(["umount", str(tmp_path / "k1")], check=True)


def test_a_config_symlinked_to_another_kernel_never_takes_its_watch(watched) -> None:
    root, book, _, watcher = watched
    write_kernel(root, "real", {"cuda.shares": {"GPU-a": Decimal("0.5")}})
    wait_for(lambda: book.view().alloc_map == {"GPU-a": "0.5"})
    (root / "alias").mkdir()
    (root / "alias" / "config").symlink_to(Path("..", "real", "config"))
    # The directory may be read before its config/ link exists (pending); the link's event follows.
    wait_for(lambda: "alias" in book.view().kernels and book.view().kernels["alias"].state is KernelState.INVALID)
    assert "config/ is a symlink" in book.view().kernels["alias"].reason
    assert book.view().alloc_map == {"GPU-a": "0.5"}  # counted once
    # The real kernel's rewrite arrives by its own inotify watch (the rescan is an hour away).
    write_kernel(root, "real", {"cuda.shares": {"GPU-a": Decimal("0.25")}})
    wait_for(lambda: book.view().alloc_map == {"GPU-a": "0.25"})


def test_arming_from_both_threads_registers_each_watch_once(tmp_path: Path, recwarn) -> None:
    """The reader thread (events) and the worker (rescans) arm watches at the same time; the watch
    tables must stay one entry per kernel and watchdog must never see a callback registered twice."""
    book = AllocationBook()
    with ScratchWatcher(Scanner(book), [str(tmp_path)], rescan_interval=3600) as watcher:
        stop = threading.Event()

        def rescans() -> None:
            while not stop.is_set():
                watcher._full_scan(force=False, recheck=True)

        thread = threading.Thread(target=rescans)
        thread.start()
        try:
            for i in range(150):
                write_kernel(tmp_path, f"k{i:03d}", {"cuda.shares": {"GPU-a": Decimal("0.01")}})
                if i % 3 == 0:
                    shutil.rmtree(tmp_path / f"k{i:03d}")
        finally:
            stop.set()
            thread.join()
        wait_for(lambda: len(book.view().kernels) == 100, timeout=30)
        watcher._full_scan(force=False)
        assert watcher.status().watches == 101  # 100 kernels' config/ and the root
    assert not [w for w in recwarn if "already exists" in str(w.message)]


def test_reaching_the_watch_limit_logs_one_line(watched, monkeypatch, caplog) -> None:
    import errno

    root, book, _, watcher = watched

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(watcher._fd, "add_callback", full)
    for i in range(5):
        write_kernel(root, f"k{i}", {"cuda.shares": {"GPU-a": Decimal("0.1")}})
    # Every kernel read (so every watch tried) before the rescan: kernels of one inotify read are
    # read after its events, and a rescan between the two would find no kernel to watch, say the
    # watches fit again, and the kernels read after it would hit the limit (and say so) anew.
    wait_for(lambda: watcher.status().degraded is not None and len(book.view().kernels) == 5)
    watcher._full_scan(force=False)
    lines = [r.getMessage() for r in caplog.records if "watch limit" in r.getMessage()]
    assert len(lines) == 1 and "fs.inotify.max_user_watches=" in lines[0] and "\n" not in lines[0]


def test_a_rewrite_between_the_first_read_and_the_watch_is_not_lost(tmp_path: Path) -> None:
    """Kernel watches are armed after the first scan (readiness does not wait for them); a rewrite
    in that gap is caught by the stat-only pass that follows the arming, not by the hourly rescan."""
    write_kernel(tmp_path, "k1", {"cuda.shares": {"GPU-a": Decimal("0.5")}})
    book = AllocationBook()

    class RewriteAfterFirstRead(Scanner):
        done = False

        def _restat(self, root, kernels, aside=None):
            super()._restat(root, kernels, aside)
            if not self.done:  # the arming pass's stats are done; its watches are not armed yet
                self.done = True
                (tmp_path / "k1/config/resource.txt").write_text(FULL.replace("0.5", "0.25") + "X=grown\n")

    with ScratchWatcher(RewriteAfterFirstRead(book), [str(tmp_path)], rescan_interval=3600) as watcher:
        wait_for(lambda: book.view().alloc_map == {"GPU-a": "0.25"})
        assert watcher.status().rescans_total == 1


def test_events_about_the_root_itself_are_never_a_kernel(watched) -> None:
    """The kernel reports IN_UNMOUNT and IN_IGNORED of a watched root with an empty name (flagged
    IN_ISDIR). Read as a kernel, the root became kernel "" whose watch, on the same inode and so
    the same wd, took over the root's: new kernels then went unseen until the safety-net rescan."""
    from watchdog.observers.inotify_c import InotifyConstants as IN
    from watchdog.observers.inotify_c import InotifyEvent

    root, book, _, watcher = watched
    write_kernel(root, "k1", {"cuda.shares": {"GPU-a": Decimal("0.5")}})
    wait_for(lambda: "k1" in book.view().kernels)
    wd = watcher._root_watch[str(root)].wd
    watcher._on_event(InotifyEvent(wd, IN.IN_ATTRIB | IN.IN_ISDIR, 0, b""))
    assert "" not in book.view().kernels and watcher._root_watch[str(root)].wd == wd
    watcher._on_event(InotifyEvent(wd, IN.IN_UNMOUNT | IN.IN_ISDIR, 0, b""))  # asks for a rescan instead
    write_kernel(root, "k2", {"cuda.shares": {"GPU-a": Decimal("0.25")}})
    wait_for(lambda: "k2" in book.view().kernels)
    assert "" not in book.view().kernels


class _ThreadReads(Scanner):
    """A real scanner that records the reads and removals made by the test's own thread."""

    def __init__(self, book: AllocationBook) -> None:
        super().__init__(book)
        self.mine: list[tuple] = []
        self._me = threading.current_thread()

    def refresh(self, root: str, kernel_id: str, closed: bool = False, identity: bool = False) -> None:
        if threading.current_thread() is self._me:
            self.mine.append(("read", kernel_id, closed))
            if identity:
                self.mine.append(("identity", kernel_id))
        super().refresh(root, kernel_id, closed, identity)

    def refresh_identity(self, root: str, kernel_id: str) -> None:
        if threading.current_thread() is self._me:
            self.mine.append(("identity", kernel_id))
        super().refresh_identity(root, kernel_id)


@pytest.fixture
def held(tmp_path: Path):
    """50 kernels read by the start, their watches armed, and the watcher's lock held by the test:
    the reader thread waits at its next event while the test hands over the events of one read
    itself (``_on_event`` for each, then ``_flush``, as the reader does)."""
    from watchdog.observers.inotify_c import InotifyConstants as IN
    from watchdog.observers.inotify_c import InotifyEvent

    for i in range(50):
        write_kernel(tmp_path, f"k{i:02d}", {"cuda.shares": {"GPU-a": Decimal("0.01")}}, cpus=1)
    book = AllocationBook()
    scanner = _ThreadReads(book)
    with ScratchWatcher(scanner, [str(tmp_path)], rescan_interval=3600) as watcher:
        # Until the passes after the start are done, the worker may rescan beside the test's events.
        assert watcher.wait_armed(10) and watcher.status().watches == 51
        root_wd = watcher._root_watch[str(tmp_path)].wd

        def event(kernel_id: str, mask: int, name: str | None = None) -> None:
            wd = root_wd if name is None else watcher._kernel_watch[(str(tmp_path), kernel_id)].wd
            watcher._on_event(InotifyEvent(wd, mask | (IN.IN_ISDIR if name is None else 0), 0, (name or kernel_id).encode()))

        with watcher._lock:
            yield tmp_path, book, scanner, watcher, event, IN


def test_kernels_deleted_in_one_read_are_forgotten_as_one_change_without_reading(held) -> None:
    root, book, scanner, watcher, event, IN = held
    assert book.view().alloc_map == {"GPU-a": "0.50"}
    version = book.version
    for i in range(40):
        shutil.rmtree(root / f"k{i:02d}")
        event(f"k{i:02d}", IN.IN_DELETE, "resource.txt")  # rm -rf unlinks the file before the directory
        event(f"k{i:02d}", IN.IN_DELETE)
    watcher._flush()
    assert scanner.mine == []  # nothing left to read of a kernel that went
    assert book.version == version + 1  # one change, so one analysis pass, for all 40
    assert sorted(book.view().kernels) == [f"k{i:02d}" for i in range(40, 50)]
    assert book.view().alloc_map == {"GPU-a": "0.10"}
    assert watcher.status().watches == 11


def test_a_kernel_gone_and_back_within_one_read_is_read_again_not_forgotten(held) -> None:
    root, book, scanner, watcher, event, IN = held
    shutil.rmtree(root / "k00")
    event("k00", IN.IN_DELETE)
    write_kernel(root, "k00", {"cuda.shares": {"GPU-a": Decimal("0.25")}}, cpus=1)
    event("k00", IN.IN_CREATE)
    shutil.rmtree(root / "k01")
    event("k01", IN.IN_DELETE)
    write_kernel(root, "k01", {"cuda.shares": {"GPU-a": Decimal("0.5")}}, cpus=1)  # its event in a later read
    watcher._flush()
    # A new directory is read whole: its recovery.json may predate its watch.
    assert sorted(scanner.mine) == [("identity", "k00"), ("identity", "k01"), ("read", "k00", False), ("read", "k01", False)]
    assert book.view().kernels["k00"].allocations[0].amount == Decimal("0.25")
    assert book.view().kernels["k01"].allocations[0].amount == Decimal("0.5")


def test_a_file_written_and_closed_within_one_read_is_read_once_as_closed(held) -> None:
    root, book, scanner, watcher, event, IN = held
    path = root / "k00" / "config" / "resource.txt"
    path.write_text(FULL.replace("0.5", "0.75").rstrip("\n"))  # no final newline: complete only once closed
    event("k00", IN.IN_CREATE, "resource.txt")
    event("k00", IN.IN_CLOSE_WRITE, "resource.txt")
    event("k00", IN.IN_CLOSE_WRITE, "recovery.json")
    event("k01", IN.IN_CLOSE_WRITE, "resource.txt")
    event("k01", IN.IN_CREATE, "resource.txt")  # written again since its close: not known complete
    watcher._flush()
    assert sorted(scanner.mine) == [("identity", "k00"), ("read", "k00", True), ("read", "k01", False)]
    assert book.view().kernels["k00"].state is KernelState.OK


def test_a_kernel_moved_away_whose_watch_still_reports_is_forgotten_with_its_watch(held) -> None:
    root, book, scanner, watcher, event, IN = held
    away = root.parent / f"{root.name}-away"
    away.mkdir()
    (root / "k00").rename(away / "k00")
    event("k00", IN.IN_MOVED_FROM)
    event("k00", IN.IN_CLOSE_WRITE, "resource.txt")  # written in its new place: its watch followed it
    watcher._flush()
    assert scanner.mine == [("read", "k00", True)]
    assert "k00" not in book.view().kernels
    assert ("k00" not in {k for _, k in watcher._kernel_watch}) and watcher.status().watches == 50


def test_a_rescan_steps_aside_while_events_arrive(tmp_path: Path) -> None:
    """A rescan is a safety net behind the events: one that starts right after an event waits
    for a quiet spell first (exporter.foreground), and one with no event since does not."""
    write_kernel(tmp_path, "k1", {"cuda.shares": {"GPU-a": Decimal("0.5")}})
    book = AllocationBook()
    spans: list[tuple[float, float]] = []  # (requested, stats begun), monotonic seconds
    requested = [0.0]

    class Timed(Scanner):
        def _restat(self, root, kernels, aside=None):
            def first_aside() -> None:
                if aside is not None:
                    aside()
                spans.append((requested[0], time.monotonic()))

            super()._restat(root, kernels, first_aside)

    with ScratchWatcher(Timed(book), [str(tmp_path)], rescan_interval=3600) as watcher:
        assert watcher.wait_armed(5)
        watcher._foreground = Foreground(watcher._stop.wait, quiet=0.5)  # wide apart from a slow machine's delays
        spans.clear()
        (tmp_path / "k1/config/resource.txt").write_text(FULL.replace("0.5", "0.25"))
        wait_for(lambda: book.view().alloc_map == {"GPU-a": "0.25"})
        requested[0] = time.monotonic()
        watcher.request_rescan()
        wait_for(lambda: spans)
        asked, begun = spans[0]
        assert begun - asked >= 0.45  # the event before it: a quiet spell of 0.5 s first
        spans.clear()
        requested[0] = time.monotonic()
        watcher.request_rescan()
        wait_for(lambda: spans)
        asked, begun = spans[0]
        assert begun - asked < 0.4  # nothing since: at once
