"""The fractional allocator and headroom against the released Backend.AI agent's own code.

Backend.AI's ``FractionAllocMap`` and ``AffinityMap`` (``ai/backend/agent/alloc_map.py``,
``affinity_map.py``) from the wheels on PyPI run side by side with
:mod:`exporter.analysis.placement` on seeded random multi-NUMA nodes (mixed capacities, quanta,
allocations, affinity policies), called as ``resources.allocate()`` calls them: a fresh
``AffinityHint(None, AffinityMap.build(devices), policy)``. Verdicts, per-device amounts,
headroom and how many requests of a size fit one after another must agree exactly.

The wheels are a test-only input: ``pip download`` puts them in pytest's cache folder (or
``$GPU_ALLOC_AGENT_WHEELS``), never in the repository. Only the two allocator modules are
copied to a temporary folder, where their Python 3.12+ syntax (PEP 695 aliases and type
parameters, ``typing.override``) is rewritten mechanically so Python 3.11 runs them
(``tests/backendai_wheels.py``). What they
import from the agent's runtime is replaced there by stand-ins: the agent's exception classes
(names and hierarchy), a logging adapter, and ``DeviceId``/``DeviceName``/``SlotName``/
``SlotTypes`` and ``ConfigurationError`` copied out of ``backend.ai-common``'s source. networkx
and more-itertools come as the versions the agent pins.

No network, no test: the download failing fails this test, loudly.
``GPU_ALLOC_SKIP_AGENT_DIFFERENTIAL=1`` skips it instead (for offline local runs only).
"""

from __future__ import annotations

import random
import sys
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace

import pytest
from backendai_wheels import TYPING_SHIM, extract, fetch_wheel, to_py311, wheels_folder

from exporter.analysis.headroom import count_fits, headroom
from exporter.analysis.placement import (
    AffinityPolicy,
    DeviceFree,
    NoFragRule,
    Placement,
    Policy,
    Request,
    place,
    round_down,
)

D = Decimal
SKIP_ENV = "GPU_ALLOC_SKIP_AGENT_DIFFERENTIAL"
WHEELS_ENV = "GPU_ALLOC_AGENT_WHEELS"
SEED = 2609
SLOT = "cuda.shares"

# (agent release, the rule that follows it, nodes). 26.9.6 is the reference; 26.8.3 and 26.1.0
# check the two older rules against the releases they name.
RELEASES = [("26.9.6", NoFragRule.NUMA_CANDIDATES, 300), ("26.8.3", NoFragRule.MULTI_DEVICE, 100),
            ("26.1.0", NoFragRule.SINGLE_DEVICE, 100)]
# The versions backend.ai-agent 26.9.6 pins (networkx~=3.3.0, more-itertools~=10.5.0).
DEPENDENCIES = [("networkx==3.3", "networkx-3.3-*.whl"), ("more-itertools==10.5.0", "more_itertools-10.5.0-*.whl")]


# --- fetching and preparing the released code ---------------------------------------------------


def _wheel(cache: Path, requirement: str, pattern: str) -> Path:
    return fetch_wheel(cache, requirement, pattern, SKIP_ENV)


_ERRORS = '''class ResourceError(Exception):
    def __init__(self, *args, **kwargs):
        super().__init__(*args)
        self.details = kwargs


class InvalidResourceCombination(ResourceError): pass
class InvalidResourceArgument(ResourceError): pass
class NotMultipleOfQuantum(InvalidResourceArgument): pass
class InsufficientResource(ResourceError): pass
class FractionalResourceFragmented(ResourceError): pass
class ResourceAllocationError(ResourceError): pass
'''

_LOGGING = '''import logging


class BraceStyleAdapter(logging.LoggerAdapter):
    def __init__(self, logger):
        super().__init__(logger, {})
'''


def build_tree(agent: Path, common: Path, deps: Sequence[Path], root: Path) -> None:
    """The released allocator modules under ``root``, runnable on this Python."""
    for dep in deps:
        with zipfile.ZipFile(dep) as z:
            z.extractall(root)
    package = root / "ai" / "backend"
    (package / "agent").mkdir(parents=True)
    (package / "common").mkdir()
    for init in (root / "ai", package, package / "agent", package / "common"):
        (init / "__init__.py").write_text("")
    with zipfile.ZipFile(agent) as z:
        for name in ("alloc_map.py", "affinity_map.py"):
            (package / "agent" / name).write_text(to_py311(z.read(f"ai/backend/agent/{name}").decode()))
    with zipfile.ZipFile(common) as z:
        types = z.read("ai/backend/common/types.py").decode()
        exception = z.read("ai/backend/common/exception.py").decode()
    (package / "common" / "types.py").write_text(extract(
        types, {"DeviceName", "DeviceId", "SlotName", "SlotTypes"},
        "from __future__ import annotations\n\nimport enum\nfrom collections import UserString\nfrom typing import NewType",
    ))
    (package / "common" / "exception.py").write_text(extract(
        exception, {"ConfigurationError"},
        "from __future__ import annotations\n\nfrom collections.abc import Mapping\nfrom typing import Any",
    ))
    (package / "agent" / "errors.py").write_text(_ERRORS)
    # Before 26.4 the same classes came from ``.exception``.
    (package / "agent" / "exception.py").write_text("from .errors import *  # noqa: F403\n")
    (package / "logging.py").write_text(_LOGGING)
    (root / "_typing311.py").write_text(TYPING_SHIM)


