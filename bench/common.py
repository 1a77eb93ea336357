"""Shared pieces of the benchmark and load tools: scratch trees, the exporter as a separate process,
a Prometheus-like HTTP client, /proc accounting, a fast consistency check of one exposition.

Only the standard library and the exporter's own dependencies; usable from tests (imported by path).
"""

from __future__ import annotations

import gzip
import http.client
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Prometheus 2.42's scrape Accept header (tooling.md §4) and its Accept-Encoding.
PROMETHEUS_HEADERS = {
    "Accept": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
              "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "Accept-Encoding": "gzip",
    "User-Agent": "Prometheus/2.42.0",
}
CLK_TCK = os.sysconf("SC_CLK_TCK")
GPUS = [f"GPU-{i:08x}-0000-4000-8000-00000000be0{i}" for i in range(8)]


def kernel_id(i: int) -> str:
    return f"{i:08x}-b3c4-4d5e-8f60-{i:012x}"


def resource_text(allocs: dict[str, Decimal], cid: str | None = None) -> str:
    """A current-format resource.txt holding ``cuda.shares`` amounts on devices."""
    total = sum(allocs.values(), Decimal(0))
    lines = ["SCRATCH_SIZE=0m", "MOUNTS=/var/lib/backend.ai/krunner:/opt/kernel:ro",
             f'SLOTS={{"cpu":"2","mem":"4294967296","cuda.shares":"{total}"}}', "UNIFIED_DEVICES=[]"]
    if allocs:
        lines.append("CUDA.SHARES_SHARES=" + ",".join(f"{d}:{a}" for d, a in allocs.items()))
    lines += ["CPU_SHARES=0:1,1:1", "MEM_SHARES=root:4g"]
    if cid:
        lines.append(f"CID={cid}")
    return "\n".join(lines) + "\n"


def random_alloc(rng: random.Random) -> dict[str, Decimal]:
    """One or two devices, amounts in 0.01 steps (exact in Decimal)."""
    devices = rng.sample(GPUS, rng.choice((1, 1, 1, 2)))
    return {d: Decimal(rng.randint(1, 100)) / 100 for d in devices}


def write_resource(root: Path, kid: str, allocs: dict[str, Decimal], cid: str | None = None) -> None:
    """Write in place (truncate + write, no rename), as the agent does."""
    path = root / kid / "config" / "resource.txt"
    with open(path, "w") as f:
        f.write(resource_text(allocs, cid))


def build_tree(root: Path, kernels: int, seed: int = 1) -> dict[str, dict[str, Decimal]]:
    """``kernels`` kernel directories (config/ and work/) with random fGPU allocations over 8 GPUs."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    truth = {}
    for i in range(kernels):
        kid = kernel_id(i)
        (root / kid / "config").mkdir(parents=True, exist_ok=True)
        (root / kid / "work").mkdir(exist_ok=True)
        allocs = random_alloc(rng)
        write_resource(root, kid, allocs, cid=f"{i:064x}")
        truth[kid] = allocs
    return truth


def settle() -> None:
    """Write a freshly built tree back to disk before timing: its ~30,000 dirty pages are otherwise
    flushed by the kernel's writeback threads during the first starts, on the same 2 cores (the
    first of 7 starts took up to 1.8 s, the last 0.9 s)."""
    os.sync()
    time.sleep(2)


def compile_bytecode() -> None:
    """Compile the package's bytecode, as ``pip install`` and the container image do: where
    PYTHONDONTWRITEBYTECODE is set and the package is an editable checkout, every start would
    otherwise compile ~70 modules from source (~0.1 s of each start)."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "exporter")], check=True)


def expected_alloc_map(truth: dict[str, dict[str, Decimal]]) -> dict[str, Decimal]:
    out: dict[str, Decimal] = {}
    for allocs in truth.values():
        for d, a in allocs.items():
            out[d] = out.get(d, Decimal(0)) + a
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- processes ------------------------------------------------------------------------------------


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


