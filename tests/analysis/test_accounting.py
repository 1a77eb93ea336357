"""GPU shares, measured use normalised by allocation, and the ledger's counters, on the fake
DGX A100 with the recorded /proc tree (tests/helpers.py describes the node); the ledger's
invariants over random timelines are in test_ledger_properties.py."""

from __future__ import annotations

import pytest
from attribution_node import GPU, K1, K2, K3, K4, K5, MIG, Clock, dgx, kernel, node_kernels, run, tracker

from exporter.analysis.accounting import Accountant
from exporter.analysis.capacity import CapacityConfig
from exporter.telemetry.devices import DeviceResolver
from exporter.telemetry.model import TelemetrySnapshot

SMS = {i: {"multiprocessor_count": 108} for i in range(8)}  # the fake reports no SM count; an A100 has 108
SHARE = 0.5 / 13.5  # 0.5 fGPU shares of a 40 GiB, 108-SM A100: min(40 / 2, 108 / 8) = 13.5 shares


def account(clock: Clock, acc: Accountant, snapshot=None, kernels=None, attribution=True):
    snapshot = snapshot or dgx(gpu=SMS)
    kernels = node_kernels() if kernels is None else kernels
    result = run(tracker(clock=clock), snapshot, kernels) if attribution else None
    gpu_ids = [a.device_id for k in kernels for a in k.allocations if a.slot.startswith("cuda.")]
    return acc.update(kernels, snapshot, DeviceResolver(snapshot, gpu_ids), CapacityConfig(), result)


def test_shares_of_physical_gpus() -> None:
    clock = Clock()
    out = account(clock, Accountant(clock))
    assert out.shares[(K1, GPU[0])] == pytest.approx(SHARE) and out.shares[(K1, GPU[1])] == pytest.approx(SHARE)
    assert out.shares[(K2, GPU[2])] == 1.0 and out.shares[(K4, GPU[4])] == 1.0
    # A MIG slice counts against its GPU: 42 of the 3g.20gb's SMs over the GPU's 108.
    assert out.shares[(K5, GPU[6])] == pytest.approx(42 / 108)
    assert not any(gpu == MIG[0] for _, gpu in out.shares)


def test_use_is_averaged_per_allocated_device_not_summed() -> None:
    clock = Clock()
    out = account(clock, Accountant(clock))
    # K1: GPU 0 at 0.6 + 0.7 (capped at 1), GPU 1 at 0.02: the mean of the two devices.
    assert out.kernels[K1].utilization_ratio == pytest.approx((1.0 + 0.02) / 2)
    assert out.kernels[K2].utilization_ratio == pytest.approx(0.5)
    # K2 holds a whole 40 GiB GPU and uses 10 GiB of it; K3 holds 8 GiB (cuda.mem) and uses 6.
    assert out.kernels[K2].memory_ratio == pytest.approx(0.25)
    # K4 is allocated and measured but has no process: idle, 0, not absent.
    assert out.kernels[K4].utilization_ratio == 0.0 and out.kernels[K4].memory_ratio == 0.0


def test_unmeasured_use_is_absent_never_zero() -> None:
    clock = Clock()
    out = account(clock, Accountant(clock))
    assert out.kernels[K5].utilization_ratio is None  # MIG: no per-process samples
    assert out.kernels[K5].memory_ratio is not None
    failed = TelemetrySnapshot(source="nvml", success=False, error="NVML_ERROR_UNKNOWN")
    out = account(clock, Accountant(clock), snapshot=failed)
    assert all(u.utilization_ratio is None and u.memory_ratio is None for u in out.kernels.values())
    lost = dgx(gpu={**SMS, 0: {"up": False, "multiprocessor_count": 108}})  # GPU 0 fell off the bus
    out = account(clock, Accountant(clock), snapshot=lost)
    assert out.kernels[K1].utilization_ratio is None  # one of K1's two devices unread: no value
    assert out.kernels[K2].utilization_ratio == pytest.approx(0.5)


def busy_at(t: float):
    """The node at ``t`` seconds, GPU 2's process (K2's 2001) busy half of the time; the other
    GPUs' sources count no busy time."""
    return dgx(gpu={**SMS, 0: {"multiprocessor_count": 108, "process_busy_seconds": None, "busy_seconds": None},
                    2: {"multiprocessor_count": 108, "process_busy_seconds": {2001: 0.5 * t}, "busy_seconds": 0.5 * t}})


