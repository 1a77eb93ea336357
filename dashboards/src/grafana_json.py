"""A small builder for Grafana dashboard JSON: plain dicts, no dependency, deterministic output.

Only keys that Grafana's dashboard schema (npm ``@grafana/schema``, ``Dashboard``) defines are
written, so the output also passes the *strict* variant of that schema, which catches misspelled
keys. Panels are laid out left to right on the 24-column grid and wrap to a new line; a row
starts a new line. Panel ids are assigned in order, starting at 1.

Every PromQL target goes through :class:`Target`, which also records which queries may
legitimately return nothing (``empty_ok``, with the reason) for the end-to-end test.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DATASOURCE",
    "SCHEMA_VERSION",
    "Dashboard",
    "Panel",
    "Target",
    "custom_var",
    "datasource_var",
    "dumps",
    "query_var",
]

# Grafana 10.4 / 11.0 write schemaVersion 39; newer Grafana migrates it on load.
SCHEMA_VERSION = 39
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Grafana's import dialog asks for a data source for every entry of ``__inputs`` and replaces
# ``${DS_PROMETHEUS}`` in the JSON with its uid: here the default of the ``datasource`` variable.
# File provisioning skips the dialog; the variable then falls back to the default data source.
DS_INPUT = "DS_PROMETHEUS"
INPUTS = [{"name": DS_INPUT, "label": "Prometheus", "description": "Prometheus (or VictoriaMetrics) holding the gpu-alloc series",
           "type": "datasource", "pluginId": "prometheus", "pluginName": "Prometheus"}]
GRID_COLUMNS = 24

# Colours by name so a reader of the JSON sees intent, not hex codes.
OK, WARN, BAD, INFO, GREY = "green", "orange", "red", "blue", "text"


@dataclass(frozen=True)
class Target:
    """One PromQL query of a panel.

    :param legend: ``legendFormat``; the tests require ``{{instance}}`` in it unless ``fleet``.
    :param instant: an instant query (tables, stats, bar gauges) instead of a range query.
    :param table: ``format: table`` (one row per series, labels as columns).
    :param empty_ok: why this query may return no series on a healthy node (the end-to-end test
        then only requires its metrics to exist); None means it must return data.
    :param fleet: the result is a fleet-wide aggregate without an ``instance`` label.
    """

    expr: str
    legend: str = ""
    instant: bool = False
    table: bool = False
    empty_ok: str | None = None
    fleet: bool = False
    hide: bool = False

    def to_json(self, ref_id: str) -> dict[str, Any]:
        out: dict[str, Any] = {
            "datasource": DATASOURCE,
            "editorMode": "code",
            "expr": self.expr,
            "format": "table" if self.table else "time_series",
            "instant": self.instant,
            "legendFormat": self.legend or "__auto",
            "range": not self.instant,
            "refId": ref_id,
        }
        if self.hide:
            out["hide"] = True
        return out


@dataclass
class Panel:
    """A panel before layout. ``kind`` is Grafana's panel type id."""

    kind: str
    title: str
    targets: list[Target]
    description: str = ""
    unit: str | None = None
    min: float | None = None
    max: float | None = None
    decimals: int | None = None
    no_value: str | None = None
    thresholds: list[tuple[float | None, str]] | None = None
    mappings: list[dict[str, Any]] = field(default_factory=list)
    overrides: list[dict[str, Any]] = field(default_factory=list)
    custom: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    transformations: list[dict[str, Any]] = field(default_factory=list)
    color: dict[str, Any] | None = None
    w: int = 12
    h: int = 8

    def to_json(self, panel_id: int, x: int, y: int) -> dict[str, Any]:
        defaults: dict[str, Any] = {}
        if self.color is not None:
            defaults["color"] = self.color
        if self.custom:
            defaults["custom"] = self.custom
        if self.decimals is not None:
            defaults["decimals"] = self.decimals
        if self.mappings:
            defaults["mappings"] = self.mappings
        if self.max is not None:
            defaults["max"] = self.max
        if self.min is not None:
            defaults["min"] = self.min
        if self.no_value is not None:
            defaults["noValue"] = self.no_value
        steps = self.thresholds or [(None, OK)]
        defaults["thresholds"] = {"mode": "absolute", "steps": [{"color": c, "value": v} for v, c in steps]}
        if self.unit is not None:
            defaults["unit"] = self.unit
        out: dict[str, Any] = {
            "datasource": DATASOURCE,
            "fieldConfig": {"defaults": defaults, "overrides": self.overrides},
            "gridPos": {"h": self.h, "w": self.w, "x": x, "y": y},
            "id": panel_id,
            "options": self.options,
            "targets": [t.to_json(chr(ord("A") + i)) for i, t in enumerate(self.targets)],
            "title": self.title,
            "type": self.kind,
        }
        if self.description:
            out["description"] = self.description
        if self.transformations:
            out["transformations"] = self.transformations
        return out


def datasource_var() -> dict[str, Any]:
    return {"current": {"selected": False, "text": f"${{{DS_INPUT}}}", "value": f"${{{DS_INPUT}}}"},
            "hide": 0, "label": "Data source", "name": "datasource", "query": "prometheus", "refresh": 1, "regex": "", "type": "datasource"}


