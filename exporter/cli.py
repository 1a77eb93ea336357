"""Command line: ``gpu-alloc-exporter [serve] | demo | scan | simulate``.

Flags are generated from :class:`exporter.settings.Settings`; ``--help`` shows each one's
placeholder, default and environment variable, grouped by prefix. Every command accepts every
setting (one config file serves them all) but its ``--help`` shows only the ones it uses.

``main(argv)`` returns the exit status: 0 on a clean stop, 2 for unusable configuration or a bad
command line (one line on stderr naming the flag or file and the reason), 1 for anything
unexpected (and, for ``simulate``, for a request the node would reject). A closed output pipe
(``scan --output json | head``) is not an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import typing
from pathlib import Path
from typing import Any, NoReturn

from exporter import __version__
from exporter.config import DEFAULT_AGENT_CONFIG, Config, headroom_params, resolve
from exporter.logs import setup_logging
from exporter.sdnotify import notify
from exporter.settings import ENV_PREFIX, FIELDS, ConfigError, Setting, Settings, parse_listen_address
from exporter.telemetry.model import SourceConfigError

__all__ = ["COMMANDS", "DEFAULT_AGENT_CONFIG", "build_parser", "main", "run"]

# Read when present and no --agent.config is given (the agent's own default location).

log = logging.getLogger("exporter")
PROG = "gpu-alloc-exporter"

COMMANDS = {
    "serve": "watch the scratch roots and serve /metrics and the JSON API (the default)",
    "demo": "serve a living sample node: simulated GPUs, sessions that come and go, planted faults",
    "scan": "print the allocation once and exit",
    "simulate": "show where a request would be placed, and what would remain",
}
_USAGE = {
    "serve": "[serve] [FLAGS]",
    "demo": "demo [FLAGS]",
    "scan": "scan [--output {table,json}] [FLAGS]",
    "simulate": "simulate --request SLOT=AMOUNT [--policy POLICY] [--state FILE] [FLAGS]",
}
# The settings each command's --help shows (flag prefixes or whole flags); the rest are accepted
# but hidden, so one config file serves every command.
_SHOWN: dict[str, tuple[str, ...] | None] = {
    "serve": None,  # everything
    "demo": ("--web.", "--telemetry.mock-file", "--log."),
    "scan": ("--scratch.root", "--scratch.max-file-bytes", "--log."),
    "simulate": ("--scratch.root", "--telemetry.source", "--telemetry.mock-file", "--device.", "--capacity.",
                 "--headroom.mode", "--headroom.nofrag-rule", "--headroom.exclude-stale", "--stale.", "--path.cgroupfs"),
}
_GROUPS = {
    "scratch": "scratch tree",
    "web": "HTTP",
    "telemetry": "device telemetry",
    "device": "device ids",
    "path": "host paths",
    "attribution": "process attribution",
    "capacity": "capacity (the fractional plugin's settings)",
    "alloc-map": "alloc map (the agent's gpu_alloc_map)",
    "headroom": "headroom",
    "stale": "stale kernels",
    "mig": "MIG",
    "agent": "agent",
    "identity": "kernel identity",
    "log": "logging",
}
# Placeholders that the field's type alone does not say; anything else is derived in _metavar.
_METAVARS = {
    "scratch_roots": "DIR",
    "web_listen_address": "[HOST]:PORT",
    "capacity_overrides": "DEVICE_ID=SHARES",
    "headroom_requests": "SLOT=AMOUNT",
    "capacity_unit_mem": "BYTES",
    "capacity_unit_proc": "SMS",
    "capacity_quantum": "SHARES",
    "capacity_agents": "N",
    "agent_id": "ID",
}


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())


def main(argv: list[str] | None = None, *, default_agent_config: Path | None = None) -> int:
    """Run one command; ``default_agent_config``: the agent.toml read when present and no
    ``--agent.config`` is given (tests point it elsewhere)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "help":  # "gpu-alloc-exporter help [COMMAND]"
        argv = [*argv[1:2], "--help"]
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        _fail(PROG, f"unknown command {argv[0]!r} (commands: {', '.join(COMMANDS)}; see {PROG} --help)")
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "serve"
    # The collector switches need every collector's module: only when one is given (or help
    # asked for) does the start import them before readiness.
    switched = any(a.startswith(("--collector.", "--no-collector.")) or a in ("-h", "--help") for a in argv)
    parser = build_parser(command, collector_switches=switched)
    args = vars(parser.parse_args(argv))
    extra = {k: args.pop(k) for k in list(args) if k.startswith("cmd_")}
    switches = {k.partition(":")[2]: extra.pop(k) for k in list(extra) if k.startswith("cmd_collector:")}
    config_file = args.pop("config_file", None)
    try:
        settings = Settings.load(args, Path(config_file) if config_file else None)
        headroom_params(settings)  # every command refuses what serve would, before anything runs
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    level = settings.log_level
    if command in ("scan", "simulate") and "log_level" not in settings.given:
        level = "warning"  # a one-shot command's answer is its output; progress lines would be noise
    setup_logging(level, settings.log_format)
    agent_config = default_agent_config or DEFAULT_AGENT_CONFIG
    try:
        if command == "demo":  # the demo builds its own node; a real one's agent.toml is not its
            return _demo(settings, extra["cmd_dir"], extra["cmd_seed"], extra["cmd_time_scale"], switches)
        if command == "scan":
            return _scan(resolve(settings, agent_config=agent_config, telemetry=False, roots="exist"), extra["cmd_output"])
        if command == "simulate":
            live = extra["cmd_state"] is None  # without --state the live node is read
            config = resolve(settings, agent_config=agent_config, telemetry=live, roots="exist" if live else None)
            return _simulate(config, extra["cmd_request"], extra["cmd_policy"], extra["cmd_state"], extra["cmd_output"])
        config = resolve(settings, agent_config=agent_config, collectors=switches, web=True,
                         roots="may-be-missing" if extra["cmd_allow_missing_root"] else "exist")
        return serve(config)
    except (ConfigError, SourceConfigError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2


def _fail(prog: str, message: str) -> NoReturn:
    print(f"{prog}: {message}", file=sys.stderr)
    sys.exit(2)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the flag and the reason, no usage dump."""

    def error(self, message: str) -> NoReturn:
        _fail(self.prog, message.removeprefix("argument ") + f" (see {self.prog} --help)")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=30, width=min(shutil.get_terminal_size().columns, 110))


def build_parser(command: str, *, collector_switches: bool = True) -> argparse.ArgumentParser:
    """The argument parser of one command; settings flags come from :class:`Settings`."""
    prog = PROG if command == "serve" else f"{PROG} {command}"
    if command == "serve":
        usage = "\n       ".join([*(f"{PROG} {_USAGE[c]}" for c in COMMANDS), f"{PROG} COMMAND --help"])
        description = "Prometheus exporter for live GPU allocation on Backend.AI agent nodes.\n\ncommands:\n" + "\n".join(
            f"  {c:<10}{h}" for c, h in COMMANDS.items()
        )
    else:
        usage = f"{PROG} {_USAGE[command]}"
        description = COMMANDS[command][0].upper() + COMMANDS[command][1:] + "."
    shown = _SHOWN[command]
    epilog = (
        f"Every flag is also an environment variable, {ENV_PREFIX} + the name after 'env' (e.g. "
        f"{ENV_PREFIX}SCRATCH_ROOTS), and a key of the --config.file (the flag without the dashes, "
        "e.g. scratch.root). Reference: docs/configuration.md."
    )
    if shown is not None:
        epilog = f"Every flag of '{PROG} --help' is accepted too, so one config file serves every command. " + epilog
    parser = _Parser(
        prog=prog, usage=usage, description=description, epilog=epilog, formatter_class=_Formatter, allow_abbrev=False,
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument("--config.file", dest="config_file", metavar="FILE",
                        help="YAML or TOML file with settings [env CONFIG_FILE]",
                        default=os.environ.get(f"{ENV_PREFIX}CONFIG_FILE"))
    own = parser.add_argument_group(f"{command} flags")
    if command == "serve":
        own.add_argument("--scratch.allow-missing-root", dest="cmd_allow_missing_root", action="store_true",
                         default=False, help="start even if a scratch root does not exist yet (it is picked up when it appears)")
    if command in ("scan", "simulate"):
        own.add_argument("--output", dest="cmd_output", choices=["table", "json"], default="table",
                         help="table for people, json for scripts (default: table)")
    if command == "simulate":
        from exporter.analysis.simulate import POLICIES

        own.add_argument("--request", dest="cmd_request", required=True, metavar="SLOT=AMOUNT",
                         help="the request, e.g. cuda.shares=1.5, cuda.device=2 or cuda.device:1g.10gb-mig=1")
        own.add_argument("--policy", dest="cmd_policy", default="evenly", choices=POLICIES,
                         metavar="{" + ",".join(POLICIES) + "}",
                         help="evenly (Backend.AI, the default), evenly-nofrag, simple/besteffort (go-gpuallocator), "
                         "compact-first/low-load-first (tensor-fusion), hami-binpack/hami-spread (HAMi)")
        own.add_argument("--state", dest="cmd_state", metavar="FILE", default=None,
                         help="a saved /api/v1/state document instead of the live scratch roots and devices")
    if command == "demo":
        own.add_argument("--demo.dir", dest="cmd_dir", metavar="DIR", default=None,
                         help="where to build the node's scratch root, /proc and cgroup tree (default: a new temporary directory)")
        own.add_argument("--demo.seed", "--seed", dest="cmd_seed", metavar="N", type=int, default=None,
                         help="seed for arrivals, amounts, ids and loads: the same seed plays the same node (default: random)")
        own.add_argument("--demo.time-scale", "--time-scale", dest="cmd_time_scale", metavar="FACTOR", type=_positive,
                         default=1.0, help="play the node's schedule this many times faster (default: 1)")
    if command in ("serve", "demo") and collector_switches:
        from exporter.metrics.collectors import collectors

        switches = parser.add_argument_group("collectors", "Each collector on (--collector.NAME) or off (--no-collector.NAME).")
        for c in collectors().values():
            switches.add_argument(f"--collector.{c.name}", dest=f"cmd_collector:{c.name}", action=argparse.BooleanOptionalAction,
                                  help=f"{c.help} (default: {'on' if c.default else 'off'})")
    if not own._group_actions:
        parser._action_groups.remove(own)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, field in FIELDS.items():
        flag = field.flag
        visible = shown is None or any(flag == s or (s.endswith(".") and flag.startswith(s)) for s in shown)
        prefix = flag[2:].split(".", 1)[0]
        if visible and prefix not in groups:
            groups[prefix] = parser.add_argument_group(_GROUPS.get(prefix, prefix))
        target = groups[prefix] if visible else parser
        kwargs: dict[str, Any] = {"dest": name, "help": _help(name, field) if visible else argparse.SUPPRESS}
        if field.annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["metavar"] = _metavar(name, field)
            if field.repeat:
                kwargs["action"] = "append"
        target.add_argument(flag, **kwargs)
    return parser


def _help(name: str, field: Setting) -> str:
    default = field.default
    if isinstance(default, bool):
        shown = "on" if default else "off"
    elif isinstance(default, list):
        shown = ",".join(map(str, default))
    else:
        shown = "" if default is None else str(default)
    notes = [f"default {shown}"] if shown else []
    notes.append(f"env {name.upper()}")  # the variable is ENV_PREFIX + this (the epilog says so)
    # The first clause; docs/configuration.md has the whole description.
    return f"{field.description.split('; ')[0]} [{'; '.join(notes)}]"


def literal_choices(annotation: Any) -> tuple[str, ...]:
    """The allowed values of a ``Literal[...]`` (or ``Literal[...] | None``) setting, else ()."""
    if typing.get_origin(annotation) is typing.Literal:
        return tuple(str(a) for a in typing.get_args(annotation))
    for arg in typing.get_args(annotation):
        if typing.get_origin(arg) is typing.Literal:
            return literal_choices(arg)
    return ()


def _metavar(name: str, field: Setting) -> str:
    """The placeholder of a settings flag: a whole word, or the allowed values."""
    explicit = field.metavar or _METAVARS.get(name)
    if explicit:
        return explicit
    choices = literal_choices(field.annotation)
    if choices:
        return "{" + ",".join(choices) + "}"
    types = {field.annotation, *typing.get_args(field.annotation)}
    if Path in types:
        return "FILE" if name.endswith("_file") else "DIR"
    if float in types and name.endswith(("_interval", "_timeout", "_grace", "_seconds")):
        return "SECONDS"
    if name.endswith("_ratio"):
        return "RATIO"
    if name.endswith("_bytes"):
        return "BYTES"
    return field.flag.rsplit(".", 1)[-1].replace("-", "_").upper()


def _emit(text: str) -> None:
    """Print to stdout; a reader that went away (``| head``) is not an error."""
    try:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        # Python would report the failed flush again at exit: point stdout at /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


_SWITCH_INTERVAL_SECONDS = 0.0005


def serve(config: Config, *, on_ready=None, stop: threading.Event | None = None, telemetry=None) -> int:
    """Run the exporter until SIGTERM/SIGINT (or ``stop`` is set); ``telemetry``: a ready source
    instead of the one ``--telemetry.source`` names. The configuration has checked the roots."""
    from exporter.app import Exporter
    from exporter.web.server import HttpServer

    settings = config.settings
    host, port = parse_listen_address(settings.web_listen_address)
    server: HttpServer | None = None  # bound below; its counters are read only once serving
    exporter = Exporter(config, telemetry=telemetry, server_stats=lambda: server.stats())
    server = HttpServer(exporter.routes, host, port, web_config=config.web)  # routes: some run offloaded
    try:
        server.start()
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"{settings.web_listen_address} is already in use (set --web.listen-address)") from None
        raise ConfigError(f"cannot listen on {settings.web_listen_address}: {exc.strerror}") from None
    # A thread that wants the GIL waits until its holder has run this long: with CPython's 5 ms,
    # each system call of a /metrics request (wake-up, read, write) could wait 5 ms behind a worker
    # building a JSON document; 0.5 ms bounds that wait at the cost of more frequent switches
    # between busy threads, which keeps /metrics fast while a client polls /api/v1/state.
    sys.setswitchinterval(_SWITCH_INTERVAL_SECONDS)
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
        # A Type=notify unit is active from here, as /-/ready answers 200 from here.
        notify(f"READY=1\nSTATUS=serving on port {server.port}, {len(exporter.book.view().kernels)} kernels")
        if on_ready:
            on_ready(exporter, server)
        stop.wait()
    finally:
        notify("STOPPING=1")
        server.close()
        exporter.close()
    log.info("stopped")
    return 0


def _scan(config: Config, output: str) -> int:
    from exporter.metrics.documents import state_document
    from exporter.scratch.allocation import AllocationBook
    from exporter.scratch.reader import Scanner

    settings = config.settings
    book = AllocationBook()
    scanner = Scanner(book, settings.scratch_max_file_bytes)
    for root in settings.scratch_roots:
        scanner.scan(str(root))
    view = book.view()
    if output == "json":
        _emit(json.dumps(state_document(view, [str(r) for r in settings.scratch_roots]), indent=1))
        return 0
    _emit(format_table(view))
    return 0


def _simulate(config: Config, request: str, policy: str, state_file: str | None, output: str) -> int:
    """Exit 0 when the request would be placed, 1 when it would be rejected, 2 on bad input."""
    from exporter.analysis import simulate as sim

    try:
        want = sim.parse_request(request)
    except ValueError as exc:
        raise ConfigError(f"--request {request!r}: {exc}") from None
    if state_file:
        try:
            state = sim.load_state(state_file)
        except ValueError as exc:  # one line naming the file and the reason
            raise ConfigError(str(exc)) from None
    else:
        state = _live_node_state(config)
    if not state.slots:
        if state_file:
            raise ConfigError(f"--state {state_file}: the saved state has no devices")
        raise ConfigError(
            f"this node shows no devices to place {want.slot} on; give them with --telemetry.source nvml (a GPU node), "
            "--telemetry.source mock --telemetry.mock-file FILE, --capacity.override DEVICE_ID=SHARES "
            "for the devices resource.txt names, or --state FILE (a saved /api/v1/state)"
        )
    result = sim.simulate(state, want, policy)
    _emit(json.dumps(sim.result_document(result), indent=1) if output == "json" else sim.format_table(result))
    return 0 if result.placed else 1


def _live_node_state(config: Config):
    """One scan plus one telemetry sample, as the server would see them."""
    from exporter.app import Exporter

    exporter = Exporter(config)
    exporter.start()
    try:
        exporter.sampler.wait_for_version(0, config.settings.telemetry_timeout * 2)
        return exporter.pipeline.step().state
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


def _demo(settings: Settings, directory: str | None, seed: int | None, time_scale: float, collectors: dict[str, bool]) -> int:
    """A living node (simulated NVML devices, sessions, /proc, cgroups, planted events), or with
    ``--telemetry.mock-file`` the still sample tree on those mock devices."""
    base = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="gpu-alloc-demo-"))
    try:
        if settings.telemetry_mock_file is not None:
            return _demo_still(settings, base, collectors)
        return _demo_living(settings, base, seed, time_scale, collectors)
    finally:
        if directory is None:  # a temporary tree of our own: leave nothing behind
            shutil.rmtree(base, ignore_errors=True)


def _demo_living(settings: Settings, base: Path, seed: int | None, time_scale: float, collectors: dict[str, bool]) -> int:
    import random

    from exporter.demo.node import LivingNode
    from exporter.telemetry.nvml import NvmlSource

    seed = random.SystemRandom().randrange(10**6) if seed is None else seed
    node = LivingNode(base, seed=seed, time_scale=time_scale, agent_id=settings.agent_id or "i-demo-dgx01")
    # The demo's own paths; its pace only where the user set none.
    update: dict[str, Any] = {"scratch_roots": [node.scratch], "path_procfs": node.host.proc, "path_cgroupfs": node.host.cgroup,
                              "agent_id": node.agent_id}
    # fGPU capacity comes from the simulated CUDA driver's SM counts, as on a real node.
    # Latched faults of simulated GPUs belong to the demo's folder, never to the host's state file.
    defaults = {"telemetry_interval": 2.0, "telemetry_pcie": True, "stale_grace": 60.0 / time_scale,
                "health_state_file": base / "health.json"}
    update.update({k: v for k, v in defaults.items() if k not in settings.given})
    settings = dataclasses.replace(settings, **update, given=settings.given | update.keys())

    def announce(exporter, server) -> None:
        node.begin()  # demo second 0: the exporter is ready
        print(f"gpu-alloc-exporter demo: {node.describe()}", flush=True)
        _print_urls(settings, server, node.base)

    with node.running():
        config = resolve(settings, collectors=collectors, web=True, telemetry=False)  # its own simulated NVML
        return serve(config, on_ready=announce, telemetry=NvmlSource(pcie=settings.telemetry_pcie))


def _demo_still(settings: Settings, base: Path, collectors: dict[str, bool]) -> int:
    from exporter.demo import build_demo_tree

    root, cgroups = base / "scratches", base / "cgroup"
    build_demo_tree(root, cgroups)
    update: dict[str, Any] = {"scratch_roots": [root], "path_cgroupfs": cgroups, "stale_grace": 60.0}
    if "health_state_file" not in settings.given:
        update["health_state_file"] = base / "health.json"  # the demo's faults stay in the demo's folder
    if "telemetry_source" not in settings.given:  # a device file given means: serve those devices
        update["telemetry_source"] = "mock"
    settings = dataclasses.replace(settings, **update, given=settings.given | update.keys())

    def announce(exporter, server) -> None:
        print(f"gpu-alloc-exporter demo: sample scratch root at {root}, mock devices from {settings.telemetry_mock_file}", flush=True)
        _print_urls(settings, server, base)

    return serve(resolve(settings, collectors=collectors, web=True), on_ready=announce)


def _print_urls(settings: Settings, server, base: Path) -> None:
    host, _ = parse_listen_address(settings.web_listen_address)
    url = f"http://{host if host not in ('', '0.0.0.0', '::') else '127.0.0.1'}:{server.port}"
    print(f"files under {base}; serving:", flush=True)
    for path in ("/metrics", "/api/v1/alloc-map", "/api/v1/state", "/-/ready"):
        print(f"  {url}{path}", flush=True)
    print("Press Ctrl-C to stop.", flush=True)
