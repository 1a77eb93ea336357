"""The recovery.json storm, and series per node with identity and accounting.

1. Storm: 1,000 kernels, each with resource.txt and recovery.json, watched by the real watcher
   (inotify). The agent rewrites every kernel's recovery.json, unchanged, in place (what it does
   on each kernel start and stop). Measured: CPU time of the exporter's threads (inotify reader
   and worker, from /proc/self/task/<tid>/stat) over the storm, resource.txt reads, Kernel
   objects replaced, and the per-kernel render after the storm. Median of 5 storms.
2. Cardinality: /metrics sample lines of one node (mock telemetry, demo devices) at 10, 50 and
   200 kernels, with and without the families this work added.

Run: .venv/bin/python bench/identity_storm.py
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time
from decimal import Decimal
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exporter.demo import demo_devices, write_kernel, write_recovery  # noqa: E402
from exporter.metrics.allocation import KernelText  # noqa: E402
from exporter.scratch import reader as reader_module  # noqa: E402
from exporter.scratch.allocation import AllocationBook  # noqa: E402
from exporter.scratch.reader import Scanner  # noqa: E402
from exporter.scratch.watcher import ScratchWatcher  # noqa: E402

KERNELS = 1000
TICK = os.sysconf("SC_CLK_TCK")
NEW_FAMILIES = ("gpu_alloc_kernel_identity_info", "gpu_alloc_kernel_gpu_share_ratio", "gpu_alloc_kernel_measured_",
                "gpu_alloc_kernel_allocated_gpu_seconds_total", "gpu_alloc_kernel_busy_gpu_seconds_total",
                'collector="accounting"')


def thread_cpu(tids: list[int]) -> float:
    total = 0
    for tid in tids:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        total += int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks
    return total / TICK


class Counting(Scanner):
    """Counts reads of resource.txt (real reads, not stat-only rescans) and of recovery.json."""

    def __init__(self, book: AllocationBook) -> None:
        super().__init__(book)
        self.reads = self.identity_reads = 0
        real = reader_module.read_kernel

        def counting(*args, **kwargs):
            self.reads += 1
            return real(*args, **kwargs)

        reader_module.read_kernel = counting

    def refresh_identity(self, root, kernel_id, force=True):
        self.identity_reads += 1
        super().refresh_identity(root, kernel_id, force)


def storm() -> dict:
    gpus, _ = demo_devices()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        kids = [f"00000000-0000-4000-8000-{i:012x}" for i in range(KERNELS)]
        sessions = {k: f"11111111-0000-4000-8000-{i:012x}" for i, k in enumerate(kids)}
        for i, k in enumerate(kids):
            write_kernel(root, k, {"cuda.shares": {gpus[i % 4]: Decimal("0.25")}}, container_id=f"{i:064x}")
            write_recovery(root, k, sessions[k], "f38dea23-50fa-42a0-b5ae-338f5f4693f4")
        book = AllocationBook()
        scanner = Counting(book)
        before = {t.native_id for t in threading.enumerate()}
        watcher = ScratchWatcher(scanner, [str(root)], rescan_interval=3600, mountinfo=None)
        watcher.start()
        try:
            # Kernel watches are armed just after the start, then a stat-only pass: let both finish.
            while watcher.status().watches < KERNELS + 1:
                time.sleep(0.01)
            time.sleep(1.0)
            tids = [t.native_id for t in threading.enumerate() if t.native_id not in before]
            text = KernelText()
            text.render(book.view())
            cpu, renders, wall = [], [], []
            for _ in range(5):
                objects, reads, version = dict(book.view().kernels), scanner.reads, book.version
                target = scanner.identity_reads + KERNELS
                c0, w0 = thread_cpu(tids), time.monotonic()
                for k in kids:
                    write_recovery(root, k, sessions[k], "f38dea23-50fa-42a0-b5ae-338f5f4693f4")
                while scanner.identity_reads < target:
                    time.sleep(0.001)
                wall.append(time.monotonic() - w0)
                cpu.append(thread_cpu(tids) - c0)
                assert scanner.reads == reads, "resource.txt re-read"
                assert book.version == version and all(book.view().kernels[k] is objects[k] for k in kids)
                r0 = time.perf_counter()
                text.render(book.view())
                renders.append(time.perf_counter() - r0)
            return {"cpu": statistics.median(cpu), "wall": statistics.median(wall), "render": statistics.median(renders),
                    "resource_reads": 0, "replaced": 0}
        finally:
            watcher.close()


def series(n: int) -> tuple[int, int]:
    from exporter.app import Exporter
    from exporter.config import resolve
    from exporter.settings import Settings
    from exporter.telemetry.mock import DEMO_DEVICES_FILE

    gpus, _ = demo_devices()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "scratch"
        for i in range(n):
            k = f"00000000-0000-4000-8000-{i:012x}"
            write_kernel(root, k, {"cuda.shares": {gpus[i % 4]: Decimal("0.25")}}, container_id=f"{i:064x}")
            write_recovery(root, k, f"11111111-0000-4000-8000-{i:012x}", "f38dea23-50fa-42a0-b5ae-338f5f4693f4")
        (Path(tmp) / "proc").mkdir()
        settings = Settings.load({"scratch_roots": [str(root)], "telemetry_source": "mock", "telemetry_mock_file": str(DEMO_DEVICES_FILE),
                                  "path_procfs": str(Path(tmp) / "proc"), "path_cgroupfs": tmp, "telemetry_interval": 3600})
        exporter = Exporter(resolve(settings))
        exporter.start()
        try:
            lines = [ln for ln in exporter.render().decode().splitlines() if ln and not ln.startswith("#")]
        finally:
            exporter.close()
    new = sum(1 for ln in lines if any(f in ln for f in NEW_FAMILIES))
    return len(lines) - new, len(lines)


if __name__ == "__main__":
    r = storm()
    print(f"storm at {KERNELS} kernels (median of 5): exporter CPU {r['cpu']:.3f} s, drained in {r['wall']:.3f} s, "
          f"resource.txt reads {r['resource_reads']}, kernels replaced {r['replaced']}, per-kernel render after it {r['render'] * 1e3:.2f} ms")
    print("| kernels per node | series before | series after | added per kernel |")
    print("|---|---|---|---|")
    for n in (10, 50, 200):
        before, after = series(n)
        print(f"| {n} | {before} | {after} | {(after - before) / n:.2f} |")
