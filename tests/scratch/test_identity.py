"""recovery.json → Identity: upstream's samples, torn and empty files, label value formats, hostile
input; the reader's safety rules; and the watcher picking identity up late, through a storm of
rewrites, without re-reading resource.txt or replacing unchanged kernels."""

from __future__ import annotations

import json
import os
from decimal import Decimal
from pathlib import Path

import pytest
from helpers import FIXTURES, wait_for
from hypothesis import given
from hypothesis import strategies as st

from exporter.demo import recovery_json, write_kernel, write_recovery
from exporter.scratch import reader as reader_module
from exporter.scratch.allocation import AllocationBook
from exporter.scratch.identity import UNDEFINED, Identity, identity_from_labels, parse_recovery
from exporter.scratch.reader import Scanner, read_identity
from exporter.scratch.watcher import ScratchWatcher

SAMPLES = FIXTURES / "recovery"  # copies of the agent-schema samples
KID = "3f6c2b1e-8a4d-4c2e-9b7a-1d2e3f4a5b6c"
SID = "b0a4e7c2-5d1f-4e6a-8c3b-2f9d7e1a6b4c"
UID = "f38dea23-50fa-42a0-b5ae-338f5f4693f4"
# The same documents inline, so the tests do not depend on a checkout of the shared samples.
INTERACTIVE = recovery_json(KID, SID, UID, agent_id="i-gpu-node01")
BATCH_NO_OWNER = recovery_json("9e1d7c3a-2b4f-4a6e-8d5c-7f0a1b2c3d4e", "4c8e2a6f-1b3d-4f5a-9e7c-0d2b4f6a8c1e", None,
                               agent_id="i-gpu-node01", session_type="batch")


def test_an_interactive_session_with_an_owner() -> None:
    assert parse_recovery(INTERACTIVE) == Identity(KID, SID, UID, UNDEFINED, "i-gpu-node01", "interactive")


def test_a_null_owner_is_undefined_as_in_backendai_labels() -> None:
    identity = parse_recovery(BATCH_NO_OWNER)
    assert identity.user_id == UNDEFINED and identity.project_id == UNDEFINED and identity.session_type == "batch"
    assert identity.known


@pytest.mark.parametrize("text", ["{}", INTERACTIVE[:163], INTERACTIVE[:-1], "", "null", "[]", '"x"', "{" * 100_000,
                                  '{"id": "not-a-uuid", "ownership_data": {"session_id": "x"}}',
                                  json.dumps({"id": KID, "ownership_data": None})])
def test_torn_empty_and_shapeless_files_give_nothing(text: str) -> None:
    assert parse_recovery(text) is None


def test_upstream_samples() -> None:
    assert parse_recovery((SAMPLES / "interactive.json").read_text()).user_id == UID
    assert parse_recovery((SAMPLES / "batch-no-owner.json").read_text()).user_id == UNDEFINED
    assert parse_recovery((SAMPLES / "left-by-cleanup-race.json").read_text()) is None
    assert parse_recovery((SAMPLES / "torn-write.json").read_text()) is None


def test_values_are_spelled_as_backendai_spells_its_labels() -> None:
    doc = json.loads(INTERACTIVE)
    doc["ownership_data"]["session_id"] = SID.upper()
    doc["ownership_data"]["owner_user_id"] = UID.replace("-", "")  # hex without hyphens
    doc["session_type"] = "INTERACTIVE"
    identity = parse_recovery(json.dumps(doc))
    assert (identity.session_id, identity.user_id, identity.session_type) == (SID, UID, "interactive")


@pytest.mark.parametrize(("field", "value"), [("owner_user_id", "alice"), ("owner_user_id", 42), ("agent_id", "i-a\nb"),
                                              ("agent_id", "x" * 300), ("agent_id", "")])
def test_values_that_cannot_be_labels_are_undefined(field: str, value) -> None:
    doc = json.loads(INTERACTIVE)
    doc["ownership_data"][field] = value
    doc["agent_id"] = None
    identity = parse_recovery(json.dumps(doc))
    assert getattr(identity, "user_id" if field == "owner_user_id" else "agent_id") == UNDEFINED


@given(st.text(max_size=300))
def test_any_text_parses_or_gives_nothing(text: str) -> None:
    identity = parse_recovery(text)
    assert identity is None or identity.known


@given(st.integers(min_value=0, max_value=len(INTERACTIVE)))
def test_every_prefix_of_a_write_is_either_nothing_or_the_whole_identity(cut: int) -> None:
    assert parse_recovery(INTERACTIVE[:cut]) in (None, parse_recovery(INTERACTIVE))


def test_docker_labels() -> None:
    labels = {"ai.backend.kernel-id": KID, "ai.backend.session-id": SID, "ai.backend.owner-user-id": UID,
              "ai.backend.agent-id": "i-gpu-node01", "ai.backend.session-type": "batch", "com.example": "x"}
    assert identity_from_labels(labels) == Identity(KID, SID, UID, UNDEFINED, "i-gpu-node01", "batch")
    assert identity_from_labels({"ai.backend.kernel-id": KID}) is None


# -- the reader ---------------------------------------------------------------------------------


