"""The HTTP server under hostile load, side by side with Debian's prometheus-node-exporter.

    python bench/hostile.py                       # all scenarios, this tree
    python bench/hostile.py --repo /tmp/before    # the same against another checkout (before/after)
    python bench/hostile.py --only flood,password

Scenarios (each reports medians; node_exporter runs the same client in the same run where it applies):

* ``slow``: /metrics latency at 10,000 kernels idle, while one client fetches /api/v1/state in a
  loop, and how long one ``simulate`` request with ``cuda.shares=1e999999`` takes;
* ``noread``: 300 clients ask for /api/v1/state at 2,000 kernels and never read; RSS before, at
  the peak, and 5 s after they left;
* ``noread_metrics``: 300, then 1,000 clients ask for /metrics at 10,000 kernels (plain, then
  gzip) with a 1 KiB receive buffer and never read: RSS before, at the peak and after, how many
  were answered 503, and a reading scrape meanwhile; node_exporter gets the same clients;
* ``flood``: silent TCP connects as fast as 4 threads can make them for 10 s while a scraper asks
  for /metrics on a fresh connection every 100 ms: answers and their p50/p99;
* ``password``: right after a start, 16 threads guess passwords from 127.0.0.2 while a scraper
  with the right password asks once a second from 127.0.0.1, 18 times: how many got in;
* ``password_own``: the same with 64 guessing threads on the scraper's own address, 127.0.0.1.

Prints one JSON document; exits 0.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import ExporterProcess, build_tree, free_port, percentile, proc_rss_bytes  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class NodeExporter:
    def __init__(self, *extra: str) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(["prometheus-node-exporter", f"--web.listen-address=127.0.0.1:{self.port}",
                                      "--collector.disable-defaults", "--collector.loadavg", *extra],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("node_exporter did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


def fetch(port: int, path: str = "/metrics", headers: dict | None = None, source: str = "127.0.0.1",
          timeout: float = 10) -> tuple[int, float]:
    """(status, seconds) on a fresh connection; status 0 when it failed or timed out."""
    t = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0))
    try:
        conn.request("GET", path, headers=headers or {})
        r = conn.getresponse()
        r.read()
        return r.status, time.perf_counter() - t
    except (OSError, http.client.HTTPException):
        return 0, time.perf_counter() - t
    finally:
        conn.close()


def latencies(port: int, n: int) -> list[float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    out = []
    for _ in range(n):
        t = time.perf_counter()
        conn.request("GET", "/metrics")
        r = conn.getresponse()
        r.read()
        out.append((time.perf_counter() - t) * 1000)
        time.sleep(0.01)
    conn.close()
    return out


def summary(ms: list[float]) -> dict:
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 2), "p99_ms": round(percentile(ms, 99), 2)}


def scenario_slow(tmp: Path) -> dict:
    root = tmp / "slow"
    build_tree(root, 10_000)
    ex = ExporterProcess(root)
    try:
        idle = latencies(ex.port, 200)
        stop = threading.Event()
        state_times: list[float] = []

        def loop() -> None:
            while not stop.is_set():
                state_times.append(fetch(ex.port, "/api/v1/state", timeout=60)[1])

        t = threading.Thread(target=loop)
        t.start()
        time.sleep(1)
        loaded = latencies(ex.port, 200)
        stop.set()
        t.join()
        status, seconds = fetch(ex.port, "/api/v1/simulate?request=cuda.shares=1e999999&policy=evenly-nofrag", timeout=120)
        return {"metrics_idle": summary(idle), "metrics_while_state_loops": summary(loaded),
                "state_fetch_ms_median": round(statistics.median(state_times) * 1000, 1),
                "simulate_1e999999": {"status": status, "seconds": round(seconds, 3)}}
    finally:
        ex.stop()


def scenario_noread(tmp: Path, clients: int = 300) -> dict:
    root = tmp / "noread"
    build_tree(root, 2_000)
    ex = ExporterProcess(root)
    try:
        fetch(ex.port, "/api/v1/state")
        before = proc_rss_bytes(ex.pid)
        socks = []
        peak = before
        for _ in range(clients):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", ex.port))
            s.sendall(b"GET /api/v1/state HTTP/1.1\r\nHost: x\r\n\r\n")
            socks.append(s)
            peak = max(peak, proc_rss_bytes(ex.pid))
        end = time.monotonic() + 10
        while time.monotonic() < end:
            peak = max(peak, proc_rss_bytes(ex.pid))
            time.sleep(0.1)
        metrics_during = fetch(ex.port)[1]
        for s in socks:
            s.close()
        time.sleep(5)
        after = proc_rss_bytes(ex.pid)
        mib = 1 << 20
        return {"clients": clients, "rss_before_mib": round(before / mib, 1), "rss_peak_mib": round(peak / mib, 1),
                "rss_after_mib": round(after / mib, 1), "metrics_during_ms": round(metrics_during * 1000, 1)}
    finally:
        ex.stop()


def never_read_metrics(port: int, pid: int, clients: int, gzipped: bool, hold: float = 8.0) -> dict:
    """``clients`` connections that each ask for /metrics with a 1 KiB receive buffer and never
    read, held ``hold`` seconds: the server's RSS before, at the peak and 5 s after they left."""
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + (b"Accept-Encoding: gzip\r\n" if gzipped else b"") + b"\r\n"
    before = peak = proc_rss_bytes(pid)
    socks, failed = [], 0
    for _ in range(clients):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connect: the window stays tiny
        try:
            s.connect(("127.0.0.1", port))
            s.sendall(request)
        except OSError:
            failed += 1
            s.close()
            continue
        socks.append(s)
        peak = max(peak, proc_rss_bytes(pid))
    end = time.monotonic() + hold
    while time.monotonic() < end:
        peak = max(peak, proc_rss_bytes(pid))
        time.sleep(0.1)
    headers = {"Accept-Encoding": "gzip"} if gzipped else {}
    status, seconds = fetch(port, headers=headers)
    outcomes = {"200": 0, "503": 0, "closed unanswered": 0, "nothing yet": 0}
    for s in socks:  # what each client has been sent, as far as its tiny buffer shows
        s.setblocking(False)
        try:
            head = s.recv(16)
            outcome = "200" if head.startswith(b"HTTP/1.1 200") else "503" if head.startswith(b"HTTP/1.1 503") else "closed unanswered"
        except BlockingIOError:
            outcome = "nothing yet"
        except OSError:
            outcome = "closed unanswered"
        outcomes[outcome] += 1
        s.close()
    time.sleep(5)
    mib = 1 << 20
    return {"clients": clients, "gzip": gzipped, "rss_before_mib": round(before / mib, 1),
            "rss_peak_mib": round(peak / mib, 1), "rss_after_mib": round(proc_rss_bytes(pid) / mib, 1),
            "outcomes": outcomes, "connect_failed": failed, "scrape_meanwhile": {"status": status, "ms": round(seconds * 1000, 1)}}


