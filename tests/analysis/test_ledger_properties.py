"""The GPU ledger balances over random timelines: kernels start, stop and resize, processes
end and their PIDs come back, the source restarts (a new ``nvml_generation``), reads fail, and
passes come at any interval. At every pass, per GPU and to 1e-9:

* Σ kernels' allocated GPU-seconds (= the GPU's allocated counter) + unallocated = the seconds
  the GPU was known;
* each kernel's busy GPU-seconds ≤ its allocated ones, and Σ kernels' busy = the GPU's busy;
* Σ kernels' joules + unattributed joules = the increase of the GPU's energy counter since the
  exporter first read it;
* per owner (user, project) the same sums as per GPU; and no counter ever goes down.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.analysis.accounting import ENERGY_SPLITS, Accountant, Accounting
from exporter.analysis.attribution import AttributionResult, KernelDeviceUsage, ProcessUsage
from exporter.analysis.capacity import CapacityConfig
from exporter.scratch.allocation import Kernel, KernelState
from exporter.scratch.identity import UNDEFINED, Identity
from exporter.scratch.resources import Allocation, ResourceSpec
from exporter.telemetry.devices import DeviceResolver
from exporter.telemetry.model import DeviceReading, GpuProcess, TelemetrySnapshot

GPUS = ["GPU-00000000-0000-4000-8000-00000000000a", "GPU-00000000-0000-4000-8000-00000000000b"]
GIB = 1 << 30
CAPACITY = CapacityConfig()
USERS = ["00000000-0000-4000-8000-0000000000e1", "00000000-0000-4000-8000-0000000000f2"]
PROJECTS = [UNDEFINED, "00000000-0000-4000-8000-0000000000c1"]
INTERVALS = (0.0, 0.001, 0.5, 5.0, 60.0, 3600.0)
TOL = 1e-9


@dataclass
class Proc:
    pid: int
    start: int
    rate: float  # SM-busy seconds per second
    busy: float = 0.0  # the source's cumulative counter


@dataclass
class Sim:
    """A node of two 40 GiB, 108-SM GPUs (13.5 fGPU shares each) and the source's counters."""

    rng: random.Random
    now: float = 0.0
    kernels: dict[str, Kernel] = field(default_factory=dict)
    procs: dict[tuple[str, str], Proc] = field(default_factory=dict)  # (kernel_id, GPU) -> its process
    energy: dict[str, float] = field(default_factory=lambda: dict.fromkeys(GPUS, 0.0))
    generation: dict[str, int] = field(default_factory=lambda: dict.fromkeys(GPUS, 1))
    next_pid: int = 1000
    next_start: int = 1
    version: int = 1

    def new_kernel(self) -> None:
        kid = f"00000000-0000-4000-8000-{len(self.kernels) + self.next_pid:012d}"
        self._place(kid)

    def _place(self, kid: str) -> None:
        rng = self.rng
        gpus = rng.sample(GPUS, rng.choice((1, 1, 2)))
        if rng.random() < 0.2:
            allocs = tuple(Allocation("cuda.device", g, Decimal(1)) for g in gpus)
        else:
            allocs = tuple(Allocation("cuda.shares", g, Decimal(rng.choice(("0.5", "2.5", "5", "13.5", "20")))) for g in gpus)
        owner = Identity(kid, session_id="00000000-0000-4000-8000-00000000000d", user_id=rng.choice(USERS),
                         project_id=rng.choice(PROJECTS)) if rng.random() < 0.8 else None
        self.kernels[kid] = Kernel(kid, "/scratch", KernelState.OK, ResourceSpec(allocs, (), None), None, 0.0, owner)
        for key in [key for key in self.procs if key[0] == kid and key[1] not in gpus]:
            del self.procs[key]
        for g in gpus:
            if (kid, g) not in self.procs:
                self.procs[(kid, g)] = self._proc()
        self.version += 1

    def _proc(self) -> Proc:
        self.next_pid += 1
        self.next_start += 1
        return Proc(self.next_pid, self.next_start, self.rng.choice((0.0, 0.05, 0.3, 1.0, 1.5)))

    def event(self) -> dict:
        """One random change; returns what reads fail at the next pass."""
        rng = self.rng
        action = rng.choice(("none", "none", "start", "start", "stop", "resize", "restart", "reuse", "fail", "fail"))
        if action == "start" or not self.kernels:
            self.new_kernel()
        elif action == "stop":
            kid = rng.choice(sorted(self.kernels))
            del self.kernels[kid]
            self.procs = {k: p for k, p in self.procs.items() if k[0] != kid}
            self.version += 1
        elif action == "resize":
            self._place(rng.choice(sorted(self.kernels)))
        elif action == "restart":  # the driver reloads: every counter of the GPU starts at 0
            g = rng.choice(GPUS)
            self.generation[g] += 1
            self.energy[g] = 0.0
            for key, p in self.procs.items():
                if key[1] == g:
                    p.busy = 0.0
        elif action == "reuse" and self.procs:  # a process ends; a new one gets its PID
            key = rng.choice(sorted(self.procs))
            old = self.procs[key]
            self.next_start += 1
            self.procs[key] = Proc(old.pid, self.next_start, rng.choice((0.0, 0.5, 1.0)))
        if action == "fail":
            return {"what": rng.choice(("down", "busy", "energy", "attribution")), "gpu": rng.choice(GPUS)}
        return {}

    def advance(self, dt: float) -> None:
        self.now += dt
        for g in GPUS:
            self.energy[g] += dt * self.rng.choice((60.0, 250.0, 400.0))
        for p in self.procs.values():
            p.busy += p.rate * dt

    def read(self, fail: dict) -> tuple[TelemetrySnapshot, AttributionResult | None]:
        devices = []
        for i, g in enumerate(GPUS):
            procs = [(key[0], p) for key, p in sorted(self.procs.items()) if key[1] == g]
            down = fail.get("gpu") == g and fail.get("what") == "down"
            devices.append(DeviceReading(
                uuid=g, index=i, memory_total_bytes=40 * GIB, multiprocessor_count=108, up=not down,
                energy_joules=None if fail.get("gpu") == g and fail.get("what") == "energy" else self.energy[g],
                processes=tuple(GpuProcess(p.pid, GIB) for _, p in procs),
                process_utilization={p.pid: min(1.0, p.rate) for _, p in procs},
                process_busy_seconds=None if fail.get("gpu") == g and fail.get("what") == "busy" else {p.pid: p.busy for _, p in procs},
                busy_seconds=sum(p.busy for _, p in procs),
                nvml_generation=self.generation[g],
            ))
        snapshot = TelemetrySnapshot(source="nvml", devices=tuple(devices), success=True)
        if fail.get("what") == "attribution":
            return snapshot, None
        read = [d for d in devices if d.up]
        usages = [KernelDeviceUsage(kid, g, True, 1, GIB, min(1.0, self.procs[(kid, g)].rate), 0.0, 0.0)
                  for kid, k in sorted(self.kernels.items()) for g in {a.device_id for a in k.allocations}
                  if (kid, g) in self.procs and any(d.uuid == g for d in read)]
        processes = [ProcessUsage(d.uuid, p.pid, kid, GIB, min(1.0, p.rate), None, None, p.start)
                     for d in read for (kid, g), p in sorted(self.procs.items()) if g == d.uuid]
        return snapshot, AttributionResult(tuple(usages), (), tuple(processes), {d.uuid: True for d in read}, 0.0)


