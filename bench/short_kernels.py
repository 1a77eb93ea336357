"""Short kernels against the ledger: does a kernel that lives one telemetry interval get counted?

    python bench/short_kernels.py                          # this checkout
    python bench/short_kernels.py --compare /tmp/before    # this checkout beside another, alternated

One process per round and checkout runs the real analysis pipeline (its two threads, the
allocation book, the accountant) over one GPU, a sampler thread publishing every ``--interval``
seconds. A kernel holding 4 of the GPU's 13.5 shares comes every 50-400 ms (uniform) and goes
``--interval`` seconds later, so that the usage thread, which steps aside while kernels change,
meets changes in the middle of its waits. Reported per round: how many of ``--kernels`` kernels the
ledger never counted (``allocated_gpu_seconds`` 0), and Σ counted ÷ Σ held (1.0: nothing lost nor
added, on the whole).

Prints one JSON document: per checkout, its rounds.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import threading
import time
from decimal import Decimal
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import GPUS, resource_text  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHARES = 4  # of the GPU's 13.5 (an A100's default fractional capacity)
GPU = GPUS[0]


def _resource(amount: int) -> str:
    return resource_text({GPU: Decimal(amount)})


def one_round(kernels: int, interval: float, seed: int) -> dict:
    """Runs in the checkout whose ``exporter`` is first on ``sys.path``."""
    from exporter.analysis.accounting import Accountant
    from exporter.analysis.node import HeadroomParams
    from exporter.analysis.pipeline import AnalysisPipeline, PipelineConfig
    from exporter.scratch.allocation import AllocationBook
    from exporter.scratch.resources import parse_resource
    from exporter.telemetry.model import DeviceReading, TelemetrySnapshot

    snapshot = TelemetrySnapshot(source="nvml", success=True, devices=(DeviceReading(
        uuid=GPU, index=0, name="NVIDIA A100-SXM4-40GB", memory_total_bytes=40 << 30, multiprocessor_count=108),))
    published = [1, snapshot]
    book = AllocationBook(clock=lambda: 0.0)
    pipeline = AnalysisPipeline(PipelineConfig(params=HeadroomParams(mode="fractional"), interval=interval), book.view,
                                lambda: (published[0], published[1]), accountant=Accountant())
    book.subscribe(pipeline.poke)
    book.apply("base", "/scratch", parse_resource(_resource(1)))
    pipeline.step()
    pipeline.start()
    stop = threading.Event()

    def sampler() -> None:
        while not stop.wait(interval):
            published[0] += 1
            pipeline.sampled()

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    rng = random.Random(seed)
    held: dict[str, float] = {}
    for i in range(kernels):
        time.sleep(rng.uniform(0.05, 0.4))
        kid = f"k{i}"
        book.apply(kid, "/scratch", parse_resource(_resource(SHARES)))
        began = time.monotonic()
        time.sleep(interval)
        book.remove(kid)
        held[kid] = time.monotonic() - began
    time.sleep(3 * interval)  # passes that see them gone
    stop.set()
    thread.join()
    pipeline.close()
    allocated = pipeline.current.accounting.allocated_seconds
    counted = {kid: allocated.get((kid, GPU), 0.0) * 13.5 / SHARES for kid in held}
    return {"kernels": kernels, "not_counted": sum(1 for v in counted.values() if v == 0.0),
            "counted_over_held": round(sum(counted.values()) / sum(held.values()), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", type=Path, help="another checkout, run alternately with this one")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kernels", type=int, default=60)
    ap.add_argument("--interval", type=float, default=0.2, help="telemetry interval, seconds")
    ap.add_argument("--one", type=Path, help=argparse.SUPPRESS)  # a round in this checkout (internal)
    ap.add_argument("--seed", type=int, default=7, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        sys.path.insert(0, str(args.one))
        print(json.dumps(one_round(args.kernels, args.interval, args.seed)))
        return
    checkouts = {"this": ROOT, **({"other": args.compare.resolve()} if args.compare else {})}
    out: dict[str, list] = {name: [] for name in checkouts}
    for r in range(args.rounds):
        for name, path in checkouts.items():
            run = subprocess.run([sys.executable, __file__, "--one", str(path), "--kernels", str(args.kernels),
                                  "--interval", str(args.interval), "--seed", str(7 + r)],
                                 capture_output=True, text=True, check=True)
            out[name].append(json.loads(run.stdout))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
