"""Backend.AI's mock-accelerator TOML, read into the description of a simulated machine.

:func:`parse_mock_file` takes the file's text (and its name, for messages) and returns a
:class:`MockMachine`: GPUs, MIG devices, value patterns, processes, versions. It says what the
machine *is*; what NVML answers about it (MIG aggregates, no utilisation on MIG, remaining
capacity, energy) is the simulated library's business (:meth:`FakeNvml.from_mock_file
<exporter.telemetry.nvml.simulated.FakeNvml.from_mock_file>`), and readings are the binding's.
No NVML here, and no I/O.

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

Device ids follow the plugin: a whole GPU is its ``mother_uuid`` (its NVML uuid is
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
  period_seconds = 240, phase = 0.0‥1.0 }``, a function of the clock; a square pattern also
  takes ``duty`` (0‥1, default 0.5), the fraction of each period it spends at ``max`` (first,
  from the period's start as ``phase`` shifts it). Unset fields follow default sine patterns
  whose phase comes from ``seed`` and the device position; fields of one device share the
  phase, so they move together.
- MIG devices: ``profile`` (default from ``model_name``), ``placement_start``,
  ``placement_size`` (default: the profile's size on a known SKU), ``gpu_instance_id``
  (default: order on the GPU, from 1; devices with one placement share a GPU instance),
  ``compute_instance_id`` (default 0), ``memory_used_ratio``. When the parent's model is a MIG SKU
  that :mod:`exporter.telemetry.mig` knows (A30, A100, H100, H200), placements are checked against
  its legal starts.
- per whole GPU, ``processes = [{ pid = 1001, used_memory = "4G", sm_util = 0.6 }, …]``: its
  compute processes by host PID and their per-process SM samples, for process attribution;
  without the key the process list is unknown, as when NVML cannot read it. ``sm_util`` (0‥1)
  is a number or a pattern, e.g. a kernel busy in bursts:
  ``sm_util = { pattern = "square", min = 0, max = 1, period_seconds = 10, duty = 0.2 }``
  (2 s at full SM use every 10 s); the driver samples it every 1/6 s, so bursts shorter than a
  scrape interval still count in full in the busy-time counters.
- ``[mig_parents.<mother_uuid>]``: the physical GPU of a group of MIG devices when it is not
  listed in ``devices``: ``model_name``, ``memory_size``, ``subproc_count``, ``numa_node``
  and the per-device keys above (but ``processes``: a MIG-enabled GPU's processes run in its
  MIG devices).

See docs/mock-devices.md.
"""

from __future__ import annotations

import math
import random
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from exporter.telemetry.mig import MigProfile, MigTable, table_for_product
from exporter.telemetry.model import MigPlacement, SourceConfigError
from exporter.units import parse_binary_size

__all__ = ["MockConfigError", "MockGpu", "MockMachine", "MockMigDevice", "MockProcess", "Pattern", "parse_mock_file"]


class MockConfigError(SourceConfigError):
    """A mock device file that cannot be used; ``str()`` reads ``path: reason``. A
    :class:`~exporter.telemetry.model.SourceConfigError`, so the CLI exits with status 2."""

    def __init__(self, path: Path | str, reason: str) -> None:
        self.path, self.reason = Path(path), reason
        super().__init__(f"{path}: {reason}")


@dataclass(frozen=True, slots=True)
class Pattern:
    """A value as a function of the clock: constant, or sine/ramp/square between ``low`` and
    ``high`` with ``period`` seconds and ``phase`` (0-1) into the period; a square is at ``high``
    for the first ``duty`` (0-1) of each period."""

    kind: str  # "constant", "sine", "ramp", "square"
    low: float
    high: float
    period: float = 240.0
    phase: float = 0.0
    duty: float = 0.5  # square only

    def at(self, t: float) -> float:
        """The value at ``t`` seconds since the epoch."""
        if self.kind == "constant":
            return self.low
        frac = (t / self.period + self.phase) % 1.0
        if self.kind == "sine":
            level = 0.5 + 0.5 * math.sin(2 * math.pi * frac)
        elif self.kind == "ramp":
            level = frac
        else:
            level = 1.0 if frac < self.duty else 0.0
        return self.low + (self.high - self.low) * level


