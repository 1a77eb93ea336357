"""The analysis pipeline on its own: a real allocation book and telemetry snapshots in, one read
model out per change, without an exporter, a watcher or a sampler."""

from __future__ import annotations

import logging
import threading
import time
from decimal import Decimal
from pathlib import Path

import pytest
from helpers import wait_for

from exporter.analysis.accounting import Accountant
from exporter.analysis.node import HeadroomParams
from exporter.analysis.pipeline import AnalysisPipeline, PipelineConfig, analyse
from exporter.foreground import Foreground
from exporter.scratch.allocation import AllocationBook
from exporter.scratch.resources import parse_resource
from exporter.telemetry.model import DeviceReading, TelemetrySnapshot

GiB = 1024**3
CID = "3b9e1c0d5f2a4e6b8c7d9f0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e"


def resource(shares: str) -> str:
    total = sum(Decimal(e.split(":")[1]) for e in shares.split(","))
    return (f'SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={{"cuda.shares":"{total}"}}\n'
            f"CUDA.SHARES_SHARES={shares}\nCID={CID}\n")


def snapshot(*uuids: str) -> TelemetrySnapshot:
    devices = tuple(DeviceReading(uuid=u, index=i, name="NVIDIA A100-SXM4-40GB", memory_total_bytes=40 * GiB,
                                  multiprocessor_count=108) for i, u in enumerate(uuids))
    return TelemetrySnapshot(source="nvml", devices=devices, success=True)


class Telemetry:
    """What the sampler publishes: (version, snapshot), replaced as a pair."""

    def __init__(self, snap: TelemetrySnapshot) -> None:
        self.published = (1, snap)

    def publish(self, snap: TelemetrySnapshot) -> None:
        self.published = (self.published[0] + 1, snap)

    def __call__(self) -> tuple[int, TelemetrySnapshot]:
        return self.published


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def pipeline(book: AllocationBook, telemetry: Telemetry, clock: Clock | None = None, **config) -> AnalysisPipeline:
    clock = clock or Clock()
    return AnalysisPipeline(PipelineConfig(params=HeadroomParams(mode="fractional"), interval=5.0, **config), book.view,
                            telemetry, accountant=Accountant(clock), clock=clock, monotonic=clock)


def headroom(model) -> Decimal:
    return model.headroom.summaries["cuda.shares"].headroom


def test_a_kernel_change_reaches_headroom_in_one_pass_without_a_sample() -> None:
    book, telemetry = AllocationBook(clock=lambda: 0.0), Telemetry(snapshot("GPU-a", "GPU-b"))
    p = pipeline(book, telemetry)
    first = p.step()
    assert headroom(first) == 27  # two empty GPUs of 13.5 shares
    book.apply("k1", "/scratch", parse_resource(resource("GPU-a:4")))
    second = p._pass(full=False)
    assert second.view.version == book.version and second.version == first.version + 1
    assert headroom(second) == 23
    assert second.headroom_version == first.headroom_version + 1
    assert second.usage_version == first.usage_version  # no sample, no interval: attribution waits
    book.apply("k2", "/scratch", parse_resource(resource("GPU-a:1")))
    third = p._pass(full=False)
    assert headroom(third) == 22
    assert third.resolver is second.resolver  # same snapshot, same GPU ids: the join is kept


def test_a_wake_with_nothing_new_publishes_nothing() -> None:
    book, telemetry = AllocationBook(clock=lambda: 0.0), Telemetry(snapshot("GPU-a"))
    p = pipeline(book, telemetry)
    first = p.step()
    assert p._pass(full=False) is first


def test_a_sample_with_the_same_devices_keeps_the_headroom() -> None:
    book, telemetry = AllocationBook(clock=lambda: 0.0), Telemetry(snapshot("GPU-a"))
    p = pipeline(book, telemetry)
    first = p.step()
    telemetry.publish(snapshot("GPU-a"))
    second = p._pass(full=False)
    assert second.sample_version == 2 and second.usage_version == first.usage_version + 1
    assert second.headroom_version == first.headroom_version  # inventory equal: figures kept
    assert second.headroom is first.headroom
    telemetry.publish(snapshot("GPU-a", "GPU-b"))  # a GPU appears: the inventory moved
    third = p._pass(full=False)
    assert third.headroom_version == second.headroom_version + 1 and headroom(third) == 27


