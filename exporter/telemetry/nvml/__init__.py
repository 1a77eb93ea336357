"""NVML: the binding-backed telemetry source and the simulated NVML library.

- :mod:`exporter.telemetry.nvml.binding`: :class:`NvmlSource`, reading GPUs through NVIDIA's
  ``pynvml`` binding (nvidia-ml-py);
- :mod:`exporter.telemetry.nvml.simulated`: a simulated ``libnvidia-ml`` answering that binding's
  C calls (named machines, faults, MIG), for tests and the demo, as go-nvml ships its dgxa100 mock.

These two are the only modules of the exporter that import ``pynvml``. Importing this package
does not load ``pynvml`` (the binding imports it at call time; ``simulated`` is imported only by
those who install it).
"""

from exporter.telemetry.nvml.binding import (
    THROTTLE_REASONS,
    CudaDevice,
    CudaUnavailable,
    NvmlSource,
    binding_path,
    cuda_devices,
    known_sm_count,
    normalize_pci_bus_id,
    probe,
)

__all__ = [
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