def scenario_noread_metrics(tmp: Path) -> dict:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # 1,000 client sockets in this process
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    root = tmp / "noread_metrics"
    build_tree(root, 10_000)
    cases = [(300, False), (300, True), (1000, False), (1000, True)]
    ex = ExporterProcess(root)
    try:
        fetch(ex.port)
        fetch(ex.port, headers={"Accept-Encoding": "gzip"})
        ours = [never_read_metrics(ex.port, ex.pid, clients, gz) for clients, gz in cases]
    finally:
        ex.stop()
    ne = NodeExporter()
    try:
        theirs = [never_read_metrics(ne.port, ne.proc.pid, clients, gz) for clients, gz in cases]
    finally:
        ne.stop()
    return {"exporter": ours, "node_exporter": theirs}


def flood(port: int, seconds: float = 10.0, threads: int = 4) -> dict:
    stop = threading.Event()
    connects = [0]

    def flooder() -> None:
        held: list[socket.socket] = []
        while not stop.is_set():
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=2)
                held.append(s)
                connects[0] += 1
            except OSError:
                pass
            if len(held) > 200:  # keep a window open, like a flood that does not wait for answers
                held.pop(0).close()
        for s in held:
            s.close()

    workers = [threading.Thread(target=flooder) for _ in range(threads)]
    for w in workers:
        w.start()
    answered: list[float] = []
    tries = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        tries += 1
        status, took = fetch(port, timeout=5)
        if status == 200:
            answered.append(took * 1000)
        time.sleep(0.1)
    stop.set()
    for w in workers:
        w.join()
    out = {"connects": connects[0], "tries": tries, "answered": len(answered)}
    if answered:
        out.update(summary(answered))
    return out


