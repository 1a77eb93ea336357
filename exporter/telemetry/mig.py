"""MIG geometry: which GPU instances can still be created on a GPU, given those that exist.

Pure functions, no NVML and no I/O. A GPU instance occupies ``[start, start + size)`` on the
memory-slice axis (8 slices; 4 on the A30); each profile has fixed legal starts. How many more
instances of a profile fit is a greedy pass over its legal starts (optimal for equal-sized
intervals), capped by the profile's instance limit. Per-profile numbers are alternatives, not
jointly achievable.

NVML's own answers win when given (``nvmlDeviceGetGpuInstanceRemainingCapacity``,
``nvmlDeviceGetGpuInstancePossiblePlacements``): the built-in tables (NVIDIA MIG User Guide,
``nvidia-smi mig -lgip/-lgipp``) are the fallback for unprivileged reads.

HAMi's device-config ``knownMigGeometries`` (lists of ``{name, memory, count}`` templates per GPU
model) is accepted as a source of allowed geometries; :func:`reachable_geometries` says which of
them can still be reached by creating instances, without destroying any.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "BUILTIN_TABLES",
    "GpuInstance",
    "HamiGeometry",
    "HamiModel",
    "MigLayoutError",
    "MigProfile",
    "MigTable",
    "creatable_instances",
    "hami_geometries_for",
    "parse_hami_geometries",
    "reachable_geometries",
    "table_for_product",
]


@dataclass(frozen=True, slots=True)
class MigProfile:
    """One GPU-instance profile of one SKU.

    :param name: nvidia-smi name without ``MIG `` (``1g.10gb``, ``1g.10gb+me``).
    :param profile_id: NVML profile ID (``info.id``: 19, 20, 15, 14, 9, 5, 0 on A100/H100).
    :param memory_slices: slices occupied on the memory axis (``placement.size``).
    :param compute_slices: compute slices (the ``Ng`` of the name).
    :param max_instances: NVML ``instanceCount``.
    :param starts: legal ``placement.start`` values.
    """

    name: str
    profile_id: int
    memory_slices: int
    compute_slices: int
    max_instances: int
    starts: tuple[int, ...]


@dataclass(frozen=True)
class MigTable:
    """A SKU's MIG geometry."""

    sku: str
    memory_slices: int
    profiles: tuple[MigProfile, ...]

    def profile(self, key: str | int) -> MigProfile:
        """The profile by name or NVML profile ID; KeyError if this SKU has none."""
        for p in self.profiles:
            if p.name == key or p.profile_id == key:
                return p
        raise KeyError(f"{self.sku} has no MIG profile {key!r}")


def _eight_slice(sku: str, names: Sequence[str]) -> MigTable:
    """A100/H100/H200 layout: 8 memory slices, same IDs, counts and legal starts on every SKU."""
    shapes = (  # (profile ID, memory slices, compute slices, max instances, starts)
        (19, 1, 1, 7, (0, 1, 2, 3, 4, 5, 6)),
        (20, 1, 1, 1, (0, 1, 2, 3, 4, 5, 6)),  # +me: shares slices with the plain 1g, at most 1
        (15, 2, 1, 4, (0, 2, 4, 6)),
        (14, 2, 2, 3, (0, 2, 4)),
        (9, 4, 3, 2, (0, 4)),  # 3g takes 4 memory slices
        (5, 4, 4, 1, (0,)),
        (0, 8, 7, 1, (0,)),
    )
    return MigTable(sku, 8, tuple(MigProfile(n, *shape) for n, shape in zip(names, shapes, strict=True)))


