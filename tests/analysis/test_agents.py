"""The agent layout: flags and agent.toml resolved into the host's agents, roots and bindings."""

from __future__ import annotations

from decimal import Decimal

import pytest

from exporter.analysis.agents import agent_headroom, agent_views
from exporter.analysis.capacity import GpuInventory
from exporter.analysis.node import HeadroomParams, Inventory, node_state
from exporter.config import agent_layout as resolve_agent_layout
from exporter.scratch.allocation import AllocationBook
from exporter.scratch.identity import Identity
from exporter.scratch.resources import parse_resource
from exporter.settings import ConfigError, Settings

MULTI = """
[resource]
allocation-mode = "auto-split"
[container]
scratch-root = "/var/lib/backend.ai/scratches"
[[agents]]
[agents.agent]
id = "i-node01-a"
[[agents]]
[agents.agent]
id = "i-node01-b"
[agents.container]
scratch-root = "/data/scratches-b"
"""
SHARED = """
[container]
scratch-root = "/srv/scratches"
[[agents]]
agent = { id = "a1" }
[[agents]]
agent = { id = "a2" }
"""
SINGLE_NO_ID = '[container]\nscratch-root = "/srv/scratches"\n'


def settings(**flags) -> Settings:
    return Settings.load(flags)


def test_no_agent_toml_and_no_flags_is_the_default_root_and_no_agent() -> None:
    layout = resolve_agent_layout(settings(), None, None, "node01")
    assert layout.roots == ("/var/lib/backend.ai/scratches",)
    assert layout.agents == () and not layout.multi_agent and layout.default_agent_id is None


def test_agent_toml_with_agents_gives_roots_ids_bindings_and_mode() -> None:
    layout = resolve_agent_layout(settings(), MULTI, "/etc/backend.ai/agent.toml", "node01")
    assert layout.roots == ("/var/lib/backend.ai/scratches", "/data/scratches-b")
    assert layout.agents == ("i-node01-a", "i-node01-b") and layout.multi_agent
    assert dict(layout.bindings) == {"/var/lib/backend.ai/scratches": "i-node01-a", "/data/scratches-b": "i-node01-b"}
    assert layout.allocation_mode == "auto-split" and layout.source == "/etc/backend.ai/agent.toml"


def test_a_shared_root_is_bound_to_no_agent() -> None:
    layout = resolve_agent_layout(settings(), SHARED, "agent.toml", "node01")
    assert layout.roots == ("/srv/scratches",) and layout.agents == ("a1", "a2") and dict(layout.bindings) == {}
    assert layout.roots_of("a1") == ("/srv/scratches",)


def test_an_agent_without_id_takes_i_hostname() -> None:
    layout = resolve_agent_layout(settings(), SINGLE_NO_ID, "agent.toml", "gpu-node07")
    assert layout.agents == ("i-gpu-node07",) and layout.default_agent_id == "i-gpu-node07"
    assert dict(layout.bindings) == {"/srv/scratches": "i-gpu-node07"}


def test_flags_win_over_agent_toml() -> None:
    # --scratch.root replaces agent.toml's roots; its agents keep their ids.
    layout = resolve_agent_layout(settings(scratch_roots=["/mnt/s"]), MULTI, "agent.toml", "n")
    assert layout.roots == ("/mnt/s",) and layout.agents == ("i-node01-a", "i-node01-b") and dict(layout.bindings) == {}
    # --agent.id replaces a single agent's id.
    layout = resolve_agent_layout(settings(agent_id="i-cloud-1"), SINGLE_NO_ID, "agent.toml", "n")
    assert layout.agents == ("i-cloud-1",) and layout.roots == ("/srv/scratches",)
    # --scratch.agent replaces [[agents]], the mode stays agent.toml's.
    layout = resolve_agent_layout(settings(scratch_agents=["/x=A", "/y=B"]), MULTI, "agent.toml", "n")
    assert layout.roots == ("/x", "/y") and layout.agents == ("A", "B") and layout.allocation_mode == "auto-split"
    assert dict(layout.bindings) == {"/x": "A", "/y": "B"}


def test_scratch_agent_without_agent_toml() -> None:
    layout = resolve_agent_layout(settings(scratch_agents=["/x=A", "/x=B"]), None, None, "n")
    assert layout.roots == ("/x",) and layout.agents == ("A", "B") and dict(layout.bindings) == {}


