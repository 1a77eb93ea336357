"""Alerts an on-call can trust, as ``promtool test rules`` files generated from data.

* **A quiet node raises nothing for a day.** Nodes whose kernels never change (none, idle,
  busy, with mock telemetry as in tests/golden/mock.prom; busy with NVML-style telemetry and
  every health family) are replayed for 24 h, scraped every 15 s as deploy/prometheus/prometheus.yml
  does, the rules evaluated every minute (every 15 s for the 3 h of the matrix's healthy states).
  Every collector part except the telemetry source keeps the timestamp of its first render, as
  on a node where nothing changes. No alert of any severity fires at any of several times up to
  24 h (every alert name read from the rule files), nor at any evaluation of the day.
* **Every alert both ways** (alerts/tests/matrix.yml, one row per alert): planted in a healthy
  node, its fault fires it within its ``for:`` (plus the window its expression needs, which the
  row states) and two evaluation intervals, with exactly the identity the row names; what the row
  says resolves it does; it stays quiet in the healthy states and near misses the row lists. An
  alert of the rule files without a row fails.
* **Incidents** (alerts/tests/matrix.yml): one fault on a node and every alert it fires there,
  with when each starts; checked here exactly, and replayed through Alertmanager by
  tests/test_alertmanager_e2e.py, which counts the notifications.

The node model below mirrors the exporter's families (names and label names are checked against
the golden expositions), and :func:`values` is the small language the matrix writes series in.
"""

from __future__ import annotations

import functools
import math
import re
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import monitoring_checks as mc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
MATRIX = ROOT / "alerts" / "tests" / "matrix.yml"
STEP = 15  # seconds: scrape and evaluation interval of deploy/prometheus/prometheus.yml
DAY = 86400
JOB = "gpu-nodes-rack7"  # any name: no rule selects a scrape job by name
STATES = ("zero-kernels", "idle-kernels", "busy-kernels")

pytestmark = pytest.mark.tools("promtool")


# --- durations ---------------------------------------------------------------------------------

