"""Evidence for one recommendation: render the allocation families incrementally.

    python bench/render_prototype.py [--kernels 10000]

Times, on the same AllocationView:

1. ``generate_latest`` over ``exporter.collector.allocation_families`` (what the exporter does now
   after every change);
2. a hand-written encoder of the same families, whole;
3. the same encoder with one cached text chunk per kernel (keyed by the immutable ``Kernel``
   object, which the book reuses while a kernel is unchanged), after one kernel changed.

and checks that all three parse to the same samples. Not product code: a measurement.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from decimal import Decimal
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import build_tree, kernel_id, random_alloc, write_resource  # noqa: E402
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from prometheus_client.utils import floatToGoString  # noqa: E402

from exporter.allocation import AllocationBook, KernelState, is_accelerator_slot  # noqa: E402
from exporter.collector import allocation_families  # noqa: E402
from exporter.resources import SlotKind, slot_kind  # noqa: E402
from exporter.scratch import Scanner  # noqa: E402


def esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Encoder:
    """Per-kernel chunks for the two kernel families, cached by Kernel identity."""

    def __init__(self) -> None:
        self.cache: dict[str, tuple[object, str, str, str]] = {}

    def kernel_chunks(self, kernel) -> tuple[str, str, str]:
        hit = self.cache.get(kernel.kernel_id)
        if hit is not None and hit[0] is kernel:
            return hit[1], hit[2], hit[3]
        kid = esc(kernel.kernel_id)
        count, nbytes = [], []
        for a in kernel.allocations:
            if is_accelerator_slot(a.slot):
                line = f'{{device_id="{esc(a.device_id)}",kernel_id="{kid}",slot="{esc(a.slot)}"}} {floatToGoString(float(a.amount))}\n'
                (nbytes if slot_kind(a.slot) is SlotKind.BYTES else count).append(line)
        info = f'gpu_alloc_kernel_info{{kernel_id="{kid}",state="{kernel.state.value}"}} 1.0\n'
        c = "".join("gpu_alloc_kernel_allocated" + s for s in count)
        b = "".join("gpu_alloc_kernel_allocated_bytes" + s for s in nbytes)
        self.cache[kernel.kernel_id] = (kernel, c, b, info)
        return c, b, info

    def render(self, view) -> str:
        out = []
        dev_c, dev_b = [], []
        for (device_id, slot), amount in sorted(view.device_totals.items()):
            line = f'{{device_id="{esc(device_id)}",slot="{esc(slot)}"}} {floatToGoString(float(amount))}\n'
            (dev_b if slot_kind(slot) is SlotKind.BYTES else dev_c).append(line)
        out.append("# HELP gpu_alloc_device_allocated x\n# TYPE gpu_alloc_device_allocated gauge\n")
        out += ["gpu_alloc_device_allocated" + s for s in dev_c]
        out.append("# HELP gpu_alloc_device_allocated_bytes x\n# TYPE gpu_alloc_device_allocated_bytes gauge\n")
        out += ["gpu_alloc_device_allocated_bytes" + s for s in dev_b]
        out.append("# HELP gpu_alloc_device_fgpu_allocated x\n# TYPE gpu_alloc_device_fgpu_allocated gauge\n")
        out += [f'gpu_alloc_device_fgpu_allocated{{device_id="{esc(d)}"}} {floatToGoString(float(Decimal(a)))}\n'
                for d, a in view.alloc_map.items()]
        chunks = [self.kernel_chunks(k) for _, k in sorted(view.kernels.items())]
        out.append("# HELP gpu_alloc_kernel_allocated x\n# TYPE gpu_alloc_kernel_allocated gauge\n")
        out += [c[0] for c in chunks]
        out.append("# HELP gpu_alloc_kernel_allocated_bytes x\n# TYPE gpu_alloc_kernel_allocated_bytes gauge\n")
        out += [c[1] for c in chunks]
        out.append("# HELP gpu_alloc_kernel_info x\n# TYPE gpu_alloc_kernel_info gauge\n")
        out += [c[2] for c in chunks]
        out.append("# HELP gpu_alloc_kernels x\n# TYPE gpu_alloc_kernels gauge\n")
        out += [f'gpu_alloc_kernels{{state="{s.value}"}} {floatToGoString(view.state_counts.get(s, 0))}\n' for s in KernelState]
        return "".join(out)


def samples(text: str) -> set:
    keep = ("gpu_alloc_device_allocated", "gpu_alloc_device_allocated_bytes", "gpu_alloc_device_fgpu_allocated",
            "gpu_alloc_kernel_allocated", "gpu_alloc_kernel_allocated_bytes", "gpu_alloc_kernel_info", "gpu_alloc_kernels")
    return {(s.name, tuple(sorted(s.labels.items())), s.value) for f in text_string_to_metric_families(text)
            for s in f.samples if s.name in keep}


def best_of(n: int, fn) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--kernels", type=int, default=10_000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "scratch"
        build_tree(root, args.kernels)
        book = AllocationBook()
        scanner = Scanner(book)
        scanner.scan(str(root))
        view = book.view()

        class C:
            def collect(self):
                return allocation_families(view)

        registry = CollectorRegistry(auto_describe=False)
        registry.register(C())
        lib = best_of(3, lambda: generate_latest(registry))
        enc = Encoder()
        whole = best_of(3, lambda: Encoder().render(view))
        enc.render(view)
        # One kernel changes: only its chunk is rebuilt.
        kid = kernel_id(7)
        write_resource(root, kid, random_alloc(random.Random(3)))
        scanner.refresh(str(root), kid)
        view2 = book.view()
        incremental = best_of(5, lambda: enc.render(view2))
        view = view2
        same = samples(generate_latest(registry).decode()) == samples(enc.render(view2))
    n = sum(1 for line in enc.render(view2).splitlines() if not line.startswith("#"))
    print(f"{args.kernels} kernels, {n} samples in the allocation families:")
    print(f"  generate_latest(allocation_families)  {lib * 1000:8.1f} ms")
    print(f"  hand-written encoder, whole           {whole * 1000:8.1f} ms")
    print(f"  per-kernel cached chunks, 1 changed   {incremental * 1000:8.1f} ms")
    print(f"  same samples: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
