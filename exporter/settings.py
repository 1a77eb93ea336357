"""Configuration: one frozen settings object fed by flags, environment and an optional file.

Precedence, highest first: command-line flags, ``GPU_ALLOC_EXPORTER_*`` environment variables,
the ``--config.file`` (YAML or TOML, keys as the field names below or as the flags without
dashes), then defaults. Every field declares its Prometheus-style dotted flag, help text and bounds
in a :class:`Setting` inside its ``Annotated`` type; :mod:`exporter.cli` builds the argument parser
from :data:`FIELDS`, so a new setting needs no CLI code. A changed copy is
``dataclasses.replace(settings, ...)``; :attr:`Settings.given` says which were set explicitly.

Plain dataclasses and a small coercion layer (:meth:`Setting.coerce`) rather than pydantic: that
import alone took a large share of the memory and time of a start that must stay under 1 s and
60 MiB. The coercion
follows pydantic's lax rules (``"yes"`` is true, ``"2.0"`` is the integer 2, ``"nan"`` is no
decimal) and its wording, which the docs and the tests quote.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Literal

from exporter.files import MAX_FILE_BYTES, FileReadError, read_text

__all__ = ["DEFAULT_PORT", "ENV_PREFIX", "ConfigError", "Setting", "Settings", "load_config_file", "parse_listen_address"]

ENV_PREFIX = "GPU_ALLOC_EXPORTER_"
# Outside the 9100-9999 range that the Prometheus wiki allocates to exporters (now full), and
# away from Backend.AI's own agent ports (6001-6009).
DEFAULT_PORT = 19402


class ConfigError(Exception):
    """Unusable configuration; the CLI prints it on one line and exits with status 2."""


def parse_listen_address(address: str) -> tuple[str, int]:
    """``host:port``, ``:port`` or ``[v6]:port`` → (host, port); an empty host means all interfaces."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"listen address {address!r} is not host:port")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return host, int(port)


@dataclass(frozen=True)
class Setting:
    """One setting: declared in a field's ``Annotated`` type with its flag, help text and bounds;
    :data:`FIELDS` holds copies completed with the field's name, type and default.

    :param flag: the dotted command-line flag (``--scratch.root``); without dashes, the config-file key.
    :param description: the help text (``--help`` shows its first ``; `` clause, the docs all of it).
    :param gt, ge, le: bounds of a number.
    :param repeat: a list flag given once per value.
    :param metavar: the ``--help`` placeholder, where the type does not say it.
    :param check: raises ValueError on a value of the right type that is still unusable.
    """

    flag: str
    description: str
    gt: float | None = None
    ge: float | None = None
    le: float | None = None
    repeat: bool = False
    metavar: str | None = None
    check: Callable[[Any], object] | None = None
    name: str = ""
    annotation: Any = None
    default: Any = None

    def coerce(self, value: Any) -> Any:
        """``value`` (a flag's or variable's string, or a config file's value) as this setting's type.

        :raises ValueError: the reason, in words (never a Python type name).
        """
        value = _coerce(self.annotation, value)
        if self.gt is not None and not value > self.gt:  # "not >": NaN fails too
            raise ValueError(f"Input should be greater than {self.gt}")
        if self.ge is not None and not value >= self.ge:
            raise ValueError(f"Input should be greater than or equal to {self.ge}")
        if self.le is not None and not value <= self.le:
            raise ValueError(f"Input should be less than or equal to {self.le}")
        if self.check is not None:
            self.check(value)
        return value


