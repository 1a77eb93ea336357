"""The ``mock`` telemetry source: devices described by a Backend.AI mock-accelerator TOML file.

Backend.AI's own ``mock-accelerator.toml`` (``ai.backend.accelerator.mock``) is accepted unchanged::

    slot_name = "cuda"
    device_plugin_name = "CUDADevice"
    devices = [
      { mother_uuid = "c59395cd-…-3d2568aa2d01", model_name = "CUDA GPU", numa_node = 0,
        subproc_count = 108, memory_size = "40G", is_mig_device = false },
      { mother_uuid = "c59395cd-…-3d2568aa2d03", model_name = "MIG-20g", numa_node = 0,
        subproc_count = 56, memory_size = "20G", is_mig_device = true },
    ]
    [attributes]
    nvidia_driver = "450.0.0"
    cuda_runtime = "11.0"
    [formats.devices]   # read by Backend.AI only

Device ids follow the plugin: a whole GPU is its ``mother_uuid`` (reported here with uuid
``GPU-<mother_uuid>``); a MIG device (``is_mig_device = true``, required for ``slot_name = "cuda"``)
is ``MIG-<mother_uuid>/<idx>/0`` with ``idx`` its position in ``devices`` and profile
``model_name.split("-", 1)[1]``. MIG devices are grouped under a physical GPU per
``mother_uuid``; when that GPU is not listed itself, it is synthesised (model "CUDA GPU",
memory and SMs the sum of its MIG devices). The legacy ``cuda_mock`` key ``smp_count`` is read
as ``subproc_count``; ``[attributes]`` and ``[formats]`` are optional here.

Extensions (all optional; Backend.AI ignores unknown keys). Devices may also be written as
``[[devices]]`` tables, which makes the per-device tables below readable.

- top level ``seed`` (int, default 0): seeds the phase of every default pattern.
- per device, numbers or *patterns*: ``utilization_ratio``, ``memory_utilization_ratio``,
  ``memory_used_ratio`` (of ``memory_size``), ``temperature_celsius``, ``power_watts``,
  ``sm_clock_mhz``, ``memory_clock_mhz``, ``fan_speed_ratio``; numbers only:
  ``power_limit_watts`` (default 250, Backend.AI's mock value); strings: ``serial``,
  ``pci_bus_id`` (default ``0000:99:<idx>.0`` as the plugin's ``hw_location``).
  A pattern is ``{ pattern = "sine" | "ramp" | "square", min = …, max = …,
  period_seconds = 240, phase = 0.0‥1.0 }``, evaluated on the injected clock, so a frozen clock
  gives frozen values. Unset fields follow default sine patterns whose phase comes from
  ``seed`` and the device position; fields of one device share the phase, so they move together.
- MIG devices: ``profile`` (default from ``model_name``), ``placement_start``,
  ``placement_size`` (default: the profile's size on a known SKU), ``gpu_instance_id``
  (default: order on the GPU, from 1), ``compute_instance_id`` (default 0),
  ``memory_used_ratio``. When the parent's model is a MIG SKU that
  :mod:`exporter.telemetry.mig` knows (A30, A100, H100, H200), placements are checked against its
  legal starts, and the GPU instances and each profile's remaining capacity are reported as NVML
  would.
- per whole GPU, ``processes = [{ pid = 1001, used_memory = "4G", sm_util = 0.6 }, …]``: its
  compute processes by host PID and their per-process SM samples, for process attribution;
  without the key the process list is unknown, as when NVML cannot read it.
- ``[mig_parents.<mother_uuid>]``: the physical GPU of a group of MIG devices when it is not
  listed in ``devices``: ``model_name``, ``memory_size``, ``subproc_count``, ``numa_node``
  and the per-device keys above.

A MIG-enabled GPU reports no utilization, as NVML does. See docs/mock-devices.md.
"""

from __future__ import annotations

import math
import random
import time
import tomllib
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from exporter.telemetry.mig import GpuInstance, MigProfile, MigTable, creatable_instances, table_for_product
from exporter.telemetry.model import (
    DeviceReading,
    GpuInstanceReading,
    GpuProcess,
    MigDeviceReading,
    MigPlacement,
    MigProfileCapacity,
    SourceConfigError,
    SourceInfo,
    XidCounter,
)
from exporter.units import parse_binary_size

