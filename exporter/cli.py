"""Command line: ``gpu-alloc-exporter [serve] | demo | scan``.

Flags are generated from :class:`exporter.settings.Settings`; ``--help`` shows each one's
environment variable. ``main(argv)`` returns the exit status: 0 on a clean stop, 2 for unusable
configuration (one line on stderr), 1 for anything unexpected.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from exporter import __version__
from exporter.logs import setup_logging
from exporter.settings import ENV_PREFIX, ConfigError, Settings, parse_listen_address
from exporter.telemetry.model import SourceConfigError

__all__ = ["DEFAULT_AGENT_CONFIG", "load_agent_layout", "main", "run"]

# Read when present and no --agent.config is given (the agent's own default location).
DEFAULT_AGENT_CONFIG = Path("/etc/backend.ai/agent.toml")

log = logging.getLogger("exporter")

COMMANDS = {
    "serve": "watch the scratch roots and serve metrics (the default)",
    "demo": "build a realistic sample scratch root and serve it",
    "scan": "print the current allocation once and exit",
    "simulate": "show where a request would be placed (live scratch roots or a saved /api/v1/state)",
}


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())


def main(argv: list[str] | None = None, *, default_agent_config: Path | None = None) -> int:
    """Run one command; ``default_agent_config``: the agent.toml read when present and no
    ``--agent.config`` is given (tests point it elsewhere)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "serve"
    parser = build_parser(command)
    args = vars(parser.parse_args(argv))
    extra = {k: args.pop(k) for k in list(args) if k.startswith("cmd_")}
    config_file = args.pop("config_file", None)
    try:
        settings = Settings.load(args, Path(config_file) if config_file else None)
    except ConfigError as exc:
        print(f"gpu-alloc-exporter: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.log_format)
    try:
        if command != "demo":  # the demo builds its own node; a real one's agent.toml is not its
            layout = load_agent_layout(settings, default_agent_config or DEFAULT_AGENT_CONFIG)
            settings = settings.model_copy(update={"scratch_roots": [Path(r) for r in layout.roots]})
        if command == "scan":
            return _scan(settings, extra["cmd_output"])
        if command == "demo":
            return _demo(settings, extra["cmd_dir"], extra["cmd_seed"], extra["cmd_time_scale"])
        if command == "simulate":
            return _simulate(settings, extra["cmd_request"], extra["cmd_policy"], extra["cmd_state"], extra["cmd_output"], layout)
        return serve(settings, allow_missing_root=extra["cmd_allow_missing_root"], layout=layout)
    except (ConfigError, SourceConfigError) as exc:
        print(f"gpu-alloc-exporter: {exc}", file=sys.stderr)
        return 2


def build_parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpu-alloc-exporter" + ("" if command == "serve" else f" {command}"),
        description="Prometheus exporter for live GPU allocation on Backend.AI agent nodes. Commands: "
        + "; ".join(f"{c}: {h}" for c, h in COMMANDS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--version", action="version", version=f"gpu-alloc-exporter {__version__}")
    parser.add_argument("--config.file", dest="config_file", metavar="PATH",
                        help=f"YAML or TOML file with settings (env: {ENV_PREFIX}CONFIG_FILE)",
                        default=os.environ.get(f"{ENV_PREFIX}CONFIG_FILE"))
    for name, field in Settings.model_fields.items():
        extra = field.json_schema_extra or {}
        env = f"{ENV_PREFIX}{name.upper()}"
        default = field.default
        shown = ",".join(map(str, default)) if isinstance(default, list) else default
        help_text = f"{field.description} (default: {shown}; env: {env})"
        kwargs: dict[str, Any] = {"dest": name, "help": help_text}
        if field.annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["metavar"] = name.rsplit("_", 1)[-1].upper().rstrip("S")
            if extra.get("repeat"):
                kwargs["action"] = "append"
        parser.add_argument(extra["flag"], **kwargs)
    if command == "serve":
        parser.add_argument("--scratch.allow-missing-root", dest="cmd_allow_missing_root", action="store_true",
                            default=False, help="start even if a scratch root does not exist yet (it is picked up when it appears)")
    if command in ("scan", "simulate"):
        parser.add_argument("--output", dest="cmd_output", choices=["table", "json"], default="table")
    if command == "simulate":
        from exporter.analysis.placement import Policy

        parser.add_argument("--request", dest="cmd_request", required=True, metavar="SLOT=AMOUNT",
                            help="e.g. cuda.shares=1.5, cuda.device=2 or cuda.device:1g.10gb-mig=1")
        parser.add_argument("--policy", dest="cmd_policy", default="evenly", choices=[p.value for p in Policy],
                            help="evenly (Backend.AI), evenly-nofrag, simple/besteffort (go-gpuallocator), "
                            "compact-first/low-load-first (tensor-fusion)")
        parser.add_argument("--state", dest="cmd_state", metavar="FILE", default=None,
                            help="a saved /api/v1/state JSON instead of the live scratch roots and devices")
    if command == "demo":
        parser.add_argument("--demo.dir", dest="cmd_dir", metavar="PATH", default=None,
                            help="where to build the node's scratch root, /proc and cgroup tree (default: a new temporary directory)")
        parser.add_argument("--demo.seed", "--seed", dest="cmd_seed", metavar="N", type=int, default=None,
                            help="seed for arrivals, amounts, ids and loads: the same seed plays the same node (default: random)")
        parser.add_argument("--demo.time-scale", "--time-scale", dest="cmd_time_scale", metavar="FACTOR", type=_positive,
                            default=1.0, help="play the node's schedule this many times faster (default: 1)")
    return parser


def load_agent_layout(settings: Settings, default_agent_config: Path = DEFAULT_AGENT_CONFIG):
    """The host's agents from the flags and agent.toml (``--agent.config``, else
    ``default_agent_config`` when it exists); see :mod:`exporter.analysis.agents`.

    :raises ConfigError: an unreadable or unusable agent.toml, named with the reason.
    """
    from exporter.app import agent_layout

    path = settings.agent_config_file
    if path is None and default_agent_config.is_file():
        path = default_agent_config
    text = None
    if path is not None:
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"{path}: cannot be read: {exc.strerror or exc} (set --agent.config)") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: not valid UTF-8") from None
    layout = agent_layout(settings, text, str(path) if path else None, socket.gethostname())
    if layout.source:
        log.info("agents from %s: %s", layout.source, ", ".join(layout.agents) or "none")
    return layout


def _check_roots(settings: Settings, allow_missing: bool) -> None:
    for root in settings.scratch_roots:
        try:
            is_dir = stat.S_ISDIR(os.stat(root).st_mode)
        except FileNotFoundError:
            if allow_missing:
                log.warning("scratch root %s does not exist yet; waiting for it", root)
                continue
            is_dir = False
        except OSError as exc:  # EACCES on a parent, ELOOP, EIO: the root cannot even be looked at
            raise ConfigError(f"scratch root {root} cannot be read: {exc.strerror} (set --scratch.root)") from None
        if not is_dir:
            raise ConfigError(f"scratch root {root} is not a directory (set --scratch.root)")
        if not os.access(root, os.R_OK | os.X_OK):
            raise ConfigError(f"scratch root {root} is not readable by uid {os.getuid()}")


def serve(settings: Settings, *, allow_missing_root: bool = False, on_ready=None, stop: threading.Event | None = None,
          telemetry=None, layout=None) -> int:
    """Run the exporter until SIGTERM/SIGINT (or ``stop`` is set); ``telemetry``: a ready source
    instead of the one ``--telemetry.source`` names; ``layout``: the host's agents (default: from
    the flags alone)."""
    from exporter.app import Exporter
    from exporter.web.server import HttpServer
    from exporter.web.webconfig import WebConfigError, WebConfigFile

    _check_roots(settings, allow_missing_root)
    host, port = parse_listen_address(settings.web_listen_address)
    web_config = None
    if settings.web_config_file is not None:
        web_config = WebConfigFile(settings.web_config_file)
        try:
            web_config.load()  # unknown keys, bad hashes, unreadable certificates: exit 2
        except WebConfigError as exc:
            raise ConfigError(str(exc).replace("\n", " ")) from None
    exporter = Exporter(settings, telemetry=telemetry, layout=layout)
    server = HttpServer(exporter.routes, host, port, web_config=web_config)  # routes: some run offloaded
    try:
        server.start()
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"{settings.web_listen_address} is already in use (set --web.listen-address)") from None
        raise ConfigError(f"cannot listen on {settings.web_listen_address}: {exc.strerror}") from None
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    try:
        exporter.start()
        shown = f"[{host}]" if ":" in host else (host or "0.0.0.0")
        scheme = "https" if server.tls else "http"
        log.info("serving on %s://%s:%d/metrics (scratch roots: %s)", scheme, shown, server.port,
                 ", ".join(map(str, settings.scratch_roots)))
        if on_ready:
            on_ready(exporter, server)
        stop.wait()
    finally:
        server.close()
        exporter.close()
    log.info("stopped")
    return 0