@dataclass(frozen=True, slots=True)
class MockProcess:
    """A compute process on a whole GPU: host PID, memory (bytes, None: not available) and the SM
    share of its samples over the clock (0-1, None: never sampled)."""

    pid: int
    used_memory_bytes: int | None
    sm_util: Pattern | None


@dataclass(frozen=True, slots=True)
class MockMigDevice:
    """One MIG device (a compute instance in its GPU instance)."""

    uuid: str  # MIG-<mother_uuid>/<position>/0, as the mock plugin names it
    position: int  # index in ``devices``
    profile: str
    memory_bytes: int
    multiprocessors: int
    memory_used: Pattern  # ratio of memory_bytes
    gpu_instance_id: int
    compute_instance_id: int
    placement: MigPlacement | None  # None: the file gives no layout


@dataclass(frozen=True, slots=True)
class MockGpu:
    """One physical GPU, listed in ``devices`` or synthesised as the parent of MIG devices."""

    uuid: str  # GPU-<mother_uuid>
    model_name: str
    numa_node: int
    multiprocessors: int
    memory_bytes: int
    pci_bus_id: str
    serial: str | None
    power_limit_watts: float
    # utilization_ratio, memory_utilization_ratio, memory_used_ratio, temperature_celsius,
    # power_watts, sm_clock_mhz, memory_clock_mhz and fan_speed_ratio where given.
    patterns: Mapping[str, Pattern]
    mig_devices: tuple[MockMigDevice, ...] = ()
    processes: tuple[MockProcess, ...] | None = None  # None: the list is unknown
    listed: bool = True  # False: synthesised as the parent of MIG devices
    mig_sku: MigTable | None = None  # the model's MIG geometry, where exporter.telemetry.mig has it


@dataclass(frozen=True, slots=True)
class MockMachine:
    """What a mock device file describes: GPUs in NVML index order and the versions."""

    gpus: tuple[MockGpu, ...]
    driver_version: str | None
    cuda_version: str | None  # "12.4"


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
_UNIT_INTERVAL = ("utilization_ratio", "memory_utilization_ratio", "memory_used_ratio", "sm_util")
_DEFAULT_POWER_LIMIT_W = 250.0  # Backend.AI's mock plugin reports 250 W
# NVML hands strings back in fixed buffers (nvml.h): names and uuids 96 bytes, serials 30, bus
# ids 32; a MIG device's name and uuid add to the GPU's, hence the margins.
_MAX_ID, _MAX_MODEL, _MAX_PROFILE, _MAX_SERIAL = 80, 64, 24, 29
_PCI_BUS_ID = re.compile(r"[0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{1,2}:[0-9A-Fa-f]{1,3}\.[0-7]")
_CUDA_VERSION = re.compile(r"\d{1,3}\.\d{1,2}(\.\d+)?")