def query_var(name: str, label: str, query: str, *, multi: bool = False, include_all: bool = False, all_value: str = ".*",
              description: str = "", regex: str = "") -> dict[str, Any]:
    """A Prometheus query variable (``label_values(...)``, or ``query_result(...)`` with a ``regex``
    that extracts the value), refreshed when the time range changes."""
    out: dict[str, Any] = {
        "datasource": DATASOURCE,
        "hide": 0,
        "includeAll": include_all,
        "label": label,
        "multi": multi,
        "name": name,
        "query": query,
        "refresh": 2,
        "regex": regex,
        "sort": 1,
        "type": "query",
    }
    if include_all:
        out["allValue"] = all_value
    if description:
        out["description"] = description
    return out


def custom_var(name: str, label: str, values: list[str], description: str = "") -> dict[str, Any]:
    """A fixed list; the first value is the default."""
    options = [{"selected": i == 0, "text": v, "value": v} for i, v in enumerate(values)]
    out: dict[str, Any] = {
        "current": {"text": values[0], "value": values[0]},
        "hide": 0,
        "includeAll": False,
        "label": label,
        "multi": False,
        "name": name,
        "options": options,
        "query": ",".join(values),
        "type": "custom",
    }
    if description:
        out["description"] = description
    return out


class Dashboard:
    """Collects rows and panels; :meth:`build` lays them out and returns the JSON document."""

    def __init__(self, uid: str, title: str, description: str, tags: list[str], variables: list[dict[str, Any]],
                 links: list[dict[str, Any]] | None = None, time_from: str = "now-6h", refresh: str = "30s") -> None:
        self.uid, self.title, self.description, self.tags = uid, title, description, tags
        self.variables = variables
        self.links = links or []
        self.time_from, self.refresh = time_from, refresh
        self._items: list[tuple[str, Any]] = []

    def row(self, title: str) -> Dashboard:
        self._items.append(("row", title))
        return self

    def add(self, *panels: Panel) -> Dashboard:
        for p in panels:
            self._items.append(("panel", p))
        return self

    def panels(self) -> list[Panel]:
        return [p for kind, p in self._items if kind == "panel"]

    def build(self) -> dict[str, Any]:
        out_panels: list[dict[str, Any]] = []
        next_id, x, y, line_h = 1, 0, 0, 0
        for kind, item in self._items:
            if kind == "row":
                if x:
                    y, x, line_h = y + line_h, 0, 0
                out_panels.append({"collapsed": False, "gridPos": {"h": 1, "w": GRID_COLUMNS, "x": 0, "y": y}, "id": next_id,
                                   "panels": [], "title": item, "type": "row"})
                next_id, y = next_id + 1, y + 1
                continue
            if x + item.w > GRID_COLUMNS:
                y, x, line_h = y + line_h, 0, 0
            out_panels.append(item.to_json(next_id, x, y))
            next_id, x, line_h = next_id + 1, x + item.w, max(line_h, item.h)
        return {
            "__inputs": INPUTS,
            "annotations": {"list": [{
                "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
                "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard",
            }]},
            "description": self.description,
            "editable": True,
            "fiscalYearStartMonth": 0,
            "graphTooltip": 1,
            "links": self.links,
            "panels": out_panels,
            "refresh": self.refresh,
            "schemaVersion": SCHEMA_VERSION,
            "tags": self.tags,
            "templating": {"list": self.variables},
            "time": {"from": self.time_from, "to": "now"},
            "timepicker": {},
            "timezone": "browser",
            "title": self.title,
            "uid": self.uid,
            "version": 1,
            "weekStart": "",
        }


def dumps(doc: dict[str, Any]) -> str:
    """The committed form: sorted keys, two-space indent, trailing newline."""
    return json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


# --- option helpers shared by the dashboards ----------------------------------------------------


def legend_table(*calcs: str) -> dict[str, Any]:
    return {"calcs": list(calcs), "displayMode": "table", "placement": "bottom", "showLegend": True}


def timeseries_options(*calcs: str) -> dict[str, Any]:
    return {"legend": legend_table(*(calcs or ("lastNotNull", "max"))), "tooltip": {"mode": "multi", "sort": "desc"}}


def stat_options(text_mode: str = "value_and_name", color_mode: str = "value") -> dict[str, Any]:
    return {
        "colorMode": color_mode,
        "graphMode": "none",
        "justifyMode": "auto",
        "orientation": "auto",
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "textMode": text_mode,
    }


def value_map(mapping: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """``{"0": ("OK", "green")}`` → a Grafana value mapping."""
    return {"options": {k: {"color": c, "index": i, "text": t} for i, (k, (t, c)) in enumerate(mapping.items())}, "type": "value"}


def override_by_name_regex(pattern: str, props: dict[str, Any]) -> dict[str, Any]:
    return {"matcher": {"id": "byRegexp", "options": pattern}, "properties": [{"id": k, "value": v} for k, v in props.items()]}
