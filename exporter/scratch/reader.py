"""Reading a Backend.AI scratch root: which directories are kernels, and what their resource.txt says.

Layout, as the agent creates it for each kernel::

    {scratch_root}/{kernel_id}/config/resource.txt
    {scratch_root}/{kernel_id}/work/...        # the user's home: never read, never watched
    {scratch_root}/{kernel_id}_tmp/            # scratch-type=memory sibling: not a kernel
    {scratch_root}/{kernel_id}.img             # scratch-type=hostfile sibling: not a kernel

Reads are bounded, never block on a FIFO, and never follow a symlink out of the scratch root.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from exporter.scratch.allocation import AllocationBook, Kernel, KernelState, Outcome
from exporter.scratch.beneath import open_beneath
from exporter.scratch.identity import RECOVERY_FILE, Identity, parse_recovery
from exporter.scratch.prefetch import read_batches
from exporter.scratch.resources import UNTERMINATED, Pending, ResourceParseError, parse_resource

__all__ = ["IDENTITY_FILE", "RESOURCE_FILE", "ScanStats", "Scanner", "is_kernel_name", "read_identity", "read_kernel"]

log = logging.getLogger(__name__)

RESOURCE_FILE = Path("config") / "resource.txt"
IDENTITY_FILE = Path("config") / RECOVERY_FILE
# The same as strings: a scan joins them for every kernel, and a Path costs an __fspath__ each time.
_CONFIG, _RESOURCE = RESOURCE_FILE.parts
_RESOURCE_PATH = os.fspath(RESOURCE_FILE)
# A rescan steps aside for changes every this many kernels (~0.3 ms of its stats; a change that
# arrives during a step waits for it, sharing the interpreter).
_ASIDE_EVERY = 32
DEFAULT_MAX_BYTES = 1 << 20  # a real file is ~1 KiB; 1 MiB leaves room for 10,000-entry lines
# recovery.json is ~1 KiB (a few service ports); a kernel with hundreds of ports stays far below.
IDENTITY_MAX_BYTES = 256 << 10


def is_kernel_name(name: str) -> bool:
    """Kernel directories are named by kernel id; skip the agent's siblings, hidden entries, and
    names that are not UTF-8 (no kernel id is, and they could not be a label value)."""
    if not name or name.startswith(".") or name.endswith(("_tmp", ".img")) or name == "lost+found":
        return False
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # os.fsdecode's surrogate escapes
        return False
    return True


DEFAULT_SETTLE_SECONDS = 5.0  # a file nobody modified for this long is no longer being written


class _Refused(Exception):
    """A file we will not read, with the reason."""


_Read = tuple[bytes, os.stat_result] | OSError | _Refused
"""One config file as read (:func:`_read_config`): its bytes and its ``fstat`` as of the open, or
the error that stopped the read. An error is kept without its traceback, which would keep the
reading frames alive: a scan of kernels without recovery.json then ran the garbage collector
several times as often."""


def read_kernel(
    root: str,
    kernel_id: str,
    max_bytes: int = DEFAULT_MAX_BYTES,
    *,
    closed: bool = False,
    settled_before: float | None = None,
    read: _Read | None = None,
):
    """Read and parse one kernel's resource.txt.

    :param closed: the writer is known to have closed the file (an ``IN_CLOSE_WRITE`` event).
    :param settled_before: unix time; a file last modified before it counts as closed too, so an
        unterminated last line is read instead of staying pending forever.
    :param read: the file as the caller already read it, to parse without reading it again.
    :returns: a ``ResourceSpec``, a ``Pending``, a ``ResourceParseError``, or None when the kernel
        directory itself is gone.
    """
    if read is None:
        read = _read_config(root, kernel_id, ((_RESOURCE, max_bytes),))[0]
    path = os.path.join(root, kernel_id, _RESOURCE_PATH)
    if not isinstance(read, tuple):
        if isinstance(read, FileNotFoundError):
            if not os.path.isdir(os.path.join(root, kernel_id)):
                return None
            # The agent creates config/ before it writes resource.txt; failed creations stay here.
            return Pending("no config/resource.txt yet")
        if isinstance(read, OSError):
            reason = "permission denied" if read.errno in (errno.EACCES, errno.EPERM) else (read.strerror or str(read))
            return ResourceParseError(path, None, reason)
        return ResourceParseError(path, None, str(read))  # _Refused
    data, st = read
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return ResourceParseError(path, None, f"not UTF-8 text (byte {exc.start})")
    closed = closed or (settled_before is not None and st.st_mtime < settled_before)
    try:
        return parse_resource(text, path, closed=closed)
    except ResourceParseError as exc:
        return exc
    except Exception as exc:  # a parser bug must cost one kernel, never the scan
        return ResourceParseError(path, None, f"unparseable ({type(exc).__name__})")


def read_identity(
    root: str, kernel_id: str, max_bytes: int = IDENTITY_MAX_BYTES, *, read: _Read | None = None
) -> Identity | None:
    """Read and parse one kernel's ``config/recovery.json``, the only file besides resource.txt
    read from a kernel (``environ.txt``, ``kconfig.dat``, ``cluster.json`` and the rest hold
    secrets and are never opened).

    :param read: the file as the caller already read it, to parse without reading it again.
    :returns: the identity, or None while there is none to read: no file yet, a torn or ``{}``
        write, a file that names another kernel, or one that cannot be read (too big, a symlink
        out of the root, not a regular file). The caller keeps the identity it had.
    """
    if read is None:
        read = _read_config(root, kernel_id, ((RECOVERY_FILE, max_bytes),))[0]
    if not isinstance(read, tuple):
        return None
    try:
        identity = parse_recovery(read[0].decode("utf-8"))
    except UnicodeDecodeError:
        return None
    if identity is None or identity.kernel_id != kernel_id:
        return None  # a copied file describes another kernel: never label this one with it
    return identity


_NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_ROOT_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC  # the root itself may be a symlink
# O_NONBLOCK: opening a FIFO planted in place of the file must not hang the scanner.
_FILE = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
_NOFOLLOW_FILE = _FILE | os.O_NOFOLLOW
# The read of a file that is not there, shared: every kernel of an agent before 25.18 has no
# recovery.json. Never raised, so it holds no traceback; readers only test its type.
_MISSING = FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT))


def _read_config(root: str, kernel_id: str, files: Sequence[tuple[str, int]], root_fd: int | None = None) -> list[_Read]:
    """Read files of ``{root}/{kernel_id}/config/``, given as (name, most bytes), refusing a
    symlink in any component below the root (:func:`~exporter.scratch.beneath.open_beneath`).

    The agent never writes a symlink there. One that points out of the root would leak another
    file; one that points at another kernel's ``config/`` would count that kernel twice (and take
    over its inotify watch, which is per inode). Either way the kernel is refused.

    :param root_fd: the root, already open (a scan opens it once for all its kernels).
    """
    own = root_fd is None
    if own:
        try:
            root_fd = os.open(root, _ROOT_DIR)
        except OSError as exc:
            return [exc.with_traceback(None)] * len(files)
    try:
        return _read_below(root, kernel_id, files, root_fd)
    finally:
        if own:
            os.close(root_fd)


def _read_below(root: str, kernel_id: str, files: Sequence[tuple[str, int]], root_fd: int) -> list[_Read]:
    out: list[_Read] = []
    for name, max_bytes in files:
        fd = open_beneath(root_fd, f"{kernel_id}/{_CONFIG}/{name}", _FILE)
        if fd is None:
            return _walk_config(root, kernel_id, files, root_fd)
        if fd >= 0:
            out.append(_read_open(fd, max_bytes))
        elif fd == -errno.ENOENT:
            out.append(_MISSING)
        else:
            out.append(_link_refusal(OSError(-fd, os.strerror(-fd)), os.path.join(root, kernel_id), name))
    return out


def _walk_config(root: str, kernel_id: str, files: Sequence[tuple[str, int]], root_fd: int) -> list[_Read]:
    """:func:`_read_config` without openat2: one component at a time, never following a symlink."""
    kdir = os.path.join(root, kernel_id)
    try:
        kernel_fd = os.open(kernel_id, _NOFOLLOW_DIR, dir_fd=root_fd)
        try:
            config_fd = os.open(_CONFIG, _NOFOLLOW_DIR, dir_fd=kernel_fd)
        finally:
            os.close(kernel_fd)
    except OSError as exc:
        return [_link_refusal(exc, kdir)] * len(files)
    out: list[_Read] = []
    try:
        for name, max_bytes in files:
            try:
                fd = os.open(name, _NOFOLLOW_FILE, dir_fd=config_fd)
            except OSError as exc:
                out.append(_link_refusal(exc, kdir, name))
            else:
                out.append(_read_open(fd, max_bytes))
    finally:
        os.close(config_fd)
    return out


def _read_open(fd: int, max_bytes: int) -> _Read:
    """The open file ``fd`` (closed here): at most ``max_bytes``, a regular file only."""
    try:
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return _Refused("not a regular file")
            if st.st_size > max_bytes:
                return _Refused(f"file is {st.st_size} bytes, over the {max_bytes}-byte limit")
            # One read of the size fstat gave, plus a byte: exactly that many bytes is the whole
            # file, without a second read to see its end (one system call fewer per file; a write
            # after this read is a new IN_CLOSE_WRITE). A file that grew or shrank reads on.
            data = os.read(fd, min(st.st_size, max_bytes) + 1)
            if len(data) != st.st_size:
                chunks, left = [data], max_bytes + 1 - len(data)
                while left > 0 and (chunk := os.read(fd, min(left, 65536))):
                    chunks.append(chunk)
                    left -= len(chunk)
                data = b"".join(chunks)
        finally:
            os.close(fd)
    except OSError as exc:
        return exc.with_traceback(None)
    if len(data) > max_bytes:  # grew while we read
        return _Refused(f"file is over the {max_bytes}-byte limit")
    return data, st


def _link_refusal(exc: OSError, kdir: str, name: str | None = None) -> OSError | _Refused:
    """``exc``, or a :class:`_Refused` when a symlink on the way to ``{kdir}/config/<name>`` caused it."""
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EXDEV):
        config = os.path.join(kdir, _CONFIG)
        for what, path in (("the kernel directory", kdir), ("config/", config), (name, name and os.path.join(config, name))):
            if path and os.path.islink(path):
                return _Refused(f"{what} is a symlink (a kernel's config path must be its own, not a link)")
    return exc.with_traceback(None)


@dataclass(frozen=True, slots=True)
class ScanStats:
    root: str
    kernels: int
    duration_seconds: float
    ok: bool
    error: str | None = None


# A file's (st_dev, st_ino, st_size, st_mtime_ns), packed into one int: exact, and one object per
# kernel and file rather than a tuple of four ints (the table holds one per kernel and file).
_Signature = int
_FIELD = (1 << 64) - 1
# A forced scan reads the files of this many kernels, then parses them (see
# :func:`~exporter.scratch.prefetch.read_batches`), then lands them as one change of the book. It
# is also the unit the helper process sends.
_SCAN_BATCH = 64


class Scanner:
    """Reads kernels into an :class:`AllocationBook` and logs each bad file once.

    Used for the full scans (start, periodic safety net, after an inotify overflow) and by the
    watcher for single kernels.
    """

    def __init__(
        self,
        book: AllocationBook,
        max_bytes: int = DEFAULT_MAX_BYTES,
        monotonic: Callable[[], float] = time.monotonic,
        clock: Callable[[], float] = time.time,
        settle_seconds: float = DEFAULT_SETTLE_SECONDS,
    ) -> None:
        self.book = book
        self.max_bytes = max_bytes
        self._monotonic = monotonic
        self._clock = clock
        self._settle = settle_seconds
        # kernel_id -> the signature (device, inode, size, mtime) of resource.txt when last read;
        # a safety-net rescan re-reads only files whose signature changed.
        self._seen: dict[str, _Signature | None] = {}
        # The same for recovery.json, which the agent rewrites for every kernel at once.
        self._seen_identity: dict[str, _Signature | None] = {}
        # The inotify reader and the rescan worker both refresh; serialising read+apply keeps an
        # older read from landing after a newer one. Reentrant: a forced scan holds it throughout.
        self._lock = threading.RLock()

    def refresh(self, root: str, kernel_id: str, closed: bool = False, identity: bool = False) -> None:
        """Re-read one kernel (or forget it if its directory is gone).

        :param closed: the writer has just closed the file (``IN_CLOSE_WRITE``).
        :param identity: read its recovery.json too, and land both as one change (the two files'
            events came together: no pass sees the new allocation under the old owner).
        """
        with self._lock:
            now = self._clock()
            names = (_RESOURCE, RECOVERY_FILE) if identity else (_RESOURCE,)
            read, *identity_read = _read_config(root, kernel_id, self._files(*names))
            sig = _read_signature(read, root, kernel_id, _RESOURCE)
            changed = self._land(root, kernel_id, now, read, sig, closed, *identity_read)
        _log_invalid(kernel_id, changed)

    def _land(
        self, root: str, kernel_id: str, now: float, read: _Read, sig: _Signature | None, closed: bool, identity_read: _Read | None = None
    ) -> Kernel | None:
        """Parse one read of a kernel's resource.txt into the book (the caller holds the lock).

        :param now: unix time just before the read (a file older than the settle time is closed).
        :param identity_read: the kernel's recovery.json, where the caller read it already (a torn
            or missing one keeps the last identity). A kernel new to the book enters it with its
            identity, read here otherwise: a usage pass between the two would give its first
            seconds to no owner.
        :returns: the kernel if it changed (or None, also when it is gone).
        """
        outcome = read_kernel(root, kernel_id, self.max_bytes, closed=closed, settled_before=now - self._settle, read=read)
        if outcome is not None and identity_read is None and not self.book.holds(kernel_id, root):
            identity_read = self._read(root, kernel_id, RECOVERY_FILE)
        if (entry := self._note(kernel_id, (sig, outcome, *_identity_of(root, kernel_id, identity_read)))) is None:
            if self.book.remove(kernel_id):
                log.debug("kernel %s removed", kernel_id)
            return None
        return self.book.apply(kernel_id, root, *entry)

    def _note(self, kernel_id: str, parsed: _Parsed) -> tuple[Outcome, Identity | None] | None:
        """Remember the signatures of one kernel's parsed files (the caller holds the lock).

        :returns: what to record in the book, or None when the kernel is gone (forgotten here).
        """
        sig, outcome, identity_sig, identity = parsed
        if outcome is None:
            self._seen.pop(kernel_id, None)
            self._seen_identity.pop(kernel_id, None)
            return None
        # An unterminated file, unchanged, is still read again on the next rescan: by then it has settled.
        self._seen[kernel_id] = None if isinstance(outcome, Pending) and outcome.reason == UNTERMINATED else sig
        self._note_identity(kernel_id, identity_sig, identity)
        return outcome, identity

    def _note_identity(self, kernel_id: str, sig: _Signature | None, identity: Identity | None) -> None:
        """Remember the signature of a kernel's recovery.json as read (None: there was none), only
        of a file that parsed: a torn one is read again later (the caller holds the lock)."""
        if sig is not None:
            self._seen_identity[kernel_id] = sig if identity is not None else None

    def forget(self, kernel_ids: Sequence[str]) -> None:
        """Forget kernels whose directories are gone, as one change of the book."""
        with self._lock:
            for kernel_id in kernel_ids:
                self._seen.pop(kernel_id, None)
                self._seen_identity.pop(kernel_id, None)
            if removed := self.book.remove_many(kernel_ids):
                log.debug("%d kernel(s) removed", removed)

    def refresh_identity(self, root: str, kernel_id: str) -> None:
        """Re-read one kernel's recovery.json (never its resource.txt).

        A file that says what the kernel's identity already says changes nothing (same
        :class:`Kernel` object, same book version); a torn or ``{}`` file keeps the last identity.
        """
        with self._lock:
            self._land_identity(root, kernel_id, self._read(root, kernel_id, RECOVERY_FILE))

    def _land_identity(self, root: str, kernel_id: str, read: _Read) -> None:
        """Parse one read of a kernel's recovery.json into the book (the caller holds the lock)."""
        identity_sig, identity = _identity_of(root, kernel_id, read)
        self._note_identity(kernel_id, identity_sig, identity)
        if identity is not None:
            self.book.set_identity(kernel_id, identity)

    def apply_label_identity(self, kernel_id: str, identity: Identity) -> None:
        """Give a kernel the identity its container's Docker labels state (opt-in, agents before
        25.18), unless its own recovery.json was read: that file always wins."""
        with self._lock:
            if self._seen_identity.get(kernel_id) is None:
                self.book.set_identity(kernel_id, identity)

    def _read(self, root: str, kernel_id: str, name: str) -> _Read:
        """One of a kernel's config files (resource.txt, recovery.json), read but not parsed."""
        return _read_config(root, kernel_id, self._files(name))[0]

    def _files(self, *names: str) -> tuple[tuple[str, int], ...]:
        """The config files to read, as :func:`_read_config` takes them."""
        return tuple((name, IDENTITY_MAX_BYTES if name == RECOVERY_FILE else self.max_bytes) for name in names)

    def scan(self, root: str, force: bool = True, aside: Callable[[], None] | None = None) -> ScanStats:
        """Read every kernel under ``root`` and forget the ones that vanished.

        :param force: read every file (the scan at start); otherwise re-read only the files whose
            size, mtime or inode changed (the safety-net rescans: stats, not reads).
        :param aside: called every :data:`_ASIDE_EVERY` kernels of a rescan (where the caller
            steps aside for changes: :mod:`exporter.foreground`).
        """
        started = self._monotonic()
        if aside is not None:  # the listing below walks every kernel directory (~10 ms at 10,000)
            aside()
        known = self.book.known(root)
        try:
            # The kernel directories (symlinks not followed). A name the book holds was a kernel's
            # name when it was read: only new names are checked.
            with os.scandir(root) as it:
                seen = {entry.name for entry in it if (entry.name in known or is_kernel_name(entry.name))
                        and entry.is_dir(follow_symlinks=False)}
        except OSError as exc:
            # A missing or unreadable root empties it: its kernels are no longer visible.
            seen, error = set(), exc.strerror or str(exc)
        else:
            error = None
        gone = []
        for kernel_id in known - seen:
            if error is None and os.path.isdir(os.path.join(root, kernel_id)) and not os.path.islink(os.path.join(root, kernel_id)):
                # Created after the listing and already read from its event: not gone.
                seen.add(kernel_id)
                continue
            gone.append(kernel_id)
        self.forget(gone)
        kernels = list(seen)
        if force:
            self._read_all(root, kernels)
        else:
            self._restat(root, kernels, aside)
        return ScanStats(root, len(seen), self._monotonic() - started, error is None, error)

    def _restat(self, root: str, kernels: Sequence[str], aside: Callable[[], None] | None = None) -> None:
        """Re-read only the files whose signature changed since their last read (a safety-net
        rescan: at 10,000 kernels, 20,000 stats, made relative to the root opened once, ~0.1 s)."""
        with _opened_root(root) as root_fd:
            if root_fd is None:
                return  # gone or unreadable since its listing: the next scan says so
            # The loop inlines _signature: at 10,000 kernels its calls were a sixth of a rescan.
            stat, seen, seen_identity = os.stat, self._seen, self._seen_identity
            resource, identity = f"/{_RESOURCE_PATH}", f"/{_CONFIG}/{RECOVERY_FILE}"
            for n, kernel_id in enumerate(kernels):
                if aside is not None and not n % _ASIDE_EVERY:
                    aside()
                # Compared outside the lock: a change in between is re-read (here, or by its event).
                try:
                    changed = seen.get(kernel_id) != _stat_signature(stat(kernel_id + resource, dir_fd=root_fd))
                except OSError:
                    changed = True
                if changed:
                    self.refresh(root, kernel_id)
                try:
                    sig = _stat_signature(stat(kernel_id + identity, dir_fd=root_fd))
                except OSError:
                    continue
                if seen_identity.get(kernel_id) != sig:
                    self.refresh_identity(root, kernel_id)

    def _read_all(self, root: str, kernels: Sequence[str]) -> None:
        """Read, parse and land every kernel's two files (a forced scan), a batch at a time.

        A large root's kernels are read and parsed by a helper process ahead of this one
        (:mod:`~exporter.scratch.prefetch`), which lands them. Each batch lands as one change of
        the book. The lock is held over the whole scan, so that no event's refresh lands between
        a file's read and its landing, which would put an older read over a newer one (forced
        scans run at start, before events are served: nothing waits).
        """
        both = self._files(_RESOURCE, RECOVERY_FILE)
        # Opened once for every kernel's reads; None: each read opens it again and says why it cannot.
        with _opened_root(root) as root_fd, self._lock:
            # Taken before every read: a file last modified before it is closed.
            settled_before = self._clock() - self._settle
            for batch, parsed in read_batches(
                lambda kernel_id: _read_config(root, kernel_id, both, root_fd),
                kernels,
                _SCAN_BATCH,
                lambda kernel_id, reads: _parse_reads(root, kernel_id, reads, settled_before, self.max_bytes),
            ):
                entries, gone = [], []
                for kernel_id, one in zip(batch, parsed, strict=True):
                    if (entry := self._note(kernel_id, one)) is None:
                        gone.append(kernel_id)
                    else:
                        entries.append((kernel_id, *entry))
                for kernel in self.book.apply_many(root, entries):
                    _log_invalid(kernel.kernel_id, kernel)
                self.book.remove_many(gone)


