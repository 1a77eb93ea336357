"""Where a cold start's time goes, phase by phase, optionally alternated with another checkout.

    python bench/start_phases.py                          # 6 starts over a 10,000-kernel tree
    python bench/start_phases.py --compare /tmp/before    # alternated with a worktree of another revision

Each start is a fresh ``python -m exporter`` (``--telemetry.source none``) whose ``Exporter.start``,
``ScratchWatcher.start`` (the first scan) and the first analysis pass (``AnalysisPipeline.step``, or
``Exporter._analyse`` in a checkout from before the pipeline) are wrapped in timers; it exits
at ``READY=1``. Prints one line per start (milliseconds since the interpreter started the script:
imports done, scan, first analysis, ready) and the medians. The tree is built once, written back
to disk, and the bytecode of each checkout compiled first, as ``bench/scale.py`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, build_tree, settle  # noqa: E402

# Runs inside the exporter's interpreter: wraps the phases, prints them as JSON at READY=1.
_PROBE = r"""
import json, os, sys, time
t0 = time.perf_counter()
marks = {}
import exporter.cli as cli, exporter.app as app
from exporter.scratch import watcher
marks["imports"] = time.perf_counter() - t0

def timed(cls, name, key):
    f = getattr(cls, name)
    def g(*a, **k):
        s = time.perf_counter(); r = f(*a, **k); marks[key] = time.perf_counter() - s; return r
    setattr(cls, name, g)

timed(watcher.ScratchWatcher, "start", "scan")
try:
    from exporter.analysis.pipeline import AnalysisPipeline
    timed(AnalysisPipeline, "step", "analysis")
except ImportError:  # a checkout from before the pipeline
    timed(app.Exporter, "_analyse", "analysis")

def notify(message):
    if "READY=1" in message:
        marks["ready"] = time.perf_counter() - t0
        print(json.dumps({k: round(v * 1000, 1) for k, v in marks.items()}), flush=True)
        os._exit(0)

cli.notify = notify
sys.argv = ["gpu-alloc-exporter", "--scratch.root", sys.argv[1], "--web.listen-address", "127.0.0.1:0",
            "--telemetry.source", "none", "--log.level", "warning"]
cli.main()
"""


def one_start(checkout: Path, root: Path) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", _PROBE, str(root)], cwd=checkout, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(checkout)}, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--starts", type=int, default=6)
    p.add_argument("--kernels", type=int, default=10_000)
    p.add_argument("--compare", type=Path, help="another checkout, started alternately with this one")
    args = p.parse_args(argv)
    checkouts = [REPO] + ([args.compare.resolve()] if args.compare else [])
    for checkout in checkouts:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(checkout / "exporter")], check=True)
    with tempfile.TemporaryDirectory(prefix="gpu-alloc-phases-") as tmp:
        root = Path(tmp) / "scratch"
        build_tree(root, args.kernels)
        settle()
        runs: dict[Path, list[dict[str, float]]] = {c: [] for c in checkouts}
        for _ in range(args.starts):
            for checkout in checkouts:
                phases = one_start(checkout, root)
                runs[checkout].append(phases)
                print(checkout, phases, flush=True)
    for checkout, phases in runs.items():
        medians = {k: statistics.median(p[k] for p in phases) for k in phases[0]}
        print(f"{checkout}: medians (ms) " + ", ".join(f"{k} {v:.0f}" for k, v in medians.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
