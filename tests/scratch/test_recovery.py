"""recovery.json: identity of a kernel, tolerant of the agent's non-atomic rewrites."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import FIXTURES
from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.scratch.recovery import Recovery, parse_recovery

SAMPLES = FIXTURES / "recovery"


def test_an_interactive_session_with_an_owner() -> None:
    assert parse_recovery((SAMPLES / "interactive.json").read_text()) == Recovery(
        kernel_id="3f6c2b1e-8a4d-4c2e-9b7a-1d2e3f4a5b6c",
        session_id="b0a4e7c2-5d1f-4e6a-8c3b-2f9d7e1a6b4c",
        owner_user_id="f38dea23-50fa-42a0-b5ae-338f5f4693f4",
        agent_id="i-gpu-node01",
        session_type="interactive",
    )


def test_a_batch_session_without_an_owner() -> None:
    r = parse_recovery((SAMPLES / "batch-no-owner.json").read_text())
    assert r is not None and r.owner_user_id is None and r.session_type == "batch"
    assert r.session_id == "4c8e2a6f-1b3d-4f5a-9e7c-0d2b4f6a8c1e"


@pytest.mark.parametrize("name", ["left-by-cleanup-race.json", "torn-write.json"])
def test_torn_and_empty_files_are_not_yet_usable(name: str) -> None:
    assert parse_recovery((SAMPLES / name).read_text()) is None


def test_the_record_is_immutable() -> None:
    r = parse_recovery((SAMPLES / "interactive.json").read_text())
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.agent_id = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"id":"3F6C2B1E-8A4D-4C2E-9B7A-1D2E3F4A5B6C"}', Recovery("3f6c2b1e-8a4d-4c2e-9b7a-1d2e3f4a5b6c", None, None, None, None)),
        ('{"ownership_data":{"kernel_id":"3f6c2b1e-8a4d-4c2e-9b7a-1d2e3f4a5b6c","agent_id":"i-a"}}',
         Recovery("3f6c2b1e-8a4d-4c2e-9b7a-1d2e3f4a5b6c", None, None, "i-a", None)),
        ('{"id":"not-a-uuid"}', None),
        ('[1,2]', None),
        ('{"id":"3f6c2b1e-8a4d-4c2e-9b7a-1d2e3f4a5b6c","agent_id":"bad id\\n","session_type":"weird"}',
         Recovery("3f6c2b1e-8a4d-4c2e-9b7a-1d2e3f4a5b6c", None, None, None, None)),
    ],
)
def test_values_that_are_not_ids_are_left_out(text: str, expected: Recovery | None) -> None:
    assert parse_recovery(text) == expected


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=800))
def test_every_prefix_of_a_rewrite_is_none_or_the_full_record(cut: int) -> None:
    text = (SAMPLES / "interactive.json").read_text()
    full = parse_recovery(text)
    assert parse_recovery(text[:cut]) in (None, full)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_any_text_gives_a_record_or_none(text: str) -> None:
    assert parse_recovery(text) is None or isinstance(parse_recovery(text), Recovery)