@dataclass
class Books:
    """What the test itself knows: each GPU's known seconds and its energy counter's increase."""

    first: dict[str, float] = field(default_factory=dict)
    last_energy: dict[str, tuple[int, float]] = field(default_factory=dict)
    joules: dict[str, float] = field(default_factory=dict)

    def see(self, snapshot: TelemetrySnapshot, now: float) -> None:
        for d in snapshot.devices:
            self.first.setdefault(d.uuid, now)
            if d.energy_joules is None or not d.up:
                continue
            last = self.last_energy.get(d.uuid)
            if last is None:
                delta = 0.0
            elif last[0] != d.nvml_generation or d.energy_joules < last[1]:
                delta = d.energy_joules
            else:
                delta = d.energy_joules - last[1]
            self.last_energy[d.uuid] = (d.nvml_generation, d.energy_joules)
            self.joules[d.uuid] = self.joules.get(d.uuid, 0.0) + delta


def close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * max(1.0, abs(a), abs(b))


def by_gpu(counters, gpu: str) -> float:
    return sum(v for (_, g), v in counters.items() if g == gpu)


def check(out: Accounting, books: Books, now: float, before: Accounting | None) -> None:
    for gpu, first in books.first.items():
        held = out.device_allocated_seconds[gpu]
        assert close(held + out.device_unallocated_seconds[gpu], now - first), gpu
        assert close(by_gpu(out.allocated_seconds, gpu), held)
        if gpu in out.device_busy_seconds:
            assert close(by_gpu(out.busy_seconds, gpu), out.device_busy_seconds[gpu])
        if gpu in books.last_energy:
            assert close(out.device_energy_joules[gpu] + out.device_unattributed_joules[gpu], books.joules[gpu]), gpu
            assert close(by_gpu(out.energy_joules, gpu), out.device_energy_joules[gpu])
    for key, busy in out.busy_seconds.items():
        assert busy <= out.allocated_seconds[key] + TOL * max(1.0, busy), key
    for owners, devices in ((out.owner_allocated_seconds, out.device_allocated_seconds),
                            (out.owner_busy_seconds, out.device_busy_seconds),
                            (out.owner_energy_joules, out.device_energy_joules)):
        assert close(sum(dict(owners.items()).values()), sum(dict(devices.items()).values()))
    if before is not None:
        for name in ("allocated_seconds", "busy_seconds", "energy_joules", "device_allocated_seconds",
                     "device_unallocated_seconds", "device_busy_seconds", "device_energy_joules",
                     "device_unattributed_joules", "owner_allocated_seconds", "owner_busy_seconds", "owner_energy_joules"):
            old, new = dict(getattr(before, name).items()), dict(getattr(out, name).items())
            for key, value in old.items():
                assert key in new and new[key] >= value - TOL * max(1.0, value), (name, key)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def account(acc: Accountant, sim: Sim, fail: dict) -> Accounting:
    snapshot, attribution = sim.read(fail)
    kernels = list(sim.kernels.values())
    resolver = DeviceResolver(snapshot, [a.device_id for k in kernels for a in k.allocations])
    return acc.update(kernels, snapshot, resolver, CAPACITY, attribution, version=sim.version)


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), split=st.sampled_from(ENERGY_SPLITS), steps=st.integers(1, 40))
def test_the_ledger_balances_over_random_timelines(seed: int, split: str, steps: int) -> None:
    sim = Sim(random.Random(seed))
    clock = Clock()
    acc = Accountant(clock, retention=1e12, energy_split=split)  # nothing expires: every kernel stays in the sums
    books = Books()
    sim.new_kernel()
    before = None
    for _ in range(steps):
        fail = sim.event()
        sim.advance(sim.rng.choice(INTERVALS))
        clock.now = sim.now
        snapshot, _ = sim.read(fail)
        books.see(snapshot, sim.now)
        out = account(acc, sim, fail)
        check(out, books, sim.now, before)
        before = out


