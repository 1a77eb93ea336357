"""Opening the telemetry source that ``--telemetry.source`` names (NVML, mock devices or none)."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exporter.telemetry.model import SOURCE_KINDS, NullSource, SourceConfigError, TelemetrySource

__all__ = ["SourceChoice", "build_source", "choose_source", "open_source"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourceChoice:
    """The telemetry source ``--telemetry.source`` resolves to on this host, checked: ``auto``
    decided, NVML probed, the mock file read and parsed. Building it cannot fail on configuration.

    :param kind: ``nvml``, ``mock`` or ``none``.
    :param mock_file: the mock device file, and ``mock``: the machine it describes.
    """

    kind: str
    mock_file: Path | None = None
    mock: Any = None  # exporter.telemetry.nvml.mockfile.MockMachine (imported only with mock devices)


def choose_source(kind: str, *, mock_file: Path | None = None, log: logging.Logger = log) -> SourceChoice:
    """Resolve ``--telemetry.source``.

    :param kind: ``auto`` (NVML when ``nvmlInit`` works, else ``none``), ``nvml``, ``mock`` or ``none``.
    :param mock_file: the device TOML for ``mock`` (Backend.AI's mock-accelerator.toml format).
    :raises exporter.telemetry.model.SourceConfigError: the mock file is missing or invalid, or
        ``nvml`` was asked for and ``nvmlInit`` fails (the CLI exits with status 2).
    :raises ValueError: unknown kind, or ``mock`` without a file (settings validation prevents both).
    """
    if kind not in SOURCE_KINDS:
        raise ValueError(f"unknown telemetry source {kind!r} (expected one of {', '.join(SOURCE_KINDS)})")
    if kind == "mock":
        if mock_file is None:
            raise ValueError("telemetry source 'mock' needs a device file")
        from exporter.telemetry.mock import read_mock_file

        machine = read_mock_file(mock_file)
        log.info("telemetry source: mock devices from %s", mock_file)
        return SourceChoice("mock", mock_file, machine)
    if kind == "none":
        log.info("telemetry source: none")
        return SourceChoice("none")

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
        return SourceChoice("none")
    log.info("telemetry source: nvml (%s)", nvml.binding_path())
    return SourceChoice("nvml")


def build_source(choice: SourceChoice, *, pcie: bool = False) -> TelemetrySource:
    """The source of a :class:`SourceChoice` (:param pcie: read PCIe throughput: NVML blocks
    20 ms per counter and GPU to sample it)."""
    if choice.kind == "mock":
        from exporter.telemetry.mock import MockSource

        return MockSource(choice.mock_file, machine=choice.mock)
    if choice.kind == "nvml":
        from exporter.telemetry import nvml

        return nvml.NvmlSource(pcie=pcie)
    return NullSource()


def open_source(kind: str, *, mock_file: Path | None = None, pcie: bool = False, log: logging.Logger = log) -> TelemetrySource:
    """:func:`choose_source` and :func:`build_source` in one (tests, tools)."""
    return build_source(choose_source(kind, mock_file=mock_file, log=log), pcie=pcie)
