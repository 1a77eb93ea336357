"""Opening the telemetry source that ``--telemetry.source`` names (NVML, mock devices or none)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from exporter.telemetry.model import SOURCE_KINDS, NullSource, SourceConfigError, TelemetrySource

__all__ = ["open_source"]

log = logging.getLogger(__name__)


def open_source(
    kind: str,
    *,
    mock_file: Path | None = None,
    pcie: bool = False,
    log: logging.Logger = log,
) -> TelemetrySource:
    """Create the telemetry source named by ``--telemetry.source``.

    :param kind: ``auto`` (NVML when ``nvmlInit`` works, else ``none``), ``nvml``, ``mock`` or ``none``.
    :param mock_file: the device TOML for ``mock`` (Backend.AI's mock-accelerator.toml format).
    :param pcie: read PCIe throughput (NVML blocks 20 ms per counter and GPU to sample it).
    :raises exporter.telemetry.model.SourceConfigError: the mock file is missing or invalid, or
        ``nvml`` was asked for and ``nvmlInit`` fails (the CLI exits with status 2).
    :raises ValueError: unknown kind, or ``mock`` without a file (settings validation prevents both).
    """
    if kind not in SOURCE_KINDS:
        raise ValueError(f"unknown telemetry source {kind!r} (expected one of {', '.join(SOURCE_KINDS)})")
    if kind == "mock":
        if mock_file is None:
            raise ValueError("telemetry source 'mock' needs a device file")
        from exporter.telemetry.mock import MockSource

        source: TelemetrySource = MockSource(mock_file)
        log.info("telemetry source: mock devices from %s", mock_file)
        return source
    if kind == "none":
        log.info("telemetry source: none")
        return NullSource()

    from exporter.telemetry import nvml

    problem = nvml.probe()
    if problem is not None:
        # probe() says "Type: reason"; people read the reason.
        reason = re.sub(r"^\w+: ", "", problem)
        if kind == "nvml":  # asked for NVML by name: not starting is a configuration error
            raise SourceConfigError(
                f"--telemetry.source nvml: NVML does not start ({reason}); use auto to run without telemetry"
            )
        log.info("telemetry source: none (NVML unavailable: %s)", reason)
        return NullSource()
    log.info("telemetry source: nvml (%s)", nvml.binding_path())
    return nvml.NvmlSource(pcie=pcie)
