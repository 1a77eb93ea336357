"""The living demo node: a simulated DGX A100 running Backend.AI sessions that come and go.

Everything the exporter reads is produced the way the real thing produces it, and read through
the exporter's real paths:

* **devices**: NVIDIA's ``pynvml`` binding over the simulated ``libnvidia-ml``
  (:mod:`exporter.telemetry.nvml.simulated`, the DGX A100 preset: 8× A100-SXM4-40GB, GPUs 6 and 7
  in MIG mode), read by the exporter's own :class:`~exporter.telemetry.nvml.NvmlSource`;
* **the scratch tree**: each session's ``config/resource.txt`` written as the agent writes it
  (truncated, then written in place; ``CID=`` appended once the container runs), placed by the
  agent's EVENLY allocator (:mod:`exporter.analysis.placement`); ``config/recovery.json`` in the
  agent's schema, every kernel's rewritten in place on each start and stop, as the agent does;
* **the host**: ``/proc/<pid>`` and the cgroup v2 tree of Docker's systemd driver
  (:mod:`exporter.demo.host`), so process attribution and stale-kernel checks run on real files.

Sessions arrive at random (seeded) and leave; busy, bursty and idle kernels, a kernel that never
started a process, MIG kernels and CPU-only kernels. Allocations use only the slots a current
plugin registers (``cuda.shares`` and MIG slots; no plugin writes ``cuda.mem`` any more), so a
kernel's memory limit is its shares' (``CUDA_MEMORY_LIMITS``); one kernel's processes fill 97 % of
it. On top, a schedule of planted events: an isolation breach, a host process on a GPU, XIDs,
corrected ECC errors, a pending row remap, a thermal throttle, a GPU that falls off the bus, a
container removed out of band (its kernel turns stale), a ``resource.txt`` left half-written, a
session whose dead process's CUDA context stays (ghost memory), a sweep that strands free
capacity, and GPU resets (``nvidia-smi -r``: the energy counter restarts, which is how the
exporter's latched health tells a reset) that clear the lost GPU and, in a maintenance window,
the remapped one. Each is logged as it happens. The schedule printed at start names the alerts each fault
raises and by when the shipped rules fire and resolve them (:class:`AlertPromise`): a fault lasts
at least its alert's ``for:`` and two evaluation intervals, so some last 10 or 30 minutes.

Times are *demo seconds*: wall seconds since the start times ``time_scale``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import logging
import math
import random
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

from exporter.analysis.capacity import CapacityConfig, fractional_capacity, usable_capacity
from exporter.analysis.placement import DeviceFree, Placement, Policy, Request, place
from exporter.demo.host import SimulatedHost
from exporter.demo.tree import append_cid, recovery_json, resource_lines
from exporter.telemetry.nvml.simulated import GIB, MIB, FakeNvml

__all__ = ["AGENT_ID", "EVALUATION_INTERVAL_S", "SETTLE_S", "SHIPPED_RULES", "AlertPromise", "LivingNode", "PlannedEvent", "RuleTiming"]

log = logging.getLogger("exporter.demo")

AGENT_ID = "i-demo-dgx01"
SHARES = "cuda.shares"
UNIT_MEM = 2 * GIB  # the fractional plugin's unit_mem: a share's memory limit
_ARRIVAL_MEAN = 40.0  # demo seconds between session arrivals (exponential)
_TICK = 1.0  # wall seconds between telemetry updates of the simulated GPUs
_IMAGES = {
    "training": ("stable/pytorch", "stable", "2.3-py312-cuda12.4"),
    "inference": ("stable/vllm", "stable", "0.5.4-py310-cuda12.4"),
    "notebook": ("stable/python-ff", "stable", "24.03-py310-cuda12.4"),
    "batch": ("cloud/tensorflow", "cloud", "2.15-py312-cuda12.3"),
    "cpu": ("stable/python", "stable", "3.12-ubuntu22.04"),
}
_COMMANDS = {"training": "python3", "inference": "python3", "notebook": "python", "batch": "python3"}


@dataclass
class GpuProcess:
    """A CUDA process of a session (or of the host) on one GPU or MIG device."""

    pid: int
    gpu: int
    mig: int | None
    memory: int  # bytes
    kind: str  # training, inference, notebook (idle), batch, duty (bursts), breach, host, ghost (its process is dead)


@dataclass
class Session:
    """One Backend.AI kernel (single-kernel session) on this agent."""

    kernel_id: str
    session_id: str
    owner: str | None
    kind: str  # training, inference, notebook, batch, idle-start, mig, cpu
    allocations: dict[str, dict[str, Decimal | str]]
    container_id: str
    cpus: list[int]
    mem: str
    started: float  # demo seconds
    ends: float | None  # demo seconds; None: stays
    processes: list[GpuProcess] = field(default_factory=list)
    running: bool = False  # its container runs
    planted: str = ""  # the role it plays in a planted event
    fill: float | None = None  # of its share's memory its processes use; None: its kind's usual
    duty: bool = False  # its processes run in bursts (DUTY_BUSY_S of every DUTY_PERIOD_S), else idle


#: Prometheus' scrape and evaluation interval in deploy/prometheus/prometheus.yml, seconds.
EVALUATION_INTERVAL_S = 15.0
#: The duty-cycled kernel: busy this many seconds of every period, the period being the scrape
#: interval, so a gauge scraped every 15 s reads the same phase of the cycle each time.
DUTY_PERIOD_S = EVALUATION_INTERVAL_S
DUTY_BUSY_S = 3.0


@dataclass(frozen=True)
class RuleTiming:
    """How an alert of the shipped rules follows a fault, in seconds."""

    for_s: float  # the rule's for:
    interval_s: float = EVALUATION_INTERVAL_S  # its group's evaluation interval
    event_age_s: float = 0.0  # true this long after the fault's onset whatever it does (an XID's recent window)


#: What the demo adds to a fault before Prometheus can see it: its telemetry interval (2 s) and
#: the render, rounded up; seconds.
SETTLE_S = 5.0
#: The shipped rules (alerts/*.rules.yml) for each alert the demo announces, as Prometheus runs
#: them with deploy/prometheus/prometheus.yml. An installed package carries no rule files, so the
#: figures are repeated here; tests/demo/test_announced_alerts.py fails when they differ from the
#: files, and replays the demo through the exporter and promtool to show every announced alert
#: firing and resolving by the time the demo prints.
SHIPPED_RULES: dict[str, RuleTiming] = {
    "GpuAllocIsolationBreach": RuleTiming(for_s=120, interval_s=60),  # group gpu-alloc-kernels
    "GpuAllocGpuLost": RuleTiming(for_s=60),
    "GpuAllocDeviceNeedsReset": RuleTiming(for_s=0),  # latched: fires at once, resolves with the reset
    "GpuAllocGhostMemory": RuleTiming(for_s=120),
    # A critical XID counts as recent for global:gpu_alloc_xid_recent_seconds:threshold.
    "GpuAllocXidCritical": RuleTiming(for_s=0, event_age_s=1800),
    "GpuAllocSessionsOnUnhealthyGpu": RuleTiming(for_s=0, event_age_s=1800),
    "GpuAllocGpuResetPending": RuleTiming(for_s=900),
    "GpuAllocThermalThrottling": RuleTiming(for_s=600),
    "GpuAllocNodeFragmented": RuleTiming(for_s=1800),
}


@dataclass(frozen=True)
class AlertPromise:
    """An alert the demo announces for a planted fault, and by when it fires and resolves (demo
    seconds, for the shipped rules): ``fires_by`` is at least the rule's ``for:``, one scrape and
    one evaluation interval and :data:`SETTLE_S` after ``onset``; the fault lasts until ``ends``,
    past ``fires_by``; ``resolves_by`` as long after the later of ``ends`` and the event's age."""

    alert: str
    labels: tuple[tuple[str, str], ...]  # what tells it from the same alert about another GPU
    fault: str
    onset: float
    fires_by: float
    ends: float
    resolves_by: float
    rule: RuleTiming

    def describe(self) -> str:
        why = f"for: {_duration(self.rule.for_s)}"
        if self.rule.event_age_s:
            why += f"; the XID counts as recent for {_duration(self.rule.event_age_s)}"
        return f"{self.alert} fires by {_mmss(self.fires_by)}, resolves by {_mmss(self.resolves_by)} ({why})"


