"""An independent re-implementation of how Backend.AI's agent reads resource.txt back.

Follows ``KernelResourceSpec.read_from_string`` and ``scan_gpu_alloc_map``
(src/ai/backend/agent/resources.py) line by line in behaviour, so tests can compare the exporter's
results with what the agent itself would compute from the same files. Deliberately shares no code
with the exporter.
"""

from __future__ import annotations

from collections import defaultdict
from decimal import Decimal

# The agent's known_slot_types on a node with the intrinsic and CUDA plugins.
KNOWN_SLOT_TYPES = {"cpu": "count", "mem": "bytes", "cuda.shares": "count", "cuda.device": "count", "cuda.mem": "bytes"}
_SUFFIX = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5, "e": 6, "z": 7, "y": 8}


def binary_size(text: str) -> int:
    try:
        return int(text.replace("_", ""))
    except ValueError:
        value = text.lower()
        for tail in ("ibytes", "ibyte", "ib", "bytes", "byte", "b"):
            if value.endswith(tail):
                value = value[: -len(tail)]
                break
        return int(Decimal(value[:-1]) * 1024 ** _SUFFIX[value[-1]])


def read_allocations(text: str) -> dict[str, dict[str, Decimal]]:
    """slot -> device_id -> amount, as read_from_string builds ``allocations``."""
    kv = {}
    for line in text.split("\n"):
        if "=" not in line:
            continue
        key, val = line.strip().split("=", maxsplit=1)
        kv[key] = val
    for required in ("MOUNTS", "SCRATCH_SIZE", "SLOTS"):
        kv[required]  # KeyError, as upstream
    out: dict[str, dict[str, Decimal]] = {}
    for key, val in kv.items():
        if key.endswith("_SHARES"):
            slot = key[:-7].lower()
            per_device = {}
            for entry in val.split(","):
                dev, _, raw = entry.partition(":")
                if not dev or not raw:
                    continue
                if KNOWN_SLOT_TYPES.get(slot, "count") == "bytes":
                    per_device[dev] = Decimal(binary_size(raw))
                else:
                    per_device[dev] = Decimal(raw)
            out[slot] = per_device
    return out


def scan_gpu_alloc_map(texts: list[str]) -> dict[str, str]:
    """The agent RPC's result: cuda.shares + cuda.device per device id, summed, as strings."""
    total: dict[str, Decimal] = defaultdict(lambda: Decimal(0))
    for text in texts:
        allocs = read_allocations(text)
        per_kernel: dict[str, Decimal] = defaultdict(lambda: Decimal(0))
        for slot in ("cuda.shares", "cuda.device"):
            for dev, amount in allocs.get(slot, {}).items():
                per_kernel[dev] += Decimal(amount)
        for dev, amount in per_kernel.items():
            total[dev] += amount
    return {k: str(v) for k, v in total.items()}