_DURATION = re.compile(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")


def seconds(text: str | int) -> int:
    """``1h30m`` / ``90s`` / ``0m`` → seconds."""
    if isinstance(text, int):
        return text
    m = _DURATION.fullmatch(str(text).strip())
    if not m or not any(m.groups()):
        raise ValueError(f"not a duration: {text!r}")
    h, mi, s = (int(g or 0) for g in m.groups())
    return 3600 * h + 60 * mi + s


def duration(secs: int) -> str:
    """Seconds → promtool's ``1h2m3s`` (``0s`` for zero)."""
    h, rest = divmod(int(secs), 3600)
    mi, s = divmod(rest, 60)
    return "".join(f"{v}{u}" for v, u in ((h, "h"), (mi, "m"), (s, "s")) if v) or "0s"


# --- series values ----------------------------------------------------------------------------
#
# A series is a list of phases (start second, spec). Specs:
#   a number     the value                 "_"          no sample (the series is not served)
#   "clock"      the sample's time         "hold"       the previous sample's value
#   "onset"      the phase's start time    "elapsed"    seconds since the phase started
#   "step N"     previous value + N once, then constant (a counter that counted N events)
#   "every D"    a counter: +1 every D     "rise R"     a counter: +R per second
#   "sawtooth D" seconds since the last multiple of D (idle seconds of a kernel used every D)

Phases = list[tuple[int, Any]]


def _value(spec: Any, t: int, start: int, prev: float | None) -> float | None:
    if isinstance(spec, bool):
        raise ValueError(f"not a series value: {spec!r}")
    if isinstance(spec, (int, float)):
        return float(spec)
    word, _, arg = str(spec).partition(" ")
    if word == "_":
        return None
    if word == "clock":
        return float(t)
    if word == "hold":
        return prev
    if word == "onset":
        return float(start)
    if word == "elapsed":
        return float(t - start)
    if word == "step":
        return (prev or 0.0) + float(arg) if t == start else prev
    if word == "every":
        period = seconds(arg)
        return (prev or 0.0) + (1.0 if t > start and t % period == 0 else 0.0)
    if word == "rise":
        return (prev or 0.0) + (float(arg) * STEP if t > start else 0.0)
    if word == "sawtooth":
        return float(t % seconds(arg))
    try:
        return float(spec)
    except ValueError:
        raise ValueError(f"not a series value: {spec!r}") from None


def values(phases: Phases, end: int) -> list[float | None]:
    """The samples at 0, STEP, … end of a series given as phases."""
    out: list[float | None] = []
    prev: float | None = None
    ordered = sorted(phases, key=lambda p: p[0])  # stable: a later entry at the same second wins
    if any(s % STEP for s, _ in ordered):
        raise ValueError(f"phases must start on a sample (every {STEP} s): {ordered}")
    for t in range(0, end + 1, STEP):
        start, spec = next(((s, sp) for s, sp in reversed(ordered) if s <= t), (0, "_"))
        prev = _value(spec, t, start, prev)
        out.append(prev)
    return out


def _num(v: float) -> str:
    if v == int(v) and abs(v) < 1e15:
        return str(int(v))
    text = repr(v)
    # promtool's series notation reads "1e+10" as 1e plus 10: write plain decimals.
    return text if "e" not in text else format(v, ".17f").rstrip("0").rstrip(".")


def notation(samples: list[float | None]) -> str:
    """promtool's expanding notation for a list of samples; a series that stops being served gets a
    staleness marker at the next scrape, as Prometheus writes one."""
    out: list[str] = []
    i, n, present = 0, len(samples), False
    while i < n:
        v = samples[i]
        if v is None:
            j = i
            while j < n and samples[j] is None:
                j += 1
            count = j - i
            if present:
                out.append("stale")
                count -= 1
            if count:
                out.append("_" if count == 1 else f"_x{count}")
            present, i = False, j
            continue
        j, d = i, 0.0
        if i + 1 < n and samples[i + 1] is not None:
            d = samples[i + 1] - v
            j = i + 1
            while j + 1 < n and samples[j + 1] is not None and math.isclose(samples[j + 1] - samples[j], d, abs_tol=1e-9):
                j += 1
            if d != 0 and j - i < 2:  # two values are clearer (and exact) written out
                j, d = i, 0.0
        runs = j - i
        if runs == 0:
            out.append(_num(v))
        elif d == 0:
            out.append(f"{_num(v)}x{runs}")
        else:
            out.append(f"{_num(v)}{'+' if d > 0 else '-'}{_num(abs(d))}x{runs}")
        present, i = True, j + 1
    return " ".join(out)


# --- selectors ----------------------------------------------------------------------------------

Labels = tuple[tuple[str, str], ...]
Key = tuple[str, Labels]  # metric name, sorted labels (without job and instance)

_MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*,?')


def key(name: str, **labels: Any) -> Key:
    return name, tuple(sorted((k, str(v)) for k, v in labels.items()))


@dataclass(frozen=True)
class Selector:
    """A series selector of the matrix: ``name{label="v", label=~"re", __name__=~"re"}``."""

    text: str
    matchers: tuple[tuple[str, str, str], ...]

    @classmethod
    def parse(cls, text: str) -> Selector:
        m = re.fullmatch(r"\s*([A-Za-z_:][A-Za-z0-9_:]*)?\s*(?:\{(.*)\})?\s*", text, re.S)
        if not m:
            raise ValueError(f"matrix: not a series selector: {text!r}")
        matchers = [("__name__", "=", m.group(1))] if m.group(1) else []
        body = m.group(2) or ""
        pos = 0
        while pos < len(body):
            mm = _MATCHER.match(body, pos)
            if not mm:
                raise ValueError(f"matrix: cannot read the label matchers of {text!r}")
            matchers.append((mm.group(1), mm.group(2), mm.group(3)))
            pos = mm.end()
        if not any(n == "__name__" for n, _, _ in matchers):
            raise ValueError(f"matrix: {text!r} names no metric")
        return cls(text, tuple(matchers))

    def matches(self, k: Key) -> bool:
        labels = dict(k[1], __name__=k[0])
        for name, op, val in self.matchers:
            got = labels.get(name, "")
            ok = {"=": got == val, "!=": got != val, "=~": re.fullmatch(val, got) is not None,
                  "!~": re.fullmatch(val, got) is None}[op]
            if not ok:
                return False
        return True

    def as_key(self) -> Key:
        """The series this selector names exactly (a new series the fault adds)."""
        if any(op != "=" for _, op, _ in self.matchers):
            raise ValueError(f"matrix: {self.text!r} matches no healthy series and is not an exact series name")
        labels = {n: v for n, _, v in self.matchers if n != "__name__"}
        return key(next(v for n, _, v in self.matchers if n == "__name__"), **labels)


def render_key(k: Key, instance: str) -> str:
    labels = ", ".join(f'{n}="{v}"' for n, v in (("job", JOB), ("instance", instance), *k[1]))
    return f"{k[0]}{{{labels}}}"


# --- the node model -----------------------------------------------------------------------------

GIB = 2**30
MEMORY_TOTAL = 80 * GIB
SHARES_PER_GPU = 10.0  # cuda.shares one GPU holds
AGENT = "i-node01"
SCRATCH_ROOT = "/var/lib/backend.ai/scratches"
THROTTLE_REASONS = ("applications_clocks_setting", "display_clock_setting", "gpu_idle", "hw_power_brake_slowdown",
                    "hw_slowdown", "hw_thermal_slowdown", "sw_power_cap", "sw_thermal_slowdown", "sync_boost")
TELEMETRY_SOURCES = ("nvml", "mock", "none")  # the telemetry part's collector names


def _golden_parts() -> tuple[str, ...]:
    """The exporter's collector parts besides the telemetry source, as the golden files show them
    (build, scratch, watcher, headroom, attribution, accounting, ...)."""
    names: set[str] = set()
    for path in sorted(mc.GOLDEN_DIR.glob("*.prom")):
        names |= set(re.findall(r'^gpu_alloc_collector_success\{collector="([^"]+)"\}', path.read_text(), re.M))
    return tuple(sorted(names - set(TELEMETRY_SOURCES)))


PARTS = _golden_parts()


@dataclass(frozen=True)
class Gpu:
    device_id: str
    index: int
    mig: tuple[str, ...] = ()  # MIG device ids when MIG mode is on


@dataclass(frozen=True)
class Kernel:
    kernel_id: str
    session_id: str
    user_id: str
    device_id: str
    shares: float  # cuda.shares on the device


# The matrix node: four A100s; GPU-1 shared by two sessions, GPU-3 in MIG mode.
MATRIX_GPUS = (Gpu("GPU-0", 0), Gpu("GPU-1", 1), Gpu("GPU-2", 2), Gpu("GPU-3", 3, ("MIG-3a", "MIG-3b")))
MATRIX_KERNELS = (Kernel("k-1", "s-1", "u-1", "GPU-0", 2.5), Kernel("k-2", "s-2", "u-2", "GPU-1", 2.5),
                  Kernel("k-3", "s-3", "u-3", "GPU-1", 5.0))


@dataclass
class Node:
    """One exporter's series as spec phases, for a healthy state."""

    series: dict[Key, Phases] = field(default_factory=dict)

    def set(self, k: Key, spec: Any) -> None:
        self.series[k] = [(0, spec)]


def healthy_node(state: str, gpus: Iterable[Gpu] = MATRIX_GPUS, kernels: Iterable[Kernel] = MATRIX_KERNELS,
                 telemetry: Mapping[Key, Any] | None = None, source: str = "nvml") -> Node:
    """A node where nothing changes. ``state``: zero-kernels (no kernel), idle-kernels (each kernel
    used about every 45 minutes, below the 1 h idle threshold), busy-kernels. ``telemetry``: the
    telemetry families (default: NVML-style ones for ``gpus``)."""
    if state not in STATES:
        raise ValueError(f"unknown healthy state {state!r}; known: {', '.join(STATES)}")
    gpus = tuple(gpus)
    kernels = () if state == "zero-kernels" else tuple(kernels)
    busy = state == "busy-kernels"
    node = Node()
    s = node.set
    s(key("up"), 1)
    s(key("gpu_alloc_build_info", agent_id=AGENT, python_version="3.11.7", version="0.1.0"), 1)
    for part in (*PARTS, source):
        s(key("gpu_alloc_collector_success", collector=part), 1)
        s(key("gpu_alloc_collector_duration_seconds", collector=part), 0.004)
        # A part re-renders when its input changes; on this node only the telemetry source moves.
        s(key("gpu_alloc_collector_last_success_timestamp_seconds", collector=part), "clock" if part == source else 0)
    # watcher: alive, no events on a quiet node, a safety-net rescan every minute
    s(key("gpu_alloc_watcher_up"), 1)
    s(key("gpu_alloc_watcher_degraded"), 0)
    s(key("gpu_alloc_watcher_watches"), 1 + len(kernels))
    s(key("gpu_alloc_watcher_events_total"), 0)
    s(key("gpu_alloc_watcher_overflows_total"), 0)
    s(key("gpu_alloc_watcher_errors_total"), 0)
    s(key("gpu_alloc_watcher_rescans_total"), "every 1m")
    s(key("gpu_alloc_watcher_last_event_timestamp_seconds"), 0)
    # scratch
    s(key("gpu_alloc_scratch_root_up", scratch_root=SCRATCH_ROOT), 1)
    s(key("gpu_alloc_resource_parse_errors_total"), 0)
    for st, n in (("ok", len(kernels)), ("pending", 0), ("invalid", 0)):
        s(key("gpu_alloc_kernels", state=st), n)
    for st, n in (("live", len(kernels)), ("stale", 0), ("unknown", 0)):
        s(key("gpu_alloc_kernels_liveness", status=st), n)
    whole = [g for g in gpus if not g.mig]
    allocated = {g.device_id: sum(k.shares for k in kernels if k.device_id == g.device_id) for g in whole}
    for g in whole:
        d = g.device_id
        s(key("gpu_alloc_device_capacity", device_id=d, slot="cuda.shares"), SHARES_PER_GPU)
        s(key("gpu_alloc_device_free", device_id=d, slot="cuda.shares"), SHARES_PER_GPU - allocated[d])
        s(key("gpu_alloc_device_overcommitted", device_id=d, slot="cuda.shares"), 0)
        if allocated[d]:
            s(key("gpu_alloc_device_allocated", device_id=d, slot="cuda.shares"), allocated[d])
            s(key("gpu_alloc_device_fgpu_allocated", device_id=d), allocated[d])
    for g in gpus:
        for mig in g.mig:
            slot = "cuda.device:1g.10gb-mig"
            s(key("gpu_alloc_device_capacity", device_id=mig, slot=slot), 1)
            s(key("gpu_alloc_device_free", device_id=mig, slot=slot), 1)
            s(key("gpu_alloc_device_overcommitted", device_id=mig, slot=slot), 0)
    for k in kernels:
        alloc_bytes = k.shares / SHARES_PER_GPU * MEMORY_TOTAL
        s(key("gpu_alloc_kernel_info", kernel_id=k.kernel_id, state="ok"), 1)
        s(key("gpu_alloc_kernel_identity_info", agent_id=AGENT, kernel_id=k.kernel_id, project_id="undefined",
              session_id=k.session_id, session_type="interactive", user_id=k.user_id), 1)
        s(key("gpu_alloc_kernel_allocated", device_id=k.device_id, kernel_id=k.kernel_id, slot="cuda.shares"), k.shares)
        s(key("gpu_alloc_kernel_allocated_bytes", device_id=k.device_id, kernel_id=k.kernel_id, slot="cuda.mem"), alloc_bytes)
        s(key("gpu_alloc_kernel_gpu_share_ratio", device_id=k.device_id, kernel_id=k.kernel_id), k.shares / SHARES_PER_GPU)
        # attribution
        pair = {"device_id": k.device_id, "kernel_id": k.kernel_id}
        s(key("gpu_alloc_kernel_processes", **pair), 2 if busy else 1)
        s(key("gpu_alloc_kernel_memory_used_bytes", **pair), (0.5 if busy else 0.125) * alloc_bytes)
        s(key("gpu_alloc_kernel_utilization_ratio", **pair), 0.375 if busy else 0)
        s(key("gpu_alloc_kernel_idle_seconds", **pair), 0 if busy else "sawtooth 45m")
        s(key("gpu_alloc_kernel_no_process_seconds", **pair), 0)
        s(key("gpu_alloc_kernel_isolation_breach", **pair), 0)
        # accounting
        s(key("gpu_alloc_kernel_allocated_gpu_seconds_total", **pair), f"rise {k.shares / SHARES_PER_GPU}")
        s(key("gpu_alloc_kernel_busy_gpu_seconds_total", **pair), f"rise {0.375 * k.shares / SHARES_PER_GPU if busy else 0}")
        s(key("gpu_alloc_kernel_energy_joules_total", **pair), f"rise {60 * k.shares / SHARES_PER_GPU}")
    for g in whole:
        s(key("gpu_alloc_device_utilization_attributable", device_id=g.device_id), 1)
    # the ledger, per GPU and per owner (a quiet node's counters only grow)
    for g in whole:
        held, d = allocated[g.device_id] / SHARES_PER_GPU, {"device_id": g.device_id}
        s(key("gpu_alloc_device_allocated_gpu_seconds_total", **d), f"rise {held}")
        s(key("gpu_alloc_device_unallocated_gpu_seconds_total", **d), f"rise {1 - held}")
        s(key("gpu_alloc_device_busy_gpu_seconds_total", **d), f"rise {0.375 * held if busy else 0}")
        s(key("gpu_alloc_device_busy_measured", **d), 1)
        s(key("gpu_alloc_device_attributed_energy_joules_total", **d), f"rise {60 * held}")
        s(key("gpu_alloc_device_unattributed_energy_joules_total", **d), f"rise {60 * (1 - held)}")
    for user in sorted({k.user_id for k in kernels}):
        mine, owner = sum(k.shares for k in kernels if k.user_id == user) / SHARES_PER_GPU, {"project_id": "undefined", "user_id": user}
        s(key("gpu_alloc_user_allocated_gpu_seconds_total", **owner), f"rise {mine}")
        s(key("gpu_alloc_user_busy_gpu_seconds_total", **owner), f"rise {0.375 * mine if busy else 0}")
        s(key("gpu_alloc_user_energy_joules_total", **owner), f"rise {60 * mine}")
    # headroom
    free = [SHARES_PER_GPU - allocated[g.device_id] for g in whole]
    for frag in ("allowed", "disallowed"):
        s(key("gpu_alloc_node_headroom", fragmentation=frag, slot="cuda.shares"), sum(free) if frag == "allowed" else max(free))
        for request in ("0.5", "1", "4"):
            fits = sum(math.floor(f / float(request)) for f in free)
            s(key("gpu_alloc_request_fits", fragmentation=frag, request=request, slot="cuda.shares"), fits)
    s(key("gpu_alloc_node_max_single_device_free", slot="cuda.shares"), max(free))
    s(key("gpu_alloc_node_fragmentation_ratio", slot="cuda.shares"), round(1 - max(free) / sum(free), 6))
    s(key("gpu_alloc_node_whole_free_devices", slot="cuda.shares"), sum(1 for f in free if f == SHARES_PER_GPU))
    # fleet what-if: what the manager sees and whether the configured shapes would be placed
    s(key("gpu_alloc_node_remaining", slot="cuda.shares"), sum(free))
    # HAMi's node score: 20 x allocated / capacity (docs/headroom.md)
    s(key("gpu_alloc_node_hami_score", slot="cuda.shares"), 20 * (1 - sum(free) / (SHARES_PER_GPU * len(whole))))
    for shape, amount in (("fgpu-1", 1), ("fgpu-4", 4)):
        s(key("gpu_alloc_shape_request", shape=shape, slot="cuda.shares"), amount)
        for frag in ("allowed", "disallowed"):
            s(key("gpu_alloc_node_request_placeable", fragmentation=frag, shape=shape), 1)
    # health: every GPU ok since the exporter started, no ghost memory
    for g in gpus:
        s(key("gpu_alloc_device_health", device_id=g.device_id, state="ok"), 1)
        s(key("gpu_alloc_device_health_since_timestamp_seconds", device_id=g.device_id), 0)
    for g in whole:
        for cause in ("dead_process", "unattributed_process", "ended_kernel"):
            s(key("gpu_alloc_device_ghost_memory_bytes", cause=cause, device_id=g.device_id), 0)
    migs = [m for g in gpus for m in g.mig]
    if migs:
        s(key("gpu_alloc_node_max_single_device_free", slot="cuda.device:1g.10gb-mig"), 1)
        s(key("gpu_alloc_node_whole_free_devices", slot="cuda.device:1g.10gb-mig"), len(migs))
    tele = dict(telemetry) if telemetry is not None else nvml_telemetry(gpus, kernels, busy)
    for k, spec in tele.items():
        s(k, spec)
    return node


def nvml_telemetry(gpus: tuple[Gpu, ...], kernels: tuple[Kernel, ...], busy: bool) -> dict[Key, Any]:
    """NVML-style telemetry of healthy A100s: every health family present and calm, a benign XID
    (13, an application's fault) seen once before."""
    out: dict[Key, Any] = {}
    out[key("gpu_alloc_driver_info", cuda_version="12.4", driver_version="550.54.15")] = 1
    out[key("gpu_alloc_driver_devices")] = len(gpus)
    for g in gpus:
        d = {"device_id": g.device_id}
        used = sum(k.shares / SHARES_PER_GPU * MEMORY_TOTAL * (0.5 if busy else 0.125) for k in kernels if k.device_id == g.device_id)
        working = busy and any(k.device_id == g.device_id for k in kernels)
        out[key("gpu_alloc_device_info", **d, index=g.index, model="NVIDIA A100-SXM4-80GB", numa_node=g.index // 2,
                pci_bus_id=f"00000000:{7 + 8 * g.index:02X}:00.0", serial=f"16523220001{g.index:02d}", uuid=g.device_id)] = 1
        out[key("gpu_alloc_device_up", **d)] = 1
        out[key("gpu_alloc_device_stale", **d)] = 0
        out[key("gpu_alloc_device_last_update_timestamp_seconds", **d)] = "clock"
        out[key("gpu_alloc_device_memory_total_bytes", **d)] = MEMORY_TOTAL
        out[key("gpu_alloc_device_memory_used_bytes", **d)] = GIB // 2 + used
        out[key("gpu_alloc_device_temperature_celsius", **d)] = 62 if working else 34
        out[key("gpu_alloc_device_power_watts", **d)] = 300 if working else 60
        out[key("gpu_alloc_device_power_limit_watts", **d)] = 400
        out[key("gpu_alloc_device_energy_joules_total", **d)] = f"rise {300 if working else 60}"
        out[key("gpu_alloc_device_ecc_uncorrected_errors_total", **d)] = 0
        out[key("gpu_alloc_device_ecc_corrected_errors_total", **d)] = 3  # old, corrected: no alert
        out[key("gpu_alloc_device_remapped_rows_pending", **d)] = 0
        out[key("gpu_alloc_device_remapped_rows_failure", **d)] = 0
        out[key("gpu_alloc_device_retired_pages_pending", **d)] = 0
        for cause in ("correctable", "uncorrectable"):
            out[key("gpu_alloc_device_remapped_rows_total", **d, cause=cause)] = 0
        for reason in THROTTLE_REASONS:
            active = (reason == "sw_power_cap" and working) or (reason == "gpu_idle" and not working)
            out[key("gpu_alloc_device_throttle_active", **d, reason=reason)] = int(active)
        out[key("gpu_alloc_device_mig_mode", **d, state="current")] = int(bool(g.mig))
        out[key("gpu_alloc_device_mig_mode", **d, state="pending")] = int(bool(g.mig))
        if g.mig:
            out[key("gpu_alloc_device_mig_layout_readable", **d)] = 1
            for i, mig in enumerate(g.mig):
                out[key("gpu_alloc_mig_device_info", ci_id=0, device_id=mig, gi_id=i + 1, parent_device_id=g.device_id,
                        placement_size=1, placement_start=i, profile="1g.10gb", uuid=mig)] = 1
                out[key("gpu_alloc_mig_device_memory_total_bytes", device_id=mig)] = 10 * GIB
                out[key("gpu_alloc_mig_device_memory_used_bytes", device_id=mig)] = GIB // 4
        else:
            out[key("gpu_alloc_device_utilization_ratio", **d)] = 0.75 if working else 0
            out[key("gpu_alloc_device_memory_utilization_ratio", **d)] = 0.3 if working else 0
    first = gpus[0].device_id
    out[key("gpu_alloc_xid_errors_total", device_id=first, xid=13)] = 1
    out[key("gpu_alloc_xid_last_seen_timestamp_seconds", device_id=first, xid=13)] = 0
    return out


def golden_telemetry(name: str = "mock.prom") -> tuple[dict[Key, Any], tuple[Gpu, ...], str]:
    """The telemetry part of a golden exposition as it would be served for a day: values as
    recorded, the sampler's timestamps moving with the clock. Returns the series, the GPUs it
    lists (with their MIG devices) and the source's collector name."""
    text = (mc.GOLDEN_DIR / name).read_text()
    out: dict[Key, Any] = {}
    source = ""
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            k = key(sample.name, **sample.labels)
            spec: Any = sample.value
            if sample.name == "gpu_alloc_collector_last_success_timestamp_seconds":
                source = sample.labels["collector"]
                spec = "clock"
            elif sample.name == "gpu_alloc_device_last_update_timestamp_seconds":
                spec = "clock"
            out[k] = spec
    parents: dict[str, list[str]] = {}
    for k in out:
        if k[0] == "gpu_alloc_mig_device_info":
            labels = dict(k[1])
            parents.setdefault(labels["parent_device_id"], []).append(labels["device_id"])
    gpus = tuple(Gpu(dict(k[1])["device_id"], int(dict(k[1])["index"]), tuple(sorted(parents.get(dict(k[1])["device_id"], ()))))
                 for k in out if k[0] == "gpu_alloc_device_info")
    # The registry serves success, duration and timestamp for every part; the telemetry part's
    # own three come from the golden file, the model adds the others.
    out = {k: v for k, v in out.items() if not k[0].startswith("gpu_alloc_collector_")}
    return out, gpus, source


# --- rules ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AlertRule:
    name: str
    file: Path
    group: str
    for_s: int
    interval_s: int  # the group's evaluation interval in production (15 s unless the group sets one)
    severity: str


@functools.cache
def alert_rules() -> dict[str, AlertRule]:
    out = {}
    for path in mc.RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            interval = seconds(group.get("interval", f"{STEP}s"))
            for rule in group["rules"]:
                if "alert" in rule:
                    out[rule["alert"]] = AlertRule(rule["alert"], path, group["name"], seconds(rule.get("for", "0s")),
                                                   interval, rule["labels"]["severity"])
    return out


def rule_copies(dest: Path, keep_alerts: Iterable[str] | None = None, drop: Iterable[str] = ()) -> list[Path]:
    """Copies of the rule files in ``dest``: only ``keep_alerts`` and the recording rules they
    read (transitively), none of ``drop``. promtool evaluates every rule it loads at every step,
    so a test about a few alerts loads only what they need (a row runs in a second, not ten)."""
    rules = mc.load_rules(mc.RULE_FILES)
    keep: set[str] | None = None
    if keep_alerts is not None:
        keep = set(keep_alerts)
        for name in list(keep):
            keep |= {n for n in mc.rule_inputs(rules.alerts[name]["expr"], rules) if n in rules.records}
    dropped = set(drop)
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for path in mc.RULE_FILES:
        doc = yaml.safe_load(path.read_text())
        groups = []
        for group in doc["groups"]:
            group["rules"] = [r for r in group["rules"] if (r.get("record") or r.get("alert")) not in dropped
                              and (keep is None or (r.get("record") or r.get("alert")) in keep)]
            if group["rules"]:
                groups.append(group)
        if groups:
            copy = dest / path.name
            copy.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
            out.append(copy)
    return out


def promtool_file(path: Path, tests: list[dict[str, Any]], rule_files: Iterable[Path] = mc.RULE_FILES,
                  evaluation_interval: int = STEP) -> Path:
    rule_files = list(rule_files)
    # Recording groups first, so alerts read this evaluation's recorded series (Prometheus
    # runs groups concurrently; promtool would pick an arbitrary order).
    order = [g["name"] for f in rule_files for g in yaml.safe_load(f.read_text())["groups"]
             if all("record" in r for r in g["rules"])]
    doc = {"rule_files": [str(p) for p in rule_files], "evaluation_interval": duration(evaluation_interval),
           "group_eval_order": order, "tests": tests}
    path.write_text(yaml.safe_dump(doc, sort_keys=False, width=10_000))
    return path


def run_promtool(path: Path, timeout: int = 300) -> None:
    result = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=timeout)
    out = (result.stdout + result.stderr).strip()
    assert result.returncode == 0, f"promtool test rules {path.name} failed:\n{out[-20000:]}"