def node(*kernels: tuple[str, str, str, float]) -> Sim:
    """A node with these kernels: (kernel id, GPU, cuda.shares amount, its process's busy rate)."""
    sim = Sim(random.Random(0))
    for n, (kid, gpu, amount, rate) in enumerate(kernels):
        allocs = (Allocation("cuda.shares", gpu, Decimal(amount)),)
        ident = Identity(kid, session_id=kid, user_id=USERS[n % 2])
        sim.kernels[kid] = Kernel(kid, "/scratch", KernelState.OK, ResourceSpec(allocs, (), None), None, 0.0, ident)
        sim.procs[(kid, gpu)] = Proc(4242 + n, 7 + n, rate)
    return sim


def run_for(sim: Sim, acc: Accountant, clock: Clock, interval: float, until: float, watts: float = 300.0) -> Accounting:
    out = account(acc, sim, {})
    while sim.now < until - 1e-12:
        step = min(interval, until - sim.now)
        sim.now += step
        for g in GPUS:
            sim.energy[g] += watts * step
        for p in sim.procs.values():
            p.busy += p.rate * step
        clock.now = sim.now
        out = account(acc, sim, {})
    return out


K_A, K_B = "00000000-0000-4000-8000-000000000001", "00000000-0000-4000-8000-000000000002"


