"""Fleet benchmark: one zone Prometheus over N simulated gpu-alloc nodes, with the project's rules.

    nice .venv/bin/python bench/fleet.py --nodes 1000 --work /tmp/fleet-bench --json fleet-1000.json

What it does (Debian's Prometheus 2.42 and promtool; nothing else):

1. Builds N node expositions with the exporter's own metric names and label sets (those of
   tests/golden/*.prom): a mix of fractional-GPU, whole-GPU and MIG nodes with 8 GPUs each,
   kernels per node drawn around ``--kernels`` (mean 58), process attribution on (per kernel and
   device: allocation, memory, utilisation, processes, idle and no-process time, isolation flag),
   9 throttle reasons per GPU, and the fleet what-if families for the default request shapes
   (remaining totals, requests, placeable or refused per fragmentation mode).
   ``--switches`` reports what each proposed cardinality switch saves.
2. Serves them from one in-process HTTP server as N scrape targets and runs a zone Prometheus
   (``deploy/prometheus/prometheus.yml``'s settings: 15 s scrape and evaluation, both rule files)
   until every rule group has evaluated ``--cycles`` times; reports each group's evaluation time
   (median and maximum over the cycles, and the first evaluation) from ``/api/v1/rules``.
3. Reads ``/federate`` with the ``match[]`` of ``deploy/prometheus/federation.yml``: series per
   node, bytes and time per federation scrape.
4. Backfills ``--history`` (3 h) of the federated recorded series for every node, and of the raw
   series of a few nodes (``promtool tsdb create-blocks-from openmetrics``; the values are the live
   ones, held constant), so the dashboards' range queries read a full history.
5. Times each dashboard as Grafana sends it: variables via ``/api/v1/label/<name>/values``, targets
   marked instant as ``/api/v1/query``, the rest as ``/api/v1/query_range`` over the history with
   ``step`` from the panel's width; ``$__rate_interval`` = 4 × 15 s; ``All`` = ``.*``. The fleet
   dashboard with every variable at All, the node dashboard for one node, the kernel dashboard
   as an alert link opens it (one node, one kernel). Wall time with 6 queries in flight (a
   browser's connection limit) and the sum of the single query times, medians of ``--repeat``.

Values are static, so the figures are the cost of the series counts and label sets, not of churn.
``--rules-only`` stops after steps 2 and 3 (no history, no dashboards) and prints the targets
that concern them. ``--fleet-only`` times the fleet rules alone (``alerts/gpu-alloc-fleet.rules.yml``
over only the series they read, while ingesting): their own cost, apart from the other groups'.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO))
import monitoring_checks as mc  # noqa: E402

from exporter.analysis.shapes import DEFAULT_SHAPES  # noqa: E402

THROTTLE_REASONS = ["gpu_idle", "applications_clocks_setting", "sw_power_cap", "hw_slowdown", "sync_boost",
                    "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "display_clock_setting"]
ALERTING_REASONS = {"sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"}
MIG_LAYOUT = [("3g.40gb", 3), ("2g.20gb", 2), ("1g.10gb", 1), ("1g.10gb", 1)]  # one A100-80GB in MIG mode: 4 instances
SCRAPE = 15.0


@dataclass(frozen=True)
class Switches:
    """Exporter-side cardinality switches (proposed; see BENCHMARKS.md "Fleet")."""

    attribution: str = "per-device"  # per-device (today) | per-kernel (device_id dropped) | off
    throttle: str = "all"  # all (today: 9 reasons) | alerting (the 5 the rules read) | active (only while 1)
    breach: str = "always"  # always (today: 0 or 1) | active (only while 1)


@dataclass
class Node:
    name: str
    kind: str
    text: bytes = b""
    series: int = 0
    kernels: list[str] = field(default_factory=list)


def _s(name: str, labels: dict[str, str], value: float, out: list[str]) -> None:
    body = ",".join(f'{k}="{v}"' for k, v in labels.items())
    out.append(f"{name}{{{body}}} {value:.6g}" if body else f"{name} {value:.6g}")


def render_node(i: int, rng: random.Random, mean_kernels: int, sw: Switches) -> Node:
    """One node's exposition (text 0.0.4 samples only; Prometheus needs no HELP/TYPE to ingest)."""
    kind = rng.choices(["fgpu", "whole", "mig"], weights=[5, 3, 2])[0]
    node = Node(f"gpu-{i:05d}:19402", kind)
    out: list[str] = []
    gpus = [f"GPU-{uuid.UUID(int=rng.getrandbits(128), version=4)}" for _ in range(8)]
    agent = f"i-gpu-{i:05d}"
    _s("gpu_alloc_build_info", {"agent_id": agent, "python_version": "3.11.7", "version": "0.1.0"}, 1, out)
    _s("gpu_alloc_driver_info", {"cuda_version": "12.4", "driver_version": "550.54.15"}, 1, out)
    _s("gpu_alloc_driver_devices", {}, 8, out)
    for c in ("scratch", "nvml", "attribution"):
        _s("gpu_alloc_collector_success", {"collector": c}, 1, out)
        _s("gpu_alloc_collector_duration_seconds", {"collector": c}, 0.01, out)
    _s("gpu_alloc_collector_last_success_timestamp_seconds", {"collector": "nvml"}, time.time(), out)
    for m, v in (("gpu_alloc_watcher_up", 1), ("gpu_alloc_watcher_degraded", 0), ("gpu_alloc_watcher_watches", 60),
                 ("gpu_alloc_watcher_events_total", 100), ("gpu_alloc_watcher_rescans_total", 10), ("gpu_alloc_watcher_overflows_total", 0),
                 ("gpu_alloc_watcher_errors_total", 0), ("gpu_alloc_resource_parse_errors_total", 0), ("gpu_alloc_cgroup_visible", 1)):
        _s(m, {}, v, out)
    _s("gpu_alloc_scratch_root_up", {"scratch_root": "/var/lib/backend.ai/scratches"}, 1, out)
    # Devices the kernels are allocated on: whole GPUs, or MIG devices of the MIG GPUs.
    slots: dict[str, list[tuple[str, float]]] = {}  # slot -> [(device, capacity)]
    migs = []
    for g, gpu in enumerate(gpus):
        mig_on = kind == "mig" and g < 4
        _s("gpu_alloc_device_info", {"device_id": gpu, "index": str(g), "model": "NVIDIA A100-SXM4-80GB", "numa_node": str(g // 4),
                                     "pci_bus_id": f"00000000:{g:02x}:00.0", "serial": f"15639200{i:05d}{g}", "uuid": gpu}, 1, out)
        for m, v in (("gpu_alloc_device_up", 1), ("gpu_alloc_device_temperature_celsius", rng.randint(35, 80)),
                     ("gpu_alloc_device_power_watts", rng.randint(60, 400)), ("gpu_alloc_device_power_limit_watts", 400),
                     ("gpu_alloc_device_energy_joules_total", rng.randint(1, 10**9)), ("gpu_alloc_device_memory_used_bytes", rng.randint(1, 80) * 1e9),
                     ("gpu_alloc_device_memory_total_bytes", 80e9), ("gpu_alloc_device_memory_reserved_bytes", 5e8),
                     ("gpu_alloc_device_last_update_timestamp_seconds", time.time()), ("gpu_alloc_device_ecc_corrected_errors_total", 0),
                     ("gpu_alloc_device_ecc_uncorrected_errors_total", 0), ("gpu_alloc_device_remapped_rows_pending", 0),
                     ("gpu_alloc_device_remapped_rows_failure", 0), ("gpu_alloc_device_utilization_attributable", 0 if mig_on else 1)):
            _s(m, {"device_id": gpu}, v, out)
        if not mig_on:
            _s("gpu_alloc_device_utilization_ratio", {"device_id": gpu}, rng.random(), out)
            _s("gpu_alloc_device_memory_utilization_ratio", {"device_id": gpu}, rng.random(), out)
        for clock in ("sm", "memory"):
            _s("gpu_alloc_device_clock_hertz", {"clock": clock, "device_id": gpu}, 1.41e9, out)
        for cause in ("correctable", "uncorrectable"):
            _s("gpu_alloc_device_remapped_rows_total", {"cause": cause, "device_id": gpu}, 0, out)
        for state in ("current", "pending"):
            _s("gpu_alloc_device_mig_mode", {"device_id": gpu, "state": state}, 1 if mig_on else 0, out)
        for reason in THROTTLE_REASONS:
            active = 1 if reason == "sw_power_cap" and rng.random() < 0.3 else 0
            if sw.throttle == "alerting" and reason not in ALERTING_REASONS or sw.throttle == "active" and not active:
                continue
            _s("gpu_alloc_device_throttle_active", {"device_id": gpu, "reason": reason}, active, out)
        if mig_on:
            _s("gpu_alloc_device_mig_layout_readable", {"device_id": gpu}, 1, out)
            for n, (profile, size) in enumerate(MIG_LAYOUT):
                mig = f"MIG-{uuid.UUID(int=rng.getrandbits(128), version=4)}"
                migs.append(mig)
                _s("gpu_alloc_mig_device_info", {"ci_id": "0", "device_id": mig, "gi_id": str(n + 1), "parent_device_id": gpu,
                                                 "placement_size": str(size), "placement_start": str(n), "profile": profile, "uuid": mig}, 1, out)
                for m, v in (("gpu_alloc_mig_device_memory_used_bytes", size * 5e9), ("gpu_alloc_mig_device_memory_total_bytes", size * 10e9),
                             ("gpu_alloc_mig_device_multiprocessors", size * 14)):
                    _s(m, {"device_id": mig}, v, out)
                slots.setdefault(f"cuda.device:{profile}-mig", []).append((mig, 1.0))
            for profile in ("1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"):
                _s("gpu_alloc_mig_creatable_instances", {"device_id": gpu, "profile": profile}, 0, out)
        else:
            slots.setdefault("cuda.shares" if kind == "fgpu" else "cuda.device", []).append((gpu, 10.0 if kind == "fgpu" else 1.0))
    # Kernels and what they hold.
    n_kernels = max(1, int(rng.gauss(mean_kernels, mean_kernels / 4)))
    allocated: dict[tuple[str, str], float] = {}
    kernel_lines: list[str] = []
    states = {"ok": 0, "pending": 0, "invalid": 0}
    for _ in range(n_kernels):
        kid = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        node.kernels.append(kid)
        state = "ok" if rng.random() > 0.02 else "pending"
        states[state] += 1
        _s("gpu_alloc_kernel_info", {"kernel_id": kid, "state": state}, 1, kernel_lines)
        slot = rng.choice(list(slots))
        devices = rng.sample(slots[slot], 2 if rng.random() < 0.2 and len(slots[slot]) > 1 else 1)
        idle = rng.choice([0.0, 0.0, 120.0, 5400.0 + rng.random() * 3600])
        for dev, _cap in devices:
            amount = round(rng.choice([0.1, 0.25, 0.5, 1.0]), 2) if slot == "cuda.shares" else 1.0
            allocated[(dev, slot)] = allocated.get((dev, slot), 0.0) + amount
            _s("gpu_alloc_kernel_allocated", {"device_id": dev, "kernel_id": kid, "slot": slot}, amount, kernel_lines)
            if sw.attribution == "per-device":
                labels = {"device_id": dev, "kernel_id": kid}
                _s("gpu_alloc_kernel_memory_used_bytes", labels, rng.randint(1, 20) * 1e9, kernel_lines)
                _s("gpu_alloc_kernel_processes", labels, 1, kernel_lines)
                _s("gpu_alloc_kernel_no_process_seconds", labels, 0, kernel_lines)
                if not dev.startswith("MIG-"):
                    _s("gpu_alloc_kernel_utilization_ratio", labels, 0 if idle else rng.random(), kernel_lines)
                    _s("gpu_alloc_kernel_idle_seconds", labels, idle, kernel_lines)
                if sw.breach == "always":
                    _s("gpu_alloc_kernel_isolation_breach", labels, 0, kernel_lines)
        if sw.attribution == "per-kernel":
            labels = {"kernel_id": kid}
            for m, v in (("gpu_alloc_kernel_memory_used_bytes", rng.randint(1, 20) * 1e9), ("gpu_alloc_kernel_processes", 1),
                         ("gpu_alloc_kernel_no_process_seconds", 0), ("gpu_alloc_kernel_idle_seconds", idle)):
                _s(m, labels, v, kernel_lines)
            if sw.breach == "always":
                _s("gpu_alloc_kernel_isolation_breach", labels, 0, kernel_lines)
    for state, count in states.items():
        _s("gpu_alloc_kernels", {"state": state}, count, out)
    for status, count in (("live", states["ok"]), ("stale", 0), ("unknown", states["pending"])):
        _s("gpu_alloc_kernels_liveness", {"status": status}, count, out)
    _s("gpu_alloc_node_allocated", {"slot": "cpu"}, n_kernels * 2, out)
    _s("gpu_alloc_node_allocated_bytes", {"slot": "mem"}, n_kernels * 8e9, out)
    # Per device and slot: allocation, capacity, free; per slot: headroom and fits.
    for slot, devices in slots.items():
        frees = []
        for dev, cap in devices:
            a = allocated.get((dev, slot), 0.0)
            free = max(cap - a, 0.0)
            frees.append(free)
            labels = {"device_id": dev, "slot": slot}
            _s("gpu_alloc_device_allocated", labels, a, out)
            _s("gpu_alloc_device_capacity", labels, cap, out)
            _s("gpu_alloc_device_free", labels, free, out)
            _s("gpu_alloc_device_overcommitted", labels, 1 if a > cap else 0, out)
            if slot in ("cuda.shares", "cuda.device"):
                _s("gpu_alloc_device_fgpu_allocated", {"device_id": dev}, a, out)
        for frag in ("allowed", "disallowed"):
            _s("gpu_alloc_node_headroom", {"fragmentation": frag, "slot": slot}, max(frees) if frag == "disallowed" else sum(frees), out)
            for req in (("0.5", "1", "2") if slot == "cuda.shares" else ("1",)):
                _s("gpu_alloc_request_fits", {"fragmentation": frag, "request": req, "slot": slot}, int(sum(f // float(req) for f in frees)), out)
        _s("gpu_alloc_node_max_single_device_free", {"slot": slot}, max(frees), out)
        _s("gpu_alloc_node_whole_free_devices", {"slot": slot}, sum(1 for f, (_, c) in zip(frees, devices, strict=True) if f == c), out)
        if slot == "cuda.shares":
            total = sum(frees)
            _s("gpu_alloc_node_fragmentation_ratio", {"slot": slot}, 0 if not total else sum(f for f, (_, c) in zip(frees, devices, strict=True) if f < c) / total, out)
    fleet_series(slots, allocated, out)
    out += kernel_lines
    node.series = len(out)
    node.text = ("\n".join(out) + "\n").encode()
    return node


def fleet_series(slots: dict[str, list[tuple[str, float]]], allocated: dict[tuple[str, str], float], out: list[str]) -> None:
    """The fleet what-if families (exporter/metrics/fleet.py) for the default request shapes: the
    remaining total per slot, each shape's request, and per fragmentation mode whether the node
    places it (allowed: the free total covers it; disallowed: one device's free piece does, the
    shapes being at most one device) or why not."""
    remaining = {slot: sum(cap - allocated.get((dev, slot), 0.0) for dev, cap in devices) for slot, devices in slots.items()}
    for slot, left in sorted(remaining.items()):
        _s("gpu_alloc_node_remaining", {"slot": slot}, left, out)
    for shape in DEFAULT_SHAPES:
        slot, amount = shape.accelerator
        _s("gpu_alloc_shape_request", {"shape": shape.name, "slot": slot}, float(amount), out)
        frees = [max(cap - allocated.get((dev, slot), 0.0), 0.0) for dev, cap in slots.get(slot, [])]
        for frag, room in (("allowed", sum(frees)), ("disallowed", max(frees, default=0.0))):
            reason = ("capacity" if not frees or remaining[slot] < float(amount) else
                      None if room >= float(amount) else "fragmented")
            _s("gpu_alloc_node_request_placeable", {"fragmentation": frag, "shape": shape.name}, int(reason is None), out)
            if reason is not None:
                _s("gpu_alloc_node_request_refused", {"fragmentation": frag, "reason": reason, "shape": shape.name}, 1, out)


def build_fleet(n: int, mean_kernels: int, seed: int, sw: Switches = Switches()) -> list[Node]:
    rng = random.Random(seed)
    return [render_node(i, rng, mean_kernels, sw) for i in range(n)]


# --- engines -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NodeServer:
    """Serves every node's exposition: GET /node/<i>."""

    def __init__(self, nodes: list[Node]) -> None:
        bodies = {f"/node/{i}": n.text for i, n in enumerate(nodes)}

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802
                body = bodies.get(self.path, b"")
                self.send_response(200 if body else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a scrape Prometheus gave up on (timeout under load) resets the connection

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="node-server", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


class Prom:
    def __init__(self, work: Path, config: dict[str, Any]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data = work / "data"
        self.config_path = path = work / "prometheus.yml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log = (work / "prometheus.log").open("w")
        self.proc = subprocess.Popen(["prometheus", f"--config.file={path}", f"--storage.tsdb.path={self.data}",
                                      "--storage.tsdb.retention.time=10y", f"--web.listen-address=127.0.0.1:{self.port}",
                                      "--query.max-samples=200000000", "--log.level=warn"], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not self._ok("/-/ready"):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("prometheus did not start: " + (work / "prometheus.log").read_text()[-2000:])
            time.sleep(0.2)

    def _ok(self, path: str) -> bool:
        try:
            with urllib.request.urlopen(self.url + path, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def get(self, path: str, params: dict[str, Any] | list[tuple[str, str]] | None = None, timeout: float = 300) -> tuple[bytes, float]:
        url = self.url + path + ("?" + urllib.parse.urlencode(params) if params else "")
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body = r.read()
        return body, time.perf_counter() - t0

    def api(self, path: str, params: dict[str, Any] | list[tuple[str, str]] | None = None) -> Any:
        body, _ = self.get("/api/v1/" + path, params)
        doc = json.loads(body)
        if doc.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {doc}")
        return doc["data"]

    def reload(self, config: dict[str, Any]) -> None:
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def zone_config(server_port: int, nodes: list[Node], rule_files: list[Path]) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with the simulated nodes as targets."""
    doc = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    doc.pop("alerting", None)
    doc["rule_files"] = [str(p) for p in rule_files]
    doc["scrape_configs"] = [{
        "job_name": "bench-gpu-nodes",
        "static_configs": [{"targets": [f"127.0.0.1:{server_port}"], "labels": {"__metrics_path__": f"/node/{i}", "node": n.name}}
                           for i, n in enumerate(nodes)],
        "relabel_configs": [{"source_labels": ["node"], "target_label": "instance"}, {"regex": "node", "action": "labeldrop"}],
    }]
    return doc


# --- measurements ------------------------------------------------------------------------------


def rule_group_times(prom: Prom, cycles: int, timeout: float, after: str = "",
                     rule_files: tuple[Path, ...] = mc.RULE_FILES) -> dict[str, dict[str, Any]]:
    """Per rule group: every distinct evaluation's duration (s) until each group has ``cycles``
    (evaluations that started after the RFC 3339 time ``after`` only)."""
    seen: dict[str, dict[str, float]] = {}
    intervals: dict[str, float] = {}
    expected = {g["name"] for p in rule_files for g in yaml.safe_load(p.read_text())["groups"]}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for g in prom.api("rules")["groups"]:
            if g.get("lastEvaluation", "").startswith("0001") or g["lastEvaluation"] <= after:
                continue
            seen.setdefault(g["name"], {})[g["lastEvaluation"]] = g["evaluationTime"]
            intervals[g["name"]] = g["interval"]
        if len(seen) == len(expected) and all(len(v) >= cycles for v in seen.values()):
            break
        time.sleep(2)
    slow = sorted(((r["evaluationTime"], r["name"], g["name"]) for g in prom.api("rules")["groups"] for r in g["rules"]), reverse=True)[:6]
    out: dict[str, Any] = {"_slowest_rules": [{"rule": n, "group": gn, "seconds": round(t, 3)} for t, n, gn in slow]}
    for name, evals in seen.items():
        times = [evals[k] for k in sorted(evals)]
        out[name] = {"interval_s": intervals[name], "evaluations": len(times), "first_s": round(times[0], 3),
                     "median_s": round(statistics.median(times), 3), "max_s": round(max(times), 3),
                     "median_share_of_interval": round(statistics.median(times) / intervals[name], 4)}
    return out


def federation_matchers() -> list[str]:
    doc = yaml.safe_load((REPO / "deploy" / "prometheus" / "federation.yml").read_text())
    return doc["scrape_configs"][0]["params"]["match[]"]


def federate(prom: Prom) -> tuple[bytes, float]:
    return prom.get("/federate", [("match[]", m) for m in federation_matchers()])


def parse_federate(body: bytes) -> list[tuple[str, str, float]]:
    """(name, label text, value) per series of a /federate text body."""
    out = []
    for line in body.decode().splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([^{ ]+)(\{.*\})? (\S+)", line)
        if m:
            out.append((m.group(1), m.group(2) or "{}", float(m.group(3))))
    return out


def backfill(prom: Prom, work: Path, series: list[tuple[str, str]], values: list[float], start: float, end: float,
             step: float, name: str) -> float:
    """Write ``series`` (name, label text) with constant ``values`` from start to end as OpenMetrics,
    turn it into blocks with promtool and move them into the running Prometheus' data directory."""
    om = work / f"{name}.om"
    t0 = time.perf_counter()
    stamps = [start + k * step for k in range(int((end - start) // step))]
    with om.open("w") as f:
        for (metric, labels), value in zip(series, values, strict=True):
            # OpenMetrics wants a family's samples together, time-ascending, integer-free floats ok.
            prefix = f"{metric}{labels} {value!r} "
            f.write("".join(f"{prefix}{ts:.0f}\n" for ts in stamps))
        f.write("# EOF\n")
    out = work / f"{name}-blocks"
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", "--max-block-duration=24h", str(om), str(out)],
                   check=True, capture_output=True, timeout=3600)
    om.unlink()
    for block in out.iterdir():
        if block.is_dir():
            shutil.move(str(block), prom.data / block.name)
    return time.perf_counter() - t0


def _round_interval(seconds: float) -> float:
    """Grafana's roundInterval (public/app/core/utils/kbn.ts), in seconds."""
    for limit, value in ((0.015, 0.01), (0.035, 0.02), (0.075, 0.05), (0.15, 0.1), (0.35, 0.2), (0.75, 0.5), (1.5, 1), (3.5, 2),
                         (7.5, 5), (12.5, 10), (17.5, 15), (25, 20), (45, 30), (90, 60), (210, 120), (450, 300), (750, 600),
                         (1050, 900), (1500, 1200), (2700, 1800), (5400, 3600), (9000, 7200), (16200, 10800), (32400, 21600)):
        if seconds < limit:
            return value
    return 43200


@dataclass
class Request:
    what: str
    path: str
    params: dict[str, str]


def dashboard_requests(doc: dict[str, Any], values: dict[str, str], now: float, range_s: float) -> list[Request]:
    """The HTTP requests Grafana's Prometheus data source sends to load ``doc`` (variables first)."""
    reqs = []
    start = now - range_s
    for v in doc["templating"]["list"]:
        if v.get("type") != "query":
            continue
        selector = mc.label_values_metric(v["query"])
        if v["query"].lstrip().startswith("query_result("):  # an instant query
            reqs.append(Request(f"variable {v['name']}", "/api/v1/query", {"query": mc.substitute_vars(selector, values), "time": f"{now:.0f}"}))
            continue
        label = re.match(r".*,\s*(\w+)\s*\)\s*$", v["query"], re.S).group(1)
        reqs.append(Request(f"variable {v['name']}", f"/api/v1/label/{label}/values",
                            {"match[]": mc.substitute_vars(selector, values), "start": f"{start:.0f}", "end": f"{now:.0f}"}))
    rate = {"__rate_interval": f"{int(4 * SCRAPE)}s"}
    for p in mc.iter_panels(doc):
        width_px = p.get("gridPos", {}).get("w", 12) / 24 * 1800
        step = max(_round_interval(range_s / width_px), SCRAPE)
        for t in p.get("targets", []) or []:
            expr = mc.substitute_vars(t["expr"], {**values, **rate, "__interval": f"{int(step)}s"})
            if t.get("instant"):
                reqs.append(Request(f"{p['title']} {t['refId']}", "/api/v1/query", {"query": expr, "time": f"{now:.0f}"}))
            else:
                reqs.append(Request(f"{p['title']} {t['refId']}", "/api/v1/query_range",
                                    {"query": expr, "start": f"{start:.0f}", "end": f"{now:.0f}", "step": f"{step:g}"}))
    return reqs


def time_dashboard(prom: Prom, reqs: list[Request], repeat: int, parallel: int = 6) -> dict[str, Any]:
    def one(r: Request) -> float:
        body, dt = prom.get(r.path, r.params)
        doc = json.loads(body)
        if doc.get("status") != "success":
            raise RuntimeError(f"{r.what}: {doc}")
        return dt

    walls, sums, slowest = [], [], {}
    with ThreadPoolExecutor(parallel) as pool:
        for _ in range(repeat):
            t0 = time.perf_counter()
            times = list(pool.map(one, reqs))
            walls.append(time.perf_counter() - t0)
            sums.append(sum(times))
            for r, dt in zip(reqs, times, strict=True):
                slowest.setdefault(r.what, []).append(dt)
    top = sorted(((statistics.median(v), k) for k, v in slowest.items()), reverse=True)[:3]
    return {"requests": len(reqs), "wall_s": round(statistics.median(walls), 3), "sum_s": round(statistics.median(sums), 3),
            "slowest": [{"query": k, "median_s": round(v, 3)} for v, k in top]}


def switch_costs(n: int, mean_kernels: int, seed: int) -> list[dict[str, Any]]:
    variants = [("today", Switches()), ("attribution per kernel", Switches(attribution="per-kernel")),
                ("attribution off", Switches(attribution="off")), ("throttle: alerting reasons", Switches(throttle="alerting")),
                ("throttle: active only", Switches(throttle="active")), ("isolation_breach: only while 1", Switches(breach="active")),
                ("all three (per kernel, active throttles, breaches while 1)", Switches("per-kernel", "active", "active"))]
    base = None
    out = []
    for name, sw in variants:
        nodes = build_fleet(n, mean_kernels, seed, sw)
        per_node = sum(x.series for x in nodes) / n
        base = base or per_node
        out.append({"switch": name, "series_per_node": round(per_node, 1), "saved_per_node": round(base - per_node, 1),
                    "bytes_per_node": round(sum(len(x.text) for x in nodes) / n)})
    return out


TARGETS = (  # at 1,000 nodes in one zone, 15 s
    ("every rule group evaluates in under 25 % of its interval", lambda r: max(g["median_share_of_interval"] for g in r["rule_groups"].values()) < 0.25,
     lambda r: "worst median {:.1%} ({}), worst single evaluation {:.1%}".format(
         *max((g["median_share_of_interval"], n) for n, g in r["rule_groups"].items()),
         max(g["max_s"] / g["interval_s"] for g in r["rule_groups"].values()))),
    ("federated series per node <= 50", lambda r: r["federation"]["series_per_node"] <= 50,
     lambda r: f"{r['federation']['series_per_node']} ({r['federation']['per_node_series_per_node']} per-node + zone-level)"),
    ("fleet dashboard <= 1 s", lambda r: r["dashboards"]["fleet (all nodes)"]["wall_s"] <= 1,
     lambda r: f"{r['dashboards']['fleet (all nodes)']['wall_s']} s"),
    ("kernel dashboard opened from an alert <= 0.5 s", lambda r: r["dashboards"]["kernel (from an alert link)"]["wall_s"] <= 0.5,
     lambda r: f"{r['dashboards']['kernel (from an alert link)']['wall_s']} s"),
)


def render_markdown(runs: list[dict[str, Any]], command: str) -> str:
    """BENCHMARKS.md's "Fleet" section from one or more runs (different node counts)."""
    runs = sorted(runs, key=lambda r: r["nodes"])
    big = runs[-1]
    lines = ["## Fleet", "",
             f"`{command}` ({big['prometheus']}; one zone, 15 s scrape and evaluation, the rule files of `alerts/`, the fleet",
             "settings of `deploy/prometheus/`). Simulated nodes with the exporter's names and label sets: 8 GPUs each, a mix of",
             "fractional-GPU, whole-GPU and MIG nodes, a mean of 58 kernels per node with process attribution, 9 throttle reasons",
             "per GPU; static values. Rule-group times are Prometheus' own `evaluationTime` (groups run concurrently), median and",
             "maximum over ~3 minutes with ingestion paused (the 2 shared cores otherwise also scrape ~60 k samples/s and compact;",
             "the first evaluation is taken while ingesting); dashboards are loaded as Grafana sends them over",
             f"{big['history_h']:g} h of history (wall time with 6 requests in flight, median of 5 loads; sum of the single",
             "query times in brackets).", ""]
    if big["nodes"] >= 1000:
        lines += ["| target at 1,000 nodes | measured | |", "|---|---|---|"]
        r1000 = next(r for r in runs if r["nodes"] == 1000)
        for name, ok, show in TARGETS:
            lines.append(f"| {name} | {show(r1000)} | {'met' if ok(r1000) else '**missed**'} |")
        lines.append("")
    head = "| | " + " | ".join(f"{r['nodes']:,} nodes" for r in runs) + " |"
    lines += [head, "|---|" + "---|" * len(runs)]

    def row(label: str, f: Any) -> None:
        lines.append(f"| {label} | " + " | ".join(str(f(r)) for r in runs) + " |")

    row("kernels", lambda r: f"{r['kernels']:,}")
    row("series per node (exporter)", lambda r: r["series_per_node"])
    row("zone head series", lambda r: f"{r['head_series']:,}")
    row("zone Prometheus RSS", lambda r: f"{r['prometheus_rss_gib']} GiB")
    row("federated series per node", lambda r: f"{r['federation']['series_per_node']} ({r['federation']['per_node_series_per_node']} per node)")
    row("federated share of the zone", lambda r: f"{r['federation']['share_of_zone']:.1%}")
    row("one /federate: bytes (gzip), time", lambda r: f"{r['federation']['bytes'] / 1e6:.1f} MB ({r['federation']['gzip_bytes'] / 1e3:.0f} KB), {r['federation']['seconds_median']} s")
    for g in big["rule_groups"]:
        row(f"rule group `{g}` ({big['rule_groups'][g]['interval_s']:g} s): median / max (first, ingesting)",
            lambda r, g=g: "{median_s} / {max_s} s".format(**r["rule_groups"][g]) + f" ({r['first_evaluation_while_ingesting_s'].get(g, '-')} s)"
            if g in r["rule_groups"] else "-")
    for d in big["dashboards"]:
        row(f"dashboard {d}: load (sum of queries)", lambda r, d=d: f"{r['dashboards'][d]['wall_s']} s ({r['dashboards'][d]['sum_s']} s)")
    if len(runs) > 1:
        a, b = runs[0], runs[-1]
        dn = b["nodes"] - a["nodes"]
        lines += ["", f"Growth per node between {a['nodes']:,} and {b['nodes']:,} nodes: fleet dashboard "
                  f"{(b['dashboards']['fleet (all nodes)']['wall_s'] - a['dashboards']['fleet (all nodes)']['wall_s']) / dn * 1e3:.3f} ms, "
                  "slowest 15 s rule group "
                  f"{(max(g['median_s'] for g in b['rule_groups'].values() if g['interval_s'] == 15) - max(g['median_s'] for g in a['rule_groups'].values() if g['interval_s'] == 15)) / dn * 1e3:.3f} ms, "
                  f"kernel group {(b['rule_groups']['gpu-alloc-kernel']['median_s'] - a['rule_groups']['gpu-alloc-kernel']['median_s']) / dn * 1e3:.3f} ms."]
    if big.get("slowest_rules"):
        lines += ["", f"Slowest single rules at {big['nodes']:,} nodes: " + ", ".join(
            f"`{x['rule']}` {x['seconds']} s" for x in big["slowest_rules"][:4]) + "."]
    if big.get("switches"):
        lines += ["", "**Cardinality switches** (exporter side, proposed; series per node over the first 200 simulated nodes; the rules work with each):", "",
                  "| switch | series per node | saved per node | exposition bytes per node |", "|---|---|---|---|"]
        for sw in big["switches"]:
            lines.append(f"| {sw['switch']} | {sw['series_per_node']} | {sw['saved_per_node']} | {sw['bytes_per_node']:,} |")
    return "\n".join(lines) + "\n"


def write_benchmarks_section(text: str, path: Path = REPO / "BENCHMARKS.md") -> None:
    """Replace BENCHMARKS.md's "## Fleet" section (up to the next "## " heading), or append it."""
    doc = path.read_text()
    m = re.search(r"^## Fleet\n.*?(?=^## |\Z)", doc, re.S | re.M)
    doc = doc[: m.start()] + text + ("\n" if doc[m.end():] else "") + doc[m.end():] if m else doc.rstrip("\n") + "\n\n" + text
    path.write_text(doc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--kernels", type=int, default=58, help="mean kernels per node")
    ap.add_argument("--history", type=float, default=3.0, help="hours of history for the dashboards' range queries")
    ap.add_argument("--cycles", type=int, default=3, help="evaluations of every rule group to time (within 170 s)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--raw-history-nodes", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--switches", action="store_true", help="also report the series each cardinality switch saves")
    ap.add_argument("--rules-only", action="store_true", help="rule groups and federation only: no history, no dashboards")
    ap.add_argument("--fleet-only", action="store_true", help="only the fleet rules over only the series they read")
    ap.add_argument("--render", type=Path, nargs="+", help="only write BENCHMARKS.md's Fleet section from saved --json files")
    args = ap.parse_args(argv) if not (argv or sys.argv[1:]) or "--render" not in (argv or sys.argv[1:]) else None
    if args is None:
        rp = argparse.ArgumentParser()
        rp.add_argument("--render", type=Path, nargs="+", required=True)
        rp.add_argument("--command", default="nice python bench/fleet.py --nodes N --switches")
        rargs = rp.parse_args(argv)
        write_benchmarks_section(render_markdown([json.loads(p.read_text()) for p in rargs.render], rargs.command))
        return 0

    if args.fleet_only:
        return fleet_only(args)
    result: dict[str, Any] = {"nodes": args.nodes, "mean_kernels": args.kernels, "history_h": args.history,
                              "prometheus": subprocess.run(["prometheus", "--version"], capture_output=True, text=True).stdout.split("\n")[0]}
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    t0 = time.perf_counter()
    nodes = build_fleet(args.nodes, args.kernels, args.seed)
    kernels = sum(len(n.kernels) for n in nodes)
    result["series_per_node"] = round(sum(n.series for n in nodes) / args.nodes, 1)
    result["kernels"] = kernels
    result["exposition_bytes_per_node"] = round(sum(len(n.text) for n in nodes) / args.nodes)
    result["kinds"] = {k: sum(1 for n in nodes if n.kind == k) for k in ("fgpu", "whole", "mig")}
    print(f"built {args.nodes} nodes, {kernels} kernels, {result['series_per_node']} series/node in {time.perf_counter() - t0:.1f}s", flush=True)
    if args.switches:
        result["switches"] = switch_costs(min(args.nodes, 200), args.kernels, args.seed)
        print(json.dumps(result["switches"], indent=1), flush=True)

    server = NodeServer(nodes)
    prom = Prom(args.work, zone_config(server.port, nodes, list(mc.RULE_FILES)))
    try:
        t_start = time.time()
        # Wait for every target's first scrape.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            up = prom.api("query", {"query": "count(up == 1)"})["result"]
            if up and int(float(up[0]["value"][1])) == args.nodes:
                break
            time.sleep(2)
        result["first_scrape_of_all_s"] = round(time.time() - t_start, 1)
        print(f"all {args.nodes} targets scraped after {result['first_scrape_of_all_s']}s", flush=True)
        # The first evaluation of every group, while the zone ingests (and the series are new).
        # Evaluations that started after every target's first scrape (earlier ones saw part of the zone).
        all_up = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        live = rule_group_times(prom, 1, timeout=300, after=all_up)
        result["first_evaluation_while_ingesting_s"] = {n: g["first_s"] for n, g in live.items() if not n.startswith("_")}
        print(f"first evaluations: {result['first_evaluation_while_ingesting_s']}", flush=True)
        head = prom.api("status/tsdb")["headStats"]
        result["head_series"] = head["numSeries"]

        bodies = [federate(prom) for _ in range(3)]
        body, _ = bodies[-1]
        fed = parse_federate(body)
        # Per node: instance:*, instance_slot:*, instance_state:*; per zone: zone_*, job:*, global:*, ALERTS.
        per_node_series = [x for x in fed if x[0].startswith("instance")]
        result["federation"] = {
            "series": len(fed), "series_per_node": round(len(fed) / args.nodes, 1),
            "per_node_series_per_node": round(len(per_node_series) / args.nodes, 1),
            "zone_level_series": len(fed) - len(per_node_series), "bytes": len(body), "gzip_bytes": len(gzip.compress(body)),
            "seconds_median": round(statistics.median(dt for _, dt in bodies), 3),
            "share_of_zone": round(len(fed) / head["numSeries"], 4),
        }
        print(f"federation: {result['federation']}", flush=True)

        result["federation"]["shape_level_series"] = sum(1 for x in fed if x[0].startswith("shape"))
        if args.rules_only:
            frozen = zone_config(server.port, nodes, list(mc.RULE_FILES))
            frozen["scrape_configs"][0]["scrape_interval"] = "1h"
            frozen["scrape_configs"][0]["scrape_timeout"] = "10s"
            after = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(time.time() + 1))
            prom.reload(frozen)
            result["rule_groups"] = rule_group_times(prom, args.cycles, timeout=170, after=after)
            result["slowest_rules"] = result["rule_groups"].pop("_slowest_rules")
            result["fleet_rules"] = fleet_rule_times(prom)
            for name, ok, show in TARGETS[:2]:
                print(f"{name}: {show(result)} ({'met' if ok(result) else 'MISSED'})", flush=True)
            print(f"fleet group: {result['rule_groups'].get('gpu-alloc-fleet')}; rules: {result['fleet_rules']}", flush=True)
            status = Path(f"/proc/{prom.proc.pid}/status").read_text()
            result["prometheus_rss_gib"] = round(int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 2**20, 2)
            return _finish(result, args.json)

        # History: every federated series for the whole range (constant at its live value), and the
        # raw series of a few nodes (the node and kernel dashboards read one node).
        live_from = t_start - 60
        start = live_from - args.history * 3600
        # /federate adds the zone's external labels; the zone's own series have none.
        named = [(name, re.sub(r',?zone="[^"]*"', "", labels).replace("{,", "{")) for name, labels, _ in fed if name != "ALERTS"]
        values = [v for name, _, v in fed if name != "ALERTS"]
        dt = backfill(prom, args.work, named, values, start, live_from, SCRAPE, "recorded")
        raw_series, raw_values = [], []
        for n in nodes[: args.raw_history_nodes]:
            for line in n.text.decode().splitlines():
                m = re.match(r"([^{ ]+)(\{.*\})? (\S+)", line)
                labels = (m.group(2) or "{}")[:-1]
                labels = labels + ("," if len(labels) > 1 else "") + f'instance="{n.name}",job="bench-gpu-nodes"}}'
                raw_series.append((m.group(1), labels))
                raw_values.append(float(m.group(3)))
        order = sorted(range(len(raw_series)), key=lambda k: raw_series[k])
        dt += backfill(prom, args.work, [raw_series[k] for k in order], [raw_values[k] for k in order], start, live_from, SCRAPE, "raw")
        result["backfill_s"] = round(dt, 1)
        probe = f"count(count_over_time(instance:gpu_alloc_fgpu_allocated:sum[5m] @ {start + 1800:.0f}))"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not prom.api("query", {"query": probe})["result"]:
            time.sleep(5)
        print(f"history backfilled in {dt:.0f}s", flush=True)

        # Pause ingestion: scraping 1,000 targets (~60k samples/s) and the backfill share the 2
        # cores with rule evaluation here; on a zone server they run on other cores. With a 1 h
        # scrape interval the series stay queryable for the 5-minute lookback, long enough to
        # time every rule group and the dashboards on exactly the data of the last scrape.
        frozen = zone_config(server.port, nodes, list(mc.RULE_FILES))
        frozen["scrape_configs"][0]["scrape_interval"] = "1h"
        frozen["scrape_configs"][0]["scrape_timeout"] = "10s"
        after = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(time.time() + 1))
        prom.reload(frozen)
        result["rule_groups"] = rule_group_times(prom, args.cycles, timeout=170, after=after)
        result["slowest_rules"] = result["rule_groups"].pop("_slowest_rules")
        print(f"slowest rules: {result['slowest_rules']}", flush=True)
        for name, g in result["rule_groups"].items():
            print(f"  {name}: median {g['median_s']}s max {g['max_s']}s ({g['evaluations']}) of {g['interval_s']}s", flush=True)

        # Dashboards as Grafana loads them.
        now = time.time()
        rng = random.Random(args.seed)
        node = nodes[rng.randrange(args.raw_history_nodes)]
        kernel = node.kernels[0]
        dashboards = {p.stem: json.loads(p.read_text()) for p in sorted((REPO / "dashboards").glob("*.json"))}
        frag = {"fragmentation": "disallowed", "datasource": "prom"}
        views = {
            "fleet (all nodes)": (dashboards["gpu-alloc-fleet"], {"job": ".*", "agent": ".*", "instance": ".*", **frag}),
            "node (one node)": (dashboards["gpu-alloc-node"], {"job": ".*", "agent": ".*", "instance": node.name, **frag}),
            "kernel (from an alert link)": (dashboards["gpu-alloc-kernel"],
                                            {"job": ".*", "agent": ".*", "instance": node.name, "kernel_id": kernel, **frag}),
        }
        result["dashboards"] = {}
        for name, (doc, vals) in views.items():
            reqs = dashboard_requests(doc, vals, now, args.history * 3600)
            result["dashboards"][name] = time_dashboard(prom, reqs, args.repeat)
            print(f"  {name}: {result['dashboards'][name]}", flush=True)
        status = Path(f"/proc/{prom.proc.pid}/status").read_text()
        result["prometheus_rss_gib"] = round(int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 2**20, 2)
    finally:
        prom.stop()
        server.close()
    return _finish(result, args.json)


def _finish(result: dict[str, Any], path: Path | None) -> int:
    if path:
        path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


FLEET_RULES = REPO / "alerts" / "gpu-alloc-fleet.rules.yml"
# What the fleet rules and their alert's annotations read, and what finds the exporters.
FLEET_INPUTS = {"gpu_alloc_build_info", "gpu_alloc_node_remaining", "gpu_alloc_shape_request",
                "gpu_alloc_node_request_placeable", "gpu_alloc_node_request_refused", "gpu_alloc_node_headroom"}


def fleet_only(args: argparse.Namespace) -> int:
    """The fleet rules alone over the fleet series of ``args.nodes`` simulated nodes, timed while
    the zone ingests them (every evaluation after all targets' first scrape, ``args.cycles`` of them)."""
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    nodes = build_fleet(args.nodes, args.kernels, args.seed)
    for n in nodes:
        lines = [line for line in n.text.decode().splitlines() if line.split("{", 1)[0].split(" ", 1)[0] in FLEET_INPUTS]
        n.text, n.series = ("\n".join(lines) + "\n").encode(), len(lines)
    result: dict[str, Any] = {"nodes": args.nodes, "fleet_only": True,
                              "prometheus": subprocess.run(["prometheus", "--version"], capture_output=True, text=True).stdout.split("\n")[0],
                              "series_per_node": round(sum(n.series for n in nodes) / args.nodes, 1)}
    server = NodeServer(nodes)
    prom = Prom(args.work, zone_config(server.port, nodes, [FLEET_RULES]))
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            up = prom.api("query", {"query": "count(up == 1)"})["result"]
            if up and int(float(up[0]["value"][1])) == args.nodes:
                break
            time.sleep(2)
        after = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        groups = rule_group_times(prom, args.cycles, timeout=60 + 16 * args.cycles, after=after, rule_files=(FLEET_RULES,))
        groups.pop("_slowest_rules")
        result["rule_groups"] = groups
        result["fleet_rules"] = fleet_rule_times(prom)
        result["recorded"] = {}  # series count of each recorded result (and the alert), as evaluated
        for q in ("instance_shape:gpu_alloc_node_remaining:after_request", "instance_shape_selector:gpu_alloc_node_remaining:selected",
                  "shape_selector:gpu_alloc_session_failure:predicted", 'ALERTS{alertname="GpuAllocPredictedSessionFailure"}'):
            found = prom.api("query", {"query": f"count({q})"})["result"]
            result["recorded"][q] = int(float(found[0]["value"][1])) if found else 0
    finally:
        prom.stop()
        server.close()
    return _finish(result, args.json)


def fleet_rule_times(prom: Prom) -> list[dict[str, Any]]:
    """The last evaluation time of each rule of the fleet group (``alerts/gpu-alloc-fleet.rules.yml``)."""
    return [{"rule": r["name"], "seconds": round(r["evaluationTime"], 4)}
            for g in prom.api("rules")["groups"] if g["name"] == "gpu-alloc-fleet" for r in g["rules"]]


if __name__ == "__main__":
    sys.exit(main())