@dataclass(frozen=True, init=False)
class Settings:
    """Every knob of the exporter. Units are in the field names or descriptions.

    Build it from user input with :meth:`load`. Calling ``Settings(name=value, ...)`` takes the
    values as they are (typed already: no coercion, bounds or combination checks), as tests and
    the demo do; the names given become :attr:`given`.
    """

    scratch_roots: Annotated[list[Path], Setting(
        "--scratch.root", "Backend.AI scratch root (the agent's [container] scratch-root); repeat for several agents", repeat=True,
    )] = field(default_factory=lambda: [Path("/var/lib/backend.ai/scratches")])
    scratch_agents: Annotated[list[str], Setting(
        "--scratch.agent", "ROOT=AGENT_ID: a scratch root written by one Backend.AI agent (multi-agent hosts); repeatable, replaces agent.toml's [[agents]]",
        repeat=True,
    )] = field(default_factory=list)
    agent_config_file: Annotated[Path | None, Setting(
        "--agent.config", "the Backend.AI agent's agent.toml, for scratch roots, agent ids and allocation mode (default: /etc/backend.ai/agent.toml when present)",
    )] = None
    scratch_watch_mode: Annotated[Literal["inotify", "poll"], Setting(
        "--scratch.watch-mode", "inotify for low latency, or poll for filesystems without inotify (NFS, CIFS)",
    )] = "inotify"
    scratch_rescan_interval: Annotated[float, Setting(
        "--scratch.rescan-interval", "seconds between safety-net rescans (stat only, re-reading changed files)", gt=0,
    )] = 60.0
    scratch_poll_interval: Annotated[float, Setting(
        "--scratch.poll-interval", "seconds between rescans in poll mode or when inotify is degraded", gt=0,
    )] = 2.0
    scratch_max_file_bytes: Annotated[int, Setting(
        "--scratch.max-file-bytes", "largest resource.txt read, in bytes; bigger files mark the kernel invalid", gt=0,
    )] = 1 << 20
    web_listen_address: Annotated[str, Setting(
        "--web.listen-address", "address to serve on, host:port (':PORT' = all interfaces, port 0 = any)", check=parse_listen_address,
    )] = f":{DEFAULT_PORT}"
    web_config_file: Annotated[Path | None, Setting("--web.config.file", "exporter-toolkit web config (TLS, basic auth)")] = None
    web_openmetrics_created: Annotated[bool, Setting(
        "--web.openmetrics-created", "write counters' _created samples to OpenMetrics scrapers; Prometheus 2.42 and VictoriaMetrics store each as one more series",
    )] = False
    telemetry_source: Annotated[Literal["auto", "nvml", "mock", "none"], Setting(
        "--telemetry.source", "device telemetry: auto = NVML if it initialises, else none",
    )] = "auto"
    telemetry_mock_file: Annotated[Path | None, Setting(
        "--telemetry.mock-file", "device file for --telemetry.source=mock (Backend.AI mock-accelerator.toml format)",
    )] = None
    telemetry_interval: Annotated[float, Setting(
        "--telemetry.interval", "seconds between telemetry samples (scrapes never wait for NVML)", gt=0,
    )] = 5.0
    telemetry_timeout: Annotated[float, Setting(
        "--telemetry.timeout", "deadline in seconds for one device's NVML calls; a stuck device is marked stale", gt=0,
    )] = 2.0
    telemetry_pcie: Annotated[bool, Setting(
        "--telemetry.pcie", "sample PCIe throughput (blocks about 20 ms per GPU per sample)",
    )] = False
    device_id_scheme: Annotated[Literal["auto", "index", "uuid", "bare-uuid"], Setting(
        "--device.id-scheme", "how device_id labels are spelled; auto follows the ids in resource.txt",
    )] = "auto"
    path_procfs: Annotated[Path, Setting(
        "--path.procfs", "host /proc for process attribution (a sidecar needs hostPID or the host's /proc mounted)",
    )] = Path("/proc")
    path_cgroupfs: Annotated[Path, Setting(
        "--path.cgroupfs", "host cgroup tree, to tell live kernels from stale scratch directories",
    )] = Path("/sys/fs/cgroup")
    health_state_file: Annotated[Path, Setting(
        "--health.state-file",
        "file that keeps latched GPU faults across restarts until a reset, driver reload or reboot; "
        "written atomically, at most 64 KiB; an unreadable or unwritable file is logged once and latches stay in memory",
    )] = Path("/var/lib/gpu-alloc-exporter/health.json")
    attribution_process_detail: Annotated[bool, Setting(
        "--attribution.process-detail", "add per-process series with a pid label (raises cardinality)",
    )] = False
    attribution_kernel_series: Annotated[Literal["per-device", "per-kernel", "off"], Setting(
        "--attribution.kernel-series",
        "per-kernel attribution series: per kernel and device, collapsed per kernel (no device_id), or off",
    )] = "per-device"
    attribution_breach_series: Annotated[Literal["all", "active"], Setting(
        "--attribution.breach-series", "gpu_alloc_kernel_isolation_breach for every kernel and device (0 or 1), or only while 1",
    )] = "all"
    telemetry_throttle_reasons: Annotated[Literal["all", "alerting", "active"], Setting(
        "--telemetry.throttle-reasons",
        "throttle-reason series: all nine per GPU, the five the shipped rules read, or only those active",
    )] = "all"
    attribution_idle_threshold_ratio: Annotated[float, Setting(
        "--attribution.idle-threshold-ratio", "utilisation (0-1) below which an allocated device counts as idle", ge=0, le=1,
    )] = 0.05
    accounting_energy_split: Annotated[Literal["allocation", "use", "max"], Setting(
        "--accounting.energy-split",
        "how a GPU's energy is split between its kernels: by allocated share, by measured busy time, or the larger of the two",
    )] = "max"
    capacity_unit_mem: Annotated[int, Setting(
        "--capacity.unit-mem", "bytes of device memory per fGPU share (the plugin's unit_mem)", gt=0,
    )] = 2 << 30
    capacity_unit_proc: Annotated[int, Setting("--capacity.unit-proc", "SMs per fGPU share (the plugin's unit_proc)", gt=0)] = 8
    capacity_quantum: Annotated[Decimal, Setting(
        "--capacity.quantum", "allocation quantum in shares (the plugin's quantum_size)", gt=0,
    )] = Decimal("0.01")
    capacity_overrides: Annotated[list[str], Setting(
        "--capacity.override", "DEVICE_ID=SHARES capacity override; repeatable", repeat=True,
    )] = field(default_factory=list)
    alloc_map_format: Annotated[Literal["absolute", "ratio"], Setting(
        "--alloc-map.format",
        "default form of /api/v1/alloc-map: absolute (agents before 26.4.8) or ratio (26.4.8+, 26.8.x)",
    )] = "absolute"
    headroom_mode: Annotated[Literal["auto", "fractional", "discrete"], Setting(
        "--headroom.mode", "whether whole GPUs are handed out as cuda.shares or cuda.device",
    )] = "auto"
    headroom_nofrag_rule: Annotated[Literal["26.9", "26.4", "before-26.4"], Setting(
        "--headroom.nofrag-rule",
        "the agent release whose fractional allocator and fragmentation guard headroom and simulate follow: "
        "26.9 (26.9.0+), 26.4 (26.4.0-26.8.x) or before-26.4 (unset: the running agent's release where it can be read)",
    )] = "26.9"
    headroom_requests: Annotated[list[str], Setting(
        "--headroom.request",
        "reference request SLOT=AMOUNT for gpu_alloc_request_fits; repeatable (default: shares 0.5,1,2,4 and 1,2,4 GPUs)",
        repeat=True,
    )] = field(default_factory=list)
    fleet_shapes: Annotated[list[str], Setting(
        "--fleet.shape",
        "request shape NAME=SLOT:AMOUNT,... (one accelerator slot; cpu, mem) judged for gpu_alloc_node_request_placeable; "
        "repeatable (default: fgpu-0.5, fgpu-1, fgpu-2, fgpu-4, fgpu-8 with 4 CPU cores and 16g per fGPU)",
        repeat=True,
    )] = field(default_factory=list)
    headroom_exclude_stale: Annotated[bool, Setting(
        "--headroom.exclude-stale", "leave stale kernels out of allocated and headroom figures",
    )] = True
    stale_grace: Annotated[float, Setting(
        "--stale.grace", "seconds before a kernel without a live container or complete file counts as stale", ge=0,
    )] = 300.0
    mig_geometries_file: Annotated[Path | None, Setting(
        "--mig.geometries-file", "HAMi device-config YAML with knownMigGeometries",
    )] = None
    agent_id: Annotated[str | None, Setting(
        "--agent.id", "Backend.AI agent id (overrides agent.toml's), exported on gpu_alloc_build_info for joins",
    )] = None
    identity_docker_socket: Annotated[Path | None, Setting(
        "--identity.docker-socket",
        "Docker API socket (e.g. /var/run/docker.sock) whose kernel-container labels give the identity of kernels without a recovery.json (agents before 25.18); root-equivalent access, so off unless set",
        metavar="SOCKET",
    )] = None
    identity_docker_interval: Annotated[float, Setting(
        "--identity.docker-interval", "seconds between reads of the container labels (one list request each)", gt=0,
    )] = 10.0
    log_level: Annotated[Literal["debug", "info", "warning", "error"], Setting("--log.level", "log level")] = "info"
    log_format: Annotated[Literal["logfmt", "json"], Setting("--log.format", "log line format")] = "logfmt"

    #: The settings given explicitly (a flag, variable or file key; a keyword), as opposed to
    #: left at their defaults. ``dataclasses.replace`` keeps it unless it is replaced too.
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def __init__(self, **values: Any) -> None:
        given = values.pop("given", None)
        unknown = values.keys() - FIELDS.keys()
        if unknown:
            raise TypeError(f"unknown settings: {', '.join(sorted(unknown))}")
        for f in dataclasses.fields(self):
            if f.name in values:
                value = values[f.name]
            else:
                value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            object.__setattr__(self, f.name, value)
        object.__setattr__(self, "given", frozenset(values) if given is None else frozenset(given))

    @classmethod
    def load(cls, flags: Mapping[str, Any], config_file: Path | None = None) -> Settings:
        """Build settings from parsed flags (field name → value), the environment and an optional
        config file.

        :raises ConfigError: one line naming each wrong value's flag (prefixed with the variable
            or file it came from) and the reason.
        """
        unknown = flags.keys() - FIELDS.keys()
        if unknown:
            raise ConfigError(f"unknown setting {sorted(unknown)[0]!r}")
        # Lowest precedence first, so that a higher source replaces the value and its origin.
        given: dict[str, tuple[Any, str]] = {}
        if config_file:
            given.update((name, (value, f"{config_file}: ")) for name, value in load_config_file(config_file).items())
        given.update((name, (value, f"{ENV_PREFIX}{name.upper()}: ")) for name, value in _environment().items())
        given.update((name, (value, "")) for name, value in flags.items())
        values: dict[str, Any] = {}
        errors = []
        for name, setting in FIELDS.items():  # every error, in declaration order
            if name in given:
                value, origin = given[name]
                try:
                    values[name] = setting.coerce(value)
                except ValueError as exc:
                    errors.append(f"{origin}{setting.flag}: {exc}")
        if errors:
            raise ConfigError("; ".join(errors))
        settings = cls(**values)
        settings._check_combination()
        return settings

    def _check_combination(self) -> None:
        if self.telemetry_source == "mock" and self.telemetry_mock_file is None:
            raise ConfigError("--telemetry.source=mock needs --telemetry.mock-file")
        if not self.scratch_roots:
            raise ConfigError("at least one --scratch.root is needed")