def test_counters_integrate_in_the_background_whatever_the_cadence() -> None:
    coarse, fine = Clock(), Clock()
    a, b = Accountant(coarse), Accountant(fine)
    account(coarse, a, snapshot=busy_at(0))
    account(fine, b, snapshot=busy_at(0))
    coarse.now = 60
    out_a = account(coarse, a, snapshot=busy_at(60))
    for t in range(1, 61):
        fine.now = t
        out_b = account(fine, b, snapshot=busy_at(t))
    for out in (out_a, out_b):
        assert out.allocated_seconds[(K2, GPU[2])] == pytest.approx(60)
        assert out.allocated_seconds[(K1, GPU[0])] == pytest.approx(60 * SHARE)
        assert out.busy_seconds[(K2, GPU[2])] == pytest.approx(60 * 0.5)
        assert out.measured[GPU[2]] and not out.measured[GPU[0]] and not out.measured[GPU[6]]
        # No busy counter from the source (GPU 0), or MIG: no sample, never 0.
        assert (K1, GPU[0]) not in out.busy_seconds
        assert (K5, GPU[6]) in out.allocated_seconds and (K5, GPU[6]) not in out.busy_seconds


def test_an_ended_kernels_counters_stay_for_the_retention_then_go() -> None:
    clock = Clock()
    acc = Accountant(clock, retention=600)
    account(clock, acc)
    clock.now = 10
    account(clock, acc)
    others = [k for k in node_kernels() if k.kernel_id != K2]
    clock.now = 20
    out = account(clock, acc, kernels=others)
    assert out.allocated_seconds[(K2, GPU[2])] == pytest.approx(20)  # the last interval is counted
    clock.now = 500
    out = account(clock, acc, kernels=others)
    assert out.allocated_seconds[(K2, GPU[2])] == pytest.approx(20) and (K2, GPU[2]) not in out.shares
    clock.now = 700
    assert (K2, GPU[2]) not in account(clock, acc, kernels=others).allocated_seconds


def test_unknown_capacity_gives_no_share_rather_than_a_guess() -> None:
    clock = Clock()
    no_sms = dgx(gpu={i: {"multiprocessor_count": None} for i in range(8)})  # fGPU capacity unknown
    out = account(clock, Accountant(clock), snapshot=no_sms)
    assert (K1, GPU[0]) not in out.shares and (K3, GPU[3]) not in out.shares
    assert out.shares[(K2, GPU[2])] == 1.0
    # Without telemetry a whole device is still a whole device, under the id resource.txt gives.
    k = kernel("00000000-0000-4000-8000-000000000001", {"cuda.device": {"GPU-x": "1"}})
    out = account(clock, Accountant(clock), snapshot=TelemetrySnapshot(source="none"), kernels=[k], attribution=False)
    assert out.shares == {(k.kernel_id, "GPU-x"): 1.0} and out.kernels[k.kernel_id].utilization_ratio is None


def test_an_unchanged_node_reuses_its_rates_and_every_result_stays_as_it_was() -> None:
    """Passes over the same view with nothing measured change no rate: the counters still grow
    exactly, results handed out earlier never change, and a change settles every counter once."""
    clock = Clock()
    snapshot, kernels = dgx(), node_kernels()
    resolver = DeviceResolver(snapshot, [a.device_id for k in kernels for a in k.allocations])
    acc = Accountant(clock)
    cap = CapacityConfig()  # one object: the accountant keys its cache by the configuration's identity
    first = acc.update(kernels, snapshot, resolver, cap, None, version=1)
    assert first.allocated_seconds[(K2, GPU[2])] == 0
    clock.now += 10
    second = acc.update(kernels, snapshot, resolver, cap, None, version=1)
    clock.now += 10
    third = acc.update(kernels, snapshot, resolver, cap, None, version=1)
    assert second.shares is first.shares  # the same rates: nothing was walked again
    assert second.allocated_seconds[(K2, GPU[2])] == pytest.approx(10)
    assert third.allocated_seconds[(K2, GPU[2])] == pytest.approx(20)
    assert first.allocated_seconds[(K2, GPU[2])] == 0  # an earlier result is unchanged
    others = [k for k in kernels if k.kernel_id != K2]
    clock.now += 10
    fourth = acc.update(others, snapshot, resolver, cap, None, version=2)
    clock.now += 10
    fifth = acc.update(others, snapshot, resolver, cap, None, version=2)
    # K2 ended: its counter took the last interval at the old rate, then stopped.
    assert fourth.allocated_seconds[(K2, GPU[2])] == pytest.approx(30) == fifth.allocated_seconds[(K2, GPU[2])]
    assert third.allocated_seconds[(K2, GPU[2])] == pytest.approx(20)
    assert dict(fifth.allocated_seconds).keys() == dict(fourth.allocated_seconds).keys()
