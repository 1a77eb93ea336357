"""Families for GPU accounting (:mod:`exporter.analysis.accounting`): the share of each physical
GPU a kernel holds, each kernel's measured use normalised by what it holds, and the chargeback
counters. Identity is never copied here: join ``gpu_alloc_kernel_identity_info`` on ``kernel_id``.
The ledger's counters (per kernel, per GPU, per user and project) are described in
:mod:`exporter.analysis.accounting`. Sample output::

    gpu_alloc_kernel_gpu_share_ratio{device_id="GPU-5d2c…",kernel_id="0b3f…"} 0.037
    gpu_alloc_kernel_measured_utilization_ratio{kernel_id="0b3f…"} 0.3
    gpu_alloc_kernel_allocated_gpu_seconds_total{device_id="GPU-5d2c…",kernel_id="0b3f…"} 13.3
    gpu_alloc_kernel_busy_gpu_seconds_total{device_id="GPU-5d2c…",kernel_id="0b3f…"} 4.1
    gpu_alloc_kernel_energy_joules_total{device_id="GPU-5d2c…",kernel_id="0b3f…"} 5210.0
    gpu_alloc_device_unallocated_gpu_seconds_total{device_id="GPU-5d2c…"} 861.2
    gpu_alloc_user_energy_joules_total{project_id="undefined",user_id="f38dea23-…"} 15630.0
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Mapping
from itertools import chain, repeat
from operator import add, itemgetter, mul
from typing import TYPE_CHECKING

from exporter.analysis.model import Accounting, DrivenCounters
from exporter.metrics.collectors import Inputs, Part, register
from exporter.metrics.families import counter, escape_label, float_format, float_texts, gauge
from exporter.metrics.status import Health
from exporter.metrics.text import EMPTY, ChunkedText, Deflated, Joiner, deflate, joined, openmetrics_text

if TYPE_CHECKING:
    from prometheus_client.core import Metric

__all__ = ["AccountingText", "accounting_families", "accounting_health"]

_PAIR = ["device_id", "kernel_id"]
# Past this many pairs come or gone since the last render, the pair order is sorted anew rather
# than moved pair by pair.
_MOVED_APART = 64


def accounting_families(result: Accounting | None) -> list[Metric]:
    """Families for one pass; None (no pass yet, or the pass failed) has none."""
    if result is None:
        return []
    share = gauge(
        "gpu_alloc_kernel_gpu_share_ratio",
        "Share (0-1) of a physical GPU a kernel holds: 1 for cuda.device, shares over the GPU's fractional capacity, "
        "a MIG slice's SMs over the GPU's (device_id is the GPU, also for MIG slices)",
        _PAIR,
    )
    for (kernel_id, gpu), value in sorted(result.shares.items()):
        share.add_metric([gpu, kernel_id], value)
    util = gauge(
        "gpu_alloc_kernel_measured_utilization_ratio",
        "SM utilisation of the kernel's processes on its allocated GPUs, averaged per allocated device (0-1); "
        "absent where any allocated device is not measured (MIG, a failed read)",
        ["kernel_id"],
    )
    memory = gauge(
        "gpu_alloc_kernel_measured_memory_ratio",
        "GPU memory the kernel's processes use over the memory it holds, averaged per allocated device "
        "(0-1: use beyond the share, where the plugin does not cap memory, counts as 1); absent where any allocated device is not measured",
        ["kernel_id"],
    )
    # Only measured kernels have a sample: sort those, not every kernel (this part renders at
    # every scrape, since its counters move, and would pay for sorting the unmeasured ones each time).
    measured = [(k, use) for k, use in result.kernels.items() if use.utilization_ratio is not None or use.memory_ratio is not None]
    for kernel_id, use in sorted(measured):
        if use.utilization_ratio is not None:
            util.add_metric([kernel_id], use.utilization_ratio)
        if use.memory_ratio is not None:
            memory.add_metric([kernel_id], use.memory_ratio)
    allocated = counter(
        "gpu_alloc_kernel_allocated_gpu_seconds",
        "GPU share held by a kernel, integrated over time (GPU-seconds; /3600 for GPU-hours; on an overcommitted GPU "
        "each share over the sum of its shares); integrated in the background at every telemetry sample, "
        "reset only when the exporter restarts",
        _PAIR,
    )
    for (kernel_id, gpu), value in sorted(result.allocated_seconds.items()):
        allocated.add_metric([gpu, kernel_id], value)
    families = [share, util, memory, allocated]
    for name, doc, values in _pair_counters(result):
        family = counter(name, doc, _PAIR)
        for (kernel_id, gpu), value in sorted(values.items()):
            family.add_metric([gpu, kernel_id], value)
        families.append(family)
    for name, doc, values in _device_counters(result):
        family = counter(name, doc, ["device_id"])
        for gpu, value in sorted(values.items()):
            family.add_metric([gpu], value)
        families.append(family)
    measured = gauge(_MEASURED[0], _MEASURED[1], ["device_id"])
    for gpu, flag in sorted(result.measured.items()):
        measured.add_metric([gpu], 1.0 if flag else 0.0)
    families.append(measured)
    for name, doc, values in _owner_counters(result):
        family = counter(name, doc, _OWNER)
        for owner, value in sorted(values.items()):
            family.add_metric(list(owner), value)
        families.append(family)
    return families


# The ledger's families (docs/metrics.md, "GPU ledger"): name without _total, help, values.
_OWNER = ["user_id", "project_id"]
_MEASURED = ("gpu_alloc_device_busy_measured",
             "1 where the last sample measured the busy time of the GPU's processes, else 0 "
             "(its kernels then have no busy sample, never 0)")


def _pair_counters(result: Accounting) -> list[tuple[str, str, Mapping]]:
    return [
        ("gpu_alloc_kernel_busy_gpu_seconds",
         "Busy seconds of the kernel's processes (the driver's cumulative per-process counters) times the share it holds, "
         "at most what it held (processes busy together beyond the interval are charged the share); absent where not measurable",
         result.busy_seconds),
        ("gpu_alloc_kernel_energy_joules",
         "The GPU's energy charged to the kernel, split per --accounting.energy-split; absent where the GPU's energy "
         "counter cannot be read", result.energy_joules),
    ]


def _device_counters(result: Accounting) -> list[tuple[str, str, Mapping]]:
    return [
        ("gpu_alloc_device_allocated_gpu_seconds",
         "Sum of the kernels' allocated GPU-seconds on the GPU, kept when they end", result.device_allocated_seconds),
        ("gpu_alloc_device_unallocated_gpu_seconds",
         "GPU-seconds of the GPU that no kernel held; allocated + unallocated = seconds the GPU was known",
         result.device_unallocated_seconds),
        ("gpu_alloc_device_busy_gpu_seconds",
         "Sum of the kernels' busy GPU-seconds on the GPU, kept when they end", result.device_busy_seconds),
        ("gpu_alloc_device_attributed_energy_joules",
         "Sum of the kernels' joules on the GPU, kept when they end", result.device_energy_joules),
        ("gpu_alloc_device_unattributed_energy_joules",
         "The GPU's joules charged to no kernel; attributed + unattributed = the energy counter's increase "
         "since the exporter first read it", result.device_unattributed_joules),
    ]


def _owner_counters(result: Accounting) -> list[tuple[str, str, Mapping]]:
    return [
        ("gpu_alloc_user_allocated_gpu_seconds",
         "Allocated GPU-seconds of the kernels of a user and project (Backend.AI's ids, undefined where unknown), "
         "kept while kernels come and go", result.owner_allocated_seconds),
        ("gpu_alloc_user_busy_gpu_seconds", "Busy GPU-seconds of the kernels of a user and project",
         result.owner_busy_seconds),
        ("gpu_alloc_user_energy_joules", "Joules charged to the kernels of a user and project", result.owner_energy_joules),
    ]


def accounting_health(result: Accounting | None) -> Health:
    """Failed until a pass has run, or when the last pass failed."""
    return Health(result is not None)


class AccountingText:
    """:func:`accounting_families` as exposition text, byte for byte, without prometheus_client's
    per-sample formatting, compressed (see :attr:`~exporter.metrics.collectors.Part.gzipped`).

    The counters move at every analysis pass, so this part is rendered again at nearly every
    scrape: at 10,000 kernels, 12,500 (kernel, GPU) pairs per family. A render writes and
    compresses only what moved since the last one:

    * each family's HELP and TYPE lines are a compressed piece of their own, made once in both
      formats: the OpenMetrics form is the same sample pieces behind other heads;
    * the share family's samples are kept in chunks of neighbouring pairs (:class:`ChunkedText`):
      a pass that moved a few kernels rewrites their chunks, one that moved none hands out the
      same mapping and nothing is compared; the measured-use families are kept while the uses
      are equal;
    * each pair's label text is built once and kept while the pair exists;
    * the ledger's per-pair counters (:class:`~exporter.analysis.model.DrivenCounters`) are
      computed in C loops over lists aligned with the exposition's order, kept while the
      ledger's tables are the same objects;
    * after a kernel change the ledger tells which pairs moved since the last render
      (:meth:`~exporter.analysis.model.Accounting.moved_since`): the pair order, the aligned
      lists and the share chunks are patched at those pairs, not made again from every pair.
    """

    def __init__(self, aside: Callable[[], None] = lambda: None) -> None:
        self._aside = aside  # called before each per-pair family (Inputs.aside)
        # (kernel_id, GPU) -> b'{device_id="…",kernel_id="…"}', with "%" doubled: a fragment of
        # a %-format (see _pair_text).
        self._pairs: dict[tuple[str, str], bytes] = {}
        self._order: list[tuple[str, str]] = []
        self._ordered_labels: list[bytes] = []  # the label of each pair of ``_order``
        # How the last render's order was made from the one before: None (anew), else the
        # (index, key) removed and then inserted, in that order (see _pair_labels).
        self._edits: tuple[list[int], list[tuple[int, tuple[str, str]]]] | None = None
        self._before: list[tuple[str, str]] = self._order  # the order ``_edits`` was applied to
        self._last: Accounting | None = None  # the result last rendered
        self._template: tuple[list[bytes] | None, bytes] = (None, b"")  # _ordered_labels -> every pair's line, "%s{…} %s\n"
        self._pair_sources: tuple = ()  # the key tables ``_order`` was built from (compared by identity)
        self._kernels: dict[str, str] = {}  # kernel_id -> '{kernel_id="…"}'
        self._labels: dict[tuple[str, ...], str] = {}  # a GPU's or an owner's label text (a few dozen)
        self._heads: list[tuple[str, Deflated, Deflated]] | None = None  # per family: name, head pieces (text, OpenMetrics)
        self._samples: list[Deflated] = []  # the last render's samples piece per family (EMPTY: no sample)
        # The share samples' piece and the shares it was written from; the measured-use families'
        # pieces and the uses they were written from.
        self._shares: tuple[Mapping | None, Deflated] = (None, EMPTY)
        self._uses: tuple[Mapping | None, list[Deflated]] = (None, [])
        # Per-pair counter family -> what its values were aligned from, and the aligned lists.
        self._aligned: dict[int, tuple[tuple, _Aligned | None]] = {}
        self._share_chunks = ChunkedText(1, gzipped=True)  # the share family's samples
        self._share_joiner = Joiner()

    def render(self, result: Accounting | None) -> Deflated:
        """The families' text, compressed; :meth:`openmetrics` then gives the same render in
        OpenMetrics 1.0."""
        if result is None:
            self._samples = []
            return EMPTY
        heads = self._heads_made()
        names = [name for name, _, _ in heads]
        self._aside()
        moved = result.moved_since(self._last) if self._last is not None else None
        order, labels = self._pair_labels(result, moved)
        samples = [self._share_piece(names[0], result.shares, moved)]
        samples += self._use_pieces(result.kernels, names[1], names[2])
        per_pair = [result.allocated_seconds] + [values for _, _, values in _pair_counters(result)]
        texts = []
        for i, counters in enumerate(per_pair, start=3):  # each ~3-5 ms at 12,500 pairs, in long C loops
            self._aside()
            texts.append(self._pair_text(names[i].encode(), self._pair_values(i, counters, order, moved), labels))
        self._last = result
        i = 3 + len(per_pair)
        rows = [(("device_id",), {(gpu,): v for gpu, v in values.items()}) for _, _, values in _device_counters(result)]
        rows.append((("device_id",), {(gpu,): 1.0 if flag else 0.0 for gpu, flag in result.measured.items()}))
        rows += [(_OWNER, values) for _, _, values in _owner_counters(result)]
        fmt = float_format()
        for j, (label_names, values) in enumerate(rows, start=i):
            texts.append("".join(f"{names[j]}{self._label(label_names, key)} {fmt(v)}\n"
                                 for key, v in sorted(values.items())).encode())
        samples += [deflate(text) for text in texts]
        self._samples = samples
        return _joined(heads, samples, 1)

    def openmetrics(self) -> Deflated:
        """The last render in OpenMetrics 1.0 (less ``# EOF``), without ``_created``, compressed."""
        return _joined(self._heads, self._samples, 2) if self._samples else EMPTY

    def _heads_made(self) -> list[tuple[str, Deflated, Deflated]]:
        if self._heads is None:
            from exporter.metrics.registry import render_families  # prometheus_client: loaded to render only

            heads = [render_families([family]) for family in accounting_families(Accounting())]
            # Samples read the same in both formats; only each family's HELP, TYPE and UNIT lines differ.
            self._heads = [(h.split(b" ", 3)[2].decode(), deflate(h), deflate(openmetrics_text(h))) for h in heads]
        return self._heads

    def _share_piece(self, name: str, shares: Mapping[tuple[str, str], float], moved: frozenset | None) -> Deflated:
        """The share family's samples: kept in chunks of neighbouring pairs (:class:`ChunkedText`),
        so that a pass that moved a few kernels writes and compresses their chunks only (told
        which pairs moved, it looks at no other), and not looked at while the ledger hands out
        the same mapping."""
        if self._shares[0] is not shares:
            fmt, prefix = float_format(), name.encode().replace(b"%", b"%%")
            pieces = self._share_chunks.render(
                shares, lambda key, share: ((prefix + self._pair_label(key) + b" %s\n") % fmt(share).encode(),), moved)[0]
            self._shares = (shares, self._share_joiner(pieces))
        return self._shares[1]

    def _use_pieces(self, uses: Mapping, util_name: str, memory_name: str) -> list[Deflated]:
        """The measured-use families' samples, written again only when the uses differ (compared in
        C: a ledger pass that moved a few kernels hands out a new mapping of the same uses)."""
        kept, pieces = self._uses
        if kept is None or (kept is not uses and kept != uses):
            measured = sorted((k, use) for k, use in uses.items()
                              if use.utilization_ratio is not None or use.memory_ratio is not None)
            fmt = float_format()
            texts = [
                "".join(f"{util_name}{self._kernel_labels(k)} {fmt(use.utilization_ratio)}\n"
                        for k, use in measured if use.utilization_ratio is not None),
                "".join(f"{memory_name}{self._kernel_labels(k)} {fmt(use.memory_ratio)}\n"
                        for k, use in measured if use.memory_ratio is not None),
            ]
            pieces = [deflate(text.encode()) for text in texts]
            self._uses = (uses, pieces)
        return list(pieces)

    def _pair_values(self, family: int, values: Mapping[tuple[str, str], float], order: list[tuple[str, str]],
                     moved: frozenset | None) -> list:
        """The family's value of each pair of ``order`` (None: it has none; no value: it has no
        pair). ``moved``: the pairs whose terms moved since the last render, if known."""
        if not values:
            return []
        if isinstance(values, DrivenCounters):
            base, splits, drive = values.terms()
            known, aligned = self._aligned.get(family, ((), None))
            if len(known) != 3 or known[0] is not base or known[1] is not splits or known[2] is not order:
                patched = None
                if aligned is not None and moved is not None and self._edits is not None and known[2] is self._before:
                    patched = aligned.patched(base, splits, order, self._edits, moved)
                aligned = patched or _Aligned.of(base, splits, order)
                self._aligned[family] = ((base, splits, order), aligned)
            if aligned is not None:
                return aligned.values(drive)
        return list(map(dict(values.items()).get, order))  # one pass over counters computed when read

    def _pair_text(self, name: bytes, found: list, labels: list[bytes]) -> bytes:
        """The sample lines of one per-pair family, in the exposition's order (``found``: each
        pair's value, None for a pair it lacks). At 10,000 kernels a render writes tens of
        thousands of them: one ``%`` over a template of every pair's line (``%s{labels} %s``,
        joined in C from the labels, which are %-format fragments; for a family with a value for
        every pair made once per pair order and shared by the families), one C loop instead of a
        join of a string per line (BENCHMARKS.md, figures behind design decisions)."""
        if not found:
            return b""
        if None in found:  # a family of some pairs only (busy time, energy)
            kept = [(label, value) for label, value in zip(labels, found, strict=True) if value is not None]
            template = _template([label for label, _ in kept])
            return template % tuple(chain.from_iterable(zip(repeat(name), float_texts([value for _, value in kept]))))
        if self._template[0] is not labels:
            self._template = (labels, _template(labels))
        return self._template[1] % tuple(chain.from_iterable(zip(repeat(name), float_texts(found))))

    def _label(self, names: tuple[str, ...] | list[str], values: tuple[str, ...]) -> str:
        key = (*names, *values)
        text = self._labels.get(key)
        if text is None:
            if len(self._labels) > 4096:  # owners accumulate over the process's life: stay bounded
                self._labels.clear()
            # Label names in sorted order, as the exposition writes them.
            inner = ",".join(f'{n}="{escape_label(v)}"' for n, v in sorted(zip(names, values, strict=True)))
            text = self._labels[key] = f"{{{inner}}}"
        return text

    def _pair_labels(self, result: Accounting, moved: frozenset | None) -> tuple[list[tuple[str, str]], list[bytes]]:
        """Every pair in the exposition's order (kernel, then GPU: the order of sorting the
        families' keys) and each one's label in that order, both kept while the pairs are the
        same (known without a look at them while the tables are the same objects). New lists
        when pairs come or go: what was derived from the old ones tells by identity, and
        ``_edits`` says how the new order was made from the one before (``_before``).

        ``moved``: the only pairs that may have come or gone since the last render, if known;
        else every table's keys are compared with the pairs known."""
        sources = tuple(values.terms()[0] if isinstance(values, DrivenCounters) else values
                        for values in (result.shares, result.allocated_seconds, result.busy_seconds, result.energy_joules))
        self._before, self._edits = self._order, ([], [])
        if len(self._pair_sources) == len(sources) and all(a is b for a, b in zip(self._pair_sources, sources, strict=True)):
            return self._order, self._ordered_labels
        tables = (result.shares.keys(), result.allocated_seconds.keys(), result.busy_seconds.keys(),
                  result.energy_joules.keys())
        if moved is not None:  # (each side a set: a dict's keys on the right would be walked whole)
            now = {key for key in moved if any(key in keys for keys in tables)}
            came, gone = {key for key in now if key not in self._pairs}, {key for key in moved - now if key in self._pairs}
        else:
            keys = tables[0] | tables[1] | tables[2] | tables[3]
            came, gone = keys - self._pairs.keys(), self._pairs.keys() - keys
        if len(came) + len(gone) > _MOVED_APART:  # many: the order made anew
            for key in gone:
                del self._pairs[key]
            self._order = sorted(self._pairs.keys() | came)
            self._ordered_labels = list(map(self._pair_label, self._order))
            self._edits = None
        elif came or gone:  # a few: moved in copies of the sorted lists (a copy is ~0.1 ms, a sort ~10 ms)
            order, labels, removed, inserted = list(self._order), list(self._ordered_labels), [], []
            for key in gone:
                at = bisect_left(order, key)
                del order[at], labels[at]
                del self._pairs[key]
                removed.append(at)
            for key in came:
                at = bisect_left(order, key)
                order.insert(at, key)
                labels.insert(at, self._pair_label(key))
                inserted.append((at, key))
            self._order, self._ordered_labels, self._edits = order, labels, (removed, inserted)
        self._pair_sources = sources
        return self._order, self._ordered_labels

    def _pair_label(self, key: tuple[str, str]) -> bytes:
        text = self._pairs.get(key)
        if text is None:
            text = self._pairs[key] = _pair_label_text(key)
        return text

    def _kernel_labels(self, kernel_id: str) -> str:
        text = self._kernels.get(kernel_id)
        if text is None:
            if len(self._kernels) > 4 * max(len(self._pairs), 64):  # measured kernels come and go: stay bounded
                self._kernels.clear()
            text = self._kernels[kernel_id] = f'{{kernel_id="{escape_label(kernel_id)}"}}'
        return text


class _Aligned:
    """A per-pair family's ledger terms in the exposition's order: the counters of a render are
    then ``base + fraction × drive[GPU]`` in three ``map`` loops, not a dict lookup and a split
    per pair. Made for the families whose pairs each grow on one GPU at most (the ledger's
    per-pair ones); None from :meth:`of` otherwise, and where a pair of the order has no counter."""

    __slots__ = ("_bases", "_fractions", "_gpus")

    def __init__(self, bases: list[float], gpus: list[str | None], fractions: list[float]) -> None:
        self._bases, self._gpus, self._fractions = bases, gpus, fractions

    @classmethod
    def of(cls, base: Mapping, splits: Mapping, order: list[tuple[str, str]]) -> _Aligned | None:
        bases = list(map(base.get, order))
        if len(base) != len(order) or None in bases:
            return None
        found = list(map(splits.get, order, repeat(())))
        if max(map(len, found), default=0) > 1:
            return None
        firsts = [split[0] if split else (None, 0.0) for split in found]  # none: grows by 0 × nothing
        return cls(bases, list(map(itemgetter(0), firsts)), list(map(itemgetter(1), firsts)))

    def patched(self, base: Mapping, splits: Mapping, order: list[tuple[str, str]],
                edits: tuple[list[int], list[tuple[int, tuple[str, str]]]], moved: frozenset) -> _Aligned | None:
        """These lists for the ``base`` and ``splits`` of a later result, in ``order``: the pair
        order's ``edits`` applied (removals, then insertions, as ``_pair_labels`` made them), then
        the entries of the ``moved`` pairs (every inserted pair is one) read again. The other
        pairs' terms are the same (:meth:`~exporter.analysis.model.Accounting.moved_since`).
        None where :meth:`of` would give None."""
        if len(base) != len(order):
            return None
        bases, gpus, fractions = list(self._bases), list(self._gpus), list(self._fractions)
        removed, inserted = edits
        for at in removed:
            del bases[at], gpus[at], fractions[at]
        for at, _ in inserted:
            bases.insert(at, 0.0)
            gpus.insert(at, None)
            fractions.insert(at, 0.0)
        for key in moved:
            at = bisect_left(order, key)
            if at == len(order) or order[at] != key:
                continue
            value, split = base.get(key), splits.get(key, ())
            if value is None or len(split) > 1:
                return None
            bases[at] = value
            gpus[at], fractions[at] = split[0] if split else (None, 0.0)
        return _Aligned(bases, gpus, fractions)

    def values(self, drive: Mapping[str, float]) -> list[float]:
        # The sum DrivenCounters computes for a one-GPU split, in its order: base + fraction × drive.
        return list(map(add, self._bases, map(mul, self._fractions, map(drive.get, self._gpus, repeat(0.0)))))


def _pair_label_text(key: tuple[str, str]) -> bytes:
    """A pair's labels as a %-format fragment ("%" doubled)."""
    return f'{{device_id="{escape_label(key[1])}",kernel_id="{escape_label(key[0])}"}}'.replace("%", "%%").encode()


def _template(labels: list[bytes]) -> bytes:
    """``%s{labels} %s\n`` for each of ``labels`` (%-format fragments), joined in C."""
    return b"%s" + b" %s\n%s".join(labels) + b" %s\n" if labels else b""


def _joined(heads: list[tuple[str, Deflated, Deflated]], samples: list[Deflated], form: int) -> Deflated:
    """Each family's head piece (``form`` 1: text, 2: OpenMetrics) before its samples piece."""
    return joined(piece for head, sample in zip(heads, samples, strict=True) for piece in (head[form], sample))


@register("accounting", "GPU share per kernel, measured use over what it holds, chargeback counters", order=60)
def _accounting(inputs: Inputs) -> list[Part]:
    text = AccountingText(inputs.aside)
    return [Part("accounting", lambda: accounting_families(inputs.model().accounting), lambda: inputs.model().usage_version,
                 text=lambda: text.render(inputs.model().accounting), gzipped=True,
                 health=lambda: accounting_health(inputs.model().accounting), openmetrics=text.openmetrics, ahead=True)]
