"""The CUDA driver API (``libcuda.so.1``): SM counts and memory of whole GPUs.

NVML reports ``multiprocessorCount`` for MIG device handles only, but the fractional CUDA plugin
sizes a whole GPU's shares from its SM count and memory as the CUDA runtime reports them
(``multiProcessorCount``, ``totalGlobalMem``). The same numbers come from the CUDA driver API in
``libcuda.so.1``, which ships with the driver: :func:`cuda_devices` asks it
(``cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)``, ``cuDeviceTotalMem``) through
ctypes, with no binding. Without ``libcuda``, or when CUDA sees no device
(``CUDA_ERROR_NO_DEVICE``: no device nodes in a container, or every GPU in MIG mode),
:func:`known_sm_count` answers from a table of known models (:data:`KNOWN_SM_COUNTS`).

The library is loaded by :func:`_load_libcuda`, looked up at call time, so the simulated driver of
:mod:`exporter.telemetry.nvml.simulated` can take its place.
"""

from __future__ import annotations

import ctypes
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "KNOWN_SM_COUNTS",
    "CudaDevice",
    "CudaUnavailable",
    "cuda_devices",
    "known_sm_count",
    "normalize_pci_bus_id",
]

log = logging.getLogger(__name__)

_CUDA_SUCCESS, _CUDA_ERROR_NO_DEVICE = 0, 100
_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16  # cuda.h CUdevice_attribute
_CUDA_LIBRARY = "libcuda.so.1"  # the driver's own library; "libcuda.so" exists only with dev packages

# SMs of whole GPUs by NVML product name, for when libcuda cannot answer. Longest match wins, so
# "H100 PCIe" is not read as "H100". Figures from NVIDIA's data sheets / deviceQuery.
KNOWN_SM_COUNTS: tuple[tuple[str, int], ...] = (
    ("A100", 108), ("A800", 108), ("A30", 56), ("A40", 84), ("A10G", 80), ("A10", 72), ("A16", 10), ("A2", 10),
    ("H100 PCIe", 114), ("H100 NVL", 132), ("H100", 132), ("H800 PCIe", 114), ("H800", 132), ("H200", 132),
    ("H20", 78), ("GH200", 132), ("B200", 148), ("B100", 132), ("GB200", 152),
    ("L40S", 142), ("L40", 142), ("L20", 92), ("L4", 58),
    ("V100", 80), ("T4", 40), ("P100", 56), ("P40", 30),
    ("RTX 6000 Ada", 142), ("RTX A6000", 84), ("RTX A5000", 64), ("RTX A4000", 48),
    ("RTX 4090", 128), ("RTX 3090", 82),
)


def known_sm_count(name: str | None) -> int | None:
    """The SM count of a GPU model from :data:`KNOWN_SM_COUNTS` (longest name match), or None."""
    if not name:
        return None
    folded = name.upper()
    # A model matches as a whole token: "P40" is not "P400", "A10" is not "A10G", "H200" not "GH200".
    hits = [
        (len(model), sms)
        for model, sms in KNOWN_SM_COUNTS
        if re.search(rf"(?<![A-Z0-9]){re.escape(model.upper())}(?![A-Z0-9])", folded)
    ]
    return max(hits)[1] if hits else None


class CudaUnavailable(Exception):
    """``libcuda`` is missing or cannot enumerate devices; ``str()`` says why."""


@dataclass(frozen=True, slots=True)
class CudaDevice:
    """What the CUDA driver reports of one device it enumerates."""

    ordinal: int  # CUDA's device ordinal (CUDA_VISIBLE_DEVICES applies)
    uuid: str | None  # "GPU-…", as NVML spells it
    pci_bus_id: str | None  # normalised "dddddddd:bb:dd.f", lower case
    multiprocessor_count: int
    memory_total_bytes: int | None  # cuDeviceTotalMem: what cudaDeviceProp.totalGlobalMem reports


def _load_libcuda() -> Any:
    """Load the CUDA driver library (tests put a fake driver in its place)."""
    return ctypes.CDLL(_CUDA_LIBRARY)


def normalize_pci_bus_id(bus_id: str | bytes | None) -> str | None:
    """``0000:07:00.0`` (CUDA) and ``00000000:07:00.0`` (NVML) → ``00000000:07:00.0``."""
    if bus_id is None:
        return None
    text = (bus_id.decode(errors="replace") if isinstance(bus_id, bytes) else bus_id).strip().lower()
    try:
        domain, bus, rest = text.split(":")
        device, function = rest.split(".")
        return f"{int(domain, 16):08x}:{int(bus, 16):02x}:{int(device, 16):02x}.{int(function, 16):x}"
    except ValueError:
        return text or None


def cuda_devices(load: Callable[[], Any] | None = None) -> tuple[CudaDevice, ...]:
    """Every device the CUDA driver enumerates, with its SM count and memory.

    :param load: returns the loaded driver library; default ``ctypes.CDLL("libcuda.so.1")``.
    :raises CudaUnavailable: the library is missing, or ``cuInit``/``cuDeviceGetCount`` fail
        (``CUDA_ERROR_NO_DEVICE`` included).
    """
    try:
        lib = (load or _load_libcuda)()  # the module global at call time
    except OSError as exc:
        raise CudaUnavailable(f"{_CUDA_LIBRARY} not loadable ({exc})") from None

    def call(name: str, *args: Any) -> None:
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise CudaUnavailable(f"{_CUDA_LIBRARY} has no {name}") from None
        code = fn(*args)
        if code != _CUDA_SUCCESS:
            what = "no CUDA device visible" if code == _CUDA_ERROR_NO_DEVICE else f"CUresult {code}"
            raise CudaUnavailable(f"{name}: {what}")

    call("cuInit", ctypes.c_uint(0))
    count = ctypes.c_int(0)
    call("cuDeviceGetCount", ctypes.byref(count))
    devices = []
    for ordinal in range(count.value):
        dev = ctypes.c_int(0)
        sms = ctypes.c_int(0)
        try:
            call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(ordinal))
            call("cuDeviceGetAttribute", ctypes.byref(sms), ctypes.c_int(_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT), dev)
        except CudaUnavailable as exc:
            log.info("CUDA device %d: %s", ordinal, exc)
            continue
        devices.append(
            CudaDevice(ordinal, _cuda_uuid(lib, dev), _cuda_pci(lib, dev), sms.value, _cuda_memory(lib, dev))
        )
    return tuple(devices)


def _cuda_uuid(lib: Any, dev: Any) -> str | None:
    raw = (ctypes.c_ubyte * 16)()
    for name in ("cuDeviceGetUuid_v2", "cuDeviceGetUuid"):
        fn = getattr(lib, name, None)
        if fn is not None and fn(ctypes.byref(raw), dev) == _CUDA_SUCCESS:
            h = bytes(raw).hex()
            return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
    return None


def _cuda_pci(lib: Any, dev: Any) -> str | None:
    buf = ctypes.create_string_buffer(32)
    fn = getattr(lib, "cuDeviceGetPCIBusId", None)
    if fn is None or fn(buf, ctypes.c_int(len(buf)), dev) != _CUDA_SUCCESS:
        return None
    return normalize_pci_bus_id(buf.value)


def _cuda_memory(lib: Any, dev: Any) -> int | None:
    size = ctypes.c_size_t(0)
    fn = getattr(lib, "cuDeviceTotalMem_v2", None)
    if fn is None or fn(ctypes.byref(size), dev) != _CUDA_SUCCESS:
        return None
    return size.value