def test_the_interval_runs_usage_without_a_sample() -> None:
    clock = Clock()
    book, telemetry = AllocationBook(clock=lambda: 0.0), Telemetry(snapshot("GPU-a"))
    p = pipeline(book, telemetry, clock)
    first = p.step()
    clock.now += 5.0
    assert p._pass(full=False).usage_version == first.usage_version + 1


def test_the_ledgers_first_pass_can_be_left_to_the_usage_thread() -> None:
    """The start publishes the ledger empty (nothing counted yet: every counter would read zero)
    and leaves its first pass to the usage thread, due at once, without a sample or the interval."""
    clock = Clock()
    book, telemetry = AllocationBook(clock=lambda: 0.0), Telemetry(snapshot("GPU-a"))
    book.apply("k1", "/scratch", parse_resource(resource("GPU-a:0.5")))
    p = pipeline(book, telemetry, clock)
    first = p.step(ledger=False)
    assert first.accounting is not None and not first.accounting.shares and not first.accounting.allocated_seconds
    assert headroom(first) == Decimal("13")  # the rest of the model is whole (13.5 - 0.5)
    counted = p._pass(full=False)
    assert counted.usage_version == first.usage_version + 1 and dict(counted.accounting.shares) == {("k1", "GPU-a"): 0.5 / 13.5}  # of the GPU
    clock.now += 1.0
    assert p._pass(full=False).usage_version == counted.usage_version  # then every interval again, as before
    clock.now += 5.0
    assert p._pass(full=False).usage_version == counted.usage_version + 1


def test_one_name_two_spellings_and_unknown_ids_are_judged_once() -> None:
    book, telemetry = AllocationBook(clock=lambda: 0.0), Telemetry(snapshot("GPU-a"))
    book.apply("k1", "/scratch", parse_resource(resource("GPU-a:1,GPU-zz:2")))
    model = pipeline(book, telemetry).step()
    assert model.unknown_devices == {("GPU-zz", "cuda.shares"): Decimal(2)}
    assert analyse(book.view()).unknown_devices is None  # no inventory: nothing can be judged


def test_stale_kernels_leave_headroom_and_are_logged_once(tmp_path: Path, caplog) -> None:
    cgroup = tmp_path / "cgroup"
    (cgroup / "system.slice").mkdir(parents=True)
    (cgroup / "cgroup.controllers").write_text("cpu memory pids\n")
    clock = Clock()
    book, telemetry = AllocationBook(clock=clock), Telemetry(snapshot("GPU-a"))
    book.apply("k1", "/scratch", parse_resource(resource("GPU-a:4")))
    p = pipeline(book, telemetry, clock, cgroupfs=cgroup, stale_grace=0.0)
    clock.now += 60
    with caplog.at_level(logging.INFO, logger="exporter.analysis.pipeline"):
        model = p.step()
        clock.now += 60
        again = p.step()
    assert model.liveness["k1"].status.value == "stale"
    assert headroom(model) == Decimal("13.5") and model.state.stale == {("GPU-a", "cuda.shares"): Decimal(4)}
    assert again.liveness is model.liveness and again.liveness_version == model.liveness_version
    assert sum("kernel(s) stale" in r.getMessage() for r in caplog.records) == 1


def test_a_failing_stage_leaves_the_rest_published(caplog) -> None:
    class Broken(Accountant):
        def update(self, *args, **kwargs):
            raise RuntimeError("injected")

    book, telemetry = AllocationBook(clock=lambda: 0.0), Telemetry(snapshot("GPU-a"))
    p = AnalysisPipeline(PipelineConfig(), book.view, telemetry, accountant=Broken())
    model = p.step()
    assert model.accounting is None and model.headroom.summaries
    assert "GPU accounting failed" in caplog.text


def test_the_thread_follows_the_book_and_leaves_nothing_behind() -> None:
    book, telemetry = AllocationBook(clock=lambda: 0.0), Telemetry(snapshot("GPU-a"))
    p = AnalysisPipeline(PipelineConfig(params=HeadroomParams(mode="fractional"), interval=3600), book.view, telemetry)
    book.subscribe(p.poke)
    p.step()
    published = threading.Event()
    p.start(first=published.set)
    try:
        assert published.wait(5)
        book.apply("k1", "/scratch", parse_resource(resource("GPU-a:4")))
        for _ in range(500):
            if p.current.view.version == book.version:
                break
            threading.Event().wait(0.01)
        assert headroom(p.current) == Decimal("9.5")
    finally:
        p.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("analysis")]


