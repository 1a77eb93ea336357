"""The GPU ledger over a 3-minute window, as a new user sees it: ``gpu-alloc-exporter demo`` in
real time (time scale 1) scraped by Debian's Prometheus every 15 s, the scrape interval of the
shipped deploy/prometheus/prometheus.yml.

For every GPU of the demo node (a DGX A100: six whole GPUs and two in MIG mode; the ledger keys
every counter by the physical GPU, a MIG slice counting against the GPU it is carved from, so
each ``device_id`` is one GPU), over a window of 180 s that starts at the second scrape (after
the first one, so every series has a sample before it):

1. the kernels' allocated GPU-seconds plus the GPU's unallocated ones grow by the time that
   passed × 1 GPU;
2. the kernels' joules plus the unattributed ones grow by what the GPU's own energy counter grew;
3. the duty-cycled kernel (busy ``DUTY_BUSY_S`` of every ``DUTY_PERIOD_S``, in step with the
   scrape) has its busy GPU-seconds grow by what the simulated driver generated for it, while
   its utilisation gauge, scraped every 15 s, is off by half or more.

All within 1 %, while sessions come and go and the demo's planted faults play: a GPU falls off
the bus at +1:00 and is reset at +3:00 (its energy counter restarts), a session ends leaving
ghost memory, new sessions arrive.

Why not plain ``increase(x[3m])`` at any time: Prometheus extrapolates a range's first and last
samples towards the window's edges, so its result depends on where the scrapes fall in the
window, by up to a scrape interval's worth (8 % of 180 s), and a series that starts inside the
window (a session that arrives) is extrapolated towards a start it cannot see. So every figure is
measured between two scrapes: the window is [s1, s2], s1 and s2 being scrape timestamps as
Prometheus stored them, and the range is exactly ``s2 - s1`` long (in milliseconds), evaluated
at s2. ``increase()`` then covers its range with samples at both edges and extrapolates nothing
(checked: it equals the raw difference of the edge samples, and the range holds every scrape);
it is used where a counter may restart (the energy counter of the GPU that is reset). The
kernels' counters, whose series come and go with the sessions, are compared sample by sample:
the value at s2 minus the value at s1, or minus 0 for a series whose first sample lies inside the
window (the exporter starts every kernel's counters at 0 when it first sees the kernel, and keeps
an ended kernel's for 10 minutes, past the window's end). The expected time is ``s2 - s1`` itself.

The ground truth of the busy time is the demo's schedule: the simulated driver samples each GPU
every 1/6 s, and the demo makes the duty-cycled processes busy exactly in ``[k * DUTY_PERIOD_S,
k * DUTY_PERIOD_S + DUTY_BUSY_S)`` of demo time, demo second 0 being when it printed its
schedule. The window is 12 whole duty periods, so what was generated in it does not depend on
where the bursts fall (their phase only matters for the milliseconds by which ``s2 - s1`` may
differ from 180 s). The kernel's busy GPU-seconds are that busy time × the share of the GPU it
holds.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import yaml
from e2e.harness import Exporter, Prometheus, free_port, running, wait_until
from helpers import ROOT

from exporter.demo.node import DUTY_BUSY_S, DUTY_PERIOD_S

pytestmark = [pytest.mark.slow, pytest.mark.tools("prometheus")]

SEED = 7
WINDOW_S = 180.0
TOLERANCE = 0.01  # relative
GAUGE_OFF = 0.5  # at least this far (relative) from the truth: what a scraped gauge misses
JOB = "gpu-nodes"
# What a user's Prometheus has: the shipped config's scrape interval and timeout.
SHIPPED = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())["global"]


def _seconds(duration: str) -> float:
    m = re.fullmatch(r"(\d+)s", duration)
    assert m, f"deploy/prometheus/prometheus.yml: expected a scrape interval in seconds, got {duration!r}"
    return float(m.group(1))


SCRAPE_S = _seconds(SHIPPED["scrape_interval"])

Samples = list[tuple[int, float]]  # (Prometheus timestamp in ms, value), oldest first


@dataclass
class Window:
    """The demo, its Prometheus and the window [s1, s2] between two of its scrapes."""

    prom: Prometheus
    exporter: Exporter
    gpus: dict[str, str]  # device_id -> "GPU n", as the demo printed them
    duty_kernel: str
    demo_zero: float  # Unix time of the demo's second 0 (when it printed its schedule), ±0.1 s
    s1: int  # ms
    s2: int  # ms

    @property
    def range(self) -> str:
        return f"{self.s2 - self.s1}ms"

    @property
    def elapsed(self) -> float:
        return (self.s2 - self.s1) / 1000

    def query(self, expr: str, at: int | None = None) -> list[dict]:
        at = self.s2 if at is None else at
        return self.prom.api("query", query=expr, time=f"{at / 1000:.3f}")["result"]

    def by_device(self, expr: str) -> dict[str, float]:
        """An instant query at s2, one value per device_id."""
        return {r["metric"]["device_id"]: float(r["value"][1]) for r in self.query(expr)}

    def raw(self, selector: str) -> dict[tuple[tuple[str, str], ...], Samples]:
        """Every sample of the series ``selector`` holds in [s1, s2], per series."""
        out = {}
        for r in self.query(f"{selector}[{self.range}]"):
            labels = tuple(sorted((k, v) for k, v in r["metric"].items() if k not in ("instance", "job")))
            out[labels] = [(round(float(t) * 1000), float(v)) for t, v in r["values"]]
        return out

    def growth(self, name: str, samples: Samples) -> float:
        """A counter's growth over [s1, s2]: from 0 where the series starts inside the window."""
        (t0, v0), (t1, v1) = samples[0], samples[-1]
        assert t1 == self.s2, f"{name}: its last sample is at {t1} ms, not at the window's end {self.s2} ms (the series went away)"
        values = [v for _, v in samples]
        assert all(b >= a for a, b in zip(values, values[1:], strict=False)), f"{name} went back within the window: {values}"
        return v1 - (v0 if t0 == self.s1 else 0.0)

    def grown_by_device(self, name: str) -> dict[str, float]:
        """Σ over the series of counter ``name`` of their growth over [s1, s2], per device_id."""
        out: dict[str, float] = {}
        for labels, samples in self.raw(name).items():
            device = dict(labels)["device_id"]
            out[device] = out.get(device, 0.0) + self.growth(f"{name}{dict(labels)}", samples)
        return out


