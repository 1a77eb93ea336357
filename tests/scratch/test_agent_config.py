"""agent.toml as the agent reads it: ids, scratch roots, backends, [[agents]], allocation modes."""

from __future__ import annotations

from decimal import Decimal

import pytest

from exporter.analysis.capacity import agent_slot_total
from exporter.scratch.agent_config import AgentConfigError, AgentEntry, derived_agent_id, parse_agent_config

SINGLE = """
[agent]
id = "i-gpu-node01"
backend = "docker"
[container]
scratch-type = "hostdir"
scratch-root = "/var/lib/backend.ai/scratches"
"""

MULTI = """
[agent]
backend = "docker"
rpc-listen-addr = { host = "0.0.0.0", port = 6001 }
[container]
scratch-root = "/var/lib/backend.ai/scratches"
[resource]
allocation-mode = "manual"
[resource.allocations]
cpu = 4
mem = "16g"

[[agents]]
[agents.agent]
id = "i-node01-a"
[agents.resource]
cpu = 8
devices = { "cuda.shares" = "20" }

[[agents]]
[agents.agent]
id = "i-node01-b"
[agents.container]
scratch-root = "/data/scratches-b"
[agents.resource]
devices = { "cuda.shares" = 7.5 }
"""


def test_a_single_agent() -> None:
    cfg = parse_agent_config(SINGLE, "/etc/backend.ai/agent.toml")
    assert cfg.agents == (AgentEntry("i-gpu-node01", "/var/lib/backend.ai/scratches"),)
    assert not cfg.multi_agent and cfg.allocation_mode == "shared"


def test_every_agents_entry_with_its_own_or_the_shared_scratch_root() -> None:
    cfg = parse_agent_config(MULTI)
    assert [(a.agent_id, a.scratch_root) for a in cfg.agents] == [
        ("i-node01-a", "/var/lib/backend.ai/scratches"),
        ("i-node01-b", "/data/scratches-b"),
    ]
    assert cfg.multi_agent and cfg.allocation_mode == "manual"
    assert dict(cfg.agents[0].allocations) == {"cpu": Decimal(8), "mem": Decimal(16 << 30), "cuda.shares": Decimal(20)}
    assert dict(cfg.agents[1].allocations) == {"cpu": Decimal(4), "mem": Decimal(16 << 30), "cuda.shares": Decimal("7.5")}
    assert cfg.roots() == {"/var/lib/backend.ai/scratches": ("i-node01-a",), "/data/scratches-b": ("i-node01-b",)}


def test_agents_sharing_the_default_root() -> None:
    text = '[container]\nscratch-root = "/s"\n[[agents]]\nagent = { id = "a" }\n[[agents]]\nagent = { id = "b" }\n'
    assert parse_agent_config(text).roots() == {"/s": ("a", "b")}


def test_an_unset_id_is_derived_as_the_agent_does_off_a_cloud() -> None:
    cfg = parse_agent_config('[container]\nscratch_root = "/s"\n[agent]\nmode = "kubernetes"\n')
    assert cfg.agents[0].agent_id is None and cfg.agents[0].backend == "kubernetes"
    assert cfg.with_default_ids("gpu-node07").agents[0].agent_id == "i-gpu-node07" == derived_agent_id("gpu-node07")


def test_the_default_relative_root_needs_the_agents_working_directory() -> None:
    with pytest.raises(AgentConfigError, match="relative to the agent's working directory"):
        parse_agent_config("[agent]\nid = 'x'\n", "/etc/backend.ai/agent.toml")
    cfg = parse_agent_config("[agent]\nid = 'x'\n", working_dir="/opt/backend.ai")
    assert cfg.agents[0].scratch_root == "/opt/backend.ai/scratches"


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("[agent\n", "not valid TOML"),
        ("agent = 3\n", "[agent] must be a table"),
        ('[resource]\nallocation-mode = "split"\n[container]\nscratch-root="/s"\n', "allocation-mode must be one of"),
        ('[agent]\nbackend = "podman"\n[container]\nscratch-root="/s"\n', "backend must be one of"),
        ('[container]\nscratch-root = 5\n', "scratch-root must be a string"),
        ('[container]\nscratch-root="/s"\n[[agents]]\n[agents.container]\nscratch-root="/t"\n', "has no agent id"),
        ('[container]\nscratch-root="/s"\n[[agents]]\nagent={id="a"}\n[[agents]]\nagent={id="a"}\n', "repeats agent id 'a'"),
        ('[container]\nscratch-root="/s"\n[resource]\nallocation-mode="manual"\n[resource.allocations]\ncpu="lots"\n', "allocation of 'cpu'"),
    ],
)
def test_bad_files_name_the_file_and_reason(text: str, reason: str) -> None:
    with pytest.raises(AgentConfigError) as info:
        parse_agent_config(text, "/etc/backend.ai/agent.toml")
    assert str(info.value).startswith("/etc/backend.ai/agent.toml: ")
    assert reason in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("mode", "slot", "total", "agents", "index", "manual", "expected"),
    [
        ("shared", "cuda.shares", Decimal(54), 2, 1, None, Decimal(54)),
        ("auto-split", "cuda.shares", Decimal(54), 4, 0, None, Decimal("13.5")),
        ("auto-split", "cuda.device", Decimal(7), 3, 0, None, Decimal(3)),
        ("auto-split", "cuda.device", Decimal(7), 3, 2, None, Decimal(2)),
        ("manual", "cuda.shares", Decimal(54), 2, 0, Decimal(20), Decimal(20)),
        ("auto-split", "cuda.shares", Decimal(54), 1, 0, None, Decimal(54)),
    ],
)
def test_each_agent_offers_its_share_of_a_slot(mode, slot, total, agents, index, manual, expected) -> None:
    assert agent_slot_total(mode, slot, total, agents, index, manual) == expected


def test_manual_mode_needs_an_amount() -> None:
    with pytest.raises(ValueError, match="without an amount"):
        agent_slot_total("manual", "cuda.shares", Decimal(1), 2, 0)