def scenario_flood(tmp: Path) -> dict:
    root = tmp / "flood"
    build_tree(root, 100)
    ex = ExporterProcess(root)
    try:
        ours = flood(ex.port)
    finally:
        ex.stop()
    ne = NodeExporter()
    try:
        theirs = flood(ne.port)
    finally:
        ne.stop()
    return {"exporter": ours, "node_exporter": theirs}


def password(port: int, tries: int = 18, guessers: int = 16, guess_from: str = "127.0.0.2") -> dict:
    stop = threading.Event()
    guesses = [0]

    def guesser(n: int) -> None:
        i = 0
        while not stop.is_set():
            token = base64.b64encode(f"prometheus:guess-{n}-{i}".encode()).decode()
            fetch(port, headers={"Authorization": f"Basic {token}"}, source=guess_from, timeout=10)
            guesses[0] += 1
            i += 1

    workers = [threading.Thread(target=guesser, args=(n,)) for n in range(guessers)]
    for w in workers:
        w.start()
    time.sleep(0.5)
    token = base64.b64encode(b"prometheus:s3cret").decode()
    codes, times = [], []
    for _ in range(tries):
        status, took = fetch(port, headers={"Authorization": f"Basic {token}"}, timeout=10)
        codes.append(status)
        times.append(took * 1000)
        time.sleep(1)
    stop.set()
    for w in workers:
        w.join()
    return {"got_in": codes.count(200), "tries": tries, "codes": sorted(set(codes)), "guesses": guesses[0],
            **{k: v for k, v in summary(times).items() if k != "n"}}


def scenario_password(tmp: Path, guessers: int = 16, guess_from: str = "127.0.0.2") -> dict:
    import bcrypt

    config = tmp / "web.yml"
    config.write_text(f"basic_auth_users:\n  prometheus: {bcrypt.hashpw(b's3cret', bcrypt.gensalt(10)).decode()}\n")
    root = tmp / ("password" if guess_from == "127.0.0.2" else "password_own")
    build_tree(root, 100)
    ex = ExporterProcess(root, "--web.config.file", str(config), wait_ready=False)
    try:
        deadline = time.monotonic() + 60
        while fetch(ex.port, "/-/ready")[0] != 401:  # up (it asks for credentials)
            if time.monotonic() > deadline:
                raise RuntimeError("exporter did not start")
            time.sleep(0.05)
        ours = password(ex.port, guessers=guessers, guess_from=guess_from)
    finally:
        ex.stop()
    ne = NodeExporter(f"--web.config.file={config}")
    try:
        theirs = password(ne.port, guessers=guessers, guess_from=guess_from)
    finally:
        ne.stop()
    return {"exporter": ours, "node_exporter": theirs}


def scenario_password_own(tmp: Path) -> dict:
    return scenario_password(tmp, guessers=64, guess_from="127.0.0.1")


SCENARIOS = {"slow": scenario_slow, "noread": scenario_noread, "noread_metrics": scenario_noread_metrics,
             "flood": scenario_flood, "password": scenario_password, "password_own": scenario_password_own}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", help="run the exporter from this checkout instead of this one")
    parser.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenarios")
    args = parser.parse_args(argv)
    if args.repo:
        common.REPO = Path(args.repo).resolve()
    result: dict = {"repo": str(common.REPO)}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            log(f"scenario {name}")
            result[name] = SCENARIOS[name](Path(tmp))
            log(json.dumps(result[name]))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
