"""Shared test helpers: polling, the attribution node (the fake DGX A100 with a recorded /proc
tree) and a small PKI. Test modules import from here, never from each other.

The attribution node: ``tests/fixtures/proc`` holds one directory per host PID (``stat``,
``cgroup``, ``mountinfo``), as node_exporter's fixtures do:

====  ====================  ==============================================================
pid   who                   how it shows
====  ====================  ==============================================================
1001  kernel K1             cgroup v1, Docker cgroupfs driver; on GPU 0 and GPU 1
1002  kernel K1             same container, GPU 0
2001  kernel K2             cgroup v2, systemd driver; ``comm`` with spaces and parentheses
2002  kernel K2             same, but on GPU 3, which K2 does not hold (isolation breach)
3001  kernel K3             CID= not appended yet: found by its ``/home/config`` bind mount;
                            the scratch root's filesystem is mounted at /var/lib/backend.ai
4001  host process          user session; host mounts include K4's tmpfs mount *point*
5001  kernel K5             hybrid cgroup v1 + v2, systemd driver; GPU 6's 3g.20gb MIG device
5002  kernel K5             GPU 6's 2g.10gb MIG device, which K5 does not hold (breach)
6001  leaked container      its kernel's directory is gone; a 1g.5gb MIG device of GPU 7
7001  kernel K4             cgroup v2; listed only when a test starts K4's process
9999  (no entry)            exited between NVML's list and /proc
====  ====================  ==============================================================
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from decimal import Decimal
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from exporter.analysis.attribution import AttributionTracker, ProcFS
from exporter.scratch.allocation import Kernel, KernelState
from exporter.scratch.resources import Allocation, ResourceSpec
from exporter.telemetry.devices import DeviceResolver
from exporter.telemetry.model import DeviceReading, TelemetrySnapshot
from exporter.telemetry.nvml import NvmlSource
from exporter.telemetry.nvml.simulated import GIB as GiB
from exporter.telemetry.nvml.simulated import FakeNvml

ROOT = Path(__file__).resolve().parent.parent  # the repository
FIXTURES = ROOT / "tests" / "fixtures"
GOLDEN = ROOT / "tests" / "golden"


def wait_for(predicate, timeout: float = 5.0, interval: float = 0.005):
    """Poll until ``predicate()`` is truthy; returns its value or fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout}s")
        time.sleep(interval)


# -- the attribution node -----------------------------------------------------------------------

PROC = FIXTURES / "proc"
SCRATCH = "/var/lib/backend.ai/scratches"

K1 = "0b3f6a52-1c2d-4e5f-8a9b-0c1d2e3f4a51"
K2 = "1c4e7b63-2d3e-4f60-9bac-1d2e3f4a5b62"
K3 = "2d5f8c74-3e4f-4071-acbd-2e3f4a5b6c73"
K4 = "3e609d85-4f50-4182-bdce-3f4a5b6c7d84"
K5 = "4f71ae96-5061-4293-cedf-4a5b6c7d8e95"
K6 = "5082bfa7-6172-43a4-dfe0-5b6c7d8e9fa6"
CID = {
    K1: "badb7283766a112aebdb2936077a25f5db85ea465cdbac330ba6641d38c4ac77",
    K2: "6897ab3e7bed435cf094a10477f16bf68af03a04d99b2833d43902ce2b40f0a9",
    K4: "0d4c" * 16,
    K5: "e75d1509b86b903f14316bbc8b9ba4ccb96f18b8543a423f24e5e869aac65097",
}
LEAKED_CID = "749c6e87acfeab8be0a145721650f755ffbe9e02d173ba0b5ab169728edaa480"
K3_CID = "54c41e0402abdddf802c5423f301d6e4231e205de082057831912ae6450d95be"

