"""A kernel change's path inside the exporter, without HTTP: ``resource.txt`` rewritten -> the
allocation pass that places it published, at 10,000 kernels; and what a usage pass costs after one
kernel changed.

    python bench/change_path.py                        # this checkout
    python bench/change_path.py --repo /tmp/before     # another checkout, same tree and seed

An ``Exporter`` in this process (``--telemetry.source none``, a capacity override per GPU, the
flags of ``bench/pipeline_ab.py``), every kernel watched, then ``--changes`` rewrites of random
kernels 20-60 ms apart. Each stage is timed by wrapping the scanner's refresh and the pipeline's
passes: write -> refresh starts, the refresh, refresh -> pass starts, the pass; p50 / p90 / max in
ms. Then, with the pipeline's threads stopped, one kernel changed and one usage and allocation pass
run by hand, ``--passes`` times. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from decimal import Decimal
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import GPUS, REPO, build_tree, resource_text  # noqa: E402


def _ms(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50": round(1000 * statistics.median(ordered), 2), "p90": round(1000 * ordered[int(0.9 * len(ordered))], 2),
            "max": round(1000 * ordered[-1], 2)}


def measure(changes: int, passes: int, kernels: int) -> dict:
    from exporter.analysis.pipeline import AnalysisPipeline
    from exporter.app import Exporter
    from exporter.config import resolve
    from exporter.scratch.reader import Scanner
    from exporter.settings import Settings

    marks: dict[str, dict[str, float]] = {}
    current: list[str | None] = [None]
    refresh, allocation_pass = Scanner.refresh, AnalysisPipeline._allocation_pass

    def timed_refresh(self, root, kernel_id, *args, **kwargs):
        marks.setdefault(kernel_id, {}).setdefault("refresh0", time.perf_counter())
        out = refresh(self, root, kernel_id, *args, **kwargs)
        marks[kernel_id]["refresh1"] = time.perf_counter()
        return out

    def timed_pass(self):
        start = time.perf_counter()
        out = allocation_pass(self)
        kid = current[0]
        if kid in marks and "refresh1" in marks[kid] and "published" not in marks[kid]:
            marks[kid].update(pass0=start, published=time.perf_counter())
        return out

    Scanner.refresh, AnalysisPipeline._allocation_pass = timed_refresh, timed_pass
    rng = random.Random(5)
    with tempfile.TemporaryDirectory(prefix="gpu-alloc-path-") as tmp:
        root = Path(tmp) / "scratches"
        ids = sorted(build_tree(root, kernels))
        settings = Settings(scratch_roots=[root], telemetry_source="none", headroom_mode="fractional",
                            capacity_overrides=[f"{gpu}=13.5" for gpu in GPUS])
        exporter = Exporter(resolve(settings))
        exporter.start()
        try:
            exporter.watcher.wait_armed(60)
            time.sleep(1.0)
            rows = []
            for i in range(changes):
                kid = ids[rng.randrange(len(ids))]
                current[0] = kid
                marks.pop(kid, None)
                start = time.perf_counter()
                (root / kid / "config" / "resource.txt").write_text(
                    resource_text({GPUS[i % len(GPUS)]: Decimal(rng.randint(1, 100)) / 100}))
                deadline = start + 2.0
                while "published" not in marks.get(kid, {}) and time.perf_counter() < deadline:
                    time.sleep(0.0005)
                m = marks.get(kid, {})
                if "published" in m:
                    rows.append((m["refresh0"] - start, m["refresh1"] - m["refresh0"], m["pass0"] - m["refresh1"],
                                 m["published"] - m["pass0"], m["published"] - start))
                time.sleep(rng.uniform(0.02, 0.06))
            exporter.pipeline.close()
            by_hand = []
            for i in range(passes):
                kid = ids[rng.randrange(len(ids))]
                (root / kid / "config" / "resource.txt").write_text(
                    resource_text({GPUS[i % len(GPUS)]: Decimal(rng.randint(1, 100)) / 100}))
                time.sleep(0.05)
                start = time.perf_counter()
                exporter.pipeline.step()
                by_hand.append(time.perf_counter() - start)
        finally:
            exporter.close()
    names = ("write_to_refresh", "refresh", "refresh_to_pass", "allocation_pass", "change_to_published")
    out = {name: _ms([row[n] for row in rows]) for n, name in enumerate(names)}
    out["changes_seen"] = len(rows)
    out["usage_and_allocation_pass_after_one_change"] = _ms(by_hand[1:])  # the first builds the shift's index
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, help="measure another checkout of the exporter (run in its own process)")
    ap.add_argument("--changes", type=int, default=120)
    ap.add_argument("--passes", type=int, default=8)
    ap.add_argument("--kernels", type=int, default=10_000)
    args = ap.parse_args()
    if args.repo is not None and args.repo.resolve() != REPO:
        # The other checkout's package, this checkout's bench: the same tree, flags and seed.
        code = (f"import sys; sys.path[:0] = [{str(args.repo.resolve())!r}, {str(Path(__file__).resolve().parent)!r}]; "
                f"import change_path, json; print(json.dumps(change_path.measure({args.changes}, {args.passes}, {args.kernels})))")
        result = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                                           cwd=str(args.repo)).stdout)
    else:
        sys.path.insert(0, str(REPO))
        result = measure(args.changes, args.passes, args.kernels)
    print(json.dumps({"repo": str(args.repo or REPO), **result}, indent=1))


if __name__ == "__main__":
    main()