def load(root: Path) -> SimpleNamespace:
    """Import the modules under ``root``; leaves nothing of them in ``sys.modules`` or ``sys.path``."""
    before = set(sys.modules)
    sys.path.insert(0, str(root))
    try:
        from ai.backend.agent import affinity_map, alloc_map, errors  # noqa: PLC0415
        from ai.backend.common import types  # noqa: PLC0415

        return SimpleNamespace(
            FractionAllocMap=alloc_map.FractionAllocMap, DeviceSlotInfo=alloc_map.DeviceSlotInfo,
            AffinityMap=affinity_map.AffinityMap, AffinityHint=affinity_map.AffinityHint,
            AffinityPolicy=affinity_map.AffinityPolicy, SlotName=types.SlotName, SlotTypes=types.SlotTypes,
            DeviceId=types.DeviceId, DeviceName=types.DeviceName, errors=errors,
            alloc_map_file=alloc_map.__file__,
        )
    finally:
        sys.path.remove(str(root))
        for name in set(sys.modules) - before:
            if name.split(".")[0] in ("ai", "_typing311", "networkx", "more_itertools"):
                del sys.modules[name]


@pytest.fixture(scope="module")
def wheels_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return wheels_folder(request, tmp_path_factory, WHEELS_ENV, "backendai-agent-wheels")