BUILTIN_TABLES: Mapping[str, MigTable] = {
    t.sku: t
    for t in (
        MigTable(
            "A30-24GB",
            4,
            (
                MigProfile("1g.6gb", 14, 1, 1, 4, (0, 1, 2, 3)),
                MigProfile("1g.6gb+me", 21, 1, 1, 1, (0, 1, 2, 3)),
                MigProfile("2g.12gb", 5, 2, 2, 2, (0, 2)),
                MigProfile("2g.12gb+me", 6, 2, 2, 1, (0, 2)),
                MigProfile("4g.24gb", 0, 4, 4, 1, (0,)),
            ),
        ),
        _eight_slice("A100-40GB", ("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb")),
        _eight_slice("A100-80GB", ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")),
        _eight_slice("H100-80GB", ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")),
        _eight_slice("H100-94GB", ("1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb")),
        _eight_slice("H100-96GB", ("1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb")),
        _eight_slice("H200-141GB", ("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb")),
    )
}

# Product names as NVML reports them (``NVIDIA A100-SXM4-80GB``, ``NVIDIA H100 NVL``,
# ``NVIDIA GH200 480GB``); first match wins, so the more specific patterns come first.
_PRODUCTS = (
    (re.compile(r"\bA30\b"), "A30-24GB"),
    (re.compile(r"A100.*80GB"), "A100-80GB"),
    (re.compile(r"A100"), "A100-40GB"),
    (re.compile(r"GH200"), "H100-96GB"),
    (re.compile(r"H200"), "H200-141GB"),
    (re.compile(r"H100.*(94GB|NVL)"), "H100-94GB"),
    (re.compile(r"H100"), "H100-80GB"),
)


def table_for_product(product_name: str) -> MigTable | None:
    """The built-in table for an NVML product name, or None for a SKU without one."""
    for pattern, sku in _PRODUCTS:
        if pattern.search(product_name):
            return BUILTIN_TABLES[sku]
    return None


class MigLayoutError(ValueError):
    """The described GPU instances cannot coexist (overlap, illegal start, unknown profile)."""


@dataclass(frozen=True, slots=True)
class GpuInstance:
    """An existing GPU instance: its profile (name or NVML ID) and ``placement.start``. The size
    comes from the profile; NVML's ``placement.size`` may be given to cross-check it."""

    profile: str | int
    start: int
    size: int | None = None


def _mask(start: int, size: int) -> int:
    return ((1 << size) - 1) << start


def _occupied(table: MigTable, instances: Iterable[GpuInstance]) -> tuple[int, Counter[str]]:
    mask, counts = 0, Counter[str]()
    for gi in instances:
        try:
            profile = table.profile(gi.profile)
        except KeyError as exc:
            raise MigLayoutError(str(exc)) from None
        size = profile.memory_slices
        if gi.size is not None and gi.size != size:
            raise MigLayoutError(f"{profile.name} at {gi.start} reports size {gi.size}, expected {size}")
        if gi.start + size > table.memory_slices or gi.start < 0:
            raise MigLayoutError(f"{profile.name} at {gi.start} runs past {table.memory_slices} slices")
        if mask & _mask(gi.start, size):
            raise MigLayoutError(f"{profile.name} at {gi.start} overlaps another instance")
        mask |= _mask(gi.start, size)
        counts[profile.name] += 1
    return mask, counts


def creatable_instances(
    table: MigTable,
    instances: Iterable[GpuInstance],
    *,
    remaining: Mapping[str, int] | None = None,
    placements: Mapping[str, Sequence[tuple[int, int]]] | None = None,
) -> dict[str, int]:
    """How many more instances of each profile could be created, each on its own (profile name →
    count).

    :param instances: the GPU instances that exist (placements from ``nvmlGpuInstanceGetInfo``).
    :param remaining: NVML ``GetGpuInstanceRemainingCapacity`` per profile name; taken as is.
    :param placements: NVML ``GetGpuInstancePossiblePlacements`` per profile name as
        ``(start, size)``; replaces the table's legal starts.
    :raises MigLayoutError: when the instances cannot coexist on this SKU.
    """
    occupied, counts = _occupied(table, instances)
    result = {}
    for p in table.profiles:
        if remaining is not None and p.name in remaining:
            result[p.name] = remaining[p.name]
            continue
        legal = placements[p.name] if placements and p.name in placements else [(s, p.memory_slices) for s in p.starts]
        free, fits = occupied, 0
        for start, size in sorted(legal):
            if not free & _mask(start, size):
                free |= _mask(start, size)
                fits += 1
        result[p.name] = max(0, min(fits, p.max_instances - counts[p.name]))
    return result


# --- HAMi knownMigGeometries ------------------------------------------------------------------


@dataclass(frozen=True)
class HamiGeometry:
    """One allowed geometry: its templates as HAMi spells them, and a label for metrics (the
    Volcano group name, else ``name:count,…``)."""

    label: str
    counts: tuple[tuple[str, int, int], ...]  # (profile name, memory MiB, instance count)


@dataclass(frozen=True)
class HamiModel:
    """A ``knownMigGeometries`` entry: the models it applies to and their allowed geometries."""

    models: tuple[str, ...]
    geometries: tuple[HamiGeometry, ...]


def parse_hami_geometries(text: str) -> list[HamiModel]:
    """Parse HAMi's device-config YAML: the whole file (``nvidia: {knownMigGeometries: ...}``),
    a mapping with ``knownMigGeometries``, or the bare list. Each allowed geometry is a list of
    ``{name, memory, count}`` templates, or ``{group, geometries: [...]}`` as Volcano writes it.

    :raises ValueError: when the text is not that shape; the message names the place (entry and
        geometry numbers, from 1), never the file's content.
    """
    import yaml  # here: a start without a HAMi config need not pay for importing PyYAML

    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"not valid YAML{at}") from None
    except RecursionError:
        raise ValueError("not valid YAML (nested too deeply)") from None
    if isinstance(doc, dict):
        doc = doc.get("nvidia", doc)
        doc = doc.get("knownMigGeometries") if isinstance(doc, dict) else None
    if not isinstance(doc, list):
        raise ValueError("no knownMigGeometries list found")
    models = []
    for i, entry in enumerate(doc, start=1):
        if not isinstance(entry, dict) or not isinstance(entry.get("models"), list):
            raise ValueError(f"knownMigGeometries entry {i} has no models list")
        geometries = []
        allowed = entry.get("allowedGeometries") or []
        if not isinstance(allowed, list):
            raise ValueError(f"knownMigGeometries entry {i}: allowedGeometries is not a list")
        for j, raw in enumerate(allowed, start=1):
            where = f"knownMigGeometries entry {i}, allowed geometry {j}"
            group = None
            if isinstance(raw, dict):
                group, raw = raw.get("group"), raw.get("geometries")
            if not isinstance(raw, list) or not all(isinstance(t, dict) and "name" in t for t in raw):
                raise ValueError(f"{where} is not a list of {{name, memory, count}}")
            try:
                counts = tuple((str(t["name"]), _whole(t.get("memory", 0)), _whole(t.get("count", 1))) for t in raw)
            except ValueError:
                raise ValueError(f"{where}: memory and count must be whole numbers") from None
            label = group or ",".join(f"{name}:{count}" for name, _, count in counts)
            geometries.append(HamiGeometry(str(label), counts))
        models.append(HamiModel(tuple(str(m) for m in entry["models"]), tuple(geometries)))
    return models


def _whole(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError("not a whole number")
    number = int(value)  # ValueError for "abc"
    if number < 0:
        raise ValueError("negative")
    return number


def hami_geometries_for(models: Sequence[HamiModel], product_name: str) -> tuple[HamiGeometry, ...]:
    """HAMi's rule: the first entry with a model that is a substring of the product name."""
    for entry in models:
        if any(m in product_name for m in entry.models):
            return entry.geometries
    return ()


_NAME = re.compile(r"^(\d+)g\.(\d+)gb(\+me)?$")  # 1g.10gb, 1g.10gb+me


def _resolve(table: MigTable, name: str, memory_mib: int) -> MigProfile | None:
    """Map a HAMi template name to a profile: exact name, else the one profile with the same
    compute slices (HAMi lists ``7g.79gb`` for NVIDIA's ``7g.80gb``), else the nearest in size."""
    try:
        return table.profile(name)
    except KeyError:
        pass
    m = _NAME.match(name)
    if not m:
        return None
    same = []
    for p in table.profiles:
        pm = _NAME.match(p.name)
        if pm and pm.group(1) == m.group(1) and pm.group(3) == m.group(3):
            same.append((int(pm.group(2)), p))
    if len(same) <= 1:
        return same[0][1] if same else None
    wanted = memory_mib / 1024 if memory_mib else int(m.group(2))
    return min(same, key=lambda gb_profile: abs(gb_profile[0] - wanted))[1]


def reachable_geometries(
    table: MigTable, instances: Iterable[GpuInstance], geometries: Iterable[HamiGeometry]
) -> dict[str, bool | None]:
    """For each allowed geometry (by label): can it be reached by only creating instances?

    False when an existing instance is not part of it, or when the missing instances cannot all
    be placed on the free slices together; None when a template names a profile this SKU lacks.
    """
    occupied, existing = _occupied(table, instances)
    result: dict[str, bool | None] = {}
    for geometry in geometries:
        wanted = _wanted(table, geometry)
        if wanted is None:
            result[geometry.label] = None
        elif existing - wanted or any(n > table.profile(p).max_instances for p, n in wanted.items()):
            result[geometry.label] = False
        else:
            todo = sorted((table.profile(n) for n in (wanted - existing).elements()), key=lambda p: -p.memory_slices)
            result[geometry.label] = _fits_together(todo, occupied)
    return result


def _wanted(table: MigTable, geometry: HamiGeometry) -> Counter[str] | None:
    wanted: Counter[str] = Counter()
    for name, memory, count in geometry.counts:
        profile = _resolve(table, name, memory)
        if profile is None:
            return None
        wanted[profile.name] += count
    return wanted


def _fits_together(todo: Sequence[MigProfile], occupied: int) -> bool:
    """Backtracking placement of every profile in ``todo`` (largest first) on the free slices."""
    if not todo:
        return True
    head, rest = todo[0], todo[1:]
    for start in head.starts:
        m = _mask(start, head.memory_slices)
        if not occupied & m and _fits_together(rest, occupied | m):
            return True
    return False
