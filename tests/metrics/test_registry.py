"""Exposition: a golden /metrics for a fixture scratch tree, promtool-clean, failures as data."""

from __future__ import annotations

import gzip
import re
import subprocess
import threading
import zlib
from decimal import Decimal
from pathlib import Path

import pytest
from helpers import FIXTURES, GOLDEN
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from exporter.metrics.allocation import KernelText, allocation_families, kernel_families
from exporter.metrics.exporter import build_info, watcher_families
from exporter.metrics.registry import ExporterCollector, Part, render_families
from exporter.metrics.status import Health
from exporter.metrics.text import ChunkedText, Deflated, Joiner, deflate, gzip_body, inflate, joined, openmetrics_text
from exporter.scratch.allocation import AllocationBook
from exporter.scratch.reader import Scanner, ScanStats
from exporter.scratch.watcher import WatcherStatus

FIXTURE = FIXTURES / "scratch" / "mixed"
GOLDEN_FILE = GOLDEN / "mixed.prom"
STATUS = WatcherStatus(
    mode="inotify", up=True, watches=17, overflows_total=0, watch_errors_total=0, events_total=3, rescans_total=1,
    last_event_timestamp=1.7e9, last_scan=(ScanStats("/scratch", 15, 0.0125, True),), degraded=None,
)


def render(tree: Path, status: WatcherStatus = STATUS) -> bytes:
    book = AllocationBook(clock=lambda: 1.7e9)
    Scanner(book).scan(str(tree))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ExporterCollector([
        Part("build", lambda: [build_info("agent-1")], lambda: 0),
        Part("scratch", lambda: allocation_families(book.view()) + kernel_families(book.view()) + watcher_families(status), lambda: 0,
             health=lambda: Health(all(s.ok for s in status.last_scan), sum(s.duration_seconds for s in status.last_scan))),
    ], clock=lambda: 1.7e9))
    return generate_latest(registry)


def test_golden_metrics(update_golden: bool) -> None:
    text = render(FIXTURE).decode().replace(__import__("platform").python_version(), "PYTHON")
    # The build part's duration is its measured render time.
    text = re.sub(r'^(gpu_alloc_collector_duration_seconds\{collector="build"\}) .*$', r"\1 0", text, flags=re.M)
    if update_golden:
        GOLDEN_FILE.write_text(text)
    assert text == GOLDEN_FILE.read_text(), "exposition changed; review and run pytest --update-golden"


@pytest.mark.tools("promtool")
def test_promtool_check_metrics_is_clean() -> None:
    result = subprocess.run(["promtool", "check", "metrics"], input=render(FIXTURE), capture_output=True)
    assert result.returncode == 0, result.stderr.decode()


def test_hostile_label_values_are_escaped() -> None:
    text = render(FIXTURE).decode()
    # The invalid kernel's quoted device id never reaches a label (its file never parsed), and
    # nothing in the output breaks the line structure.
    assert 'GPU-"quoted"' not in text
    for line in text.splitlines():
        assert line.startswith("#") or line.count('"') % 2 == 0


def test_a_failing_source_reports_success_0_and_the_scrape_still_works() -> None:
    def broken():
        raise RuntimeError("NVML went away")

    registry = CollectorRegistry(auto_describe=False)
    registry.register(ExporterCollector([Part("nvml", broken, lambda: 0), Part("build", lambda: [build_info(None)], lambda: 0)]))
    assert registry.get_sample_value("gpu_alloc_collector_success", {"collector": "nvml"}) == 0
    assert registry.get_sample_value("gpu_alloc_build_info", {"version": __import__("exporter").__version__,
                                                                "python_version": __import__("platform").python_version(),
                                                                "agent_id": ""}) == 1


