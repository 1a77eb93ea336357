"""The analysis pipeline: allocation view + telemetry snapshot -> one :class:`~exporter.analysis.model.Analysis`.

Two threads run it, each over whatever moved since its last pass, coalescing any number of
changes into one result. The *usage* thread wakes when the sampler publishes (or at the latest
every ``interval`` seconds); the *allocation* thread when the allocation book changes, or when a
usage pass moved what placement reads. So a kernel change reaches headroom without waiting for
a usage pass, however long that one takes:

* **join** (either thread): the device resolver (allocation ids <-> telemetry devices) and the
  inventory, again only when the snapshot or the set of allocated GPU ids changed;
* **liveness** (usage): stale kernels from the cgroup tree, on a usage pass, when the kernels changed
  or every :data:`STALE_CHECK_SECONDS`;
* **usage** (usage): process attribution, ghost memory, device health and accounting, on every new
  telemetry sample (or interval);
* **allocation** (allocation): the node state, its headroom figures, the ratio map's divisors, allocations
  on unknown devices and each agent's share, again whenever the view, the inventory, the
  liveness or the ghost memory per device changed: a kernel change reaches headroom in one
  pass, without waiting for a sample.

A stage whose inputs are the same objects as last time keeps its output, so a pass costs what
changed. While kernels change, the usage thread steps aside (:mod:`exporter.foreground`): before a
pass, before the ledger and between the steps of the render ahead
(:meth:`AnalysisPipeline.step_aside`) it waits for a quiet spell, within a bound. It observes the
allocation view, and the time the ledger counts it from, when it wakes, before it steps aside: a
change delays a pass's work, never what the pass observes, so a kernel that comes and goes while
the thread waits is still counted for the time it held its share. :func:`analyse` is the same
computation as a pure function (tests, ``scan``, ``simulate``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from exporter.analysis.accounting import Accountant, Accounting
from exporter.analysis.agents import AgentLayout, agent_headroom, agent_views
from exporter.analysis.attribution import AttributionResult, AttributionTracker
from exporter.analysis.capacity import CapacityConfig, is_fractional_slot
from exporter.analysis.ghost import GhostMemory, GhostTracker
from exporter.analysis.health import HealthTracker
from exporter.analysis.liveness import (
    CgroupScan,
    KernelLiveness,
    Liveness,
    classify_kernels,
    scan_cgroups,
    summarise,
    time_moves,
)
from exporter.analysis.model import AgentShare, Analysis
from exporter.analysis.node import (
    HeadroomParams,
    Inventory,
    headroom_figures,
    inventory_from_snapshot,
    node_state,
    ratio_capacities,
)
from exporter.analysis.shapes import DEFAULT_SHAPES, Shape, shape_figures
from exporter.foreground import ASIDE_AT_MOST_SECONDS, QUIET_SECONDS, Foreground
from exporter.scratch.allocation import AllocationView, Kernel
from exporter.scratch.identity import UNDEFINED
from exporter.telemetry.devices import DeviceResolver
from exporter.telemetry.model import TelemetrySnapshot

__all__ = ["STALE_CHECK_SECONDS", "AnalysisPipeline", "PipelineConfig", "analyse", "device_join"]

log = logging.getLogger(__name__)

# Staleness moves on a scale of minutes: a changed kernel is judged at once, the kernels in their grace
# period every this many seconds.
STALE_CHECK_SECONDS = 30.0
_LOG_KERNELS = 5  # kernels named in one stale-change log line; the rest are counted
_JUDGED_APART = 256  # past this many changed kernels, judging every kernel costs less than the merge
_SINGLE = AgentLayout(roots=())
_NOTHING_COUNTED = Accounting()  # the ledger before its first pass: no counter yet
_DEFAULTS = HeadroomParams()


@dataclass(frozen=True)
class PipelineConfig:
    """What the pipeline is told (resolved by the configuration, never read here).

    :param interval: seconds between usage passes when no telemetry sample arrives.
    :param cgroupfs: the cgroup tree for stale kernels; None: staleness is not judged.
    :param stale_grace: seconds a scratch directory may lack its container before it is stale.
    """

    params: HeadroomParams = _DEFAULTS
    layout: AgentLayout = _SINGLE
    device_id_scheme: str = "auto"
    interval: float = 5.0
    cgroupfs: str | Path | None = None
    stale_grace: float = 300.0
    shapes: tuple[Shape, ...] = DEFAULT_SHAPES  # --fleet.shape: request shapes judged per node
    quiet: float = QUIET_SECONDS  # the usage thread steps aside for kernel changes (exporter.foreground)
    aside_at_most: float = ASIDE_AT_MOST_SECONDS


def _moved(before: Mapping[str, KernelLiveness], after: Mapping[str, KernelLiveness],
           judged: frozenset[str] | None) -> bool:
    """Whether any verdict differs; only the ``judged`` kernels' can (None: any kernel's). At
    10,000 kernels a comparison of every verdict holds the GIL ~2 ms after each change."""
    if judged is None:
        return after != before
    return any(after.get(kid) != before.get(kid) for kid in judged)


def _recounted(counts: Mapping[Liveness, int], before: Mapping[str, KernelLiveness], after: Mapping[str, KernelLiveness],
               judged: frozenset[str]) -> dict[Liveness, int]:
    """``counts`` (the verdicts per status of ``before``) moved by the ``judged`` kernels' verdicts."""
    new = dict(counts)
    for kid in judged:
        if (verdict := before.get(kid)) is not None:
            new[verdict.status] = new.get(verdict.status, 0) - 1
        if (verdict := after.get(kid)) is not None:
            new[verdict.status] = new.get(verdict.status, 0) + 1
    return {status: n for status, n in new.items() if n}  # as summarise counts


