"""A GPU that falls off the bus pages once, stays lost across an exporter restart, and clears
only when it is reset: the exporter's CLI (``serve --health.state-file``) over the simulated
``libnvidia-ml``, scraped by Debian's Prometheus with the shipped rules (every ``for:`` 0s),
notifying Debian's Alertmanager with the shipped routing and inhibition (durations scaled
1/30) and a local webhook.

The exporter runs as a child process through this file's ``__main__``: the simulated DGX A100
(:meth:`FakeNvml.dgx_a100`) installed under ``pynvml``, then :func:`exporter.cli.main`. The
test drives the machine through a command file the child polls (``xid 5 79``, ``lose 5``,
``reset 5``). A restarted child is the same machine: it replays what lasts (a GPU lost stays
lost until reset), not what happened once (an XID event is not seen again), so only the state
file can tell the new exporter that the GPU was lost by XID 79.

The restart is timed right after a scrape, so no scrape fails: a failed scrape marks every
series stale and would resolve, then re-fire, the alert (Prometheus' scrape interval is 4 s
here, far longer than the exporter's start). ~45 s.
"""

from __future__ import annotations

import copy
import json
import re
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

if __name__ != "__main__":  # the child (below) starts fast: it needs none of the test's tools
    import monitoring_checks as mc
    import pytest
    import yaml
    from e2e.harness import Process, Prometheus, Webhook, e2e_rules, free_port, wait_until

    from exporter.demo import write_kernel, write_recovery

    pytestmark = [pytest.mark.slow, pytest.mark.tools("prometheus", "prometheus-alertmanager", "amtool")]

LOST = 5  # the GPU that falls off the bus
KERNEL, SESSION = "5eed0000-0000-4000-8000-00000000000a", "5e550000-0000-4000-8000-00000000000a"  # on that GPU
SCRAPE_S = 8.0  # Prometheus' scrape interval here: twice a restart of the exporter on a busy machine
SCALE = 1 / 60  # Alertmanager's durations: group_wait 2m -> 2 s, group_interval 5m -> 5 s
ROOT = Path(__file__).resolve().parent.parent
SHIPPED_AM = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
_HEALTH = re.compile(r'^gpu_alloc_device_health\{device_id="([^"]+)",state="(\w+)"\} 1(?:\.0)?$', re.M)


# --- the child: the simulated machine under the exporter's CLI ----------------------------------


def _node(commands: Path, argv: list[str]) -> int:
    """Run ``exporter.cli.main(argv)`` on a simulated DGX A100 that obeys ``commands``."""
    from exporter.cli import main
    from exporter.telemetry.nvml.simulated import FakeNvml

    fake = FakeNvml.dgx_a100(clock=time.time)
    fake.max_event_wait_ms = 200
    for index in (0, 1):  # no process anywhere: the node's health is the subject, not its load
        fake.set_processes(index, [])
    fake.set_processes(6, [], mig_index=0)
    done = commands.read_text().splitlines() if commands.exists() else []
    lost: set[int] = set()
    for line in done:  # what lasts from before this process: a GPU off the bus stays off
        verb, index = line.split()[:2]
        if verb == "lose":
            lost.add(int(index))
        elif verb == "reset":
            lost.discard(int(index))
    for index in lost:
        fake.lose(index)
    stop = threading.Event()

    def obey() -> None:
        seen = len(done)
        while not stop.wait(0.05):
            lines = commands.read_text().splitlines() if commands.exists() else []
            for line in lines[seen:]:
                verb, index, *rest = line.split()
                if verb == "xid":
                    fake.push_xid(int(index), int(rest[0]))
                elif verb == "lose":
                    fake.lose(int(index))
                elif verb == "reset":
                    fake.reset(int(index))
            seen = max(seen, len(lines))

    thread = threading.Thread(target=obey, name="commands", daemon=True)
    with fake.installed():
        thread.start()
        try:
            return main(argv)
        finally:
            stop.set()
            thread.join(5)