def test_a_failed_scan_reports_success_0() -> None:
    status = WatcherStatus(**{**STATUS.__dict__, "last_scan": (ScanStats("/gone", 0, 0.0, False, "No such file"),)})
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ExporterCollector([Part("scratch", lambda: watcher_families(status), lambda: 0,
                                              health=lambda: Health(all(s.ok for s in status.last_scan)))]))
    assert registry.get_sample_value("gpu_alloc_collector_success", {"collector": "scratch"}) == 0
    assert registry.get_sample_value("gpu_alloc_scratch_root_up", {"scratch_root": "/gone"}) == 0


def test_render_reuses_unchanged_parts_and_reports_every_part() -> None:
    calls = {"big": 0, "small": 0}
    version = {"small": 0}

    def big():
        calls["big"] += 1
        return [GaugeMetricFamily("gpu_alloc_big", "a value", value=1)]

    def small():
        calls["small"] += 1
        return [GaugeMetricFamily("gpu_alloc_small", "a value", value=version["small"])]

    collector = ExporterCollector([Part("big", big, lambda: 0, health=lambda: Health(True, 0.5, 1.6e9)),
                                   Part("small", small, lambda: version["small"])], clock=lambda: 1.7e9)
    first = collector.render()
    version["small"] = 1
    second = collector.render()
    assert calls == {"big": 1, "small": 2}
    assert b"gpu_alloc_small 0.0" in first and b"gpu_alloc_small 1.0" in second
    # One family per name, one sample per part: the registry alone reports on the parts.
    assert second.count(b"# TYPE gpu_alloc_collector_success gauge") == 1
    assert b'gpu_alloc_collector_success{collector="big"} 1.0' in second
    assert b'gpu_alloc_collector_success{collector="small"} 1.0' in second
    assert b'gpu_alloc_collector_duration_seconds{collector="big"} 0.5' in second  # the part's own figure
    assert b'gpu_alloc_collector_last_success_timestamp_seconds{collector="big"} 1.6e+09' in second
    assert b'gpu_alloc_collector_last_success_timestamp_seconds{collector="small"} 1.7e+09' in second
    assert gzip.decompress(collector.render(gzipped=True)) == second
    result = subprocess.run(["promtool", "check", "metrics"], input=second, capture_output=True)
    assert result.returncode == 0, result.stderr.decode()


def test_a_failed_part_is_dropped_not_cached_and_retried() -> None:
    state = {"fail": False, "token": 0, "calls": 0}

    def flaky():
        state["calls"] += 1
        if state["fail"]:
            raise RuntimeError("boom")
        return [GaugeMetricFamily("gpu_alloc_flaky", "a value", value=state["token"])]

    clock = [100.0]
    collector = ExporterCollector([Part("flaky", flaky, lambda: state["token"])], clock=lambda: clock[0])
    assert b"gpu_alloc_flaky 0.0" in collector.render()
    state.update(fail=True, token=1)
    clock[0] = 200.0
    failed = collector.render()
    assert b"gpu_alloc_flaky " not in failed  # the last good series is dropped, not served stale
    assert b'gpu_alloc_collector_success{collector="flaky"} 0.0' in failed
    assert b'gpu_alloc_collector_last_success_timestamp_seconds{collector="flaky"} 100.0' in failed
    collector.render()
    assert state["calls"] == 3  # not cached: tried again on the next scrape
    state["fail"] = False
    recovered = collector.render()
    assert b"gpu_alloc_flaky 1.0" in recovered and b'gpu_alloc_collector_success{collector="flaky"} 1.0' in recovered


def test_part_names_are_unique() -> None:
    with pytest.raises(ValueError, match="repeat"):
        ExporterCollector([Part("a", list, lambda: 0), Part("a", list, lambda: 0)])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.text(min_size=1, max_size=8), st.text(min_size=1, max_size=8),
                          st.sampled_from(["cuda.shares", "cuda.mem", "rocm.device", "cuda.device:1g.10gb-mig"]),
                          st.decimals(min_value=0, max_value=10**12, places=2)), max_size=12))