def gpu_ids(view: AllocationView) -> frozenset[str]:
    # Only GPU slots decide the id scheme: CPU core ids ("0", "1") would look like ordinals.
    return frozenset(d for d, slot in view.device_totals if slot.startswith("cuda."))


def device_join(view: AllocationView, snapshot: TelemetrySnapshot, scheme: str = "auto") -> tuple[DeviceResolver, Inventory]:
    """How this node's allocated device ids map to the snapshot's devices, and the inventory so spelled."""
    resolver = DeviceResolver(snapshot, gpu_ids(view), scheme)
    return resolver, inventory_from_snapshot(snapshot, resolver)


def _changes(view: AllocationView, version: Hashable) -> dict[str, Kernel | None] | None:
    """The kernels of ``view`` changed since ``version`` (kernel id -> the kernel, None where it
    went), or None where the book no longer knows."""
    ids = view.changed_since(version) if isinstance(version, int) else None
    return None if ids is None else {kid: view.kernels.get(kid) for kid in ids}


def _canonical_ids(resolver: DeviceResolver) -> Callable[[str], str]:
    """An allocated device id -> the inventory's spelling of the device it names (itself where it
    names none), memoised: one GPU written ``GPU-<uuid>`` by one kernel and ``<uuid>`` by another
    is one device of the node state."""
    memo: dict[str, str] = {}

    def canonical(device_id: str) -> str:
        out = memo.get(device_id)
        if out is None:
            device = resolver.resolve(device_id)
            out = memo[device_id] = resolver.label(device) if device is not None else device_id
        return out

    return canonical


def _short_shares(view: AllocationView, state, canonical: Callable[[str], str]) -> tuple[tuple[str, str], ...]:
    """(kernel id, device id as allocated) of every fractional share on a device whose usable
    memory no longer covers what is allocated there: those shares cannot all get their memory."""
    short = {(d.device_id, slot) for slot, rows in state.slots.items() for d in rows
             if (d.device_id, slot) in state.blocked and d.allocated > d.capacity}
    if not short:
        return ()
    return tuple(sorted({(k.kernel_id, a.device_id) for k in view.kernels.values() for a in k.allocations
                         if is_fractional_slot(a.slot) and a.amount and (canonical(a.device_id), a.slot) in short}))