def _rel(observed: float, expected: float) -> float:
    return (observed - expected) / expected if expected else math.inf


@pytest.fixture(scope="module")
def window(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Window]:
    work = tmp_path_factory.mktemp("e2e-ledger-window")
    address = f"127.0.0.1:{free_port()}"
    with running() as started:
        config = {"global": {k: SHIPPED[k] for k in ("scrape_interval", "scrape_timeout", "evaluation_interval")},
                  "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": [address]}]}]}
        # Prometheus first, so that it scrapes the demo from its first interval on.
        prom = Prometheus(work, config=config)
        started.append(prom)
        exporter = Exporter(["--seed", str(SEED), "--demo.dir", str(work / "node")], work, command=("demo",), listen=address)
        started.append(exporter)
        schedule = wait_until(lambda: "Press Ctrl-C to stop." in exporter.log() and exporter.log(), 20, "the demo's schedule")
        demo_zero = time.time()  # the schedule is printed at demo second 0; read within 0.1 s of it
        gpus = {uuid: f"GPU {n}" for n, uuid in re.findall(r"^  GPU (\d+) (GPU-[0-9a-f-]+):", schedule, re.M)}
        duty = re.search(r"^  ([0-9a-f-]{36}) .*\(duty-cycled", schedule, re.M)
        assert len(gpus) == 8 and duty, f"the demo's schedule lacks its GPUs or its duty-cycled kernel:\n{schedule}"

        # s1: the second scrape that carried the ledger, so the window lies after the first scrape.
        def ledger_scrapes() -> list[int]:
            result = prom.api("query", query=f'gpu_alloc_device_unallocated_gpu_seconds_total{{job="{JOB}"}}[10m]')["result"]
            if len(result) < len(gpus):
                return []
            stamps = [round(float(t) * 1000) for t, _ in result[0]["values"]]
            return stamps if len(stamps) >= 2 else []

        s1 = wait_until(ledger_scrapes, 3 * SCRAPE_S + 20, "two scrapes of the demo's ledger", interval=0.5)[1]

        # s2: the scrape WINDOW_S after s1 (Prometheus keeps scrapes on their grid, within ms).
        def scrape_near_end() -> int | None:
            result = prom.api("query", query=f'up{{job="{JOB}"}}[5m]')["result"]
            stamps = [round(float(t) * 1000) for t, _ in result[0]["values"]] if result else []
            return next((t for t in stamps if abs(t - s1 - WINDOW_S * 1000) <= 1000), None)

        time.sleep(max(0.0, s1 / 1000 + WINDOW_S - time.time()))
        s2 = wait_until(scrape_near_end, SCRAPE_S, f"the scrape {WINDOW_S:g} s after the window's start", interval=0.2)
        assert exporter.alive(), f"the demo exited:\n{exporter.log()[-3000:]}"
        yield Window(prom, exporter, gpus, duty.group(1), demo_zero, s1, s2)