def test_counted_runs_once_on_the_usage_thread_after_the_ledgers_first_pass() -> None:
    """What the start hands ``counted`` (freezing the ledger's tables out of the collector's
    generations) runs once the usage thread has counted, and only once."""
    book, telemetry = AllocationBook(clock=lambda: 0.0), Telemetry(snapshot("GPU-a"))
    book.apply("k1", "/scratch", parse_resource(resource("GPU-a:0.5")))
    p = AnalysisPipeline(PipelineConfig(params=HeadroomParams(mode="fractional"), interval=0.01), book.view, telemetry,
                         accountant=Accountant())
    p.step(ledger=False)
    seen: list[tuple[str, bool]] = []
    p.start(counted=lambda: seen.append((threading.current_thread().name, bool(p.current.accounting.shares))))
    try:
        assert wait_for(lambda: p.current.usage_version > 3)  # several passes since
    finally:
        p.close()
    assert seen == [("analysis-usage", True)]


def test_used_runs_on_the_usage_thread_after_each_usage_pass_with_the_time_to_the_next() -> None:
    """``used`` (the exposition renders ahead what the next scrape reads) runs after every usage
    pass, on the usage thread, told how long until the next pass is due, after the model is
    published."""
    book, telemetry = AllocationBook(clock=lambda: 0.0), Telemetry(snapshot("GPU-a"))
    book.apply("k1", "/scratch", parse_resource(resource("GPU-a:0.5")))
    p = AnalysisPipeline(PipelineConfig(params=HeadroomParams(mode="fractional"), interval=0.05), book.view, telemetry,
                         accountant=Accountant())
    p.step(ledger=False)
    seen: list[tuple[str, float, int]] = []
    p.start(used=lambda due: seen.append((threading.current_thread().name, due, p.current.usage_version)))
    try:
        assert wait_for(lambda: len(seen) >= 3)
    finally:
        p.close()
    assert {name for name, _, _ in seen} == {"analysis-usage"}
    assert all(0.0 <= due <= 0.05 for _, due, _ in seen)
    versions = [version for _, _, version in seen]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)  # once per pass, each published


def test_a_kernel_change_is_placed_while_a_usage_pass_runs() -> None:
    """The allocation stage never waits for the usage stage: with a usage pass held in the
    middle (an accountant that blocks), a kernel change still reaches headroom."""
    entered, release = threading.Event(), threading.Event()

    class Slow(Accountant):
        def update(self, *args, **kwargs):
            entered.set()
            release.wait(10)
            return super().update(*args, **kwargs)

    book, telemetry = AllocationBook(clock=lambda: 0.0), Telemetry(snapshot("GPU-a"))
    p = AnalysisPipeline(PipelineConfig(params=HeadroomParams(mode="fractional"), interval=3600), book.view, telemetry,
                         accountant=Slow())
    book.subscribe(p.poke)
    release.set()
    p.step()
    release.clear()
    entered.clear()  # set by the step's ledger pass
    p.start()
    try:
        telemetry.publish(snapshot("GPU-a"))
        p.sampled()
        assert entered.wait(5)  # the usage pass is now held
        book.apply("k1", "/scratch", parse_resource(resource("GPU-a:4")))
        for _ in range(500):
            if p.current.view.version == book.version:
                break
            threading.Event().wait(0.01)
        assert headroom(p.current) == Decimal("9.5")
        assert p.current.sample_version == 1  # the held pass has not published
    finally:
        release.set()
        p.close()
    assert p.current.sample_version == 2 and headroom(p.current) == Decimal("9.5")
    assert not [t for t in threading.enumerate() if t.name.startswith("analysis")]


def test_what_if_names_the_parameter() -> None:
    book = AllocationBook(clock=lambda: 0.0)
    model = analyse(book.view(), snapshot("GPU-a"), HeadroomParams(mode="fractional"))
    assert model.what_if("cuda.shares=2")["placed"] is True
    for request, policy, name in (("cuda.shares=x", "evenly", "parameter request:"), ("cuda.shares=1", "nope", "parameter policy:")):
        try:
            model.what_if(request, policy)
        except ValueError as exc:
            assert str(exc).startswith(name)
        else:
            raise AssertionError("accepted")


