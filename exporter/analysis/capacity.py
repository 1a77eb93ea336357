"""Capacity of each accelerator device, per slot, as the Backend.AI agent registers it.

Pure functions, no I/O. Amounts are ``Decimal`` in the slot's own unit:

* ``<plugin>.device`` (whole devices, ``cuda_open`` and discrete mode): 1 per device;
* MIG slots (``cuda.device:1g.10gb-mig``, docs spelling ``cuda.mig-1g.10gb``): 1 per MIG device,
  the slot type is ``UNIQUE``;
* ``<plugin>.shares`` (fractional GPU): ``min(memory / unit_mem, SMs / unit_proc)`` rounded down
  to 0.01, the rule of the fractional CUDA plugin (mock ``plugin.py`` ``_get_share_raw``). A
  40 GiB, 108-SM A100 holds ``min(20, 13.5)`` = 13.5 shares with the defaults.

The exporter cannot read ``unit_mem``/``unit_proc``/``quantum_size`` from the scratch tree (they
live in etcd under ``config/plugins/accelerator/cuda/``), so they are configuration here, with the
plugin's defaults; a per-device override covers anything else.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import ROUND_DOWN, ROUND_UP, Decimal

__all__ = [
    "CAPACITY_PRECISION",
    "OPEN_PLUGIN_DEVICE_SLOTS",
    "DEFAULT_QUANTUM",
    "DEFAULT_UNIT_MEM_BYTES",
    "DEFAULT_UNIT_PROC",
    "CapacityConfig",
    "GpuInventory",
    "agent_slot_total",
    "device_capacity",
    "fractional_capacity",
    "is_device_slot",
    "is_fractional_slot",
    "is_mig_slot",
    "mig_profile_of_slot",
    "usable_capacity",
]

DEFAULT_UNIT_MEM_BYTES = 2 * 1024**3  # mock plugin default ``unit_mem`` (2 GiB)
DEFAULT_UNIT_PROC = 8  # mock plugin default ``unit_proc`` (SMs per share)
DEFAULT_QUANTUM = Decimal("0.01")  # FractionAllocMap's default ``quantum_size`` (the mock uses 0.1)
CAPACITY_PRECISION = Decimal("0.01")  # the plugin quantizes a device's shares down to this

# Both spellings of a MIG slot: the code's ``cuda.device:<profile>-mig`` and the docs'
# ``cuda.mig-<profile>`` (docs/headroom.md, *Units and capacity*).
_MIG_SLOT = re.compile(r"^[a-z0-9_-]+\.(?:device:(?P<a>.+)-mig|mig-(?P<b>.+))$")


# Whole-device slots of Backend.AI's open accelerator plugins (25.19+); each device holds 1, every
# plugin makes its own slot exclusive, and device ids are the plugin's (rocm: the GPU's serial
# number; ipu: the Graphcore id; atom*: rbln<N> or a serial; the rest: indices).
OPEN_PLUGIN_DEVICE_SLOTS = (
    "cuda.device",
    "rocm.device",
    "tpu.device",
    "ipu.device",
    "atom.device",
    "atom-plus.device",
    "atom-max.device",
    "gaudi.device",
    "gaudi2.device",
    "gaudi3.device",
    "warboy.device",
    "rngd.device",
    "tt-n300.device",
    "hyperaccel-lpu.device",
)


def is_mig_slot(slot: str) -> bool:
    """Whether ``slot`` names one MIG profile (each MIG device is its own device of capacity 1)."""
    return _MIG_SLOT.match(slot) is not None


def mig_profile_of_slot(slot: str) -> str | None:
    """The MIG profile a MIG slot names (``cuda.device:1g.10gb-mig`` → ``1g.10gb``), else None."""
    m = _MIG_SLOT.match(slot)
    return (m.group("a") or m.group("b")) if m else None


def is_fractional_slot(slot: str) -> bool:
    """``<plugin>.shares``: amounts are fractions of a device, capacity from memory and SMs."""
    return slot.endswith(".shares") and slot.count(".") == 1


def is_device_slot(slot: str) -> bool:
    """``<plugin>.device``: whole devices, capacity 1 each."""
    return slot.endswith(".device") and slot.count(".") == 1


@dataclass(frozen=True, slots=True)
class GpuInventory:
    """What the exporter knows about one physical accelerator, keyed by the agent's device id.

    :param device_id: the id the agent writes in ``resource.txt`` (``GPU-<uuid>``, a CUDA ordinal,
        a mock ``mother_uuid``).
    :param memory_total_bytes: total device memory in bytes (NVML ``memory.total``), or None.
    :param multiprocessor_count: number of SMs, or None when unknown.
    :param numa_node: the NUMA node the device is attached to (NVML ``nvmlDeviceGetNumaNodeId``,
        the mock file's ``numa_node``), or None when unknown: the agent groups devices by it.
    :param memory_reserved_bytes: memory the driver keeps for itself that ``memory_total_bytes``
        still includes (NVML ``memory.reserved`` where the total is NVML's; 0 where it is the
        memory CUDA reports, which already leaves it out).
    """

    device_id: str
    memory_total_bytes: int | None = None
    multiprocessor_count: int | None = None
    numa_node: int | None = None
    memory_reserved_bytes: int = 0


@dataclass(frozen=True)
class CapacityConfig:
    """How the fractional plugin turns a device into shares.

    :param unit_mem_bytes: bytes of device memory per share (plugin ``unit_mem``, default 2 GiB).
    :param unit_proc: SMs per share (plugin ``unit_proc``, default 8).
    :param quantum: allocation quantum in shares (plugin ``quantum_size``, a multiple of 0.01);
        used by headroom and placement, never by capacity itself.
    :param overrides: device id → capacity in shares, replacing the computed value (heterogeneous
        nodes, a plugin with other rules).
    """

    unit_mem_bytes: int = DEFAULT_UNIT_MEM_BYTES
    unit_proc: int = DEFAULT_UNIT_PROC
    quantum: Decimal = DEFAULT_QUANTUM
    overrides: Mapping[str, Decimal] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.unit_mem_bytes <= 0 or self.unit_proc <= 0:
            raise ValueError("unit_mem_bytes and unit_proc must be positive")
        # The agent computes fractional amounts in hundredths, so a finer quantum means nothing.
        if not self.quantum > 0 or self.quantum % CAPACITY_PRECISION:
            raise ValueError("quantum must be a positive multiple of 0.01")


def fractional_capacity(memory_total_bytes: int, multiprocessor_count: int, config: CapacityConfig) -> Decimal:
    """Shares one device holds: ``min(memory / unit_mem, SMs / unit_proc)``, rounded down to 0.01.

    The plugin divides in binary floating point before converting to ``Decimal``; doing the same
    reproduces its number even where the exact quotient sits on a 0.01 boundary.
    """
    shares = min(memory_total_bytes / config.unit_mem_bytes, multiprocessor_count / config.unit_proc)
    # Every agent of a multi-agent host registers each device's whole capacity in its own map;
    # ``allocation-mode`` splits only the slot totals it reports (:func:`agent_slot_total`).
    return Decimal(shares).quantize(CAPACITY_PRECISION, rounding=ROUND_DOWN)


def usable_capacity(capacity: Decimal, memory_bytes: int | None, unusable_bytes: int, config: CapacityConfig) -> Decimal:
    """The shares of a device of ``capacity`` shares whose memory can still be handed out, when
    ``unusable_bytes`` of its ``memory_bytes`` are held by no share (driver-reserved, ghost).

    Unusable memory first takes the memory the SM bound leaves over (a 40 GiB, 108-SM A100 holds
    13.5 shares, 27 GiB: 13 GiB are spare); only the rest takes shares, ``unit_mem`` bytes each,
    rounded up to 0.01. Equal to ``capacity`` when nothing is unusable or the memory is unknown.
    """
    if unusable_bytes <= 0 or memory_bytes is None:
        return capacity
    spare = memory_bytes - int(capacity * config.unit_mem_bytes)
    over = unusable_bytes - max(spare, 0)
    if over <= 0:
        return capacity
    lost = (Decimal(over) / config.unit_mem_bytes).quantize(CAPACITY_PRECISION, rounding=ROUND_UP)
    return max(capacity - lost, Decimal(0))


def device_capacity(
    slot: str, device_id: str, inventory: GpuInventory | None, config: CapacityConfig
) -> Decimal | None:
    """Capacity of ``device_id`` for ``slot`` in the slot's unit, or None when it cannot be known.

    Whole-device and MIG slots hold 1. A fractional slot takes the configured override, else the
    plugin rule over the inventory; without memory and SM count it is unknown (None), never guessed.
    Other slots (``cpu``, ``mem``) have no per-device capacity here.
    """
    if is_mig_slot(slot) or is_device_slot(slot):
        return Decimal(1)
    if not is_fractional_slot(slot):
        return None
    if device_id in config.overrides:
        return Decimal(config.overrides[device_id])
    if inventory is None or inventory.memory_total_bytes is None or inventory.multiprocessor_count is None:
        return None
    return fractional_capacity(inventory.memory_total_bytes, inventory.multiprocessor_count, config)


def agent_slot_total(
    mode: str,
    slot: str,
    node_total: Decimal,
    agents: int,
    agent_index: int,
    manual: Decimal | None = None,
) -> Decimal:
    """How much of a slot one agent of a multi-agent host offers the scheduler (``[resource]
    allocation-mode``; ``resources.py`` ``_calculate_device_slot``).

    Each agent still builds its own full allocation map, so every device keeps its whole capacity
    per agent (and agents in ``shared`` mode can allocate one device twice over); what the mode
    splits is the slot total the agent reports:

    * ``shared``: the node's total;
    * ``auto-split``: a fractional slot's total divided by the number of agents; a whole-device
      slot's ``divmod`` share, the remainder going one each to the first agents;
    * ``manual``: the amount configured for the agent (``[resource.allocations]`` /
      ``[agents.resource]``).

    :param node_total: the slot's total over the node's devices (after the reserved cores/memory).
    :param agent_index: the agent's position in ``[[agents]]`` (0-based).
    :raises ValueError: an unknown mode, or ``manual`` without an amount.
    """
    if mode == "shared" or agents <= 1:
        return node_total
    if mode == "auto-split":
        if is_fractional_slot(slot):
            return node_total / agents
        share, extra = divmod(node_total, agents)
        return share + (1 if agent_index < extra else 0)
    if mode == "manual":
        if manual is None:
            raise ValueError(f"manual allocation mode without an amount for {slot}")
        return manual
    raise ValueError(f"unknown allocation mode {mode!r}")