def _scan(settings: Settings, output: str) -> int:
    from exporter.scratch.allocation import AllocationBook
    from exporter.scratch.reader import Scanner
    from exporter.web.routes import state_document

    _check_roots(settings, allow_missing=False)
    book = AllocationBook()
    scanner = Scanner(book, settings.scratch_max_file_bytes)
    for root in settings.scratch_roots:
        scanner.scan(str(root))
    view = book.view()
    if output == "json":
        print(json.dumps(state_document(view, [str(r) for r in settings.scratch_roots]), indent=1))
        return 0
    print(format_table(view))
    return 0


def _simulate(settings: Settings, request: str, policy: str, state_file: str | None, output: str, layout=None) -> int:
    """Exit 0 when the request would be placed, 1 when it would be rejected, 2 on bad input."""
    from exporter.analysis import simulate as sim

    try:
        if state_file:
            state = sim.load_state(state_file)
        else:
            state = _live_node_state(settings, layout)
        result = sim.simulate(state, request, policy)
    except (OSError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    print(json.dumps(sim.result_document(result), indent=1) if output == "json" else sim.format_table(result))
    return 0 if result.placed else 1


def _live_node_state(settings: Settings, layout=None):
    """One scan plus one telemetry sample, as the server would see them."""
    from exporter.app import Exporter

    _check_roots(settings, allow_missing=False)
    exporter = Exporter(settings, layout=layout)
    exporter.start()
    try:
        exporter.sampler.wait_for_version(0, settings.telemetry_timeout * 2)
        return exporter.node_state()
    finally:
        exporter.close()


def format_table(view) -> str:
    """Human-readable allocation: devices first, then kernels that are not ok."""
    from exporter.scratch.allocation import KernelState

    lines = [f"{'DEVICE':<48} {'SLOT':<28} {'ALLOCATED':>14}"]
    for (device_id, slot), amount in sorted(view.device_totals.items()):
        lines.append(f"{device_id:<48} {slot:<28} {amount:>14}")
    lines.append("")
    lines.append(f"{'DEVICE':<48} {'FGPU (gpu_alloc_map)':>20}")
    for device_id, amount in view.alloc_map.items():
        lines.append(f"{device_id:<48} {amount:>20}")
    lines.append("")
    counts = ", ".join(f"{s.value} {n}" for s, n in view.state_counts.items())
    lines.append(f"kernels: {counts}")
    for k in sorted(view.kernels.values(), key=lambda k: k.kernel_id):
        if k.state is not KernelState.OK:
            lines.append(f"  {k.kernel_id}: {k.state.value}: {k.reason}")
    return "\n".join(lines)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def _demo(settings: Settings, directory: str | None, seed: int | None, time_scale: float) -> int:
    """A living node (simulated NVML devices, sessions, /proc, cgroups, planted events), or with
    ``--telemetry.mock-file`` the still sample tree on those mock devices."""
    base = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="gpu-alloc-demo-"))
    try:
        if settings.telemetry_mock_file is not None:
            return _demo_still(settings, base)
        return _demo_living(settings, base, seed, time_scale)
    finally:
        if directory is None:  # a temporary tree of our own: leave nothing behind
            shutil.rmtree(base, ignore_errors=True)