def proc_rss_bytes(pid: int) -> int:
    return int(proc_status(pid)["VmRSS"].split()[0]) * 1024


def proc_threads(pid: int) -> int:
    return int(proc_status(pid)["Threads"])


class ExporterProcess:
    """``python -m exporter`` as a child process on a free port (the package of ``repo``).

    Readiness is learnt as a ``Type=notify`` systemd unit learns it: the exporter's ``READY=1``
    datagram on ``$NOTIFY_SOCKET`` (sent as ``/-/ready`` turns 200; one GET confirms it; an exporter
    from before READY=1 is found by asking ``/-/ready`` every 0.1 s instead). Polling
    ``/-/ready`` every 2 ms instead (``ready_via="poll"``) costs the exporter the CPU of ~500
    answers a second on a 2-core machine: it adds ~0.3 s to a 10,000-kernel start.
    """

    def __init__(self, root: Path | str, *extra: str, python: str = sys.executable, env: dict | None = None,
                 log_path: Path | None = None, wait_ready: bool = True, ready_via: str = "notify",
                 repo: Path | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w") if log_path else subprocess.DEVNULL
        self.port = free_port()
        self._notify_dir = tempfile.mkdtemp(prefix="gpu-alloc-notify-")
        self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._notify.bind(os.path.join(self._notify_dir, "notify"))
        self.ready_via = ready_via
        env = {**os.environ, **(env or {})}
        if ready_via == "notify":
            env["NOTIFY_SOCKET"] = os.path.join(self._notify_dir, "notify")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            [python, "-m", "exporter", "--scratch.root", str(root), "--web.listen-address", f"127.0.0.1:{self.port}",
             "--telemetry.source", "none", *extra],
            stdout=subprocess.DEVNULL, stderr=self._log, env=env, cwd=str(repo or REPO),
        )
        self.pid = self.proc.pid
        self.ready_seconds: float | None = None
        if wait_ready:
            self.wait_ready()

    def wait_ready(self, timeout: float = 60.0) -> float:
        """Seconds from spawn to readiness (``READY=1``, or the first 200 from /-/ready)."""
        deadline = time.monotonic() + timeout
        if self.ready_via == "notify":
            self._notify.settimeout(0.1)
            while True:
                try:
                    message = self._notify.recv(4096)
                except TimeoutError:
                    message = b""
                if b"READY=1" in message.split(b"\n"):
                    self.ready_seconds = time.perf_counter() - self.started
                    assert self._ready_status() == 200, "READY=1 before /-/ready answers 200"
                    return self.ready_seconds
                if not message and self._ready_quietly():  # an exporter from before READY=1
                    self.ready_seconds = time.perf_counter() - self.started
                    return self.ready_seconds
                if self.proc.poll() is not None:
                    raise RuntimeError(f"exporter exited with {self.proc.returncode}")
                if time.monotonic() > deadline:
                    raise TimeoutError("exporter not ready")
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exporter exited with {self.proc.returncode}")
            try:
                if self._ready_status() == 200:
                    self.ready_seconds = time.perf_counter() - self.started
                    return self.ready_seconds
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("exporter not ready")
            time.sleep(0.002)

    def _ready_quietly(self) -> bool:
        """/-/ready answers 200 (asked at most every 0.1 s: no load on the start being timed)."""
        try:
            return self._ready_status() == 200
        except OSError:
            return False

    def _ready_status(self) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1)
        try:
            conn.request("GET", "/-/ready")
            return conn.getresponse().status
        finally:
            conn.close()

    def cpu_seconds(self) -> float:
        return proc_cpu_seconds(self.pid)

    def rss_bytes(self) -> int:
        return proc_rss_bytes(self.pid)

    def threads(self) -> int:
        return proc_threads(self.pid)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        self._notify.close()
        shutil.rmtree(self._notify_dir, ignore_errors=True)
        return self.proc.returncode

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        self._notify.close()
        shutil.rmtree(self._notify_dir, ignore_errors=True)


