"""Scratch trees as the agent writes them, and a still sample node for tests.

:func:`write_kernel` writes a kernel's ``config/resource.txt``; :func:`build_demo_tree` a fixed
sample node whose devices come from the packaged ``data/demo-devices.toml`` (the same file mock
telemetry reads), so allocations and telemetry describe the same GPUs. Files are written in the
current agent format (``CID=`` appended last, compact ``SLOTS``), as Backend.AI writes them.
"""

from __future__ import annotations

import json
import tomllib
import uuid
from decimal import Decimal
from importlib import resources
from pathlib import Path

__all__ = ["DEMO_DEVICES", "append_cid", "build_demo_tree", "demo_devices", "recovery_json", "resource_lines",
           "write_kernel", "write_recovery"]

DEMO_DEVICES = "demo-devices.toml"


def demo_devices() -> tuple[list[str], list[tuple[str, str]]]:
    """Device ids as resource.txt spells them: (whole GPUs as ``GPU-<uuid>``, [(MIG id, MIG slot)])."""
    doc = tomllib.loads(resources.files("exporter").joinpath("data", DEMO_DEVICES).read_text())
    gpus, migs = [], []
    for idx, dev in enumerate(doc["devices"]):
        if dev.get("is_mig_device"):
            profile = dev["model_name"].split("-", 1)[1]
            migs.append((f"MIG-{dev['mother_uuid']}/{idx}/0", f"cuda.device:{profile}-mig"))
        else:
            gpus.append(f"GPU-{dev['mother_uuid']}")
    return gpus, migs


def write_kernel(
    root: Path,
    kernel_id: str,
    allocations: dict[str, dict[str, Decimal | str]],
    *,
    cpus: int | list[int] = 2,
    mem: str = "8g",
    container_id: str | None = None,
    complete: bool = True,
    mounts: list[str] | None = None,
    tail: list[str] | None = None,
) -> Path:
    """Write ``{root}/{kernel_id}/config/resource.txt`` as the agent does (slot -> device -> amount).

    Bytes slots (``cuda.mem``) take BinarySize amounts (``"10g"``), written as given in their
    ``_SHARES`` line and in bytes in ``SLOTS``, as the agent does. ``cpus`` is a count (cores 0…n-1)
    or the core ids. ``mounts`` are the ``MOUNTS`` entries (``src:dst:mode``); ``tail`` lines follow
    the ``_SHARES`` lines (a plugin's ``CUDA_*`` lines). ``complete=False`` writes only the first
    line, as a reader sees a file the agent is still writing. ``container_id`` appends a ``CID=``
    line at once; the agent appends it later (:func:`append_cid`).
    """
    config = root / kernel_id / "config"
    config.mkdir(parents=True, exist_ok=True)
    (root / kernel_id / "work").mkdir(exist_ok=True)
    path = config / "resource.txt"
    lines = resource_lines(allocations, cpus=cpus, mem=mem, mounts=mounts, tail=tail)
    text = "".join(line + "\n" for line in lines)
    if container_id:
        text += f"CID={container_id}\n"
    path.write_text(text if complete else lines[0] + "\n")
    return path


def resource_lines(
    allocations: dict[str, dict[str, Decimal | str]],
    *,
    cpus: int | list[int] = 2,
    mem: str = "8g",
    mounts: list[str] | None = None,
    tail: list[str] | None = None,
) -> list[str]:
    """The lines of a ``resource.txt`` before any ``CID=``, in the agent's order."""
    cores = list(range(cpus)) if isinstance(cpus, int) else list(cpus)
    slots = {"cpu": str(len(cores)), "mem": str(_bytes(mem))}
    for slot, per_device in allocations.items():
        if "mem" in slot:  # a bytes slot (ResourceSlot._guess_slot_type)
            slots[slot] = str(sum(_bytes(str(v)) for v in per_device.values()))
        else:
            slots[slot] = str(sum((Decimal(str(v)) for v in per_device.values()), Decimal(0)))
    lines = ["SCRATCH_SIZE=0m", "MOUNTS=" + ",".join(mounts or ()), "SLOTS=" + json.dumps(slots, separators=(",", ":")),
             "UNIFIED_DEVICES=[]"]
    for slot, per_device in allocations.items():
        lines.append(f"{slot.upper()}_SHARES=" + ",".join(f"{d}:{v}" for d, v in per_device.items()))
    lines.append("CPU_SHARES=" + ",".join(f"{i}:1" for i in cores))
    lines.append(f"MEM_SHARES=root:{mem}")
    return lines + list(tail or ())


def append_cid(path: Path, container_id: str) -> None:
    """Append ``CID=<id>`` as the agent does once the container exists (again on every restart)."""
    with path.open("a") as f:
        f.write(f"CID={container_id}\n")