def _allocation_stage(
    view: AllocationView, snapshot: TelemetrySnapshot, resolver: DeviceResolver, inventory: Inventory,
    params: HeadroomParams, layout: AgentLayout, liveness: Mapping[str, KernelLiveness],
    ghost: Mapping[str, int] | None = None,
    shapes: tuple[Shape, ...] = DEFAULT_SHAPES,
) -> dict:
    """The fields of :class:`Analysis` that follow the allocation: node state and figures
    (``ghost``: device id -> ghost bytes, which headroom leaves out)."""
    canonical = _canonical_ids(resolver)
    state = node_state(view, inventory, params, liveness, canonical, ghost)
    unknown = None
    if snapshot.devices:  # without an inventory nothing can be judged unknown
        unknown = {
            (device_id, slot): amount
            for (device_id, slot), amount in sorted(view.device_totals.items())
            if slot.startswith("cuda.") and resolver.resolve(device_id) is None
        }
    agents = {}
    if layout.multi_agent:
        for agent_id, own in agent_views(view, layout).items():
            own_state = node_state(own, inventory, params, liveness, canonical, ghost)
            agents[agent_id] = AgentShare(own, agent_headroom(state, own_state, layout, agent_id))
    return {
        "state": state,
        "headroom": headroom_figures(state, inventory, params),
        "ratio_capacities": ratio_capacities(state, inventory),
        "unknown_devices": unknown,
        "agents": agents,
        "short_shares": _short_shares(view, state, canonical),
        "shapes": shape_figures(state, shapes, params.exclude_stale),
    }


def analyse(
    view: AllocationView,
    snapshot: TelemetrySnapshot | None = None,
    params: HeadroomParams = _DEFAULTS,
    *,
    layout: AgentLayout = _SINGLE,
    scheme: str = "auto",
    liveness: Mapping[str, KernelLiveness] | None = None,
    shapes: tuple[Shape, ...] = DEFAULT_SHAPES,
) -> Analysis:
    """One read model of ``view`` and ``snapshot``, without the usage stage (no attribution or
    accounting: those integrate over samples): what ``scan``, ``simulate`` and tests read."""
    snapshot = snapshot or TelemetrySnapshot(source="none")
    resolver, inventory = device_join(view, snapshot, scheme)
    liveness = liveness or {}
    stale, counts = summarise(liveness)
    fields = _allocation_stage(view, snapshot, resolver, inventory, params, layout, liveness, shapes=shapes)
    return Analysis(view=view, snapshot=snapshot, resolver=resolver, inventory=inventory, layout=layout,
                    liveness=liveness, stale_kernels=stale, liveness_counts=counts, **fields)


