"""/metrics latency while one GPU's NVML calls hang (issue: a hung NVML call never delays a scrape).

Runs the exporter in-process on the simulated DGX A100 (the real nvidia-ml-py binding over a fake
libnvidia-ml), with a 0.2 s sampling interval, and scrapes /metrics over real HTTP:
first with every GPU healthy, then with GPU 3's ``nvmlDeviceGetUtilizationRates`` blocked until
the end. Prints p50/p99 of both phases and whether GPU 3 turned stale while the others kept
reporting.

    .venv/bin/python bench/telemetry_hang.py [--requests 400]
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import sys
import tempfile
import time
from decimal import Decimal
from pathlib import Path

from exporter.app import Exporter
from exporter.config import resolve
from exporter.demo import write_kernel
from exporter.settings import Settings
from exporter.telemetry.nvml import NvmlSource
from exporter.telemetry.nvml.simulated import FakeNvml
from exporter.web.server import HttpServer


def scrape(port: int, n: int) -> list[float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        conn.request("GET", "/metrics")
        body = conn.getresponse().read()
        times.append(time.perf_counter() - t0)
        assert body
    conn.close()
    return times


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] * 1000


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=400)
    args = ap.parse_args()
    fake = FakeNvml.dgx_a100()
    root = Path(tempfile.mkdtemp()) / "scratches"
    for i, gpu in enumerate(fake.gpus[:6]):
        write_kernel(root, f"k{i}", {"cuda.shares": {gpu.uuid: Decimal("0.5")}}, container_id=f"{i:02x}" * 32)
    settings = Settings.load({"scratch_roots": [str(root)], "telemetry_source": "none",
                              "telemetry_interval": 0.2, "telemetry_timeout": 0.5})
    with fake.installed():
        exporter = Exporter(resolve(settings), telemetry=NvmlSource(event_wait_ms=50))
        exporter.start()
        server = HttpServer(exporter.handle, "127.0.0.1", 0)
        server.start()
        try:
            healthy = scrape(server.port, args.requests)
            fault = fake.hang("nvmlDeviceGetUtilizationRates", index=3)
            hung_at = time.monotonic()
            while exporter.sampler.latest().devices[3].up:
                time.sleep(0.01)
            stale_after = time.monotonic() - hung_at
            hanging = scrape(server.port, args.requests)
            snap = exporter.sampler.latest()
            others_up = sum(d.up for i, d in enumerate(snap.devices) if i != 3)
            fault.release()
        finally:
            server.close()
            exporter.close()
    print(f"/metrics, {args.requests} sequential scrapes each, fake DGX A100, interval 0.2 s, timeout 0.5 s")
    print(f"  healthy:        p50 {pct(healthy, 50):.2f} ms  p99 {pct(healthy, 99):.2f} ms")
    print(f"  GPU 3 hanging:  p50 {pct(hanging, 50):.2f} ms  p99 {pct(hanging, 99):.2f} ms")
    print(f"  GPU 3 marked down {stale_after:.2f} s after the hang began; other GPUs up: {others_up}/7")
    return 0


if __name__ == "__main__":
    sys.exit(main())
