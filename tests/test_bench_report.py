"""bench/run.py rewrites its own sections of BENCHMARKS.md and keeps every other one."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _run_module():
    sys.path.insert(0, str(BENCH))  # bench/run.py imports its sibling common.py
    try:
        spec = importlib.util.spec_from_file_location("bench_run", BENCH / "run.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def test_a_rerun_keeps_the_sections_other_benchmarks_wrote(tmp_path: Path) -> None:
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Old\n\nintro\n\n## Targets\n\nold targets\n\n## a. Latency\n\nold a\n\n## g. Hostile\n\nkept g\n\n"
                   "## i. The run-time house\n\nkept i\n\n### i7. Idle\n\nkept i7\n\n## Figures behind design decisions\n\nkept f\n")
    _run_module().write_report(out, "# New\n\n## Targets\n\nnew targets\n\n## a. Latency\n\nnew a\n\n## Notes\n\nnotes\n")
    text = out.read_text()
    assert "old targets" not in text and "old a" not in text and "new a" in text
    for kept in ("kept g", "kept i", "### i7. Idle\n\nkept i7", "kept f"):
        assert kept in text
    assert text.index("notes") < text.index("kept g") < text.index("kept i") < text.index("kept f")