def recovery_json(
    kernel_id: str,
    session_id: str,
    user_id: str | None,
    *,
    agent_id: str = "i-demo-node",
    session_type: str = "interactive",
    image: tuple[str, str, str] = ("stable/python-ff", "stable", "24.03-py310-cuda12.4"),
) -> str:
    """``config/recovery.json`` as a 25.18+ agent writes it: compact pydantic JSON, fields in the
    order the agent's schema declares them (``owner_project_id`` is always null today).

    :param image: the image's (name, project, tag).
    """
    name, project, tag = image
    doc = {
        "id": kernel_id,
        "agent_id": agent_id,
        "image_ref": {"name": name, "project": project, "tag": tag,
                      "registry": "cr.backend.ai", "architecture": "x86_64", "is_local": False},
        "version": 5,
        "ownership_data": {"kernel_id": kernel_id, "session_id": session_id, "agent_id": agent_id,
                           "owner_user_id": user_id, "owner_project_id": None},
        "network_id": f"bai-singlenode-{session_id[:8]}",
        "network_driver": "bridge",
        "session_type": session_type,
        "block_service_ports": False,
        "domain_socket_proxies": [],
        # Batch sessions serve nothing; the others a notebook and SSH.
        "service_ports": [] if session_type == "batch" else [
            {"name": "jupyter", "protocol": "http", "container_ports": [8081], "host_ports": [30712], "is_inference": False},
            {"name": "sshd", "protocol": "tcp", "container_ports": [2200], "host_ports": [30713], "is_inference": False}],
        "repl_in_port": 2000,
        "repl_out_port": 2001,
    }
    return json.dumps(doc, separators=(",", ":"))


def write_recovery(root: Path, kernel_id: str, session_id: str, user_id: str | None, **kw: str) -> Path:
    """Write (in place, as the agent does) ``{root}/{kernel_id}/config/recovery.json``."""
    path = root / kernel_id / "config" / "recovery.json"
    with open(path, "w") as f:
        f.write(recovery_json(kernel_id, session_id, user_id, **kw))
    return path


DEMO_USERS = ("f38dea23-50fa-42a0-b5ae-338f5f4693f4", "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d", "7e6d5c4b-3a29-4817-a6b5-c4d3e2f1a0b9")


def _bytes(size: str) -> int:
    from exporter.units import parse_binary_size

    return parse_binary_size(size)


def build_demo_tree(root: Path, cgroup_root: Path | None = None) -> list[str]:
    """Populate ``root`` with fGPU, whole-GPU, MIG, CPU-only and pending kernels. Returns kernel ids.

    With ``cgroup_root``, also write a cgroup v2 tree in which every kernel's container runs
    except one, whose scratch directory is therefore stale (its container was removed out of band).
    """
    root.mkdir(parents=True, exist_ok=True)
    gpus, migs = demo_devices()
    ids = iter(str(uuid.UUID(int=0x5EED0000_0000_4000_8000_000000000000 + i)) for i in range(1000))
    cid = iter(f"{i:02x}" * 32 for i in range(1, 1000))
    kernels: list[str] = []

    def add(allocs: dict, **kw) -> None:
        kid = next(ids)
        write_kernel(root, kid, allocs, container_id=next(cid), **kw)
        # One session per kernel, owned by one of three users in turn.
        session = str(uuid.UUID(int=0x5E550000_0000_4000_8000_000000000000 + len(kernels)))
        write_recovery(root, kid, session, DEMO_USERS[len(kernels) % len(DEMO_USERS)])
        kernels.append(kid)

    fgpu = gpus[:-1]
    # fGPU kernels spread over the fractional devices, with amounts users actually request.
    for i, amount in enumerate(["0.5", "1", "2", "2.5", "4", "1.5", "0.25", "3"]):
        add({"cuda.shares": {fgpu[i % len(fgpu)]: Decimal(amount)}}, cpus=4, mem="16g")
    # One large request split evenly over two devices, as the EVENLY allocator does.
    add({"cuda.shares": {fgpu[0]: Decimal("3.00"), fgpu[1]: Decimal("3.00")}}, cpus=8, mem="64g")
    # A whole-GPU kernel on the last non-MIG GPU: on a fractional node that is every share of it
    # (13.5 for an 80 GB, 108-SM device at the default unit_mem 2 GiB and unit_proc 8).
    add({"cuda.shares": {gpus[-1]: Decimal("13.50")}}, cpus=16, mem="128g")
    # MIG slices: every other instance taken.
    for mig_id, slot in migs[::2]:
        add({slot: {mig_id: Decimal(1)}}, cpus=2, mem="8g")
    # CPU-only kernels.
    add({}, cpus=8, mem="32g")
    add({}, cpus=2, mem="4g")
    # A kernel whose container is gone: its directory stays behind (the agent never sweeps).
    add({"cuda.shares": {fgpu[-1]: Decimal("0.5")}}, cpus=2, mem="8g")
    stale_cid = f"{len(kernels):02x}" * 32
    # A kernel the agent is still writing.
    kid = next(ids)
    write_kernel(root, kid, {"cuda.shares": {fgpu[-1]: Decimal("1")}}, complete=False)
    kernels.append(kid)
    if cgroup_root is not None:
        (cgroup_root / "system.slice").mkdir(parents=True, exist_ok=True)
        (cgroup_root / "cgroup.controllers").write_text("cpu memory pids\n")
        for i in range(1, len(kernels)):
            container = f"{i:02x}" * 32
            if container != stale_cid:
                (cgroup_root / "system.slice" / f"docker-{container}.scope").mkdir(exist_ok=True)
    return kernels