def test_the_window_lies_between_two_scrapes_and_nothing_is_extrapolated(window: Window) -> None:
    w = window
    scrapes = round(w.elapsed / SCRAPE_S) + 1
    # The range holds a scrape at each edge and every one between (Prometheus 2.x includes the
    # sample at the range's start)...
    count = w.query(f'count_over_time(up{{job="{JOB}"}}[{w.range}])')
    assert count and float(count[0]["value"][1]) == scrapes, (count, scrapes)
    assert w.query(f'up{{job="{JOB}"}}[{w.range}]')[0]["values"][0][0] == pytest.approx(w.s1 / 1000)
    # ...so increase() over it is the raw difference of its edge samples, not an extrapolation.
    increase = w.by_device(f"increase(gpu_alloc_device_unallocated_gpu_seconds_total[{w.range}])")
    raw = {dict(k)["device_id"]: s[-1][1] - s[0][1] for k, s in w.raw("gpu_alloc_device_unallocated_gpu_seconds_total").items()}
    assert set(increase) == set(raw) == set(w.gpus)
    assert all(increase[d] == pytest.approx(raw[d], rel=1e-9, abs=1e-9) for d in raw), (increase, raw)


def test_allocated_and_unallocated_gpu_seconds_add_up_to_the_time_that_passed_on_every_gpu(window: Window) -> None:
    w = window
    kernels = w.grown_by_device("gpu_alloc_kernel_allocated_gpu_seconds_total")
    unallocated = w.by_device(f"increase(gpu_alloc_device_unallocated_gpu_seconds_total[{w.range}])")
    devices = w.by_device(f"increase(gpu_alloc_device_allocated_gpu_seconds_total[{w.range}])")
    assert set(unallocated) == set(w.gpus), f"the ledger's GPUs {sorted(unallocated)} are not the demo's {sorted(w.gpus)}"
    expected = w.elapsed  # × 1 GPU: every device_id of the ledger is one physical GPU
    rows, bad = [], []
    for device, gpu in sorted(w.gpus.items(), key=lambda kv: kv[1]):
        observed = kernels.get(device, 0.0) + unallocated[device]
        err = _rel(observed, expected)
        row = (f"{gpu} {device}: expected {expected:.3f} GPU-s, observed {observed:.3f} (kernels {kernels.get(device, 0.0):.3f} "
               f"+ unallocated {unallocated[device]:.3f}), error {err:+.3%}")
        rows.append(row)
        if abs(err) > TOLERANCE or abs(_rel(devices[device] + unallocated[device], expected)) > TOLERANCE:
            bad.append(row + f"; the device's own allocated counter says {devices[device]:.3f}")
    print("\nallocated + unallocated over the window:\n" + "\n".join(rows))
    assert not bad, "allocated + unallocated GPU-seconds are not the time that passed:\n" + "\n".join(bad)


def test_kernels_and_unattributed_joules_add_up_to_the_energy_counter_on_every_gpu(window: Window) -> None:
    """Per GPU, over the window, the GPU the demo takes off the bus included: while a GPU does not
    answer its energy counter stays at the last value read, so the joules the ledger split before
    the loss are in the counter's increase too, and its restarted counter after the reset is a
    counter reset that increase() follows."""
    w = window
    counter = w.by_device(f"increase(gpu_alloc_device_energy_joules_total[{w.range}])")
    unattributed = w.raw("gpu_alloc_device_unattributed_energy_joules_total")
    kernels = w.raw("gpu_alloc_kernel_energy_joules_total")
    assert set(counter) == set(w.gpus), f"energy counters of {sorted(counter)}, not of the demo's GPUs {sorted(w.gpus)}"
    rows, bad = [], []
    for device, gpu in sorted(w.gpus.items(), key=lambda kv: kv[1]):
        series = [(f"{dict(k)['__name__']}{dict(k)}", s) for source in (kernels, unattributed)
                  for k, s in source.items() if dict(k)["device_id"] == device]
        observed = sum(w.growth(name, s) for name, s in series)
        expected = counter[device]
        err = _rel(observed, expected)
        row = f"{gpu} {device}: energy counter +{expected:.1f} J, kernels + unattributed +{observed:.1f} J, error {err:+.3%}"
        rows.append(row)
        if abs(err) > TOLERANCE:
            bad.append(row)
    print("\nkernels' + unattributed joules against the energy counter over the window:\n" + "\n".join(rows))
    assert not bad, "the GPU's joules are not split in full:\n" + "\n".join(bad)


