"""A large forced scan's reads and parses, shared with a forked helper process while this one lands them.

The scan at start spends its time in the system calls that open, stat and read each kernel's two
config files, in parsing them, and in landing the results in the book: all of it on one core,
under the GIL. :func:`read_batches` forks a child that reads and parses from the front of the
list and streams its batches back through a pipe, so that on a machine with a second core that
work overlaps the landing. Whenever no batch of the child's is waiting, this process does one
itself, from the back of the list: when the other core is busy elsewhere, the scan is no slower
than without the child. One pickler there and one unpickler here serve every batch, so what the
batches share (the parser's shared amounts, ids and allocations) crosses once and stays shared.

A batch is ``batch`` kernels, or fewer when their files already held :data:`BATCH_BYTES` (files
near the 1 MiB cap): neither process ever holds more than about one batch of file bytes' worth of
results, three times over while it is pickled, sent and unpickled, however large the files; the
memos start again past that many bytes.

The child only makes system calls, parses, pickles and writes (no logging, no locks, no threads
of its own), so it is safe to fork from a process whose other threads may hold locks. Whatever it
did not deliver, because it could not be forked, died, or sent a torn batch, is done in this
process, the same way: a scan never depends on the helper.
"""

from __future__ import annotations

import fcntl
import io
import os
import pickle
import select
import signal
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

__all__ = ["BATCH_BYTES", "MIN_KERNELS", "read_batches"]

T = TypeVar("T")
U = TypeVar("U")

# Below this a fork (the whole process's page tables copied) costs about what it saves.
MIN_KERNELS = 1024
# The file bytes a batch may hold before it is closed (4 MiB: ~1,000 kernels of ~4 KiB files,
# 4 of files near the 1 MiB cap). 64 kernels of 1 MiB files made 64 MiB batches, which the helper
# held three times at once (the reads, their pickle, the pickle with its header).
BATCH_BYTES = 4 << 20
# Before each batch: its pickled size, in bytes, and whether the child cleared its pickler's memo
# before it (the receiver clears its own to match).
_HEADER = struct.Struct("=I?")
# The kernel's limit for an unprivileged process (/proc/sys/fs/pipe-max-size): several batches fit
# in the pipe, so the child rarely waits for the parser.
_PIPE_BYTES = 1 << 20


def read_batches(
    read: Callable[[str], T], kernels: Sequence[str], batch: int, parse: Callable[[str, T], U] | None = None
) -> Iterator[tuple[Sequence[str], list[U]]]:
    """``(kernel ids, [parse(id, read(id)) for each])``, at most ``batch`` at a time and at most
    about :data:`BATCH_BYTES` of file bytes (:func:`weight` of the reads) at a time, each kernel
    exactly once (not necessarily in order). A batch is read whole, then parsed: parsing each
    kernel right after its reads is markedly slower, as the system calls evict the parser's
    working set from the CPU caches.

    With at least :data:`MIN_KERNELS` kernels and a second CPU, a forked child shares the work.
    ``read`` and ``parse`` must only read and compute (they also run in the child: no logging, no
    locks), and what ``parse`` returns must pickle.

    :param parse: None: the reads themselves.
    """
    work = (read, parse)
    if len(kernels) >= MIN_KERNELS and _cpus() > 1:
        yield from _shared(work, kernels, batch)
        return
    start = 0
    while start < len(kernels):
        results, _ = _do_forward(work, kernels, start, len(kernels), batch)
        yield kernels[start : start + len(results)], results
        start += len(results)


def weight(value: object) -> int:
    """The bytes a read holds: the length of every bytes-like object in it, also inside tuples and
    lists (a kernel's read is ``(resource.txt, recovery.json)``, each ``(bytes, stat)`` or an error)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return len(value)
    if isinstance(value, (tuple, list)):
        return sum(weight(v) for v in value)
    return 0


_Work = tuple[Callable[[str], T], "Callable[[str, T], U] | None"]  # (read, parse), as read_batches takes them


def _do_forward(work: _Work, kernels: Sequence[str], start: int, end: int, batch: int) -> tuple[list, int]:
    """The results of ``kernels[start:end]`` from the front, until ``batch`` or :data:`BATCH_BYTES`
    of reads, and the bytes their reads held."""
    return _do(work, kernels, range(start, min(end, start + batch)))


def _do_backward(work: _Work, kernels: Sequence[str], start: int, end: int, batch: int) -> list:
    """The results of the tail of ``kernels[start:end]``, read from the back, until ``batch`` or
    :data:`BATCH_BYTES` of reads; in the kernels' order."""
    return _do(work, kernels, range(end - 1, max(start, end - batch) - 1, -1))[0]


def _do(work: _Work, kernels: Sequence[str], indices: range) -> tuple[list, int]:
    """The results of the kernels at ``indices``, read in that order until :data:`BATCH_BYTES` of
    reads, then parsed in the kernels' order; and the bytes their reads held."""
    read, parse = work
    ids: list[str] = []
    reads: list = []
    held = 0
    for index in indices:
        ids.append(kernels[index])
        reads.append(read(kernels[index]))
        held += weight(reads[-1])
        if held >= BATCH_BYTES:
            break
    if indices.step < 0:
        ids.reverse()
        reads.reverse()
    return _parsed(parse, ids, reads), held