@pytest.mark.parametrize("interval", [0.25, 1.0, 7.0, 120.0])
def test_busy_time_and_energy_are_the_same_at_any_pass_interval(interval: float) -> None:
    clock = Clock()
    out = run_for(node((K_A, GPUS[0], "6.75", 0.4)), Accountant(clock), clock, interval, 120.0)
    key = (K_A, GPUS[0])
    assert out.allocated_seconds[key] == pytest.approx(60.0)  # half the GPU for two minutes
    # Busy 40 % of the time on the half it holds: every busy second, none lost between passes.
    assert out.busy_seconds[key] == pytest.approx(0.5 * 0.4 * 120)
    assert out.owner_busy_seconds[(USERS[0], UNDEFINED)] == pytest.approx(0.5 * 0.4 * 120)
    # The only kernel: the allocated half of the energy is its own, the other half unattributed.
    assert out.energy_joules[key] == pytest.approx(0.5 * 300 * 120)
    assert out.device_unattributed_joules[GPUS[0]] == pytest.approx(0.5 * 300 * 120)
    assert out.device_unallocated_seconds[GPUS[0]] == pytest.approx(60.0)


@pytest.mark.parametrize(("split", "busy", "idle"), [("allocation", 0.25, 0.25), ("use", 0.5, 0.0), ("max", 0.5, 0.25)])
def test_the_energy_split_policies(split: str, busy: float, idle: float) -> None:
    """Two kernels hold a quarter of the GPU each; one is busy, the other idle."""
    clock = Clock()
    sim = node((K_A, GPUS[0], "3.375", 0.8), (K_B, GPUS[0], "3.375", 0.0))
    out = run_for(sim, Accountant(clock, energy_split=split), clock, 5.0, 100.0)
    total = 300 * 100
    assert out.energy_joules[(K_A, GPUS[0])] == pytest.approx(busy * total)
    assert out.energy_joules[(K_B, GPUS[0])] == pytest.approx(idle * total)
    assert out.device_unattributed_joules[GPUS[0]] == pytest.approx((1 - busy - idle) * total)


def test_an_interval_without_a_measured_start_is_split_by_allocation() -> None:
    clock = Clock()
    sim = node((K_A, GPUS[0], "3.375", 0.8), (K_B, GPUS[0], "3.375", 0.0))
    acc = Accountant(clock, energy_split="use")
    account(acc, sim, {"what": "busy", "gpu": GPUS[0]})  # the start of the first interval: not measured
    for _ in range(2):
        before = sim.energy[GPUS[0]]
        sim.advance(10.0)
        clock.now = sim.now
        out = account(acc, sim, {})
    # First interval by allocation (a quarter each), the second by use (the busy one's half).
    assert out.energy_joules[(K_A, GPUS[0])] == pytest.approx(0.25 * before + 0.5 * (sim.energy[GPUS[0]] - before))
    assert out.energy_joules[(K_B, GPUS[0])] == pytest.approx(0.25 * before)


def test_a_kernel_busy_beyond_its_share_is_charged_its_share() -> None:
    """Its processes together busy 1.5 s per second (concurrent, or time-sliced beyond its fifth
    of the GPU): charged every GPU-second it held, never more."""
    clock = Clock()
    sim = node((K_A, GPUS[1], "2.7", 1.5))
    out = run_for(sim, Accountant(clock), clock, 6.0, 60.0)
    key = (K_A, GPUS[1])
    assert out.busy_seconds[key] == pytest.approx(out.allocated_seconds[key]) == pytest.approx(0.2 * 60)
    assert out.device_busy_seconds[GPUS[1]] == pytest.approx(0.2 * 60)


