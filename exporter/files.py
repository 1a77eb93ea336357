"""Reading a file a person names (a config file, agent.toml, a web config and its certificates, a
mock-device or MIG-geometry file, a saved state document) as the scratch reader reads kernels'
files: a regular file only (a FIFO, a device or ``/dev/zero`` behind a link is refused), opened
without blocking, and at most a size cap read. Such files are a few KiB; a start must never hang
on one or read without bound.
"""

from __future__ import annotations

import os
import stat

__all__ = ["MAX_FILE_BYTES", "FileReadError", "read_bytes", "read_text"]

MAX_FILE_BYTES = 1024 * 1024


class FileReadError(ValueError):
    """One line: the file and the reason (never its content)."""


def read_bytes(path: str | os.PathLike[str], limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes.

    :raises FileReadError: ``"{path}: {reason}"``.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise FileReadError(f"{path}: cannot be read: {exc.strerror or 'unreadable'}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FileReadError(f"{path}: not a regular file")
        chunks, size = [], 0
        while size <= limit:  # read to the end, or one byte past the cap (a file that grows)
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise FileReadError(f"{path}: cannot be read: {exc.strerror or 'unreadable'}") from None
    finally:
        os.close(fd)
    if size > limit:
        raise FileReadError(f"{path}: larger than {limit} bytes")
    return b"".join(chunks)


def read_text(path: str | os.PathLike[str], limit: int = MAX_FILE_BYTES) -> str:
    """:func:`read_bytes` as UTF-8 text."""
    try:
        return read_bytes(path, limit).decode("utf-8")
    except UnicodeDecodeError:
        raise FileReadError(f"{path}: not UTF-8 text") from None