def test_kernel_text_equals_prometheus_client_output(rows) -> None:
    """The cached encoder must write exactly what generate_latest writes, hostile ids included."""
    from exporter.scratch.resources import Allocation, ResourceSpec

    book = AllocationBook(clock=lambda: 0.0)
    for kernel_id, device_id, slot, amount in rows:
        book.apply(kernel_id + '"\\\n', "/r", ResourceSpec((Allocation(slot, device_id + '"\\\n', amount),), (), None))
    text, packed = KernelText(), KernelText(gzipped=True)
    assert text.render(book.view()) == render_families(kernel_families(book.view()))
    assert inflate(packed.render(book.view())) == render_families(kernel_families(book.view()))
    if rows:  # and after a change, from the cache
        book.remove(rows[0][0] + '"\\\n')
        assert text.render(book.view()) == render_families(kernel_families(book.view()))
        assert inflate(packed.render(book.view())) == render_families(kernel_families(book.view()))


class _Obj:
    """An immutable value with its own identity: a new one stands for a changed key."""

    def __init__(self, value: str) -> None:
        self.value = value


def _segments(key: str, obj: _Obj) -> tuple[bytes, ...]:
    # Three sections of different lengths, the middle one often empty, non-ASCII included.
    return (f"{key}={obj.value}".encode(), obj.value.encode() * (len(obj.value) % 2), f"[{key}\u00e9]".encode())


@settings(max_examples=200, deadline=None)
@given(st.booleans(), st.sampled_from([4, 5, 6, 16]),
       st.lists(st.lists(st.tuples(st.text("abcdefghijkl", min_size=1, max_size=2),
                                   st.one_of(st.none(), st.text(max_size=4))), max_size=30),
                max_size=8), st.booleans())
def test_chunked_text_equals_encoding_everything_again(gzipped, chunk_keys, steps, told) -> None:
    """Keys come, change (a new object, same value or not) and go between renders, in numbers
    that split, merge and empty chunks; each render equals every key encoded afresh, in key
    order, whatever was kept from the last one (plain or compressed)."""
    chunked, objects = ChunkedText(3, gzipped=gzipped, chunk_keys=chunk_keys), {}
    for n, step in enumerate([[], *steps]):
        for key, value in step:
            if value is None:
                objects.pop(key, None)
            else:
                objects[key] = _Obj(value)
        full = [_segments(k, objects[k]) for k in sorted(objects)]
        # Told which keys changed (a superset, as a book's record may be) or left to compare all.
        changed = {key for key, _ in step} | set(list(objects)[:1]) if told else None
        sections = chunked.render(dict(objects), _segments, changed)
        assert len(sections) == 3
        for s, pieces in enumerate(sections):
            text = inflate(joined(pieces)) if gzipped else b"".join(pieces)
            assert text == b"".join(seg[s] for seg in full), (n, s)
        assert all(len(c.keys) <= 2 * chunk_keys for c in chunked._chunks)


def test_chunked_text_encodes_only_the_chunks_of_changed_keys() -> None:
    encoded = []

    def encode(key: str, obj: _Obj) -> tuple[bytes]:
        encoded.append(key)
        return (obj.value.encode(),)

    chunked = ChunkedText(1, chunk_keys=4)
    keys = [f"k{i:02}" for i in range(12)]  # three chunks of four
    objects = {k: _Obj(k) for k in keys}
    before = chunked.render(objects, encode)[0]
    assert b"".join(before) == "".join(keys).encode() and len(before) == 3
    encoded.clear()
    objects = {**objects, "k05": _Obj("K05"), "k050": _Obj("new")}
    after = chunked.render(objects, encode)[0]
    assert sorted(encoded) == ["k04", "k05", "k050", "k06", "k07"]  # the middle chunk only
    assert after[0] is before[0] and after[2] is before[2]  # the others' bytes handed out as they were
    assert b"".join(after) == b"k00k01k02k03k04K05newk06k07k08k09k10k11"
    encoded.clear()
    assert chunked.render(objects, encode)[0] == after and encoded == []  # nothing changed: nothing encoded
    # Told which keys changed, it looks at their chunks only: an unnamed change waits for a full look.
    objects = {**objects, "k01": _Obj("K01"), "k10": _Obj("K10")}
    told = chunked.render(objects, encode, changed={"k10"})[0]
    assert sorted(encoded) == ["k08", "k09", "k10", "k11"] and told[0] is after[0]
    encoded.clear()
    assert b"k00K01" in b"".join(chunked.render(objects, encode)[0]) and sorted(encoded) == ["k00", "k01", "k02", "k03"]


