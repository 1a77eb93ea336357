"""Hostile input: the corpus in tests/fixtures/hostile/ (one kernel per case, see its README) and
hypothesis fuzzing of ``exporter.scratch.resources.parse_resource``.

For every case: no crash, bounded time, the expected per-kernel state, one warning naming the file
and the reason (invalid files only; none again on a rescan), two canary kernels unaffected, every
label value surviving prometheus_client's parser and ``promtool check metrics``, and no planted
secret anywhere in the output or the log.

Permission denied is simulated in-process by making ``os.open`` raise ``PermissionError`` for that
one file (the tests run as root, which bypasses file modes); test_faults.py runs the real exporter
as uid 65534 over a mode-000 file for the real thing.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
import tomllib
import urllib.request
from decimal import Decimal
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from processes import require_tool
from prometheus_client.parser import text_string_to_metric_families

from exporter.app import Exporter
from exporter.config import resolve
from exporter.scratch import reader as reader_module
from exporter.scratch.allocation import AllocationBook
from exporter.scratch.reader import DEFAULT_MAX_BYTES
from exporter.scratch.resources import Pending, ResourceParseError, ResourceSpec, parse_resource
from exporter.settings import Settings
from exporter.web.server import Request

CORPUS = Path(__file__).parent / "fixtures" / "hostile"
CASES = sorted(p for p in CORPUS.iterdir() if p.is_dir())
GOOD = ('SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={{"cpu":"1","mem":"1073741824","cuda.shares":"{amount}"}}\nUNIFIED_DEVICES=[]\n'
        "CUDA.SHARES_SHARES={dev}:{amount}\nCPU_SHARES=0:1\nMEM_SHARES=root:1g\n")
CANARIES = {"canary-a": ("GPU-canary-a", "0.25"), "canary-b": ("GPU-canary-b", "0.75")}
SECRET_FILE = GOOD.format(dev="GPU-x", amount="0.5").replace("MOUNTS=", "MOUNTS=/HOSTILE-SECRET-OUTSIDE:/x:ro")


def meta(case: Path) -> dict:
    return tomllib.loads((case / "case.toml").read_text())


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def install(case: Path, root: Path, outside: Path) -> str:
    """Install one case under ``root``; returns the kernel id as the scanner will spell it."""
    m = meta(case)
    gen = m.get("generator")
    kid = case.name
    kdir = root / kid
    res = kdir / "config" / "resource.txt"
    if gen is None:
        # Fresh mtimes: a cut-off case stands for a file the agent is writing right now (once it
        # has settled, an unterminated last line is read as the agent reads it).
        shutil.copytree(case / "config", kdir / "config", copy_function=shutil.copyfile)
    elif gen == "sparse-1g":
        res.parent.mkdir(parents=True)
        with open(res, "wb") as f:
            f.truncate(1 << 30)
    elif gen == "over-limit":
        body = GOOD.format(dev="GPU-x", amount="0.5")
        body += "X=" + "y" * (DEFAULT_MAX_BYTES + 1 - len(body) - 3) + "\n"
        write(res, body)
        assert res.stat().st_size == DEFAULT_MAX_BYTES + 1
    elif gen == "fifo":
        res.parent.mkdir(parents=True)
        os.mkfifo(res)
    elif gen == "directory":
        res.mkdir(parents=True)
    elif gen == "char-device":
        res.parent.mkdir(parents=True)
        os.mknod(res, stat.S_IFCHR | 0o644, os.makedev(1, 5))  # /dev/zero
    elif gen == "socket-node":
        res.parent.mkdir(parents=True)
        os.mknod(res, stat.S_IFSOCK | 0o644)
    elif gen == "symlink-out":
        write(outside / "secret.txt", SECRET_FILE)
        res.parent.mkdir(parents=True)
        res.symlink_to(outside / "secret.txt")
    elif gen == "config-symlink-out":
        write(outside / "config" / "resource.txt", SECRET_FILE)
        kdir.mkdir()
        (kdir / "config").symlink_to(outside / "config")
    elif gen == "symlink-inside":
        write(root / ".shared" / "resource.txt", GOOD.format(dev="GPU-x", amount="0.5"))  # hidden: not a kernel
        res.parent.mkdir(parents=True)
        res.symlink_to(Path("..", "..", ".shared", "resource.txt"))
    elif gen == "symlink-loop":
        res.parent.mkdir(parents=True)
        res.symlink_to("resource.txt")
    elif gen == "symlink-dangling":
        res.parent.mkdir(parents=True)
        res.symlink_to("does-not-exist.txt")
    elif gen == "config-symlink-inside":  # a second name for canary-a's config/: never counted twice
        kdir.mkdir()
        (kdir / "config").symlink_to(Path("..", "canary-a", "config"))
    elif gen == "kernel-dir-symlink":
        write(outside / "kdir" / "config" / "resource.txt", SECRET_FILE)
        kdir.symlink_to(outside / "kdir")
    elif gen == "permission-denied":
        write(res, GOOD.format(dev="GPU-x", amount="0.5"))
        res.chmod(0)
    elif gen == "ten-thousand-entries":
        entries = ",".join(f"GPU-{i:05d}:0.01" for i in range(10_000))
        write(res, GOOD.format(dev="GPU-x", amount="100").replace("CUDA.SHARES_SHARES=GPU-x:100", f"CUDA.SHARES_SHARES={entries}"))
    elif gen == "hundred-thousand-lines":
        write(res, GOOD.format(dev="GPU-x", amount="0.5") + "".join(f"X{i:x}=\n" for i in range(100_000)))
        assert res.stat().st_size < DEFAULT_MAX_BYTES
    elif gen == "long-unterminated-line":
        write(res, GOOD.format(dev="GPU-x", amount="0.5") + "X=" + "a" * 900_000)
    elif gen == "kernel-name":
        name = bytes.fromhex(m["name_hex"])
        kid = os.fsdecode(name)
        path = os.path.join(os.fsencode(root), name, b"config")
        os.makedirs(path)
        with open(os.path.join(path, b"resource.txt"), "w") as f:
            f.write(GOOD.format(dev="GPU-x", amount="0.5"))
    else:
        raise AssertionError(f"unknown generator {gen}")
    return kid


def install_canaries(root: Path) -> None:
    for kid, (dev, amount) in CANARIES.items():
        write(root / kid / "config" / "resource.txt", GOOD.format(dev=dev, amount=amount))


def get(exporter: Exporter, path: str) -> bytes:
    response = exporter.handle(Request(method="GET", path=path, query={}, headers={}))
    assert response.status == 200, (path, response.status, bytes(response.body[:300]))
    return bytes(response.body)  # a shared document is a read-only memoryview


def labels_in(text: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for k, v in sample.labels.items():
                out.setdefault(k, set()).add(v)
    return out


def promtool_check(text: bytes) -> None:
    r = subprocess.run([require_tool("promtool"), "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert r.returncode == 0, r.stderr.decode()[:2000]


def rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar")


def _param(case: Path):
    bug = meta(case).get("bug")
    marks = [pytest.mark.xfail(strict=True, reason=f"BUG: {bug}")] if bug else []
    return pytest.param(case, id=case.name, marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_hostile_case(case: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch) -> None:
    m = meta(case)
    root, outside = tmp_path / "scratch", tmp_path / "outside"
    root.mkdir()
    install_canaries(root)
    kid = install(case, root, outside)
    if m.get("generator") == "permission-denied":
        real_open = os.open

        def open_as_unprivileged(path, flags, mode=0o777, *, dir_fd=None):
            target = os.readlink(f"/proc/self/fd/{dir_fd}") + "/" + os.fsdecode(path) if dir_fd is not None else os.fsdecode(path)
            if target.endswith(f"/{kid}/config/resource.txt"):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
            return real_open(path, flags, mode, dir_fd=dir_fd)

        monkeypatch.setattr(os, "open", open_as_unprivileged)
        real_beneath = reader_module.open_beneath

        def beneath_as_unprivileged(dir_fd, path, flags):  # the openat2 path to the same file
            return -errno.EACCES if path == f"{kid}/config/resource.txt" else real_beneath(dir_fd, path, flags)

        monkeypatch.setattr(reader_module, "open_beneath", beneath_as_unprivileged)
    exporter = Exporter(resolve(Settings(scratch_roots=[root], telemetry_source="none")))
    caplog.set_level(logging.INFO)

    before, started = rchar(), time.monotonic()
    stats = exporter.scanner.scan(str(root))
    elapsed, read = time.monotonic() - started, rchar() - before
    assert stats.ok and elapsed < 5, elapsed
    if m.get("generator") == "sparse-1g":
        assert read < 4 << 20, f"read {read} bytes of a 1 GiB file"

    view = exporter.book.view()
    kernel = view.kernels.get(kid)
    expected = set(m["expect"].split("|"))
    state = "absent" if kernel is None else kernel.state.value
    assert state in expected, (state, kernel and kernel.reason)
    if m["reason"]:
        assert m["reason"].lower() in (kernel.reason or "").lower(), kernel.reason

    # The canaries are untouched.
    for ckid, (dev, amount) in CANARIES.items():
        assert view.kernels[ckid].state.value == "ok"
        assert view.alloc_map[dev] == amount
    if "alloc" in m:
        assert view.alloc_map["GPU-h0000000-0000-4000-8000-000000000001"] == m["alloc"]

    # One warning per invalid file, naming the file and the reason; nothing for the others.
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    if state == "invalid":
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        message = warnings[0].getMessage()
        assert f"{kid}/config/resource.txt" in message and m["reason"].lower() in message.lower(), message
    else:
        assert warnings == [], [r.getMessage() for r in warnings]
    exporter.scanner.scan(str(root))  # a rescan of an unchanged tree logs nothing new
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == len(warnings)

    # Everything renders; every label value round-trips exactly through a real parser.
    metrics = get(exporter, "/metrics")
    text = metrics.decode("utf-8")
    labels = labels_in(text)
    view = exporter.book.view()
    assert labels["kernel_id"] >= set(view.kernels)
    devices = {a.device_id for k in view.kernels.values() for a in k.allocations if "." in a.slot}
    assert labels.get("device_id", set()) >= devices
    promtool_check(metrics)
    state_doc = get(exporter, "/api/v1/state")
    alloc_doc = get(exporter, "/api/v1/alloc-map")
    assert {k["kernel_id"] for k in json.loads(state_doc)["kernels"]} == set(view.kernels)
    assert json.loads(alloc_doc) == dict(view.alloc_map)

    secret = m.get("secret")
    if secret:
        logged = "\n".join(r.getMessage() for r in caplog.records)
        for where, blob in (("/metrics", text), ("/api/v1/state", state_doc.decode()), ("/api/v1/alloc-map", alloc_doc.decode()),
                            ("log", logged)):
            assert secret not in blob, f"{secret} leaked into {where}"


def test_the_corpus_is_big_enough() -> None:
    assert len(CASES) >= 40
    assert {meta(c)["expect"].split("|")[0] for c in CASES} >= {"ok", "pending", "invalid", "absent"}


def test_whole_corpus_in_one_real_process(tmp_path: Path) -> None:
    """Every case without a known bug in one scratch root, served by the real process: it starts,
    serves every endpoint, lints clean, leaks no secret (the log included) and stops cleanly."""
    root, outside = tmp_path / "scratch", tmp_path / "outside"
    root.mkdir()
    install_canaries(root)
    expected: dict[str, set[str]] = {}
    for case in CASES:
        m = meta(case)
        if m.get("bug") or m.get("generator") == "permission-denied":  # root reads a mode-000 file
            continue
        kid = install(case, root, outside)
        expected[kid] = set(m["expect"].split("|"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "exporter", "--scratch.root", str(root), "--web.listen-address", "127.0.0.1:0",
         "--telemetry.source", "none", "--log.level", "debug"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace",
    )
    log_lines: list[str] = []
    try:
        deadline = time.monotonic() + 20
        port = None
        while port is None:
            line = proc.stderr.readline()
            assert line and time.monotonic() < deadline, "exporter did not start:\n" + "".join(log_lines)
            log_lines.append(line)
            if found := re.search(r"serving on http://\S+:(\d+)/metrics", line):
                port = int(found.group(1))

        def fetch(path: str) -> bytes:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
                assert r.status == 200
                return r.read()

        metrics, state, alloc = fetch("/metrics"), fetch("/api/v1/state"), fetch("/api/v1/alloc-map")
        promtool_check(metrics)
        labels = labels_in(metrics.decode())
        doc = json.loads(state)
        states = {k["kernel_id"]: k["state"] for k in doc["kernels"]}
        for kid, exp in expected.items():
            assert states.get(kid, "absent") in exp, (kid, states.get(kid))
        assert set(states) <= labels["kernel_id"]
        assert json.loads(alloc)["GPU-canary-a"] == "0.25"
    finally:
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=20)[1]
        log_lines.append(rest)
    assert proc.returncode == 0
    log = "".join(log_lines)
    for blob in (metrics.decode(), state.decode(), alloc.decode(), log):
        assert "HOSTILE-SECRET" not in blob
    assert "Traceback" not in log


# -- fuzzing --------------------------------------------------------------------------------------

HEADER = 'SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={"cpu":"1","cuda.shares":"1"}\n'


def _check_outcome(result, text: str) -> None:
    assert isinstance(result, (ResourceSpec, Pending))
    if isinstance(result, ResourceSpec):
        for a in result.allocations:
            assert a.amount.is_finite() and a.amount >= 0
            # The agent keeps an id as written, a plain space included (" GPU-x" after a comma);
            # any other whitespace or control character makes the file invalid.
            assert a.device_id and not re.search(r"[\x00-\x1f\x7f]|[^\S ]", a.device_id)
        for _, amount in result.requested:
            assert amount.is_finite() and amount >= 0


@settings(max_examples=400, deadline=1000, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=2000))
def test_fuzz_arbitrary_text_never_raises_anything_else(text: str) -> None:
    try:
        result = parse_resource(text, "/s/k/config/resource.txt")
    except ResourceParseError as exc:
        assert str(exc).startswith("/s/k/config/resource.txt") and "\n" not in exc.reason
        return
    _check_outcome(result, text)


@settings(max_examples=300, deadline=1000)
@given(st.binary(max_size=2000))
def test_fuzz_arbitrary_bytes_decoded_leniently(data: bytes) -> None:
    text = data.decode("utf-8", "replace")
    try:
        _check_outcome(parse_resource(HEADER + text, "f"), text)
    except ResourceParseError:
        pass


_HOSTILE_AMOUNTS = st.one_of(
    st.decimals(min_value=0, max_value=10**6, places=4, allow_nan=False, allow_infinity=False).map(str),
    st.sampled_from(["NaN", "-NaN", "sNaN", "Infinity", "-Infinity", "inf", "-1", "-0", "0", "1e3", "8E+1", "1.5g", "4GiB",
                     "", " ", "0x1", "1_0", "½", "٣", "1e-5", "0.000001"]),
    st.text(max_size=8),
)
_DEVICE_IDS = st.one_of(
    st.from_regex(r"GPU-[0-9a-f]{8}", fullmatch=True),
    st.text(alphabet=st.characters(blacklist_characters=",:\n"), min_size=0, max_size=12),
    st.sampled_from(['GPU-"q"', "GPU-\\", "GPU-}{", "MIG-GPU-1/2/0", "日本", "GPU-\u202e"]),
)
_SLOTS = st.sampled_from(["cuda.shares", "cuda.device", "cuda.mem", "rocm.device", "cuda.device:1g.5gb-mig", "x.y", "cpu", "mem"])


@st.composite
def near_valid_files(draw) -> str:
    lines = ["SCRATCH_SIZE=0m", "MOUNTS=" + draw(st.text(alphabet=st.characters(blacklist_characters="\n"), max_size=30))]
    requested = {s: draw(_HOSTILE_AMOUNTS) for s in draw(st.lists(_SLOTS, max_size=4, unique=True))}
    lines.append("SLOTS=" + json.dumps(requested))
    for slot in draw(st.lists(_SLOTS, max_size=4)):
        entries = draw(st.lists(st.tuples(_DEVICE_IDS, _HOSTILE_AMOUNTS), max_size=5))
        lines.append(f"{slot.upper()}_SHARES=" + ",".join(f"{d}:{a}" for d, a in entries))
    if draw(st.booleans()):
        lines.append("CID=" + draw(st.text(alphabet="0123456789abcdef", max_size=64)))
    lines = draw(st.permutations(lines))
    text = "\n".join(lines) + "\n"
    cut = draw(st.one_of(st.none(), st.integers(0, len(text))))  # a writer caught mid-write
    return text if cut is None else text[:cut]


@settings(max_examples=400, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(near_valid_files())
def test_fuzz_near_valid_files_render_and_round_trip(text: str) -> None:
    """Whatever parses must go through the model and the exposition with exact label values."""
    try:
        result = parse_resource(text, "f")
    except ResourceParseError:
        return
    _check_outcome(result, text)
    if not isinstance(result, ResourceSpec):
        return
    from exporter.metrics.allocation import KernelText, allocation_families
    from exporter.metrics.registry import render_families

    book = AllocationBook(clock=lambda: 0.0)
    book.apply("k1", "/r", result)
    book.apply("k2", "/r", result)
    view = book.view()
    # What /metrics serves: the device families and the cached per-kernel text.
    exposition = (render_families(allocation_families(view)) + KernelText().render(view)).decode()
    labels = labels_in(exposition)
    accelerator = {a.device_id for a in result.allocations if "." in a.slot}
    assert labels.get("device_id", set()) >= accelerator
    for device_id, amount in view.alloc_map.items():
        assert Decimal(amount) == 2 * sum((a.amount for a in result.allocations
                                           if a.device_id == device_id and a.slot in ("cuda.shares", "cuda.device")), Decimal(0))


# -- a hostile environment: non-root, read-only, secrets next to the files we read -----------------

SECRETS = ("AKIA-HOSTILE-ENV-SECRET", "hunter2-HOSTILE-ENV-PASSWORD", "HOSTILE-MOUNT-PATH-SECRET", "HOSTILE-DOCKER-CRED")
IN_OPEN = 0x20


class OpenWatch:
    """Report every open() of a file in some directories (inotify IN_OPEN), without a thread."""

    def __init__(self, dirs: list[Path]) -> None:
        import ctypes

        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0
        for d in dirs:
            assert self.libc.inotify_add_watch(self.fd, os.fsencode(d), IN_OPEN) >= 0

    def opened(self) -> list[str]:
        import struct

        names = []
        while True:
            try:
                data = os.read(self.fd, 1 << 20)
            except BlockingIOError:
                return names
            pos = 0
            while pos < len(data):
                _, mask, _, length = struct.unpack_from("iIII", data, pos)
                name = data[pos + 16:pos + 16 + length].rstrip(b"\0").decode()
                pos += 16 + length
                if mask & IN_OPEN and name:
                    names.append(name)

    def close(self) -> None:
        os.close(self.fd)


def _secret_kernel(root: Path, kid: str, amount: str) -> None:
    config = root / kid / "config"
    write(config / "resource.txt", GOOD.format(dev="GPU-nonroot", amount=amount).replace(
        "MOUNTS=", "MOUNTS=/srv/HOSTILE-MOUNT-PATH-SECRET/data:/home/work/data:rw,"))
    write(config / "environ.txt", "BACKENDAI_SESSION_ID=s-1\nAWS_ACCESS_KEY_ID=AKIA-HOSTILE-ENV-SECRET\n"
                                  "DB_PASSWORD=hunter2-HOSTILE-ENV-PASSWORD\n")
    shutil.copy(config / "environ.txt", config / "environ_base.txt")
    write(config / "docker-creds.json", '{"auths": {"r": {"auth": "HOSTILE-DOCKER-CRED"}}}')
    (root / kid / "work").mkdir(exist_ok=True)


def _unprivileged_python(repo: Path) -> tuple[list[str], dict] | None:
    """An interpreter uid 65534 can run with this checkout and its dependencies importable.

    The venv's own interpreter may live under a directory nobody can traverse (e.g. /root/.pyenv), so
    Debian's /usr/bin/python3 (same minor version) with the venv's site-packages on PYTHONPATH is
    tried first.
    """
    import site

    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    env = {"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/nonexistent",
           "PYTHONPATH": os.pathsep.join([str(repo), *site.getsitepackages()])}
    candidates = [p for p in ("/usr/bin/python3",) if os.path.exists(p)] + [os.path.realpath(sys.executable)]
    for python in candidates:
        cmd = [setpriv, "--reuid", "65534", "--regid", "65534", "--clear-groups", "--inh-caps=-all", "--no-new-privs", python]
        probe = subprocess.run([*cmd, "-c", "import sys, exporter.cli, exporter.app, exporter.web.server; print(sys.version_info[:2])"],
                               env=env, capture_output=True, cwd="/", timeout=60, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == str(sys.version_info[:2]):
            return cmd, env
    return None


def _tree_signature(root: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[p] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_uid)
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="runs the exporter as uid 65534 via setpriv, which needs root")
def test_runs_as_nobody_reads_only_and_exports_no_secret() -> None:
    import tempfile

    repo = Path(__file__).resolve().parent.parent
    found = _unprivileged_python(repo)
    if found is None:
        pytest.skip("no interpreter that uid 65534 can run with this checkout importable")
    cmd, env = found
    base = Path(tempfile.mkdtemp(prefix="gpu-alloc-nonroot-", dir="/tmp"))
    proc = None
    watch = None
    try:
        base.chmod(0o755)
        root = base / "scratch"
        for i in range(3):
            _secret_kernel(root, f"kernel-{i}", "0.25")
        _secret_kernel(root, "unreadable-file", "0.5")
        (root / "unreadable-file" / "config" / "resource.txt").chmod(0o000)
        _secret_kernel(root, "unreadable-dir", "0.5")
        (root / "unreadable-dir" / "config").chmod(0o700)
        for dirpath, _dirnames, filenames in os.walk(root):
            if not dirpath.endswith("unreadable-dir/config"):
                os.chmod(dirpath, 0o755)
            for f in filenames:
                p = Path(dirpath, f)
                if p.name != "resource.txt" or "unreadable-file" not in dirpath:
                    p.chmod(0o644)
        before = _tree_signature(root)
        watch = OpenWatch([root / f"kernel-{i}" / "config" for i in range(3)])

        proc = subprocess.Popen([*cmd, "-m", "exporter", "--scratch.root", str(root), "--web.listen-address", "127.0.0.1:0",
                                 "--telemetry.source", "none", "--log.level", "debug"],
                                env=env, cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        log: list[str] = []
        for line in proc.stderr:
            log.append(line)
            if m := re.search(r"serving on http://\S+:(\d+)/metrics", line):
                port = int(m.group(1))
                break
        else:
            raise AssertionError("exporter did not start as uid 65534:\n" + "".join(log))
        status = Path(f"/proc/{proc.pid}/status").read_text()
        assert re.search(r"^Uid:\s+65534\s+65534\s+65534\s+65534$", status, re.M), status
        assert re.search(r"^CapEff:\s+0+$", status, re.M)

        def fetch(path: str) -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
                assert r.status == 200
                return r.read().decode()

        _secret_kernel(root, "kernel-live", "0.25")  # an event while running (written by root)
        for p in (root / "kernel-live").rglob("*"):
            p.chmod(0o755 if p.is_dir() else 0o644)
        (root / "kernel-live").chmod(0o755)
        deadline = time.monotonic() + 10
        while json.loads(fetch("/api/v1/alloc-map")).get("GPU-nonroot") != "1.00" and time.monotonic() < deadline:
            time.sleep(0.02)
        bodies = {p: fetch(p) for p in ("/metrics", "/api/v1/state", "/api/v1/alloc-map", "/", "/-/ready", "/-/healthy")}
        assert json.loads(bodies["/api/v1/alloc-map"]) == {"GPU-nonroot": "1.00"}
        states = {k["kernel_id"]: k for k in json.loads(bodies["/api/v1/state"])["kernels"]}
        for kid in ("unreadable-file", "unreadable-dir"):
            assert states[kid]["state"] == "invalid" and states[kid]["reason"].endswith("permission denied"), states[kid]

        # Read-only: every regular file the process holds open is open read-only.
        for fd in os.listdir(f"/proc/{proc.pid}/fd"):
            try:
                target = os.readlink(f"/proc/{proc.pid}/fd/{fd}")
                flags = int(re.search(r"flags:\s+(\d+)", Path(f"/proc/{proc.pid}/fdinfo/{fd}").read_text()).group(1), 8)
            except (OSError, AttributeError):
                continue
            if target.startswith("/") and os.path.isfile(target):
                assert flags & os.O_ACCMODE == os.O_RDONLY, (target, oct(flags))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            rest = proc.communicate(timeout=20)[1]
            log.append(rest)
        opened = watch.opened() if watch else []
        if watch:
            watch.close()
        after = _tree_signature(root) if base.exists() else {}
        shutil.rmtree(base, ignore_errors=True)
    assert proc.returncode == 0
    logged = "".join(log)
    assert "Traceback" not in logged
    assert sum("permission denied" in line and "unreadable-file/config/resource.txt" in line for line in log) == 1
    for secret in SECRETS:
        for where, blob in [*bodies.items(), ("log", logged)]:
            assert secret not in blob, f"{secret} in {where}"
    # It opened resource.txt (the watch works) and never environ*.txt or the registry credentials.
    assert "resource.txt" in opened and not {"environ.txt", "environ_base.txt", "docker-creds.json"} & set(opened), opened
    # Nothing under the root changed except what this test itself wrote (kernel-live).
    assert {p: v for p, v in after.items() if "kernel-live" not in p} == before


@pytest.mark.skipif(os.geteuid() != 0, reason="runs the exporter as uid 65534 via setpriv, which needs root")
def test_a_zero_flag_start_as_a_service_user_that_cannot_enter_etc_backend_ai_is_one_line_and_exit_2() -> None:
    """The packaged unit runs as an unprivileged user; where /etc/backend.ai is root's alone (0700),
    the default agent.toml is unreachable: one line and exit 2, never a traceback the unit restarts."""
    import tempfile

    repo = Path(__file__).resolve().parent.parent
    found = _unprivileged_python(repo)
    if found is None:
        pytest.skip("no interpreter that uid 65534 can run with this checkout importable")
    cmd, env = found
    base = Path(tempfile.mkdtemp(prefix="gpu-alloc-etc-", dir="/tmp"))
    try:
        base.chmod(0o755)
        etc = base / "backend.ai"
        etc.mkdir(mode=0o700)
        (etc / "agent.toml").write_text('[container]\nscratch-root = "/var/lib/backend.ai/scratches"\n')
        code = f"import sys; from pathlib import Path; from exporter.cli import main; sys.exit(main([], default_agent_config=Path({str(etc / 'agent.toml')!r})))"
        proc = subprocess.run([*cmd, "-c", code], env=env, cwd="/", capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
        assert f"{etc / 'agent.toml'}: cannot be read by uid 65534: Permission denied" in proc.stderr
    finally:
        shutil.rmtree(base, ignore_errors=True)