def test_unmeasured_devices_have_no_busy_or_energy_sample_and_say_so() -> None:
    sim = Sim(random.Random(1))
    sim.new_kernel()
    clock = Clock()
    acc = Accountant(clock)
    fail = {"what": "busy", "gpu": GPUS[0]}
    out = account(acc, sim, fail)
    assert out.measured == {GPUS[0]: False, GPUS[1]: True}
    assert all(g != GPUS[0] for _, g in out.busy_seconds) and GPUS[0] not in out.device_busy_seconds
    assert any(g == GPUS[1] for _, g in out.busy_seconds) or not any(g == GPUS[1] for _, g in out.allocated_seconds)
    out = account(Accountant(clock), sim, {"what": "energy", "gpu": GPUS[1]})
    assert all(g != GPUS[1] for _, g in out.energy_joules) and GPUS[1] not in out.device_unattributed_joules
    assert GPUS[0] in out.device_unattributed_joules


def test_owner_counters_outlive_their_kernels() -> None:
    """A session shorter than a scrape interval: its kernel's series go after the retention, the
    owner's counters keep every second and joule of it."""
    sim = Sim(random.Random(2))
    clock = Clock()
    acc = Accountant(clock, retention=30)
    sim.new_kernel()
    account(acc, sim, {})
    sim.advance(5.0)
    sim.kernels.clear()  # ended before the next pass: its last interval is counted by that pass
    sim.procs.clear()
    sim.version += 1
    clock.now = sim.now
    ended = account(acc, sim, {})
    total = sum(dict(ended.owner_allocated_seconds.items()).values())
    joules = sum(dict(ended.owner_energy_joules.items()).values())
    assert total > 0 and joules > 0
    assert total == pytest.approx(sum(dict(ended.allocated_seconds.items()).values()))
    for _ in range(3):
        sim.advance(20.0)
        clock.now = sim.now
        out = account(acc, sim, {})
    assert not out.allocated_seconds and not out.energy_joules  # the kernel's series are gone
    assert sum(dict(out.owner_allocated_seconds.items()).values()) == pytest.approx(total)
    assert sum(dict(out.owner_energy_joules.items()).values()) == pytest.approx(joules)


def test_an_unchanged_unmeasured_node_publishes_in_constant_time_and_its_energy_still_balances() -> None:
    sim = Sim(random.Random(3))
    for _ in range(3):
        sim.new_kernel()
    clock = Clock()
    acc = Accountant(clock)
    books = Books()
    fail = {"what": "attribution"}
    from exporter.metrics.accounting import AccountingText, accounting_families
    from exporter.metrics.registry import render_families
    from exporter.metrics.text import inflate

    text = AccountingText()
    first = account(acc, sim, fail)
    books.see(sim.read(fail)[0], sim.now)
    text.render(first)
    for _ in range(5):
        sim.advance(10.0)
        clock.now = sim.now
        books.see(sim.read(fail)[0], sim.now)
        out = account(acc, sim, fail)
        assert out.shares is first.shares  # the fast path: nothing was walked
        check(out, books, sim.now, None)
        # The renderer keeps what it derived from the same tables; the counters it writes move.
        assert inflate(text.render(out)) == render_families(accounting_families(out))


def test_the_ledger_text_is_what_prometheus_client_writes() -> None:
    """The hand-written renderer writes every ledger family byte for byte as generate_latest,
    also as kernels, GPUs and owners come and go (its label caches follow)."""
    from exporter.metrics.accounting import AccountingText, accounting_families
    from exporter.metrics.registry import render_families
    from exporter.metrics.text import inflate

    sim = Sim(random.Random(5))
    clock = Clock()
    acc = Accountant(clock, retention=15)
    text = AccountingText()
    for _ in range(30):
        fail = sim.event()
        sim.advance(sim.rng.choice(INTERVALS[1:4]))
        clock.now = sim.now
        out = account(acc, sim, fail)
        assert inflate(text.render(out)) == render_families(accounting_families(out))
    odd = Accounting(owner_busy_seconds={('u"1\\', "p\n"): 1.5}, device_busy_seconds={'G"\\': 2.0}, measured={'G"\\': True})
    assert inflate(text.render(odd)) == render_families(accounting_families(odd))
    assert b"gpu_alloc_user_energy_joules_total" in inflate(text.render(out))


