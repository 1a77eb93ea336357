"""NVML or mock devices → immutable telemetry snapshots: the readings model, the sampler with its
deadlines, the one NVML boundary, mock devices, MIG geometry and device ids. Imports nothing else
from the package but ``units``."""