if __name__ == "__main__":
    sys.exit(_node(Path(sys.argv[1]), sys.argv[2:]))


# --- the test --------------------------------------------------------------------------------------


def _exporter(work: Path, name: str, commands: Path, argv: list[str]) -> Process:
    """This file's node as a child process, once it serves."""
    proc = Process(name, [sys.executable, __file__, str(commands), *argv], work)

    def serving() -> bool:
        if "serving on" in proc.log():
            return True
        if not proc.alive():
            raise AssertionError(f"{name} exited:\n{proc.log()}")
        return False

    proc.start_checked(serving, f"{name} to serve")
    return proc


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def _health(address: str) -> tuple[dict[str, str], str]:
    """device_id -> health state, and the whole exposition."""
    text = _get(f"http://{address}/metrics")
    return {d: s for d, s in _HEALTH.findall(text)}, text


def _since(text: str, device_id: str) -> float:
    m = re.search(rf'^gpu_alloc_device_health_since_timestamp_seconds\{{device_id="{re.escape(device_id)}"\}} (\S+)$', text, re.M)
    assert m, f"no since for {device_id}"
    return float(m.group(1))


def _last_scrape(prom: Prometheus) -> str:
    targets = json.loads(_get(f"{prom.url}/api/v1/targets"))["data"]["activeTargets"]
    return targets[0]["lastScrape"] if targets else ""


def _alertmanager_config(webhook_port: int) -> dict[str, Any]:
    """The shipped routing and inhibition, durations scaled, every receiver posting here."""
    config = copy.deepcopy(yaml.safe_load(SHIPPED_AM.read_text()))

    def scale(route: dict[str, Any]) -> None:
        for key in ("group_wait", "group_interval", "repeat_interval"):
            if key in route:
                seconds = sum(int(n) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[u] for n, u in re.findall(r"(\d+)([smhd])", route[key]))
                route[key] = f"{max(1, round(seconds * SCALE * 1000))}ms"
        for child in route.get("routes", []):
            scale(child)

    scale(config["route"])
    for receiver in config["receivers"]:
        receiver.pop("email_configs", None)
        receiver["webhook_configs"] = [{"url": f"http://127.0.0.1:{webhook_port}/{receiver['name']}", "send_resolved": True}]
    return config


def _alertmanager(work: Path, webhook_port: int) -> tuple[Process, str]:
    """Debian's Alertmanager with the shipped configuration (scaled) on a loopback port."""
    path = work / "alertmanager.yml"
    path.write_text(yaml.safe_dump(_alertmanager_config(webhook_port), sort_keys=False))
    address = f"127.0.0.1:{free_port()}"
    # --cluster.listen-address= (empty) disables HA gossip, which would bind 0.0.0.0:9094.
    am = Process("alertmanager", ["prometheus-alertmanager", f"--config.file={path}", f"--storage.path={work / 'am-data'}",
                                  f"--web.listen-address={address}", "--cluster.listen-address=", "--log.level=warn"], work)
    am.start_checked(lambda: _ready(f"http://{address}"), "Alertmanager to be ready")
    return am, address


