"""Opening a file below a directory without following a symlink anywhere on the way.

A kernel's config files are ``{root}/{kernel_id}/config/{name}``, and no component may be a
symlink: one out of the root would leak another file, one to another kernel's ``config/`` would
count that kernel twice. ``openat2(2)`` with ``RESOLVE_NO_SYMLINKS`` checks every component in
one system call (Linux 5.6+). Without it (an older kernel, a seccomp profile that refuses it, an
architecture whose syscall number is not the common one) the reader walks one component at a time
with ``O_NOFOLLOW``, which costs three more opens and closes per kernel and nearly doubles the
time a scan spends reading.

Python has no binding for openat2; this one is a ctypes call to libc's ``syscall``.
"""

from __future__ import annotations

import errno
import os
import platform

__all__ = ["open_beneath"]

# openat2 is 437 in the syscall table every architecture added since Linux 5.1 shares; elsewhere
# (alpha, mips and ia64 add offsets) the number would name another call, so it is never tried.
_NR_OPENAT2 = 437
_COMMON_TABLE = frozenset({"x86_64", "aarch64", "arm64", "riscv64", "ppc64le", "ppc64", "s390x", "loongarch64", "armv7l", "i686"})
_RESOLVE_NO_SYMLINKS = 0x04  # no component may be a symlink (magic links included)
_RESOLVE_BENEATH = 0x08  # nor may ".." or an absolute path leave the directory

_call = None  # (syscall, ctypes module, struct type) once probed and usable; False when not
# os.open flags -> (their struct open_how, its address, its size), built once: the struct is kept
# alive here, as the address is all a call passes.
_hows: dict[int, tuple[object, int, int]] = {}


def _binding():
    global _call
    if _call is None:
        _call = _probe()
    return _call


def _probe():
    if platform.system() != "Linux" or platform.machine() not in _COMMON_TABLE:
        return False
    try:
        import ctypes
    except ImportError:  # a Python built without ctypes
        return False

    class OpenHow(ctypes.Structure):  # struct open_how (linux/openat2.h)
        _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]

    libc = ctypes.CDLL(None, use_errno=True)
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    syscall.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
    how = OpenHow(os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, 0, _RESOLVE_NO_SYMLINKS)
    fd = syscall(_NR_OPENAT2, -100, b"/", ctypes.addressof(how), ctypes.sizeof(how))  # AT_FDCWD
    if fd < 0:
        # No such call (ENOSYS), a seccomp filter (EPERM), a kernel that does not know the
        # struct (E2BIG): whatever the reason, the walk works everywhere.
        return False
    os.close(fd)
    return syscall, ctypes, OpenHow


def open_beneath(dir_fd: int, path: str, flags: int) -> int | None:
    """Open ``path`` (relative) below the directory ``dir_fd``, refusing a symlink in any
    component, the last included (``ELOOP``), and any way out of the directory (``EXDEV``).

    Failures are returned, not raised, as the system call returns them: a scan meets a missing
    ``recovery.json`` in every kernel of an agent before 25.18, and an exception for each would
    cost as much as the read of the other file.

    :param flags: ``os.open`` flags (``O_NOFOLLOW`` is implied).
    :returns: the new descriptor; minus the errno when the path cannot be opened; None where
        openat2 cannot be used (the caller walks instead).
    """
    binding = _binding()
    if not binding:
        return None
    syscall, ctypes, open_how = binding
    how = _hows.get(flags)
    if how is None:
        struct = open_how(flags | os.O_NOFOLLOW, 0, _RESOLVE_NO_SYMLINKS | _RESOLVE_BENEATH)
        how = _hows[flags] = (struct, ctypes.addressof(struct), ctypes.sizeof(struct))
    encoded = os.fsencode(path)
    while True:
        fd = syscall(_NR_OPENAT2, dir_fd, encoded, how[1], how[2])
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err == errno.ENOSYS:  # a seccomp filter installed after the probe
            return None
        if err != errno.EINTR:  # retried as os.open does (PEP 475)
            return -err