@pytest.mark.parametrize("gzipped", [False, True])
def test_chunked_text_encodes_only_the_changed_keys_of_a_large_chunk(gzipped) -> None:
    """A few changed, new or ended keys of a chunk: only the changed and new ones are encoded, the
    others cut from its text; many: the chunk is encoded whole."""
    encoded = []

    def encode(key: str, obj: _Obj) -> tuple[bytes, bytes]:
        encoded.append(key)
        return (obj.value.encode(), obj.value.encode() * (key.endswith("7")))

    def text(sections, s: int = 0) -> bytes:
        return inflate(joined(sections[s])) if gzipped else b"".join(sections[s])

    chunked = ChunkedText(2, gzipped=gzipped, chunk_keys=16)
    keys = [f"k{i:02}" for i in range(32)]  # two chunks of sixteen
    objects = {k: _Obj(k) for k in keys}
    chunked.render(objects, encode)
    encoded.clear()
    objects = {**objects, "k03": _Obj("LONGER03"), "k07": _Obj("7")}
    sections = chunked.render(objects, encode, changed={"k03", "k07"})
    assert sorted(encoded) == ["k03", "k07"]
    assert text(sections) == b"".join(o.value.encode() for o in objects.values())
    assert text(sections, 1) == b"7k17k27"  # the keys ending in 7, k07's new segment spliced in
    encoded.clear()
    objects = {k: o for k, o in objects.items() if k != "k05"} | {"k050": _Obj("new")}  # one came, one went
    sections = chunked.render(objects, encode, changed={"k05", "k050"})
    assert encoded == ["k050"]
    assert text(sections) == b"".join(objects[k].value.encode() for k in sorted(objects))
    assert text(sections, 1) == b"7k17k27"
    encoded.clear()
    objects = {**objects, **{k: _Obj(k.upper()) for k in keys[16:20]}}  # 4 of 16: the chunk whole
    sections = chunked.render(objects, encode)
    assert sorted(encoded) == keys[16:]
    assert text(sections) == b"".join(objects[k].value.encode() for k in sorted(objects))


def test_kernel_text_openmetrics_form_is_the_conversion_of_its_text() -> None:
    """The OpenMetrics form a render shares its samples with equals the text converted whole."""
    from exporter.scratch.resources import Allocation, ResourceSpec

    book = AllocationBook(clock=lambda: 0.0)
    for n in range(150):
        book.apply(f"k{n:03}", "/r", ResourceSpec((Allocation("cuda.shares", f"GPU-{n % 3}", Decimal("0.5")),
                                                   Allocation("cuda.mem", f"GPU-{n % 3}", Decimal(2 ** 30))), (), None))
    head = render_families(allocation_families(book.view()))
    gone = iter(["k007", "k070", "k140", "k149"])
    for gzipped in (False, True):
        kt = KernelText(gzipped=gzipped)
        unpack = inflate if gzipped else bytes
        for _ in range(2):  # the first render, then one after a kernel went
            text = unpack(kt.render(book.view(), head))
            assert text == head + render_families(kernel_families(book.view()))
            assert unpack(kt.openmetrics()) == openmetrics_text(text)
            book.remove(next(gone))


