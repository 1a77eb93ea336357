"""Reading a Backend.AI scratch root: which directories are kernels, and what their resource.txt says.

Layout (backendai-scratch.md §2)::

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from exporter.scratch.allocation import AllocationBook, KernelState
from exporter.scratch.identity import RECOVERY_FILE, Identity, parse_recovery
from exporter.scratch.resources import UNTERMINATED, Pending, ResourceParseError, parse_resource

__all__ = ["IDENTITY_FILE", "RESOURCE_FILE", "ScanStats", "Scanner", "is_kernel_name", "read_identity", "read_kernel"]

log = logging.getLogger(__name__)

RESOURCE_FILE = Path("config") / "resource.txt"
IDENTITY_FILE = Path("config") / RECOVERY_FILE
DEFAULT_MAX_BYTES = 1 << 20  # a real file is ~1 KiB; 1 MiB leaves room for 10,000-entry lines
# recovery.json is ~1 KiB (a few service ports); a kernel with hundreds of ports stays far below.
IDENTITY_MAX_BYTES = 256 << 10


def is_kernel_name(name: str) -> bool:
    """Kernel directories are named by kernel id; skip the agent's siblings, hidden entries, and
    names that are not UTF-8 (no kernel id is, and they could not be a label value)."""
    if name.startswith(".") or name.endswith(("_tmp", ".img")) or name == "lost+found":
        return False
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # os.fsdecode's surrogate escapes
        return False
    return True


DEFAULT_SETTLE_SECONDS = 5.0  # a file nobody modified for this long is no longer being written


def read_kernel(
    root: str,
    kernel_id: str,
    max_bytes: int = DEFAULT_MAX_BYTES,
    *,
    closed: bool = False,
    settled_before: float | None = None,
):
    """Read and parse one kernel's resource.txt.

    :param closed: the writer is known to have closed the file (an ``IN_CLOSE_WRITE`` event).
    :param settled_before: unix time; a file last modified before it counts as closed too, so an
        unterminated last line is read instead of staying pending forever.
    :returns: a ``ResourceSpec``, a ``Pending``, a ``ResourceParseError``, or None when the kernel
        directory itself is gone.
    """
    kdir = os.path.join(root, kernel_id)
    path = os.path.join(kdir, RESOURCE_FILE)
    try:
        data, mtime = _read_bounded(root, kernel_id, max_bytes)
    except FileNotFoundError:
        if not os.path.isdir(kdir):
            return None
        # The agent creates config/ before it writes resource.txt; failed creations stay here.
        return Pending("no config/resource.txt yet")
    except _Refused as exc:
        return ResourceParseError(path, None, str(exc))
    except OSError as exc:
        reason = "permission denied" if exc.errno in (errno.EACCES, errno.EPERM) else (exc.strerror or str(exc))
        return ResourceParseError(path, None, reason)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return ResourceParseError(path, None, f"not UTF-8 text (byte {exc.start})")
    closed = closed or (settled_before is not None and mtime < settled_before)
    try:
        return parse_resource(text, path, closed=closed)
    except ResourceParseError as exc:
        return exc
    except Exception as exc:  # a parser bug must cost one kernel, never the scan
        return ResourceParseError(path, None, f"unparseable ({type(exc).__name__})")


def read_identity(root: str, kernel_id: str, max_bytes: int = IDENTITY_MAX_BYTES) -> Identity | None:
    """Read and parse one kernel's ``config/recovery.json``, the only file besides resource.txt
    read from a kernel (``environ.txt``, ``kconfig.dat``, ``cluster.json`` and the rest hold
    secrets and are never opened).

    :returns: the identity, or None while there is none to read: no file yet, a torn or ``{}``
        write, a file that names another kernel, or one that cannot be read (too big, a symlink
        out of the root, not a regular file). The caller keeps the identity it had.
    """
    try:
        data, _ = _read_bounded(root, kernel_id, max_bytes, IDENTITY_FILE)
        identity = parse_recovery(data.decode("utf-8"))
    except (OSError, _Refused, UnicodeDecodeError):
        return None
    if identity is None or identity.kernel_id != kernel_id:
        return None  # a copied file describes another kernel: never label this one with it
    return identity


class _Refused(Exception):
    """A file we will not read, with the reason."""


_NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO planted in place of the file must not hang the scanner.
_NOFOLLOW_FILE = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_config(root: str, kernel_id: str, file: Path = RESOURCE_FILE) -> int:
    """Open ``{kernel}/config/<file>`` one component at a time without following symlinks
    (three cheap opens instead of a realpath per file).

    The agent never writes a symlink there. One that points out of the root would leak another
    file; one that points at another kernel's ``config/`` would count that kernel twice (and take
    over its inotify watch, which is per inode). Either way the kernel is refused."""
    config, name = file.parts
    fds: list[int] = []
    try:
        fds.append(os.open(os.path.join(root, kernel_id), _NOFOLLOW_DIR))
        fds.append(os.open(config, _NOFOLLOW_DIR, dir_fd=fds[-1]))
        return os.open(name, _NOFOLLOW_FILE, dir_fd=fds[-1])
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            kdir = os.path.join(root, kernel_id)
            for what, path in (("the kernel directory", kdir), ("config/", os.path.join(kdir, config)),
                               (name, os.path.join(kdir, config, name))):
                if os.path.islink(path):
                    raise _Refused(f"{what} is a symlink (a kernel's config path must be its own, not a link)") from None
        raise
    finally:
        for fd in fds:
            os.close(fd)


def _read_bounded(root: str, kernel_id: str, max_bytes: int, file: Path = RESOURCE_FILE) -> tuple[bytes, float]:
    """The file's bytes and its mtime (unix seconds) as of the open."""
    fd = _open_config(root, kernel_id, file)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Refused("not a regular file")
        if st.st_size > max_bytes:
            raise _Refused(f"file is {st.st_size} bytes, over the {max_bytes}-byte limit")
        chunks, left = [], max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 65536))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # grew while we read
        raise _Refused(f"file is over the {max_bytes}-byte limit")
    return data, st.st_mtime