def test_a_pass_between_samples_loses_no_busy_time() -> None:
    """Allocation changes run passes on the last sample: they add no busy time and move no
    mark, so the next sample is charged over its whole span."""
    clock = Clock()
    sim = node((K_A, GPUS[0], "6.75", 0.6))
    acc = Accountant(clock)
    account(acc, sim, {})
    for _ in range(4):
        sim.advance(10.0)
        snapshot, attribution = sim.read({})
        kernels = list(sim.kernels.values())
        resolver = DeviceResolver(snapshot, [a.device_id for k in kernels for a in k.allocations])
        clock.now = sim.now
        acc.update(kernels, snapshot, resolver, CAPACITY, attribution, version=sim.version)
        clock.now = sim.now + 4.0  # a pass 4 s later on the same sample
        out = acc.update(kernels, snapshot, resolver, CAPACITY, attribution, version=sim.version)
        assert out.measured[GPUS[0]]
        sim.now += 4.0
        sim.energy[GPUS[0]] += 1.0
        sim.procs[(K_A, GPUS[0])].busy += 0.6 * 4.0
    clock.now = sim.now
    out = account(acc, sim, {})
    assert out.busy_seconds[(K_A, GPUS[0])] == pytest.approx(0.5 * 0.6 * sim.now)


COUNTER_FIELDS = ("allocated_seconds", "busy_seconds", "energy_joules", "device_allocated_seconds",
                  "device_unallocated_seconds", "device_busy_seconds", "device_energy_joules",
                  "device_unattributed_joules", "owner_allocated_seconds", "owner_busy_seconds", "owner_energy_joules")


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), split=st.sampled_from(ENERGY_SPLITS))
def test_a_pass_that_moves_only_the_changed_kernels_equals_a_settle(seed: int, split: str) -> None:
    """Two accountants see the same allocation book over a random timeline (kernels start, stop,
    resize, overcommit a GPU, use a GPU the inventory lacks, get an owner late; energy counters
    climb; some passes measure use): one told which kernels changed (so passes that measure
    nothing move only their counters), one not (every pass settles every kernel). At every pass
    every counter is the same to 1e-9, the told one's never goes down by even a rounding error,
    and it did take the short path."""
    from exporter.scratch.allocation import AllocationBook

    rng = random.Random(seed)
    clock = Clock()
    book = AllocationBook(clock)
    from exporter.metrics.accounting import AccountingText, accounting_families
    from exporter.metrics.registry import render_families
    from exporter.metrics.text import inflate

    told, walked = Accountant(clock, retention=30.0, energy_split=split), Accountant(clock, retention=30.0, energy_split=split)
    text = AccountingText()  # renders the told results at some passes: patched by the pairs that moved between
    energy = dict.fromkeys(GPUS, 0.0)
    ids = [f"00000000-0000-4000-8000-{n:012d}" for n in range(12)]
    before = None
    for _ in range(60):
        for _ in range(rng.choice((0, 1, 1, 2, 5))):
            kid, roll = rng.choice(ids), rng.random()
            if roll < 0.2:
                book.remove(kid)
            elif roll < 0.3 and book.view().kernels.get(kid) is not None:
                book.set_identity(kid, Identity(kid, user_id=rng.choice(USERS), project_id=rng.choice(PROJECTS)))
            else:
                gpus = rng.sample([*GPUS, "GPU-ffffffff-0000-4000-8000-00000000000f"] if rng.random() < 0.1 else GPUS,
                                  rng.choice((0, 1, 1, 2)))
                amount = Decimal(rng.choice(("0.5", "1.25", "2.5", "5", "13.5")))
                book.apply(kid, "/scratch", ResourceSpec(tuple(Allocation("cuda.shares", g, amount) for g in gpus), (), None))
        clock.now += rng.choice((0.0, 0.001, 0.5, 5.0, 20.0))
        for g in GPUS:
            energy[g] += (clock.now - (before[1] if before else 0.0)) * rng.choice((60.0, 300.0))
        view = book.view()
        snapshot = TelemetrySnapshot(source="nvml", success=True, devices=tuple(
            DeviceReading(uuid=g, index=i, memory_total_bytes=40 * GIB, multiprocessor_count=108, energy_joules=energy[g],
                          nvml_generation=1) for i, g in enumerate(GPUS)))
        resolver = DeviceResolver(snapshot, [a.device_id for k in view.kernels.values() for a in k.allocations])
        attribution = None
        measurable = [(kid, a.device_id) for kid, k in sorted(view.kernels.items()) for a in k.allocations]
        if measurable and rng.random() < 0.15:  # a pass that measures a kernel's use: both settle
            kid, g = measurable[0]
            attribution = AttributionResult((KernelDeviceUsage(kid, g, True, 1, GIB, 0.5, 0.0, 0.0),), (), (), {}, 0.0)
        from exporter.analysis.pipeline import _changes

        a = told.update(view.kernels.values(), snapshot, resolver, CAPACITY, attribution, version=view.version,
                        changes=lambda v, view=view: _changes(view, v))
        b = walked.update(view.kernels.values(), snapshot, resolver, CAPACITY, attribution, version=view.version)
        for name in COUNTER_FIELDS:
            ours, theirs = dict(getattr(a, name).items()), dict(getattr(b, name).items())
            assert ours.keys() == theirs.keys(), name
            assert all(close(ours[k], theirs[k]) for k in ours), name
        assert dict(a.shares) == dict(b.shares) and dict(a.kernels) == dict(b.kernels) and dict(a.measured) == dict(b.measured)
        assert told._fracs.keys() == walked._fracs.keys()
        if rng.random() < 0.5:
            assert inflate(text.render(a)) == render_families(accounting_families(a))
        if before is not None:
            for name in COUNTER_FIELDS:
                old, new = dict(getattr(before[0], name).items()), dict(getattr(a, name).items())
                assert all(new[k] >= v for k, v in old.items() if k in new), name
        before = (a, clock.now)


