"""Scale targets at 10,000 and 50,000 kernels, each exporter a fresh process (``--telemetry.source none``).

    python bench/scale.py                 # all stages; prints a Markdown table, writes bench/results/scale.json
    python bench/scale.py --starts 3 --skip-50k
    python bench/scale.py --skip-50k --compare /tmp/before   # cold starts beside another checkout

Stages:

a. cold start at 10,000 kernels, ``--starts`` times, the package's bytecode compiled as an install
   compiles it: spawn -> ``READY=1`` (sd_notify, sent as ``/-/ready`` turns 200), the median; and,
   interleaved, spawn -> first ``/-/ready`` 200 polled every 2 ms (the polling slows the start).
b. idle RSS at 10,000 kernels, 20 s after ready with a scrape every 2 s (what the deployments'
   memory limit must hold).
c. ``/metrics`` p50/p99 at 10,000 kernels, quiet and while a second client fetches
   ``/api/v1/state`` in a loop, interleaved in one run; node_exporter's quiet p99 beside it.
d. 50,000 kernels: RSS after ready, then ``rm -rf`` of every kernel directory: seconds from the
   end of the deletion until ``/api/v1/state`` reports no kernel (and from its start).

These are timings on a shared 2-core machine: compare the ratios of one run, not runs.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, ExporterProcess, build_tree, compile_bytecode, percentile, proc_rss_bytes, settle  # noqa: E402
from run import NodeExporter, Timed  # noqa: E402

MIB = 1 << 20


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cold_starts(root: Path, runs: int, compare: Path | None = None) -> dict[str, list[float]]:
    """Spawn to ready, learnt from READY=1 (no load on the exporter) and, interleaved, by polling
    /-/ready every 2 ms (what the earlier figures used; the polling itself slows the start); with
    ``compare``, that checkout's exporter too, polled (it may predate READY=1)."""
    out: dict[str, list[float]] = {"notify": [], "poll": []}
    if compare is not None:
        out["compare_poll"] = []
    for _ in range(runs):
        for via in out:
            ex = ExporterProcess(root, ready_via=via.removeprefix("compare_"), repo=compare if via.startswith("compare") else None)
            out[via].append(ex.ready_seconds)
            ex.stop()
    return out


def idle_rss(root: Path, seconds: float) -> float:
    ex = ExporterProcess(root)
    try:
        client = Timed(ex.port)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            client.get("/metrics")
            time.sleep(2)
        return proc_rss_bytes(ex.pid) / MIB
    finally:
        ex.stop()


def metrics_under_state_loop(root: Path, rounds: int) -> dict:
    ex = ExporterProcess(root)
    ne = NodeExporter()
    try:
        scrape, baseline = Timed(ex.port), Timed(ne.port)
        quiet, ne_quiet = [], []
        for _ in range(rounds):  # interleaved, request by request
            quiet.append(scrape.get("/metrics")[0])
            ne_quiet.append(baseline.get("/metrics")[0])
        stop, states = threading.Event(), [0]

        def loop() -> None:
            conn = http.client.HTTPConnection("127.0.0.1", ex.port, timeout=60)
            while not stop.is_set():
                conn.request("GET", "/api/v1/state")
                conn.getresponse().read()
                states[0] += 1

        t = threading.Thread(target=loop)
        t.start()
        try:
            loaded = [scrape.get("/metrics")[0] for _ in range(rounds)]
        finally:
            stop.set()
            t.join()
        return {
            "quiet_p50_ms": percentile(quiet, 50) * 1e3, "quiet_p99_ms": percentile(quiet, 99) * 1e3,
            "state_loop_p50_ms": percentile(loaded, 50) * 1e3, "state_loop_p99_ms": percentile(loaded, 99) * 1e3,
            "state_documents": states[0],
            "node_exporter_quiet_p99_ms": percentile(ne_quiet, 99) * 1e3,
        }
    finally:
        ne.stop()
        ex.stop()