class _Reader:
    """Typed access to the TOML tables; every error names the file and the offending key."""

    def __init__(self, name: str) -> None:
        self.name = name

    def fail(self, where: str, reason: str) -> MockConfigError:
        return MockConfigError(self.name, f"{where}: {reason}" if where else reason)

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

    def text(self, table: Mapping[str, Any], key: str, where: str, limit: int, default: Any = ...) -> Any:
        value = self.get(table, key, where, str, default)
        if value is not None and (len(value) > limit or not value.isprintable()):
            raise self.fail(f"{where}.{key}" if where else key, f"at most {limit} printable characters, got {value!r}")
        return value

    def count(self, table: Mapping[str, Any], key: str, where: str, minimum: int, default: Any = ..., maximum: int | None = None) -> Any:
        value = self.get(table, key, where, int, default)
        if value is not None and value < minimum:
            raise self.fail(f"{where}.{key}", f"must be at least {minimum}, got {value}")
        if value is not None and maximum is not None and value > maximum:
            raise self.fail(f"{where}.{key}", f"must be at most {maximum}, got {value}")
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

    def pattern(self, table: Mapping[str, Any], key: str, where: str, default: Pattern | None) -> Pattern | None:
        if key not in table:
            return default
        value, where = table[key], f"{where}.{key}"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            pattern = Pattern("constant", float(value), float(value))
        elif isinstance(value, dict):
            kind = self.get(value, "pattern", where, str)
            if kind not in ("sine", "ramp", "square"):
                raise self.fail(f"{where}.pattern", f"expected sine, ramp or square, got {kind!r}")
            if "duty" in value and kind != "square":
                raise self.fail(f"{where}.duty", "only a square pattern has a duty cycle")
            pattern = Pattern(
                kind,
                float(self.get(value, "min", where, (int, float))),
                float(self.get(value, "max", where, (int, float))),
                float(self.get(value, "period_seconds", where, (int, float), 240.0)),
                float(self.get(value, "phase", where, (int, float), default.phase if default else 0.0)),
                float(self.get(value, "duty", where, (int, float), 0.5)),
            )
            if pattern.low > pattern.high or pattern.period <= 0 or not 0 <= pattern.phase <= 1 or not 0 <= pattern.duty <= 1:
                raise self.fail(where, "needs min <= max, period_seconds > 0, 0 <= phase <= 1 and 0 <= duty <= 1")
        else:
            raise self.fail(where, f"expected a number or a pattern table, got {value!r}")
        if not all(math.isfinite(x) for x in (pattern.low, pattern.high, pattern.period, pattern.phase, pattern.duty)):
            raise self.fail(where, "needs finite numbers")
        if pattern.low < 0 or (key in _UNIT_INTERVAL and pattern.high > 1):
            raise self.fail(where, "out of range" + (" 0..1" if key in _UNIT_INTERVAL else ": negative"))
        return pattern

    def processes(self, table: Mapping[str, Any], where: str) -> tuple[MockProcess, ...] | None:
        """``processes = [{ pid = 1001, used_memory = "4G", sm_util = 0.6 }, …]``."""
        entries = self.get(table, "processes", where, list, None)
        if entries is None:
            return None
        out = []
        for i, entry in enumerate(entries):
            at = f"{where}.processes[{i}]"
            if not isinstance(entry, dict):
                raise self.fail(at, f"expected a table, got {entry!r}")
            util = self.pattern(entry, "sm_util", at, None)
            out.append(MockProcess(self.count(entry, "pid", at, 1), self.size(entry, "used_memory", at, None), util))
        return tuple(out)


@dataclass(slots=True)
class _Mig:
    """A MIG device while the file is read; placement and GI id are resolved per GPU."""

    uuid: str
    position: int
    profile: str
    memory_bytes: int
    multiprocessors: int
    memory_used: Pattern
    placement_start: int | None
    placement_size: int | None
    gpu_instance_id: int | None
    compute_instance_id: int | None
    placement: MigPlacement | None = None


@dataclass(slots=True)
class _Gpu:
    """A GPU while the file is read: MIG devices are added after every entry is seen."""

    fields: dict[str, Any]
    listed: bool
    migs: list[_Mig] = field(default_factory=list)


