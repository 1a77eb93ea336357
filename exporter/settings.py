"""Configuration: one frozen settings object fed by flags, environment and an optional file.

Precedence, highest first: command-line flags, ``GPU_ALLOC_EXPORTER_*`` environment variables,
the ``--config.file`` (YAML or TOML, keys as the field names below or as the flags without
dashes), then defaults. Every field declares its Prometheus-style dotted flag in
``json_schema_extra["flag"]``; :mod:`exporter.cli` builds the argument parser from them, so a new
setting needs no CLI code.
"""

from __future__ import annotations

import json
import os
import tomllib
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings.exceptions import SettingsError

__all__ = ["DEFAULT_PORT", "ENV_PREFIX", "ConfigError", "Settings", "load_config_file", "parse_listen_address"]

ENV_PREFIX = "GPU_ALLOC_EXPORTER_"
# Outside the 9100-9999 range that the Prometheus wiki allocates to exporters (now full), and
# away from Backend.AI's own agent ports (6001-6009).
DEFAULT_PORT = 19402


class ConfigError(Exception):
    """Unusable configuration; the CLI prints it on one line and exits with status 2."""


def _flag(flag: str, **extra: Any) -> dict[str, Any]:
    return {"flag": flag, **extra}


class Settings(BaseSettings):
    """Every knob of the exporter. Units are in the field names or descriptions."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="forbid", populate_by_name=True)

    scratch_roots: Annotated[list[Path], NoDecode] = Field(
        default=[Path("/var/lib/backend.ai/scratches")],
        description="Backend.AI scratch root (the agent's [container] scratch-root); repeat for several agents",
        json_schema_extra=_flag("--scratch.root", repeat=True),
    )
    scratch_agents: Annotated[list[str], NoDecode] = Field(
        default=[], description="ROOT=AGENT_ID: a scratch root written by one Backend.AI agent (multi-agent hosts); repeatable, replaces agent.toml's [[agents]]",
        json_schema_extra=_flag("--scratch.agent", repeat=True),
    )
    agent_config_file: Path | None = Field(
        default=None, description="the Backend.AI agent's agent.toml, for scratch roots, agent ids and allocation mode (default: /etc/backend.ai/agent.toml when present)",
        json_schema_extra=_flag("--agent.config"),
    )
    scratch_watch_mode: Literal["inotify", "poll"] = Field(
        default="inotify",
        description="inotify for low latency, or poll for filesystems without inotify (NFS, CIFS)",
        json_schema_extra=_flag("--scratch.watch-mode"),
    )
    scratch_rescan_interval: float = Field(
        default=60.0, gt=0, description="seconds between safety-net rescans (stat only, re-reading changed files)",
        json_schema_extra=_flag("--scratch.rescan-interval"),
    )
    scratch_poll_interval: float = Field(
        default=2.0, gt=0, description="seconds between rescans in poll mode or when inotify is degraded",
        json_schema_extra=_flag("--scratch.poll-interval"),
    )
    scratch_max_file_bytes: int = Field(
        default=1 << 20, gt=0, description="largest resource.txt read, in bytes; bigger files mark the kernel invalid",
        json_schema_extra=_flag("--scratch.max-file-bytes"),
    )
    web_listen_address: str = Field(
        default=f":{DEFAULT_PORT}", description="address to serve on, host:port (':PORT' = all interfaces, port 0 = any)",
        json_schema_extra=_flag("--web.listen-address"),
    )
    web_config_file: Path | None = Field(
        default=None, description="exporter-toolkit web config (TLS, basic auth)",
        json_schema_extra=_flag("--web.config.file"),
    )
    telemetry_source: Literal["auto", "nvml", "mock", "none"] = Field(
        default="auto", description="device telemetry: auto = NVML if it initialises, else none",
        json_schema_extra=_flag("--telemetry.source"),
    )
    telemetry_mock_file: Path | None = Field(
        default=None, description="device file for --telemetry.source=mock (Backend.AI mock-accelerator.toml format)",
        json_schema_extra=_flag("--telemetry.mock-file"),
    )
    telemetry_interval: float = Field(
        default=5.0, gt=0, description="seconds between telemetry samples (scrapes never wait for NVML)",
        json_schema_extra=_flag("--telemetry.interval"),
    )
    telemetry_timeout: float = Field(
        default=2.0, gt=0, description="deadline in seconds for one device's NVML calls; a stuck device is marked stale",
        json_schema_extra=_flag("--telemetry.timeout"),
    )
    telemetry_pcie: bool = Field(
        default=False, description="sample PCIe throughput (blocks about 20 ms per GPU per sample)",
        json_schema_extra=_flag("--telemetry.pcie"),
    )
    device_id_scheme: Literal["auto", "index", "uuid", "bare-uuid"] = Field(
        default="auto", description="how device_id labels are spelled; auto follows the ids in resource.txt",
        json_schema_extra=_flag("--device.id-scheme"),
    )
    path_procfs: Path = Field(
        default=Path("/proc"), description="host /proc for process attribution (a sidecar needs hostPID or the host's /proc mounted)",
        json_schema_extra=_flag("--path.procfs"),
    )
    path_cgroupfs: Path = Field(
        default=Path("/sys/fs/cgroup"), description="host cgroup tree, to tell live kernels from stale scratch directories",
        json_schema_extra=_flag("--path.cgroupfs"),
    )
    attribution_process_detail: bool = Field(
        default=False, description="add per-process series with a pid label (raises cardinality)",
        json_schema_extra=_flag("--attribution.process-detail"),
    )
    attribution_kernel_series: Literal["per-device", "per-kernel", "off"] = Field(
        default="per-device",
        description="per-kernel attribution series: per kernel and device, collapsed per kernel (no device_id), or off",
        json_schema_extra=_flag("--attribution.kernel-series"),
    )
    attribution_breach_series: Literal["all", "active"] = Field(
        default="all", description="gpu_alloc_kernel_isolation_breach for every kernel and device (0 or 1), or only while 1",
        json_schema_extra=_flag("--attribution.breach-series"),
    )
    telemetry_throttle_reasons: Literal["all", "alerting", "active"] = Field(
        default="all",
        description="throttle-reason series: all nine per GPU, the five the shipped rules read, or only those active",
        json_schema_extra=_flag("--telemetry.throttle-reasons"),
    )
    attribution_idle_threshold_ratio: float = Field(
        default=0.05, ge=0, le=1, description="utilisation (0-1) below which an allocated device counts as idle",
        json_schema_extra=_flag("--attribution.idle-threshold-ratio"),
    )
    capacity_unit_mem: int = Field(
        default=2 << 30, gt=0, description="bytes of device memory per fGPU share (the plugin's unit_mem)",
        json_schema_extra=_flag("--capacity.unit-mem"),
    )
    capacity_unit_proc: int = Field(
        default=8, gt=0, description="SMs per fGPU share (the plugin's unit_proc)",
        json_schema_extra=_flag("--capacity.unit-proc"),
    )
    capacity_quantum: Decimal = Field(
        default=Decimal("0.01"), gt=0, description="allocation quantum in shares (the plugin's quantum_size)",
        json_schema_extra=_flag("--capacity.quantum"),
    )
    capacity_overrides: Annotated[list[str], NoDecode] = Field(
        default=[], description="DEVICE_ID=SHARES capacity override; repeatable",
        json_schema_extra=_flag("--capacity.override", repeat=True),
    )
    alloc_map_format: Literal["absolute", "ratio"] = Field(
        default="absolute",
        description="default form of /api/v1/alloc-map: absolute (agents before 26.4.8) or ratio (26.4.8+, 26.8.x)",
        json_schema_extra=_flag("--alloc-map.format"),
    )
    headroom_mode: Literal["auto", "fractional", "discrete"] = Field(
        default="auto", description="whether whole GPUs are handed out as cuda.shares or cuda.device",
        json_schema_extra=_flag("--headroom.mode"),
    )
    headroom_nofrag_rule: Literal["26.4", "before-26.4"] = Field(
        default="26.4", description="the agent's fragmentation guard for the 'disallowed' figures",
        json_schema_extra=_flag("--headroom.nofrag-rule"),
    )
    headroom_requests: Annotated[list[str], NoDecode] = Field(
        default=[], description="reference request SLOT=AMOUNT for gpu_alloc_request_fits; repeatable (default: shares 0.5,1,2,4 and 1,2,4 GPUs)",
        json_schema_extra=_flag("--headroom.request", repeat=True),
    )
    headroom_exclude_stale: bool = Field(
        default=True, description="leave stale kernels out of allocated and headroom figures",
        json_schema_extra=_flag("--headroom.exclude-stale"),
    )
    stale_grace: float = Field(
        default=300.0, ge=0, description="seconds before a kernel without a live container or complete file counts as stale",
        json_schema_extra=_flag("--stale.grace"),
    )
    mig_geometries_file: Path | None = Field(
        default=None, description="HAMi device-config YAML with knownMigGeometries",
        json_schema_extra=_flag("--mig.geometries-file"),
    )
    agent_id: str | None = Field(
        default=None, description="Backend.AI agent id (overrides agent.toml's), exported on gpu_alloc_build_info for joins",
        json_schema_extra=_flag("--agent.id"),
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="log level", json_schema_extra=_flag("--log.level"),
    )
    log_format: Literal["logfmt", "json"] = Field(
        default="logfmt", description="log line format", json_schema_extra=_flag("--log.format"),
    )

    @field_validator("scratch_roots", "scratch_agents", "capacity_overrides", "headroom_requests", mode="before")
    @classmethod
    def _split_list(cls, value: Any) -> Any:
        # From the environment: a JSON list or a comma-separated list.
        if isinstance(value, str):
            return json.loads(value) if value.startswith("[") else [v for v in value.split(",") if v]
        return value

    @field_validator("web_listen_address")
    @classmethod
    def _check_address(cls, value: str) -> str:
        parse_listen_address(value)
        return value

    @model_validator(mode="after")
    def _check_combination(self) -> Settings:
        if self.telemetry_source == "mock" and self.telemetry_mock_file is None:
            raise ValueError("--telemetry.source=mock needs --telemetry.mock-file")
        if not self.scratch_roots:
            raise ValueError("at least one --scratch.root is needed")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Flags arrive as init kwargs; the config file is merged in by load() below them.
        return (init_settings, env_settings)

    @classmethod
    def load(cls, flags: dict[str, Any], config_file: Path | None = None) -> Settings:
        """Build settings from parsed flags, the environment and an optional config file.

        :raises ConfigError: with a one-line explanation.
        """
        from pydantic import ValidationError

        values = load_config_file(config_file) if config_file else {}
        environ = {k.upper() for k in os.environ}
        env_set = {name for name in cls.model_fields if f"{ENV_PREFIX}{name}".upper() in environ}
        # The environment outranks the file: drop file values the environment sets.
        merged = {k: v for k, v in values.items() if k not in env_set}
        merged.update(flags)
        # Where each value came from, so an error names the file or variable that holds it.
        origins = {name: f"{config_file}: " for name in values if name not in env_set and name not in flags}
        origins.update({name: f"{ENV_PREFIX}{name.upper()}: " for name in env_set if name not in flags})
        try:
            return cls(**merged)
        except ValidationError as exc:
            raise ConfigError(_one_line(exc, origins)) from None
        except (SettingsError, ValueError) as exc:  # an environment value that is not valid JSON
            raise ConfigError(str(exc)) from None


def load_config_file(path: Path) -> dict[str, Any]:
    """Read a YAML or TOML config file; keys may be field names or flag names without dashes."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from None
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
    by_flag = {(f.json_schema_extra or {})["flag"].lstrip("-"): name for name, f in Settings.model_fields.items()}
    out: dict[str, Any] = {}
    for key, value in _flatten(data):
        name = by_flag.get(key) or key.replace("-", "_").replace(".", "_")
        if name not in Settings.model_fields:
            raise ConfigError(f"{path}: unknown setting {key!r}")
        out[name] = value
    return out


def _flatten(data: dict[Any, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Nested tables as dotted keys: TOML's ``[scratch] root = [...]`` (or YAML's ``scratch: {root:
    [...]}``) is ``scratch.root``. A key that names a setting keeps its value as it is."""
    names = {(f.json_schema_extra or {})["flag"].lstrip("-") for f in Settings.model_fields.values()} | set(Settings.model_fields)
    out = []
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and dotted not in names:
            out += _flatten(value, dotted + ".")
        else:
            out.append((dotted, value))
    return out


def parse_listen_address(address: str) -> tuple[str, int]:
    """``host:port``, ``:port`` or ``[v6]:port`` → (host, port); an empty host means all interfaces."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"listen address {address!r} is not host:port")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return host, int(port)


def _one_line(exc: Any, origins: dict[str, str] | None = None) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        name = str(err["loc"][0]) if err["loc"] else ""
        field = Settings.model_fields.get(name)
        flag = (field.json_schema_extra or {}).get("flag") if field else None
        msg = err["msg"].removeprefix("Value error, ")
        where = (origins or {}).get(name, "")
        parts.append(f"{where}{flag or loc}: {msg}" if (flag or loc) else msg)
    return "; ".join(parts)
