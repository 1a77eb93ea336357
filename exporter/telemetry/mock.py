"""The ``mock`` telemetry source: the simulated NVML library a mock device file describes, read
through the NVML binding.

``--telemetry.source mock --telemetry.mock-file FILE`` reads FILE (Backend.AI's
``mock-accelerator.toml``, accepted unchanged, plus the extensions of docs/mock-devices.md) with
:func:`~exporter.telemetry.nvml.mockfile.parse_mock_file`, builds the simulated ``libnvidia-ml``
(and ``libcuda``) it describes with :meth:`FakeNvml.from_mock_file
<exporter.telemetry.nvml.simulated.FakeNvml.from_mock_file>`, and reads that machine with
:class:`~exporter.telemetry.nvml.NvmlSource`: mock devices are read as GPUs are, so what NVML says
of MIG, utilisation or energy is decided in one place.

The simulated library is put under ``pynvml`` for the duration of each call only, so several
sources in one process keep their own machines, and nothing stays installed once a call returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import TYPE_CHECKING

from exporter.files import FileReadError, read_text
from exporter.telemetry.model import DeviceReading, SourceInfo
from exporter.telemetry.nvml import NvmlSource
from exporter.telemetry.nvml.mockfile import MockConfigError, MockMachine, parse_mock_file

if TYPE_CHECKING:
    from exporter.telemetry.nvml.simulated import FakeNvml

__all__ = ["DEMO_DEVICES_FILE", "MockConfigError", "MockSource", "read_mock_file"]

# The package data directory: exporter/data/.
DEMO_DEVICES_FILE = Path(__file__).parent.parent / "data" / "demo-devices.toml"


class MockSource(NvmlSource):
    """The devices of a mock file, read through NVML; their values follow patterns on ``clock``.

    :param path: the TOML file.
    :param clock: seconds since the epoch; patterns, the energy counter and timestamps follow it.
    :param machine: the file already read and parsed (:func:`read_mock_file`: the configuration
        does that at start, so opening the source cannot fail on the file); None: read ``path``.
    :raises MockConfigError: an unreadable file, invalid TOML or an invalid entry.
    """

    name = "mock"
    may_block = False  # the simulated library answers at once

    def __init__(self, path: Path, clock: Callable[[], float] = time.time, machine: MockMachine | None = None) -> None:
        self.path = Path(path)
        description = machine if machine is not None else read_mock_file(self.path)
        # Imported here: the simulated library (and pynvml) load only where mock devices are used.
        from exporter.telemetry.nvml.simulated import FakeNvml

        self.machine: FakeNvml = FakeNvml.from_mock_file(description, clock=clock)
        super().__init__(clock=clock, xid_events=False)

    def prepare(self) -> SourceInfo:
        with self.machine.installed():
            return super().prepare()

    def read_device(self, key: Hashable) -> DeviceReading | None:
        with self.machine.installed():
            if not self._initialised:  # read before prepare(): initialise as prepare() would
                super().prepare()
            return super().read_device(key)

    def close(self) -> None:
        with self.machine.installed():
            super().close()


def read_mock_file(path: Path) -> MockMachine:
    """The machine a mock device file describes (read bounded, parsed as text).

    :raises MockConfigError: ``path: reason``, one line.
    """
    return parse_mock_file(_read(path), str(path))


def _read(path: Path) -> str:
    """The file's text, read as every file a person names is read (:func:`exporter.files.read_text`:
    a regular file only, opened without blocking, at most 1 MiB): a FIFO or ``/dev/zero`` given as
    the mock file is an error at once, not a hang or a read without end.

    :raises MockConfigError: ``path: reason``, one line.
    """
    try:
        return read_text(path)
    except FileReadError as exc:
        reason = str(exc).removeprefix(f"{path}: ")
        if reason.startswith(_CANNOT_BE_READ):
            reason = f"cannot read the file ({reason.removeprefix(_CANNOT_BE_READ)})"
        raise MockConfigError(path, reason) from None


_CANNOT_BE_READ = "cannot be read: "  # exporter.files' wording for an open or read that failed