__all__ = ["DEMO_DEVICES_FILE", "MockConfigError", "MockSource"]

# The package data directory: exporter/data/.
DEMO_DEVICES_FILE = Path(__file__).parent.parent / "data" / "demo-devices.toml"


class MockConfigError(SourceConfigError):
    """A mock device file that cannot be used; ``str()`` reads ``path: reason``. A
    :class:`~exporter.telemetry.model.SourceConfigError`, so the CLI exits with status 2."""

    def __init__(self, path: Path | str, reason: str) -> None:
        self.path, self.reason = Path(path), reason
        super().__init__(f"{path}: {reason}")


@dataclass(frozen=True, slots=True)
class _Pattern:
    kind: str  # "constant", "sine", "ramp", "square"
    low: float
    high: float
    period: float = 240.0
    phase: float = 0.0

    def at(self, t: float) -> float:
        if self.kind == "constant":
            return self.low
        frac = (t / self.period + self.phase) % 1.0
        if self.kind == "sine":
            level = 0.5 + 0.5 * math.sin(2 * math.pi * frac)
        elif self.kind == "ramp":
            level = frac
        else:
            level = 1.0 if frac < 0.5 else 0.0
        return self.low + (self.high - self.low) * level


# Default patterns as (min, max, period); power is scaled by the device's power limit.
_DEFAULTS: Mapping[str, tuple[float, float, float]] = {
    "utilization_ratio": (0.05, 0.95, 240.0),
    "memory_utilization_ratio": (0.02, 0.6, 240.0),
    "memory_used_ratio": (0.25, 0.85, 900.0),
    "temperature_celsius": (34.0, 76.0, 240.0),
    "power_watts": (0.22, 0.92, 240.0),
    "sm_clock_mhz": (1050.0, 1410.0, 240.0),
    "memory_clock_mhz": (1593.0, 1593.0, 240.0),
}
_PATTERN_KEYS = (*_DEFAULTS, "fan_speed_ratio")
_DEFAULT_POWER_LIMIT_W = 250.0  # Backend.AI's mock plugin reports 250 W


@dataclass(slots=True)
class _MockMig:
    device_id: str
    position: int
    profile: str
    memory_bytes: int
    multiprocessors: int
    memory_used: _Pattern
    placement_start: int | None
    placement_size: int | None
    gpu_instance_id: int | None
    compute_instance_id: int | None
    placement: MigPlacement | None = None  # set by _check_layout


@dataclass(slots=True)
class _MockGpu:
    mother_uuid: str
    index: int
    model_name: str
    numa_node: int
    multiprocessors: int | None
    memory_bytes: int | None
    pci_bus_id: str
    serial: str | None
    power_limit_watts: float
    patterns: dict[str, _Pattern]
    listed: bool  # False: synthesised as the parent of MIG devices
    migs: list[_MockMig] = field(default_factory=list)
    # (pid, used memory bytes, SM ratio or None); None: no process list (as when NVML cannot read it)
    processes: tuple[tuple[int, int | None, float | None], ...] | None = None


@dataclass(frozen=True, slots=True)
class _MockFile:
    gpus: tuple[_MockGpu, ...]
    driver_version: str | None
    cuda_version: str | None


def _processes(r: _Reader, table: Mapping[str, Any], where: str) -> tuple[tuple[int, int | None, float | None], ...] | None:
    """``processes = [{ pid = 1001, used_memory = "4G", sm_util = 0.6 }, …]``: compute processes by
    host PID, as NVML lists them (and samples their SM use) on a GPU without MIG."""
    entries = r.get(table, "processes", where, list, None)
    if entries is None:
        return None
    out = []
    for i, entry in enumerate(entries):
        at = f"{where}.processes[{i}]"
        if not isinstance(entry, dict):
            raise r.fail(at, f"expected a table, got {entry!r}")
        util = r.get(entry, "sm_util", at, (int, float), None)
        if util is not None and not 0 <= util <= 1:
            raise r.fail(f"{at}.sm_util", f"must be within 0-1, got {util}")
        out.append((r.count(entry, "pid", at, 1), r.size(entry, "used_memory", at, None), None if util is None else float(util)))
    return tuple(out)