def test_the_duty_cycled_kernels_busy_counter_counts_every_burst_and_its_gauge_does_not(window: Window) -> None:
    w = window
    kid = w.duty_kernel
    busy = {dict(k)["device_id"]: s for k, s in w.raw(f'gpu_alloc_kernel_busy_gpu_seconds_total{{kernel_id="{kid}"}}').items()}
    shares = {dict(k)["device_id"]: s for k, s in w.raw(f'gpu_alloc_kernel_gpu_share_ratio{{kernel_id="{kid}"}}').items()}
    gauges = {dict(k)["device_id"]: s for k, s in w.raw(f'gpu_alloc_kernel_utilization_ratio{{kernel_id="{kid}"}}').items()}
    assert busy and set(busy) == set(shares) == set(gauges), (sorted(busy), sorted(shares), sorted(gauges))

    # Generated: busy in [k * P, k * P + B) of demo time, over the window's exact span.
    def busy_seconds(a: float, b: float) -> float:
        a, b = a - w.demo_zero, b - w.demo_zero
        total, k = 0.0, math.floor(a / DUTY_PERIOD_S)
        while k * DUTY_PERIOD_S < b:
            total += max(0.0, min(b, k * DUTY_PERIOD_S + DUTY_BUSY_S) - max(a, k * DUTY_PERIOD_S))
            k += 1
        return total

    generated = busy_seconds(w.s1 / 1000, w.s2 / 1000)
    assert generated == pytest.approx(w.elapsed / DUTY_PERIOD_S * DUTY_BUSY_S, abs=0.1)  # whole periods, whatever the phase
    rows, bad = [], []
    for device in sorted(busy):
        gpu = w.gpus.get(device, device)
        share_values = {v for _, v in shares[device]}
        assert len(share_values) == 1, f"kernel {kid} on {gpu} {device}: its share changed within the window: {share_values}"
        share = share_values.pop()
        truth = generated * share
        counted = w.growth(f"busy of kernel {kid} on {device}", busy[device])
        # What a user estimates from the utilisation gauge scraped every 15 s: its mean × the span × the share.
        readings = [v for _, v in gauges[device]]
        gauge = sum(readings) / len(readings) * w.elapsed * share
        row = (f"kernel {kid} on {gpu} {device} (share {share:.4f}): generated {truth:.3f} busy GPU-s, counter +{counted:.3f} "
               f"(error {_rel(counted, truth):+.3%}), the 15 s gauge says {gauge:.3f} (error {_rel(gauge, truth):+.1%}; "
               f"{len(readings)} scrapes reading {sorted(set(readings))})")
        rows.append(row)
        if abs(_rel(counted, truth)) > TOLERANCE or abs(_rel(gauge, truth)) < GAUGE_OFF:
            bad.append(row)
    print("\nthe duty-cycled kernel over the window:\n" + "\n".join(rows))
    assert not bad, (f"busy {DUTY_BUSY_S:g} s of every {DUTY_PERIOD_S:g} s: the counter should be within {TOLERANCE:.0%} "
                     f"and the gauge off by {GAUGE_OFF:.0%} or more:\n" + "\n".join(bad))


def test_the_owners_counters_add_up_to_the_gpus(window: Window) -> None:
    """Per user and project the same sums: what the owners' counters grew by over the window is
    what the GPUs' grew by (owners appear with their first session: from 0 then)."""
    w = window
    for owner, device in (("allocated_gpu_seconds", "allocated_gpu_seconds"), ("busy_gpu_seconds", "busy_gpu_seconds"),
                          ("energy_joules", "attributed_energy_joules")):
        owners = sum(w.growth(f"{k}", s) for k, s in w.raw(f"gpu_alloc_user_{owner}_total").items())
        devices = sum(w.growth(f"{k}", s) for k, s in w.raw(f"gpu_alloc_device_{device}_total").items())
        assert owners == pytest.approx(devices, rel=TOLERANCE), (
            f"gpu_alloc_user_{owner}_total grew by {owners:.3f} over the window, the GPUs' gpu_alloc_device_{device}_total by {devices:.3f}")
    assert w.exporter.alive(), "the demo exited during the window"
