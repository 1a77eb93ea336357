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

from collections.abc import Mapping
from typing import TYPE_CHECKING

from exporter.analysis.model import Accounting
from exporter.metrics.collectors import Inputs, Part, register
from exporter.metrics.families import counter, escape_label, float_format, float_texts, gauge
from exporter.metrics.status import Health
from exporter.metrics.text import openmetrics_text

if TYPE_CHECKING:
    from prometheus_client.core import Metric

__all__ = ["AccountingText", "accounting_families", "accounting_health"]

_PAIR = ["device_id", "kernel_id"]


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
    per-sample formatting.

    The counters move at every analysis pass, so this part is rendered again at nearly every
    scrape; at thousands of kernels the generic renderer escapes and joins every sample's labels
    each time. Here each (kernel, GPU) pair's label text is built once and kept while the pair
    exists, the HELP and TYPE lines come from the generic renderer (rendered once, empty), and a
    render only formats the values.
    """

    def __init__(self) -> None:
        self._pairs: dict[tuple[str, str], str] = {}  # (kernel_id, GPU) -> '{device_id="…",kernel_id="…"}'
        self._order: list[tuple[str, str]] = []
        self._ordered_labels: list[str] = []  # the label text of each pair of ``_order``
        self._kernels: dict[str, str] = {}  # kernel_id -> '{kernel_id="…"}'
        self._labels: dict[tuple[str, ...], str] = {}  # a GPU's or an owner's label text (a few dozen)
        self._heads: list[str] | None = None  # each family's HELP and TYPE lines, in order
        self._om_heads: list[str] = []  # the same in OpenMetrics (with UNIT where the name says one)
        self._openmetrics = b""  # the last render's OpenMetrics form
        # The share lines of the last render and what they were written from: shares change only
        # with the allocation, while every other per-pair counter moves with time.
        self._shares: tuple[Mapping | None, list | None, list[str]] = (None, None, [])

    def render(self, result: Accounting | None) -> bytes:
        """The families' text; :meth:`openmetrics` then gives the same render in OpenMetrics 1.0."""
        if result is None:
            self._openmetrics = b""
            return b""
        if self._heads is None:
            from exporter.metrics.registry import render_families  # prometheus_client: loaded to render only

            heads = [render_families([family]) for family in accounting_families(Accounting())]
            self._heads = [h.decode() for h in heads]
            # Samples read the same in both formats; only each family's HELP, TYPE and UNIT lines differ.
            self._om_heads = [openmetrics_text(h).decode() for h in heads]
        fmt = float_format()
        heads = self._heads
        names = [line.split(" ", 3)[2] for line in heads]
        out: list[str] = []
        at: list[int] = []  # where each family's head is in ``out``, family by family

        def head(i: int) -> None:
            at.append(len(out))
            out.append(heads[i])

        order, labels = self._pair_labels(result)
        head(0)
        out += self._share_lines(names[0], result.shares, order, labels)
        measured = sorted((k, use) for k, use in result.kernels.items()
                          if use.utilization_ratio is not None or use.memory_ratio is not None)
        head(1)
        out += [f"{names[1]}{self._kernel_labels(k)} {fmt(use.utilization_ratio)}\n"
                for k, use in measured if use.utilization_ratio is not None]
        head(2)
        out += [f"{names[2]}{self._kernel_labels(k)} {fmt(use.memory_ratio)}\n"
                for k, use in measured if use.memory_ratio is not None]
        per_pair = [result.allocated_seconds] + [values for _, _, values in _pair_counters(result)]
        i = 3
        for counters in per_pair:
            head(i)
            out += _pair_lines(names[i], counters, order, labels)
            i += 1
        for _, _, values in _device_counters(result):
            head(i)
            out += [f"{names[i]}{self._label(('device_id',), (gpu,))} {fmt(v)}\n" for gpu, v in sorted(values.items())]
            i += 1
        head(i)
        out += [f"{names[i]}{self._label(('device_id',), (gpu,))} {fmt(1.0 if flag else 0.0)}\n"
                for gpu, flag in sorted(result.measured.items())]
        i += 1
        for _, _, values in _owner_counters(result):
            head(i)
            out += [f"{names[i]}{self._label(_OWNER, owner)} {fmt(v)}\n" for owner, v in sorted(values.items())]
            i += 1
        text = "".join(out).encode()
        for family, position in enumerate(at):
            out[position] = self._om_heads[family]
        self._openmetrics = "".join(out).encode()
        return text

    def openmetrics(self) -> bytes:
        """The last render in OpenMetrics 1.0 (less ``# EOF``), without ``_created``."""
        return self._openmetrics

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

    def _pair_labels(self, result: Accounting) -> tuple[list[tuple[str, str]], list[str]]:
        """Every pair in the exposition's order (kernel, then GPU: the order of sorting the
        families' keys) and each one's label text in that order, both kept while the pairs are
        the same."""
        keys = result.shares.keys() | result.allocated_seconds.keys() | result.busy_seconds.keys() | result.energy_joules.keys()
        if keys != self._pairs.keys():  # kernels came or went: drop the others' labels, add the new ones
            self._pairs = {key: self._pairs.get(key) or f'{{device_id="{escape_label(key[1])}",kernel_id="{escape_label(key[0])}"}}'
                           for key in keys}
            self._order = sorted(keys)
            self._ordered_labels = list(map(self._pairs.__getitem__, self._order))
        return self._order, self._ordered_labels

    def _share_lines(self, name: str, shares: Mapping[tuple[str, str], float], order: list[tuple[str, str]],
                     labels: list[str]) -> list[str]:
        """The share family's lines: the last render's while the pairs and their shares are the
        same (compared in C: ~1 ms against ~10 ms to write 12,500 lines)."""
        seen, seen_order, lines = self._shares
        if not (order is seen_order and (shares is seen or shares == seen)):
            lines = _pair_lines(name, shares, order, labels)
            self._shares = (shares, order, lines)
        return lines

    def _kernel_labels(self, kernel_id: str) -> str:
        text = self._kernels.get(kernel_id)
        if text is None:
            if len(self._kernels) > 4 * max(len(self._pairs), 64):  # measured kernels come and go: stay bounded
                self._kernels.clear()
            text = self._kernels[kernel_id] = f'{{kernel_id="{escape_label(kernel_id)}"}}'
        return text


def _pair_lines(name: str, values: Mapping[tuple[str, str], float], order: list[tuple[str, str]],
                labels: list[str]) -> list[str]:
    """The sample lines of one per-pair family, in the exposition's order: at 10,000 kernels a
    render writes tens of thousands of them, so the loops run in ``map`` and ``str.join``."""
    if not values:
        return []
    found = list(map(dict(values.items()).get, order))  # one pass over counters computed when read
    if len(values) != len(order):  # a family of some pairs only (busy time, energy): the others are None
        kept = [(label, value) for label, value in zip(labels, found, strict=True) if value is not None]
        labels, found = [label for label, _ in kept], [value for _, value in kept]
    # name{labels} value\n, for every pair: the label text and value joined by a space, the lines
    # by a newline and the name.
    return [name, f"\n{name}".join(map(" ".join, zip(labels, float_texts(found), strict=True))), "\n"]


@register("accounting", "GPU share per kernel, measured use over what it holds, chargeback counters", order=60)
def _accounting(inputs: Inputs) -> list[Part]:
    text = AccountingText()
    return [Part("accounting", lambda: accounting_families(inputs.model().accounting), lambda: inputs.model().usage_version,
                 text=lambda: text.render(inputs.model().accounting),
                 health=lambda: accounting_health(inputs.model().accounting), openmetrics=text.openmetrics)]