def _settings_fields(cls: type) -> dict[str, Setting]:
    hints = typing.get_type_hints(cls, include_extras=True)
    out = {}
    for f in dataclasses.fields(cls):
        if f.name == "given":
            continue
        annotation, *meta = typing.get_args(hints[f.name])
        (setting,) = (m for m in meta if isinstance(m, Setting))
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        out[f.name] = dataclasses.replace(setting, name=f.name, annotation=annotation, default=default)
    return out


#: Every setting by field name, in declaration order (the order of ``--help`` and of errors).
FIELDS: Mapping[str, Setting] = MappingProxyType(_settings_fields(Settings))


def _environment() -> dict[str, str]:
    """Settings set as ``GPU_ALLOC_EXPORTER_<NAME>`` variables; the names match in any case."""
    environ = {key.upper(): value for key, value in os.environ.items()}
    return {name: environ[key] for name in FIELDS if (key := f"{ENV_PREFIX}{name.upper()}") in environ}


# -- coercion: pydantic's lax rules and words, for the types the settings use ----------------------

_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})
_INTEGER = re.compile(r"([+-]?\d+(?:_\d+)*)(?:\.0*)?")  # "2.0" is the integer 2; "1.5" and "1e3" are not


def _coerce(annotation: Any, value: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value in choices and isinstance(value, str):
            return value
        others = ", ".join(map(repr, choices[:-1]))
        raise ValueError(f"Input should be {others + ' or ' if others else ''}{choices[-1]!r}")
    if origin is types.UnionType:  # X | None
        (inner,) = (a for a in typing.get_args(annotation) if a is not type(None))
        return None if value is None else _coerce(inner, value)
    if origin is list:
        if isinstance(value, str):  # an environment variable (or a file's string): a JSON list, or comma-separated
            value = _split_list(value)
        if not isinstance(value, list | tuple):
            raise ValueError("Input should be a valid list")
        (item,) = typing.get_args(annotation)
        return [_coerce(item, v) for v in value]
    return _SCALARS[annotation](value)


def _split_list(text: str) -> list[Any]:
    if not text.startswith("["):
        return [v for v in text.split(",") if v]
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"Input should be a JSON list or comma-separated values ({exc})") from None
    if not isinstance(value, list):
        raise ValueError("Input should be a JSON list or comma-separated values")
    return value