def _no_durations(text: bytes) -> bytes:
    # Render times are measured, so they differ between two collectors.
    return re.sub(rb"^gpu_alloc_collector_duration_seconds.*$", b"", text, flags=re.M)


def test_render_cached_answers_only_from_current_text_and_never_waits() -> None:
    """What the serving loop asks: bytes when every part's text in that encoding is current, else
    None (the request then renders on the render thread), also while a render holds the lock."""
    version = {"small": 0}
    calls = []

    def big() -> Deflated:
        calls.append(1)
        return deflate(render_families([GaugeMetricFamily("gpu_alloc_big", "a value", value=1)]))

    collector = ExporterCollector([
        Part("big", list, lambda: 0, big, gzipped=True),  # kept compressed only
        Part("small", lambda: [GaugeMetricFamily("gpu_alloc_small", "a value", value=version["small"])], lambda: version["small"]),
        Part("flaky", lambda: 1 / 0, lambda: 0),
    ], clock=lambda: 1.7e9)
    assert collector.render_cached(gzipped=True) is None  # nothing rendered yet
    collector.render(gzipped=True)
    assert collector.render_cached(gzipped=True) is None  # the failed part is never cached: retried
    collector = ExporterCollector(collector._parts[:2], clock=lambda: 1.7e9)
    rendered = collector.render(gzipped=True)
    assert _no_durations(gzip.decompress(collector.render_cached(gzipped=True))) == _no_durations(gzip.decompress(rendered))
    assert collector.render_cached(gzipped=False) is None  # plain would inflate "big": not on the loop
    version["small"] = 1
    assert collector.render_cached(gzipped=True) is None  # a part changed
    collector.render(gzipped=True)
    assert b"gpu_alloc_small 1.0" in gzip.decompress(collector.render_cached(gzipped=True))
    with collector._lock:  # a render in progress (another thread): no wait, no answer
        assert collector.render_cached(gzipped=True) is None
    assert len(calls) == 2  # rendered by the two collectors, never by render_cached


def test_a_part_marked_ahead_is_rendered_after_a_pass_the_next_scrape_will_read() -> None:
    """After each usage pass the registry renders the ``ahead`` parts whose token moved when a
    scrape is expected before the next pass (the last scrapes' median interval after the last),
    so that scrape finds them rendered; no scrape expected, nothing is rendered ahead."""
    now, token, renders = [0.0], [0], []

    def ledger() -> list:
        renders.append(token[0])
        return [GaugeMetricFamily("gpu_alloc_ledger", "A part long to render", value=token[0])]

    collector = ExporterCollector([Part("ledger", ledger, lambda: token[0], ahead=True),
                                   Part("build", lambda: [build_info(None)], lambda: 0)], monotonic=lambda: now[0])
    assert not collector.render_ahead(5.0)  # never scraped
    for at in (0.0, 15.0, 30.0):
        now[0] = at
        collector.render(gzipped=True, openmetrics=True)
    assert renders == [0]
    token[0], now[0] = 1, 35.0  # a pass at 35 s, the next at 40 s: the scrape at 45 s reads the next one
    assert not collector.render_ahead(5.0) and renders == [0]
    token[0], now[0] = 2, 40.0  # the pass the scrape at 45 s reads
    assert collector.render_ahead(5.0) and renders == [0, 2]
    assert collector.render_cached(gzipped=True, openmetrics=True) is not None  # rendered, OpenMetrics form too
    now[0] = 45.0
    assert b"gpu_alloc_ledger 2.0" in gzip.decompress(collector.render(gzipped=True, openmetrics=True))
    assert renders == [0, 2]  # the scrape rendered nothing
    token[0], now[0] = 3, 64.0  # the scrape due at 60 s is late: expected any moment
    assert collector.render_ahead(5.0) and renders == [0, 2, 3]
    token[0], now[0] = 4, 200.0  # scrapes stopped: no render ahead
    assert not collector.render_ahead(5.0) and renders == [0, 2, 3]