class AnalysisPipeline:
    """Runs the passes and publishes each :class:`Analysis`; see the module docstring.

    Two threads run them, so that a kernel change never waits for a usage pass (at 10,000
    kernels a usage pass after a change re-integrates every kernel's counters and re-judges its
    liveness, hundreds of milliseconds of Python): ``analysis`` runs the allocation stage when
    the book changes, ``analysis-usage`` the join and the usage stage on every sample or
    interval. Each publishes its own fields into the newest model; a usage pass that moved the
    inventory, the liveness or the ghost memory wakes the allocation stage, which then places
    on them. A model may so briefly pair a new view with the previous pass's usage figures.

    :param view: the allocation book's current view (cheap when nothing changed).
    :param telemetry: the sampler's (version, latest snapshot).
    :param tracker: process attribution, kept across passes (it integrates idle windows).
    :param accountant: GPU accounting, kept across passes (it integrates counters).
    :param ghost: ghost memory, kept across passes (it remembers PIDs and ended kernels).
    :param health: device health, kept across passes (it latches faults until their remedy).
    :param clock: unix time (staleness); ``monotonic``: seconds for intervals.
    """

    def __init__(
        self,
        config: PipelineConfig,
        view: Callable[[], AllocationView],
        telemetry: Callable[[], tuple[int, TelemetrySnapshot]],
        *,
        tracker: AttributionTracker | None = None,
        accountant: Accountant | None = None,
        ghost: GhostTracker | None = None,
        health: HealthTracker | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._view = view
        self._telemetry = telemetry
        self._tracker = tracker
        self._accountant = accountant
        self._ghost = ghost
        self._health = health
        self._clock = clock
        self._monotonic = monotonic
        self._model: Analysis | None = None
        self._join_ids: frozenset[str] = frozenset()  # the GPU ids the published join was made for
        self._placed: tuple = ()  # (view, inventory, liveness, ghost totals) the published node state is of
        self._judged: tuple[int, float] = (-1, 0.0)  # (view version, monotonic time) of the last staleness check
        self._stale: tuple[Mapping | None, Mapping[str, KernelLiveness]] = (None, {})  # (liveness, its stale verdicts)
        self._next_usage = 0.0  # monotonic time the next usage pass is due without a sample
        self._observed = float("-inf")  # monotonic time of the view the last usage pass observed
        self._usage_lock = threading.Lock()  # one usage pass at a time (its trackers integrate)
        self._allocation_lock = threading.Lock()  # one allocation pass at a time
        self._publish_lock = threading.Lock()  # one replacement of the model at a time
        self._changed = threading.Event()  # the book moved, or a usage pass moved what placement reads
        self._sampled = threading.Event()
        self._stop = threading.Event()
        self._foreground = Foreground(self._stop.wait, config.quiet, config.aside_at_most)
        self._threads: list[threading.Thread] = []
        self._usage_thread: threading.Thread | None = None

    @property
    def current(self) -> Analysis:
        """The last published read model (one pass is run first if none has been)."""
        model = self._model
        return model if model is not None else self.step()

    def poke(self) -> None:
        """The allocation book changed: place it soon (the usage thread steps aside meanwhile).
        Cheap, never blocks (the book calls it under its lock)."""
        self._foreground.changed()
        self._changed.set()

    def step_aside(self) -> None:
        """On the usage thread, wait while kernels change (within its pass's bound, see
        :mod:`exporter.foreground`); on any other thread return at once. The render ahead, which
        runs on the usage thread, calls it between its long steps."""
        if threading.current_thread() is self._usage_thread:
            self._foreground.step_aside()

    def sampled(self) -> None:
        """The sampler published: run a usage pass soon. Cheap, never blocks."""
        self._sampled.set()

    def start(self, first: Callable[[], None] | None = None, counted: Callable[[], None] | None = None,
              used: Callable[[float], None] | None = None) -> None:
        """Run passes on threads of their own; ``first`` runs on the allocation thread once before
        its first wait, ``counted`` on the usage thread once after its first pass (the ledger's
        first, after ``step(ledger=False)``), ``used`` on the usage thread after each usage pass,
        with the seconds until the next one is due."""
        self._usage_thread = threading.Thread(target=self._usage_loop, args=(counted, used), name="analysis-usage",
                                              daemon=True)
        self._threads = [threading.Thread(target=self._allocation_loop, args=(first,), name="analysis", daemon=True),
                         self._usage_thread]
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        self._stop.set()
        self._changed.set()
        self._sampled.set()
        for thread in self._threads:
            thread.join()

    def _allocation_loop(self, first: Callable[[], None] | None) -> None:
        if first is not None:
            try:
                first()
            except Exception:  # never a dead thread: whatever it prepares is built again on use
                log.exception("preparing the metrics collector failed")
        while not self._stop.is_set():
            self._changed.wait()
            if self._stop.is_set():
                return
            self._changed.clear()
            self._guarded(self._allocation_pass)

    def _usage_loop(self, counted: Callable[[], None] | None, used: Callable[[float], None] | None) -> None:
        aside = self._foreground  # steps aside while kernels change (exporter.foreground)
        aside.seen()  # the start's own changes: placed by its step, and the ledger's first pass is due now
        while not self._stop.is_set():
            self._sampled.wait(max(self._next_usage - self._monotonic(), 0.0))
            if self._stop.is_set():
                return
            self._sampled.clear()
            # What this pass counts, observed before it steps aside: a kernel that comes and goes
            # meanwhile is in its view (observed later, the ledger would never see it).
            observed = (self._view(), self._monotonic())
            aside.begin()
            aside.step_aside()
            if self._stop.is_set():
                return
            if self._guarded(partial(self._usage_pass, observed=observed)):
                self._changed.set()
                if used is not None:  # it steps aside itself (step_aside), once scrapes serve the last render
                    aside.begin()
                    self._guarded(lambda: used(max(self._next_usage - self._monotonic(), 0.0)))
            if counted is not None:
                self._guarded(counted)
                counted = None

    def _guarded(self, run: Callable[[], object]) -> object:
        try:
            return run()
        except Exception:
            log.exception("analysis pass failed; the last result stays published")
            self._stop.wait(1.0)  # a pass that keeps failing must not spin a core
            return None

    def step(self, ledger: bool = True) -> Analysis:
        """One full pass now (usage included, whether or not a sample arrived); publishes and
        returns the result.

        :param ledger: False: publish an empty ledger (nothing counted yet) and leave its first
            pass to the usage thread, which runs it as soon as it starts. At start the ledger's
            counters are all zero whatever it computes, and its first pass walks every kernel
            (at 10,000 kernels with capacities known, ~0.1 s of a start that must stay under 1 s).
        """
        return self._pass(full=True, ledger=ledger)

    def _pass(self, full: bool, ledger: bool = True) -> Analysis:
        """Both stages on the calling thread: usage when due (``full``: always), then placement
        of whatever moved."""
        self._usage_pass(full, ledger)
        self._allocation_pass()
        return self._model

    def _publish(self, changes: dict, join_ids: frozenset[str] | None = None) -> Analysis:
        """Replace the model with ``changes`` applied to the newest one (``join_ids``: the
        changes carry a device join made for these GPU ids)."""
        with self._publish_lock:
            prev = self._model
            changes["version"] = prev.version + 1 if prev else 1
            if join_ids is not None:
                self._join_ids = join_ids
            self._model = replace(prev, **changes) if prev else Analysis(layout=self.config.layout, **changes)
            return self._model

    def _usage_pass(self, full: bool = False, ledger: bool = True,
                    observed: tuple[AllocationView, float] | None = None) -> bool:
        """The join (when the snapshot or the GPU ids moved) and the usage stage, when a sample
        arrived, the interval passed or ``full``; publishes them. Returns whether it ran.

        :param ledger: False: the ledger's pass is left to the next usage pass, due at once.
        :param observed: (view, monotonic time) to count, observed earlier by the caller; None, or
            one older than the last pass's (a ``step`` ran meanwhile): observed now.
        """
        with self._usage_lock:
            prev = self._model
            sample_version, snapshot = self._telemetry()
            if observed is None or observed[1] < self._observed:
                observed = (self._view(), self._monotonic())
            view, now = observed
            if not (full or prev is None or sample_version != prev.sample_version or now >= self._next_usage):
                return False
            self._observed = now
            ids = gpu_ids(view)
            if prev is not None and snapshot is prev.snapshot and ids == self._join_ids:
                resolver, inventory = prev.resolver, prev.inventory
            else:
                resolver, inventory = device_join(view, snapshot, self.config.device_id_scheme)
            changes: dict = {"snapshot": snapshot, "sample_version": sample_version, "resolver": resolver,
                             "inventory": inventory}
            changes.update(self._usage(prev, view, snapshot, resolver, now, ledger))
            self._next_usage = now + self.config.interval if ledger or self._accountant is None else now
            if prev is None:  # the first model is published whole, never without a node state
                changes.update(self._placement(view, inventory, resolver, snapshot, changes.get("liveness", {}),
                                               changes.get("ghost_totals", {}), None))
            self._publish(changes, ids)
            return True

    def _allocation_pass(self) -> Analysis | None:
        """The allocation stage, when the view, the inventory, the liveness or the ghost memory
        moved since the published node state was placed; publishes it."""
        with self._allocation_lock:
            prev = self._model
            if prev is None:
                return None
            view = self._view()
            snapshot, resolver, inventory = prev.snapshot, prev.resolver, prev.inventory
            ids = gpu_ids(view)
            join_ids = None
            if ids != self._join_ids:  # a GPU id no join has seen: join again, on the same snapshot
                resolver, inventory = device_join(view, snapshot, self.config.device_id_scheme)
                join_ids = ids
            placed = self._placed
            if (placed and view is placed[0] and inventory == placed[1] and prev.liveness is placed[2]
                    and prev.ghost_totals == placed[3]):
                return prev
            changes = self._placement(view, inventory, resolver, snapshot, prev.liveness, prev.ghost_totals, prev)
            if join_ids is not None:
                changes.update(resolver=resolver, inventory=inventory)
            with self._publish_lock:  # a usage pass that published a newer snapshot meanwhile keeps its join
                stale_join = self._model.snapshot is not snapshot
            if stale_join:
                changes.pop("resolver", None)
                changes.pop("inventory", None)
                join_ids = None
                self._changed.set()  # place again on the newer join
            return self._publish(changes, join_ids)

    def _placement(self, view: AllocationView, inventory: Inventory, resolver: DeviceResolver,
                   snapshot: TelemetrySnapshot, liveness: Mapping[str, KernelLiveness], ghost: Mapping[str, int],
                   prev: Analysis | None) -> dict:
        fields = _allocation_stage(view, snapshot, resolver, inventory, self.config.params, self.config.layout,
                                   self._stale_of(liveness), ghost, self.config.shapes)
        self._placed = (view, inventory, liveness, ghost)
        return {"view": view, **fields, "headroom_version": prev.headroom_version + 1 if prev else 1}

    def _stale_of(self, liveness: Mapping[str, KernelLiveness]) -> Mapping[str, KernelLiveness]:
        """The stale verdicts of ``liveness``, filtered once per liveness result: liveness has a
        verdict for every kernel, the node state needs only the few stale ones, and a kernel
        change must not cost a pass over every kernel."""
        known, stale = self._stale
        if known is not liveness:
            stale = {k: v for k, v in liveness.items() if v.status is Liveness.STALE}
            self._stale = (liveness, stale)
        return stale

    def _usage(self, prev: Analysis | None, view: AllocationView, snapshot: TelemetrySnapshot, resolver: DeviceResolver,
               now: float, ledger: bool = True) -> dict:
        """Liveness (when due), attribution and accounting; each failure is logged and leaves
        its figures empty, never the pass undone."""
        out: dict = {"usage_version": prev.usage_version + 1 if prev else 1}
        before = prev.liveness if prev else {}
        cfg = self.config
        if cfg.cgroupfs is not None and (view.version != self._judged[0] or now - self._judged[1] >= STALE_CHECK_SECONDS):
            judged: frozenset[str] | None = None
            try:
                cgroups, liveness, judged = self._judge(prev, view, before, now)
            except Exception:
                log.exception("stale-kernel check failed")
                cgroups, liveness = None, {}
                self._judged = (view.version, now)
            self._log_stale_changes(before, liveness, judged)
            visible = cgroups.visible if cgroups else None
            was_visible = prev.cgroups.visible if prev and prev.cgroups else None
            if prev is None or visible != was_visible or _moved(before, liveness, judged):
                if prev is not None and judged is not None:  # only the judged kernels' verdicts moved
                    stale, counts = self._stale_of(liveness), _recounted(prev.liveness_counts, before, liveness, judged)
                else:
                    stale, counts = summarise(liveness)
                    self._stale = (liveness, stale)
                out.update(liveness=liveness, liveness_version=prev.liveness_version + 1 if prev else 1,
                           stale_kernels=stale, liveness_counts=counts)
            elif self._stale[0] is liveness:  # the same verdicts: the model keeps the old result
                self._stale = (before, self._stale[1])
            out["cgroups"] = cgroups
        capacity: CapacityConfig = cfg.params.capacity
        attribution = None
        if self._tracker is not None:
            try:
                attribution = self._tracker.update(snapshot, view.kernels.values(), resolver)
            except Exception:
                log.exception("process attribution failed")
        if self._accountant is not None:
            if ledger:
                self.step_aside()  # on the usage thread only: a start's step never waits
            out["accounting"] = self._count(view, snapshot, resolver, capacity, attribution, now) if ledger else _NOTHING_COUNTED
        out["attribution"] = attribution
        if self._ghost is not None:
            try:
                ghost: GhostMemory | None = self._ghost.update(attribution, view.kernels, out.get("liveness", before),
                                                               version=view.version, changes=partial(_changes, view))
            except Exception:
                log.exception("ghost memory check failed")
                ghost = None
            out["ghost"] = ghost
            totals = ghost.totals() if ghost is not None else {}
            previous = prev.ghost_totals if prev else {}
            out["ghost_totals"] = previous if totals == previous else totals
        if self._health is not None:
            try:
                out["health"] = self._health.update(snapshot, view.kernels, resolver)
            except Exception:
                log.exception("device health check failed")
        return out

    def _count(self, view: AllocationView, snapshot: TelemetrySnapshot, resolver: DeviceResolver, capacity: CapacityConfig,
               attribution: AttributionResult | None, at: float) -> Accounting | None:
        """The ledger's pass (None where it failed: logged, the rest of the pass stands)."""
        try:
            return self._accountant.update(view.kernels.values(), snapshot, resolver, capacity, attribution,
                                           version=view.version, changes=partial(_changes, view), at=at)
        except Exception:
            log.exception("GPU accounting failed")
            return None

    def _judge(self, prev: Analysis | None, view: AllocationView, before: Mapping[str, KernelLiveness],
               now: float) -> tuple[CgroupScan, dict[str, KernelLiveness], frozenset[str] | None]:
        """The cgroup scan and every kernel's verdict, and the kernels judged anew (None: all).

        While the scan is the last one's, only the kernels changed since are judged again (a
        kernel change at 10,000 kernels must not cost a judgement of every kernel, ~25 ms), and
        every :data:`STALE_CHECK_SECONDS` the kernels whose grace period ended since too: with
        the same containers and the same kernel, time moves no other verdict (a kernel past its
        grace stays past it, one within it stays "starting"). A scan that differs judges every
        kernel."""
        cfg = self.config
        cgroups = scan_cgroups(cfg.cgroupfs)
        version, at = self._judged
        changed = None
        due = now - at >= STALE_CHECK_SECONDS
        if prev is not None and prev.cgroups == cgroups:
            changed = view.changed_since(version)
            if changed is not None and due:
                # Only the kernels whose grace ended since: a node whose kernels all started
                # within the grace period would otherwise judge every kernel each time.
                clock, kernels = self._clock(), view.kernels
                changed = changed | {kid for kid, verdict in before.items() if kid in kernels
                                     and time_moves(verdict, kernels[kid], clock, cfg.stale_grace)}
            if changed is not None and len(changed) > _JUDGED_APART:
                changed = None
        kernels = view.kernels if changed is None else {kid: view.kernels[kid] for kid in changed if kid in view.kernels}
        # A kernel without CID= that its agent still keeps in its registry is live.
        recovery = {kid: k.identity.agent_id for kid, k in kernels.items()
                    if k.identity is not None and k.identity.agent_id != UNDEFINED}
        verdicts = classify_kernels(kernels, cgroups, self._clock(), cfg.stale_grace,
                                    recovery_agents=recovery, host_agents=frozenset(cfg.layout.agents))
        if changed is None:
            self._judged = (view.version, now)
            return cgroups, verdicts, None
        self._judged = (view.version, now if due else at)  # when the verdicts time moves were last judged
        liveness = dict(before)  # a copy in C, then the changed kernels' verdicts
        for kid in changed:
            liveness.pop(kid, None)
        liveness.update(verdicts)
        known, stale = self._stale
        if known is before:  # keep the stale verdicts filtered: only the judged ones can move
            stale = {kid: v for kid, v in stale.items() if kid not in changed}
            stale.update((kid, v) for kid, v in verdicts.items() if v.status is Liveness.STALE)
            self._stale = (liveness, stale)
        return cgroups, liveness, changed

    def _log_stale_changes(self, before: Mapping[str, KernelLiveness], after: Mapping[str, KernelLiveness],
                           judged: frozenset[str] | None = None) -> None:
        """Say once, when it happens, that kernels' allocations leave (or rejoin) the allocated and
        headroom figures: an operator comparing them with the agent's map needs to know why
        (``judged``: the only kernels whose verdict may have moved; None: any)."""
        if judged is None:  # the stale verdicts of each, filtered once per result (the placement reads them too)
            was, now = self._stale_of(before).keys(), self._stale_of(after).keys()
        else:
            was = {k for k in judged if k in before and before[k].status is Liveness.STALE}
            now = {k for k in judged if k in after and after[k].status is Liveness.STALE}
        became = sorted(now - was)
        back = sorted(k for k in was - now if k in after)
        excluded = self.config.params.exclude_stale
        effect = ("left out of the allocated and headroom figures" if excluded
                  else "still counted in the allocated and headroom figures (--no-headroom.exclude-stale)")
        for kernels, what, verb in ((became, "stale", effect), (back, "live again", "counted again")):
            if not kernels or (what == "live again" and not excluded):
                continue
            shown = ", ".join(f"{k} ({after[k].reason})" for k in kernels[:_LOG_KERNELS])
            more = f" and {len(kernels) - _LOG_KERNELS} more" if len(kernels) > _LOG_KERNELS else ""
            log.info("%d kernel(s) %s, their allocations %s: %s%s", len(kernels), what, verb, shown, more)