# Where the fixture PIDs run on the fake DGX A100: (GPU index, MIG index or None) -> [(pid, bytes)].
# GPU 6 is in MIG mode with 3g.20gb, 2g.10gb and 1g.5gb devices, GPU 7 with seven 1g.5gb.
PLACEMENT = {
    (0, None): [(1001, 4 * GiB), (1002, 2 * GiB)],
    (1, None): [(1001, 4 * GiB)],
    (2, None): [(2001, 10 * GiB)],
    (3, None): [(2002, 1 * GiB), (3001, 6 * GiB)],
    (5, None): [(4001, GiB // 2), (9999, GiB // 4)],
    (6, 0): [(5001, 8 * GiB)],
    (6, 1): [(5002, 1 * GiB)],
    (7, 3): [(6001, 3 * GiB)],
}
# Per-process SM samples (pid -> 0-1) of the GPUs without MIG, the field requested from telemetry.
UTILIZATION = {0: {1001: 0.6, 1002: 0.7}, 1: {1001: 0.02}, 2: {2001: 0.5}, 3: {3001: 0.3}, 4: {}, 5: {4001: 0.1}}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Reading(DeviceReading):
    """A reading with per-process SM samples, until telemetry provides ``process_utilization``."""

    process_utilization: Mapping[int, float] | None = None


@functools.cache
def _sampled() -> tuple[DeviceReading, ...]:
    """The fake DGX A100 read once through the real NVML source, with the fixture PIDs placed."""
    fake = FakeNvml.dgx_a100()
    for gpu in fake.gpus:
        fake.set_processes(gpu.index, PLACEMENT.get((gpu.index, None), []))
        for _, ci in gpu.cis():
            fake.set_processes(gpu.index, PLACEMENT.get((gpu.index, ci.mig_index), []), mig_index=ci.mig_index)
    with fake.installed():
        source = NvmlSource()
        try:
            return tuple(source.read_device(key) for key in source.prepare().device_keys)
        finally:
            source.close()


GPU = [d.uuid for d in _sampled()]
MIG = [m.uuid for m in _sampled()[6].mig_devices]  # 3g.20gb, 2g.10gb, 1g.5gb
LEAKED_MIG = _sampled()[7].mig_devices[3].uuid


def dgx(gpu: Mapping[int, dict] | None = None, mig: Mapping[tuple[int, int], dict] | None = None) -> TelemetrySnapshot:
    """One telemetry sample of the fake DGX A100; ``gpu``/``mig`` replace fields of single devices."""
    gpu, mig = gpu or {}, mig or {}
    devices = []
    for d in _sampled():
        fields = {f.name: getattr(d, f.name) for f in dataclasses.fields(DeviceReading)}
        fields["process_utilization"] = UTILIZATION.get(d.index)
        fields["mig_devices"] = tuple(dataclasses.replace(m, **mig.get((d.index, m.index), {})) for m in d.mig_devices)
        devices.append(Reading(**{**fields, **gpu.get(d.index, {})}))
    return TelemetrySnapshot(source="nvml", devices=tuple(devices), success=True)


def kernel(kid, allocations, cid=None, root=SCRATCH) -> Kernel:
    allocs = tuple(Allocation(slot, dev, Decimal(a)) for slot, per_dev in allocations.items() for dev, a in per_dev.items())
    return Kernel(kid, root, KernelState.OK, ResourceSpec(allocs, (), cid), None, 0.0)


def node_kernels(gpu=GPU, mig=MIG):
    return [
        kernel(K1, {"cuda.shares": {gpu[0]: "0.5", gpu[1]: "0.5"}, "cpu": {"0": "1", "1": "1"}}, CID[K1]),
        kernel(K2, {"cuda.device": {gpu[2]: "1"}, "cpu": {"2": "1"}}, CID[K2]),
        kernel(K3, {"cuda.shares": {gpu[3]: "1.0"}}),
        kernel(K4, {"cuda.device": {gpu[4]: "1"}}, CID[K4]),
        kernel(K5, {"cuda.device:3g.20gb-mig": {mig[0]: "1"}}, CID[K5]),
        kernel(K6, {"cuda.device:1g.5gb-mig": {mig[2]: "1"}}, "6b6b" * 16),
    ]


class Clock:
    def __init__(self, now=0.0):
        self.now = now

    def __call__(self):
        return self.now


def tracker(proc=PROC, clock=None, **kw) -> AttributionTracker:
    return AttributionTracker(ProcFS(proc) if isinstance(proc, Path) else proc, clock or Clock(), **kw)


def run(t: AttributionTracker, snapshot: TelemetrySnapshot | None = None, kernels=None):
    """One update, with the device resolver the exporter builds per sample."""
    snapshot = snapshot or dgx()
    kernels = node_kernels() if kernels is None else kernels
    gpu_ids = [a.device_id for k in kernels for a in k.allocations if a.slot.startswith("cuda.")]
    return t.update(snapshot, kernels, DeviceResolver(snapshot, gpu_ids))


def usage(result, kernel_id, device_id):
    found = [u for u in result.kernels if (u.kernel_id, u.device_id) == (kernel_id, device_id)]
    assert len(found) <= 1
    return found[0] if found else None


def unattributed(result, device_id):
    return {u.reason: (u.processes, u.memory_used_bytes) for u in result.unattributed if u.device_id == device_id and u.processes}


# -- a small PKI ----------------------------------------------------------------------------------

HASH = "$2y$10$X0h1gDsPszWURQaxFh.zoubFi6DXncSjhoQNJgRrnGs7EsimhC7zG"  # exporter-toolkit docs example


@dataclass
class Pki:
    dir: Path

    def path(self, name: str) -> Path:
        return self.dir / name


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None = None) -> None:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        path.with_suffix(".key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def make_ca(path: Path, cn: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write(path, cert, key)
    return cert, key


def make_leaf(path: Path, cn: str, ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey], *, server: bool,
              sans: list[x509.GeneralName]) -> int:
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    serial = x509.random_serial_number()
    usage = x509.oid.ExtendedKeyUsageOID.SERVER_AUTH if server else x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH
    cert = (
        x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(serial).not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write(path, cert, key)
    return serial


def make_pki(directory: Path) -> Pki:
    """ca.crt; server.crt/key (127.0.0.1, localhost); client.crt/key (DNS prometheus.example, signed by
    ca); rogue-ca.crt and rogue.crt/key (a client cert from another CA); server2 (a second server
    certificate for rotation tests)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = make_ca(directory / "ca", "test CA")
    rogue_ca = make_ca(directory / "rogue-ca", "rogue CA")
    server_sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    make_leaf(directory / "server", "server", ca, server=True, sans=server_sans)
    make_leaf(directory / "server2", "server two", ca, server=True, sans=server_sans)
    make_leaf(directory / "client", "prometheus", ca, server=False,
              sans=[x509.DNSName("prometheus.example"), x509.UniformResourceIdentifier("spiffe://test/prometheus")])
    make_leaf(directory / "other", "other", ca, server=False, sans=[x509.DNSName("other.example")])
    make_leaf(directory / "rogue", "prometheus", rogue_ca, server=False, sans=[x509.DNSName("prometheus.example")])
    return Pki(directory)


# -- Debian's node_exporter, the reference HTTP peer -------------------------------------------------

NODE_EXPORTER = shutil.which("prometheus-node-exporter")

# Each Debian tool the tests run and the package that ships it.
TOOLS = {
    "promtool": "prometheus",
    "prometheus": "prometheus",
    "prometheus-alertmanager": "prometheus-alertmanager",
    "amtool": "prometheus-alertmanager",
    "prometheus-node-exporter": "prometheus-node-exporter",
    "victoria-metrics": "victoria-metrics",
    "vmalert": "victoria-metrics",
}
REQUIRE_TOOLS = "GPU_ALLOC_EXPORTER_TEST_REQUIRE_TOOLS"
SKIPPED_FOR_TOOLS: list[str] = []  # listed at the end of the run (tests/conftest.py)


def require_tool(name: str, who: str = "") -> str:
    """The tool's path. Missing: the test fails under ``scripts/test`` (which installs every
    tool and sets GPU_ALLOC_EXPORTER_TEST_REQUIRE_TOOLS=1), else it is skipped, loudly."""
    path = shutil.which(name)
    if path is not None:
        return path
    why = f"{name} not installed (Debian: apt-get install {TOOLS.get(name, name)})"
    if os.environ.get(REQUIRE_TOOLS) == "1":
        pytest.fail(f"{why}; {REQUIRE_TOOLS}=1 forbids skipping", pytrace=False)
    SKIPPED_FOR_TOOLS.append(f"{who or os.environ.get('PYTEST_CURRENT_TEST', '?')}: {why}")
    pytest.skip(f"LOUD SKIP: {why}")


@contextlib.contextmanager
def node_exporter(web_config: Path | None = None) -> Iterator[int]:
    """Debian's node_exporter (loadavg collector only) on a free loopback port; yields the port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [NODE_EXPORTER, f"--web.listen-address=127.0.0.1:{port}", "--collector.disable-defaults", "--collector.loadavg"]
    if web_config is not None:
        args.append(f"--web.config.file={web_config}")
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def up() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return True
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode()
                return False

        wait_for(up, timeout=10)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stderr.close()


# -- a Docker Engine API endpoint (the opt-in label reader) ---------------------------------------


def container(kernel_id: str, session_id: str, user_id: str | None = "f38dea23-50fa-42a0-b5ae-338f5f4693f4", **extra: str) -> dict:
    """One entry of ``GET /containers/json`` as the Docker Engine API answers it for a kernel."""
    labels = {"ai.backend.kernel-id": kernel_id, "ai.backend.session-id": session_id,
              "ai.backend.agent-id": "i-gpu-node01", "ai.backend.session-type": "interactive",
              "ai.backend.service-ports": "jupyter:http:8080", **extra}
    if user_id is not None:
        labels["ai.backend.owner-user-id"] = user_id
    return {"Id": "3b9e1c0d" * 8, "Names": [f"/kernel.python.{kernel_id[:8]}"], "Image": "cr.backend.ai/python:3.11",
            "Labels": labels, "State": "running", "Status": "Up 5 minutes"}


class FakeDocker:
    """A Docker Engine API endpoint on a unix socket: answers ``/containers/json`` (honouring the
    label filter) and records every request line, so a test can tell nothing else was asked."""

    def __init__(self, path: Path, containers: list[dict]) -> None:
        self.path, self.containers, self.requests = path, containers, []
        self.status, self.body, self.drip = 200, None, 0.0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                fake.requests.append(self.path)
                url = urllib.parse.urlsplit(self.path)
                if url.path != "/containers/json":
                    self.send_error(404)
                    return
                filters = json.loads(urllib.parse.parse_qs(url.query).get("filters", ["{}"])[0])
                wanted = filters.get("label", [])
                listed = [c for c in fake.containers if all(w in c["Labels"] for w in wanted)]
                body = fake.body if fake.body is not None else json.dumps(listed).encode()
                self.send_response(fake.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                for i in range(0, len(body), 64):
                    self.wfile.write(body[i:i + 64])
                    self.wfile.flush()
                    time.sleep(fake.drip)

            def log_message(self, *args: object) -> None:
                pass

        self.server = socketserver.UnixStreamServer(str(path), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


class Running:
    """A ``python -m exporter`` child process; the port comes from its 'serving on' log line."""

    def __init__(self, *args: str, env: dict | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "exporter", *args], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})},
        )
        self.log: list[str] = []
        for line in self.proc.stderr:
            self.log.append(line)
            m = re.search(r"serving on http://\S+:(\d+)/metrics", line)
            if m:
                self.port = int(m.group(1))
                break
        else:
            raise AssertionError("exporter did not start:\n" + "".join(self.log))

    def get(self, path: str, headers: dict | None = None) -> tuple[int, bytes, dict]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, r.read(), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, e.read(), dict(e.headers)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(10)
        self.proc.stderr.close()
        self.proc.stdout.close()
        return rc
