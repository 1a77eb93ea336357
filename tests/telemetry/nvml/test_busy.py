"""Busy time from the driver's sample buffers: the simulated driver fills them as its clock passes,
the NVML binding integrates them into counters (exporter/telemetry/nvml/binding.py, simulated.py,
and the ``sm_util`` patterns of mockfile.py)."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from exporter.telemetry.mock import MockSource
from exporter.telemetry.model import DeviceReading, TelemetryUnavailable
from exporter.telemetry.nvml import NvmlSource
from exporter.telemetry.nvml.binding import _Usage
from exporter.telemetry.nvml.mockfile import MockConfigError, Pattern, parse_mock_file
from exporter.telemetry.nvml.simulated import NOT_FOUND, SAMPLE_BUFFER, SAMPLE_PERIOD_US, UNKNOWN, FakeNvml

P, R = SAMPLE_PERIOD_US, SAMPLE_BUFFER
PCT_US = 100 * 1_000_000  # % x µs per busy second


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def tick(t: float, period: int = P) -> int:
    """The newest sampling period that ended by ``t`` (the simulated driver's µs, floored)."""
    return int(t * 1_000_000) // period


def generated(value, periods, period: int = P) -> int:
    """∫ value dt over the given periods (by the tick that ends each), in % x µs: each period
    holds the value it had at its start, in whole %."""
    return sum(round(100 * value((k - 1) * period / 1e6)) * period for k in periods)


def gpu_file(util: str, processes: str) -> str:
    return ('[[devices]]\nmother_uuid = "m1"\nmodel_name = "CUDA GPU"\nnuma_node = 0\nsubproc_count = 108\n'
            f'memory_size = "40G"\nis_mig_device = false\nutilization_ratio = {util}\nprocesses = {processes}\n')


def square(period: float, duty: float, high: float = 1.0) -> str:
    return f'{{ pattern = "square", min = 0, max = {high}, period_seconds = {period}, duty = {duty} }}'


@settings(max_examples=30, deadline=None)
@given(
    reads=st.lists(st.integers(0, 45_000), min_size=1, max_size=10),  # ms between reads
    start=st.floats(1000, 2000),
    period=st.integers(1, 30),
    duty=st.floats(0, 1),
    sampling=st.sampled_from([(P, R), (1_000_000, 8), (50_000, 300), (250_000, 2)]),  # (µs, periods kept)
)
@example(reads=[25_000, 100, 0, 40_000, 1_000], start=1000.0, period=10, duty=0.2, sampling=(P, R))
def test_cumulative_busy_time_is_the_generated_integral(reads: list[int], start: float, period: int, duty: float,
                                                        sampling: tuple[int, int]) -> None:
    """Whatever the read intervals, shorter or longer than the driver's buffer reaches back."""
    sample_period, kept_periods = sampling
    processes = (f'[{{ pid = 11, sm_util = {square(period, duty)} }}, '
                 '{ pid = 12, sm_util = { pattern = "sine", min = 0, max = 0.5, period_seconds = 7 } }, { pid = 13 }]')
    text = gpu_file(square(period * 1.7, 1 - duty, 0.9), processes)
    machine = parse_mock_file(text, "t.toml")
    clock = Clock(start)
    fake = FakeNvml.from_mock_file(machine, clock, sample_period_us=sample_period, sample_buffer=kept_periods)
    with fake.installed():
        source = NvmlSource(clock=clock, xid_events=False)
        source.prepare()
        first = source.read_device(0)
        assert (first.busy_seconds, first.busy_unmeasured_seconds, dict(first.process_busy_seconds)) == (0, 0, {11: 0, 12: 0, 13: 0})
        base = seen = tick(clock.now, sample_period)
        lost: set[int] = set()
        for ms in reads:
            clock.now += ms / 1000
            reading = source.read_device(0)
            last = tick(clock.now, sample_period)
            if last - kept_periods + 1 > seen + 1:  # the periods up to the oldest still held are unmeasured
                lost |= set(range(seen + 1, last - kept_periods + 2))
            seen = max(seen, last)
        source.close()
    kept = [k for k in range(base + 1, seen + 1) if k not in lost]
    gpu = machine.gpus[0]
    busy = generated(gpu.patterns["utilization_ratio"].at, kept, sample_period) / PCT_US
    assert reading.busy_seconds == pytest.approx(busy, abs=1e-9)
    assert reading.busy_unmeasured_seconds == pytest.approx(len(lost) * sample_period / 1e6, abs=1e-9)
    expected = {p.pid: generated(p.sm_util.at, kept, sample_period) / PCT_US if p.sm_util else 0 for p in gpu.processes}
    assert reading.process_busy_seconds.keys() == expected.keys()
    for pid, seconds in expected.items():
        assert reading.process_busy_seconds[pid] == pytest.approx(seconds, abs=1e-9)


def test_a_kernel_busy_in_bursts_shorter_than_a_scrape_counts_in_full() -> None:
    """2 s at full SM use every 10 s, read every 15 s: an instantaneous reading would see 0 or 1."""
    machine = parse_mock_file(gpu_file("0.5", f"[{{ pid = 7, sm_util = {square(10, 0.2)} }}]"), "t.toml")
    assert machine.gpus[0].processes[0].sm_util == Pattern("square", 0, 1, 10, 0, 0.2)
    clock = Clock(1000.0)
    source = MockSource(Path("t.toml"), clock=clock, machine=machine)
    source.read_device(0)
    for _ in range(4):
        clock.now += 15
        reading = source.read_device(0)
    source.close()
    busy = reading.process_busy_seconds[7]
    assert busy == pytest.approx(generated(machine.gpus[0].processes[0].sm_util.at, range(tick(1000.0) + 1, tick(1060.0) + 1)) / PCT_US)
    assert busy == pytest.approx(0.2 * 60, abs=2 * P / 1e6)  # a fifth of the minute, to a period or two
    assert reading.busy_seconds == pytest.approx(0.5 * (tick(1060.0) - tick(1000.0)) * P / 1e6)
    assert reading.busy_unmeasured_seconds == 0


@pytest.fixture
def dgx():
    clock = Clock(1000.0)
    fake = FakeNvml.dgx_a100(clock=clock)
    with fake.installed():
        source = NvmlSource(clock=clock, xid_events=False)
        source.prepare()
        yield fake, source, clock
        source.close()


def test_nothing_newer_is_measured_idle_not_a_failure(dgx) -> None:
    fake, source, clock = dgx
    source.read_device(0)
    clock.now += 5
    busy = source.read_device(0)
    again = source.read_device(0)  # the same instant: NVML answers NOT_FOUND, nothing ran
    assert again.busy_seconds == busy.busy_seconds == pytest.approx(97 * (tick(1005.0) - tick(1000.0)) * P / PCT_US)
    assert again.process_busy_seconds == busy.process_busy_seconds
    assert dict(again.process_utilization) == {}
    assert dict(busy.process_utilization) == {4101: 0.61, 4102: 0.33}
    # An idle GPU (no process ran, 0 %): NOT_FOUND for its process samples, and measured as 0.
    idle = source.read_device(3)
    assert (idle.busy_seconds, dict(idle.process_busy_seconds), dict(idle.process_utilization)) == (0.0, {}, {})
    assert all(not sm for _, sm in fake.samples(3)[1])


def test_a_listed_process_without_samples_was_idle(dgx) -> None:
    fake, source, clock = dgx
    fake.set_processes(0, [(4101, 1 << 30), (4102, 1 << 30), (4200, 1 << 30)])
    source.read_device(0)
    clock.now += 3
    reading = source.read_device(0)
    assert reading.process_busy_seconds[4200] == 0.0
    assert set(reading.process_utilization) == {4101, 4102}
    fake.set_processes(0, [])
    fake.update(0, process_sm={})
    clock.now += 3
    fake.set_processes(0, [(4101, 1 << 30)])
    reading = source.read_device(0)
    # 4102's last samples still count; then it is gone. 4200, never sampled and no longer listed, too.
    assert set(reading.process_busy_seconds) == {4101, 4102}
    clock.now += 3
    assert set(source.read_device(0).process_busy_seconds) == {4101}


def test_a_failed_call_is_none_never_zero_and_the_next_read_catches_up(dgx) -> None:
    fake, source, clock = dgx
    source.read_device(0)
    fake.fail("nvmlDeviceGetSamples", UNKNOWN, index=0)
    clock.now += 5
    failed = source.read_device(0)
    assert (failed.busy_seconds, failed.process_busy_seconds, failed.busy_unmeasured_seconds) == (None, None, None)
    assert dict(failed.process_utilization) == {4101: 0.61, 4102: 0.33}  # its own call worked
    fake.clear_faults()
    fake.fail("nvmlDeviceGetProcessesUtilizationInfo", UNKNOWN, index=0)
    clock.now += 1
    half = source.read_device(0)
    periods = tick(1006.0) - tick(1000.0)
    assert half.busy_seconds == pytest.approx(97 * periods * P / PCT_US, abs=1e-9)  # nothing lost meanwhile
    assert (half.process_busy_seconds, half.process_utilization) == (None, None)
    fake.clear_faults()
    clock.now += 1
    whole = source.read_device(0)
    periods = tick(1007.0) - tick(1000.0)
    assert dict(whole.process_busy_seconds) == pytest.approx({4101: 61 * periods * P / PCT_US, 4102: 33 * periods * P / PCT_US}, abs=1e-9)


def test_mig_enabled_gpus_have_no_samples(dgx) -> None:
    fake, source, clock = dgx
    clock.now += 5
    for index in (6, 7):
        r = source.read_device(index)
        assert (r.busy_seconds, r.process_busy_seconds, r.process_utilization, r.busy_unmeasured_seconds) == (None,) * 4
        assert r.energy_joules is not None


def test_older_drivers_answer_through_the_older_call() -> None:
    clock = Clock(1000.0)
    fake = FakeNvml.v100_old_driver(clock=clock)
    with fake.installed():
        source = NvmlSource(clock=clock, xid_events=False)
        source.prepare()
        assert dict(source.read_device(0).process_busy_seconds) == {3100: 0.0}
        clock.now += 2
        at_update = tick(clock.now)
        fake.update(0, process_sm={3100: 50})  # from the next sampling period on
        clock.now += 2
        reading = source.read_device(0)
        source.close()
    assert reading.process_busy_seconds[3100] == pytest.approx(50 * (tick(clock.now) - at_update - 1) * P / PCT_US, abs=1e-9)
    assert reading.busy_seconds == pytest.approx(71 * (tick(clock.now) - tick(1000.0)) * P / PCT_US, abs=1e-9)
    assert fake.calls["nvmlDeviceGetProcessUtilization"] > 0 and "nvmlDeviceGetProcessesUtilizationInfo" not in fake.calls


def test_the_driver_answers_not_found_when_nothing_is_newer() -> None:
    import pynvml

    clock = Clock(1000.0)
    fake = FakeNvml.dgx_a100(clock=clock)
    with fake.installed():
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        _, samples = pynvml.nvmlDeviceGetSamples(h, pynvml.NVML_GPU_UTILIZATION_SAMPLES, 0)
        assert len(samples) == R and {s.sampleValue.uiVal for s in samples} == {97}
        assert [b.timeStamp - a.timeStamp for a, b in pairwise(samples)] == [P] * (R - 1)
        newest = samples[-1].timeStamp
        assert len(pynvml.nvmlDeviceGetProcessesUtilizationInfo(h, 0)) == 2 * R
        for call in (lambda: pynvml.nvmlDeviceGetSamples(h, pynvml.NVML_GPU_UTILIZATION_SAMPLES, newest),
                     lambda: pynvml.nvmlDeviceGetProcessUtilization(h, newest),
                     lambda: pynvml.nvmlDeviceGetProcessesUtilizationInfo(h, newest)):
            with pytest.raises(pynvml.NVMLError) as caught:
                call()
            assert caught.value.value == NOT_FOUND
        clock.now += 1
        assert len(pynvml.nvmlDeviceGetProcessUtilization(h, newest)) == 2 * (tick(1001.0) - tick(1000.0))
        clock.now += 60  # later than the buffer: only its last R periods are left
        _, samples = pynvml.nvmlDeviceGetSamples(h, pynvml.NVML_GPU_UTILIZATION_SAMPLES, newest)
        assert samples[0].timeStamp == (tick(clock.now) - R + 1) * P and len(samples) == R
        pynvml.nvmlShutdown()


def energy(reading: DeviceReading) -> float:
    assert reading.energy_joules is not None
    return reading.energy_joules


def test_energy_is_the_integral_of_power_however_often_read() -> None:
    schedule = [(3.3, 250_000), (0.4, 90_000), (7.9, 400_000), (2.05, 60_000), (5.0, 60_000)]  # (s later, mW)
    totals = []
    for reads_between in (0, 3):
        clock = Clock(1000.0)
        fake = FakeNvml.dgx_a100(clock=clock)
        with fake.installed():
            source = NvmlSource(clock=clock, xid_events=False)
            source.prepare()
            seen = [energy(source.read_device(0))]
            for later, power in schedule:
                for _ in range(reads_between):
                    clock.now += later / (reads_between + 1)
                    seen.append(energy(source.read_device(0)))
                clock.now = round(clock.now + later / (reads_between + 1), 9) if reads_between else clock.now + later
                fake.update(0, power_mw=power)
                seen.append(energy(source.read_device(0)))
            source.close()
        assert seen == sorted(seen)  # a counter
        totals.append(seen[-1])
    assert totals[0] == pytest.approx(totals[1], abs=1e-3)
    # 362 W until the first change; each level from the sampling period after it was set.
    assert 1000 + 362 * 3.3 < totals[0] < 1000 + 400 * 18.65


def test_a_driver_reload_restarts_energy_and_busy_counters(dgx) -> None:
    fake, source, clock = dgx
    source.read_device(0)
    clock.now += 5
    before = source.read_device(0)
    assert before.busy_seconds > 0 and energy(before) > 1000 and before.nvml_generation == 1
    fake.unload_driver()
    with pytest.raises(TelemetryUnavailable):
        source.read_device(0)
    fake.load_driver()
    reloaded_at = clock.now
    clock.now += 1
    source.prepare()
    after = source.read_device(0)
    assert after.nvml_generation == 2
    assert (after.busy_seconds, dict(after.process_busy_seconds), after.busy_unmeasured_seconds) == (0, {4101: 0, 4102: 0}, 0)
    assert energy(after) == 362_000 * (int(clock.now * 1e6) - int(reloaded_at * 1e6)) // 10**6 / 1000
    assert len(fake.samples(0)[0]) == tick(clock.now) - tick(reloaded_at)  # the buffers restarted empty
    clock.now += 2
    assert source.read_device(0).busy_seconds == pytest.approx(97 * (tick(clock.now) - tick(clock.now - 2)) * P / PCT_US, abs=1e-9)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ('{ pattern = "sine", min = 0, max = 1, duty = 0.2 }', r"\.sm_util\.duty: only a square pattern has a duty cycle"),
        ('{ pattern = "square", min = 0, max = 1, duty = 1.5 }', r"\.sm_util: needs .*0 <= duty <= 1"),
        ('{ pattern = "square", min = 0, max = 2 }', r"\.sm_util: out of range 0\.\.1"),
        ("1.5", r"\.sm_util: out of range 0\.\.1"),
        ("nan", r"\.sm_util: needs finite numbers"),
    ],
)
def test_a_bad_sm_util_names_the_key(value: str, reason: str) -> None:
    with pytest.raises(MockConfigError, match=rf"^t\.toml: devices\[0\]\.processes\[0\]{reason}"):
        parse_mock_file(gpu_file("0.5", f"[{{ pid = 7, sm_util = {value} }}]"), "t.toml")


