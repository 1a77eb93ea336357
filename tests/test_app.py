"""The wiring's own behaviour: what it logs when kernels go stale (once, when it happens), and the
opt-in identity from Docker labels beside recovery.json."""

from __future__ import annotations

import logging
import time
from decimal import Decimal
from pathlib import Path

from docker_fake import FakeDocker, container
from helpers import wait_for

from exporter.analysis.pipeline import STALE_CHECK_SECONDS
from exporter.app import Exporter
from exporter.config import resolve
from exporter.demo import write_kernel, write_recovery
from exporter.settings import Settings
from exporter.telemetry.model import NullSource

LIVE, GONE = "a1" * 32, "b2" * 32


def test_stale_kernels_leaving_the_figures_is_logged_once(tmp_path: Path, caplog) -> None:
    root, cgroup = tmp_path / "scratches", tmp_path / "cgroup"
    write_kernel(root, "k-live", {"cuda.shares": {"GPU-a": Decimal("0.5")}}, container_id=LIVE)
    write_kernel(root, "k-gone", {"cuda.shares": {"GPU-a": Decimal("0.25")}}, container_id=GONE)
    (cgroup / "system.slice" / f"docker-{LIVE}.scope").mkdir(parents=True)
    (cgroup / "cgroup.controllers").write_text("cpu memory pids\n")
    settings = Settings.load({"scratch_roots": [str(root)], "path_cgroupfs": str(cgroup), "stale_grace": 0,
                              "telemetry_source": "none", "telemetry_interval": 3600})
    now = [1000.0]
    exporter = Exporter(resolve(settings), clock=lambda: now[0], monotonic=lambda: now[0], telemetry=NullSource())
    caplog.set_level(logging.INFO, logger="exporter.analysis.pipeline")
    exporter.start()
    try:
        now[0] += 600
        exporter.pipeline.step()
        lines = [r.getMessage() for r in caplog.records if "stale" in r.getMessage()]
        assert lines == ["1 kernel(s) stale, their allocations left out of the allocated and headroom figures: k-gone (container-gone)"]
        for _ in range(3):  # judged again and again: said once
            now[0] += STALE_CHECK_SECONDS
            exporter.pipeline.step()
        assert len([r for r in caplog.records if "stale" in r.getMessage()]) == 1
        (cgroup / "system.slice" / f"docker-{GONE}.scope").mkdir()  # the container is back
        now[0] += STALE_CHECK_SECONDS
        exporter.pipeline.step()
        assert caplog.records[-1].getMessage() == "1 kernel(s) live again, their allocations counted again: k-gone (container-running)"
    finally:
        exporter.close()


def test_docker_labels_name_kernels_without_recovery_json_and_recovery_json_wins(tmp_path: Path, caplog) -> None:
    root = tmp_path / "scratches"
    old, new = "3f6c2b1e-8a4d-4c2e-9b7a-1d2e3f4a5b6c", "9e1d7c3a-2b4f-4a6e-8d5c-7f0a1b2c3d4e"
    label_sid, file_sid = "b0a4e7c2-5d1f-4e6a-8c3b-2f9d7e1a6b4c", "4c8e2a6f-1b3d-4f5a-9e7c-0d2b4f6a8c1e"
    for kid in (old, new):
        write_kernel(root, kid, {"cuda.shares": {"GPU-a": Decimal("0.5")}}, container_id=LIVE)
    write_recovery(root, new, file_sid, None)  # a 25.18+ kernel: its file wins over its labels
    docker = FakeDocker(tmp_path / "docker.sock", [container(old, label_sid), container(new, label_sid)])
    settings = Settings.load({"scratch_roots": [str(root)], "telemetry_source": "none", "telemetry_interval": 3600,
                              "identity_docker_socket": str(docker.path), "identity_docker_interval": 0.05})
    exporter = Exporter(resolve(settings), telemetry=NullSource())
    caplog.set_level(logging.INFO, logger="exporter.app")
    exporter.start()
    try:
        # Readiness never waits on this opt-in source; its first read follows at once.
        wait_for(lambda: exporter.book.view().kernels[old].identity is not None, timeout=5)
        kernels = exporter.book.view().kernels
        assert kernels[old].identity.session_id == label_sid
        assert kernels[new].identity.session_id == file_sid
        wait_for(lambda: 'gpu_alloc_collector_success{collector="docker-labels"} 1.0' in exporter.collector.render().decode(),
                 timeout=5)
        docker.close()  # the daemon goes away: a metric and one log line, the identities stay
        wait_for(lambda: 'collector="docker-labels"} 0.0' in exporter.collector.render().decode(), timeout=5)
        time.sleep(0.2)  # several more failed reads
        assert exporter.book.view().kernels[old].identity.session_id == label_sid
        said = [r.getMessage() for r in caplog.records if "Docker labels" in r.getMessage()]
        # One line, whichever way the read in flight failed (refused, or cut mid-answer).
        assert len(said) == 1 and said[0].startswith(f"kernel identity from Docker labels: {docker.path}: "), said
        assert said[0].endswith("; kernels keep the identity they have")
    finally:
        exporter.close()
        docker.close()


