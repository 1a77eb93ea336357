"""Opening below a directory without following symlinks: openat2, the walk it falls back to, and
the reader's answers through either."""

from __future__ import annotations

import errno
import os
from decimal import Decimal
from pathlib import Path

import pytest

from exporter.demo import write_kernel
from exporter.scratch import beneath
from exporter.scratch import reader as reader_module
from exporter.scratch.allocation import AllocationBook, KernelState
from exporter.scratch.reader import Scanner, read_kernel

FLAGS = os.O_RDONLY | os.O_CLOEXEC


@pytest.fixture(params=["openat2", "walk"])
def read_via(request, monkeypatch) -> str:
    """Run a test through openat2 (where this kernel has it) and through the walk."""
    if request.param == "walk":
        monkeypatch.setattr(beneath, "_call", False)
    return request.param


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, int]:
    root = tmp_path / "root"
    write_kernel(root, "real", {"cuda.shares": {"GPU-a": Decimal("0.5")}})
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside/resource.txt").write_text("SECRET=1\n")
    (root / "alias").mkdir()
    (root / "alias/config").symlink_to(root / "real/config")  # a link that stays inside the root
    (root / "escape").mkdir()
    (root / "escape/config").symlink_to(tmp_path / "outside")
    (root / "linked").symlink_to(root / "real")  # the kernel directory itself
    (root / "file/config").mkdir(parents=True)
    (root / "file/config/resource.txt").symlink_to(tmp_path / "outside/resource.txt")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    yield root, fd
    os.close(fd)


def test_open_beneath_refuses_every_symlink_and_every_way_out(tree) -> None:
    root, fd = tree
    if beneath.open_beneath(fd, "real/config/resource.txt", FLAGS) is None:
        # No openat2 on this kernel (or a filter refuses it): the caller is told to walk, every time.
        assert beneath.open_beneath(fd, "alias/config/resource.txt", FLAGS) is None
        return
    opened = beneath.open_beneath(fd, "real/config/resource.txt", FLAGS)
    try:
        assert os.read(opened, 100).startswith(b"SCRATCH_SIZE=")
    finally:
        os.close(opened)
    for path in ("alias/config/resource.txt", "escape/config/resource.txt", "linked/config/resource.txt",
                 "file/config/resource.txt"):
        assert beneath.open_beneath(fd, path, FLAGS) == -errno.ELOOP, path
    assert beneath.open_beneath(fd, "real/config/recovery.json", FLAGS) == -errno.ENOENT
    assert beneath.open_beneath(fd, "../outside/resource.txt", FLAGS) == -errno.EXDEV
    assert beneath.open_beneath(fd, str(root / "real/config/resource.txt"), FLAGS) == -errno.EXDEV


def test_without_openat2_the_caller_walks(monkeypatch, tree) -> None:
    _, fd = tree
    monkeypatch.setattr(beneath, "_call", None)
    monkeypatch.setattr(beneath.platform, "machine", lambda: "mips64")  # another syscall table
    assert beneath.open_beneath(fd, "real/config/resource.txt", FLAGS) is None
    assert beneath._call is False  # probed once


def test_the_reader_refuses_the_same_links_either_way(read_via, tree) -> None:
    root, _ = tree
    assert "config/ is a symlink" in str(read_kernel(str(root), "alias"))  # would count "real" twice
    assert "config/ is a symlink" in str(read_kernel(str(root) + "/", "escape"))
    assert "the kernel directory is a symlink" in str(read_kernel(str(root), "linked"))
    assert "resource.txt is a symlink" in str(read_kernel(str(root), "file"))
    assert read_kernel(str(root), "real").allocations
    assert read_kernel(str(root), "gone") is None  # no such kernel directory
    (root / "new/config").mkdir(parents=True)
    assert read_kernel(str(root), "new").reason == "no config/resource.txt yet"


def test_a_scan_reads_the_same_book_either_way(read_via, tree) -> None:
    root, _ = tree
    book = AllocationBook()
    Scanner(book).scan(str(root))
    kernels = book.view().kernels
    assert {k: v.state for k, v in kernels.items()} == {
        "real": KernelState.OK, "alias": KernelState.INVALID, "escape": KernelState.INVALID, "file": KernelState.INVALID,
    }  # "linked" is a symlink in the root: never listed as a kernel
    assert book.view().alloc_map == {"GPU-a": "0.5"}


@pytest.mark.parametrize("size_error", [-7, +7], ids=["grew-after-fstat", "shrank-after-fstat"])
def test_a_file_that_changes_between_its_fstat_and_its_read_is_read_whole(read_via, tree, monkeypatch, size_error) -> None:
    """One read of the size fstat gave (plus a byte) is the whole file only when exactly that
    many bytes come back; any other count reads on to the end."""
    root, _ = tree
    real_fstat = os.fstat

    def fstat(fd: int) -> os.stat_result:
        st = real_fstat(fd)
        fields = list(st)
        fields[6] = max(0, st.st_size + size_error)  # st_size
        return os.stat_result(fields)

    monkeypatch.setattr(reader_module.os, "fstat", fstat)
    whole = (root / "real/config/resource.txt").read_bytes()
    assert reader_module._read_config(str(root), "real", ((reader_module._RESOURCE, 1 << 20),))[0][0] == whole
    assert ("cuda.shares", "GPU-a", Decimal("0.5")) in [(a.slot, a.device_id, a.amount) for a in read_kernel(str(root), "real").allocations]