def input_series(node: Node, instance: str, end: int) -> list[dict[str, str]]:
    out = []
    for k, phases in sorted(node.series.items()):
        samples = values(phases, end)
        if any(v is not None for v in samples):
            out.append({"series": render_key(k, instance), "values": notation(samples)})
    return out


def alerts_snapshot(instance: str | None, firing: Iterable[tuple[str, Mapping[str, str]]], at: int) -> dict[str, Any]:
    """A promql_expr_test: exactly these alerts fire at ``at`` (label sets as in ALERTS)."""
    rules = alert_rules()
    samples = []
    for name, labels in firing:
        full = {"alertname": name, "alertstate": "firing", "severity": rules[name].severity, **labels}
        body = ", ".join(f'{k}="{v}"' for k, v in sorted(full.items()))
        samples.append({"labels": f"ALERTS{{{body}}}", "value": 1})
    expr = 'ALERTS{alertstate="firing"}' if instance is None else f'ALERTS{{alertstate="firing", instance="{instance}"}}'
    return {"expr": expr, "eval_time": duration(at), "exp_samples": samples}


# --- 1. a quiet node -----------------------------------------------------------------------------

QUIET_EVAL_TIMES = ("5m", "10m", "11m", "15m", "30m", "1h", "2h", "6h", "12h", "18h", "23h", "24h")