class _Reader:
    """Typed access to the TOML tables; every error names the file and the offending key."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, where: str, reason: str) -> MockConfigError:
        return MockConfigError(self.path, f"{where}: {reason}" if where else reason)

    def get(self, table: Mapping[str, Any], key: str, where: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        if key not in table:
            if default is ...:
                raise self.fail(where or key, f"missing required key {key!r}" if where else "missing required key")
            return default
        value = table[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # bool is an int subclass, but a TOML true is never a count.
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            names = " or ".join(t.__name__ for t in kinds)
            raise self.fail(f"{where}.{key}" if where else key, f"expected {names}, got {value!r}")
        return value

    def count(self, table: Mapping[str, Any], key: str, where: str, minimum: int, default: Any = ...) -> Any:
        value = self.get(table, key, where, int, default)
        if value is not None and value < minimum:
            raise self.fail(f"{where}.{key}", f"must be at least {minimum}, got {value}")
        return value

    def subproc_count(self, table: Mapping[str, Any], where: str, default: Any = ...) -> Any:
        # The legacy cuda_mock format called it smp_count.
        key = "smp_count" if "smp_count" in table and "subproc_count" not in table else "subproc_count"
        return self.count(table, key, where, 1, default)

    def size(self, table: Mapping[str, Any], key: str, where: str, default: Any = ...) -> Any:
        value = self.get(table, key, where, (str, int), default)
        if value is None:
            return None
        try:
            size = parse_binary_size(str(value))
        except ValueError as exc:
            raise self.fail(f"{where}.{key}", str(exc)) from None
        if size <= 0:
            raise self.fail(f"{where}.{key}", "must be positive")
        return size

    def pattern(self, table: Mapping[str, Any], key: str, where: str, default: _Pattern | None) -> _Pattern | None:
        if key not in table:
            return default
        value, where = table[key], f"{where}.{key}"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            pattern = _Pattern("constant", float(value), float(value))
        elif isinstance(value, dict):
            kind = self.get(value, "pattern", where, str)
            if kind not in ("sine", "ramp", "square"):
                raise self.fail(f"{where}.pattern", f"expected sine, ramp or square, got {kind!r}")
            pattern = _Pattern(
                kind,
                float(self.get(value, "min", where, (int, float))),
                float(self.get(value, "max", where, (int, float))),
                float(self.get(value, "period_seconds", where, (int, float), 240.0)),
                float(self.get(value, "phase", where, (int, float), default.phase if default else 0.0)),
            )
            if pattern.low > pattern.high or pattern.period <= 0 or not 0 <= pattern.phase <= 1:
                raise self.fail(where, "needs min <= max, period_seconds > 0 and 0 <= phase <= 1")
        else:
            raise self.fail(where, f"expected a number or a pattern table, got {value!r}")
        if pattern.low < 0 or (key in _UNIT_INTERVAL and pattern.high > 1):
            raise self.fail(where, "out of range" + (" 0..1" if key in _UNIT_INTERVAL else ": negative"))
        return pattern


_UNIT_INTERVAL = ("utilization_ratio", "memory_utilization_ratio", "memory_used_ratio")


def _load_mock_file(path: Path) -> _MockFile:
    """Parse and validate a mock device file.

    :raises MockConfigError: unreadable file, invalid TOML, or an invalid device entry.
    """
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except OSError as exc:
        raise MockConfigError(path, f"cannot read the file ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise MockConfigError(path, f"invalid TOML: {exc}") from None
    r = _Reader(path)
    slot_name = r.get(raw, "slot_name", "", str, "cuda")
    r.get(raw, "device_plugin_name", "", str, None)
    r.get(raw, "formats", "", dict, None)
    seed = r.get(raw, "seed", "", int, 0)
    attributes = r.get(raw, "attributes", "", dict, {})
    entries = r.get(raw, "devices", "", list)
    parents = r.get(raw, "mig_parents", "", dict, {})
    # The legacy cuda_mock format kept the versions at the top level.
    driver = attributes.get("nvidia_driver", raw.get("nvidia_driver"))
    cuda = attributes.get("cuda_runtime", raw.get("cuda_runtime"))
    if slot_name == "cuda":  # the plugin's defaults for the cuda slot
        driver, cuda = driver or "450.00.00", cuda or "11.0"

    gpus: dict[str, _MockGpu] = {}

    def add_gpu(mother: str, table: Mapping[str, Any], where: str, position: int, listed: bool) -> _MockGpu:
        phase = random.Random(f"{seed}/{mother}").random()
        limit = float(r.get(table, "power_limit_watts", where, (int, float), _DEFAULT_POWER_LIMIT_W))
        patterns: dict[str, _Pattern] = {}
        for key in _PATTERN_KEYS:
            default = None
            if key in _DEFAULTS:
                low, high, period = _DEFAULTS[key]
                scale = limit if key == "power_watts" else 1.0
                default = _Pattern("sine", low * scale, high * scale, period, phase)
            pattern = r.pattern(table, key, where, default)
            if pattern is not None:
                patterns[key] = pattern
        gpus[mother] = _MockGpu(
            mother_uuid=mother,
            index=len(gpus),
            model_name=r.get(table, "model_name", where, str, "CUDA GPU"),
            numa_node=r.count(table, "numa_node", where, 0, 0),
            multiprocessors=r.subproc_count(table, where, None),
            memory_bytes=r.size(table, "memory_size", where, None),
            pci_bus_id=r.get(table, "pci_bus_id", where, str, f"0000:99:{position:02d}.0"),
            serial=r.get(table, "serial", where, str, None),
            power_limit_watts=limit,
            patterns=patterns,
            listed=listed,
            processes=_processes(r, table, where),
        )
        return gpus[mother]

    migs: list[tuple[str, _MockMig]] = []
    for position, entry in enumerate(entries):
        where = f"devices[{position}]"
        if not isinstance(entry, dict):
            raise r.fail(where, f"expected a table, got {entry!r}")
        mother = r.get(entry, "mother_uuid", where, str)
        if not mother.strip() or any(c.isspace() or not c.isprintable() for c in mother):
            raise r.fail(f"{where}.mother_uuid", f"not a usable device id: {mother!r}")
        # What Backend.AI's plugin requires of every entry.
        r.get(entry, "model_name", where, str)
        r.count(entry, "numa_node", where, 0)
        r.subproc_count(entry, where)
        r.size(entry, "memory_size", where)
        if r.get(entry, "is_mig_device", where, bool, ... if slot_name == "cuda" else False) and slot_name == "cuda":
            migs.append((mother, _mig_entry(r, entry, where, position, mother, seed)))
        elif mother in gpus:
            raise r.fail(f"{where}.mother_uuid", f"duplicate device {mother!r}")
        else:
            add_gpu(mother, entry, where, position, listed=True)

    for mother, mig in migs:
        gpu = gpus.get(mother)
        if gpu is None:
            table = r.get(parents, mother, "mig_parents", dict, {})
            gpu = add_gpu(mother, table, f"mig_parents.{mother}", mig.position, listed=False)
        gpu.migs.append(mig)
    for mother in parents:
        if mother not in gpus or gpus[mother].listed:
            raise r.fail(f"mig_parents.{mother}", "not the mother_uuid of MIG devices whose GPU is unlisted")

    for gpu in gpus.values():
        gpu.memory_bytes = gpu.memory_bytes or sum(m.memory_bytes for m in gpu.migs)
        gpu.multiprocessors = gpu.multiprocessors or sum(m.multiprocessors for m in gpu.migs)
        _check_layout(r, gpu)
    return _MockFile(tuple(gpus.values()), driver, cuda)


def _mig_entry(r: _Reader, entry: Mapping[str, Any], where: str, position: int, mother: str, seed: int) -> _MockMig:
    model = entry["model_name"]
    if "-" not in model and "profile" not in entry:
        # Backend.AI derives the slot from model_name.split("-", 1)[1] and fails without a dash.
        raise r.fail(f"{where}.model_name", f"a MIG device's model_name needs a '-<profile>' suffix, got {model!r}")
    phase = random.Random(f"{seed}/{mother}/{position}").random()
    return _MockMig(
        device_id=f"MIG-{mother}/{position}/0",
        position=position,
        profile=r.get(entry, "profile", where, str, model.split("-", 1)[-1]),
        memory_bytes=r.size(entry, "memory_size", where),
        multiprocessors=r.subproc_count(entry, where),
        memory_used=r.pattern(entry, "memory_used_ratio", where, _Pattern("sine", 0.1, 0.9, 600.0, phase)),
        placement_start=r.count(entry, "placement_start", where, 0, None),
        placement_size=r.count(entry, "placement_size", where, 1, None),
        gpu_instance_id=r.count(entry, "gpu_instance_id", where, 0, None),
        compute_instance_id=r.count(entry, "compute_instance_id", where, 0, None),
    )


def _check_layout(r: _Reader, gpu: _MockGpu) -> None:
    """Resolve each MIG device's placement and GI id, rejecting what a real GPU would refuse."""
    placed = [m for m in gpu.migs if m.placement_start is not None]
    if not placed:
        return
    table = table_for_product(gpu.model_name)
    instances: dict[int, MigPlacement] = {}
    for mig in gpu.migs:
        where = f"devices[{mig.position}]"
        if mig.placement_start is None:
            raise r.fail(where, "placement_start is needed once another MIG device of this GPU has one")
        profile = _profile(table, mig.profile)
        if table is not None and profile is None:
            raise r.fail(where, f"{mig.profile!r} is not a MIG profile of {gpu.model_name}")
        size = mig.placement_size or (profile.memory_slices if profile else None)
        if size is None:
            raise r.fail(where, f"placement_size is needed for profile {mig.profile!r} on {gpu.model_name!r}")
        placement = MigPlacement(mig.placement_start, size)
        if profile is not None and (placement.start not in profile.starts or size != profile.memory_slices):
            raise r.fail(where, f"{mig.profile} cannot be placed at {placement.start}:{size} on {gpu.model_name}")
        gi_id = mig.gpu_instance_id
        if gi_id is None:  # compute instances of one GI share its placement
            same = [i for i, p in instances.items() if p == placement]
            gi_id = same[0] if same else max(instances, default=0) + 1
        for other_id, other in instances.items():
            overlap = (((1 << size) - 1) << placement.start) & (((1 << other.size) - 1) << other.start)
            if (other_id == gi_id and other != placement) or (other_id != gi_id and overlap):
                raise r.fail(where, f"placement {placement.start}:{size} conflicts with GPU instance {other_id}")
        instances[gi_id] = placement
        mig.placement, mig.gpu_instance_id = placement, gi_id
        mig.compute_instance_id = mig.compute_instance_id or 0


