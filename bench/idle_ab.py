"""Idle CPU of this checkout's exporter and another's, one after the other, on one tree.

    python bench/idle_ab.py --compare /tmp/before                      # no capacity known
    python bench/idle_ab.py --compare /tmp/before --capacities         # a capacity per GPU

A fresh exporter (``--telemetry.source none``) over a 10,000-kernel tree, 10 s after its first
scrape, then ``--seconds`` with a scrape every 15 s: its CPU time over the wall time, in percent of
one core. ``--capacities`` adds a capacity override per GPU and ``--headroom.mode fractional``,
so headroom and the accounting counters exist for every kernel, as on a GPU node.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import GPUS, ExporterProcess, build_tree, compile_bytecode, settle  # noqa: E402
from pipeline_ab import idle_cpu  # noqa: E402


def idle_percent(root: Path, repo: Path | None, seconds: float, extra: list[str]) -> float:
    ex = ExporterProcess(root, *extra, repo=repo)
    try:
        return idle_cpu(ex, seconds, settle_s=10.0)
    finally:
        ex.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", type=Path, required=True, help="another checkout of the exporter")
    ap.add_argument("--kernels", type=int, default=10_000)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--capacities", action="store_true", help="a capacity override per GPU (accounting for every kernel)")
    args = ap.parse_args()
    extra = ["--headroom.mode", "fractional", *(a for g in GPUS for a in ("--capacity.override", f"{g}=13.5"))] if args.capacities else []
    compile_bytecode()
    with tempfile.TemporaryDirectory(prefix="gpu-alloc-idle-") as tmp:
        root = Path(tmp) / "scratches"
        build_tree(root, args.kernels)
        settle()
        for name, repo in (("this", None), ("other", args.compare.resolve())):
            print(f"{name}: {idle_percent(root, repo, args.seconds, extra)} % of a core", flush=True)


if __name__ == "__main__":
    main()