def test_the_ledger_says_which_pairs_moved_and_its_renderer_patches_them_only(monkeypatch) -> None:
    """A shift records the pairs it moved: a later result tells them since any earlier one of
    the same log (none: nothing moved), and nothing across a settle. The renderer then patches
    its pair order and per-pair lists at those pairs, and writes what generate_latest writes."""
    from exporter.analysis.pipeline import _changes
    from exporter.metrics import accounting as rendering
    from exporter.metrics.registry import render_families
    from exporter.metrics.text import inflate
    from exporter.scratch.allocation import AllocationBook

    clock = Clock()
    book = AllocationBook(clock)
    spec = [ResourceSpec((Allocation("cuda.shares", GPUS[n], Decimal("0.05")),), (), None) for n in range(2)]
    for n in range(200):
        book.apply(f"k{n:03}", "/scratch", spec[n % 2])
    snapshot = TelemetrySnapshot(source="nvml", success=True, devices=tuple(
        DeviceReading(uuid=g, index=i, memory_total_bytes=40 * GIB, multiprocessor_count=108) for i, g in enumerate(GPUS)))
    resolver = DeviceResolver(snapshot, GPUS)
    acc, text = Accountant(clock), rendering.AccountingText()

    def step(now: float) -> Accounting:
        clock.now = now
        view = book.view()
        out = acc.update(view.kernels.values(), snapshot, resolver, CAPACITY, None, version=view.version,
                         changes=lambda v: _changes(view, v))
        assert inflate(text.render(out)) == render_families(rendering.accounting_families(out))
        return out

    first = step(0.0)
    quiet = step(5.0)
    assert quiet.moved_since(first) == frozenset()
    made = []
    of = rendering._Aligned.of.__func__
    monkeypatch.setattr(rendering._Aligned, "of", classmethod(lambda cls, *a: made.append(a) or of(cls, *a)))
    book.apply("k000", "/scratch", spec[1])  # moves from GPU a to GPU b
    book.apply("k999", "/scratch", spec[0])  # comes
    book.remove("k001")  # goes (its counters stay for the retention)
    moved = step(10.0)
    book.apply("k002", "/scratch", spec[1])
    later = step(12.0)
    assert moved.moved_since(quiet) == {("k000", GPUS[0]), ("k000", GPUS[1]), ("k999", GPUS[0]), ("k001", GPUS[1])}
    assert later.moved_since(quiet) == moved.moved_since(quiet) | {("k002", GPUS[0]), ("k002", GPUS[1])}
    assert later.moved_since(later) == frozenset() and quiet.moved_since(later) is None
    assert made == []  # patched, never made again from every pair
    assert ("k999", GPUS[0]) in text._order and ("k000", GPUS[1]) in text._order
    settled = acc.update(book.view().kernels.values(), snapshot, resolver, CAPACITY, None)  # no version: a settle
    assert settled.moved_since(later) is None