def list_kernels(root: str) -> Iterator[str]:
    """Kernel ids under a scratch root (directories only, symlinks not followed)."""
    with os.scandir(root) as it:
        for entry in it:
            if is_kernel_name(entry.name) and entry.is_dir(follow_symlinks=False):
                yield entry.name


@dataclass(frozen=True, slots=True)
class ScanStats:
    root: str
    kernels: int
    duration_seconds: float
    ok: bool
    error: str | None = None


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
        # kernel_id -> (st_dev, st_ino, st_size, st_mtime_ns) of resource.txt when last read;
        # a safety-net rescan re-reads only files whose signature changed.
        self._seen: dict[str, tuple[int, int, int, int] | None] = {}
        # The same for recovery.json, which the agent rewrites for every kernel at once.
        self._seen_identity: dict[str, tuple[int, int, int, int] | None] = {}
        # The inotify reader and the rescan worker both refresh; serialising read+apply keeps an
        # older read from landing after a newer one.
        self._lock = threading.Lock()

    def refresh(self, root: str, kernel_id: str, force: bool = True, closed: bool = False) -> None:
        """Re-read one kernel (or forget it if its directory is gone).

        :param force: read even if the file's size, mtime and inode look unchanged. Events force;
            rescans don't, so a 10,000-kernel rescan costs stats, not reads.
        :param closed: the writer has just closed the file (``IN_CLOSE_WRITE``).
        """
        with self._lock:
            sig = _signature(os.path.join(root, kernel_id, RESOURCE_FILE))
            if not force and sig is not None and self._seen.get(kernel_id) == sig:
                return
            self._seen[kernel_id] = sig
            outcome = read_kernel(
                root, kernel_id, self.max_bytes, closed=closed, settled_before=self._clock() - self._settle
            )
            if isinstance(outcome, Pending) and outcome.reason == UNTERMINATED:
                # Unchanged, it is still read again on the next rescan: by then it has settled.
                self._seen[kernel_id] = None
            if outcome is None:
                self._seen.pop(kernel_id, None)
                self._seen_identity.pop(kernel_id, None)
                if self.book.remove(kernel_id):
                    log.debug("kernel %s removed", kernel_id)
                return
            changed = self.book.apply(kernel_id, root, outcome)
        if changed is not None and changed.state is KernelState.INVALID:
            kept = "keeping its last good allocation" if changed.spec else "no allocation counted"
            log.warning("kernel %s: %s (%s)", kernel_id, changed.reason, kept)

    def refresh_identity(self, root: str, kernel_id: str, force: bool = True) -> None:
        """Re-read one kernel's recovery.json (never its resource.txt).

        A file that says what the kernel's identity already says changes nothing (same
        :class:`Kernel` object, same book version); a torn or ``{}`` file keeps the last identity.

        :param force: read even if the file's signature looks unchanged (events force; rescans don't).
        """
        with self._lock:
            sig = _signature(os.path.join(root, kernel_id, IDENTITY_FILE))
            if sig is None or (not force and self._seen_identity.get(kernel_id) == sig):
                return
            identity = read_identity(root, kernel_id)
            # Remember the signature only of a file that parsed: a torn one is read again later.
            self._seen_identity[kernel_id] = sig if identity is not None else None
            if identity is not None:
                self.book.set_identity(kernel_id, identity)

    def scan(self, root: str, force: bool = True) -> ScanStats:
        """Read every kernel under ``root`` and forget the ones that vanished."""
        started = self._monotonic()
        try:
            seen = set(list_kernels(root))
        except OSError as exc:
            # A missing or unreadable root empties it: its kernels are no longer visible.
            seen, error = set(), exc.strerror or str(exc)
        else:
            error = None
        for kernel_id in self.book.known(root) - seen:
            if error is None and os.path.isdir(os.path.join(root, kernel_id)) and not os.path.islink(os.path.join(root, kernel_id)):
                # Created after the listing and already read from its event: not gone.
                seen.add(kernel_id)
                continue
            self._seen.pop(kernel_id, None)
            self._seen_identity.pop(kernel_id, None)
            self.book.remove(kernel_id)
        for kernel_id in seen:
            self.refresh(root, kernel_id, force=force)
            self.refresh_identity(root, kernel_id, force=force)
        return ScanStats(root, len(seen), self._monotonic() - started, error is None, error)


def _signature(path: str) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