def quiet_nodes() -> dict[str, Node]:
    tele, gpus, source = golden_telemetry("mock.prom")
    whole = [g for g in gpus if not g.mig]
    mock_kernels = (Kernel("k-1", "s-1", "u-1", whole[0].device_id, 2.5), Kernel("k-2", "s-2", "u-2", whole[1].device_id, 2.5),
                    Kernel("k-3", "s-3", "u-3", whole[1].device_id, 5.0))
    nodes = {f"mock-{state}:19402": healthy_node(state, gpus, mock_kernels, tele, source) for state in STATES}
    nodes["nvml-busy-kernels:19402"] = healthy_node("busy-kernels")
    return nodes


def test_a_quiet_node_raises_nothing_for_a_day(tmp_path: Path) -> None:
    """Kernels that never change, scraped every 15 s, every shipped rule file loaded: no alert of
    any severity fires at any checkpoint, nor at any evaluation of the day. The rules are
    evaluated every minute here (a day at 15 s takes promtool minutes); the matrix's healthy
    states replay 3 h at the production 15 s."""
    names = sorted(alert_rules())
    assert len(names) == len(mc.load_rules(mc.RULE_FILES).alerts) > 30
    series = [s for inst, node in quiet_nodes().items() for s in input_series(node, inst, DAY)]
    test = {
        "name": "quiet nodes: zero, idle and busy kernels with mock telemetry, busy kernels with NVML; 24 h",
        "interval": f"{STEP}s",
        "input_series": series,
        "alert_rule_test": [{"eval_time": t, "alertname": n, "exp_alerts": []} for t in QUIET_EVAL_TIMES for n in names],
        # An alert that fired at any evaluation of the day leaves a firing ALERTS sample.
        "promql_expr_test": [{"expr": 'count_over_time(ALERTS{alertstate="firing"}[1d1m])', "eval_time": "24h", "exp_samples": []}],
    }
    run_promtool(promtool_file(tmp_path / "quiet.test.yml", [test], evaluation_interval=60), timeout=600)