class Client:
    """One keep-alive connection, like one Prometheus scrape loop."""

    def __init__(self, port: int, headers: dict | None = None, timeout: float = 30.0) -> None:
        self.port, self.timeout = port, timeout
        self.headers = PROMETHEUS_HEADERS if headers is None else headers
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)

    def get(self, path: str) -> tuple[int, bytes, int]:
        """(status, decoded body, bytes on the wire)."""
        for attempt in (0, 1):
            try:
                self.conn.request("GET", path, headers=self.headers)
                r = self.conn.getresponse()
                body = r.read()
                break
            except (OSError, http.client.HTTPException) as exc:
                # A fresh connection either way: http.client is unusable after a failed exchange.
                self.conn.close()
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
                retry = isinstance(exc, (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError))
                if attempt or not retry:
                    raise
        wire = len(body)
        if r.getheader("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        return r.status, body, wire

    def json(self, path: str):
        status, body, _ = self.get(path)
        if status != 200:
            raise RuntimeError(f"{path}: HTTP {status}")
        return json.loads(body)

    def close(self) -> None:
        self.conn.close()


# -- consistency ----------------------------------------------------------------------------------

_SAMPLE = re.compile(r'^(gpu_alloc_(?:kernel|device)_allocated)\{([^}]*)\} (\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def consistency_errors(text: str) -> list[str]:
    """In one exposition, every device total must equal the sum of that device's kernel series.

    Values are compared as Decimals of the printed floats (exact for amounts in 0.01 steps), with a
    relative tolerance of 1e-9 as a fallback for float rounding.
    """
    kernel: dict[tuple[str, str], Decimal] = {}
    device: dict[tuple[str, str], Decimal] = {}
    for line in text.splitlines():
        if not line.startswith("gpu_alloc_") or "_allocated{" not in line:
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = dict(_LABEL.findall(m.group(2)))
        key = (labels.get("device_id", ""), labels.get("slot", ""))
        value = Decimal(m.group(3))
        table = kernel if m.group(1) == "gpu_alloc_kernel_allocated" else device
        table[key] = table.get(key, Decimal(0)) + value
    errors = []
    for key in set(kernel) | set(device):
        k, d = kernel.get(key, Decimal(0)), device.get(key, Decimal(0))
        if k != d and abs(k - d) > Decimal("1e-9") * max(abs(k), abs(d)):
            errors.append(f"{key}: device {d} != sum of kernels {k}")
    if not device and kernel:
        errors.append("kernel series without device totals")
    return errors


# -- machine --------------------------------------------------------------------------------------


def machine() -> dict[str, str]:
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    ne = "not installed"
    try:
        out = subprocess.run(["prometheus-node-exporter", "--version"], capture_output=True, text=True, timeout=10)
        ne = (out.stdout or out.stderr).split("\n")[0]
    except OSError:
        pass
    return {
        "cpu": cpu, "cores": str(os.cpu_count()), "memory": f"{mem_kib / 1024 / 1024:.1f} GiB",
        "kernel": platform.release(), "python": platform.python_version(), "os": _os_release(),
        "node_exporter": ne, "loadavg_at_start": Path("/proc/loadavg").read_text().split()[0],
    }


def _os_release() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    return platform.platform()


def revision() -> str:
    """The checkout measured: commit, and whether the exporter's sources had local changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "exporter"], cwd=REPO, capture_output=True,
                               text=True).stdout.strip()
    except OSError:
        return "unknown"
    return f"{head}{' + local changes in exporter/' if dirty else ''}" if head else "unknown"


def percentile(values: Iterable[float], q: float) -> float:
    v = sorted(values)
    if not v:
        return float("nan")
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


@dataclass
class Stopwatch:
    samples: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, seconds: float) -> None:
        with self.lock:
            self.samples.append(seconds)