@pytest.mark.parametrize("made_form", [True, False])
def test_a_scrape_during_a_render_ahead_serves_the_last_render_or_waits_for_the_form_it_lacks(made_form) -> None:
    """While a part is rendered ahead (outside the registry's lock), a scrape serves its last
    render at once, from the serving loop too, and never renders the part beside it; a scrape
    in a form the last render lacks waits for the new one. The scrape after gets the new render."""
    now, token, entered, release, busy = [0.0], [0], threading.Event(), threading.Event(), []

    def ledger() -> list:
        assert not busy, "rendered twice at once"
        busy.append(token[0])
        try:
            if token[0] == 2:
                entered.set()
                assert release.wait(10)
            return [GaugeMetricFamily("gpu_alloc_ledger", "A part long to render", value=token[0])]
        finally:
            busy.clear()

    collector = ExporterCollector([Part("ledger", ledger, lambda: token[0], ahead=True),
                                   Part("build", lambda: [build_info(None)], lambda: 0)], monotonic=lambda: now[0])
    for at in (0.0, 15.0, 30.0):  # scraped in OpenMetrics, or in the text format only
        now[0] = at
        collector.render(gzipped=True, openmetrics=made_form)
    token[0], now[0] = 2, 40.0
    ahead = threading.Thread(target=collector.render_ahead, args=(5.0,))
    ahead.start()
    assert entered.wait(10)
    scraped: list[bytes] = []
    scrape = threading.Thread(target=lambda: scraped.append(gzip.decompress(collector.render(gzipped=True, openmetrics=True))))
    scrape.start()
    scrape.join(0.2)
    try:
        if made_form:
            assert not scrape.is_alive() and b"gpu_alloc_ledger 0.0" in scraped[0]  # the last render, at once
            assert b"gpu_alloc_ledger 0.0" in gzip.decompress(collector.render_cached(gzipped=True, openmetrics=True))
        else:
            assert scrape.is_alive()  # no OpenMetrics form of the last render: it waits for the new one
    finally:
        release.set()
        ahead.join(10)
        scrape.join(10)
    if not made_form:
        assert b"gpu_alloc_ledger 2.0" in scraped[0]
    assert b"gpu_alloc_ledger 2.0" in gzip.decompress(collector.render(gzipped=True, openmetrics=True))


def test_a_gzipped_part_is_cached_compressed_and_inflated_for_a_plain_scrape() -> None:
    calls = []

    def piece() -> Deflated:
        calls.append(1)
        return deflate(render_families([build_info("agent-1")]))

    plain = ExporterCollector([Part("build", lambda: [build_info("agent-1")], lambda: 0)], clock=lambda: 1.7e9)
    packed = ExporterCollector([Part("build", lambda: [build_info("agent-1")], lambda: 0, piece, gzipped=True)],
                               clock=lambda: 1.7e9)
    assert _no_durations(packed.render()) == _no_durations(plain.render())
    assert _no_durations(gzip.decompress(packed.render(gzipped=True))) == _no_durations(plain.render())
    assert len(calls) == 1  # rendered once, served plain and gzip from the one piece


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=3000) | st.sampled_from([b"", b"\n" * 70000]), max_size=8), st.integers(0, 3))
def test_pieces_join_into_one_gzip_member(texts, split) -> None:
    """Pieces, joined in any grouping (a part's chunks, then the parts), make one gzip member: a
    reader that stops after the first member (libcurl) still reads every byte, and the trailer's
    CRC-32 and size are checked (by ``gzip.decompress``)."""
    pieces = [deflate(text) for text in texts]
    grouped = [joined(pieces[:split]), *pieces[split:]]  # as KernelText joins its chunks first
    body = gzip_body(grouped)
    one = zlib.decompressobj(wbits=31)  # gzip, one member
    assert one.decompress(body) == b"".join(texts) and one.eof and one.unused_data == b""
    assert gzip.decompress(body) == b"".join(texts)
    assert inflate(joined(grouped)) == b"".join(texts)
    assert bool(joined(pieces)) == any(texts)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 80), st.booleans()), max_size=6), max_size=8), st.integers(2, 5))