def test_the_quiet_replay_would_catch_the_frozen_timestamps(tmp_path: Path) -> None:
    """The same replay against the rule as it was (every part's timestamp judged) fires for the
    parts that only render on change: the quiet test can fail."""
    files = rule_copies(tmp_path / "rules", ["GpuAllocTelemetryStale"])
    old = next(f for f in files if f.name == mc.RULE_FILES[1].name)
    assert '{collector=~"nvml|mock"}' in old.read_text()
    old.write_text(old.read_text().replace('{collector=~"nvml|mock"}', ""))
    node = quiet_nodes()["mock-busy-kernels:19402"]
    instance = "mock-busy-kernels:19402"
    test = {
        "interval": f"{STEP}s",
        "input_series": input_series(node, instance, 3600),
        "promql_expr_test": [alerts_snapshot(instance, [("GpuAllocTelemetryStale", {"job": JOB, "instance": instance, "collector": part})
                                                        for part in PARTS], 3600)],
    }
    run_promtool(promtool_file(tmp_path / "old.test.yml", [test], files))


def test_the_node_model_serves_the_exporters_families() -> None:
    """Every family of the model exists in a golden exposition with the same label names, and
    every raw series an alert reads is served by the quiet nodes (else "quiet" would only mean
    "no data"), except those that exist only while something is wrong."""
    golden: dict[str, set[frozenset[str]]] = {}
    for path in sorted(mc.GOLDEN_DIR.glob("*.prom")):
        for fam in text_string_to_metric_families(path.read_text()):
            for sample in fam.samples:
                golden.setdefault(sample.name, set()).add(frozenset(sample.labels))
    served: set[str] = set()
    problems = []
    for node in quiet_nodes().values():
        for name, labels in node.series:
            served.add(name)
            if name == "up":
                continue
            if name not in golden:
                problems.append(f"{name}: in no golden exposition")
            elif frozenset(k for k, _ in labels) not in golden[name]:
                problems.append(f"{name}{{{', '.join(k for k, _ in labels)}}}: label names differ from the golden files")
    assert sorted(set(problems)) == []
    only_when_wrong = {"gpu_alloc_kernel_stale", "gpu_alloc_device_unknown_allocated", "gpu_alloc_device_unattributed_processes",
                       "gpu_alloc_ghost_memory_holder_info", "gpu_alloc_device_health_fault_info",
                       "gpu_alloc_device_health_kernel_info", "gpu_alloc_node_request_refused"}
    read = {n for n in mc.used_metric_names(ROOT / "nonexistent", mc.RULE_FILES) if ":" not in n} - mc.PROMETHEUS_SERIES
    assert sorted(read - served - only_when_wrong) == []