def _str(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise ValueError("Input should be a valid string")  # a YAML number or date is no agent id


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise ValueError("Input should be a valid boolean" + (", unable to interpret input" if isinstance(value, str | int | float) else ""))


def _int(value: Any) -> int:
    if isinstance(value, int):  # bool included: true is 1, as in pydantic
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("Input should be a finite number")
        if not value.is_integer():
            raise ValueError("Input should be a valid integer, got a number with a fractional part")
        return int(value)
    if isinstance(value, str):
        match = _INTEGER.fullmatch(value.strip())
        if match:
            return int(match.group(1))
        raise ValueError("Input should be a valid integer, unable to parse string as an integer")
    raise ValueError("Input should be a valid integer")


def _float(value: Any) -> float:
    try:
        if isinstance(value, int | float):  # bool included: true is 1.0, as in pydantic
            return float(value)
        if isinstance(value, str):
            return float(value)  # takes surrounding blanks, "1_000", "inf" and "nan" (which fails a bound)
    except OverflowError:  # an integer beyond float's range
        raise ValueError("Input should be a finite number") from None
    except ValueError:
        raise ValueError("Input should be a valid number, unable to parse string as a number") from None
    raise ValueError("Input should be a valid number")


def _decimal(value: Any) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, int | float | str | Decimal):
        raise ValueError("Decimal input should be an integer, float, string or Decimal object")
    try:
        # A float by its shortest repr: YAML's 0.1 is Decimal("0.1"), not 0.1000000000000000055...
        number = Decimal(value.strip() if isinstance(value, str) else str(value))
    except InvalidOperation:
        raise ValueError("Input should be a valid decimal") from None
    if not number.is_finite():
        raise ValueError("Input should be a finite number")
    return number