def test_a_square_pattern_spends_its_duty_at_max() -> None:
    p = Pattern("square", 0.0, 1.0, 10.0, 0.0, 0.2)
    assert [p.at(t) for t in (0, 1.99, 2.0, 9.99, 10.0)] == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert Pattern("square", 0.0, 1.0, 10.0).at(4.9) == 1.0  # the default duty is a half


def test_a_gap_is_dropped_samples_only_when_the_buffer_came_back_full() -> None:
    """A driver that takes no samples of an idle GPU leaves gaps too; only a full buffer lost any."""
    usage = _Usage()
    usage.add_device([(k * 100, 50) for k in range(1, 7)])  # the starting point: six samples held
    usage.add_device([(k * 100, 40) for k in range(7, 9)])
    assert (usage.busy, usage.unmeasured) == (40 * 200, 0)
    usage.add_device([(2000, 90), (2100, 90)])  # nothing for 11 periods, with room to spare: idle
    assert (usage.busy, usage.unmeasured) == (40 * 200 + 90 * 200, 0)
    usage.add_device([(k * 100, 10) for k in range(30, 36)])  # a full buffer, 8 periods late: dropped
    assert (usage.busy, usage.unmeasured) == (40 * 200 + 90 * 200 + 10 * 500, 3000 - 2100)
    usage.add_processes([(2000, 5, 90), (3000, 5, 10), (3100, 5, 10)])  # 3000 ends the unmeasured span
    assert usage.processes == {5: 90 * 100 + 10 * 100}
