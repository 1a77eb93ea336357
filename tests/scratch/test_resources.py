"""The resource.txt parser: every upstream format, every slot kind, pending and malformed files."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest
from backendai_reference import KNOWN_SLOT_TYPES, read_allocations, read_slots
from helpers import FIXTURES
from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.scratch.resources import (
    Allocation,
    Pending,
    ResourceParseError,
    ResourceSpec,
    SlotKind,
    parse_resource,
    slot_kind,
)

SAMPLES = sorted((FIXTURES / "resources").glob("*.txt"))
# Files written by the newest agent (25.x-26.x) and its plugins.
SAMPLES_26 = sorted((FIXTURES / "resources-26").glob("*.txt"))
HEADER = 'SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={"cpu":"1","mem":"1073741824","cuda.shares":"0.5"}\n'


def spec(text: str) -> ResourceSpec:
    result = parse_resource(text, "/s/k/config/resource.txt")
    assert isinstance(result, ResourceSpec), result
    return result


def as_dict(s: ResourceSpec) -> dict[str, dict[str, Decimal]]:
    out: dict[str, dict[str, Decimal]] = {}
    for a in s.allocations:
        out.setdefault(a.slot, {})[a.device_id] = a.amount
    return out


@pytest.mark.parametrize("path", SAMPLES + SAMPLES_26, ids=lambda p: p.name)
def test_every_sample_written_by_backendai_reads_back_as_the_agent_reads_it(path: Path) -> None:
    text = path.read_text()
    s = spec(text)
    if "cuda.mem" in s.slots():
        # The newest agent registers no bytes slot cuda.mem: its own reader raises on "10.12g"
        # (and its map stops at this file); an agent with the commercial plugin reads bytes.
        with pytest.raises(ArithmeticError):
            read_allocations(text)
        assert s.agent_unreadable == ("shares-amount",)
        assert as_dict(s) == read_allocations(text, {**KNOWN_SLOT_TYPES, "cuda.mem": "bytes"})
    else:
        assert s.agent_unreadable == ()
        assert as_dict(s) == read_allocations(text)
    assert dict(s.requested) == read_slots(text)


def test_kubernetes_file_without_cid_is_complete() -> None:
    s = spec((FIXTURES / "resources-26/kubernetes-no-cid.txt").read_text())
    assert s.container_id is None
    assert {a.device_id for a in s.allocations if a.slot == "cuda.device"} == {"0", "1"}


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        # A SLOTS key in upper case is the same slot as the lower-cased _SHARES key.
        ('SLOTS={"cuda.device:MIG-1G.10GB-mig":"1"}\nCUDA.DEVICE:MIG-1G.10GB-MIG_SHARES=MIG-x/1/0:1\n',
         {"cuda.device:mig-1g.10gb-mig": {"MIG-x/1/0": Decimal(1)}}),
        # A space inside a slot name is kept.
        ('SLOTS={"cuda.device:SXM4 MIG 1g.10gb-mig":"1"}\nCUDA.DEVICE:SXM4 MIG 1G.10GB-MIG_SHARES=MIG-y/2/0:1\n',
         {"cuda.device:sxm4 mig 1g.10gb-mig": {"MIG-y/2/0": Decimal(1)}}),
        # A null SLOTS value is skipped.
        ('SLOTS={"cuda.shares":"0.5","cuda.device":null}\nCUDA.SHARES_SHARES=a:0.5\n', {"cuda.shares": {"a": Decimal("0.5")}}),
        # A line without "=" is ignored, and so is "KEY =value" (another key to the agent).
        ('SLOTS={"cuda.shares":"0.5"}\nstray text\nCUDA.SHARES_SHARES=a:0.5\nCUDA.SHARES_SHARES =a:0.75\n=x\n',
         {"cuda.shares": {"a": Decimal("0.5")}}),
        # The agent keeps a space after a comma in the device id.
        ('SLOTS={"cuda.shares":"1"}\nCUDA.SHARES_SHARES=a:0.5, GPU-b:0.5\n', {"cuda.shares": {"a": Decimal("0.5"), " GPU-b": Decimal("0.5")}}),
        # Leading and trailing whitespace of a line is stripped, as the agent strips it.
        ('SLOTS={"cuda.shares":"0.5"}\n   CUDA.SHARES_SHARES=a:0.5  \r\n', {"cuda.shares": {"a": Decimal("0.5")}}),
    ],
)
def test_reader_parity_with_the_newest_agent(body: str, expected: dict) -> None:
    text = "SCRATCH_SIZE=0m\nMOUNTS=\n" + body
    s = spec(text)
    accel = {k: v for k, v in as_dict(s).items()}
    assert accel == expected == read_allocations(text)
    assert s.agent_unreadable == ()
    assert dict(s.requested) == read_slots(text)


def test_an_unterminated_last_line_is_read_once_the_writer_closed_the_file() -> None:
    text = HEADER + "CUDA.SHARES_SHARES=GPU-a:0.5"
    assert parse_resource(text) == Pending("last line not yet terminated")
    assert as_dict(spec_closed(text)) == read_allocations(text) == {"cuda.shares": {"GPU-a": Decimal("0.5")}}
    # A CID line the agent appended without a newline is read too, once closed.
    assert spec_closed(HEADER + "CUDA.SHARES_SHARES=g:0.5\nCID=abc").container_id == "abc"


def spec_closed(text: str) -> ResourceSpec:
    result = parse_resource(text, "/s/k/config/resource.txt", closed=True)
    assert isinstance(result, ResourceSpec), result
    return result


@pytest.mark.parametrize(
    ("header", "line", "reasons"),
    [
        ("SCRATCH_SIZE=0m\nMOUNTS=/srv/a:b:/home/work:ro\n", "", ("mounts",)),
        ("SCRATCH_SIZE=0m\nMOUNTS=relative/dir:/home/work:ro\n", "", ("mounts",)),
        ("SCRATCH_SIZE=0m\nMOUNTS=/srv/a:home:ro\n", "", ("mounts",)),
        ("SCRATCH_SIZE=0m\nMOUNTS=/srv/a:/home:rx\n", "", ("mounts",)),
        ("SCRATCH_SIZE=lots\nMOUNTS=\n", "", ("scratch-size",)),
        ("SCRATCH_SIZE=0m\nMOUNTS=\n", "CUDA.MEM_SHARES=GPU-a:1g\n", ("shares-amount",)),
        ("SCRATCH_SIZE=0m\nMOUNTS=\n", 'SLOTS={"cpu":"1","mem":"1g","cuda.shares":"0.5"}\n', ("slots-value",)),
    ],
)
def test_files_the_agent_cannot_read_are_read_and_flagged(header: str, line: str, reasons: tuple[str, ...]) -> None:
    slots = "" if line.startswith("SLOTS") else 'SLOTS={"cpu":"1","mem":"1073741824","cuda.shares":"0.5"}\n'
    text = header + slots + line + "CUDA.SHARES_SHARES=GPU-a:0.5\n"
    s = spec(text)
    assert s.agent_unreadable == reasons
    assert Allocation("cuda.shares", "GPU-a", Decimal("0.5")) in s.allocations
    with pytest.raises((ValueError, ArithmeticError)):
        read_allocations(text)


def test_volume_names_and_plain_mounts_are_readable_by_the_agent() -> None:
    text = (
        "SCRATCH_SIZE=0m\nMOUNTS=/s/k/config:/home/config:ro,backendai-krunner.v10:/opt/backend.ai:ro,/x:/home/work/x:wd\n"
        'SLOTS={"cpu":"1"}\n'
    )
    assert spec(text).agent_unreadable == ()
    read_allocations(text)


def test_pre_2412_format_has_cid_first_and_spaced_json() -> None:
    s = spec((FIXTURES / "resources/cuda.shares.pre-24.12.txt").read_text())
    assert s.container_id == "5b336bc8c25536590f7815f2af3e7dd95b336bc8c25536590f7815f2af3e7dd9"
    assert dict(s.requested)["cuda.shares"] == Decimal("0.1")
    assert Allocation("cuda.shares", "GPU-c59395cd-ac91-4cd3-a1b0-3d2568aa2d03", Decimal("0.1")) in s.allocations


def test_current_format_repeated_cid_last_one_wins() -> None:
    text = HEADER + "UNIFIED_DEVICES=[]\nCUDA.SHARES_SHARES=GPU-a:0.5\nCID=aaa\nCID=bbb\n"
    assert spec(text).container_id == "bbb"


def test_unified_devices_are_parsed_and_optional() -> None:
    text = 'SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={"cpu":"1","spark.unified":"1"}\nUNIFIED_DEVICES=[["spark","spark.unified"]]\n'
    assert spec(text).unified_devices == (("spark", "spark.unified"),)
    assert spec(HEADER + "CUDA.SHARES_SHARES=g:0.5\n").unified_devices == ()


@pytest.mark.parametrize(
    ("line", "slot", "device", "amount"),
    [
        ("CUDA.SHARES_SHARES=GPU-a:0.60", "cuda.shares", "GPU-a", Decimal("0.60")),
        ("CUDA.DEVICE_SHARES=0:1", "cuda.device", "0", Decimal(1)),
        ("CUDA.MEM_SHARES=GPU-a:10.12g", "cuda.mem", "GPU-a", Decimal(int(Decimal("10.12") * 1024**3))),
        ("CUDA.DEVICE:1G.5GB-MIG_SHARES=MIG-c593/2/0:1", "cuda.device:1g.5gb-mig", "MIG-c593/2/0", Decimal(1)),
        ("CUDA.MIG-2C10G_SHARES=MIG-x:1", "cuda.mig-2c10g", "MIG-x", Decimal(1)),
        ("ROCM.DEVICE_SHARES=2:1", "rocm.device", "2", Decimal(1)),
        ("TPU.DEVICE_SHARES=0:1", "tpu.device", "0", Decimal(1)),
        ("WARP9.CORE_SHARES=w0:3", "warp9.core", "w0", Decimal(3)),  # a slot nobody has seen before
        ("MEM_SHARES=root:1.5g", "mem", "root", Decimal(1536 * 1024**2)),
        ("CPU_SHARES=3:1", "cpu", "3", Decimal(1)),
        ("CUDA.SHARES_SHARES=GPU-a:8E+1", "cuda.shares", "GPU-a", Decimal("8E+1")),
    ],
)
def test_every_shares_line_is_a_slot(line: str, slot: str, device: str, amount: Decimal) -> None:
    text = 'SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={"cpu":"1"}\n' + line + "\n"
    assert Allocation(slot, device, amount) in spec(text).allocations


def test_slot_kinds() -> None:
    assert slot_kind("mem") is SlotKind.BYTES and slot_kind("cuda.mem") is SlotKind.BYTES
    assert slot_kind("cuda.shares") is SlotKind.COUNT and slot_kind("cuda.device:1g.5gb-mig") is SlotKind.COUNT


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "missing SCRATCH_SIZE, MOUNTS, SLOTS"),
        ("CID=abc\n", "missing SCRATCH_SIZE, MOUNTS, SLOTS"),
        ("SCRATCH_SIZE=0m\nMOUNTS=\n", "missing SLOTS"),
        (HEADER + "CUDA.SHARES_SHARES=GPU-a:0.", "last line not yet terminated"),
        (HEADER, "SLOTS requests cuda.shares but no CUDA.SHARES_SHARES line yet"),
    ],
)
def test_files_the_agent_is_still_writing_are_pending(text: str, reason: str) -> None:
    result = parse_resource(text)
    assert isinstance(result, Pending)
    assert result.reason == reason


def test_pending_keeps_the_container_id_seen_so_far() -> None:
    assert parse_resource("CID=abc\nSCRATCH_SIZE=0m\n").container_id == "abc"


def test_an_unterminated_cid_line_does_not_make_a_complete_file_pending() -> None:
    assert spec(HEADER + "CUDA.SHARES_SHARES=g:0.5\nCID=abc").container_id is None


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        (HEADER + "CUDA.SHARES_SHARES=g:NaN\n", 4, "not a finite number"),
        (HEADER + "CUDA.SHARES_SHARES=g:Infinity\n", 4, "not a finite number"),
        (HEADER + "CUDA.SHARES_SHARES=g:-0.5\n", 4, "negative amount"),
        (HEADER + "CUDA.SHARES_SHARES=g:zero\n", 4, "not a number"),
        (HEADER + "CUDA.SHARES_SHARES=g:1E+28\n", 4, "out of range"),
        (HEADER + "CUDA.SHARES_SHARES=g:0.0000000001\n", 4, "out of range"),
        (HEADER + "MEM_SHARES=root:1000000y\n", 4, "out of range"),
        ("SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS=" + "[" * 100000 + "\n", 3, "nested too deeply"),
        ("SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={broken\n", 3, "SLOTS is not valid JSON"),
        ("SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS=[1]\n", 3, "SLOTS is not a JSON object"),
        ('SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={"cpu":"NaN"}\n', 3, "SLOTS entry 1: not a finite number"),
        ('SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={"cpu":true}\n', 3, "is not a number"),
        (HEADER + "UNIFIED_DEVICES={}\nCUDA.SHARES_SHARES=g:0.5\n", 4, "UNIFIED_DEVICES is not a list"),
        (HEADER + "CUDA.SHARES_SHARES=g\x01x:0.5\n", 4, "control characters"),
        (HEADER + "MEM_SHARES=root:lots\n", 4, "not a number"),
    ],
)
def test_malformed_files_name_the_file_line_and_reason(text: str, line: int, reason: str) -> None:
    with pytest.raises(ResourceParseError) as info:
        parse_resource(text, "/scratch/k1/config/resource.txt")
    assert info.value.line == line
    assert reason in info.value.reason
    assert str(info.value).startswith(f"/scratch/k1/config/resource.txt:{line}: ")


def test_binary_garbage_is_malformed() -> None:
    with pytest.raises(ResourceParseError, match="NUL"):
        parse_resource("\x00\x01\x02garbage")


def test_empty_sides_are_skipped_and_duplicates_overwrite_as_upstream_does() -> None:
    text = HEADER + "CUDA.SHARES_SHARES=:0.5,GPU-a:,GPU-b:0.25,GPU-b:0.5\n"
    assert as_dict(spec(text)) == read_allocations(text) == {"cuda.shares": {"GPU-b": Decimal("0.5")}}
    # A repeated key replaces the whole line, as upstream's key=value dict does.
    text += "CUDA.SHARES_SHARES=GPU-c:0.5\n"
    assert as_dict(spec(text)) == read_allocations(text) == {"cuda.shares": {"GPU-c": Decimal("0.5")}}


def test_device_ids_with_quotes_and_unicode_survive_intact() -> None:
    text = HEADER + 'CUDA.SHARES_SHARES=GPU-"q"\\:0.5,장치:0.25\n'
    ids = {a.device_id for a in spec(text).allocations}
    assert ids == {'GPU-"q"\\', "장치"}


def test_a_line_with_ten_thousand_entries() -> None:
    entries = ",".join(f"{i}:1" for i in range(10_000))
    s = spec('SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={"cpu":"10000"}\nCPU_SHARES=' + entries + "\n")
    assert len(s.allocations) == 10_000


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=400))
def test_any_text_gives_a_spec_pending_or_a_parse_error(text: str) -> None:
    try:
        result = parse_resource(text, "f")
    except ResourceParseError as exc:
        assert str(exc).startswith("f")
    else:
        assert isinstance(result, (ResourceSpec, Pending))


_ids = st.text(alphabet="abcdefGPU-0123456789/", min_size=1, max_size=12)
_amounts = st.decimals(min_value=0, max_value=1000, places=2, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(_ids, _amounts, min_size=1, max_size=8), st.booleans())
def test_written_allocations_read_back_exactly(per_device: dict[str, Decimal], cid_first: bool) -> None:
    body = "CUDA.SHARES_SHARES=" + ",".join(f"{d}:{a}" for d, a in per_device.items()) + "\n"
    total = sum(per_device.values(), Decimal(0))
    header = f'SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={{"cuda.shares": "{total}"}}\n'
    text = ("CID=x\n" + header + body) if cid_first else (header + body + "CID=x\n")
    s = spec(text)
    assert as_dict(s) == read_allocations(text) == {"cuda.shares": per_device}
    assert s.container_id == "x"


@pytest.mark.parametrize("line", [
    'SLOTS={"cpu":"SECRET"}',
    'SLOTS={"SECRET":true}',
    'SLOTS={"cpu":["SECRET"]}',
    "SLOTS=SECRET",
    "CUDA.SHARES_SHARES=dev:SECRET",
    "CUDA.SHARES_SHARES=dev:-1SECRET",
    "CUDA.SHARES_SHARES=SECRET\x01:1",
    "CUDA\x01SECRET_SHARES=dev:1",
    "MEM_SHARES=root:1SECRETg",
    "UNIFIED_DEVICES=SECRET",
    'UNIFIED_DEVICES=[["SECRET"]]',
])
def test_no_value_from_the_file_is_ever_quoted_in_an_error(line: str) -> None:
    text = 'SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={"cpu":"1"}\n'
    text = text.replace('SLOTS={"cpu":"1"}', line) if line.startswith("SLOTS=") else text + line + "\n"
    with pytest.raises(ResourceParseError) as caught:
        parse_resource(text, "/s/k/config/resource.txt")
    assert "SECRET" not in str(caught.value) and str(caught.value).startswith("/s/k/config/resource.txt:")


def test_a_mount_path_with_a_newline_never_becomes_keys_or_labels() -> None:
    text = ('SCRATCH_SIZE=0m\nMOUNTS=/data/a\nCUDA.SHARES_SHARES=GPU-forged:9:/home/work/a:rw\n'
            'SLOTS={"cpu":"1","cuda.shares":"0.5"}\nCUDA.SHARES_SHARES=GPU-real:0.5\nCPU_SHARES=0:1\n')
    result = parse_resource(text, "r")
    assert {(a.slot, a.device_id) for a in result.allocations} == {("cuda.shares", "GPU-real"), ("cpu", "0")}
    assert "mounts" in result.agent_unreadable


# The value parsers are memoised on a value's text (resources._value_parser): the cache must never
# carry one file's path or line into another's error, nor change what a value reads as.
SHARED_SLOTS = 'SLOTS={"cpu":"1","cuda.shares":"0.5"}'


def test_a_memoised_value_reports_each_files_own_path_and_line() -> None:
    from exporter.scratch.resources import _parse_shares, _parse_slots

    bad_share = "CUDA.SHARES_SHARES=GPU-a:0.5,GPU-b:NaN"  # entry 2 is malformed
    first = f"SCRATCH_SIZE=0m\nMOUNTS=\n{SHARED_SLOTS}\n{bad_share}\n"
    second = f"CID=x\nSCRATCH_SIZE=0m\nMOUNTS=\n{SHARED_SLOTS}\nCPU_SHARES=0:1\nX=y\n{bad_share}\n"
    hits = _parse_slots.cached.cache_info().hits
    errors = []
    for text, source in ((first, "/s/a/config/resource.txt"), (second, "/s/b/config/resource.txt")):
        with pytest.raises(ResourceParseError) as caught:
            parse_resource(text, source)
        errors.append(caught.value)
    assert _parse_slots.cached.cache_info().hits > hits  # the second file's SLOTS came from the cache
    assert [(e.source, e.line) for e in errors] == [("/s/a/config/resource.txt", 4), ("/s/b/config/resource.txt", 7)]
    assert str(errors[1]) == "/s/b/config/resource.txt:7: CUDA.SHARES_SHARES entry 2: not a finite number"

    # The same malformed SLOTS value, on different lines of two files: a refusal is never cached.
    bad_slots = 'SLOTS={"cpu":"1","cuda.shares":"-1"}'
    for text, source, line in (
        (f"SCRATCH_SIZE=0m\nMOUNTS=\n{bad_slots}\n", "/s/c/config/resource.txt", 3),
        (f"CID=y\nX=1\nSCRATCH_SIZE=0m\nMOUNTS=\n{bad_slots}\n", "/s/d/config/resource.txt", 5),
    ):
        with pytest.raises(ResourceParseError) as caught:
            parse_resource(text, source)
        assert str(caught.value) == f"{source}:{line}: SLOTS entry 2: a negative amount"

    # A share line that parsed once is read the same from the cache, and its allocations are shared.
    good = f"SCRATCH_SIZE=0m\nMOUNTS=\n{SHARED_SLOTS}\nCUDA.SHARES_SHARES=GPU-a:0.5\nCPU_SHARES=0:1\n"
    hits = _parse_shares.cached.cache_info().hits
    a, b = spec(good), spec("CID=z\n" + good)
    assert _parse_shares.cached.cache_info().hits >= hits + 2
    assert a.allocations == b.allocations and all(x is y for x, y in zip(a.allocations, b.allocations, strict=True))
    assert a.requested == b.requested == (("cpu", Decimal(1)), ("cuda.shares", Decimal("0.5")))
    assert (a.container_id, b.container_id) == (None, "z")


def test_a_value_too_long_for_the_cache_reads_the_same_and_is_not_kept() -> None:
    from exporter.scratch.resources import _MEMO_MAX_CHARS, _parse_shares

    devices = {f"GPU-{i:04d}": Decimal("0.25") for i in range(_MEMO_MAX_CHARS // 10)}
    line = "CUDA.SHARES_SHARES=" + ",".join(f"{d}:{a}" for d, a in devices.items())
    assert len(line) > _MEMO_MAX_CHARS
    text = f"SCRATCH_SIZE=0m\nMOUNTS=\n{SHARED_SLOTS}\n{line}\n"
    before = _parse_shares.cached.cache_info()
    for _ in range(2):
        assert as_dict(spec(text)) == read_allocations(text) == {"cuda.shares": devices}
    after = _parse_shares.cached.cache_info()
    assert (after.hits, after.misses) == (before.hits, before.misses)  # never looked up, never stored
    with pytest.raises(ResourceParseError, match=r"^/s/k/config/resource.txt:4: CUDA.SHARES_SHARES entry 3: not a number$"):
        parse_resource(text.replace("GPU-0002:0.25", "GPU-0002:x"), "/s/k/config/resource.txt")