def test_one_gpu_named_two_ways_is_one_device_of_the_node_state() -> None:
    book, telemetry = AllocationBook(clock=lambda: 0.0), Telemetry(snapshot("GPU-a1b2", "GPU-c3d4"))
    book.apply("k1", "/scratch", parse_resource(resource("GPU-a1b2:4.5")))
    book.apply("k2", "/scratch", parse_resource(resource("a1b2:7")))  # the mock plugin's bare uuid
    model = pipeline(book, telemetry).step()
    devices = {d.device_id: d for d in model.state.slots["cuda.shares"]}
    assert set(devices) == {"GPU-a1b2", "GPU-c3d4"}
    assert devices["GPU-a1b2"].allocated == Decimal("11.5") and devices["GPU-a1b2"].free == 2
    assert headroom(model) == Decimal("15.5")  # 2 + 13.5, not 9 + 13.5 + 13.5
    assert model.unknown_devices == {}  # both spellings name a device
    assert model.view.alloc_map == {"GPU-a1b2": "4.5", "a1b2": "7"}  # the agent's map, as written


def test_time_alone_judges_again_only_the_kernels_whose_grace_ended(tmp_path: Path, monkeypatch) -> None:
    """With the same containers and kernels, a kernel past its grace keeps its verdict, and one
    within it stays "starting": only the ones whose grace ended are judged again, and turn stale."""
    from exporter.analysis import pipeline as pipeline_module
    from exporter.analysis.liveness import classify_kernels

    cgroup = tmp_path / "cgroup"
    (cgroup / "system.slice" / f"docker-{1:064x}.scope").mkdir(parents=True)
    (cgroup / "cgroup.controllers").write_text("cpu memory pids\n")
    clock = Clock()
    book, telemetry = AllocationBook(clock=clock), Telemetry(snapshot("GPU-a"))
    for n in range(30):  # 10 with their container running, 20 whose container is gone
        book.apply(f"old{n:02}", "/scratch", parse_resource(resource("GPU-a:0.1").replace(CID, f"{1 if n < 10 else 2:064x}")))
    p = pipeline(book, telemetry, clock, cgroupfs=cgroup, stale_grace=60.0)
    clock.now += 120.0
    first = p.step()
    assert sum(v.reason == "container-gone" for v in first.liveness.values()) == 20
    for n in range(3):  # started now, their containers not seen yet
        book.apply(f"new{n}", "/scratch", parse_resource(resource("GPU-a:0.1").replace(CID, f"{3:064x}")))
    judged: list[int] = []
    monkeypatch.setattr(pipeline_module, "classify_kernels",
                        lambda kernels, *a, **k: judged.append(len(kernels)) or classify_kernels(kernels, *a, **k))
    assert {p.step().liveness[f"new{n}"].reason for n in range(3)} == {"starting"} and judged == [3]
    for step in range(6):
        judged.clear()
        clock.now += pipeline_module.STALE_CHECK_SECONDS
        model = p.step()
        # Judged again once, at the third check: past their grace (60 s) then, and not before.
        assert sum(judged) == (3 if step == 2 else 0)
    assert {model.liveness[f"new{n}"].reason for n in range(3)} == {"container-gone"}
    assert sum(v.reason == "container-gone" for v in model.liveness.values()) == 23