def test_a_joiner_joins_as_joined_whatever_changed(steps, run) -> None:
    """Pieces replaced, inserted and removed between joins (runs kept, shifted, emptied): every
    join equals :func:`joined` of the same pieces, and their text."""
    joiner, pieces = Joiner(run), [deflate(b"%d\n" % n) for n in range(20)]
    for step in [[], *steps]:
        for at, insert in step:
            at = min(at, len(pieces))
            if insert or at == len(pieces):
                pieces.insert(at, deflate(b"new %d\n" % at))
            else:
                pieces[at] = deflate(b"") if at % 3 == 0 else deflate(b"changed %d\n" % at)
        assert joiner(pieces) == joined(pieces)
        assert inflate(joiner(pieces)) == b"".join(map(inflate, pieces))


def test_a_gzip_body_is_one_member_of_every_part() -> None:
    """Compressed parts, plain parts and the status families: one gzip member, as ``curl
    --compressed`` reads it (libcurl takes the first member only)."""
    collector = ExporterCollector([
        Part("big", list, lambda: 0, lambda: deflate(render_families([build_info("agent-1")])), gzipped=True),
        Part("small", lambda: [GaugeMetricFamily("gpu_alloc_small", "a value", value=1)], lambda: 0),
    ], clock=lambda: 1.7e9)
    for openmetrics in (False, True):
        body = collector.render(gzipped=True, openmetrics=openmetrics)
        one = zlib.decompressobj(wbits=31)
        text = one.decompress(body)
        assert one.eof and one.unused_data == b""
        assert _no_durations(text) == _no_durations(collector.render(openmetrics=openmetrics))
        assert b"gpu_alloc_build_info" in text and b"gpu_alloc_small 1.0" in text and b"gpu_alloc_collector_success" in text


_NAMES = st.sampled_from(["gpu_alloc_x", "gpu_alloc_x_seconds", "a:b", "x_total", "9bad", "bad-name", "ünicode", "x\n", ""])
_LABELS = st.sampled_from(["device_id", "kernel_id", "slot", "__reserved", "bad-label", "a:b", "ü"])
_VALUES = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-10**20, 10**20)


@st.composite
def _family(draw):
    from prometheus_client.core import Metric

    name = draw(_NAMES)
    kind = draw(st.sampled_from(["gauge", "counter", "info", "stateset", "unknown", "histogram", "summary",
                                 "gaugehistogram"]))
    try:
        family = Metric(name, draw(st.text(max_size=8)), kind)
    except ValueError:  # a name the library will not hold
        assume(False)
    for _ in range(draw(st.integers(0, 4))):
        suffix = draw(st.sampled_from(["", "_total", "_created", "_gsum", "_gcount", "_bucket", "_info"]))
        labels = draw(st.dictionaries(_LABELS, st.text(max_size=6), max_size=3))
        family.add_sample(name + suffix, labels, draw(_VALUES), draw(st.none() | st.floats(0, 2e9)))
    return family


@settings(max_examples=300, deadline=None)
@given(st.lists(_family(), max_size=4))
def test_render_families_writes_what_generate_latest_writes(families) -> None:
    """The exporter's own writer of small families, names and samples of every kind (legacy or
    not, OpenMetrics-only samples, timestamps, escapes), byte for byte as the library."""

    class Families:
        def collect(self):
            return families

    try:
        expected = generate_latest(Families())
    except Exception:  # what the library refuses to write, the writer need not write either
        return
    assert render_families(families) == expected