def _demo_living(settings: Settings, base: Path, seed: int | None, time_scale: float) -> int:
    import random

    from exporter.demo.node import LivingNode
    from exporter.telemetry.nvml import NvmlSource

    seed = random.SystemRandom().randrange(10**6) if seed is None else seed
    node = LivingNode(base, seed=seed, time_scale=time_scale, agent_id=settings.agent_id or "i-demo-dgx01")
    # The demo's own paths; its pace only where the user set none.
    update: dict[str, Any] = {"scratch_roots": [node.scratch], "path_procfs": node.host.proc, "path_cgroupfs": node.host.cgroup,
                              "agent_id": node.agent_id}
    # fGPU capacity comes from the simulated CUDA driver's SM counts, as on a real node.
    defaults = {"telemetry_interval": 2.0, "telemetry_pcie": True, "stale_grace": 60.0 / time_scale}
    update.update({k: v for k, v in defaults.items() if k not in settings.model_fields_set})
    settings = settings.model_copy(update=update)

    def announce(exporter, server) -> None:
        node.begin()  # demo second 0: the exporter is ready
        print(f"gpu-alloc-exporter demo: {node.describe()}", flush=True)
        _print_urls(settings, server, node.base)

    with node.running():
        return serve(settings, on_ready=announce, telemetry=NvmlSource(pcie=settings.telemetry_pcie))


def _demo_still(settings: Settings, base: Path) -> int:
    from exporter.demo import build_demo_tree

    root, cgroups = base / "scratches", base / "cgroup"
    build_demo_tree(root, cgroups)
    settings = settings.model_copy(update={"scratch_roots": [root], "path_cgroupfs": cgroups, "stale_grace": 60.0})

    def announce(exporter, server) -> None:
        print(f"gpu-alloc-exporter demo: sample scratch root at {root}, mock devices from {settings.telemetry_mock_file}", flush=True)
        _print_urls(settings, server, base)

    return serve(settings, on_ready=announce)


def _print_urls(settings: Settings, server, base: Path) -> None:
    host, _ = parse_listen_address(settings.web_listen_address)
    url = f"http://{host if host not in ('', '0.0.0.0', '::') else '127.0.0.1'}:{server.port}"
    print(f"files under {base}; serving:", flush=True)
    for path in ("/metrics", "/api/v1/alloc-map", "/api/v1/state", "/-/ready"):
        print(f"  {url}{path}", flush=True)
    print("Press Ctrl-C to stop.", flush=True)