def parse_mock_file(text: str, name: str) -> MockMachine:
    """Read and validate a mock device file.

    :param text: the file's content.
    :param name: the file's name, for messages.
    :raises MockConfigError: invalid TOML or an invalid entry; the message names the key.
    """
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise MockConfigError(name, f"invalid TOML: {exc}") from None
    r = _Reader(name)
    slot_name = r.get(raw, "slot_name", "", str, "cuda")
    r.get(raw, "device_plugin_name", "", str, None)
    r.get(raw, "formats", "", dict, None)
    seed = r.get(raw, "seed", "", int, 0)
    attributes = r.get(raw, "attributes", "", dict, {})
    entries = r.get(raw, "devices", "", list)
    parents = r.get(raw, "mig_parents", "", dict, {})
    # The legacy cuda_mock format kept the versions at the top level.
    def version(key: str) -> Any:
        table, where = (attributes, "attributes") if key in attributes else (raw, "")
        return r.text(table, key, where, 79, None), f"{where}.{key}" if where else key

    driver, _ = version("nvidia_driver")
    cuda, where = version("cuda_runtime")
    if cuda is not None and not _CUDA_VERSION.fullmatch(cuda):
        raise r.fail(where, f"expected a version like 12.4, got {cuda!r}")
    if slot_name == "cuda":  # the plugin's defaults for the cuda slot
        driver, cuda = driver or "450.00.00", cuda or "11.0"

    gpus: dict[str, _Gpu] = {}

    def add_gpu(mother: str, table: Mapping[str, Any], where: str, position: int, listed: bool) -> _Gpu:
        phase = random.Random(f"{seed}/{mother}").random()
        limit = float(r.get(table, "power_limit_watts", where, (int, float), _DEFAULT_POWER_LIMIT_W))
        if limit <= 0:
            raise r.fail(f"{where}.power_limit_watts", "must be positive")
        patterns: dict[str, Pattern] = {}
        for key in _PATTERN_KEYS:
            default = None
            if key in _DEFAULTS:
                low, high, period = _DEFAULTS[key]
                scale = limit if key == "power_watts" else 1.0
                default = Pattern("sine", low * scale, high * scale, period, phase)
            pattern = r.pattern(table, key, where, default)
            if pattern is not None:
                patterns[key] = pattern
        pci = r.get(table, "pci_bus_id", where, str, f"0000:99:{position:02d}.0")
        if not _PCI_BUS_ID.fullmatch(pci):
            raise r.fail(f"{where}.pci_bus_id", f"expected domain:bus:device.function in hex, got {pci!r}")
        processes = r.processes(table, where)
        if processes is not None and not listed:
            raise r.fail(f"{where}.processes", "a MIG-enabled GPU's processes run in its MIG devices")
        gpus[mother] = _Gpu(
            {
                "uuid": mother if mother.startswith("GPU-") else f"GPU-{mother}",
                "model_name": r.text(table, "model_name", where, _MAX_MODEL, "CUDA GPU"),
                "numa_node": r.count(table, "numa_node", where, 0, 0),
                "multiprocessors": r.subproc_count(table, where, None),
                "memory_bytes": r.size(table, "memory_size", where, None),
                "pci_bus_id": pci,
                "serial": r.text(table, "serial", where, _MAX_SERIAL, None),
                "power_limit_watts": limit,
                "patterns": MappingProxyType(patterns),
                "processes": processes,
            },
            listed,
        )
        return gpus[mother]

    migs: list[tuple[str, _Mig]] = []
    for position, entry in enumerate(entries):
        where = f"devices[{position}]"
        if not isinstance(entry, dict):
            raise r.fail(where, f"expected a table, got {entry!r}")
        mother = r.get(entry, "mother_uuid", where, str)
        if not mother.strip() or any(c.isspace() or not c.isprintable() for c in mother):
            raise r.fail(f"{where}.mother_uuid", f"not a usable device id: {mother!r}")
        r.text(entry, "mother_uuid", where, _MAX_ID)
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
        elif gpu.fields["processes"] is not None:
            raise r.fail(f"devices[{mig.position}]",
                         "its GPU lists processes, but a MIG-enabled GPU's processes run in its MIG devices")
        gpu.migs.append(mig)
    for mother in parents:
        if mother not in gpus or gpus[mother].listed:
            raise r.fail(f"mig_parents.{mother}", "not the mother_uuid of MIG devices whose GPU is unlisted")

    out = []
    for gpu in gpus.values():
        fields = gpu.fields
        fields["memory_bytes"] = fields["memory_bytes"] or sum(m.memory_bytes for m in gpu.migs)
        fields["multiprocessors"] = fields["multiprocessors"] or sum(m.multiprocessors for m in gpu.migs)
        table = table_for_product(fields["model_name"])
        _resolve_layout(r, gpu, table)
        devices = tuple(
            MockMigDevice(m.uuid, m.position, m.profile, m.memory_bytes, m.multiprocessors, m.memory_used,
                          m.gpu_instance_id or 0, m.compute_instance_id or 0, m.placement)  # resolved above
            for m in gpu.migs
        )
        out.append(MockGpu(**fields, mig_devices=devices, listed=gpu.listed, mig_sku=table))
    return MockMachine(tuple(out), driver, cuda)


