"""NVML: the binding-backed telemetry source, the CUDA driver's SM counts and the simulated NVML library.

- :mod:`exporter.telemetry.nvml.binding`: :class:`NvmlSource`, reading GPUs through NVIDIA's
  ``pynvml`` binding (nvidia-ml-py);
- :mod:`exporter.telemetry.nvml.cuda`: SM counts and memory of whole GPUs from ``libcuda.so.1``
  (ctypes, no binding);
- :mod:`exporter.telemetry.nvml.mockfile`: Backend.AI's mock-accelerator TOML read into the
  description of a simulated machine (text in, no NVML);
- :mod:`exporter.telemetry.nvml.simulated`: a simulated ``libnvidia-ml`` (and ``libcuda``)
  answering that binding's C calls (named machines, machines built from a mock device file,
  faults, MIG), for tests, the demo and ``--telemetry.source mock``, as go-nvml ships its dgxa100
  mock.

``binding`` and ``simulated`` are the only modules of the exporter that import ``pynvml``.
Importing this package does not load ``pynvml`` (the binding imports it at call time;
``simulated`` is imported only by those who install it).
"""

from exporter.telemetry.nvml.binding import THROTTLE_REASONS, NvmlSource, binding_path, probe
from exporter.telemetry.nvml.cuda import (
    KNOWN_SM_COUNTS,
    CudaDevice,
    CudaUnavailable,
    cuda_devices,
    known_sm_count,
    normalize_pci_bus_id,
)

__all__ = [
    "KNOWN_SM_COUNTS",
    "THROTTLE_REASONS",
    "CudaDevice",
    "CudaUnavailable",
    "NvmlSource",
    "binding_path",
    "cuda_devices",
    "known_sm_count",
    "normalize_pci_bus_id",
    "probe",
]