def test_a_pass_after_a_few_changes_walks_only_them(monkeypatch) -> None:
    """200 kernels, then one changes, one comes and one goes: the pass reads only those three
    (no walk over every kernel), and its counters are a settle's."""
    from exporter.analysis.pipeline import _changes
    from exporter.scratch.allocation import AllocationBook

    clock = Clock()
    book = AllocationBook(clock)
    spec = [ResourceSpec((Allocation("cuda.shares", GPUS[n % 2], Decimal("0.05")),), (), None) for n in range(2)]
    for n in range(200):
        book.apply(f"k{n:03}", "/scratch", spec[n % 2])
    snapshot = TelemetrySnapshot(source="nvml", success=True, devices=tuple(
        DeviceReading(uuid=g, index=i, memory_total_bytes=40 * GIB, multiprocessor_count=108) for i, g in enumerate(GPUS)))
    resolver = DeviceResolver(snapshot, GPUS)
    told, walked = Accountant(clock), Accountant(clock)

    def both() -> tuple[Accounting, Accounting]:
        view = book.view()
        return (told.update(view.kernels.values(), snapshot, resolver, CAPACITY, None, version=view.version,
                            changes=lambda v: _changes(view, v)),
                walked.update(view.kernels.values(), snapshot, resolver, CAPACITY, None, version=view.version))

    both()
    clock.now = 10.0
    book.apply("k000", "/scratch", spec[1])
    book.apply("k999", "/scratch", spec[0])
    book.remove("k001")
    walks = []
    rates = Accountant._rates
    monkeypatch.setattr(Accountant, "_rates", lambda self, *a: walks.append(self) or rates(self, *a))
    clock.now = 15.0
    a, b = both()
    assert walks == [walked]  # the told one moved three kernels' counters, the other walked all 201
    for name in COUNTER_FIELDS:
        assert dict(getattr(a, name).items()) == pytest.approx(dict(getattr(b, name).items()), rel=1e-12), name
    # A pass integrates what the last one saw: k000 held GPU a until now, and GPU b from now on.
    assert a.allocated_seconds[("k000", GPUS[0])] == pytest.approx(0.05 / 13.5 * 15)
    assert a.allocated_seconds[("k000", GPUS[1])] == 0.0
    assert a.allocated_seconds[("k001", GPUS[1])] == pytest.approx(0.05 / 13.5 * 15)  # kept after it went
    clock.now = 25.0
    a, b = both()
    assert a.allocated_seconds[("k000", GPUS[1])] == pytest.approx(0.05 / 13.5 * 10)
    assert a.allocated_seconds[("k001", GPUS[1])] == pytest.approx(0.05 / 13.5 * 15)