def _path(value: Any) -> Path:
    if isinstance(value, str | os.PathLike):
        return Path(value)
    raise ValueError("Input is not a valid path")


_SCALARS: dict[Any, Callable[[Any], Any]] = {str: _str, bool: _bool, int: _int, float: _float, Decimal: _decimal, Path: _path}


# -- files the user names -----------------------------------------------------------------------

def read_config_text(path: Path, flag: str, limit: int = MAX_FILE_BYTES) -> str:
    """The text of a file a setting names, read by :func:`exporter.files.read_text` (a regular
    file only, never a blocking open, at most ``limit`` bytes, UTF-8).

    :raises ConfigError: one line naming the file, the flag and the reason.
    """
    try:
        return read_text(path, limit)
    except FileReadError as exc:
        raise ConfigError(f"{exc} (set {flag})") from None


def optional_file(path: Path, flag: str) -> Path | None:
    """``path`` if it exists, None if it (or a directory above it) does not; a default the
    service user cannot reach is an error, never a traceback or a silent skip.

    :raises ConfigError: naming the file, the flag and the reason.
    """
    try:
        os.stat(path)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read by uid {os.getuid()}: {exc.strerror or 'unreadable'} "
                          f"(grant read access, or set {flag})") from None
    return path


# -- the config file ----------------------------------------------------------------------------


def load_config_file(path: Path) -> dict[str, Any]:
    """Read a YAML or TOML config file; keys may be field names or flag names without dashes."""
    text = read_config_text(path, "--config.file")
    import tomllib

    import yaml  # here, as tomllib: a start without a config file need not pay for either import

    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except tomllib.TOMLDecodeError as exc:  # "Expected '=' ... (at line 1, column 5)": no content
        raise ConfigError(f"{path}: not valid TOML: {exc}".replace("\n", " ")) from None
    except yaml.YAMLError as exc:  # its str() quotes the file's lines: say only where and what
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None)
        raise ConfigError(f"{path}: not valid YAML{where}" + (f": {problem}" if problem else "")) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings")
    by_flag = {s.flag.lstrip("-"): name for name, s in FIELDS.items()}
    out: dict[str, Any] = {}
    for key, value in _flatten(data, by_flag.keys() | FIELDS.keys()):
        name = by_flag.get(key) or key.replace("-", "_").replace(".", "_")
        if name not in FIELDS:
            raise ConfigError(f"{path}: unknown setting {key!r}")
        out[name] = value
    return out


def _flatten(data: dict[Any, Any], names: set[str], prefix: str = "") -> list[tuple[str, Any]]:
    """Nested tables as dotted keys: TOML's ``[scratch] root = [...]`` (or YAML's ``scratch: {root:
    [...]}``) is ``scratch.root``. A key that names a setting (in ``names``) keeps its value as it is."""
    out = []
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and dotted not in names:
            out += _flatten(value, names, dotted + ".")
        else:
            out.append((dotted, value))
    return out