# --- 2. the matrix ---------------------------------------------------------------------------------


@functools.cache
def load_matrix() -> dict[str, Any]:
    return yaml.safe_load(MATRIX.read_text())


def _phases_for(entry: Any, onset: int, lasts: int | None) -> list[tuple[int, Any]]:
    """A matrix series entry → phases after ``onset``: a spec (during the fault; healthy again
    after ``lasts``), or a mapping of offsets from the onset (and ``after``: from the end)."""
    if isinstance(entry, Mapping):
        out = []
        for off, spec in entry.items():
            if off == "after":
                if lasts is None:
                    raise ValueError("matrix: 'after' in an entry of something that has no end")
                out.append((onset + lasts, spec))
            else:
                out.append((onset + seconds(off), spec))
        return out
    return [(onset, entry)]


def planted(state: str, fault: Mapping[str, Any], onset: int, lasts: int | None) -> Node:
    """The healthy node of ``state`` with ``fault`` planted at ``onset``; each faulty series
    returns to its healthy value after ``lasts`` unless its entry says otherwise."""
    node = healthy_node(state)
    for text, entry in fault.items():
        sel = Selector.parse(text)
        phases = _phases_for(entry, onset, lasts)
        explicit_end = isinstance(entry, Mapping) and "after" in entry
        hits = [k for k in node.series if sel.matches(k)]
        if not hits:
            k = sel.as_key()
            node.series[k] = [(0, "_")]
            hits = [k]
        for k in hits:
            healthy = node.series[k]
            new = list(healthy) + phases
            if lasts is not None and not explicit_end:
                new += [(onset + lasts, spec) for _, spec in healthy[-1:]]
            node.series[k] = new
    return node


