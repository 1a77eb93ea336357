"""Capacity per device and slot: the fractional plugin's share rule, whole devices, MIG."""

from __future__ import annotations

from decimal import Decimal

import pytest

from exporter.analysis.capacity import (
    CapacityConfig,
    GpuInventory,
    agent_slot_total,
    device_capacity,
    fractional_capacity,
    is_device_slot,
    is_fractional_slot,
    is_mig_slot,
    mig_profile_of_slot,
)

GiB = 1024**3
DEFAULT = CapacityConfig()


@pytest.mark.parametrize(
    ("memory", "sms", "expected"),
    [
        (40 * GiB, 108, "13.5"),  # A100-40GB: SM-bound, min(20, 13.5) (docs/headroom.md, *Units and capacity*)
        (80 * GiB, 108, "13.5"),  # A100-80GB: still SM-bound
        (80 * GiB, 132, "16.5"),  # H100 SXM
        (24 * GiB, 56, "7"),  # A30
        (16 * GiB, 108, "8"),  # memory-bound
        (15843721216, 108, "7.37"),  # 14.76 GiB: rounded down, never up
        (1 * GiB, 1, "0.12"),  # 1/8 SM share = 0.125 → 0.12
    ],
)
def test_fractional_capacity_is_the_plugin_rule(memory: int, sms: int, expected: str) -> None:
    assert fractional_capacity(memory, sms, DEFAULT) == Decimal(expected)


def test_fractional_capacity_divides_in_floating_point_like_the_plugin() -> None:
    # 29 / 100 is 0.28999… in binary; the plugin's Decimal(float) then rounds down to 0.28.
    config = CapacityConfig(unit_proc=100)
    assert fractional_capacity(100 * GiB, 29, config) == Decimal("0.28")


def test_unit_mem_and_unit_proc_are_configurable() -> None:
    config = CapacityConfig(unit_mem_bytes=4 * GiB, unit_proc=4)
    assert fractional_capacity(40 * GiB, 108, config) == Decimal("10")


def test_each_agent_keeps_the_whole_device_in_its_map() -> None:
    # Multi-agent modes split the slot totals an agent reports (agent_slot_total), never a
    # device's capacity: every agent's allocation map holds each device whole.
    assert not hasattr(CapacityConfig(), "agents")
    assert fractional_capacity(40 * GiB, 108, CapacityConfig()) == Decimal("13.5")
    assert agent_slot_total("auto-split", "cuda.shares", Decimal("27"), 2, 1) == Decimal("13.5")


@pytest.mark.parametrize("slot", ["cuda.device", "rocm.device", "cuda.device:1g.10gb-mig", "cuda.mig-2g.20gb"])
def test_whole_device_and_mig_slots_hold_one(slot: str) -> None:
    assert device_capacity(slot, "x", None, DEFAULT) == 1


def test_fractional_slot_uses_inventory_or_override_and_never_guesses() -> None:
    gpu = GpuInventory("GPU-a", 40 * GiB, 108)
    assert device_capacity("cuda.shares", "GPU-a", gpu, DEFAULT) == Decimal("13.5")
    assert device_capacity("cuda.shares", "GPU-a", GpuInventory("GPU-a", 40 * GiB, None), DEFAULT) is None
    assert device_capacity("cuda.shares", "GPU-a", None, DEFAULT) is None
    override = CapacityConfig(overrides={"GPU-a": Decimal("10")})
    assert device_capacity("cuda.shares", "GPU-a", gpu, override) == Decimal("10")
    assert device_capacity("cuda.shares", "GPU-b", None, override) is None


@pytest.mark.parametrize("slot", ["cpu", "mem", "cuda.mem"])
def test_slots_without_per_device_capacity(slot: str) -> None:
    assert device_capacity(slot, "0", GpuInventory("0", 40 * GiB, 108), DEFAULT) is None


def test_slot_classes() -> None:
    assert is_fractional_slot("cuda.shares") and not is_fractional_slot("cuda.device")
    assert is_device_slot("cuda.device") and is_device_slot("atom-plus.device")
    assert not is_device_slot("cuda.device:1g.5gb-mig") and not is_device_slot("cpu")
    assert is_mig_slot("cuda.device:3g.20gb-mig") and is_mig_slot("cuda.mig-2c10g")
    assert not is_mig_slot("cuda.device") and not is_mig_slot("cuda.shares")
    assert mig_profile_of_slot("cuda.device:1g.10gb+me-mig") == "1g.10gb+me"
    assert mig_profile_of_slot("cuda.mig-10g") == "10g"
    assert mig_profile_of_slot("cuda.shares") is None


@pytest.mark.parametrize(
    "kwargs",
    [{"unit_mem_bytes": 0}, {"unit_proc": -1}, {"quantum": Decimal(0)}, {"quantum": Decimal("0.005")}],
)
def test_config_rejects_nonsense(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        CapacityConfig(**kwargs)