def _kernel(root: Path, kid: str = KID) -> Path:
    write_kernel(root, kid, {"cuda.shares": {"GPU-a": Decimal("0.5")}})
    return root / kid / "config"


def test_reader_reads_only_recovery_json(tmp_path: Path) -> None:
    config = _kernel(tmp_path)
    (config / "recovery.json").write_text(INTERACTIVE)
    for secret in ("environ.txt", "environ_base.txt", "kconfig.dat", "cluster.json", "docker-creds.json"):
        (config / secret).write_text("SECRET")
        os.chmod(config / secret, 0)  # root reads through mode bits; the point is that nothing opens them
    assert read_identity(str(tmp_path), KID).session_id == SID


def test_reader_refuses_symlinks_out_of_the_root_fifos_and_other_kernels_files(tmp_path: Path) -> None:
    root = tmp_path / "root"
    config = _kernel(root)
    outside = tmp_path / "outside.json"
    outside.write_text(INTERACTIVE)
    (config / "recovery.json").symlink_to(outside)
    assert read_identity(str(root), KID) is None
    (config / "recovery.json").unlink()
    os.mkfifo(config / "recovery.json")  # must not block
    assert read_identity(str(root), KID) is None
    (config / "recovery.json").unlink()
    (config / "recovery.json").write_text(BATCH_NO_OWNER)  # another kernel's file copied here
    assert read_identity(str(root), KID) is None
    (config / "recovery.json").write_text(INTERACTIVE + " " * (300 << 10))
    assert read_identity(str(root), KID) is None  # over the size bound


def test_book_keeps_the_same_kernel_object_for_an_unchanged_identity(tmp_path: Path) -> None:
    config = _kernel(tmp_path)
    book = AllocationBook()
    scanner = Scanner(book)
    scanner.scan(str(tmp_path))
    assert book.view().kernels[KID].identity is None
    (config / "recovery.json").write_text(INTERACTIVE)
    scanner.refresh_identity(str(tmp_path), KID)
    first, version = book.view().kernels[KID], book.version
    assert first.identity.session_id == SID
    for text in (INTERACTIVE, "{}", INTERACTIVE[:100], INTERACTIVE):  # rewrites, torn, cleanup race
        (config / "recovery.json").write_text(text)
        scanner.refresh_identity(str(tmp_path), KID)
        assert book.view().kernels[KID] is first and book.version == version
    (config / "resource.txt").write_text((config / "resource.txt").read_text().replace("0.5", "0.25"))
    scanner.refresh(str(tmp_path), KID)
    assert book.view().kernels[KID].identity is first.identity  # a new allocation keeps the identity


# -- the watcher --------------------------------------------------------------------------------


class IdentityCountingScanner(Scanner):
    """A real scanner that counts reads of each file: ``reads`` of resource.txt (stat-only
    rescans that find it unchanged are not reads), ``identity_reads`` of recovery.json."""

    def __init__(self, book: AllocationBook, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__(book)
        self.reads = self.identity_reads = 0
        real = reader_module.read_kernel

        def counting(*args, **kwargs):
            self.reads += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(reader_module, "read_kernel", counting)

    def refresh_identity(self, root: str, kernel_id: str) -> None:
        self.identity_reads += 1
        super().refresh_identity(root, kernel_id)


def test_identity_arrives_late_torn_and_through_a_storm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kids = [f"00000000-0000-4000-8000-{i:012x}" for i in range(50)]
    for kid in kids:
        _kernel(tmp_path, kid)
    book = AllocationBook()
    scanner = IdentityCountingScanner(book, monkeypatch)
    with ScratchWatcher(scanner, [str(tmp_path)], rescan_interval=3600, mountinfo=None):
        assert all(k.identity is None for k in book.view().kernels.values())  # exported at once, without identity
        reads = scanner.reads
        # Late, and torn first: the file is written in place in two steps.
        for i, kid in enumerate(kids):
            with open(tmp_path / kid / "config" / "recovery.json", "w") as f:
                text = recovery_json(kid, f"11111111-0000-4000-8000-{i:012x}", UID)
                f.write(text[:120])
                f.flush()
                f.write(text[120:])
        wait_for(lambda: all(k.identity is not None for k in book.view().kernels.values()), timeout=5)
        objects = dict(book.view().kernels)
        # The storm: the agent rewrites every kernel's file, unchanged, twice.
        before = scanner.identity_reads
        for _ in range(2):
            for i, kid in enumerate(kids):
                write_recovery(tmp_path, kid, f"11111111-0000-4000-8000-{i:012x}", UID)
        wait_for(lambda: scanner.identity_reads >= before + 2 * len(kids), timeout=5)
        assert scanner.reads == reads, "a recovery.json rewrite re-read resource.txt"
        assert all(book.view().kernels[k] is objects[k] for k in kids), "an unchanged identity replaced a kernel"
        # A cleanup race leaves {}: the identity stays.
        (tmp_path / kids[0] / "config" / "recovery.json").write_text("{}")
        wait_for(lambda: scanner.identity_reads >= before + 2 * len(kids) + 1)
        assert book.view().kernels[kids[0]].identity.session_id == "11111111-0000-4000-8000-000000000000"
