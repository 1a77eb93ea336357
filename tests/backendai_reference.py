"""An independent re-implementation of how Backend.AI's newest agent reads resource.txt back.

Follows ``KernelResourceSpec.read_from_string`` (with ``Mount.from_str``,
``BinarySize.finite_from_str`` and ``ResourceSlot.from_json``) and both generations of
``scan_gpu_alloc_map`` (src/ai/backend/agent/resources.py) in behaviour, so tests can compare the
exporter's results with what the agent itself would compute from the same files. Deliberately
shares no code with the exporter.

* :func:`read_allocations` raises wherever the agent's reader raises (``KeyError`` for a missing
  header key, ``ValueError``/``decimal.InvalidOperation`` for what its parsers refuse).
* :func:`scan_gpu_alloc_map` is the agent before 26.4.8: ``cuda.shares`` + ``cuda.device`` per
  device id, absolute. :func:`scan_gpu_alloc_map_ratio` is the agent from 26.4.8 / 26.8.x on: every
  slot of the ``cuda`` device divided by that device's registered capacity for the slot (the raw
  amount where none is known or it is not positive), summed over kernels, quantized to 4 places.
  Both stop at the first file the reader raises on, as the agent's loop ``break``s; the order is
  the order given (the agent's is completion order).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping
from decimal import Decimal
from pathlib import PurePosixPath

# The newest open-source agent's known_slot_types on a node with the intrinsic plugins, the open
# CUDA plugin (or the mock in discrete or fractional mode) and the other open plugins.
KNOWN_SLOT_TYPES = {
    "cpu": "count",
    "mem": "bytes",
    "cuda.shares": "count",
    "cuda.device": "count",
    "rocm.device": "count",
    "tpu.device": "count",
    "ipu.device": "count",
    "atom.device": "count",
    "atom-plus.device": "count",
    "atom-max.device": "count",
    "gaudi.device": "count",
    "gaudi2.device": "count",
    "gaudi3.device": "count",
    "warboy.device": "count",
    "rngd.device": "count",
    "tt-n300.device": "count",
    "hyperaccel-lpu.device": "count",
}
# The same agent with a plugin that registers the legacy bytes slot cuda.mem.
WITH_CUDA_MEM = {**KNOWN_SLOT_TYPES, "cuda.mem": "bytes"}
_SCALE = {"y": 2**80, "z": 2**70, "e": 2**60, "p": 2**50, "t": 2**40, "g": 2**30, "m": 2**20, "k": 2**10, " ": 1}
_ENDINGS = ("ibytes", "ibyte", "ib", "bytes", "byte", "b")


def binary_size(text: str) -> int:
    """``BinarySize.finite_from_str`` for a string."""
    if text.lower() in ("inf", "infinite", "infinity"):
        raise ValueError("infinite values are not allowed")
    expr = text.strip().replace("_", "")
    if "." in expr:
        try:
            as_dec = Decimal(expr)
        except ArithmeticError:
            as_dec = None
        if as_dec is not None and as_dec == as_dec.to_integral_value():
            expr = str(int(as_dec))
    try:
        return int(expr)
    except ValueError:
        expr = expr.lower()
        for ending in _ENDINGS:
            if (stem := expr.removesuffix(ending)) != expr:
                suffix, mantissa = stem[-1], Decimal(stem[:-1])
                break
        else:
            if expr[-1].isnumeric():
                raise ValueError("Fractional bytes are not allowed") from None
            suffix, mantissa = expr[-1], Decimal(expr[:-1])
        return int(mantissa * _SCALE[suffix])


def _mount(entry: str) -> None:
    """``Mount.from_str``: raises on what the agent refuses."""
    source, target, perm = entry.split(":")  # ValueError unless exactly three parts
    src = PurePosixPath(source)
    if not src.is_absolute() and len(src.parts) != 1:
        raise ValueError("Mount source must be an absolute path if it is not a volume name.")
    if not PurePosixPath(target).is_absolute():
        raise ValueError("Mount target must be an absolute path.")
    if perm not in ("ro", "rw", "wd"):
        raise ValueError(perm)


def read_allocations(text: str, known_slot_types: Mapping[str, str] = KNOWN_SLOT_TYPES) -> dict[str, dict[str, Decimal]]:
    """slot -> device_id -> amount, as read_from_string builds ``allocations`` (flattened)."""
    kv = {}
    for line in text.split("\n"):
        if "=" not in line:
            continue
        key, val = line.strip().split("=", maxsplit=1)
        kv[key] = val
    out: dict[str, dict[str, Decimal]] = {}
    for key, val in kv.items():
        if key.endswith("_SHARES"):
            slot = key[:-7].lower()
            per_device = {}
            for entry in val.split(","):
                dev, _, raw = entry.partition(":")
                if not dev or not raw:
                    continue
                if known_slot_types.get(slot, "count") == "bytes":
                    per_device[dev] = Decimal(binary_size(raw))
                else:
                    per_device[dev] = Decimal(raw)
            out[slot] = per_device
    for m in kv["MOUNTS"].split(","):
        if m:
            _mount(m)
    binary_size(kv["SCRATCH_SIZE"])
    json.loads(kv.get("UNIFIED_DEVICES") or "[]")
    {k: Decimal(v) for k, v in json.loads(kv["SLOTS"]).items() if v is not None}
    return out


def read_slots(text: str) -> dict[str, Decimal]:
    """The ``SLOTS`` object as ``ResourceSlot.from_json`` builds it (``null`` skipped)."""
    kv = {}
    for line in text.split("\n"):
        if "=" in line:
            key, val = line.strip().split("=", maxsplit=1)
            kv[key] = val
    return {k: Decimal(v) for k, v in json.loads(kv["SLOTS"]).items() if v is not None}


def scan_gpu_alloc_map(texts: list[str], known_slot_types: Mapping[str, str] = KNOWN_SLOT_TYPES) -> dict[str, str]:
    """The agent RPC's result before 26.4.8: cuda.shares + cuda.device per device id, summed."""
    total: dict[str, Decimal] = defaultdict(lambda: Decimal(0))
    for text in texts:
        try:
            allocs = read_allocations(text, known_slot_types)
        except Exception:  # noqa: BLE001 - the agent catches everything here and stops
            break  # the agent logs the error and stops: a partial map
        per_kernel: dict[str, Decimal] = defaultdict(lambda: Decimal(0))
        for slot in ("cuda.shares", "cuda.device"):
            for dev, amount in allocs.get(slot, {}).items():
                per_kernel[dev] += Decimal(amount)
        for dev, amount in per_kernel.items():
            total[dev] += amount
    return {k: str(v) for k, v in total.items()}


def scan_gpu_alloc_map_ratio(
    texts: list[str],
    capacities: Mapping[tuple[str, str], Decimal],
    known_slot_types: Mapping[str, str] = KNOWN_SLOT_TYPES,
) -> dict[str, str]:
    """The agent RPC's result from 26.4.8 / 26.8.x on.

    :param capacities: (slot, device id) -> the amount the plugin registered (``device_slots``).
    """
    total: dict[str, Decimal] = defaultdict(lambda: Decimal(0))
    for text in texts:
        try:
            allocs = read_allocations(text, known_slot_types)
        except Exception:  # noqa: BLE001 - the agent catches everything here and stops
            break
        for slot, per_device in allocs.items():
            if slot.split(".")[0] != "cuda":
                continue
            for dev, amount in per_device.items():
                capacity = capacities.get((slot, dev))
                total[dev] += amount / capacity if capacity is not None and capacity > 0 else amount
    return {k: str(v.quantize(Decimal("0.0001"))) for k, v in total.items()}