def test_a_lost_gpu_pages_once_survives_a_restart_and_clears_on_reset(tmp_path: Path) -> None:
    from exporter.telemetry.nvml.simulated import FakeNvml

    device = FakeNvml.dgx_a100().gpus[LOST].uuid
    scratch = tmp_path / "scratches"
    # One session on the GPU, so the alert has someone to name.
    write_kernel(scratch, KERNEL, {"cuda.shares": {device: "4"}}, container_id="e" * 64)
    write_recovery(scratch, KERNEL, SESSION, "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d")
    procfs = tmp_path / "proc"
    (procfs / "sys" / "kernel" / "random").mkdir(parents=True)
    (procfs / "sys" / "kernel" / "random" / "boot_id").write_text("0d9e1f0a-6b1c-4c55-9f1e-3c2a7b4d5e6f\n")
    state = tmp_path / "health.json"
    commands = tmp_path / "commands"
    address = f"127.0.0.1:{free_port()}"
    argv = ["serve", "--web.listen-address", address, "--scratch.root", str(scratch), "--path.procfs", str(procfs),
            "--health.state-file", str(state), "--telemetry.interval", "0.5", "--agent.id", "i-node05"]

    started: list[Any] = []
    webhook = Webhook()
    started.append(webhook)
    try:
        am, am_address = _alertmanager(tmp_path, webhook.port)
        started.append(am)

        first = _exporter(tmp_path, "exporter-1", commands, argv)
        started.append(first)
        prom = Prometheus(tmp_path, e2e_rules(tmp_path, list(mc.RULE_FILES)),
                          [{"job_name": "gpu-nodes", "scrape_interval": f"{SCRAPE_S:g}s", "scrape_timeout": "2s",
                            "static_configs": [{"targets": [address]}]}], am_address, interval="1s")
        started.append(prom)
        health, _ = _health(address)
        assert health.get(device) == "ok", health

        # The fault: XID 79, then the GPU no longer answers.
        commands.write_text(f"xid {LOST} 79\nlose {LOST}\n")
        health, text = wait_until(lambda: (h := _health(address))[0].get(device) == "lost" and h, 10, "GPU 5 lost")
        since = _since(text, device)
        assert 'reason="XID 79"' in text
        page = webhook.wait_for("firing", "GpuAllocDeviceNeedsReset", 30, device_id=device)
        assert page["labels"]["state"] == "lost" and page["labels"]["severity"] == "critical"
        assert f"session {SESSION}" in page["annotations"]["sessions"]
        assert json.loads(state.read_text())["devices"][device]["state"] == "lost"

        # The restart, right after a scrape: the next one reaches the new process.
        scraped = _last_scrape(prom)
        scraped = wait_until(lambda: (s := _last_scrape(prom)) != scraped and s, 2 * SCRAPE_S, "a scrape")
        first.stop()
        started.remove(first)
        second = _exporter(tmp_path, "exporter-2", commands, argv)
        started.append(second)
        health, text = _health(address)
        assert health.get(device) == "lost", health
        assert _since(text, device) == since  # the latch read back, not taken again
        assert 'reason="XID 79"' in text  # this process never saw the XID: the state file said so
        # Scraped again, and still lost for longer than Alertmanager's group_interval after that.
        wait_until(lambda: _last_scrape(prom) != scraped, 2 * SCRAPE_S, "a scrape of the new process")
        time.sleep(6)
        assert _health(address)[0].get(device) == "lost"

        commands.write_text(commands.read_text() + f"reset {LOST}\n")
        wait_until(lambda: _health(address)[0].get(device) == "ok", 10, "GPU 5 healthy after the reset")
        assert "cleared by a GPU reset" in second.log()
        webhook.wait_for("resolved", "GpuAllocDeviceNeedsReset", 30, device_id=device)
        assert json.loads(state.read_text())["devices"] == {}

        # Every scrape succeeded (the premise: a failed one would make every series stale).
        assert prom.query(f'min_over_time(up{{instance="{address}"}}[5m]) < 1') == [], "a scrape failed: restart too slow?"
        # One page for the whole fault, then its resolution: nothing else about GPU 5 notified.
        about = [n["payload"] for n in webhook.notifications
                 if any(a["labels"].get("device_id") == device for a in n["payload"]["alerts"])]
        assert [(p["status"], sorted({a["labels"]["alertname"] for a in p["alerts"]})) for p in about] == [
            ("firing", ["GpuAllocDeviceNeedsReset"]), ("resolved", ["GpuAllocDeviceNeedsReset"])], about
    finally:
        for thing in reversed(started):
            thing.close() if hasattr(thing, "close") else thing.stop()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False