@dataclass(frozen=True)
class Row:
    alert: str
    state: str
    fault: Mapping[str, Any]
    labels: dict[str, str]
    lasts: int
    window: int
    resolves_after: int
    resolve: str
    quiet: tuple[str, ...]
    near_misses: tuple[Mapping[str, Any], ...]
    without_rules: tuple[str, ...]


def rows() -> list[Row]:
    doc = load_matrix()
    out = []
    for r in doc["alerts"]:
        labels = {k: str(v) for k, v in (r.get("labels") or {}).items()}
        if r.get("per_node", True):
            labels = {"job": JOB, "instance": "node-1:19402", **labels}
        out.append(Row(r["alert"], r.get("state", "busy-kernels"), r.get("fault") or {}, labels, seconds(r["lasts"]),
                       seconds(r.get("window", "0s")), seconds(r.get("resolves_after", "0s")), r["resolve"],
                       tuple(r["quiet"]), tuple(r.get("near_misses") or ()), tuple(r.get("without_rules") or ())))
    return out


def test_every_alert_has_one_matrix_row() -> None:
    names = [r.alert for r in rows()]
    assert sorted(set(alert_rules()) - set(names)) == [], "alerts without a row in alerts/tests/matrix.yml"
    assert sorted(set(names) - set(alert_rules())) == [], "rows for alerts no rule file has"
    assert len(names) == len(set(names)), "an alert with two rows"


def test_matrix_rows_are_consistent() -> None:
    rules = alert_rules()
    problems = []
    for r in rows():
        rule = rules[r.alert]
        if not set(r.quiet) <= set(STATES) or not r.quiet:
            problems.append(f"{r.alert}: quiet must name healthy states ({', '.join(STATES)})")
        if r.window + rule.for_s + 2 * rule.interval_s > r.lasts:
            problems.append(f"{r.alert}: the fault ends before the alert must fire")
        if not r.resolve.strip():
            problems.append(f"{r.alert}: say what resolves it")
    assert problems == []


ONSET = 30 * 60  # every fault starts here, on a node healthy since 0 (range windows are full)
NODE = "node-1:19402"


def row_test(r: Row) -> dict[str, Any]:
    """The row as one promtool test group: quiet before the fault and before its for:, firing with
    exactly the row's identity within for: (+ window) + two intervals, resolved after what the row
    says resolves it."""
    rule = alert_rules()[r.alert]
    # A missing rule is missing from the start, and only a rule file change brings it back.
    onset = 0 if r.without_rules else ONSET
    fire_at = onset + r.window + rule.for_s + 2 * rule.interval_s
    resolved_at = onset + r.lasts + r.resolves_after + 2 * rule.interval_s
    end = resolved_at + 4 * STEP
    checks = []
    if onset:
        checks.append({"eval_time": duration(onset - STEP), "alertname": r.alert, "exp_alerts": []})
    if rule.for_s:
        checks.append({"eval_time": duration(onset + rule.for_s - STEP), "alertname": r.alert, "exp_alerts": []})
    if not r.without_rules:
        checks.append({"eval_time": duration(resolved_at), "alertname": r.alert, "exp_alerts": []})
    node = planted(r.state, r.fault, onset, r.lasts)
    firing = alerts_snapshot(None, [(r.alert, r.labels)], fire_at)
    firing["expr"] = f'ALERTS{{alertstate="firing", alertname="{r.alert}"}}'
    return {"name": f"{r.alert}: fires, then resolves ({r.resolve})", "interval": f"{STEP}s",
            "input_series": input_series(node, NODE, end), "alert_rule_test": checks, "promql_expr_test": [firing]}


def near_miss_tests(r: Row) -> list[dict[str, Any]]:
    """Healthy nodes with something that looks like the row's fault: the alert stays quiet."""
    rule = alert_rules()[r.alert]
    end = ONSET + max(2 * 3600, 2 * (r.window + rule.for_s))
    out = []
    for miss in r.near_misses:
        node = planted(miss.get("state", "busy-kernels"), miss["fault"], ONSET, None)
        times = sorted({ONSET + rule.for_s + 2 * rule.interval_s, ONSET + 3600, end})
        out.append({"name": f"{r.alert} near miss: {miss['what']}", "interval": f"{STEP}s", "input_series": input_series(node, NODE, end),
                    "alert_rule_test": [{"eval_time": duration(t), "alertname": r.alert, "exp_alerts": []} for t in times],
                    "promql_expr_test": [{"expr": f'count_over_time(ALERTS{{alertname="{r.alert}", alertstate="firing"}}[{duration(end + 60)}])',
                                          "eval_time": duration(end), "exp_samples": []}]})
    return out


@pytest.mark.parametrize("row", rows(), ids=lambda r: r.alert)
def test_matrix_row(row: Row, tmp_path: Path) -> None:
    """The row's fault fires it with its identity in time, what resolves it does, and its near
    misses never fire it (only the alert and the recording rules it reads are loaded)."""
    files = rule_copies(tmp_path / "rules", [row.alert], row.without_rules)
    run_promtool(promtool_file(tmp_path / "row.test.yml", [row_test(row), *near_miss_tests(row)], files))