@pytest.mark.parametrize(
    ("flags", "text", "message"),
    [
        ({"agent_id": "solo"}, MULTI, "--agent.id names one agent but agent.toml names 2"),
        ({"scratch_agents": ["relative=A"]}, None, "--scratch.agent root 'relative' must be an absolute path"),
        ({"scratch_agents": ["/x"]}, None, "--scratch.agent expects ROOT=AGENT_ID"),
        ({}, "[agent\n", "agent.toml: not valid TOML"),
        ({}, '[resource]\nallocation-mode = "split"\n', "agent.toml: [resource] allocation-mode must be one of"),
    ],
)
def test_unusable_input_is_a_one_line_config_error(flags, text, message) -> None:
    with pytest.raises(ConfigError) as exc:
        resolve_agent_layout(settings(**flags), text, "agent.toml", "n")
    assert message in str(exc.value) and "\n" not in str(exc.value)


def _spec(slots: str):
    return parse_resource(f"SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={{}}\n{slots}\n", "resource.txt")


def test_a_shared_root_is_split_by_recovery_json_and_bound_roots_by_root() -> None:
    book = AllocationBook(lambda: 0.0)
    k1, k2, k3, k4 = (f"{i}0000000-0000-4000-8000-000000000000" for i in range(1, 5))
    book.apply(k1, "/srv/scratches", _spec("CUDA.SHARES_SHARES=GPU-0:0.5"))
    book.apply(k2, "/srv/scratches", _spec("CUDA.SHARES_SHARES=GPU-0:0.25,GPU-1:1"))
    book.apply(k3, "/srv/scratches", _spec("CUDA.SHARES_SHARES=GPU-1:2"))  # no recovery.json yet
    book.apply(k4, "/data/b", _spec("CUDA.SHARES_SHARES=GPU-1:0.5"))
    sess = "b0a4e7c2-5d1f-4e6a-8c3b-2f9d7e1a6b4c"
    book.set_identity(k1, Identity(k1, sess, agent_id="a1"))
    book.set_identity(k2, Identity(k2, sess, agent_id="a2"))
    layout = resolve_agent_layout(settings(scratch_agents=["/srv/scratches=a1", "/srv/scratches=a2", "/data/b=a2"]), None, None, "n")
    views = agent_views(book.view(), layout)
    assert set(views) == {"a1", "a2"}
    assert dict(views["a1"].alloc_map) == {"GPU-0": "0.5"}
    assert dict(views["a2"].alloc_map) == {"GPU-0": "0.25", "GPU-1": "1.5"}
    assert k3 not in views["a1"].kernels and k3 not in views["a2"].kernels
    assert dict(book.view().alloc_map) == {"GPU-0": "0.75", "GPU-1": "3.5"}  # the node still sums all


def test_each_agent_keeps_every_device_whole_and_the_mode_splits_its_total() -> None:
    book = AllocationBook(lambda: 0.0)
    k1 = "10000000-0000-4000-8000-000000000000"
    book.apply(k1, "/a", _spec("CUDA.SHARES_SHARES=GPU-0:10"))
    layout = resolve_agent_layout(settings(scratch_agents=["/a=A", "/b=B"]), '[resource]\nallocation-mode = "auto-split"\n', "agent.toml", "n")
    inventory = Inventory(gpus=(GpuInventory("GPU-0", 80 << 30, 108), GpuInventory("GPU-1", 80 << 30, 108)))
    params = HeadroomParams(mode="fractional")
    whole = node_state(book.view(), inventory, params)
    views = agent_views(book.view(), layout)
    a = agent_headroom(whole, node_state(views["A"], inventory, params), layout, "A")["cuda.shares"]
    b = agent_headroom(whole, node_state(views["B"], inventory, params), layout, "B")["cuda.shares"]
    # 2 × 13.5 shares on the node; auto-split reports 13.5 to each agent.
    assert a.total == b.total == Decimal("13.5")
    assert a.allocated == Decimal(10) and a.headroom == Decimal("3.5")  # bounded by its total
    assert b.allocated == 0 and b.headroom == Decimal("13.5")  # its own map has GPU-0 free