def test_the_mmap_threshold_is_pinned_unless_the_operator_set_one(monkeypatch) -> None:
    """glibc's raise of the threshold is turned off at start (freed expositions go back to the
    system); an operator's MALLOC_MMAP_THRESHOLD_ wins; a C library without mallopt is left alone."""
    from types import SimpleNamespace

    import exporter.app as app

    calls = []
    libc = SimpleNamespace(mallopt=lambda param, value: calls.append((param, value)))
    monkeypatch.setattr(app, "ctypes", SimpleNamespace(CDLL=lambda name: libc))
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    app._pin_mmap_threshold()
    assert calls == [(-3, 128 * 1024)]  # M_MMAP_THRESHOLD at glibc's initial value
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    app._pin_mmap_threshold()
    assert len(calls) == 1
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setattr(app, "ctypes", SimpleNamespace(CDLL=lambda name: SimpleNamespace()))
    app._pin_mmap_threshold()  # no mallopt (macOS): nothing to do


def test_a_docker_socket_missing_from_the_start_is_said_once(tmp_path: Path, caplog) -> None:
    root = tmp_path / "scratches"
    write_kernel(root, "k1", {"cuda.shares": {"GPU-a": Decimal("0.5")}}, container_id=LIVE)
    settings = Settings.load({"scratch_roots": [str(root)], "telemetry_source": "none", "telemetry_interval": 3600,
                              "identity_docker_socket": str(tmp_path / "absent.sock"), "identity_docker_interval": 0.02})
    exporter = Exporter(resolve(settings), telemetry=NullSource())
    caplog.set_level(logging.INFO, logger="exporter.app")
    exporter.start()
    try:
        assert 'gpu_alloc_collector_success{collector="docker-labels"} 0.0' in exporter.collector.render().decode()
        wait_for(lambda: any("Docker labels" in r.getMessage() for r in caplog.records), timeout=5)
        time.sleep(0.2)  # about ten more failed reads
        said = [r.getMessage() for r in caplog.records if "Docker labels" in r.getMessage()]
        assert said == [f"kernel identity from Docker labels: {tmp_path / 'absent.sock'}: no socket there; "
                        "kernels keep the identity they have"]
    finally:
        exporter.close()


def test_the_start_pauses_the_cyclic_collector_and_hands_the_metrics_to_the_analysis_thread(tmp_path: Path, monkeypatch) -> None:
    import gc
    import sys

    write_kernel(tmp_path, "k1", {"cuda.shares": {"GPU-a": Decimal("0.5")}})
    enabled_during_scan = []
    exporter = Exporter(resolve(Settings(scratch_roots=[tmp_path], telemetry_source="none", telemetry_interval=3600)))
    real_scan = exporter.scanner.scan
    monkeypatch.setattr(exporter.scanner, "scan", lambda *a, **kw: enabled_during_scan.append(gc.isenabled()) or real_scan(*a, **kw))
    assert gc.isenabled()
    exporter.start()
    try:
        assert enabled_during_scan[0] is False and gc.isenabled()  # paused for the first scan, then back
        # The collector (and prometheus_client with it) is built by the analysis thread, not the start.
        wait_for(lambda: exporter.exposition._collector is not None)
        assert "prometheus_client" in sys.modules and b"gpu_alloc_kernel_info" in exporter.render()
    finally:
        exporter.close()


# What a start must not load before readiness: each costs tens of ms (or MiB) of a start that must
# stay under 1 s at 10,000 kernels, and none is needed before the first scrape. prometheus_client
# and the renderer load on the analysis thread right after readiness; the others only when used.
NOT_BEFORE_READY = (
    "prometheus_client",  # the collector is built after readiness
    "orjson",  # the first render of the ledger's counters
    "isal",  # the first compressed render
    "exporter.metrics.registry",
    "exporter.metrics.headroom",  # every collector's module: only to build its part, or its --collector.* flags
    "exporter.metrics.health",
    "pydantic",  # only with --web.config.file
    "yaml",  # only with a YAML config file or MIG geometries
    "tomllib",  # only with a TOML file
    "http.client",  # only with --identity.docker-socket
    "exporter.telemetry.nvml.simulated",  # only with mock devices or the demo
    "pynvml",  # only where NVML is asked for
    "multiprocessing",  # the start's helper process is a plain fork
)


def test_nothing_on_the_list_is_imported_before_readiness(tmp_path: Path) -> None:
    import subprocess
    import sys

    write_kernel(tmp_path, "k1", {"cuda.shares": {"GPU-a": Decimal("0.5")}})
    code = f"""
import sys
from pathlib import Path
from exporter.app import Exporter
from exporter.config import resolve
from exporter.settings import Settings
exporter = Exporter(resolve(Settings(scratch_roots=[Path({str(tmp_path)!r})], telemetry_source="none")))
exporter.pipeline.start = lambda first=None, counted=None, used=None: None  # the threads that build the collector and count after readiness
exporter.start()
assert exporter.ready
print(" ".join(sorted(sys.modules)))
exporter.close()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    loaded = set(out.split())
    assert "exporter.analysis.pipeline" in loaded  # the check sees the start's own modules
    assert not [m for m in NOT_BEFORE_READY if m in loaded]