def released(version: str, wheels: Path, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    agent = _wheel(wheels, f"backend.ai-agent=={version}", f"backend_ai_agent-{version}-*.whl")
    common = _wheel(wheels, "backend.ai-common==26.9.6", "backend_ai_common-26.9.6-*.whl")
    deps = [_wheel(wheels, req, pattern) for req, pattern in DEPENDENCIES]
    root = tmp_path_factory.mktemp(f"agent-{version}")
    build_tree(agent, common, deps, root)
    return load(root)


# --- the agent, called as resources.allocate() calls it ----------------------------------------


@dataclass(frozen=True, eq=False)
class FakeDevice:
    """What AffinityMap reads of a compute device (hashed by identity, as one object per device)."""

    device_id: str
    device_name: str
    numa_node: int | None


@dataclass(frozen=True)
class Node:
    devices: tuple[DeviceFree, ...]
    quantum: Decimal
    affinity: AffinityPolicy


class Agent:
    """One node's FractionAllocMap (``cuda.shares``, the mock plugin's slot type and exclusive
    slots), a fresh map and hint per allocation unless a sequence is being replayed."""

    def __init__(self, ns: SimpleNamespace, node: Node) -> None:
        self.ns, self.node = ns, node
        self.slot = ns.SlotName(SLOT)
        devices = [FakeDevice(d.device_id, ns.DeviceName("cuda"), d.numa_node) for d in node.devices]
        self.affinity_map = ns.AffinityMap.build(devices)
        # The clusters are a function of the graph alone, which nothing changes: computed once
        # (networkx would otherwise dominate the run), the very lists the agent would compute.
        clusters = self.affinity_map.get_device_clusters_with_lowest_distance(ns.DeviceName("cuda"))
        self.affinity_map.get_device_clusters_with_lowest_distance = lambda device_name: clusters
        self.policy = ns.AffinityPolicy[node.affinity.value]

    def fresh_map(self, devices: Sequence[DeviceFree]) -> object:
        info = {self.ns.DeviceId(d.device_id): self.ns.DeviceSlotInfo(self.ns.SlotTypes.COUNT, self.slot, d.capacity)
                for d in devices}
        amap = self.ns.FractionAllocMap(device_slots=info, quantum_size=self.node.quantum,
                                        exclusive_slot_types={"cuda.device:*-mig", "cuda.device", "cuda.shares"})
        amap.apply_allocation({self.slot: {self.ns.DeviceId(d.device_id): d.allocated for d in devices}})
        return amap

    def allocate(self, amount: Decimal, guarded: bool, amap: object | None = None) -> dict[str, Decimal] | str:
        """The per-device amounts, or which error the agent raised."""
        amap = amap or self.fresh_map(self.node.devices)
        hint = self.ns.AffinityHint(None, self.affinity_map, self.policy)
        errors = self.ns.errors
        try:
            result = amap.allocate({self.slot: amount}, affinity_hint=hint, allow_resource_fragmentation=not guarded)
        except errors.FractionalResourceFragmented:
            return "fragmented"
        except errors.NotMultipleOfQuantum:
            return "below-quantum"
        except errors.InsufficientResource:
            return "insufficient"
        return {str(dev): value for dev, value in result[self.slot].items() if value != 0}

    def headroom(self, guarded: bool) -> Decimal:
        """The largest multiple of the quantum the agent places in full: every size tried from
        above the free total down (the sizes that fit have gaps, so no bisection)."""
        q = self.node.quantum
        size = round_down(sum((d.free for d in self.node.devices if d.free > 0), D(0)), q) + 2 * q
        amap = self.fresh_map(self.node.devices)
        chain = amap.get_current_allocations(self.ns.AffinityHint(None, self.affinity_map, self.policy), self.slot)
        while size > 0:
            if guarded:
                # The agent's own guard on the list allocate() would give it, before the whole
                # allocation: most sizes stop there.
                try:
                    amap.ensure_slot_not_fragmented(self.slot, chain, size)
                except self.ns.errors.FractionalResourceFragmented:
                    size -= q
                    continue
            result = self.allocate(size, guarded)
            if isinstance(result, dict) and sum(result.values(), D(0)) == size:
                return size
            size -= q
        return D(0)

    def count(self, amount: Decimal, guarded: bool, limit: int) -> int:
        """How many requests of ``amount`` the agent places one after another on one map."""
        amap = self.fresh_map(self.node.devices)
        placed = 0
        while placed < limit and isinstance(self.allocate(amount, guarded, amap), dict):
            placed += 1
        return placed


# --- random nodes ------------------------------------------------------------------------------

CAPACITIES = [D("13.5"), D("10"), D("16.5"), D("8"), D("4.25"), D("20"), D("12.31")]  # fGPU shares per device
QUANTA = [D("0.01"), D("0.05"), D("0.1"), D("0.25")]


def _hundredths(rng: random.Random, low: Decimal, high: Decimal) -> Decimal:
    return D(rng.randint(int(low * 100), int(high * 100))) / 100


def random_node(rng: random.Random, index: int) -> Node:
    count = rng.randint(1, 8)
    nodes = rng.choice([1, 2, 2, 3, 4])
    layout = rng.choice(["blocks", "alternate", "random", "unknown"])
    numa: list[int | None]
    if layout == "blocks":
        numa = sorted(rng.randrange(nodes) for _ in range(count))
    elif layout == "alternate":
        numa = [i % nodes for i in range(count)]
    elif layout == "random":
        numa = [rng.randrange(nodes) for _ in range(count)]
    else:
        numa = [None] * count
    if rng.random() < 0.5:
        capacities = [rng.choice(CAPACITIES)] * count
    else:
        capacities = [rng.choice(CAPACITIES) for _ in range(count)]
    quantum = rng.choice(QUANTA)
    devices = []
    for i, (capacity, node) in enumerate(zip(capacities, numa, strict=True)):
        pick = rng.random()
        if pick < 0.2:
            allocated = D(0)
        elif pick < 0.3:
            allocated = capacity
        elif pick < 0.35:
            allocated = capacity + D("0.5")  # overcommitted (multi-agent shared mode)
        elif pick < 0.5:
            allocated = round_down(_hundredths(rng, D(0), capacity), quantum)
        else:
            allocated = _hundredths(rng, D(0), capacity)
        devices.append(DeviceFree(f"GPU-{index}-{i}", capacity, allocated, node))
    affinity = rng.choice(list(AffinityPolicy))
    return Node(tuple(devices), quantum, affinity)


def _fixed(quantum: str, *rows: tuple[str, str, int | None]) -> Node:
    """A node of devices given as (capacity, free, NUMA node)."""
    devices = tuple(DeviceFree(f"fixed-{i}", D(c), D(c) - D(f), n) for i, (c, f, n) in enumerate(rows))
    return Node(devices, D(quantum), AffinityPolicy.INTERLEAVED)


# Hand-made nodes first: the guard's capacity from the least-allocated NUMA node (12.8 is placed
# as 4.3 + 4.2 + 4.3), a chain the 26.4 allocator overfills, a tie between a NUMA node and all
# devices, a request that fits on a device other than the chain's first.
FIXED = [
    _fixed("0.1", ("13.5", "7.5", 0), ("10", "4.2", 0), ("10", "4.9", 1)),
    _fixed("0.01", ("10", "5", 0), ("10", "8", 1), ("10", "1", 1)),
    _fixed("0.01", ("10", "4", 1), ("10", "4", 0), ("10", "4", 0), ("10", "4", 1), ("10", "5", 1)),
    _fixed("0.1", ("10", "3", 0), ("10", "10", 1), ("10", "2.5", 1)),
]


def requests(rng: random.Random, node: Node) -> Iterator[Decimal]:
    """Sizes around the interesting edges: free pieces, capacities, sums, and random ones."""
    frees = [d.free for d in node.devices if d.free > 0]
    total = sum((d.capacity for d in node.devices), D(0))
    sizes = {_hundredths(rng, D("0.01"), total + 1) for _ in range(4)}
    sizes |= {round_down(_hundredths(rng, D("0.01"), total), node.quantum) for _ in range(2)}
    for edge in [*frees[:3], max(frees, default=D(0)), sum(frees, D(0)), node.devices[0].capacity]:
        sizes |= {edge, edge + D("0.01"), edge - node.quantum}
    yield from sorted(s for s in sizes if s >= D("0.01"))


def exporter_result(node: Node, amount: Decimal, guarded: bool, rule: NoFragRule) -> dict[str, Decimal] | str:
    policy = Policy.EVENLY_NOFRAG if guarded else Policy.EVENLY
    result = place(node.devices, Request(SLOT, amount), policy, quantum=node.quantum, rule=rule, affinity=node.affinity)
    return dict(result.amounts) if isinstance(result, Placement) else result.reason


def show(node: Node) -> str:
    rows = ", ".join(f"{d.device_id}@{d.numa_node}:{d.allocated}/{d.capacity}" for d in node.devices)
    return f"[{rows}] q={node.quantum} {node.affinity.value}"


# --- the comparison ----------------------------------------------------------------------------


@pytest.mark.parametrize(("version", "rule", "count"), RELEASES, ids=[r[0] for r in RELEASES])
def test_placement_and_headroom_agree_with_the_released_agent(
    version: str, rule: NoFragRule, count: int, wheels_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    ns = released(version, wheels_dir, tmp_path_factory)
    rng = random.Random(f"{SEED}-{version}")
    tally = {"verdicts": 0, "placed": 0, "headroom": 0, "sequences": 0}
    mismatches: list[str] = []
    if rule is NoFragRule.NUMA_CANDIDATES:
        expected = {"fixed-0": D("4.3"), "fixed-1": D("4.2"), "fixed-2": D("4.3")}
        assert Agent(ns, FIXED[0]).allocate(D("12.8"), guarded=True) == expected
    for index in range(count):
        node = FIXED[index] if index < len(FIXED) else random_node(rng, index)
        agent = Agent(ns, node)
        for guarded in (False, True):
            for amount in requests(rng, node):
                theirs, ours = agent.allocate(amount, guarded), exporter_result(node, amount, guarded, rule)
                tally["verdicts"] += 1
                tally["placed"] += isinstance(theirs, dict)
                if theirs != ours:
                    mismatches.append(f"{show(node)} R={amount} guarded={guarded}: agent {theirs}, exporter {ours}")
            theirs_room = agent.headroom(guarded)
            ours_room = headroom(node.devices, node.quantum, rule, guarded=guarded, affinity=node.affinity)
            tally["headroom"] += 1
            if theirs_room != ours_room:
                mismatches.append(f"{show(node)} headroom guarded={guarded}: agent {theirs_room}, exporter {ours_room}")
            # Sequences start from allocations in whole quanta, as the agent's own allocations are: its
            # in-memory map rounds a device's total down to the quantum after each allocation.
            whole = Node(tuple(replace(d, allocated=round_down(d.allocated, node.quantum)) for d in node.devices),
                         node.quantum, node.affinity)
            size = rng.choice([D("0.5"), D(1), D(2), D(4), whole.devices[0].capacity / 2]).quantize(D("0.01"))
            theirs_n = Agent(ns, whole).count(size, guarded, limit=40)
            policy = Policy.EVENLY_NOFRAG if guarded else Policy.EVENLY
            ours_n = count_fits(whole.devices, Request(SLOT, size), policy, quantum=whole.quantum, rule=rule,
                                affinity=whole.affinity, limit=40)
            tally["sequences"] += 1
            if theirs_n != ours_n:
                mismatches.append(f"{show(whole)} R={size} guarded={guarded} one after another: agent {theirs_n}, exporter {ours_n}")
    print(f"\nagent {version} ({ns.alloc_map_file}), seed {SEED}, {count} nodes: {tally['verdicts']} verdicts "
          f"({tally['placed']} placed, per-device amounts compared), {tally['headroom']} headroom figures, "
          f"{tally['sequences']} request-fits sequences; {len(mismatches)} disagreements")
    assert not mismatches, f"{len(mismatches)} disagreements with agent {version}:\n" + "\n".join(mismatches[:15])