def kernels_now(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/api/v1/state")
    doc = json.loads(conn.getresponse().read())
    conn.close()
    return len(doc["kernels"])


def alloc_map(port: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/api/v1/alloc-map")
    doc = json.loads(conn.getresponse().read())
    conn.close()
    return doc


def fifty_thousand(tmp: Path, kernels: int) -> dict:
    root = tmp / "k50"
    log(f"building {kernels} kernels")
    build_tree(root, kernels, seed=9)
    settle()
    ex = ExporterProcess(root)
    try:
        ready = ex.ready_seconds
        time.sleep(5)  # the kernel watches are armed after readiness
        rss = proc_rss_bytes(ex.pid) / MIB
        assert kernels_now(ex.port) == kernels
        log("deleting every kernel")
        started = time.monotonic()
        subprocess.run(["find", str(root), "-mindepth", "1", "-maxdepth", "1", "-exec", "rm", "-rf", "{}", "+"], check=True)
        deleted = time.monotonic()
        while alloc_map(ex.port):  # every kernel holds shares: an empty map means all are gone
            time.sleep(0.05)
        done = time.monotonic()
        return {"kernels": kernels, "ready_s": ready, "rss_mib": rss, "delete_s": deleted - started,
                "visible_after_delete_s": done - deleted, "visible_after_start_s": done - started}
    finally:
        ex.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--starts", type=int, default=7, help="cold starts at 10,000 kernels (median reported)")
    p.add_argument("--rounds", type=int, default=200, help="/metrics requests per series in stage c")
    p.add_argument("--kernels-50k", type=int, default=50_000)
    p.add_argument("--skip-50k", action="store_true")
    p.add_argument("--compare", type=Path, help="another checkout (e.g. a worktree of an earlier revision): its cold "
                   "starts interleaved with these, both polled")
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "scale.json")
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="gpu-alloc-scale-"))
    try:
        root = tmp / "k10"
        log("building 10,000 kernels")
        build_tree(root, 10_000)
        settle()
        compile_bytecode()
        r: dict = {"load_before": os.getloadavg()[0]}
        log("cold starts")
        if args.compare:
            subprocess.run([sys.executable, "-m", "compileall", "-q", str(args.compare / "exporter")], check=True)
        starts = cold_starts(root, args.starts, args.compare)
        r["cold_start_s"] = {via: {"median": statistics.median(v), "min": min(v), "max": max(v), "runs": v}
                             for via, v in starts.items()}
        log("idle RSS")
        r["idle_rss_10k_mib"] = idle_rss(root, 20)
        log("/metrics under a /api/v1/state loop")
        r["state_loop"] = metrics_under_state_loop(root, args.rounds)
        if not args.skip_50k:
            r["k50"] = fifty_thousand(tmp, args.kernels_50k)
        r["load_after"] = os.getloadavg()[0]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(r, indent=1))
    s = r["state_loop"]
    cold = r["cold_start_s"]
    rows = [
        (f"cold start to ready, 10,000 kernels (median of {args.starts}, READY=1)",
         f"{cold['notify']['median']:.2f} s (min {cold['notify']['min']:.2f}; polled every 2 ms: {cold['poll']['median']:.2f} s)",
         "≤ 1.0 s", cold["notify"]["median"] <= 1.0),
        *([(f"cold start, {args.compare} (polled every 2 ms)", f"{cold['compare_poll']['median']:.2f} s; this tree "
            f"{cold['poll']['median']:.2f} s (ratio {cold['poll']['median'] / cold['compare_poll']['median']:.2f})", "", True)]
          if args.compare else []),
        ("idle RSS, 10,000 kernels", f"{r['idle_rss_10k_mib']:.1f} MiB", "≤ 60 MiB", r["idle_rss_10k_mib"] <= 60),
        ("/metrics p99 quiet / during a /api/v1/state loop", f"{s['quiet_p99_ms']:.1f} / {s['state_loop_p99_ms']:.1f} ms "
         f"({s['state_documents']} documents; node_exporter quiet p99 {s['node_exporter_quiet_p99_ms']:.1f} ms)",
         "≤ 2× quiet", s["state_loop_p99_ms"] <= 2 * s["quiet_p99_ms"]),
    ]
    if "k50" in r:
        k = r["k50"]
        rows += [
            ("RSS at 50,000 kernels", f"{k['rss_mib']:.1f} MiB (ready in {k['ready_s']:.1f} s)", "≤ 150 MiB", k["rss_mib"] <= 150),
            ("deleting 50,000 kernels: visible after the deletion ends",
             f"{k['visible_after_delete_s']:.2f} s (rm -rf took {k['delete_s']:.1f} s)", "≤ 5 s", k["visible_after_delete_s"] <= 5),
        ]
    print(f"load average {r['load_before']:.1f} before, {r['load_after']:.1f} after\n")
    print("| figure | measured | target | |\n|---|---|---|---|")
    for name, value, target, ok in rows:
        print(f"| {name} | {value} | {target} | {('met' if ok else '**missed**') if target else ''} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
