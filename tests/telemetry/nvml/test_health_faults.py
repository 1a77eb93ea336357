"""The simulated NVML's health faults, read through the real binding: XIDs of one GPU instance,
a GPU reset, a dead PID in a process list, reserved memory and a pending row remap."""

from __future__ import annotations

from helpers import wait_for

from exporter.telemetry.nvml import NvmlSource
from exporter.telemetry.nvml.simulated import GIB, FakeNvml


def test_xid_scopes_reset_and_the_fault_fields_reach_the_readings() -> None:
    fake = FakeNvml.dgx_a100()
    with fake.installed():
        source = NvmlSource(event_wait_ms=20)
        try:
            keys = source.prepare().device_keys
            gi = source.read_device(6).mig_devices[0].gpu_instance_id
            fake.push_xid(6, 94, gi)
            fake.push_xid(6, 94)
            wait_for(lambda: any(x.count == 2 for x in source.xid_counters()))
            (counter,) = source.xid_counters()
            assert counter.xid == 94 and counter.gpu_instance_ids == (gi, None)

            fake.set_processes(0, [(2**22 + 7, 3 * GIB)])  # a PID no process has: NVML still lists it
            fake.update(0, remapped_rows=(0, 1, 1, 0))
            before = source.read_device(0)
            assert [p.pid for p in before.processes] == [2**22 + 7]
            assert before.memory_reserved_bytes > 0 and before.remapped_rows_pending is True
            assert before.nvml_generation == 1 and len(keys) == 8

            fake.reset(0)
            after = source.read_device(0)
            assert after.energy_joules < before.energy_joules
            assert after.remapped_rows_pending is False and after.remapped_rows_uncorrectable == 1
        finally:
            source.close()
