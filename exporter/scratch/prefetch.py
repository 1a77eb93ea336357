"""A large forced scan's reads, made by a forked helper process while this one parses.

At 10,000 kernels the scan at start spends ~0.17 s in the system calls that open, stat and read
each kernel's two config files, and ~0.3 s parsing and booking them: all of it on one core, under
the GIL. :func:`read_batches` forks a child that makes the reads and streams them back through a
pipe, batch by batch, so that on a machine with a second core the reading overlaps the parsing.

The child only makes system calls, pickles and writes (no logging, no locks, no threads of its
own), so it is safe to fork from a process whose other threads may hold locks. Whatever it did not
deliver, because it could not be forked, died, or sent a torn batch, is read in this process, the
same way: a scan never depends on the helper.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import signal
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

__all__ = ["MIN_KERNELS", "read_batches"]

T = TypeVar("T")

# Below this a fork (~2-5 ms for a 50 MiB process, page tables included) costs about what it saves.
MIN_KERNELS = 1024
_HEADER = struct.Struct("=I")  # a batch's pickled size, in bytes, before it
# The kernel's limit for an unprivileged process (/proc/sys/fs/pipe-max-size): the child then
# rarely waits for the parser. 10,000 kernels' reads are ~4 MB in all.
_PIPE_BYTES = 1 << 20


def read_batches(read: Callable[[str], T], kernels: Sequence[str], batch: int) -> Iterator[tuple[Sequence[str], list[T]]]:
    """``(kernel ids, [read(id) for each])`` for every kernel, in order, ``batch`` at a time.

    With at least :data:`MIN_KERNELS` kernels and a second CPU, the reads are made by a forked
    child ahead of the caller. ``read`` must only read (it also runs in the child), and its
    results must pickle.
    """
    done = 0
    if len(kernels) >= MIN_KERNELS and _cpus() > 1:
        for ids, reads in _from_child(read, kernels, batch):
            yield ids, reads
            done += len(ids)
    for start in range(done, len(kernels), batch):
        ids = kernels[start : start + batch]
        yield ids, [read(kernel_id) for kernel_id in ids]


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _from_child(read: Callable[[str], T], kernels: Sequence[str], batch: int) -> Iterator[tuple[Sequence[str], list[T]]]:
    """The batches a forked child delivers whole; nothing if it cannot be forked."""
    try:
        r, w = os.pipe2(os.O_CLOEXEC)
    except OSError:
        return
    try:
        pid = os.fork()
    except OSError:  # EAGAIN, ENOMEM, a seccomp filter: the caller reads everything itself
        os.close(r)
        os.close(w)
        return
    if pid == 0:
        _child(r, w, read, kernels, batch)  # never returns
    os.close(w)
    done = 0
    try:
        with open(r, "rb") as pipe:  # buffered: a read(n) returns n bytes, or fewer only at the end
            while done < len(kernels) and len(header := pipe.read(_HEADER.size)) == _HEADER.size:
                (size,) = _HEADER.unpack(header)
                data = pipe.read(size)
                if len(data) != size:
                    return  # the child died mid-batch
                reads = pickle.loads(data)
                ids = kernels[done : done + len(reads)]
                done += len(reads)
                yield ids, reads
    finally:
        if done < len(kernels):
            # The caller stopped early or the child failed: never wait on a child that may be
            # stuck in a read (a hung network mount) or blocked on the pipe.
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap(pid)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:  # reaped already: SIGCHLD is set to SIG_IGN
        pass


def _child(r: int, w: int, read: Callable[[str], T], kernels: Sequence[str], batch: int) -> None:
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
        for start in range(0, len(kernels), batch):
            data = pickle.dumps([read(kernel_id) for kernel_id in kernels[start : start + batch]], pickle.HIGHEST_PROTOCOL)
            view = memoryview(_HEADER.pack(len(data)) + data)
            while view:
                view = view[os.write(w, view) :]
    except BaseException:  # noqa: BLE001 - a broken pipe, a read that raised: the parent reads on
        code = 1
    finally:
        os._exit(code)
