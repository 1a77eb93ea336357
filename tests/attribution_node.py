"""The attribution node (the fake DGX A100 with a recorded /proc
tree).

The attribution node: ``tests/fixtures/proc`` holds one directory per host PID (``stat``,
``cgroup``, ``mountinfo``), as node_exporter's fixtures do:

====  ====================  ==============================================================
pid   who                   how it shows
====  ====================  ==============================================================
1001  kernel K1             cgroup v1, Docker cgroupfs driver; on GPU 0 and GPU 1
1002  kernel K1             same container, GPU 0
2001  kernel K2             cgroup v2, systemd driver; ``comm`` with spaces and parentheses
2002  kernel K2             same, but on GPU 3, which K2 does not hold (isolation breach)
3001  kernel K3             CID= not appended yet: found by its ``/home/config`` bind mount;
                            the scratch root's filesystem is mounted at /var/lib/backend.ai
4001  host process          user session; host mounts include K4's tmpfs mount *point*
5001  kernel K5             hybrid cgroup v1 + v2, systemd driver; GPU 6's 3g.20gb MIG device
5002  kernel K5             GPU 6's 2g.10gb MIG device, which K5 does not hold (breach)
6001  leaked container      its kernel's directory is gone; a 1g.5gb MIG device of GPU 7
7001  kernel K4             cgroup v2; listed only when a test starts K4's process
9999  (no entry)            exited between NVML's list and /proc
====  ====================  ==============================================================
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from decimal import Decimal
from pathlib import Path

from helpers import FIXTURES

from exporter.analysis.attribution import AttributionTracker, ProcFS
from exporter.scratch.allocation import Kernel, KernelState
from exporter.scratch.resources import Allocation, ResourceSpec
from exporter.telemetry.devices import DeviceResolver
from exporter.telemetry.model import DeviceReading, TelemetrySnapshot
from exporter.telemetry.nvml import NvmlSource
from exporter.telemetry.nvml.simulated import GIB as GiB
from exporter.telemetry.nvml.simulated import FakeNvml

PROC = FIXTURES / "proc"


SCRATCH = "/var/lib/backend.ai/scratches"


K1 = "0b3f6a52-1c2d-4e5f-8a9b-0c1d2e3f4a51"


K2 = "1c4e7b63-2d3e-4f60-9bac-1d2e3f4a5b62"


K3 = "2d5f8c74-3e4f-4071-acbd-2e3f4a5b6c73"


K4 = "3e609d85-4f50-4182-bdce-3f4a5b6c7d84"


K5 = "4f71ae96-5061-4293-cedf-4a5b6c7d8e95"


K6 = "5082bfa7-6172-43a4-dfe0-5b6c7d8e9fa6"


CID = {
    K1: "badb7283766a112aebdb2936077a25f5db85ea465cdbac330ba6641d38c4ac77",
    K2: "6897ab3e7bed435cf094a10477f16bf68af03a04d99b2833d43902ce2b40f0a9",
    K4: "0d4c" * 16,
    K5: "e75d1509b86b903f14316bbc8b9ba4ccb96f18b8543a423f24e5e869aac65097",
}


LEAKED_CID = "749c6e87acfeab8be0a145721650f755ffbe9e02d173ba0b5ab169728edaa480"


K3_CID = "54c41e0402abdddf802c5423f301d6e4231e205de082057831912ae6450d95be"


# Where the fixture PIDs run on the fake DGX A100: (GPU index, MIG index or None) -> [(pid, bytes)].
# GPU 6 is in MIG mode with 3g.20gb, 2g.10gb and 1g.5gb devices, GPU 7 with seven 1g.5gb.
PLACEMENT = {
    (0, None): [(1001, 4 * GiB), (1002, 2 * GiB)],
    (1, None): [(1001, 4 * GiB)],
    (2, None): [(2001, 10 * GiB)],
    (3, None): [(2002, 1 * GiB), (3001, 6 * GiB)],
    (5, None): [(4001, GiB // 2), (9999, GiB // 4)],
    (6, 0): [(5001, 8 * GiB)],
    (6, 1): [(5002, 1 * GiB)],
    (7, 3): [(6001, 3 * GiB)],
}


# Per-process SM samples (pid -> 0-1) of the GPUs without MIG, the field requested from telemetry.
UTILIZATION = {0: {1001: 0.6, 1002: 0.7}, 1: {1001: 0.02}, 2: {2001: 0.5}, 3: {3001: 0.3}, 4: {}, 5: {4001: 0.1}}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Reading(DeviceReading):
    """A reading with per-process SM samples, until telemetry provides ``process_utilization``."""

    process_utilization: Mapping[int, float] | None = None


@functools.cache
def _sampled() -> tuple[DeviceReading, ...]:
    """The fake DGX A100 read once through the real NVML source, with the fixture PIDs placed."""
    fake = FakeNvml.dgx_a100()
    for gpu in fake.gpus:
        fake.set_processes(gpu.index, PLACEMENT.get((gpu.index, None), []))
        for _, ci in gpu.cis():
            fake.set_processes(gpu.index, PLACEMENT.get((gpu.index, ci.mig_index), []), mig_index=ci.mig_index)
    with fake.installed():
        source = NvmlSource()
        try:
            return tuple(source.read_device(key) for key in source.prepare().device_keys)
        finally:
            source.close()


GPU = [d.uuid for d in _sampled()]


MIG = [m.uuid for m in _sampled()[6].mig_devices]  # 3g.20gb, 2g.10gb, 1g.5gb


LEAKED_MIG = _sampled()[7].mig_devices[3].uuid


def dgx(gpu: Mapping[int, dict] | None = None, mig: Mapping[tuple[int, int], dict] | None = None) -> TelemetrySnapshot:
    """One telemetry sample of the fake DGX A100; ``gpu``/``mig`` replace fields of single devices."""
    gpu, mig = gpu or {}, mig or {}
    devices = []
    for d in _sampled():
        fields = {f.name: getattr(d, f.name) for f in dataclasses.fields(DeviceReading)}
        fields["process_utilization"] = UTILIZATION.get(d.index)
        fields["mig_devices"] = tuple(dataclasses.replace(m, **mig.get((d.index, m.index), {})) for m in d.mig_devices)
        devices.append(Reading(**{**fields, **gpu.get(d.index, {})}))
    return TelemetrySnapshot(source="nvml", devices=tuple(devices), success=True)


def kernel(kid, allocations, cid=None, root=SCRATCH) -> Kernel:
    allocs = tuple(Allocation(slot, dev, Decimal(a)) for slot, per_dev in allocations.items() for dev, a in per_dev.items())
    return Kernel(kid, root, KernelState.OK, ResourceSpec(allocs, (), cid), None, 0.0)


def node_kernels(gpu=GPU, mig=MIG):
    return [
        kernel(K1, {"cuda.shares": {gpu[0]: "0.5", gpu[1]: "0.5"}, "cpu": {"0": "1", "1": "1"}}, CID[K1]),
        kernel(K2, {"cuda.device": {gpu[2]: "1"}, "cpu": {"2": "1"}}, CID[K2]),
        kernel(K3, {"cuda.shares": {gpu[3]: "1.0"}}),
        kernel(K4, {"cuda.device": {gpu[4]: "1"}}, CID[K4]),
        kernel(K5, {"cuda.device:3g.20gb-mig": {mig[0]: "1"}}, CID[K5]),
        kernel(K6, {"cuda.device:1g.5gb-mig": {mig[2]: "1"}}, "6b6b" * 16),
    ]


class Clock:
    def __init__(self, now=0.0):
        self.now = now

    def __call__(self):
        return self.now


def tracker(proc=PROC, clock=None, **kw) -> AttributionTracker:
    return AttributionTracker(ProcFS(proc) if isinstance(proc, Path) else proc, clock or Clock(), **kw)


def run(t: AttributionTracker, snapshot: TelemetrySnapshot | None = None, kernels=None):
    """One update, with the device resolver the exporter builds per sample."""
    snapshot = snapshot or dgx()
    kernels = node_kernels() if kernels is None else kernels
    gpu_ids = [a.device_id for k in kernels for a in k.allocations if a.slot.startswith("cuda.")]
    return t.update(snapshot, kernels, DeviceResolver(snapshot, gpu_ids))


def usage(result, kernel_id, device_id):
    found = [u for u in result.kernels if (u.kernel_id, u.device_id) == (kernel_id, device_id)]
    assert len(found) <= 1
    return found[0] if found else None


def unattributed(result, device_id):
    return {u.reason: (u.processes, u.memory_used_bytes) for u in result.unattributed if u.device_id == device_id and u.processes}