@dataclass(frozen=True)
class PlannedEvent:
    """A planted event: when (demo seconds), what, the step that makes it happen, and the alerts
    it raises."""

    at: float
    what: str
    step: Callable[[], None] = field(compare=False, repr=False)
    alerts: tuple[AlertPromise, ...] = ()


class LivingNode:
    """A simulated GPU node with its agent's scratch tree, ``/proc`` and cgroups under ``base``.

    :param base: directory for ``scratches/``, ``proc/`` and ``cgroup/`` (created).
    :param seed: makes arrivals, amounts, ids and loads reproducible.
    :param time_scale: demo seconds per wall second (20 plays the 5-minute schedule in 15 s).
    :param clock: monotonic wall seconds (injected in tests).
    :param driver_clock: the simulated driver's clock, for its samples and energy (a replay may
        pass the same as ``clock``).
    """

    def __init__(self, base: Path, *, seed: int, time_scale: float = 1.0, agent_id: str = AGENT_ID,
                 clock: Callable[[], float] = time.monotonic, driver_clock: Callable[[], float] = time.monotonic) -> None:
        if time_scale <= 0:
            raise ValueError("time scale must be positive")
        self.base = base
        self.scratch = base / "scratches"
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.host = SimulatedHost(base)
        self.seed = seed
        self.time_scale = time_scale
        self.agent_id = agent_id
        self._clock = clock
        self._rng = random.Random(seed)
        # The simulated driver samples on its own clock (the host's, as a real driver does); a
        # replay that drives the node's clock may drive the driver's too.
        self.machine = FakeNvml.dgx_a100(driver_clock)
        self.machine.max_event_wait_ms = 1000  # XID waits wake on an event; no need to poll fast
        self.sessions: dict[str, Session] = {}
        self.host_processes: list[GpuProcess] = []
        self._ghosts: list[GpuProcess] = []  # contexts of processes that died, which the driver keeps
        self._pids = itertools.count(self._rng.randrange(180_000, 240_000), 7)
        self._users = [str(uuid.UUID(int=self._rng.getrandbits(128), version=4)) for _ in range(5)]
        self._queue: list[tuple[float, int, str, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = clock()
        self._lost: set[int] = set()
        self._throttled: set[int] = set()
        self._sweeping: list[Session] = []
        self.schedule: list[PlannedEvent] = []
        self.promises: list[AlertPromise] = []
        self._shares_gpus = [g.index for g in self.machine.gpus if not g.mig_current]
        self._capacity = {
            g.index: fractional_capacity(g.memory_total, 108, CapacityConfig()) for g in self.machine.gpus
        }
        self._reset_machine()

    # -- the simulated machine ---------------------------------------------------------------

    def _reset_machine(self) -> None:
        """The preset's GPUs, with nothing running: idle clocks, no processes."""
        for gpu in self.machine.gpus:
            self.machine.set_processes(gpu.index, [])
            for _, ci in gpu.cis():
                self.machine.set_processes(gpu.index, [], mig_index=ci.mig_index)
                self.machine.set_mig_memory(gpu.index, ci.mig_index, 0)
            self.machine.update(gpu.index, process_sm={}, clocks_event=0x1)
        self._animate()

    def device_id(self, gpu: int, mig: int | None = None) -> str:
        """The id the agent's plugin writes: ``GPU-<uuid>``, or ``MIG-<uuid>`` for a MIG device."""
        g = self.machine.gpus[gpu]
        if mig is None:
            return g.uuid
        return next(ci.uuid for _, ci in g.cis() if ci.mig_index == mig)

    def _mig_devices(self) -> list[tuple[int, int, str]]:
        """(GPU, MIG index, slot) of every MIG device, in the order the agent enumerates them."""
        out = []
        for gpu in self.machine.gpus:
            for gi, ci in gpu.cis():
                out.append((gpu.index, ci.mig_index, f"cuda.device:{gi.spec.name}-mig"))
        return out

    # -- time and the event queue --------------------------------------------------------------

    def now(self) -> float:
        """Demo seconds since the start."""
        return (self._clock() - self._t0) * self.time_scale

    def _at(self, at: float, what: str, step: Callable[[], None]) -> None:
        with self._lock:
            heapq.heappush(self._queue, (at, next(self._seq), what, step))

    def _plant(self, at: float, what: str, step: Callable[[], None], alerts: tuple[AlertPromise, ...] = ()) -> None:
        self.schedule.append(PlannedEvent(at, what, step, alerts))

        def planted() -> None:
            log.info("demo event at %s: %s", _mmss(at), what)
            step()

        self._at(at, what, planted)

    def populate(self) -> None:
        """The sessions running at the start, and the schedule; the clock stands at 0 until :meth:`begin`."""
        self._t0 = self._clock()
        self._populate()

    def begin(self) -> None:
        """Start the clock (demo second 0 is now) and run the schedule on a thread."""
        with self._lock:
            self._t0 = self._clock()
        self._thread = threading.Thread(target=self._run, name="demo-node", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    @contextlib.contextmanager
    def running(self) -> Iterator[LivingNode]:
        """The simulated driver installed under ``pynvml`` and the node populated, for the duration;
        call :meth:`begin` once the exporter is ready to start the clock."""
        with self.machine.installed():
            self.populate()
            try:
                yield self
            finally:
                self.close()

    def _run(self) -> None:
        next_tick = self._clock() + _TICK
        while not self._stop.is_set():
            self.run_due()
            if self._clock() >= next_tick:
                with self._lock:
                    self._animate()
                next_tick = self._clock() + _TICK
            with self._lock:
                due = self._queue[0][0] if self._queue else math.inf
            wait = min(next_tick - self._clock(), (due - self.now()) / self.time_scale)
            self._stop.wait(max(0.0, min(wait, _TICK)))

    def tick(self) -> None:
        """Run what is due and bring the GPUs' load to now: one beat of the node's thread, for a
        caller that drives the clock itself (a replay)."""
        self.run_due()
        with self._lock:
            self._animate()

    def run_due(self) -> None:
        """Run every step whose time has come (the thread calls this; tests may too)."""
        while True:
            with self._lock:
                if not self._queue or self._queue[0][0] > self.now():
                    return
                _, _, what, step = heapq.heappop(self._queue)
                try:
                    step()
                except Exception:  # one broken step must not stop the node
                    log.exception("demo step failed: %s", what)

    # -- the node at start and the planted schedule -----------------------------------------------

    def _populate(self) -> None:
        """Sessions already running when the demo starts, and the schedule of planted events."""
        run = self._launch
        # Memory pressure as a current node shows it: no plugin writes cuda.mem any more, so a
        # kernel's memory limit is its shares' (CUDA_MEMORY_LIMITS, amount x unit_mem), and its
        # processes fill nearly all of it.
        trainer = run("training", {SHARES: Decimal(16)}, instant=True, fill=0.97)
        per_gpu = max(Decimal(str(a)) for a in trainer.allocations[SHARES].values())
        trainer.planted = (f"memory pressure: its processes use 97% of the {_gib(per_gpu * UNIT_MEM)} GiB its {per_gpu.normalize():f} shares "
                           "hold on each GPU (CUDA_MEMORY_LIMITS); see gpu_alloc_kernel_memory_used_bytes")
        steady = run("training", {SHARES: Decimal(4)}, instant=True)
        bursty = run("inference", {SHARES: Decimal("2.5")}, instant=True)
        run("notebook", {SHARES: Decimal(1)}, instant=True)
        run("notebook", {SHARES: Decimal("0.5")}, instant=True)
        run("idle-start", {SHARES: Decimal(2)}, instant=True)
        batch = run("batch", {SHARES: Decimal(6)}, instant=True)
        ghost_at = 150.0  # demo seconds
        ghosted = run("training", {SHARES: Decimal(10)}, instant=True, planted=f"ends at {_mmss(ghost_at)} leaving ghost memory")
        for profile in ("3g.20gb", "1g.5gb", "1g.5gb", "1g.5gb"):
            run("mig", {f"cuda.device:{profile}-mig": Decimal(1)}, instant=True)
        run("cpu", {}, instant=True)
        run("cpu", {}, instant=True)
        # A user's benchmark started on the host, outside any container.
        host_gpu = self._free_gpu(avoid=())
        host = GpuProcess(next(self._pids), host_gpu, None, 3 * GIB, "host")
        self.host.spawn(host.pid, "python3", started=0.0, ppid=4410)
        self.host_processes.append(host)
        self._sync_processes()
        self._animate()
        self._arrive_later(25.0)

        breach_gpu = self._free_gpu(avoid=(host_gpu, *self._gpus_of(trainer)))
        lost = self._shares_gpus[-1]
        # The duty-cycled kernel: one not on the GPU planted to fail, so its bursts last the demo.
        duty = next((x for x in (steady, batch) if x is not None and lost not in self._gpus_of(x)), None)
        if duty is not None:
            duty.duty = True
            duty.processes = [dataclasses.replace(p, kind="duty") for p in duty.processes]
            duty.planted = (f"duty-cycled: busy {DUTY_BUSY_S:g} s of every {DUTY_PERIOD_S:g} s, in step with a "
                            f"{EVALUATION_INTERVAL_S:g} s scrape, so a utilisation gauge scraped then reads one phase of "
                            "the cycle every time; gpu_alloc_kernel_busy_gpu_seconds_total counts every burst")
            self._animate()
        ecc_gpu, remap_gpu, hot_gpu = self._shares_gpus[3], self._shares_gpus[2], self._shares_gpus[1]
        stale = bursty
        xid, blast = "GpuAllocXidCritical", "GpuAllocSessionsOnUnhealthyGpu"
        self._fault(10, f"isolation breach: kernel {trainer.kernel_id} starts a process on GPU {breach_gpu}, "
                        "which it was not allocated", lambda: self._breach(trainer, breach_gpu),
                    alerts=[("GpuAllocIsolationBreach", breach_gpu)],
                    end=(200, f"the stray process of kernel {trainer.kernel_id} on GPU {breach_gpu} exits",
                         lambda: self._end_breach(trainer)))
        self._plant(15, f"XID 13 (graphics engine exception, an application fault) on GPU {self._gpus_of(trainer)[0]}",
                    lambda: self.machine.push_xid(self._gpus_of(trainer)[0], 13))
        self._plant(30, f"3 corrected ECC errors on GPU {ecc_gpu}", lambda: self._ecc(ecc_gpu, 3))
        self._plant(45, "the agent stops half-way through writing a new kernel's resource.txt "
                        "(pending, then stale after --stale.grace)", self._half_written)
        self._plant(50, f"5 more corrected ECC errors on GPU {ecc_gpu}", lambda: self._ecc(ecc_gpu, 5))
        latched = "GpuAllocDeviceNeedsReset"
        self._fault(60, f"GPU {lost} falls off the bus (XID 79); its processes die; the exporter holds it lost until a reset",
                    lambda: self._fall_off(lost), alerts=[(xid, lost), (blast, lost), ("GpuAllocGpuLost", lost), (latched, lost)],
                    end=(180, f"GPU {lost} is reset (nvidia-smi -r -i {lost}) and answers again: its energy counter restarts, "
                              "which the exporter takes for the reset that clears lost", lambda: self._reset(lost)))
        self._fault(75, f"a memory row of GPU {remap_gpu} is remapped, pending a GPU reset (XID 63); the exporter holds it "
                        "needs_reset until a reset",
                    lambda: self._remap(remap_gpu), alerts=[(xid, remap_gpu), (blast, remap_gpu),
                            ("GpuAllocGpuResetPending", remap_gpu), (latched, remap_gpu)],
                    end=(None, f"GPU {remap_gpu} is reset in a maintenance window (nvidia-smi -r -i {remap_gpu}, its processes "
                               "killed first): the remapped row takes effect and the exporter clears needs_reset",
                         lambda: self._reset(remap_gpu)))
        self._fault(90, f"GPU {hot_gpu} overheats: sw_thermal_slowdown holds its clocks down",
                    lambda: self._throttle(hot_gpu, True), alerts=[("GpuAllocThermalThrottling", hot_gpu)],
                    end=(None, f"GPU {hot_gpu} cools down (throttling ends)", lambda: self._throttle(hot_gpu, False)))
        self._plant(120, f"the container of kernel {stale.kernel_id} is removed out of band (docker rm -f); "
                         "its scratch directory stays behind: a stale kernel",
                    lambda: self._remove_out_of_band(stale))
        ghost_gpu = self._gpus_of(ghosted)[0]
        ghost_bytes = sum(p.memory for p in ghosted.processes)
        usable = usable_capacity(self._capacity[ghost_gpu], self.machine.gpus[ghost_gpu].memory_total,
                                 self.machine.gpus[ghost_gpu].memory_reserved + ghost_bytes, CapacityConfig())
        self._fault(ghost_at, f"session {ghosted.session_id} ends: the agent removes kernel {ghosted.kernel_id}'s container and "
                         f"scratch directory, but the CUDA context of its dead process stays: NVML keeps listing "
                         f"{_gib(ghost_bytes)} GiB on GPU {ghost_gpu} for it (ghost memory; GPU {ghost_gpu} can hand out "
                         f"{usable} of its {self._capacity[ghost_gpu]} shares until it is freed)",
                    lambda: self._end_leaving_ghost(ghosted), alerts=[("GpuAllocGhostMemory", ghost_gpu)],
                    end=(450, f"the dead process's context on GPU {ghost_gpu} is torn down at last: its memory is free again",
                         self._free_ghosts))
        self._fault(465, "a hyper-parameter sweep fills every GPU but a sliver, and refills what others free: enough "
                         "fGPU free in total, too little on any one GPU (stranded)", self._sweep,
                    alerts=[("GpuAllocNodeFragmented", None)], end=(None, "the sweep ends", self._end_sweep))

    def _fault(self, at: float, what: str, step: Callable[[], None], *, alerts: list[tuple[str, int | None]],
               end: tuple[float | None, str, Callable[[], None]]) -> None:
        """Plant a fault at ``at`` and its end, announcing the alerts it fires (each about a GPU, or
        the node). The fault lasts until every alert has fired under :data:`SHIPPED_RULES` and one
        evaluation interval more, or until ``end[0]`` if that is later."""
        until, ended, end_step = end
        promised = [(name, gpu, SHIPPED_RULES[name]) for name, gpu in alerts]
        # A fault is seen one scrape and one evaluation after it happens (plus SETTLE_S); its alert
        # fires for: later, at that evaluation.
        fires = {name: _round_up(at + rule.for_s + 2 * rule.interval_s + SETTLE_S) for name, _, rule in promised}
        ends = max([until or 0.0, *(fires[name] + rule.interval_s for name, _, rule in promised)])
        made = []
        for name, gpu, rule in promised:
            resolves = _round_up(max(ends, at + rule.event_age_s) + 2 * rule.interval_s + SETTLE_S)
            labels = (("device_id", self.device_id(gpu)),) if gpu is not None else ()
            made.append(AlertPromise(name, labels, what, at, fires[name], ends, resolves, rule))
        self.promises.extend(made)
        self._plant(at, what, step, tuple(made))
        self._plant(ends, ended, end_step)

    def describe(self) -> str:
        """What runs on the node now and what will happen when: printed at start."""
        with self._lock:
            lines = [f"simulated node {self.agent_id}: {len(self.machine.gpus)}x {self.machine.gpus[0].name} "
                     f"(driver {self.machine.driver_version}), seed {self.seed}"
                     + (f", time x{self.time_scale:g}" if self.time_scale != 1 else "")]
            for gpu in self.machine.gpus:
                if gpu.mig_current:
                    layout = ", ".join(gi.spec.name for gi in gpu.gis)
                    lines.append(f"  GPU {gpu.index} {gpu.uuid}: MIG {layout}")
                else:
                    lines.append(f"  GPU {gpu.index} {gpu.uuid}: {self._capacity[gpu.index]} fGPU shares")
            lines.append(f"sessions ({len(self.sessions)}):")
            for s in self.sessions.values():
                what = "; ".join(f"{slot} " + ", ".join(f"{self._short(d)}:{a}" for d, a in per.items())
                                 for slot, per in s.allocations.items()) or "CPU only"
                lines.append(f"  {s.kernel_id} {s.kind:<10} {what}" + (f" ({s.planted})" if s.planted else ""))
            for p in self.host_processes:
                lines.append(f"  host process {p.pid} on GPU {p.gpu}, outside any container (unattributed: its memory counts "
                             "as ghost memory while it runs)")
            lines.append(f"new sessions arrive about every {_ARRIVAL_MEAN:g}s and leave after 1.5-5 minutes; planned:")
            lines.append(f"  (alerts: by when the shipped rules fire and resolve them, with Prometheus scraping and evaluating "
                         f"every {EVALUATION_INTERVAL_S:g} s as deploy/prometheus/prometheus.yml does")
            if self.time_scale != 1:
                lines[-1] += (f"; times are demo time, which runs {self.time_scale:g} times faster: alerts keep to them only "
                              f"where Prometheus' for: and intervals are divided by {self.time_scale:g} too")
            lines[-1] += ")"
            for e in sorted(self.schedule, key=lambda e: e.at):
                lines.append(f"  {_mmss(e.at)}  {e.what}")
                lines.extend(f"           {a.describe()}" for a in e.alerts)
            return "\n".join(lines)

    def _short(self, device_id: str) -> str:
        for gpu in self.machine.gpus:
            if gpu.uuid == device_id:
                return f"GPU{gpu.index}"
            for gi, ci in gpu.cis():
                if ci.uuid == device_id:
                    return f"GPU{gpu.index}/{gi.spec.name}"
        return device_id

    # -- sessions ------------------------------------------------------------------------------

    def _free(self, slot: str) -> list[DeviceFree]:
        """Devices of ``slot`` with what live kernels hold (the agent's alloc map), in its order."""
        held: dict[str, Decimal] = {}
        for s in self.sessions.values():
            if s.running or s.planted != "stale":
                for device, amount in s.allocations.get(slot, {}).items():
                    held[device] = held.get(device, Decimal(0)) + Decimal(str(amount))
        if slot == SHARES:
            ids = [(self.device_id(i), self._capacity[i]) for i in self._shares_gpus if i not in self._lost]
        else:
            ids = [(self.device_id(g, m), Decimal(1)) for g, m, s in self._mig_devices() if s == slot]
        return [DeviceFree(d, cap, held.get(d, Decimal(0))) for d, cap in ids]

    def _launch(self, kind: str, request: dict[str, Decimal], *, instant: bool = False, duration: float | None = None,
                planted: str = "", fill: float | None = None, half_written: bool = False) -> Session | None:
        """A session arrives: placed by EVENLY on what live kernels leave free, or rejected (logged).

        ``instant``: already running when the demo starts. ``half_written``: the agent stops after
        the first lines of resource.txt and never starts the container.
        """
        allocations: dict[str, dict[str, Decimal | str]] = {}
        for slot, amount in request.items():
            result = place(self._free(slot), Request(slot, amount), Policy.EVENLY)
            if not isinstance(result, Placement):
                log.info("demo: a %s session asking %s=%s is rejected (%s: %s)", kind, slot, amount, result.reason, result.detail)
                return None
            allocations[slot] = dict(result.amounts)
        rng = self._rng
        cpus = sorted(rng.sample(range(256), {"cpu": 8, "training": 16, "batch": 8}.get(kind, 4)))
        session = Session(
            kernel_id=str(uuid.UUID(int=rng.getrandbits(128), version=4)),
            session_id=str(uuid.UUID(int=rng.getrandbits(128), version=4)),
            owner=rng.choice(self._users) if kind != "batch" else None,
            kind=kind, allocations=allocations, container_id=f"{rng.getrandbits(256):064x}",
            cpus=cpus, mem={"training": "64g", "batch": "32g", "cpu": "16g"}.get(kind, "8g"),
            started=self.now(), ends=None if duration is None else self.now() + duration, planted=planted, fill=fill,
        )
        self.sessions[session.kernel_id] = session
        if half_written:
            self._write(session, complete=False)
        elif instant:
            self._write(session, complete=True)
            self._start_container(session)
            self._start_processes(session)
        else:
            # truncate-and-write in place, CID= after the container starts, processes a little later
            self._write(session, complete=False)
            self._at(self.now() + 0.4, "resource.txt completed", lambda: self._write(session, complete=True))
            self._at(self.now() + 2, "container started", lambda: self._start_container(session))
            self._at(self.now() + 5, "processes started", lambda: self._start_processes(session))
        if session.ends is not None and not half_written:
            self._at(session.ends, "session ends", lambda: self._terminate(session))
        return session

    def _write(self, s: Session, *, complete: bool) -> None:
        kdir = self.scratch / s.kernel_id
        (kdir / "config").mkdir(parents=True, exist_ok=True)
        (kdir / "work").mkdir(exist_ok=True)
        mounts = [f"{kdir}/config:/home/config:ro", f"{kdir}/work:/home/work:rw", "/etc/localtime:/etc/localtime:ro",
                  "backendai-krunner.v10.x86_64.ubuntu22.04:/opt/backend.ai:ro"]
        lines = resource_lines(s.allocations, cpus=s.cpus, mem=s.mem, mounts=mounts, tail=self._cuda_tail(s))
        if s.running:
            lines.append(f"CID={s.container_id}")
        path = kdir / "config" / "resource.txt"
        # The agent opens the file with "w" (truncate) and writes: a reader can see any prefix.
        with path.open("w") as f:
            f.write("".join(line + "\n" for line in (lines if complete else lines[:3])))

    def _cuda_tail(self, s: Session) -> list[str]:
        shares = s.allocations.get(SHARES)
        if not shares:
            return []
        return [
            "CUDA_GLOBAL_DEVICE_IDS=" + ",".join(f"{n}:{d}" for n, d in enumerate(shares)),
            "CUDA_RESOURCE_VIRTUALIZED=1",
            "CUDA_MEMORY_LIMITS=" + ",".join(f"{d}:{int(Decimal(str(a)) * UNIT_MEM)}" for d, a in shares.items()),
            "CUDA_PROCESSOR_LIMITS=" + ",".join(f"{d}:{int(Decimal(str(a)) * 8)}" for d, a in shares.items()),
            "CUDA_RESERVED_MEMORY=0",
        ]

    def _start_container(self, s: Session) -> None:
        if s.kernel_id not in self.sessions:
            return
        self.host.start_container(s.container_id)
        s.running = True
        append_cid(self.scratch / s.kernel_id / "config" / "resource.txt", s.container_id)
        self._write_recovery_files()

    def _start_processes(self, s: Session) -> None:
        if not s.running or s.kind in ("cpu", "idle-start"):
            return
        kdir = self.scratch / s.kernel_id
        init = next(self._pids)
        self.host.spawn(init, "tini", started=self.now(), container_id=s.container_id, scratch_dir=kdir, ppid=1187)
        for per_device in s.allocations.values():
            for device, amount in per_device.items():
                gpu, mig = self._locate(device)
                if gpu in self._lost:
                    continue
                if mig is not None:
                    gi = next(gi for gi, ci in self.machine.gpus[gpu].cis() if ci.mig_index == mig)
                    memory = int(gi.spec.memory_mib * MIB * self._rng.uniform(0.3, 0.8))
                else:
                    # Of the memory the share holds: the plugin's limit, CUDA_MEMORY_LIMITS (amount x unit_mem).
                    fill = s.fill or {"training": 0.85, "inference": 0.55, "notebook": 0.3, "batch": 0.7}[s.kind]
                    memory = int(Decimal(str(amount)) * UNIT_MEM * Decimal(str(fill)))
                pid = next(self._pids)
                self.host.spawn(pid, _COMMANDS.get(s.kind, "python3"), started=self.now(), container_id=s.container_id,
                                scratch_dir=kdir, ppid=init)
                s.processes.append(GpuProcess(pid, gpu, mig, memory, "duty" if s.duty else s.kind))
        self._sync_processes()

    def _terminate(self, s: Session) -> None:
        """The session ends: processes exit, the container goes, the agent removes the scratch directory."""
        if self.sessions.pop(s.kernel_id, None) is None:
            return
        for p in s.processes:
            self.host.exit(p.pid)
        s.processes.clear()
        self.host.remove_container(s.container_id)
        shutil.rmtree(self.scratch / s.kernel_id, ignore_errors=True)
        self._sync_processes()
        self._write_recovery_files()
        log.info("demo: session %s (%s) ended", s.kernel_id, s.kind)
        if self._sweeping and s not in self._sweeping:
            self._sweep()  # the sweep's next trials take the room

    def _write_recovery_files(self) -> None:
        """Every running kernel's ``config/recovery.json``, rewritten in place (not atomically), as the
        agent's kernel registry does on every kernel start and stop."""
        for s in self.sessions.values():
            if not s.running:
                continue
            text = recovery_json(
                s.kernel_id, s.session_id, s.owner, agent_id=self.agent_id,
                session_type=s.kind if s.kind in ("batch", "inference") else "interactive",
                image=_IMAGES["notebook" if s.kind in ("idle-start", "mig") else s.kind])
            path = self.scratch / s.kernel_id / "config" / "recovery.json"
            with contextlib.suppress(FileNotFoundError), path.open("w") as f:
                f.write(text)

    def _arrive_later(self, delay: float) -> None:
        self._at(self.now() + delay, "a session arrives", self._arrive)

    def _arrive(self) -> None:
        rng = self._rng
        if self._sweeping:  # the scheduler sees no room on this node meanwhile
            self._arrive_later(rng.expovariate(1 / _ARRIVAL_MEAN))
            return
        kind = rng.choice(["training", "inference", "notebook", "batch", "notebook", "mig"])
        duration = rng.uniform(90, 300)
        if kind == "mig":
            slot = rng.choice(sorted({slot for _, _, slot in self._mig_devices()}))
            s = self._launch("mig", {slot: Decimal(1)}, duration=duration)
        else:
            amount = Decimal(rng.choice(["0.5", "1", "1.5", "2", "2.5", "3", "4", "8"]))
            s = self._launch(kind, {SHARES: amount}, duration=duration)
        if s is not None:
            log.info("demo: session %s (%s) arrives: %s", s.kernel_id, kind,
                     "; ".join(f"{slot} " + ", ".join(f"{self._short(d)}:{a}" for d, a in per.items())
                               for slot, per in s.allocations.items()))
        self._arrive_later(rng.expovariate(1 / _ARRIVAL_MEAN))

    # -- processes and device load ------------------------------------------------------------

    def _locate(self, device_id: str) -> tuple[int, int | None]:
        for gpu in self.machine.gpus:
            if gpu.uuid == device_id:
                return gpu.index, None
            for _, ci in gpu.cis():
                if ci.uuid == device_id:
                    return gpu.index, ci.mig_index
        raise KeyError(device_id)

    def _gpus_of(self, s: Session) -> list[int]:
        return [self._locate(d)[0] for d in s.allocations.get(SHARES, {})]

    def _free_gpu(self, avoid: tuple[int, ...]) -> int:
        """A whole GPU, preferring the least loaded, not in ``avoid`` and not the one planted to fail."""
        candidates = [i for i in self._shares_gpus[:-1] if i not in avoid] or self._shares_gpus[:1]
        load = {i: sum(Decimal(str(a)) for s in self.sessions.values() for d, a in s.allocations.get(SHARES, {}).items()
                       if d == self.device_id(i)) for i in candidates}
        return min(candidates, key=lambda i: (load[i], i))

    def _all_processes(self) -> list[GpuProcess]:
        """What NVML lists: the sessions' processes, the host's, and dead ones whose contexts stay."""
        return [p for s in self.sessions.values() for p in s.processes] + self.host_processes + self._ghosts

    def _sync_processes(self) -> None:
        """NVML's process lists from the processes that run now."""
        per_gpu: dict[int, list[tuple[int, int]]] = {g.index: [] for g in self.machine.gpus}
        per_mig: dict[tuple[int, int], list[tuple[int, int]]] = {(g, m): [] for g, m, _ in self._mig_devices()}
        for p in self._all_processes():
            if p.gpu in self._lost:
                continue
            if p.mig is None:
                per_gpu[p.gpu].append((p.pid, p.memory))
            else:
                per_mig[(p.gpu, p.mig)].append((p.pid, p.memory))
        for gpu, procs in per_gpu.items():
            if not self.machine.gpus[gpu].mig_current:
                self.machine.set_processes(gpu, procs)
        for (gpu, mig), procs in per_mig.items():
            self.machine.set_processes(gpu, procs, mig_index=mig)
            self.machine.set_mig_memory(gpu, mig, sum(m for _, m in procs))

    def _animate(self) -> None:
        """Utilisation, memory, power, temperature and clocks of every GPU from what runs on it."""
        t = self.now()
        procs = [p for p in self._all_processes() if p.gpu not in self._lost]
        for gpu in self.machine.gpus:
            if gpu.index in self._lost:
                continue
            mine = [p for p in procs if p.gpu == gpu.index and p.mig is None]
            sm = {p.pid: _sm_percent(p, t) for p in mine}
            busy = min(100, sum(sm.values()))
            if gpu.mig_current:
                busy = min(100, 35 * len([p for p in procs if p.gpu == gpu.index]))
            hot = gpu.index in self._throttled
            power = min(gpu.power_limit_mw, 52_000 + 3_300 * busy)
            reasons = 0x1 if not busy else (0x4 if power >= gpu.power_limit_mw * 0.97 else 0x0)
            extra: dict[str, object] = {}
            duty = {p.pid for p in mine if p.kind == "duty"}
            if duty or "process_sm" in gpu.patterns:
                patterns = {k: v for k, v in gpu.patterns.items() if k != "process_sm"}
                if duty:
                    patterns["process_sm"] = self._duty_bursts(duty, {pid: v for pid, v in sm.items() if pid not in duty})
                extra["patterns"] = patterns
            self.machine.update(
                gpu.index,
                util_gpu=0 if gpu.mig_current else busy,
                util_memory=0 if gpu.mig_current else busy * 55 // 100,
                memory_used=sum(p.memory for p in mine) or 4 * MIB,  # a driver context when nothing runs
                process_sm=sm,
                power_mw=power,
                temperature=88 if hot else 31 + busy * 40 // 100,
                sm_clock=1095 if hot else (1410 if busy else 210),
                clocks_event=(reasons & ~0x1) | 0x20 if hot else reasons,
                **extra,
            )

    def _duty_bursts(self, duty: set[int], others: dict[int, int]) -> Callable[[float], dict[int, int]]:
        """The SM % of a GPU's processes as a pattern of the driver's clock (seconds), which the
        simulated driver evaluates at the start of each sampling period: the duty-cycled ones
        busy exactly DUTY_BUSY_S of every DUTY_PERIOD_S of demo time (on the node's clock, the
        driver's in the demo), the others as this tick set them. Set at the 1 s ticks instead, a
        burst would last three tick intervals (each late by the thread's wake-up), 2 to 3.3 s."""

        def process_sm(t: float) -> dict[int, int]:
            return {**others, **dict.fromkeys(duty, _duty_percent((t - self._t0) * self.time_scale))}

        return process_sm

    # -- planted events -------------------------------------------------------------------------

    def _breach(self, s: Session, gpu: int) -> None:
        if s.kernel_id not in self.sessions or not s.running:
            return
        pid = next(self._pids)
        self.host.spawn(pid, "python3", started=self.now(), container_id=s.container_id, scratch_dir=self.scratch / s.kernel_id)
        s.processes.append(GpuProcess(pid, gpu, None, 2 * GIB, "breach"))
        self._sync_processes()

    def _end_breach(self, s: Session) -> None:
        for p in [p for p in s.processes if p.kind == "breach"]:
            s.processes.remove(p)
            self.host.exit(p.pid)
        self._sync_processes()

    def _ecc(self, gpu: int, count: int) -> None:
        self.machine.update(gpu, ecc_corrected=self.machine.gpus[gpu].ecc_corrected + count)

    def _remap(self, gpu: int) -> None:
        correctable, uncorrectable, _, failure = self.machine.gpus[gpu].remapped_rows or (0, 0, 0, 0)
        self.machine.update(gpu, remapped_rows=(correctable + 1, uncorrectable, 1, failure),
                            ecc_corrected=self.machine.gpus[gpu].ecc_corrected + 16)
        self.machine.push_xid(gpu, 63)

    def _reset(self, gpu: int) -> None:
        """``nvidia-smi -r``: it needs the GPU idle, so its processes are killed first; then the GPU
        answers again, a pending row remap takes effect and its energy counter restarts (the sign
        of a reset the exporter's latched health waits for)."""
        self._kill_processes(gpu)
        self._lost.discard(gpu)
        self.machine.reset(gpu)
        self._sync_processes()
        self._animate()

    def _throttle(self, gpu: int, on: bool) -> None:
        (self._throttled.add if on else self._throttled.discard)(gpu)
        self._animate()

    def _fall_off(self, gpu: int) -> None:
        self.machine.push_xid(gpu, 79)
        self.machine.lose(gpu)
        self._lost.add(gpu)
        self._kill_processes(gpu)  # CUDA calls fail: the processes on it die
        self._sync_processes()

    def _kill_processes(self, gpu: int) -> None:
        """Every process on GPU ``gpu`` exits (its sessions stay); a ghost context there goes too."""
        for s in self.sessions.values():
            for p in [p for p in s.processes if p.gpu == gpu]:
                s.processes.remove(p)
                self.host.exit(p.pid)
        for p in [p for p in self.host_processes if p.gpu == gpu]:
            self.host_processes.remove(p)
            self.host.exit(p.pid)
        self._ghosts = [p for p in self._ghosts if p.gpu != gpu]

    def _end_leaving_ghost(self, s: Session) -> None:
        """The session ends as usual, but the driver keeps its whole-GPU processes' contexts: NVML
        lists their memory for PIDs that no longer exist."""
        if s.kernel_id not in self.sessions:
            return
        self._ghosts += [dataclasses.replace(p, kind="ghost") for p in s.processes if p.mig is None and p.gpu not in self._lost]
        self._terminate(s)

    def _free_ghosts(self) -> None:
        self._ghosts.clear()
        self._sync_processes()
        self._animate()

    def _remove_out_of_band(self, s: Session) -> None:
        if s.kernel_id not in self.sessions:
            return
        s.planted = "stale"
        s.processes.clear()
        self.host.remove_container(s.container_id)
        s.running = False
        s.ends = None
        self._sync_processes()

    def _sweep(self) -> None:
        # Fill each GPU to within 0.3-0.45 shares of its capacity, one EVENLY placement at a time;
        # again whenever a session ends meanwhile, as a sweep's queue of trials would.
        for _ in range(3 * len(self._shares_gpus)):
            roomy = [d for d in self._free(SHARES) if d.free >= Decimal("0.5")]
            if not roomy:
                break
            target = min(roomy, key=lambda d: d.free)
            amount = target.free - Decimal("0.3") - Decimal(self._rng.randrange(0, 16)) / 100
            s = self._launch("training", {SHARES: amount}, instant=True)
            if s is None:
                break
            self._sweeping.append(s)

    def _end_sweep(self) -> None:
        for s in self._sweeping:
            self._terminate(s)
        self._sweeping.clear()

    def _half_written(self) -> None:
        # The agent gave up on it: it holds nothing in the agent's own map ("stale" for _free).
        self._launch("notebook", {SHARES: Decimal(1)}, planted="stale", half_written=True)


def _duty_percent(t: float) -> int:
    """SM utilisation of a duty-cycled process at demo time ``t``: busy DUTY_BUSY_S of every DUTY_PERIOD_S."""
    return 100 if t % DUTY_PERIOD_S < DUTY_BUSY_S else 0


def _sm_percent(p: GpuProcess, t: float) -> int:
    """SM utilisation of one process at demo time ``t``, in percent."""
    phase = (p.pid % 97) / 97
    if p.kind == "duty":  # every process of the kernel in the same bursts
        return _duty_percent(t)
    if p.kind == "training":
        return int(86 + 10 * math.sin(2 * math.pi * (t / 180 + phase)))
    if p.kind == "batch":
        return int(60 + 25 * math.sin(2 * math.pi * (t / 240 + phase)))
    if p.kind == "inference":  # bursts of requests
        return 62 if (t / 40 + phase) % 1 < 0.35 else 3
    if p.kind == "breach":
        return 30
    if p.kind == "host":
        return int(45 + 40 * math.sin(2 * math.pi * (t / 90 + phase)))
    return 0  # a notebook holding memory between cells


def _gib(nbytes: float) -> str:
    """Bytes in GiB as the demo prints them (``16``, ``16.5``)."""
    return f"{nbytes / GIB:.1f}".removesuffix(".0")


def _mmss(seconds: float) -> str:
    return f"+{int(seconds) // 60}:{int(seconds) % 60:02d}"


def _duration(seconds: float) -> str:
    """``1800`` → ``30m``, as a rule's ``for:`` reads."""
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes}m{rest}s".replace("m0s", "m") if minutes else f"{rest}s"


def _round_up(seconds: float, step: float = 5.0) -> float:
    """Up to a multiple of ``step`` seconds, so the announced times read easily."""
    return math.ceil(seconds / step) * step
