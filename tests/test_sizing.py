"""docs/deploy.md's sizing figures, measured: the exporter rendered over generated nodes.

A node here is the simulated DGX A100 (8 GPUs, GPUs 6 and 7 in MIG mode) read through the real
NVML binding with PCIe throughput, as the demo runs it; its kernels hold 0.25 fGPU shares each on
the six fractional GPUs (every fifth kernel on two), run one process per GPU in their container
(process attribution on, half of them busy), and carry a recovery.json (identity). The series of
/metrics are counted at 50 and 200 kernels: the difference gives the series per kernel, and what
is left at 50 kernels the fixed part of a node. docs/deploy.md states those figures, a node at
bench/fleet.py's mean of 58 kernels, and how much larger that is than the 881 series of the
fleet benchmark's simulated nodes (which its zone sizes were measured with); each must match the
measurement within :data:`TOLERANCE`. The demo's node at its start and tests/golden/full.prom
are counted the same way for the table there.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from decimal import Decimal
from pathlib import Path

import pytest
from helpers import GOLDEN, ROOT

from exporter.app import Exporter
from exporter.config import resolve
from exporter.demo import write_kernel, write_recovery
from exporter.demo.host import SimulatedHost
from exporter.demo.node import LivingNode
from exporter.settings import Settings
from exporter.telemetry.nvml import NvmlSource
from exporter.telemetry.nvml.simulated import MIB, FakeNvml

DEPLOY_MD = ROOT / "docs" / "deploy.md"
SIZES = (50, 200)
BENCH_KERNELS, BENCH_SERIES = 58, 881  # bench/fleet.py: mean kernels per node, series per simulated node
TOLERANCE = 0.05  # a figure in the docs may differ from the measurement by this fraction
NOW = 1_700_000_000.0
USERS = [str(uuid.UUID(int=0xA11CE + n, version=4)) for n in range(8)]


class Clock:
    now = NOW

    def __call__(self) -> float:
        return self.now


def count_series(text: str) -> int:
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def generated_node(base: Path, kernels: int, fake: FakeNvml) -> Settings:
    root = base / "scratches"
    host = SimulatedHost(base)
    gpus = [g for g in fake.gpus if not g.mig_current]
    procs: dict[int, list[tuple[int, int]]] = {g.index: [] for g in gpus}
    busy: dict[int, dict[int, int]] = {g.index: {} for g in gpus}
    for n in range(kernels):
        kernel, session = str(uuid.UUID(int=2 * n + 1, version=4)), str(uuid.UUID(int=2 * n + 2, version=4))
        container = f"{n + 1:064x}"
        held = [gpus[n % len(gpus)]] + ([gpus[(n + 1) % len(gpus)]] if n % 5 == 0 else [])
        write_kernel(root, kernel, {"cuda.shares": {g.uuid: Decimal("0.25") for g in held}}, container_id=container)
        write_recovery(root, kernel, session, USERS[n % len(USERS)], agent_id="i-sizing")
        host.start_container(container)
        for k, g in enumerate(held):
            pid = 100_000 + 10 * n + k
            host.spawn(pid, "python3", started=60.0, container_id=container, scratch_dir=root / kernel, ppid=1187)
            procs[g.index].append((pid, 512 * MIB))
            if n % 2:
                busy[g.index][pid] = 40
    for g in gpus:
        fake.set_processes(g.index, procs[g.index])
        fake.update(g.index, process_sm=busy[g.index])
    return Settings.load({"scratch_roots": [str(root)], "path_procfs": str(host.proc), "path_cgroupfs": str(host.cgroup),
                          "agent_id": "i-sizing", "telemetry_interval": 3600, "telemetry_pcie": True, "stale_grace": 60})


def render(settings: Settings, fake: FakeNvml, clock: Clock, collectors: dict[str, bool] | None = None) -> str:
    source = None if settings.telemetry_source == "none" else NvmlSource(clock=clock, event_wait_ms=20, pcie=True)
    with fake.installed():
        exporter = Exporter(resolve(settings, collectors=collectors), clock=clock, monotonic=clock, telemetry=source)
        exporter.start()
        try:
            clock.now = NOW + 600  # ten minutes on: idle and no-process times are measured
            exporter.pipeline.step()
            return exporter.render().decode()
        finally:
            exporter.close()


def exposition(base: Path, kernels: int, collectors: dict[str, bool] | None = None, **switches: str) -> str:
    clock = Clock()
    fake = FakeNvml.dgx_a100(clock=clock)
    settings = generated_node(base, kernels, fake)
    settings = dataclasses.replace(settings, **switches, given=settings.given | switches.keys())
    text = render(settings, fake, clock, collectors)
    ok = re.search(r'^gpu_alloc_kernels\{state="ok"\} (\S+)$', text, flags=re.M)
    assert ok and float(ok.group(1)) == kernels, "not every kernel was read"
    return text


# What each documented cardinality switch is measured with (at BENCH_KERNELS kernels).
SWITCHES = {
    "per-kernel": {"attribution_kernel_series": "per-kernel"},
    "off": {"attribution_kernel_series": "off"},
    "alerting": {"telemetry_throttle_reasons": "alerting"},
    "active": {"telemetry_throttle_reasons": "active"},
    "breach": {"attribution_breach_series": "active"},
    "together": {"attribution_kernel_series": "per-kernel", "telemetry_throttle_reasons": "active", "attribution_breach_series": "active"},
}


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, float]:
    tmp = tmp_path_factory.mktemp("sizing")
    small, large = SIZES
    counts = {n: count_series(exposition(tmp / f"node{n}", n)) for n in SIZES}
    bare = {n: count_series(exposition(tmp / f"bare{n}", n, {"attribution": False}, telemetry_source="none")) for n in SIZES}
    at_bench = exposition(tmp / "bench", BENCH_KERNELS)
    per_kernel = (counts[large] - counts[small]) / (large - small)
    out = {"per_kernel": per_kernel, "per_kernel_bare": (bare[large] - bare[small]) / (large - small),
           "fixed": counts[small] - small * per_kernel, "at_50": counts[small], "at_200": counts[large],
           "at_bench": count_series(at_bench), "kb_at_bench": len(at_bench.encode()) / 1000,
           "vs_bench": count_series(at_bench) / BENCH_SERIES}
    for name, switches in SWITCHES.items():
        out[f"saves_{name}"] = out["at_bench"] - count_series(exposition(tmp / f"switch-{name}", BENCH_KERNELS, **switches))
    out["saves_together_pct"] = 100 * out["saves_together"] / out["at_bench"]
    return out


def documented(pattern: str) -> float:
    text = re.sub(r"(?<=\d),(?=\d{3})", "", " ".join(DEPLOY_MD.read_text().split()))  # 1,408 -> 1408
    m = re.search(pattern, text)
    assert m, f"docs/deploy.md states no figure for {pattern!r}"
    return float(m.group(1))


def close(doc: float, value: float) -> bool:
    return abs(doc - value) <= TOLERANCE * value


FIGURES = {
    "per_kernel": r"\*\*(\d+) series per kernel\*\*",
    "per_kernel_bare": r"about ([\d.]+) per kernel without telemetry and attribution",
    "fixed": r"about (\d+) series of a node without kernels",
    "at_50": r"\| 50 kernels[^|]*\| (\d+) \|",
    "at_200": r"\| 200 kernels[^|]*\| (\d+) \|",
    "at_bench": r"\| 58 kernels[^|]*\| (\d+) ",
    "kb_at_bench": r"\| 58 kernels[^|]*\| \d+ \(~(\d+) KB of text\)",
    "vs_bench": r"(\d\.\d+) times the 881",
    "saves_per-kernel": r"kernel-series per-kernel` \(.*?\) saves (\d+) series per node",
    "saves_off": r"kernel-series off` (\d+);",
    "saves_alerting": r"throttle-reasons alerting` \([^)]*\) saves (\d+)",
    "saves_active": r"saves \d+, `active` (\d+);",
    "saves_breach": r"only while it is 1\) (\d+);",
    "saves_together": r"together (\d+) \(",
    "saves_together_pct": r"together \d+ \((\d+) %\)",
}


@pytest.mark.parametrize("key", sorted(FIGURES))
def test_the_deploy_guide_states_the_measured_sizes(measured: dict[str, float], key: str) -> None:
    doc = documented(FIGURES[key])
    assert close(doc, measured[key]), f"docs/deploy.md says {doc:g}, measured {measured[key]:.2f} ({key})"


def test_zone_sizes_are_the_benchmarks_scaled_to_the_exporters_nodes(measured: dict[str, float]) -> None:
    """The zone sizes were measured with bench/fleet.py's smaller nodes: the guide divides them by
    the measured factor."""
    ours = documented(r"\*\*about (\d+) nodes\*\* \(")
    bench = documented(r"\*\*about \d+ nodes\*\* \((\d+) of the benchmark's")
    assert abs(ours - bench / measured["vs_bench"]) <= 0.1 * ours, (ours, bench, measured["vs_bench"])


def test_the_demo_and_the_golden_node_in_the_table(tmp_path: Path) -> None:
    clock = Clock()
    node = LivingNode(tmp_path, seed=1, clock=clock)
    settings = Settings.load({"scratch_roots": [str(node.scratch)], "path_procfs": str(node.host.proc),
                              "path_cgroupfs": str(node.host.cgroup), "agent_id": node.agent_id, "telemetry_interval": 3600,
                              "telemetry_pcie": True, "stale_grace": 60})
    with node.running():
        exporter = Exporter(resolve(settings), clock=clock, monotonic=clock, telemetry=NvmlSource(clock=clock, event_wait_ms=20, pcie=True))
        exporter.start()
        try:
            exporter.pipeline.step()
            demo = count_series(exporter.render().decode())
        finally:
            exporter.close()
    assert close(documented(r"\| `demo`[^|]*\| (\d+) \|"), demo), demo
    assert documented(r"\| `demo` at its start \(seed 1\): (\d+) kernels") == len(node.sessions)
    golden = count_series((GOLDEN / "full.prom").read_text())
    assert close(documented(r"\| DGX A100[^|]*\| (\d+) \| `tests/golden/full.prom`"), golden), golden