def test_a_kernel_change_judges_only_the_changed_kernels(tmp_path: Path, monkeypatch) -> None:
    """Kernels come, change and go, and containers start and stop, over 2 s steps with a 7 s
    grace: a step that changed a few kernels and no container judges only those (the others keep
    their verdicts: time moves them at the next full judgement, at most STALE_CHECK_SECONDS
    later); any other step judges every kernel, as a judgement of all would."""
    import random

    from exporter.analysis import pipeline as pipeline_module
    from exporter.analysis.liveness import classify_kernels, scan_cgroups, summarise

    cgroup = tmp_path / "cgroup"
    (cgroup / "system.slice").mkdir(parents=True)
    (cgroup / "cgroup.controllers").write_text("cpu memory pids\n")
    clock, rng = Clock(), random.Random(5)
    book, telemetry = AllocationBook(clock=clock), Telemetry(snapshot("GPU-a"))
    cids = [f"{n:064x}" for n in range(1, 9)]
    for n in range(40):
        book.apply(f"k{n:02}", "/scratch", parse_resource(resource("GPU-a:0.1").replace(CID, rng.choice(cids))))
    p = pipeline(book, telemetry, clock, cgroupfs=cgroup, stale_grace=7.0)
    judged: list[int] = []
    monkeypatch.setattr(pipeline_module, "classify_kernels",
                        lambda kernels, *a, **k: judged.append(len(kernels)) or classify_kernels(kernels, *a, **k))
    before = p.step()
    apart = full = 0
    for _ in range(60):
        started = rng.random() < 0.2
        if started:
            container = cgroup / "system.slice" / f"docker-{rng.choice(cids)}.scope"
            container.rmdir() if container.exists() else container.mkdir()
        touched = set()
        for _ in range(rng.choice((1, 1, 2, 3))):
            kid = f"k{rng.randrange(50):02}"
            touched.add(kid)
            if rng.random() < 0.2:
                book.remove(kid)
            else:
                book.apply(kid, "/scratch", parse_resource(resource(f"GPU-a:0.{rng.randrange(1, 9)}").replace(CID, rng.choice(cids))))
        clock.now += 2.0
        judged.clear()
        model = p.step()
        view = book.view()
        touched = {kid for kid in touched if view.kernels.get(kid) is not before.view.kernels.get(kid)}  # re-applied: no change
        every = classify_kernels(view.kernels, scan_cgroups(cgroup), clock.now, 7.0)
        assert (dict(model.stale_kernels), dict(model.liveness_counts)) == summarise(model.liveness)  # kept, not walked
        if judged == [len(view.kernels)]:
            full += 1
            assert dict(model.liveness) == every
        elif not judged:  # nothing changed, no full judgement due: the verdicts stay
            assert model.liveness is before.liveness
        else:
            apart += 1
            waiting = {kid for kid, v in before.liveness.items() if v.reason == "starting"}
            assert not started and judged[0] <= len(touched | waiting)
            for kid in view.kernels:  # time moves only the verdicts of kernels in their grace period
                if kid in touched or kid not in waiting:
                    assert model.liveness[kid] == every[kid]
                else:
                    assert model.liveness[kid] in (every[kid], before.liveness[kid])
        before = model
    assert apart > 20 and full > 10


def test_the_usage_thread_steps_aside_while_kernels_change_and_the_allocation_thread_does_not() -> None:
    """While kernels change, a usage pass waits for a quiet spell (it loses nothing by starting
    later: its figures integrate over the time that passed), and the change is placed meanwhile;
    a start (``step``) never waits, and a close ends the wait at once."""
    book, telemetry = AllocationBook(clock=lambda: 0.0), Telemetry(snapshot("GPU-a"))
    p = AnalysisPipeline(PipelineConfig(params=HeadroomParams(mode="fractional"), interval=3600, quiet=60.0,
                                        aside_at_most=60.0), book.view, telemetry, accountant=Accountant())
    book.subscribe(p.poke)
    book.apply("k0", "/scratch", parse_resource(resource("GPU-a:1")))
    started = threading.Thread(target=p.step)
    started.start()
    started.join(5)
    assert not started.is_alive()  # the start placed and counted without stepping aside
    p.start()
    try:
        book.apply("k1", "/scratch", parse_resource(resource("GPU-a:4")))
        telemetry.publish(snapshot("GPU-a"))
        p.sampled()
        assert wait_for(lambda: p.current.view.version == book.version)
        assert headroom(p.current) == Decimal("8.5")
        threading.Event().wait(0.3)
        assert p.current.sample_version == 1  # the usage pass waits
    finally:
        p.close()  # within the 60 s it would wait
    assert not [t for t in threading.enumerate() if t.name.startswith("analysis")]


def test_a_kernel_that_comes_and_goes_while_a_usage_pass_steps_aside_is_counted() -> None:
    """The usage thread observes the view when it wakes, before it steps aside: a kernel that
    comes and goes while the pass waits for a quiet spell is in the ledger for the time it held its
    share (observed after the wait, it would never have been seen)."""
    book, telemetry = AllocationBook(clock=lambda: 0.0), Telemetry(snapshot("GPU-a"))
    observed = threading.Event()

    def view():
        if threading.current_thread().name == "analysis-usage":
            observed.set()
        return book.view()

    p = AnalysisPipeline(PipelineConfig(params=HeadroomParams(mode="fractional"), interval=3600, quiet=1.0,
                                        aside_at_most=60.0), view, telemetry, accountant=Accountant())
    book.subscribe(p.poke)
    book.apply("k0", "/scratch", parse_resource(resource("GPU-a:1")))
    p.step()
    p.start()
    try:
        book.apply("k1", "/scratch", parse_resource(resource("GPU-a:4")))
        began = time.monotonic()
        telemetry.publish(snapshot("GPU-a"))
        p.sampled()
        assert observed.wait(0.5)  # at once: the pass then waits for 1 s without a change
        book.remove("k1")  # within that wait
        assert p.current.sample_version == 1
        assert wait_for(lambda: p.current.sample_version == 2)
        assert ("k1", "GPU-a") in p.current.accounting.shares
        telemetry.publish(snapshot("GPU-a"))
        p.sampled()
        assert wait_for(lambda: p.current.sample_version == 3)
    finally:
        p.close()
    assert ("k1", "GPU-a") not in p.current.accounting.shares
    held = p.current.accounting.allocated_seconds[("k1", "GPU-a")]
    assert 0 < held <= (time.monotonic() - began) * 4 / 13.5  # 4 of the GPU's 13.5 shares