def _mig_entry(r: _Reader, entry: Mapping[str, Any], where: str, position: int, mother: str, seed: int) -> _Mig:
    model = entry["model_name"]
    if "-" not in model and "profile" not in entry:
        # Backend.AI derives the slot from model_name.split("-", 1)[1] and fails without a dash.
        raise r.fail(f"{where}.model_name", f"a MIG device's model_name needs a '-<profile>' suffix, got {model!r}")
    used = Pattern("sine", 0.1, 0.9, 600.0, random.Random(f"{seed}/{mother}/{position}").random())
    profile = r.text(entry, "profile", where, _MAX_PROFILE, model.split("-", 1)[-1])
    if not profile or len(profile) > _MAX_PROFILE or any(c.isspace() for c in profile):
        raise r.fail(f"{where}.profile", f"not a usable MIG profile name: {profile!r}")
    return _Mig(
        uuid=f"MIG-{mother}/{position}/0",
        position=position,
        profile=profile,
        memory_bytes=r.size(entry, "memory_size", where),
        multiprocessors=r.subproc_count(entry, where),
        memory_used=r.pattern(entry, "memory_used_ratio", where, used) or used,
        placement_start=r.count(entry, "placement_start", where, 0, None),
        placement_size=r.count(entry, "placement_size", where, 1, None),
        # NVML numbers instances from 0 up to a few per GPU; 255 leaves room and bounds the handles.
        gpu_instance_id=r.count(entry, "gpu_instance_id", where, 0, None, maximum=255),
        compute_instance_id=r.count(entry, "compute_instance_id", where, 0, None, maximum=255),
    )


def _resolve_layout(r: _Reader, gpu: _Gpu, table: MigTable | None) -> None:
    """Resolve each MIG device's placement and GPU instance, rejecting what a real GPU would refuse."""
    placed = [m for m in gpu.migs if m.placement_start is not None]
    if not placed:  # no layout: GPU instances in order, unless the file numbers them
        for mig in gpu.migs:
            if mig.gpu_instance_id is None:
                mig.gpu_instance_id = max((m.gpu_instance_id for m in gpu.migs if m.gpu_instance_id is not None), default=0) + 1
        return
    model = gpu.fields["model_name"]
    instances: dict[int, MigPlacement] = {}
    for mig in gpu.migs:
        where = f"devices[{mig.position}]"
        if mig.placement_start is None:
            raise r.fail(where, "placement_start is needed once another MIG device of this GPU has one")
        profile = _profile(table, mig.profile)
        if table is not None and profile is None:
            raise r.fail(where, f"{mig.profile!r} is not a MIG profile of {model}")
        size = mig.placement_size or (profile.memory_slices if profile else None)
        if size is None:
            raise r.fail(where, f"placement_size is needed for profile {mig.profile!r} on {model!r}")
        placement = MigPlacement(mig.placement_start, size)
        if profile is not None and (placement.start not in profile.starts or size != profile.memory_slices):
            raise r.fail(where, f"{mig.profile} cannot be placed at {placement.start}:{size} on {model}")
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


def _profile(table: MigTable | None, name: str) -> MigProfile | None:
    try:
        return table.profile(name) if table is not None else None
    except KeyError:
        return None