def _profile(table: MigTable | None, name: str) -> MigProfile | None:
    try:
        return table.profile(name) if table is not None else None
    except KeyError:
        return None


def _gpu_uuid(mother_uuid: str) -> str:
    return mother_uuid if mother_uuid.startswith("GPU-") else f"GPU-{mother_uuid}"


class MockSource:
    """Serves the devices of a mock file, their values following patterns on ``clock``.

    :param path: the TOML file.
    :param clock: seconds since the epoch; patterns and the energy counter follow it.
    :raises MockConfigError: an unreadable file, invalid TOML or an invalid entry.
    """

    name = "mock"
    may_block = False

    def __init__(self, path: Path, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self._file = _load_mock_file(self.path)
        self._clock = clock
        self._energy: dict[int, tuple[float, float]] = {}  # device index -> (time, joules)

    def prepare(self) -> SourceInfo:
        gpus = self._file.gpus
        return SourceInfo(
            device_keys=tuple(range(len(gpus))),
            driver_version=self._file.driver_version,
            cuda_version=self._file.cuda_version,
            device_count=len(gpus),
        )

    def read_device(self, key: Hashable) -> DeviceReading:
        gpu = self._file.gpus[key]  # type: ignore[index]
        t = self._clock()

        def value(name: str, scale: float = 1.0) -> float | None:
            pattern = gpu.patterns.get(name)
            return None if pattern is None else pattern.at(t) * scale

        migs = tuple(self._mig_reading(gpu, mig, t) for mig in gpu.migs)
        mig_on = bool(migs)
        memory_total = gpu.memory_bytes or 0
        if mig_on:  # the aggregate over GPU instances, as a privileged NVML reader sees it
            memory_used = sum(m.memory_used_bytes or 0 for m in migs)
        else:
            memory_used = int(memory_total * (value("memory_used_ratio") or 0.0))
        power = value("power_watts")
        instances, capacity = self._layout(gpu)
        mig_capable = table_for_product(gpu.model_name) is not None
        return DeviceReading(
            uuid=_gpu_uuid(gpu.mother_uuid),
            index=gpu.index,
            name=gpu.model_name,
            pci_bus_id=gpu.pci_bus_id,
            serial=gpu.serial,
            last_update_timestamp=t,
            memory_total_bytes=memory_total,
            memory_used_bytes=memory_used,
            # NVML reports no utilization on MIG-enabled GPUs.
            utilization_gpu_ratio=None if mig_on else value("utilization_ratio"),
            utilization_memory_ratio=None if mig_on else value("memory_utilization_ratio"),
            temperature_celsius=value("temperature_celsius"),
            power_usage_watts=power,
            power_limit_watts=gpu.power_limit_watts,
            energy_joules=self._energy_at(gpu.index, t, power),
            sm_clock_hz=value("sm_clock_mhz", 1e6),
            memory_clock_hz=value("memory_clock_mhz", 1e6),
            fan_speed_ratio=value("fan_speed_ratio"),
            mig_mode_current=mig_on or (False if mig_capable else None),
            mig_mode_pending=mig_on or (False if mig_capable else None),
            # A file without placements leaves the layout unknown, not unreadable.
            mig_layout_readable=True if mig_on and migs[0].placement is not None else None,
            mig_devices=migs,
            gpu_instances=instances,
            mig_profile_capacity=capacity,
            multiprocessor_count=gpu.multiprocessors,
            numa_node=gpu.numa_node,
            processes=None if gpu.processes is None else tuple(GpuProcess(pid, mem) for pid, mem, _ in gpu.processes),
            process_utilization=None if gpu.processes is None or mig_on else MappingProxyType(
                {pid: util for pid, _, util in gpu.processes if util is not None}),
        )

    @staticmethod
    def _mig_reading(gpu: _MockGpu, mig: _MockMig, t: float) -> MigDeviceReading:
        return MigDeviceReading(
            uuid=mig.device_id,
            parent_uuid=_gpu_uuid(gpu.mother_uuid),
            index=mig.position,
            profile=mig.profile,
            gpu_instance_id=mig.gpu_instance_id,
            compute_instance_id=mig.compute_instance_id,
            placement=mig.placement,
            memory_total_bytes=mig.memory_bytes,
            memory_used_bytes=int(mig.memory_bytes * mig.memory_used.at(t)),
            multiprocessor_count=mig.multiprocessors,
        )

    @staticmethod
    def _layout(gpu: _MockGpu) -> tuple[tuple[GpuInstanceReading, ...], tuple[MigProfileCapacity, ...] | None]:
        if not gpu.migs or gpu.migs[0].placement is None:
            return (), None
        table = table_for_product(gpu.model_name)
        instances: dict[int, GpuInstanceReading] = {}
        for m in gpu.migs:
            assert m.gpu_instance_id is not None and m.placement is not None  # set by _check_layout
            profile = _profile(table, m.profile)
            profile_id = profile.profile_id if profile else None
            instances[m.gpu_instance_id] = GpuInstanceReading(m.gpu_instance_id, profile_id, m.profile, m.placement)
        gis = tuple(instances[k] for k in sorted(instances))
        if table is None:
            return gis, None
        # What NVML's RemainingCapacity answers: a greedy pass over each profile's legal starts.
        remaining = creatable_instances(table, [GpuInstance(gi.profile or "", gi.placement.start, gi.placement.size) for gi in gis])
        capacity = tuple(
            MigProfileCapacity(
                profile_id=p.profile_id,
                name=p.name,
                slice_count=p.compute_slices,
                instance_count=p.max_instances,
                memory_bytes=None,  # per-profile sizes are the driver's; the file gives only its devices'
                multiprocessor_count=None,
                remaining=remaining[p.name],
                placements=tuple(MigPlacement(s, p.memory_slices) for s in p.starts),
            )
            for p in table.profiles
        )
        return gis, capacity

    def _energy_at(self, index: int, t: float, power: float | None) -> float | None:
        """Integrates power over the clock, so the counter only grows."""
        if power is None:
            return None
        last_t, joules = self._energy.get(index, (t, 0.0))
        if t > last_t:
            joules += power * (t - last_t)
        self._energy[index] = (max(t, last_t), joules)
        return joules

    def xid_counters(self) -> tuple[XidCounter, ...]:
        return ()

    def close(self) -> None:
        pass
