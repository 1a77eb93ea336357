"""Keeps an :class:`~exporter.scratch.allocation.AllocationBook` in step with the scratch roots.

A thin adapter over watchdog's inotify layer, designed around three measured facts:

* watchdog's ``Observer`` spends one thread per scheduled watch (5,000 watches = 5,003 threads), and
  a recursive watch would also report every write in the kernels' ``work/`` trees (users' homes).
  So we use watchdog's ``InotifyFD`` directly: one inotify fd, one reader thread, and per kernel one
  non-recursive watch on ``{kernel}/config/`` (or on ``{kernel}/`` until ``config/`` exists). Files
  under ``work/`` never produce an event we can see.
* An inotify queue overflow reaches us only as ``on_queue_overflow``; it triggers a full rescan.
* The events of one read of the inotify fd are taken together: watches are armed as each event
  says, but each kernel they touch is read once, after the last of them, and the kernels whose
  directories went are forgotten as one change of the book. Deleting (or creating) a node's
  kernels at once then costs one read per kernel at most, and no analysis pass per kernel.
* ``memory``/``hostfile`` scratch types mount a filesystem over each kernel directory after it
  appears, which hides later writes from a watch placed before the mount. The worker thread
  polls ``/proc/self/mountinfo`` (the kernel flags it on every mount-table change) and re-arms
  the watches of the kernels whose directories were mounted over or unmounted.

Besides events, a stat-based rescan runs every ``rescan_interval`` seconds as a safety net (it
re-reads only files whose size, mtime or inode changed). ``mode="poll"`` does that every
``poll_interval`` seconds instead of using inotify, for filesystems without it (NFS, CIFS).
Thread cost: two threads in total (inotify reader + worker), whatever the number of kernels.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import select
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from watchdog.observers.inotify_c import InotifyConstants as IN
from watchdog.observers.inotify_c import InotifyEvent, InotifyFD

from exporter.foreground import Foreground
from exporter.scratch.reader import IDENTITY_FILE, RESOURCE_FILE, Scanner, ScanStats, is_kernel_name

__all__ = ["ScratchWatcher", "WatcherStatus"]

log = logging.getLogger(__name__)

_ROOT_MASK = IN.IN_CREATE | IN.IN_DELETE | IN.IN_MOVED_FROM | IN.IN_MOVED_TO | IN.IN_DELETE_SELF | IN.IN_MOVE_SELF | IN.IN_ONLYDIR
_KERNEL_MASK = IN.IN_CREATE | IN.IN_MOVED_TO | IN.IN_ONLYDIR
# No IN_MODIFY: the agent writes resource.txt and recovery.json in place and always closes them,
# so a file is read once, on IN_CLOSE_WRITE, instead of on every write of a rewrite too (which
# mostly finds a torn file), which matters most when the agent rewrites every kernel's
# recovery.json at once; a writer that never closes is caught by the rescan.
_CONFIG_MASK = (
    IN.IN_CLOSE_WRITE | IN.IN_CREATE | IN.IN_DELETE | IN.IN_MOVED_FROM | IN.IN_MOVED_TO | IN.IN_ONLYDIR
)
_RESOURCE_NAME = RESOURCE_FILE.name.encode()
_CONFIG_NAME = RESOURCE_FILE.parent.name.encode()
_IDENTITY_NAME = IDENTITY_FILE.name.encode()
# recovery.json is rewritten in place (truncate, write): read it once the writer closes it.
_IDENTITY_EVENTS = IN.IN_CLOSE_WRITE | IN.IN_MOVED_TO
# Seconds a rescan may wait, in all, for quiet spells between events (exporter.foreground).
_RESCAN_ASIDE_AT_MOST = 5.0
_CB_ID = 0  # one callback per watch: its id only has to be unique within the watch
# What the events of one read left to do for a kernel (bits, see ScratchWatcher._mark).
_READ = 1  # read resource.txt
_CLOSED = 2  # ...and its writer had closed it at its last event
_IDENTITY = 4  # read recovery.json
_GONE = 8  # its directory went: forget it unless it is there again
_WENT = 16  # its directory went at some event (kept when a later one asks for a read)


@dataclass(frozen=True)
class WatcherStatus:
    """What the watcher reports about itself (exported as gpu_alloc_watcher_* metrics)."""

    mode: str
    up: bool  # inotify reader and worker alive (worker only, in poll mode)
    watches: int
    overflows_total: int
    watch_errors_total: int
    events_total: int
    rescans_total: int
    last_event_timestamp: float | None
    last_scan: tuple[ScanStats, ...]
    degraded: str | None  # why events may be missed (watch limit, root missing), else None


class _Watch:
    """A directory we watch and what it stands for (one per kernel: no path kept, the root and
    kernel id name it)."""

    __slots__ = ("root", "kernel_id", "config", "wd", "ident")

    def __init__(self, root: str, kernel_id: str | None, config: bool) -> None:
        self.root, self.kernel_id = root, kernel_id
        self.config = config  # a kernel's config/, else the kernel directory (or the root)
        self.wd = -1
        self.ident: int | None = None  # the watched directory's device and inode (_ident)


class _Dispatch:
    """The one callback registered on every watch (watchdog's WatchCallback protocol).

    One object, not one per watch: watchdog calls ``on_queue_overflow`` once per distinct
    callback, and an overflow must count once.
    """

    def __init__(self, owner: ScratchWatcher) -> None:
        self.owner = owner

    def on_event(self, event: InotifyEvent) -> None:
        try:
            self.owner._on_event(event)
        except Exception:  # a raising callback would kill the shared reader thread
            self.owner._count_error("event handler failed", exc_info=True)

    def on_watch_deleted(self, wd: int) -> None:
        self.owner._forget_wd(wd)

    def on_queue_overflow(self) -> None:
        self.owner._on_overflow()


class _Reader(InotifyFD):
    """watchdog's inotify reader thread, which also says when the events of one read are handled."""

    def __init__(self, on_read: Callable[[], None]) -> None:
        super().__init__()
        self._on_read = on_read

    def run(self) -> None:
        while self.should_keep_running():
            events = self.read_events()
            for event in events:
                self.handle_event(event)
            if events:
                self._on_read()


class ScratchWatcher:
    """Watches one or more scratch roots and feeds a :class:`Scanner`.

    :param scanner: reads kernels into the allocation book.
    :param roots: scratch root directories.
    :param mode: ``"inotify"`` or ``"poll"``.
    :param rescan_interval: seconds between safety-net rescans in inotify mode.
    :param poll_interval: seconds between rescans in poll mode, and while inotify is degraded.
    :param mountinfo: path whose POLLPRI signals mount changes (tests may pass None to disable).
    """

    def __init__(
        self,
        scanner: Scanner,
        roots: Sequence[str],
        *,
        mode: str = "inotify",
        rescan_interval: float = 60.0,
        poll_interval: float = 2.0,
        mountinfo: str | None = "/proc/self/mountinfo",
        clock: Callable[[], float] = time.time,
    ) -> None:
        if mode not in ("inotify", "poll"):
            raise ValueError(f"unknown watch mode {mode!r}")
        self.scanner = scanner
        self.roots = [os.path.abspath(r) for r in roots]
        self.mode = mode
        self.rescan_interval = rescan_interval
        self.poll_interval = poll_interval
        self._mountinfo = mountinfo
        self._clock = clock
        # One re-entrant lock covers every check of the watch tables together with the
        # registration that follows it: the inotify reader thread (events) and the worker thread
        # (rescans, mount changes) both arm watches. watchdog runs our callbacks outside its own
        # lock, so holding this one across add_callback cannot deadlock.
        self._lock = threading.RLock()
        self._fd: InotifyFD | None = None
        self._root_watch: dict[str, _Watch] = {}
        self._kernel_watch: dict[tuple[str, str], _Watch] = {}
        self._by_wd: dict[int, _Watch] = {}
        # (root, kernel id) -> what the events of the current read left to do (_READ, ...).
        self._dirty: dict[tuple[str, str], int] = {}
        self._dispatch = _Dispatch(self)
        self._worker: threading.Thread | None = None
        self._stop = threading.Event()
        self._armed = threading.Event()  # the start's arming passes are done
        # The events, which a rescan steps aside for (exporter.foreground): it is a safety net behind
        # them and may come a few seconds late, so its bound is wider than the usage thread's (a
        # burst of changes right after the start would otherwise outlast it).
        self._foreground = Foreground(self._stop.wait, at_most=_RESCAN_ASIDE_AT_MOST)
        self._wake_r, self._wake_w = -1, -1
        self._rescan_requested = False
        self._overflows = self._errors = self._events = self._rescans = 0
        self._last_event: float | None = None
        self._last_scan: tuple[ScanStats, ...] = ()
        self._degraded: dict[str, str] = {}
        self._mounts: set[str] = set()  # mount points at or below the scratch roots
        self._limit_logged = False  # the watch limit was hit and said so; cleared when watches fit again

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Full scan of every root; returns once it is complete (the book is then exact).

        The roots are watched before the scan, so kernels created meanwhile arrive as events. The
        per-kernel watches are armed afterwards by the worker, followed by a stat-only rescan that
        catches any rewrite between a kernel's read and its watch: arming one watch per kernel is
        a sizeable part of a large start, which would otherwise delay readiness.
        """
        if self.mode == "inotify":
            self._fd = _Reader(self._flush)
            self._fd.start()
        self._wake_r, self._wake_w = os.pipe()
        self._full_scan(force=True, arm_kernels=False)
        self._worker = threading.Thread(target=self._work, name="scratch-watcher", daemon=True)
        self._worker.start()

    def close(self) -> None:
        """Stop and join every thread this watcher started."""
        self._stop.set()
        if self._wake_w >= 0:
            os.write(self._wake_w, b"x")
        if self._worker is not None:
            self._worker.join()
        if self._fd is not None:
            self._fd.stop()  # closes the fd, which wakes and ends the reader thread
            self._fd.join()
            self._fd = None
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1

    def __enter__(self) -> ScratchWatcher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_armed(self, timeout: float | None = None) -> bool:
        """Wait until the passes that follow the start are done: every kernel the start found is
        watched, and re-read if it changed before its watch existed. Returns whether they are."""
        return self._armed.wait(timeout)

    def request_rescan(self) -> None:
        """Ask the worker for a full rescan soon (after an overflow, or from an operator)."""
        self._rescan_requested = True
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"r")
            except OSError:
                pass

    def status(self) -> WatcherStatus:
        reader_ok = self.mode == "poll" or (self._fd is not None and self._fd.is_alive())
        worker_ok = self._worker is not None and self._worker.is_alive()
        with self._lock:
            degraded = "; ".join(f"{k}: {v}" for k, v in sorted(self._degraded.items())) or None
            return WatcherStatus(
                mode=self.mode,
                up=reader_ok and worker_ok,
                watches=len(self._root_watch) + len(self._kernel_watch),
                overflows_total=self._overflows,
                watch_errors_total=self._errors,
                events_total=self._events,
                rescans_total=self._rescans,
                last_event_timestamp=self._last_event,
                last_scan=self._last_scan,
                degraded=degraded,
            )

    # -- the worker: rescans, mount changes ----------------------------------------------------

    def _work(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        # Before the arming passes: a mount over a root while they run is then still reported
        # (the mount table's poll reports every change since the file was opened or last polled).
        mounts = self._open_mountinfo(poller)
        if self._fd is not None:
            try:
                # Part of the start, not rescans (gpu_alloc_watcher_rescans_total counts those).
                self._full_scan(force=False, counted=False)  # arms every kernel, then...
                self._full_scan(force=False, counted=False)  # ...re-reads what changed before its watch existed
            except Exception:
                self._count_error("arming the kernel watches failed", exc_info=True)
        self._armed.set()
        next_scan = time.monotonic() + self._interval()
        while not self._stop.is_set():
            timeout = max(0.0, next_scan - time.monotonic())
            try:
                ready = poller.poll(timeout * 1000)
            except InterruptedError:
                continue
            mount_changed = False
            for fd, _ in ready:
                if fd == self._wake_r:
                    os.read(self._wake_r, 4096)
                elif fd == mounts:
                    mount_changed = True
            if self._stop.is_set():
                break
            try:
                if mount_changed:
                    # Even when a rescan is due as well: only this re-arms kernels whose directory a
                    # mount replaced, and it keeps the known mount points current for the next change.
                    self._rearm_mounted()
                if self._rescan_requested or time.monotonic() >= next_scan:
                    self._rescan_requested = False
                    self._full_scan(force=False)
                    next_scan = time.monotonic() + self._interval()
            except Exception:
                self._count_error("rescan failed", exc_info=True)
        if mounts is not None:
            os.close(mounts)

    def _interval(self) -> float:
        if self.mode == "poll" or self._degraded:
            return self.poll_interval
        return self.rescan_interval

    def _open_mountinfo(self, poller: select.poll) -> int | None:
        if self.mode != "inotify" or not self._mountinfo:
            return None
        try:
            fd = os.open(self._mountinfo, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        self._mounts = _mount_points(self._mountinfo, self.roots)
        poller.register(fd, select.POLLPRI | select.POLLERR)
        return fd

    def _full_scan(self, *, force: bool, recheck: bool = False, arm_kernels: bool = True, counted: bool = True) -> None:
        """Rescan every root. ``recheck`` also re-arms watched kernels whose directory is now a
        different inode (after a mount over the root); ``arm_kernels=False`` watches only the roots."""
        with self._lock:  # retried below: a watch limit may have been raised since
            self._degraded.pop("inotify", None)
        stats = []
        self._foreground.begin(min(_RESCAN_ASIDE_AT_MOST, self._interval()))  # degraded: rescans find changes
        for root in self.roots:
            if self._fd is not None:
                self._arm_root(root)
            stats.append(self.scanner.scan(root, force=force, aside=self._foreground.step_aside))
            if self._fd is not None and arm_kernels:
                # Watched kernels stay valid until their directory goes (a root event) or a mount
                # replaces it (a mount-table event): a rescan only arms the ones without a watch.
                self._foreground.step_aside()  # what follows walks every watch, in one go
                with self._lock:
                    armed = {k for r, k in self._kernel_watch if r == root}
                known = self.scanner.book.known(root)
                for kernel_id in known - (set() if recheck else armed):
                    self._arm_kernel(root, kernel_id)
                self._drop_vanished(root, known)
        with self._lock:
            if self._limit_logged and "inotify" not in self._degraded and self._fd is not None:
                self._limit_logged = False
                log.info("inotify watches fit again: back to events")
            self._last_scan = tuple(stats)
            self._rescans += counted
            for s in stats:
                if not s.ok:
                    self._degraded[s.root] = f"scratch root unreadable ({s.error})"
                elif self._degraded.get(s.root, "").startswith("scratch root"):
                    del self._degraded[s.root]

    def _rearm_mounted(self) -> None:
        """The mount table changed. Container starts change it all the time, so look only at mount
        points under the scratch roots: re-arm (and re-read) the kernels whose directory was
        mounted over or unmounted, or every kernel of a root that was itself remounted."""
        points = _mount_points(self._mountinfo, self.roots)
        changed, self._mounts = points ^ self._mounts, points
        for root in self.roots:
            hit = {p for p in changed if p == root or p.startswith(root + os.sep)}
            if root in hit:  # the root itself was (un)mounted: a different tree, rescan it whole
                self._full_scan(force=False, recheck=True)
                continue
            kernels = self.scanner.book.known(root) & {p[len(root) + 1 :].split(os.sep, 1)[0] for p in hit}
            for kernel_id in kernels:
                if self._arm_kernel(root, kernel_id):
                    self.scanner.refresh(root, kernel_id)
                    self.scanner.refresh_identity(root, kernel_id)

    def _drop_kernel(self, root: str, kernel_id: str) -> None:
        with self._lock:
            w = self._kernel_watch.get((root, kernel_id))
            if w is not None and not self.scanner.book.holds(kernel_id, root):
                self._unwatch(w)

    def _drop_vanished(self, root: str, known: frozenset[str]) -> None:
        """Drop the watches of kernels the book no longer holds (``known``: its kernels of
        ``root``, as just taken) whose directory went."""
        with self._lock:
            # A kernel not in the book whose directory still exists was just created: the event
            # that armed its watch reads it into the book next. Dropping its watch would lose it.
            for w in [w for (r, k), w in self._kernel_watch.items()
                      if r == root and k not in known and _dir_ident(os.path.join(root, k)) is None]:
                self._unwatch(w)

    # -- watches -------------------------------------------------------------------------------

    def _arm_root(self, root: str) -> None:
        with self._lock:
            current = self._root_watch.get(root)
            if current is not None and current.ident == _ident(root):
                return
            if current is not None:
                self._unwatch(current)
            self._watch(root, None, root, _ROOT_MASK)

    def _arm_kernel(self, root: str, kernel_id: str) -> bool:
        """Watch ``config/`` if it is a real directory, else the kernel directory. Returns True if
        (re)armed. A symlinked ``config/`` is never watched: inotify follows it to the inode of the
        directory it names, whose watch (another kernel's) it would take over."""
        kdir = os.path.join(root, kernel_id)
        config = os.path.join(kdir, _CONFIG_NAME.decode())
        with self._lock:
            ident = _dir_ident(config)
            in_config = ident is not None
            path, mask = (config, _CONFIG_MASK) if in_config else (kdir, _KERNEL_MASK)
            if not in_config:
                ident = _dir_ident(kdir)
            current = self._kernel_watch.get((root, kernel_id))
            if current is not None and current.config == in_config and current.ident == ident:
                return False
            if current is not None:
                self._unwatch(current)
            if ident is None:
                return False
            armed = self._watch(root, kernel_id, path, mask, in_config)
            if armed and not in_config and _dir_ident(config) is not None:
                # config/ appeared between our check and the watch: its IN_CREATE is lost, move now.
                return self._arm_kernel(root, kernel_id)
            return armed

    def _watch(self, root: str, kernel_id: str | None, path: str, mask: int, config: bool = False) -> bool:
        fd = self._fd
        if fd is None:
            return False
        w = _Watch(root, kernel_id, config)
        try:
            w.ident = _ident(path)
            w.wd = fd.add_callback(os.fsencode(path), mask, self._dispatch, _CB_ID)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                with self._lock:
                    if not self._limit_logged:
                        self._limit_logged = True
                        log.warning("inotify watch limit reached (fs.inotify.max_user_watches=%s, %d watches held): "
                                    "changes are now found by rescans every %g s; raise the limit with sysctl",
                                    _max_user_watches(), len(self._kernel_watch) + len(self._root_watch), self.poll_interval)
                    self._degraded["inotify"] = "watch limit reached (fs.inotify.max_user_watches); polling"
            elif exc.errno not in (errno.ENOENT, errno.ENOTDIR):
                self._count_error(f"cannot watch {path}: {exc.strerror}")
            return False
        if w.wd < 0:  # watchdog returns -1 instead of raising for EACCES
            fd.remove_callbacks([(w.wd, _CB_ID)])
            self._count_error(f"cannot watch {path}: permission denied")
            return False
        with self._lock:
            if kernel_id is None:
                self._root_watch[root] = w
            else:
                self._kernel_watch[(root, kernel_id)] = w
            self._by_wd[w.wd] = w
        return True

    def _unwatch(self, w: _Watch) -> None:
        with self._lock:
            self._forget(w)
            if self._fd is not None and w.wd >= 0:
                self._fd.remove_callbacks([(w.wd, _CB_ID)])

    def _forget(self, w: _Watch) -> None:
        with self._lock:
            table, key = (self._root_watch, w.root) if w.kernel_id is None else (self._kernel_watch, (w.root, w.kernel_id))
            if table.get(key) is w:
                del table[key]
            if self._by_wd.get(w.wd) is w:
                del self._by_wd[w.wd]

    def _forget_wd(self, wd: int) -> None:
        with self._lock:
            w = self._by_wd.get(wd)
            if w is not None:
                self._forget(w)

    # -- events (on the inotify reader thread) ---------------------------------------------------

    def _on_event(self, event: InotifyEvent) -> None:
        with self._lock:
            self._events += 1
            self._last_event = self._clock()
            self._foreground.changed()
            w = self._by_wd.get(event.wd)
        if w is None:  # a watch we just dropped
            return
        mask, name = event.mask, event.name
        if w.kernel_id is None:  # the root itself
            if mask & (IN.IN_DELETE_SELF | IN.IN_MOVE_SELF | IN.IN_UNMOUNT):
                self.request_rescan()
                return
            if not name:
                # An event about the root directory itself (IN_IGNORED, or IN_ISDIR-flagged ones):
                # never a kernel. Read as one, the root would become a kernel named "" whose watch
                # (the same inode, so the same wd) took over the root's.
                return
            kernel_id = os.fsdecode(name)
            if not (mask & IN.IN_ISDIR) or not is_kernel_name(kernel_id):
                return
            if mask & (IN.IN_CREATE | IN.IN_MOVED_TO):
                self._arm_kernel(w.root, kernel_id)
                # Both files: either may have been written before its watch existed.
                self._mark(w.root, kernel_id, _READ | _IDENTITY)
            else:  # IN_DELETE, IN_MOVED_FROM
                self._mark(w.root, kernel_id, _GONE)
        elif name == _CONFIG_NAME:  # config/ appeared in a kernel directory: move the watch there
            self._arm_kernel(w.root, w.kernel_id)
            self._mark(w.root, w.kernel_id, _READ | _IDENTITY)
        elif name == _RESOURCE_NAME:
            # After IN_CLOSE_WRITE the writer is done: an unterminated last line is complete.
            self._mark(w.root, w.kernel_id, _READ | (_CLOSED if mask & IN.IN_CLOSE_WRITE else 0))
        elif name == _IDENTITY_NAME and mask & _IDENTITY_EVENTS:
            self._mark(w.root, w.kernel_id, _IDENTITY)

    def _mark(self, root: str, kernel_id: str, todo: int) -> None:
        """Note what an event leaves to do for a kernel, done by :meth:`_flush` after the last
        event of the read. A later event overrides: a kernel created after it went is read, one
        that went after its writes is only forgotten; ``_CLOSED`` follows the last write event."""
        key = (root, kernel_id)
        with self._lock:
            if todo & _GONE:
                self._dirty[key] = _GONE | _WENT
                return
            was = self._dirty.get(key, 0) & ~_GONE
            if todo & _READ:
                was &= ~_CLOSED
            self._dirty[key] = was | todo

    def _flush(self) -> None:
        """Do what the events of one read left to do (on the reader thread, after them): read each
        kernel they touched once, and forget the kernels whose directories went in one change."""
        with self._lock:
            dirty, self._dirty = self._dirty, {}
        gone: dict[str, list[str]] = {}
        for (root, kernel_id), todo in dirty.items():
            try:
                if todo & _GONE:
                    if _dir_ident(os.path.join(root, kernel_id)) is None:
                        gone.setdefault(root, []).append(kernel_id)
                        continue
                    todo = _READ | _IDENTITY  # another directory of that name since: read it anew
                if todo & _READ:
                    self.scanner.refresh(root, kernel_id, closed=bool(todo & _CLOSED), identity=bool(todo & _IDENTITY))
                elif todo & _IDENTITY:
                    self.scanner.refresh_identity(root, kernel_id)
                if todo & _WENT:  # a directory moved away whose watch still reported: unless read back
                    self._drop_kernel(root, kernel_id)
            except Exception:  # one kernel's failure must not cost the others their reads
                self._count_error("event handler failed", exc_info=True)
        for root, kernel_ids in gone.items():
            try:
                self.scanner.forget(kernel_ids)
                for kernel_id in kernel_ids:
                    # Only these kernels' watches: a sweep of every watch per deletion made deleting
                    # every kernel of a large root quadratic in the number of kernels.
                    self._drop_kernel(root, kernel_id)
            except Exception:
                self._count_error("forgetting deleted kernels failed", exc_info=True)

    def _on_overflow(self) -> None:
        with self._lock:
            self._overflows += 1
        log.warning("inotify queue overflowed; rescanning the scratch roots")
        self.request_rescan()

    def _count_error(self, message: str, exc_info: bool = False) -> None:
        with self._lock:
            self._errors += 1
        log.error("watcher: %s", message, exc_info=exc_info)


def _mount_points(mountinfo: str, roots: Sequence[str]) -> set[str]:
    """Mount points (field 5 of /proc/self/mountinfo, octal escapes decoded) at or below ``roots``."""
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    points = set()
    for line in lines:
        fields = line.split(" ")
        if len(fields) > 4:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            if any(point == r or point.startswith(r + os.sep) for r in roots):
                points.add(point)
    return points


def _ident(path: str) -> int | None:
    """The device and inode of ``path`` as one int (a watch per kernel keeps one: an int, not a
    tuple of two), or None where it cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev << 64 | st.st_ino


def _dir_ident(path: str) -> int | None:
    """Like :func:`_ident` for a directory of a kernel, without following a symlink."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev << 64 | st.st_ino if stat.S_ISDIR(st.st_mode) else None


def _max_user_watches() -> str:
    try:
        with open("/proc/sys/fs/inotify/max_user_watches") as f:
            return f.read().strip()
    except OSError:
        return "unknown"
