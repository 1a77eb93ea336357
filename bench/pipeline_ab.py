"""The run-time path's targets at 10,000 kernels, this checkout beside another, in one run.

    python bench/pipeline_ab.py --compare /tmp/before          # all stages, both checkouts
    python bench/pipeline_ab.py --compare /tmp/before --idle 60 --trials 40

Each stage alternates the two checkouts' exporters (fresh processes on one 10,000-kernel tree,
``--telemetry.source none`` with a capacity override per GPU, so headroom has devices):

a. cold start: spawn -> ``READY=1``, ``--starts`` times each, alternated; the medians.
b. change -> headroom: a kernel's ``resource.txt`` rewritten, then ``/api/v1/simulate`` asked until
   the node state it places on (the one headroom figures and ``request_fits`` are computed from)
   holds the new amount on that GPU; and change -> ``/api/v1/alloc-map``; p50/p99 of ``--trials``,
   once the exporter watches every kernel. Readiness comes after the first scan and before the
   per-kernel watches are armed (the arming pass and the stat-only rescan after it run behind
   readiness); until they are, a change is seen by that rescan. How long after ``READY=1`` every
   kernel is watched (``gpu_alloc_watcher_watches``), and the first change made at readiness, are
   reported apart (``armed_after_ready_s``, ``change_at_ready_ms``).
c. the first ``/metrics`` scrape after each change (gzip, as Prometheus asks): p50/p99, beside
   node_exporter's median scrape in the same run.
d. idle CPU: ``--idle`` seconds, a scrape every 15 s, percent of one core.

Prints one JSON document (both checkouts' figures and the ratios this/other). A shared 2-core
machine is noisy: read the medians and the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from decimal import Decimal
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import GPUS, ExporterProcess, build_tree, compile_bytecode, percentile, resource_text, settle  # noqa: E402
from run import NodeExporter, Timed  # noqa: E402

OVERRIDES = [arg for gpu in GPUS for arg in ("--capacity.override", f"{gpu}=13.5")]
EXTRA = ("--headroom.mode", "fractional", *OVERRIDES)


def ms(values: list[float], q: float | None = None) -> float:
    return round(1000 * (statistics.median(values) if q is None else percentile(values, q)), 2)


def cold_starts(root: Path, repos: dict[str, Path | None], runs: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {name: [] for name in repos}
    for _ in range(runs):
        for name, repo in repos.items():
            ex = ExporterProcess(root, *EXTRA, repo=repo)
            out[name].append(ex.ready_seconds)
            ex.stop()
    return out


def allocated_on(client: Timed, device: str) -> Decimal:
    """What the node state that headroom and request_fits are computed from holds on ``device``."""
    body = client.get("/api/v1/simulate?request=cuda.shares=0.01&policy=evenly")[2]
    return next(Decimal(d["allocated"]) for d in json.loads(body)["devices"] if d["device_id"] == device)


def armed_after_ready(ex: ExporterProcess, kernels: int, timeout: float = 60.0) -> float:
    """Seconds from ``READY=1`` until the exporter holds a watch on every kernel (and its root)."""
    client, ready = Timed(ex.port, headers={}), ex.started + ex.ready_seconds  # perf_counter time
    try:
        while True:
            watches = next((float(line.split()[-1]) for line in client.get()[2].splitlines()
                            if line.startswith(b"gpu_alloc_watcher_watches ")), 0.0)
            if watches >= kernels + 1:
                return time.perf_counter() - ready
            if time.perf_counter() - ready > timeout:
                raise RuntimeError(f"{watches:g} watches for {kernels} kernels {timeout:g} s after ready")
            time.sleep(0.01)
    finally:
        client.close()


def changes(ex: ExporterProcess, root: Path, truth: dict, trials: int, seed: int) -> dict[str, list[float]]:
    """Per change: seconds until the node state behind headroom holds it, until the alloc map
    does, and the first scrape after both. The first change is made at readiness (``at_ready``),
    the others once every kernel is watched."""
    rng = random.Random(seed)
    ids = sorted(truth)
    plain, scrape = Timed(ex.port, headers={}), Timed(ex.port)
    out: dict[str, list[float]] = {"headroom": [], "alloc_map": [], "first_scrape": [], "at_ready": [], "armed": []}
    try:
        for i in range(trials + 1):
            if i == 1:
                out["armed"].append(armed_after_ready(ex, len(truth)))
                scrape.get()  # the first full render, before the steady-state trials
            time.sleep(rng.uniform(0.005, 0.02))  # decorrelate from any periodic work
            kid = ids[rng.randrange(len(ids))]
            device = GPUS[i % len(GPUS)]
            new = {device: Decimal(rng.randint(1, 100)) / 100}
            if truth[kid] == new:
                new = {device: new[device] + Decimal("0.01")}
            truth[kid] = new
            want = sum((a.get(device, Decimal(0)) for a in truth.values()), Decimal(0))
            t0 = time.perf_counter()
            (root / kid / "config" / "resource.txt").write_text(resource_text(new))
            seen_map = seen_state = None
            while seen_map is None or seen_state is None:
                if time.perf_counter() - t0 > 10:
                    raise RuntimeError(f"change of {kid} not visible after 10 s")
                if seen_state is None and allocated_on(plain, device) == want:
                    seen_state = time.perf_counter() - t0
                if seen_map is None and Decimal(json.loads(plain.get("/api/v1/alloc-map")[2]).get(device, "0")) == want:
                    seen_map = time.perf_counter() - t0
            if i == 0:
                out["at_ready"].append(max(seen_state, seen_map))
                continue
            out["headroom"].append(seen_state)
            out["alloc_map"].append(seen_map)
            out["first_scrape"].append(scrape.get()[0])
    finally:
        plain.close()
        scrape.close()
    return out


def idle_cpu(ex: ExporterProcess, seconds: float, settle_s: float = 3.0) -> float:
    """Percent of one core the exporter spends over ``seconds`` with a scrape every 15 s, from
    ``settle_s`` after a first scrape."""
    client = Timed(ex.port)
    try:
        client.get()
        time.sleep(settle_s)
        cpu0, t0 = ex.cpu_seconds(), time.perf_counter()
        next_scrape = t0 + 15
        while time.perf_counter() - t0 < seconds:
            time.sleep(min(1.0, max(0.0, t0 + seconds - time.perf_counter())))
            if time.perf_counter() >= next_scrape:
                client.get()
                next_scrape += 15
        return round(100 * (ex.cpu_seconds() - cpu0) / (time.perf_counter() - t0), 3)
    finally:
        client.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", type=Path, required=True, help="another checkout of the exporter")
    ap.add_argument("--kernels", type=int, default=10_000)
    ap.add_argument("--starts", type=int, default=5)
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--idle", type=float, default=120.0)
    args = ap.parse_args()
    compile_bytecode()
    repos: dict[str, Path | None] = {"this": None, "other": args.compare.resolve()}
    with tempfile.TemporaryDirectory(prefix="gpu-alloc-ab-") as tmp:
        root = Path(tmp) / "scratches"
        truth = build_tree(root, args.kernels)
        settle()
        result: dict = {"kernels": args.kernels, "other": str(args.compare)}
        starts = cold_starts(root, repos, args.starts)
        result["cold_start_median_s"] = {n: round(statistics.median(v), 3) for n, v in starts.items()}
        ne = NodeExporter()
        try:
            ne_client = Timed(ne.port)
            ne_times = [ne_client.get()[0] for _ in range(50)]
            ne_client.close()
            result["node_exporter_median_ms"] = ms(ne_times)
            per: dict[str, dict[str, list[float]]] = {
                n: {"headroom": [], "alloc_map": [], "first_scrape": [], "at_ready": [], "armed": []} for n in repos}
            idle: dict[str, list[float]] = {n: [] for n in repos}
            for round_ in range(2):  # two alternated rounds of each
                for name, repo in repos.items():
                    ex = ExporterProcess(root, *EXTRA, repo=repo)
                    try:
                        for key, values in changes(ex, root, truth, args.trials // 2, seed=round_ * 7 + len(name)).items():
                            per[name][key] += values
                        idle[name].append(idle_cpu(ex, args.idle / 2))
                    finally:
                        ex.stop()
            for name in repos:
                result[name] = {
                    "change_to_headroom_p50_ms": ms(per[name]["headroom"]),
                    "change_to_headroom_p99_ms": ms(per[name]["headroom"], 99),
                    "change_to_alloc_map_p50_ms": ms(per[name]["alloc_map"]),
                    "change_to_alloc_map_p99_ms": ms(per[name]["alloc_map"], 99),
                    "first_scrape_after_change_p50_ms": ms(per[name]["first_scrape"]),
                    "first_scrape_after_change_p99_ms": ms(per[name]["first_scrape"], 99),
                    "armed_after_ready_s": round(statistics.median(per[name]["armed"]), 3),
                    "change_at_ready_ms": ms(per[name]["at_ready"]),
                    "idle_cpu_percent_of_core": round(statistics.mean(idle[name]), 3),
                }
            result["ratios_this_over_other"] = {
                key: round(result["this"][key] / result["other"][key], 2) if result["other"][key] else None
                for key in result["this"]
            }
        finally:
            ne.stop()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