def _parsed(parse: Callable[[str, T], U] | None, kernel_ids: Sequence[str], reads: list[T]) -> list:
    if parse is None:
        return reads
    results = [parse(kernel_id, one) for kernel_id, one in zip(kernel_ids, reads, strict=True)]
    reads.clear()  # the file bytes go as soon as they are parsed, before the results are sent
    return results


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _shared(work: _Work, kernels: Sequence[str], batch: int) -> Iterator[tuple[Sequence[str], list]]:
    """The child's batches from the front as they arrive; this process's own from the back while
    none is waiting; all of it here if the child cannot be forked or stops delivering."""
    front, back = 0, len(kernels)  # the child's batches cover [0, front); this process's [back, n)
    r, pid = _fork_child(work, kernels, batch)
    receiver = _Receiver()
    try:
        if r >= 0:
            waiting = select.poll()
            waiting.register(r, select.POLLIN)
        while front < back:
            if r >= 0 and waiting.poll(0):
                reads = receiver.receive(r)
                if reads is None:  # the child ended (died, or sent a torn batch): the rest is read here
                    os.close(r)
                    r = -1
                    continue
                reads = reads[: back - front]  # the end of its last batch may be read here already
                yield kernels[front : front + len(reads)], reads
                front += len(reads)
            else:
                reads = _do_backward(work, kernels, front, back, batch)
                yield kernels[back - len(reads) : back], reads
                back -= len(reads)
    finally:
        if r >= 0:
            os.close(r)  # a child still writing gets EPIPE
        if pid > 0:
            # Whatever it still has to do is done or not needed: never wait on a child that may be
            # stuck in a read (a hung network mount) or blocked on the pipe.
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:  # reaped already: SIGCHLD is set to SIG_IGN
                pass


def _fork_child(work: _Work, kernels: Sequence[str], batch: int) -> tuple[int, int]:
    """(the read end of the child's pipe, its pid), or (-1, -1) where it cannot be forked
    (EAGAIN, ENOMEM, a seccomp filter): then this process reads everything."""
    try:
        r, w = os.pipe2(os.O_CLOEXEC)
    except OSError:
        return -1, -1
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        return -1, -1
    if pid == 0:
        _child(r, w, work, kernels, batch)  # never returns
    os.close(w)
    return r, pid


class _Receiver:
    """The child's batches, unpickled by one unpickler: its memo lives across batches, as the
    child's pickler's does, so what every batch shares (slot names, device ids, amounts, whole
    allocations) crosses the pipe, and lives here, once."""

    def __init__(self) -> None:
        self._buffer = io.BytesIO()
        self._unpickler = pickle.Unpickler(self._buffer)

    def receive(self, fd: int) -> list | None:
        """One batch from the child, or None at the end of its output (or a torn batch)."""
        header = _read_exactly(fd, _HEADER.size)
        if header is None:
            return None
        size, cleared = _HEADER.unpack(header)
        data = _read_exactly(fd, size)
        if data is None:
            return None
        if cleared:  # a new unpickler: 3.11's memo setter crashes on an empty dict
            self._unpickler = pickle.Unpickler(self._buffer)
        buffer = self._buffer
        buffer.seek(0)
        buffer.truncate()
        buffer.write(data)
        buffer.seek(0)
        return self._unpickler.load()


def _read_exactly(fd: int, size: int) -> bytearray | None:
    """``size`` bytes read straight into one buffer (no pieces joined into a second copy)."""
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        n = os.readv(fd, [view[got:]])
        if not n:
            return None
        got += n
    return data


def _child(r: int, w: int, work: _Work, kernels: Sequence[str], batch: int) -> None:
    """Read every kernel, send the batches, exit: os._exit, never back into the caller's code."""
    code = 0
    try:
        os.close(r)
        # A stop (SIGTERM from systemd or the kubelet) ends the helper at once, not through the
        # parent's handler, which only sets an event nobody in this process waits on. (Nothing is
        # imported here: another thread of the parent may have held an import lock at the fork.)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)
        try:
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
        except OSError:  # over this host's limit: the default 64 KiB works, with more waits
            pass
        sink = io.BytesIO()
        pickler = pickle.Pickler(sink, pickle.HIGHEST_PROTOCOL)
        start, remembered = 0, 0  # the file bytes whose results the pickler's memo holds
        while start < len(kernels):
            results, held = _do_forward(work, kernels, start, len(kernels), batch)
            start += len(results)
            # The memo keeps every object it pickled alive: past a batch's worth of file bytes it
            # starts again (never, on a node of ordinary files), so this process stays bounded.
            clear = remembered + held > BATCH_BYTES
            if clear:
                pickler.clear_memo()
                remembered = 0
            remembered += held
            sink.seek(0)
            sink.truncate()
            pickler.dump(results)
            data = sink.getvalue()
            del results  # in the pickle now: held once, not twice, while it is written
            for piece in (_HEADER.pack(len(data), clear), data):
                view = memoryview(piece)
                while view:
                    view = view[os.write(w, view) :]
    except BaseException:  # noqa: BLE001 - a broken pipe, a read that raised: the parent reads on
        code = 1
    finally:
        os._exit(code)