# One kernel of a forced scan, parsed (by the helper process, or here): the signature of its
# resource.txt; what the file says (None: the kernel is gone); the signature of its recovery.json
# (None: there is none) and the identity it names (None: none usable).
_Parsed = tuple["_Signature | None", "Outcome | None", "_Signature | None", "Identity | None"]


def _parse_reads(root: str, kernel_id: str, reads: list[_Read], settled_before: float, max_bytes: int) -> _Parsed:
    """Parse one kernel's two files as a forced scan read them, and nothing else: it runs in the
    scan's helper process too (no logging, no locks, no book)."""
    resource, identity_read = reads
    outcome = read_kernel(root, kernel_id, max_bytes, settled_before=settled_before, read=resource)
    identity = _identity_of(root, kernel_id, identity_read) if outcome is not None else (None, None)
    return _read_signature(resource, root, kernel_id, _RESOURCE), outcome, *identity


def _identity_of(root: str, kernel_id: str, read: _Read | None) -> tuple[_Signature | None, Identity | None]:
    """The signature of one read of a kernel's recovery.json (None: no file, or none read) and the
    identity it names (None: none usable, see :func:`read_identity`)."""
    if read is None or (sig := _read_signature(read, root, kernel_id, RECOVERY_FILE)) is None:
        return None, None
    return sig, read_identity(root, kernel_id, read=read)