def test_the_affinity_policy_of_agent_toml_reaches_headroom(tmp_path) -> None:
    from exporter.analysis.placement import AffinityPolicy
    from exporter.config import resolve

    toml = tmp_path / "agent.toml"
    toml.write_text('[container]\nscratch-root = "/srv/s"\n[resource]\naffinity-policy = "prefer_single_node"\n')
    config = resolve(settings(), agent_config=toml, hostname="n")
    assert config.layout.affinity_policy == "PREFER_SINGLE_NODE"
    assert config.headroom.affinity is AffinityPolicy.PREFER_SINGLE_NODE
    toml.write_text('[container]\nscratch-root = "/srv/s"\n')
    assert resolve(settings(), agent_config=toml, hostname="n").headroom.affinity is AffinityPolicy.INTERLEAVED
    toml.write_text('[container]\nscratch-root = "/srv/s"\n[resource]\naffinity-policy = "closest"\n')
    with pytest.raises(ConfigError, match=r"agent.toml: \[resource\] affinity-policy must be one of INTERLEAVED, PREFER_SINGLE_NODE"):
        resolve(settings(), agent_config=toml, hostname="n")


def _aliased(tmp_path) -> tuple[str, str]:
    root = tmp_path / "scratches"
    root.mkdir()
    (tmp_path / "scratches-link").symlink_to(root)
    return str(root), str(tmp_path / "scratches-link")


def _alias_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "same directory" in r.getMessage()]


def test_agents_naming_one_root_through_a_symlink_share_it(tmp_path, caplog) -> None:
    """Two spellings of one directory are one root shared by both agents (its kernels split by
    recovery.json), not two roots each crediting every kernel to its agent."""
    root, link = _aliased(tmp_path)
    text = f'[[agents]]\nagent = {{ id = "a1" }}\ncontainer = {{ scratch-root = "{root}" }}\n' \
           f'[[agents]]\nagent = {{ id = "a2" }}\ncontainer = {{ scratch-root = "{link}" }}\n'
    layout = resolve_agent_layout(settings(), text, "agent.toml", "n")
    assert layout.roots == (root,) and layout.agents == ("a1", "a2") and dict(layout.bindings) == {}
    assert _alias_warnings(caplog) == [f"scratch roots {root} and {link} are the same directory; "
                                       f"read once as {root}, shared by the agents naming either"]
    book = AllocationBook(lambda: 0.0)
    k1, k2 = (f"{i}0000000-0000-4000-8000-000000000000" for i in range(1, 3))
    book.apply(k1, root, _spec("CUDA.SHARES_SHARES=GPU-0:0.5"))
    book.apply(k2, root, _spec("CUDA.SHARES_SHARES=GPU-0:0.25"))
    sess = "b0a4e7c2-5d1f-4e6a-8c3b-2f9d7e1a6b4c"
    book.set_identity(k1, Identity(k1, sess, agent_id="a1"))
    book.set_identity(k2, Identity(k2, sess, agent_id="a2"))
    views = agent_views(book.view(), layout)
    assert dict(views["a1"].alloc_map) == {"GPU-0": "0.5"} and dict(views["a2"].alloc_map) == {"GPU-0": "0.25"}


def test_one_root_given_twice_by_flag_is_read_once(tmp_path, caplog) -> None:
    root, link = _aliased(tmp_path)
    dotted = str(tmp_path / "scratches" / ".." / "scratches")
    layout = resolve_agent_layout(settings(scratch_roots=[root, link, dotted]), None, None, "n")
    assert layout.roots == (root,)
    assert len(_alias_warnings(caplog)) == 2 and all(root in w for w in _alias_warnings(caplog))
    caplog.clear()
    layout = resolve_agent_layout(settings(scratch_agents=[f"{root}=A", f"{link}=B"]), None, None, "n")
    assert layout.roots == (root,) and layout.agents == ("A", "B") and dict(layout.bindings) == {}
    assert len(_alias_warnings(caplog)) == 1
    # A flag's root that is agent.toml's under another name: the flag wins, nothing to warn of.
    caplog.clear()
    layout = resolve_agent_layout(settings(scratch_roots=[link]), f'[agent]\nid = "a"\n[container]\nscratch-root = "{root}"\n', "agent.toml", "n")
    assert layout.roots == (link,) and dict(layout.bindings) == {link: "a"} and not _alias_warnings(caplog)
    # Distinct directories, and ones that do not exist yet, stay apart without a word.
    caplog.clear()
    other = tmp_path / "other"
    other.mkdir()
    layout = resolve_agent_layout(settings(scratch_agents=[f"{root}=A", f"{other}=B", f"{tmp_path}/later=C"]), None, None, "n")
    assert layout.roots == (root, str(other), f"{tmp_path}/later") and not _alias_warnings(caplog)
    assert dict(layout.bindings) == {root: "A", str(other): "B", f"{tmp_path}/later": "C"}