def test_a_usage_pass_waits_at_most_its_bound_however_often_kernels_change() -> None:
    book, telemetry = AllocationBook(clock=lambda: 0.0), Telemetry(snapshot("GPU-a"))
    p = AnalysisPipeline(PipelineConfig(params=HeadroomParams(mode="fractional"), interval=3600, quiet=0.05,
                                        aside_at_most=0.2), book.view, telemetry, accountant=Accountant())
    book.subscribe(p.poke)
    p.step()
    p.start()
    stop = threading.Event()

    def churn() -> None:  # a change every 10 ms: never a quiet spell of 50 ms
        n = 0
        while not stop.wait(0.01):
            n += 1
            book.apply(f"k{n % 3}", "/scratch", parse_resource(resource(f"GPU-a:{n % 5 + 1}")))

    churner = threading.Thread(target=churn)
    churner.start()
    try:
        telemetry.publish(snapshot("GPU-a"))
        p.sampled()
        assert wait_for(lambda: p.current.sample_version == 2)
    finally:
        stop.set()
        churner.join()
        p.close()


def test_stepping_aside_waits_for_a_quiet_spell_within_its_bound() -> None:
    """Each wait is one quiet spell; a change during it asks for another; the pass's bound ends
    the waiting, ``begin`` renews it, changes marked ``seen`` ask for none, and a stop ends it at once."""
    waits: list[float] = []
    during: list[int] = []  # changes that arrive during each successive wait

    def wait(seconds: float) -> bool:
        waits.append(seconds)
        for _ in range(during.pop(0) if during else 0):
            fg.changed()
        return False

    fg = Foreground(wait, 0.05, 0.12)
    fg.step_aside()
    assert waits == []  # no change since the last look: no wait
    fg.changed()
    during[:] = [2, 0]
    fg.step_aside()
    assert waits == [0.05, 0.05]  # one change, then two during the first spell, none during the second
    fg.changed()
    during[:] = [1, 1, 1]
    fg.step_aside()
    assert waits[2:] == [pytest.approx(0.02)]  # what is left of 0.12 s this pass
    fg.begin()
    during.clear()
    waits.clear()
    fg.step_aside()  # the change of the last spell, unseen: one more spell, now it may wait again
    assert waits == [0.05]
    fg.changed()
    fg.seen()  # a start's own changes
    waits.clear()
    fg.step_aside()
    assert waits == []
    stopping = Foreground(lambda s: True, 0.05, 1.0)
    stopping.changed()
    stopping.step_aside()  # returns: nothing to count, it only must not loop


def test_step_aside_waits_on_the_usage_thread_only() -> None:
    """The render ahead (on the usage thread) steps aside between its long steps while kernels
    change; the same render in a scrape, on another thread, never waits."""
    book, telemetry = AllocationBook(clock=lambda: 0.0), Telemetry(snapshot("GPU-a"))
    p = AnalysisPipeline(PipelineConfig(params=HeadroomParams(mode="fractional"), interval=0.05, quiet=60.0,
                                        aside_at_most=60.0), book.view, telemetry, accountant=Accountant())
    p.step(ledger=False)
    elsewhere = threading.Thread(target=lambda: (p.poke(), p.step_aside()))
    elsewhere.start()
    elsewhere.join(5)
    assert not elsewhere.is_alive()
    entered, left = threading.Event(), threading.Event()

    def used(_: float) -> None:
        if not entered.is_set():
            entered.set()
            p.poke()  # a kernel change while the render ahead runs
            p.step_aside()
            left.set()

    p.start(used=used)
    try:
        assert entered.wait(5)
        assert not left.wait(0.3)  # waiting for a quiet spell
    finally:
        p.close()  # ends the wait
    assert left.is_set()