def test_matrix_quiet_states(tmp_path: Path) -> None:
    """Each alert stays quiet for 3 h, evaluated every 15 s with every rule file, in the healthy
    states its row lists (one node per state, replayed together)."""
    end = 3 * 3600
    series, checks = [], []
    for state in STATES:
        instance = f"{state}:19402"
        series += input_series(healthy_node(state), instance, end)
        quiet = sorted(r.alert for r in rows() if state in r.quiet)
        # Any firing evaluation in 3 h leaves a sample; alerts without an instance count for every node.
        checks.append({"expr": f'count_over_time(ALERTS{{alertstate="firing", instance=~"{instance}|", alertname=~"{"|".join(quiet)}"}}[3h1m])',
                       "eval_time": "3h", "exp_samples": []})
    everywhere = sorted(r.alert for r in rows() if set(r.quiet) == set(STATES))
    test = {"name": "healthy states", "interval": f"{STEP}s", "input_series": series, "promql_expr_test": checks,
            "alert_rule_test": [{"eval_time": t, "alertname": a, "exp_alerts": []} for t in ("10m", "30m", "1h", "2h", "3h") for a in everywhere]}
    run_promtool(promtool_file(tmp_path / "quiet.test.yml", [test]), timeout=600)


# --- 3. incidents -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Firing:
    alert: str
    labels: dict[str, str]
    start: int  # seconds after the onset


@dataclass(frozen=True)
class Incident:
    name: str
    what: str
    state: str
    fault: Mapping[str, Any]
    firing: tuple[Firing, ...]
    page: tuple[str, ...]
    until: int


def incidents() -> list[Incident]:
    out = []
    for name, inc in load_matrix()["incidents"].items():
        firing = []
        for f in inc["firing"]:
            labels = {k: str(v) for k, v in (f.get("labels") or {}).items()}
            if f.get("per_node", True):
                labels = {"job": JOB, "instance": NODE, **labels}
            firing.append(Firing(f["alert"], labels, seconds(f["from"])))
        out.append(Incident(name, inc["what"], inc.get("state", "busy-kernels"), inc["fault"], tuple(firing),
                            tuple(inc["page"]), seconds(inc["until"])))
    return out


def incident_test(inc: Incident) -> dict[str, Any]:
    """Exactly the listed alerts fire on the node at each time one of them starts, one
    evaluation before, and at the end."""
    end = ONSET + inc.until
    node = planted(inc.state, inc.fault, ONSET, None)
    times = {ONSET - STEP, end} | {ONSET + f.start for f in inc.firing} | {ONSET + f.start - STEP for f in inc.firing}
    checks = [alerts_snapshot(None, [(f.alert, f.labels) for f in inc.firing if ONSET + f.start <= t], t) for t in sorted(times)]
    return {"name": f"incident {inc.name}: {inc.what}", "interval": f"{STEP}s", "input_series": input_series(node, NODE, end + STEP),
            "promql_expr_test": checks}


@pytest.mark.parametrize("incident", incidents(), ids=lambda i: i.name)
def test_incident_fires_exactly_these_alerts(incident: Incident, tmp_path: Path) -> None:
    assert set(incident.page) <= {f.alert for f in incident.firing}
    run_promtool(promtool_file(tmp_path / "incident.test.yml", [incident_test(incident)]))


# --- the pieces ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("samples", "text"), [
    ([1.0, 1.0, 1.0], "1x2"),
    ([0.0, 15.0, 30.0, 30.0, 30.0], "0+15x2 30x1"),
    ([5.0, None, None, 5.0], "5 stale _ 5"),
    ([None, None, 2.5], "_x2 2.5"),
    ([3.0, 2.0, 1.0, None], "3-1x2 stale"),
    ([85899345920.0, 0.037037037037037035], "85899345920 0.037037037037037035"),
    ([1e-07], "0.0000001"),
])
def test_notation(samples: list[float | None], text: str) -> None:
    assert notation(samples) == text


def test_values_language() -> None:
    phases: Phases = [(0, "every 1m"), (120, "hold"), (180, "step 5"), (210, "clock"), (240, "_"), (255, "elapsed")]
    got = values(phases, 270)
    assert got[:9] == [0, 0, 0, 0, 1, 1, 1, 1, 1]  # +1 at each minute until 2m, then held
    assert got[9:12] == [1, 1, 1] and got[12:14] == [6, 6] and got[14:16] == [210, 225]
    assert got[16] is None and got[17:] == [0, 15]
    assert values([(0, "sawtooth 45m")], 2700)[-2:] == [2685, 0]
    with pytest.raises(ValueError, match="not a series value"):
        values([(0, "sometimes")], 15)


def test_selectors() -> None:
    sel = Selector.parse('{__name__=~"gpu_alloc_device_(up|stale)", device_id="GPU-1"}')
    assert sel.matches(key("gpu_alloc_device_up", device_id="GPU-1"))
    assert not sel.matches(key("gpu_alloc_device_up", device_id="GPU-2"))
    assert not sel.matches(key("gpu_alloc_device_info", device_id="GPU-1"))
    assert Selector.parse('x{a="1", b="2"}').as_key() == key("x", a="1", b="2")
    with pytest.raises(ValueError, match="names no metric"):
        Selector.parse('{device_id="GPU-1"}')
    with pytest.raises(ValueError, match="not an exact series"):
        Selector.parse('x{a=~"1"}').as_key()


def test_rules_identity_carries_no_kernel_or_session() -> None:
    """Alerts about a device fault keep one identity while sessions come and go: no kernel or
    session label in the identity of any critical alert about a GPU."""
    for r in rows():
        if alert_rules()[r.alert].severity == "critical":
            assert not {"kernel_id", "session_id", "user_id"} & set(r.labels), r.alert


def test_sessions_xid_window_is_the_xid_threshold() -> None:
    """The blast-radius alert writes the XID window out (its file works alone); it must equal the
    threshold GpuAllocXidCritical uses, so the two resolve together."""
    rules = mc.load_rules(mc.RULE_FILES)
    threshold = float(re.fullmatch(r"vector\((.*)\)", rules.records["global:gpu_alloc_xid_recent_seconds:threshold"].strip()).group(1))
    window = re.search(r"gpu_alloc_xid_last_seen_timestamp_seconds\{[^}]*\} < (\d+)\)", rules.alerts["GpuAllocSessionsOnUnhealthyGpu"]["expr"])
    assert window and float(window.group(1)) == threshold