@contextmanager
def _opened_root(root: str) -> Iterator[int | None]:
    """A descriptor of the scratch root for relative opens and stats (None where it cannot be opened)."""
    try:
        fd = os.open(root, _ROOT_DIR)
    except OSError:
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


def _log_invalid(kernel_id: str, changed: Kernel | None) -> None:
    """Say once, when a kernel's file turns invalid, why (the file, line and reason, never its text)."""
    if changed is not None and changed.state is KernelState.INVALID:
        kept = "keeping its last good allocation" if changed.spec else "no allocation counted"
        log.warning("kernel %s: %s (%s)", kernel_id, changed.reason, kept)


def _read_signature(read: _Read, root: str, kernel_id: str, name: str) -> _Signature | None:
    """The signature of a file as read, from the read's own fstat: no second syscall per file.
    A file that could not be read is stat'ed, as a rescan would (None: there is none)."""
    if isinstance(read, tuple):
        return _stat_signature(read[1])
    if isinstance(read, FileNotFoundError):
        return None
    return _signature(os.path.join(root, kernel_id, _CONFIG, name))


def _signature(path: str, dir_fd: int | None = None) -> _Signature | None:
    try:
        st = os.stat(path, dir_fd=dir_fd)
    except OSError:
        return None
    return _stat_signature(st)


def _stat_signature(st: os.stat_result) -> _Signature:
    return (((st.st_dev << 64 | st.st_ino) << 64 | st.st_size) << 64) | (st.st_mtime_ns & _FIELD)
