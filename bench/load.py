"""Load: concurrent scrapers while resource.txt files churn, against the exporter as a separate process.

    python bench/load.py                           # 50 scrapers, 1,000 writes/s, 60 s, 1,000 kernels
    python bench/load.py --duration 600 --soak     # the 10-minute RSS soak
    python bench/load.py --duration 5              # what tests/test_faults.py runs

Checks, and exits 1 if any fails: every response is 200; every /metrics response is internally
consistent (each ``gpu_alloc_device_allocated`` equals the sum of that device's
``gpu_alloc_kernel_allocated`` series in the *same* response); after the churn stops, the
exporter converges to exactly what was last written (``/api/v1/alloc-map`` and every kernel's
allocations). With ``--soak``, RSS must not grow in the second half of the run (stable).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from decimal import Decimal
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    Client,
    ExporterProcess,
    build_tree,
    consistency_errors,
    expected_alloc_map,
    kernel_id,
    percentile,
    random_alloc,
    revision,
    write_resource,
)


def state_matches(client: Client, truth: dict[str, dict[str, Decimal]]) -> tuple[bool, str]:
    """Whether the exporter's view equals ``truth`` exactly (alloc map and every kernel)."""
    alloc = {d: Decimal(v) for d, v in client.json("/api/v1/alloc-map").items()}
    want = expected_alloc_map(truth)
    if alloc != want:
        diff = {d: (alloc.get(d), want.get(d)) for d in set(alloc) | set(want) if alloc.get(d) != want.get(d)}
        return False, f"alloc-map differs: {dict(list(diff.items())[:3])}"
    state = client.json("/api/v1/state")
    kernels = {k["kernel_id"]: k for k in state["kernels"]}
    if set(kernels) != set(truth):
        return False, f"kernel set differs ({len(kernels)} vs {len(truth)})"
    for kid, allocs in truth.items():
        k = kernels[kid]
        got = {a["device_id"]: Decimal(a["amount"]) for a in k["allocations"] if a["slot"] == "cuda.shares"}
        if k["state"] != "ok" or got != allocs:
            return False, f"kernel {kid}: {k['state']} {got} != {allocs}"
    return True, ""


def run_load(root: Path, *, kernels: int = 1000, scrapers: int = 50, rate: float = 1000.0, duration: float = 60.0,
             sample_every: float = 1.0, seed: int = 7, log_path: Path | None = None,
             kill9_at: float | None = None) -> dict:
    """Run one load test; returns the figures (see ``main`` for their meaning).

    :param kill9_at: if set, SIGKILL the exporter that many seconds into the churn, keep churning,
        restart it after the churn and require the restarted process to converge to the truth.
    """
    truth = build_tree(root, kernels, seed=seed)
    ex = ExporterProcess(root, log_path=log_path)
    result: dict = {"kernels": kernels, "scrapers": scrapers, "target_rate": rate, "duration": duration,
                    "ready_seconds": round(ex.ready_seconds or 0, 3)}
    stop = threading.Event()
    lock = threading.Lock()
    latencies: list[float] = []
    errors: list[str] = []
    inconsistent: list[str] = []
    scrapes = [0]
    samples: list[tuple[float, int, int, float]] = []  # (t, rss, threads, cpu)
    killed = threading.Event()

    def scraper(i: int) -> None:
        client = Client(ex.port)
        try:
            while not stop.is_set():
                t = time.perf_counter()
                try:
                    status, body, _ = client.get("/metrics")
                except (OSError, http.client.HTTPException) as exc:
                    if killed.is_set():
                        time.sleep(0.05)
                        continue
                    with lock:
                        errors.append(f"scraper {i}: {exc!r}")
                    time.sleep(0.05)
                    continue
                elapsed = time.perf_counter() - t
                problems = consistency_errors(body.decode()) if status == 200 else []
                with lock:
                    scrapes[0] += 1
                    latencies.append(elapsed)
                    if status != 200:
                        errors.append(f"scraper {i}: HTTP {status}")
                    if problems:
                        inconsistent.extend(problems[:2])
        finally:
            client.close()

    # The writer is a separate process: in this one it would compete for the GIL with 50 scrapers.
    writer = subprocess.Popen(
        [sys.executable, __file__, "--writer-child", str(root), str(kernels), str(rate), str(duration), str(seed + 1)],
        stdout=subprocess.PIPE, text=True,
    )

    threads = [threading.Thread(target=scraper, args=(i,), name=f"scraper-{i}") for i in range(scrapers)]
    cpu0 = ex.cpu_seconds()
    t0 = time.perf_counter()
    samples.append((0.0, ex.rss_bytes(), ex.threads(), 0.0))
    for t in threads:  # with 50 busy scrapers the loop below may get the GIL rarely: sample before and after too
        t.start()
    try:
        next_sample = t0 + sample_every
        while time.perf_counter() - t0 < duration:
            now = time.perf_counter()
            if kill9_at is not None and not killed.is_set() and now - t0 >= kill9_at:
                result["cpu_seconds_before_kill"] = round(ex.cpu_seconds() - cpu0, 2)
                killed.set()
                ex.kill9()
            if now >= next_sample and not killed.is_set():
                samples.append((now - t0, ex.rss_bytes(), ex.threads(), ex.cpu_seconds() - cpu0))
                next_sample += sample_every
            time.sleep(min(0.05, max(0.0, next_sample - time.perf_counter())))
        if not killed.is_set():
            samples.append((time.perf_counter() - t0, ex.rss_bytes(), ex.threads(), ex.cpu_seconds() - cpu0))
    finally:
        out, _ = writer.communicate(timeout=duration + 60)
        churn_seconds = time.perf_counter() - t0
        stop.set()
        for t in threads:
            t.join()
    report = json.loads(out)
    for kid, allocs in report["last"].items():
        truth[kid] = {d: Decimal(a) for d, a in allocs.items()}
    if not killed.is_set():
        cpu_churn = ex.cpu_seconds() - cpu0
    if killed.is_set():
        ex = ExporterProcess(root, log_path=log_path.with_suffix(".restart.log") if log_path else None)
        result["restart_ready_seconds"] = round(ex.ready_seconds or 0, 3)
    client = Client(ex.port, headers={})
    try:
        t1 = time.perf_counter()
        ok, why = False, ""
        while time.perf_counter() - t1 < 60:
            ok, why = state_matches(client, truth)
            if ok:
                break
            time.sleep(0.05)
        result["converged_seconds"] = round(time.perf_counter() - t1, 3)
        status = client.get("/metrics")
        final_consistent = status[0] == 200 and not consistency_errors(status[1].decode())
    finally:
        client.close()
        rc = ex.stop()
    result.update({
        "writes": report["writes"],
        "achieved_rate": round(report["writes"] / report["seconds"], 1),
        "writer_max_lag_ms": round(report["max_lag"] * 1000, 1),
        "scrapes": scrapes[0],
        "scrapes_per_second": round(scrapes[0] / churn_seconds, 1),
        "scrape_p50_ms": round(percentile(latencies, 50) * 1000, 2) if latencies else None,
        "scrape_p99_ms": round(percentile(latencies, 99) * 1000, 2) if latencies else None,
        "errors": errors[:20],
        "error_count": len(errors),
        "inconsistent": inconsistent[:20],
        "inconsistent_count": len(inconsistent),
        "final_exact": ok,
        "final_mismatch": why,
        "final_consistent": final_consistent,
        "exit_code": rc,
        "killed": killed.is_set(),
    })
    if not killed.is_set():
        result["exporter_cpu_seconds"] = round(cpu_churn, 2)
        result["exporter_cpu_percent_of_core"] = round(100 * cpu_churn / churn_seconds, 1)
    if samples:
        rss = [s[1] for s in samples]
        half = len(rss) // 2
        result.update({
            "rss_mib_start": round(rss[0] / 2**20, 1),
            "rss_mib_end": round(rss[-1] / 2**20, 1),
            "rss_mib_max": round(max(rss) / 2**20, 1),
            # Growth over the second half: a leak shows here; warm-up (caches, allocator) does not.
            "rss_mib_second_half_growth": round((max(rss[half:]) - max(rss[:half] or rss[:1])) / 2**20, 1),
            "threads_max": max(s[2] for s in samples),
            "rss_samples_mib": [round(r / 2**20, 1) for r in rss[:: max(1, len(rss) // 20)]],
        })
    return result


def writer_child(root: Path, kernels: int, rate: float, duration: float, seed: int) -> None:
    """Rewrite random kernels' resource.txt in place at ``rate`` per second; print what was last
    written per kernel, as JSON, on stdout."""
    rng = random.Random(seed)
    ids = [kernel_id(i) for i in range(kernels)]
    last: dict[str, dict[str, str]] = {}
    started = time.perf_counter()
    n, max_lag = 0, 0.0
    while True:
        due = started + n / rate
        if due - started >= duration:
            break
        now = time.perf_counter()
        if due > now:
            time.sleep(due - now)
        else:
            max_lag = max(max_lag, now - due)
        kid = ids[rng.randrange(len(ids))]
        allocs = random_alloc(rng)
        write_resource(root, kid, allocs, cid=f"{int(kid[:8], 16):064x}")
        last[kid] = {d: str(a) for d, a in allocs.items()}
        n += 1
    json.dump({"writes": n, "seconds": time.perf_counter() - started, "max_lag": max_lag, "last": last}, sys.stdout)


def passed(result: dict, soak: bool = False) -> list[str]:
    problems = []
    if result["error_count"]:
        problems.append(f"{result['error_count']} errors, e.g. {result['errors'][:2]}")
    if result["inconsistent_count"]:
        problems.append(f"{result['inconsistent_count']} inconsistent responses, e.g. {result['inconsistent'][:2]}")
    if not result["final_exact"]:
        problems.append(f"final state not exact: {result['final_mismatch']}")
    if not result["final_consistent"]:
        problems.append("final /metrics inconsistent")
    if result["exit_code"] != 0:
        problems.append(f"exporter exited with {result['exit_code']}")
    if soak and result.get("rss_mib_second_half_growth", 0) > 5:
        problems.append(f"RSS grew {result['rss_mib_second_half_growth']} MiB in the second half")
    return problems


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--writer-child":
        root, kernels, rate, duration, seed = argv[1:6]
        writer_child(Path(root), int(kernels), float(rate), float(duration), int(seed))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", type=int, default=1000)
    p.add_argument("--scrapers", type=int, default=50)
    p.add_argument("--rate", type=float, default=1000.0, help="resource.txt writes per second")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of churn")
    p.add_argument("--soak", action="store_true", help="sample RSS every 10 s and require it stable")
    p.add_argument("--kill9-at", type=float, default=None, help="SIGKILL the exporter this many seconds in, then restart")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gpu-alloc-load-") as tmp:
        result = run_load(Path(tmp) / "scratch", kernels=args.kernels, scrapers=args.scrapers, rate=args.rate,
                          duration=args.duration, sample_every=10.0 if args.soak else 1.0,
                          log_path=Path(tmp) / "exporter.log", kill9_at=args.kill9_at)
    problems = passed(result, soak=args.soak)
    result["problems"] = problems
    result["revision"] = revision()
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
