"""The gpu-alloc-exporter dashboards: node, fleet and kernel drill-down.

Generated JSON lives in ``dashboards/*.json``; regenerate with ``python dashboards/src/generate.py``
(``tests/test_dashboards.py`` fails when the committed files differ from this source).

Conventions, enforced by the tests:

* every panel queries ``${datasource}``, sets a unit and a ``noValue`` text that says why it can be
  empty (unsupported by the GPU, source off, nothing to report) instead of showing a fake zero;
* every legend names the instance, except fleet-wide aggregates;
* the fleet dashboard reads recorded series only (``alerts/gpu-alloc.recording.yml``): per node,
  or zone aggregates (``zone_*``), all of which a global Prometheus federates or receives by
  remote write (``deploy/prometheus/``), so it works there and stays fast on 10,000 nodes; its
  variables come from ``instance:gpu_alloc_build_info:last``, which federates too;
* links to the kernel dashboard always pass the node (``var-instance``): that dashboard queries
  one node, never the fleet;
* colour thresholds that correspond to an alert come from that alert's threshold series in the
  recording rules file, so the dashboards and the alerts never disagree.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from grafana_json import (
    BAD,
    GREY,
    INFO,
    OK,
    WARN,
    Dashboard,
    Panel,
    Target,
    custom_var,
    datasource_var,
    dumps,
    override_by_name_regex,
    query_var,
    stat_options,
    timeseries_options,
    value_map,
)

ROOT = Path(__file__).resolve().parents[2]
RECORDING_RULES = ROOT / "alerts" / "gpu-alloc.recording.yml"
OUT = ROOT / "dashboards"

NODE_UID, FLEET_UID, KERNEL_UID, SESSIONS_UID = "gpu-alloc-node", "gpu-alloc-fleet", "gpu-alloc-kernel", "gpu-alloc-sessions"
TAGS = ["gpu-alloc", "backend.ai", "gpu"]

# Selector fragments substituted for %S in query templates.
NODE_SEL = 'job=~"$job", instance="$instance"'
FLEET_SEL = 'job=~"$job", agent_id=~"$agent", instance=~"$instance"'
KERNEL_SEL = 'job=~"$job", instance="$instance", kernel_id="$kernel_id"'
KERNEL_NODE_SEL = 'job=~"$job", instance="$instance"'
FGPU_SLOTS = 'slot=~"cuda[.](shares|device)"'

# Clocks-event reasons worth showing; gpu_idle, application/display clock settings and sync
# boost are normal operation.
THROTTLE_SHOWN = 'reason!~"gpu_idle|applications_clocks_setting|display_clock_setting|sync_boost"'

UP_DOWN = [value_map({"0": ("down", BAD), "1": ("up", OK)})]
YES_BAD = [value_map({"0": ("no", OK), "1": ("YES", BAD)})]
OK_FAIL = [value_map({"0": ("failing", BAD), "1": ("ok", OK)})]
ACTIVE = [value_map({"0": ("-", "transparent"), "1": ("active", BAD)})]
# Empty state-timeline cells stay empty ("no data") rather than drawn as a value.
DASHED = {"custom.lineStyle": {"dash": [10, 10], "fill": "dash"}, "custom.fillOpacity": 0}


@cache
def thresholds() -> dict[str, float]:
    """``global:…:threshold`` recording rules → value: the alert thresholds, read from the rules."""
    doc = yaml.safe_load(RECORDING_RULES.read_text())
    out = {}
    for group in doc["groups"]:
        for rule in group["rules"]:
            m = re.fullmatch(r"vector\(([-0-9.e+]+)\)", str(rule.get("expr", "")).strip())
            if rule.get("record", "").endswith(":threshold") and m:
                out[rule["record"]] = float(m.group(1))
    return out


def thr(name: str) -> float:
    return thresholds()[f"global:{name}:threshold"]


def _fill(template: str, sel: str) -> str:
    return template.replace("%S", sel)


# --- panel factories ---------------------------------------------------------------------------


def _ts_custom(fill: int = 10, stack: bool = False, threshold_style: str = "off") -> dict[str, Any]:
    return {
        "axisSoftMin": 0,
        "drawStyle": "line",
        "fillOpacity": fill,
        "lineWidth": 1,
        "showPoints": "never",
        "spanNulls": False,
        "stacking": {"group": "A", "mode": "normal" if stack else "none"},
        "thresholdsStyle": {"mode": threshold_style},
    }


def ts(title: str, targets: list[Target], *, unit: str, desc: str, no_value: str, w: int = 12, h: int = 8,
       min: float | None = None, max: float | None = None, thresholds: list | None = None, dashed: str | None = None,
       stack: bool = False, decimals: int | None = None) -> Panel:
    """A time series; ``dashed`` is a regex of legend names drawn as dashed reference lines."""
    return Panel(
        "timeseries", title, targets, description=desc, unit=unit, min=min, max=max, no_value=no_value, decimals=decimals,
        thresholds=thresholds, color={"mode": "palette-classic"},
        custom=_ts_custom(stack=stack, threshold_style="dashed" if thresholds else "off"),
        overrides=[override_by_name_regex(dashed, DASHED)] if dashed else [],
        options=timeseries_options(), w=w, h=h,
    )


def stat(title: str, targets: list[Target], *, unit: str, desc: str, no_value: str, w: int = 4, h: int = 4,
         thresholds: list | None = None, mappings: list | None = None, decimals: int | None = None, text_mode: str = "value_and_name") -> Panel:
    return Panel(
        "stat", title, targets, description=desc, unit=unit, no_value=no_value, thresholds=thresholds, decimals=decimals,
        mappings=mappings or [], color={"mode": "thresholds"}, options=stat_options(text_mode), w=w, h=h,
    )


def bargauge(title: str, targets: list[Target], *, unit: str, desc: str, no_value: str, w: int = 12, h: int = 8,
             min: float | None = 0, max: float | None = None, thresholds: list | None = None, decimals: int | None = None) -> Panel:
    return Panel(
        "bargauge", title, targets, description=desc, unit=unit, no_value=no_value, min=min, max=max, decimals=decimals,
        thresholds=thresholds, color={"mode": "thresholds"}, w=w, h=h,
        options={
            "displayMode": "gradient", "minVizHeight": 10, "minVizWidth": 0, "namePlacement": "auto", "orientation": "horizontal",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}, "showUnfilled": True, "valueMode": "color",
        },
    )


def timeline(title: str, targets: list[Target], *, unit: str, desc: str, no_value: str, w: int = 12, h: int = 8,
             mappings: list | None = None, thresholds: list | None = None, continuous: bool = False) -> Panel:
    return Panel(
        "state-timeline", title, targets, description=desc, unit=unit, no_value=no_value, mappings=mappings or [],
        thresholds=thresholds, color={"mode": "continuous-BlPu" if continuous else "thresholds"},
        custom={"fillOpacity": 80, "lineWidth": 0}, w=w, h=h,
        options={
            "alignValue": "left", "legend": {"displayMode": "list", "placement": "bottom", "showLegend": False}, "mergeValues": True,
            "rowHeight": 0.9, "showValue": "auto" if continuous else "never", "tooltip": {"mode": "single", "sort": "none"},
        },
    )


def table(title: str, targets: list[Target], *, unit: str, desc: str, no_value: str, w: int = 12, h: int = 8,
          rename: dict[str, str] | None = None, column_units: dict[str, str] | None = None, mappings: list | None = None,
          hide: tuple[str, ...] = ("Time", "__name__", "job"), links: list | None = None) -> Panel:
    """Instant queries as a table; several targets are merged into one row per label set."""
    transformations: list[dict[str, Any]] = []
    if len(targets) > 1:
        transformations.append({"id": "merge", "options": {}})
    transformations.append({"id": "organize", "options": {"excludeByName": {k: True for k in hide}, "renameByName": rename or {}}})
    overrides = [{"matcher": {"id": "byName", "options": col}, "properties": [{"id": "unit", "value": u}]}
                 for col, u in (column_units or {}).items()]
    if links:
        overrides += links
    return Panel(
        "table", title, targets, description=desc, unit=unit, no_value=no_value, mappings=mappings or [], overrides=overrides,
        transformations=transformations, options={"cellHeight": "sm", "showHeader": True}, w=w, h=h,
    )


def T(expr: str, legend: str, sel: str, **kw: Any) -> Target:
    """A range query; ``sel`` replaces ``%S`` in ``expr``."""
    if not kw.get("fleet") and "{{instance}}" not in legend:
        raise ValueError(f"legend {legend!r} must name the instance")
    return Target(_fill(expr, sel), legend, **kw)


def I(expr: str, legend: str, sel: str, **kw: Any) -> Target:  # noqa: E743 (instant)
    return T(expr, legend, sel, instant=True, **kw)


# Where the fleet dashboard runs on a zone Prometheus, the per-kernel recorded series are there and
# a node or agent filter picks that node's own top 20; on a global Prometheus or VictoriaMetrics
# only each zone's recorded top 20 crossed, so the same query falls back to those.
TOP_KERNELS_SCOPE = ("On a zone's Prometheus a node or agent filter lists those nodes' own top 20; on the global level, "
                     "which holds each zone's top 20 only, the selected nodes' kernels among them (open the node dashboard "
                     "on the zone for the rest).")


def top_kernels(metric: str, op: str) -> str:
    """The 20 largest per-kernel figures of the selected nodes: the zone's per-kernel series where
    they exist, else the zones' recorded top 20 (``or`` drops a kernel both name)."""
    return f"topk(20, instance_kernel:{metric}:{op}{{%S}} or zone_kernel:{metric}:topk20{{%S}})"


def TAB(expr: str, sel: str, **kw: Any) -> Target:
    """An instant query for a table."""
    return Target(_fill(expr, sel), "", instant=True, table=True, **kw)


def kernel_link(field: str = "kernel_id") -> dict[str, Any]:
    """Make a table's kernel_id column open the kernel drill-down."""
    url = (f"/d/{KERNEL_UID}/{KERNEL_UID}?var-instance=${{__data.fields.instance}}&var-kernel_id=${{__value.raw}}"
           f"&${{__url_time_range}}&${{datasource:queryparam}}")
    return {"matcher": {"id": "byName", "options": field},
            "properties": [{"id": "links", "value": [{"title": "Kernel drill-down", "url": url}]}]}


def node_link(field: str = "instance") -> dict[str, Any]:
    url = f"/d/{NODE_UID}/{NODE_UID}?var-instance=${{__value.raw}}&${{__url_time_range}}&${{datasource:queryparam}}"
    return {"matcher": {"id": "byName", "options": field},
            "properties": [{"id": "links", "value": [{"title": "Node dashboard", "url": url}]}]}


def _links() -> list[dict[str, Any]]:
    return [{"asDropdown": True, "icon": "external link", "includeVars": False, "keepTime": True, "tags": ["gpu-alloc"],
             "targetBlank": False, "title": "gpu-alloc dashboards", "tooltip": "", "type": "dashboards"}]


def _common_vars(source: str = "gpu_alloc_build_info") -> list[dict[str, Any]]:
    """Data source, job and agent; ``source`` is the series whose labels list them."""
    return [
        datasource_var(),
        query_var("job", "Job", f"label_values({source}, job)", multi=True, include_all=True),
        query_var("agent", "Agent", f'label_values({source}{{job=~"$job"}}, agent_id)', multi=True, include_all=True,
                  description="Backend.AI agent id (--agent.id of each exporter)"),
    ]


def _fragmentation_var() -> dict[str, Any]:
    return custom_var("fragmentation", "Fragmentation", ["disallowed", "allowed"],
                      description="How your agents place fractional requests: disallowed = ensure_slot_not_fragmented applies "
                                  "(allow_fractional_resource_fragmentation = false), allowed = EVENLY may split a request")


# --- node --------------------------------------------------------------------------------------


def node() -> Dashboard:
    S = NODE_SEL
    mem_thr, frag_thr = thr("gpu_alloc_device_memory_used_ratio"), thr("gpu_alloc_node_max_single_device_free")
    variables = [
        *_common_vars(),
        query_var("instance", "Node", 'label_values(gpu_alloc_build_info{job=~"$job", agent_id=~"$agent"}, instance)'),
        _fragmentation_var(),
    ]
    d = Dashboard(NODE_UID, "gpu-alloc / Node",
                  "One Backend.AI GPU node: fGPU allocation against capacity, measured use, device health, MIG, headroom "
                  "and the exporter's own health.", TAGS, variables, _links())

    d.row("Allocation")
    d.add(
        stat("fGPU allocated", [I("sum by (job, instance) (gpu_alloc_device_fgpu_allocated{%S}) or sum by (job, instance) (0 * gpu_alloc_build_info{%S})", "{{instance}}", S)],
             unit="none", decimals=2, desc="cuda.shares + cuda.device held by kernels: Backend.AI's gpu_alloc_map summed. 0 when the exporter runs and no kernel holds a GPU.",
             no_value="exporter not reporting", w=3),
        stat("fGPU capacity", [I(f"sum by (job, instance) (gpu_alloc_device_capacity{{%S, {FGPU_SLOTS}}})", "{{instance}}", S)],
             unit="none", decimals=2, desc="What the node's GPUs hold in the slot kernels are given (shares from memory and SMs, or 1 per device).",
             no_value="unknown: no telemetry inventory or capacity override", w=3),
        stat("Allocated / capacity",
             [I(f"sum by (job, instance) (gpu_alloc_device_fgpu_allocated{{%S}}) / sum by (job, instance) (gpu_alloc_device_capacity{{%S, {FGPU_SLOTS}}})", "{{instance}}", S)],
             unit="percentunit", desc="Share of the fGPU capacity allocated; above 100 % the node is overcommitted.",
             no_value="capacity unknown or nothing allocated", thresholds=[(None, OK), (0.9, WARN), (1.0001, BAD)], w=3),
        stat("Kernels", [I("gpu_alloc_kernels{%S}", "{{instance}} {{state}}", S)], unit="none",
             desc="Kernel scratch directories by state: ok, pending (resource.txt still being written), invalid (malformed).",
             no_value="exporter not reporting", w=3),
        stat("Overcommitted devices", [I("sum by (job, instance) (gpu_alloc_device_overcommitted{%S})", "{{instance}}", S)], unit="none",
             desc="Devices on which kernels hold more of a slot than the device has (alert GpuAllocFgpuOvercommitted).",
             no_value="capacity unknown (no telemetry)", thresholds=[(None, OK), (1, BAD)], w=3),
        stat("Allocated on unknown devices",
             [I("sum by (job, instance) (gpu_alloc_device_unknown_allocated{%S}) or sum by (job, instance) (0 * gpu_alloc_device_up{%S})", "{{instance}}", S)],
             unit="none", decimals=2, thresholds=[(None, OK), (0.0001, WARN)], w=3,
             desc="GPU slots held on device ids no GPU of the driver matches (alert GpuAllocAllocationOnUnknownDevice).",
             no_value="cannot judge without a telemetry inventory"),
        stat("GPUs up / listed",
             [I("sum by (job, instance) (gpu_alloc_device_up{%S})", "{{instance}} up", S),
              I("gpu_alloc_driver_devices{%S}", "{{instance}} driver lists", S)],
             unit="none", desc="GPUs answering NVML, and GPUs the driver reports (nvidia-smi -L). A difference is a lost GPU.",
             no_value="no telemetry (source none or failing)", w=3),
        stat("CPU cores held", [I('gpu_alloc_node_allocated{%S, slot="cpu"}', "{{instance}}", S)], unit="none", w=3,
             desc="CPU cores allocated to kernels on the node (intrinsic slot cpu).", no_value="no kernel on this node"),
    )
    d.add(
        ts("fGPU allocated per device vs capacity",
           [T("gpu_alloc_device_fgpu_allocated{%S}", "{{instance}} {{device_id}} allocated", S),
            T(f"gpu_alloc_device_capacity{{%S, {FGPU_SLOTS}}}", "{{instance}} {{device_id}} capacity", S)],
           unit="none", decimals=2, dashed=".* capacity$",
           desc="Solid: fGPU held by kernels per device; dashed: the device's capacity in the same slot.",
           no_value="no GPU allocation on this node"),
        bargauge("fGPU allocated / capacity per device (now)",
                 [I(f"(sum by (job, instance, device_id) (gpu_alloc_device_fgpu_allocated{{%S}}) or 0 * sum by (job, instance, device_id) (gpu_alloc_device_capacity{{%S, {FGPU_SLOTS}}}))"
                    f" / sum by (job, instance, device_id) (gpu_alloc_device_capacity{{%S, {FGPU_SLOTS}}})", "{{instance}} {{device_id}}", S)],
                 unit="percentunit", max=1, thresholds=[(None, OK), (0.9, WARN), (1.0001, BAD)],
                 desc="Per device, allocated fGPU over its capacity. Devices whose capacity is unknown are not shown.",
                 no_value="capacity unknown: no telemetry inventory"),
    )
    d.add(
        timeline("Allocation by kernel",
                 [T("sum by (job, instance, kernel_id, slot) (gpu_alloc_kernel_allocated{%S})", "{{instance}} {{kernel_id}} {{slot}}", S)],
                 unit="none", continuous=True, w=24, h=10,
                 desc="What each kernel holds over time, per slot (fGPU shares, whole GPUs, MIG instances): when it started, grew and ended.",
                 no_value="no kernel holds an accelerator in this time range"),
    )
    d.add(
        table("Allocation per device and slot (now)", [TAB("gpu_alloc_device_allocated{%S}", S)], unit="none",
              rename={"Value": "allocated"}, desc="Every count slot per device, MIG slots and other accelerators included.",
              no_value="no accelerator allocated"),
        ts("Memory allocated: GPU (cuda.mem) and host (mem)",
           [T("gpu_alloc_device_allocated_bytes{%S}", "{{instance}} {{device_id}} {{slot}}", S, empty_ok="only where kernels hold cuda.mem"),
            T("gpu_alloc_node_allocated_bytes{%S}", "{{instance}} host {{slot}}", S)],
           unit="bytes", desc="Bytes slots: GPU memory per device where a legacy plugin allocates it explicitly (cuda.mem; no current plugin registers it), and host memory held by kernels.",
           no_value="no kernel on this node"),
    )

    d.row("Utilisation and memory (measured)")
    d.add(
        ts("GPU utilisation", [T("gpu_alloc_device_utilization_ratio{%S}", "{{instance}} {{device_id}} sm", S),
                               T("gpu_alloc_device_memory_utilization_ratio{%S}", "{{instance}} {{device_id}} memory", S)],
           unit="percentunit", min=0, max=1,
           desc="sm: fraction of time a CUDA kernel ran (nvidia-smi utilization.gpu); memory: fraction of time device memory was read or written. NVML reports neither for MIG-enabled GPUs.",
           no_value="not reported: MIG-enabled GPU, or telemetry off"),
        ts("GPU memory: used, allocated, total",
           [T("gpu_alloc_device_memory_used_bytes{%S}", "{{instance}} {{device_id}} used", S),
            T('gpu_alloc_device_allocated_bytes{%S, slot="cuda.mem"}', "{{instance}} {{device_id}} allocated", S, empty_ok="only where kernels hold cuda.mem"),
            T("gpu_alloc_device_memory_total_bytes{%S}", "{{instance}} {{device_id}} total", S)],
           unit="bytes", dashed=".* (total|allocated)$", thresholds=None,
           desc=f"Framebuffer memory in use against the device total (dashed); allocated: cuda.mem, legacy plugins only. Alert GpuAllocMemoryNearlyFull at {mem_thr:.0%} used.",
           no_value="not reported: telemetry off"),
    )
    d.add(
        ts("MIG device memory", [T("gpu_alloc_mig_device_memory_used_bytes{%S}", "{{instance}} {{device_id}} used", S),
                                 T("gpu_alloc_mig_device_memory_total_bytes{%S}", "{{instance}} {{device_id}} total", S)],
           unit="bytes", dashed=".* total$", desc="Memory of each MIG device's GPU instance.", no_value="no MIG device on this node"),
        ts("Kernel GPU memory used", [T("gpu_alloc_kernel_memory_used_bytes{%S}", "{{instance}} {{kernel_id}} {{device_id}}", S),
                                      T("gpu_alloc_device_unattributed_memory_bytes{%S}", "{{instance}} unattributed {{device_id}} {{reason}}", S,
                                        empty_ok="only while processes outside any kernel use a GPU")],
           unit="bytes", desc="Memory of each kernel's processes per device, from NVML's process list mapped to kernels via /proc; and memory of processes that belong to no kernel.",
           no_value="no kernel process on a GPU, or attribution off"),
    )
    d.add(
        ts("Kernel utilisation", [T("gpu_alloc_kernel_utilization_ratio{%S}", "{{instance}} {{kernel_id}} {{device_id}}", S)],
           unit="percentunit", min=0, max=1,
           desc="SM utilisation of each kernel's processes per device (NVML per-process samples). Not measurable on MIG devices.",
           no_value="not measurable (MIG, time-sliced sharing) or attribution off"),
        table("Kernels: allocated vs used (now)",
              [TAB("sum by (job, instance, kernel_id, device_id) (gpu_alloc_kernel_allocated{%S})", S),
               TAB("sum by (job, instance, kernel_id, device_id) (gpu_alloc_kernel_memory_used_bytes{%S})", S),
               TAB("max by (job, instance, kernel_id, device_id) (gpu_alloc_kernel_utilization_ratio{%S})", S, empty_ok="absent on MIG devices"),
               TAB("min by (job, instance, kernel_id, device_id) (gpu_alloc_kernel_idle_seconds{%S})", S, empty_ok="absent without per-process utilisation")],
              unit="none", rename={"Value #A": "allocated", "Value #B": "memory used", "Value #C": "utilisation", "Value #D": "idle for"},
              column_units={"memory used": "bytes", "utilisation": "percentunit", "idle for": "s"}, links=[kernel_link()],
              desc="Per kernel and device: what it holds and what it uses. Empty cells: not measurable there.",
              no_value="no kernel holds a GPU"),
    )
    d.add(
        stat("Unattributed GPU processes",
             [I("sum by (job, instance) (gpu_alloc_device_unattributed_processes{%S}) or sum by (job, instance) (0 * gpu_alloc_device_utilization_attributable{%S})", "{{instance}}", S)],
             unit="none", thresholds=[(None, OK), (1, WARN)],
             desc="GPU processes belonging to no kernel (host processes, leaked containers). Alert GpuAllocUnattributedProcesses.",
             no_value="attribution off or failing"),
        stat("Isolation breaches",
             [I("sum by (job, instance) (gpu_alloc_kernel_isolation_breach{%S}) or sum by (job, instance) (0 * gpu_alloc_device_utilization_attributable{%S})", "{{instance}}", S)],
             unit="none", thresholds=[(None, OK), (1, BAD)],
             desc="Kernels with a process on a device they were not allocated. Alert GpuAllocIsolationBreach.",
             no_value="attribution off or failing"),
        stat("Per-kernel utilisation measurable", [I("gpu_alloc_device_utilization_attributable{%S}", "{{instance}} {{device_id}}", S)],
             unit="none", mappings=[value_map({"0": ("not isolable (MIG)", GREY), "1": ("per kernel", OK)})], w=16,
             desc="Whether NVML samples utilisation per process on the device, so kernel utilisation is measured rather than unknown.",
             no_value="attribution off or failing"),
    )

    d.row("Temperature, power, clocks, throttling")
    d.add(
        ts("Temperature", [T("gpu_alloc_device_temperature_celsius{%S}", "{{instance}} {{device_id}}", S)], unit="celsius",
           thresholds=[(None, OK), (83, WARN), (90, BAD)],
           desc="GPU core temperature. Reference lines only: throttling itself is alerted (GpuAllocThermalThrottling).",
           no_value="not reported by this GPU or telemetry off"),
        ts("Power draw and limit", [T("gpu_alloc_device_power_watts{%S}", "{{instance}} {{device_id}} draw", S),
                                    T("gpu_alloc_device_power_limit_watts{%S}", "{{instance}} {{device_id}} limit", S)],
           unit="watt", dashed=".* limit$", desc="Power draw against the enforced power limit (dashed).",
           no_value="power readings not supported by this GPU"),
    )
    d.add(
        ts("Clocks", [T("gpu_alloc_device_clock_hertz{%S}", "{{instance}} {{device_id}} {{clock}}", S)], unit="hertz",
           desc="SM and memory clocks.", no_value="clocks not reported"),
        timeline("Throttle reasons", [T(f"gpu_alloc_device_throttle_active{{%S, {THROTTLE_SHOWN}}}", "{{instance}} {{device_id}} {{reason}}", S)],
                 unit="none", mappings=ACTIVE,
                 desc="Clocks-event reasons holding the clocks down (idle and clock-setting reasons hidden). sw_power_cap alone is normal at full load.",
                 no_value="not reported: the mock and some GPUs expose no clocks-event reasons"),
    )
    d.add(
        ts("Energy use (from the energy counter)", [T("rate(gpu_alloc_device_energy_joules_total{%S}[$__rate_interval])", "{{instance}} {{device_id}}", S)],
           unit="watt", desc="Average power from the driver's energy counter: smoother than the instantaneous draw.",
           no_value="energy counter not supported by this GPU", h=6),
        ts("PCIe throughput", [T("gpu_alloc_device_pcie_throughput_bytes_per_second{%S}", "{{instance}} {{device_id}} {{direction}}", S,
                                 empty_ok="opt-in: --telemetry.pcie")],
           unit="Bps", desc="PCIe throughput sampled over 20 ms (opt-in with --telemetry.pcie, ~20 ms per GPU and sample).",
           no_value="off: enable with --telemetry.pcie", h=6),
    )

    d.row("Health: lost GPUs, XID, ECC")
    d.add(
        timeline("GPU up", [T("gpu_alloc_device_up{%S}", "{{instance}} {{device_id}}", S)], unit="none", mappings=UP_DOWN,
                 desc="0: the GPU is lost (fell off the bus) or its driver calls are stuck (alert GpuAllocGpuLost).",
                 no_value="no telemetry (source none or failing)"),
        stat("GPU count: now vs 1-day maximum",
             [I("instance:gpu_alloc_devices:count{%S}", "{{instance}} now", S),
              I("max_over_time(instance:gpu_alloc_devices:count{%S}[1d:5m]) or instance:gpu_alloc_devices:count{%S}", "{{instance}} max 1d", S)],
             unit="none", w=12, h=8, desc="GPUs telemetry lists, against the most it listed in a day (alert GpuAllocGpuCountDropped).",
             no_value="no telemetry, or recording rules not loaded"),
    )
    d.add(
        table("XID errors since the exporter started",
              [TAB("gpu_alloc_xid_errors_total{%S}", S, empty_ok="XID series exist only once an XID happened"),
               TAB("time() - gpu_alloc_xid_last_seen_timestamp_seconds{%S}", S, empty_ok="XID series exist only once an XID happened")],
              unit="none", rename={"Value #A": "count", "Value #B": "last seen"}, column_units={"last seen": "s"}, hide=("Time", "__name__", "job"),
              desc="XID codes the driver reported per GPU. Critical ones (docs/dashboards.md) fire GpuAllocXidCritical for 30 minutes.",
              no_value="no XID since the exporter started"),
        ts("ECC errors", [T("increase(gpu_alloc_device_ecc_uncorrected_errors_total{%S}[$__rate_interval])", "{{instance}} {{device_id}} uncorrected", S),
                          T("increase(gpu_alloc_device_ecc_corrected_errors_total{%S}[$__rate_interval])", "{{instance}} {{device_id}} corrected", S),
                          T("increase(gpu_alloc_device_remapped_rows_total{%S}[$__rate_interval])", "{{instance}} {{device_id}} rows remapped ({{cause}})", S,
                            empty_ok="Ampere and later only")],
           unit="none", desc="New ECC errors and remapped memory rows per interval. Uncorrected errors kill processes (GpuAllocEccUncorrectable).",
           no_value="ECC not supported or disabled on these GPUs"),
    )
    d.add(
        stat("Memory repair state",
             [I("gpu_alloc_device_remapped_rows_pending{%S}", "{{instance}} {{device_id}} remap pending", S),
              I("gpu_alloc_device_remapped_rows_failure{%S}", "{{instance}} {{device_id}} remap failed", S),
              I("gpu_alloc_device_retired_pages_pending{%S}", "{{instance}} {{device_id}} retirement pending", S, empty_ok="pre-Ampere GPUs only")],
             unit="none", mappings=YES_BAD, w=12, h=8,
             desc="Row remapping (Ampere+) and page retirement (older): pending needs a GPU reset, failed needs service.",
             no_value="not supported by these GPUs"),
        table("GPUs", [TAB("gpu_alloc_device_info{%S} * on (job, instance) group_left (driver_version, cuda_version) gpu_alloc_driver_info{%S}", S)],
              unit="none", hide=("Time", "__name__", "job", "Value"),
              desc="Identity of each GPU (model, uuid, PCI bus, serial) and the driver version.", no_value="no telemetry"),
    )

    d.row("MIG")
    d.add(
        table("MIG devices", [TAB("gpu_alloc_mig_device_info{%S}", S)], unit="none", hide=("Time", "__name__", "job", "Value"),
              desc="Each MIG device with its GPU instance, compute instance, profile and placement on the memory slices.",
              no_value="no MIG device (MIG off, or layout unreadable)"),
        bargauge("Creatable MIG instances per profile", [I("gpu_alloc_mig_creatable_instances{%S}", "{{instance}} {{device_id}} {{profile}}", S)],
                 unit="none", decimals=0, desc="GPU instances of each profile that could still be created, each profile on its own.",
                 no_value="no MIG-enabled GPU, or its layout is unreadable"),
    )
    d.add(
        timeline("MIG mode (current / pending)", [T("gpu_alloc_device_mig_mode{%S}", "{{instance}} {{device_id}} {{state}}", S)], unit="none",
                 mappings=[value_map({"0": ("off", GREY), "1": ("MIG", INFO)})],
                 desc="pending differs from current until the GPU is reset (alert GpuAllocMigModePendingReset).",
                 no_value="GPUs are not MIG-capable"),
        stat("MIG layout readable", [I("gpu_alloc_device_mig_layout_readable{%S}", "{{instance}} {{device_id}}", S)], unit="none", w=12, h=8,
             mappings=[value_map({"0": ("denied: needs mig/monitor", WARN), "1": ("readable", OK)})],
             desc="Whether the driver lets the exporter read GPU instances and placements.", no_value="no MIG-enabled GPU"),
    )

    d.row("Headroom and fragmentation")
    d.add(
        stat("Headroom ($fragmentation)", [I('gpu_alloc_node_headroom{%S, fragmentation="$fragmentation"}', "{{instance}} {{slot}}", S)],
             unit="none", decimals=2, w=8,
             desc="Largest single request of each slot the agent would place now.", no_value="capacity unknown: no telemetry"),
        stat("Largest request on one device", [I("gpu_alloc_node_max_single_device_free{%S}", "{{instance}} {{slot}}", S)],
             unit="none", decimals=2, w=8, thresholds=[(None, WARN), (frag_thr, OK)],
             desc=f"Largest free amount on one device. Below {frag_thr:g} while the node has free fGPU: fragmented (GpuAllocNodeFragmented).",
             no_value="capacity unknown: no telemetry"),
        stat("Whole free devices", [I("gpu_alloc_node_whole_free_devices{%S}", "{{instance}} {{slot}}", S)], unit="none", w=8,
             desc="Devices nobody holds any of (whole GPUs, free MIG instances).", no_value="capacity unknown: no telemetry"),
    )
    d.add(
        ts("Headroom over time ($fragmentation)", [T('gpu_alloc_node_headroom{%S, fragmentation="$fragmentation"}', "{{instance}} {{slot}}", S)],
           unit="none", decimals=2, desc="Largest placeable request per slot.", no_value="capacity unknown: no telemetry"),
        ts("Fragmentation", [T("gpu_alloc_node_fragmentation_ratio{%S}", "{{instance}} {{slot}}", S)], unit="percentunit", min=0, max=1,
           desc="Share of the free capacity that sits on partly allocated devices (0: all free capacity on untouched GPUs).",
           no_value="capacity unknown: no telemetry"),
    )
    d.add(
        bargauge("Free per device", [I("gpu_alloc_device_free{%S}", "{{instance}} {{device_id}} {{slot}}", S)], unit="none", decimals=2,
                 desc="Capacity minus allocation per device and slot.", no_value="capacity unknown: no telemetry"),
        table("Requests that still fit ($fragmentation)", [TAB('gpu_alloc_request_fits{%S, fragmentation="$fragmentation"}', S)], unit="none",
              hide=("Time", "__name__", "job", "fragmentation"), rename={"Value": "how many more"},
              desc="How many more requests of each reference size the agent would place one after another.",
              no_value="capacity unknown: no telemetry"),
    )
    d.add(
        stat("Kernels by liveness", [I("gpu_alloc_kernels_liveness{%S}", "{{instance}} {{status}}", S)], unit="none", w=8,
             desc="live: a running container; stale: scratch directory without one; unknown: cgroups not visible.",
             no_value="liveness not checked"),
        table("Stale kernels", [TAB("gpu_alloc_kernel_stale{%S}", S, empty_ok="series exist only for stale kernels")], unit="none",
              hide=("Time", "__name__", "job", "Value"), links=[kernel_link()], w=8,
              desc="Kernels whose container is gone, with why (alert GpuAllocStaleKernel after 30 minutes).",
              no_value="no stale kernel (or liveness not checked)"),
        bargauge("Held by stale kernels", [I("gpu_alloc_device_stale_allocated{%S}", "{{instance}} {{device_id}} {{slot}}", S,
                                              empty_ok="series exist only for devices stale kernels hold")],
                 unit="none", decimals=2, w=8, desc="What stale kernels still claim per device (left out of allocated).",
                 no_value="nothing held by stale kernels"),
    )

    d.row("Exporter health")
    d.add(
        timeline("Collector success", [T("gpu_alloc_collector_success{%S}", "{{instance}} {{collector}}", S)], unit="none", mappings=OK_FAIL,
                 desc="Each source (scratch, nvml/mock, attribution) separately: one failing never blanks the others (GpuAllocCollectorFailing).",
                 no_value="exporter not reporting"),
        ts("Collector duration", [T("gpu_alloc_collector_duration_seconds{%S}", "{{instance}} {{collector}}", S)], unit="s",
           desc="How long each source's last run took.", no_value="exporter not reporting"),
    )
    d.add(
        stat("Scrape target", [I("up{%S}", "{{instance}}", S)], unit="none", mappings=UP_DOWN,
             desc="Prometheus' own view of the target (GpuAllocExporterDown).", no_value="target not configured", w=3),
        stat("Watcher", [I("gpu_alloc_watcher_up{%S}", "{{instance}} up", S), I("gpu_alloc_watcher_degraded{%S}", "{{instance}} degraded", S)],
             unit="none", mappings=[value_map({"0": ("no", GREY), "1": ("yes", INFO)})],
             desc="Watcher threads alive (GpuAllocWatcherDown); degraded: inotify cannot cover every kernel (GpuAllocWatcherDegraded).",
             no_value="exporter not reporting", w=3),
        stat("Scratch roots", [I("gpu_alloc_scratch_root_up{%S}", "{{instance}} {{scratch_root}}", S)], unit="none", mappings=UP_DOWN,
             desc="Whether each scratch root could be listed at the last scan.", no_value="exporter not reporting", w=3),
        stat("Rescans in 15 minutes", [I("increase(gpu_alloc_watcher_rescans_total{%S}[15m])", "{{instance}}", S)], unit="none", decimals=0,
             thresholds=[(None, BAD), (1, OK)],
             desc="Safety-net rescans (every --scratch.rescan-interval). 0 means the scan is stale (GpuAllocScanStale); idle nodes have no inotify events, so event age proves nothing.",
             no_value="exporter not reporting", w=3),
        stat("Telemetry age", [I("time() - gpu_alloc_collector_last_success_timestamp_seconds{%S}", "{{instance}} {{collector}}", S)], unit="s",
             thresholds=[(None, OK), (thr("gpu_alloc_telemetry_age_seconds"), BAD)],
             desc="Seconds since the telemetry source last succeeded (GpuAllocTelemetryStale).", no_value="telemetry off", w=3),
        stat("Last inotify event", [I("time() - gpu_alloc_watcher_last_event_timestamp_seconds{%S}", "{{instance}}", S)], unit="s",
             desc="Informational: an idle node has no events for hours.", no_value="no inotify event since the exporter started", w=3),
        stat("inotify watches", [I("gpu_alloc_watcher_watches{%S}", "{{instance}}", S)], unit="none", w=3,
             desc="Kernel-level watches held (one per kernel's config/ plus one per root), against fs.inotify.max_user_watches.",
             no_value="exporter not reporting"),
        stat("Containers visible", [I("gpu_alloc_cgroup_visible{%S}", "{{instance}}", S)], unit="none", w=3,
             mappings=[value_map({"0": ("no: liveness unknown", WARN), "1": ("yes", OK)})],
             desc="Whether the exporter sees the host's cgroup tree; without it no kernel can be judged stale.",
             no_value="liveness not checked"),
    )
    d.add(
        ts("Watcher activity", [T("rate(gpu_alloc_watcher_events_total{%S}[$__rate_interval])", "{{instance}} events", S),
                                T("rate(gpu_alloc_watcher_rescans_total{%S}[$__rate_interval])", "{{instance}} rescans", S),
                                T("rate(gpu_alloc_watcher_overflows_total{%S}[$__rate_interval])", "{{instance}} overflows", S),
                                T("rate(gpu_alloc_watcher_errors_total{%S}[$__rate_interval])", "{{instance}} errors", S),
                                T("rate(gpu_alloc_resource_parse_errors_total{%S}[$__rate_interval])", "{{instance}} parse errors", S)],
           unit="ops", desc="inotify events handled, full rescans, queue overflows, errors and malformed resource.txt reads per second.",
           no_value="exporter not reporting"),
        ts("Scrape duration", [T("scrape_duration_seconds{%S}", "{{instance}} scrape", S)], unit="s",
           desc="How long Prometheus' scrape of the exporter takes.", no_value="target not configured"),
    )
    return d


# --- fleet -------------------------------------------------------------------------------------


def fleet() -> Dashboard:
    F = FLEET_SEL
    targets = "instance:gpu_alloc_build_info:last"
    variables = [
        *_common_vars(targets),
        query_var("instance", "Node", f'label_values({targets}{{job=~"$job", agent_id=~"$agent"}}, instance)', multi=True, include_all=True),
        _fragmentation_var(),
    ]
    d = Dashboard(FLEET_UID, "gpu-alloc / Fleet",
                  "All GPU nodes: allocation and headroom, fragmentation hot spots, idle allocations, top kernels and health. "
                  "Reads recorded series (alerts/gpu-alloc.recording.yml) only, so it works on a zone Prometheus, on a global "
                  "Prometheus that federates the zones and on VictoriaMetrics (deploy/prometheus/).", TAGS, variables, _links())
    per_node = "sum by (job, instance, agent_id)"

    d.row("Overview")
    d.add(
        stat("Exporters up", [I('sum(job:gpu_alloc_exporters_up:sum{job=~"$job"})', "up", "", fleet=True),
                              I('sum(job:gpu_alloc_exporters:count{job=~"$job"})', "targets", "", fleet=True)],
             unit="none", desc="Scrape targets up, of all targets (all agents: up carries no agent_id).", no_value="no target (or recording rules not loaded)"),
        stat("fGPU allocated", [I("sum(instance:gpu_alloc_fgpu_allocated:sum{%S})", "allocated", F, fleet=True)], unit="none", decimals=1,
             desc="fGPU held by kernels, all selected nodes.", no_value="no node reporting"),
        stat("fGPU capacity", [I("sum(instance:gpu_alloc_fgpu_capacity:sum{%S})", "capacity", F, fleet=True)], unit="none", decimals=1,
             desc="fGPU the selected nodes' GPUs hold (where capacity is known).", no_value="capacity unknown: no telemetry"),
        stat("Allocated / capacity", [I("sum(instance:gpu_alloc_fgpu_allocated:sum{%S}) / sum(instance:gpu_alloc_fgpu_capacity:sum{%S})", "ratio", F, fleet=True)],
             unit="percentunit", thresholds=[(None, OK), (0.9, WARN), (1.0001, BAD)], desc="Fleet allocation ratio.", no_value="capacity unknown"),
        stat("Idle fGPU", [I("sum(instance:gpu_alloc_idle_fgpu_allocated:sum{%S})", "idle", F, fleet=True)], unit="none", decimals=1,
             thresholds=[(None, OK), (1, WARN)],
             desc=f"fGPU held by kernels idle for more than {thr('gpu_alloc_kernel_idle_seconds') / 3600:g} h (GpuAllocAllocatedButIdle).",
             no_value="per-kernel use not measured"),
        stat("GPUs down", [I("sum(instance:gpu_alloc_devices_down:sum{%S})", "down", F, fleet=True)], unit="none",
             thresholds=[(None, OK), (1, BAD)], desc="GPUs lost or hung across the fleet.", no_value="no telemetry"),
    )
    d.add(
        ts("Fleet fGPU allocated vs capacity", [T("sum(zone:gpu_alloc_fgpu_allocated:sum)", "allocated", "", fleet=True),
                                               T("sum(zone:gpu_alloc_fgpu_capacity:sum)", "capacity", "", fleet=True),
                                               T("sum(zone:gpu_alloc_idle_fgpu_allocated:sum)", "allocated but idle", "", fleet=True)],
           unit="none", decimals=1, dashed="^capacity$",
           desc="Fleet totals over time, from each zone's recorded total (one series per zone, so the range stays cheap on "
                "10,000 nodes): the agent and node filters do not apply here; the stats above follow them.",
           no_value="no node reporting"),
        bargauge("Requests the fleet can still place ($fragmentation)",
                 [I('sum by (slot, request) (zone_slot_request:gpu_alloc_request_fits:sum{fragmentation="$fragmentation"})', "{{slot}} = {{request}}", "", fleet=True)],
                 unit="none", decimals=0, desc="How many more requests of each reference size all nodes would take, summed per zone "
                                               "and over the zones (a zone total: the agent and node filters do not apply).",
                 no_value="capacity unknown: no telemetry"),
    )
    d.add(
        table("Capacity and free by slot", [TAB("sum by (slot) (instance_slot:gpu_alloc_device_capacity:sum{%S})", F),
                                            TAB("sum by (slot) (instance_slot:gpu_alloc_device_free:sum{%S})", F)],
              unit="none", rename={"Value #A": "capacity", "Value #B": "free"},
              desc="Every accelerator slot of the selected nodes: fGPU shares, whole GPUs, each MIG profile.",
              no_value="capacity unknown: no telemetry"),
        stat("Kernels by state", [I("sum by (state) (instance_state:gpu_alloc_kernels:sum{%S})", "{{state}}", F, fleet=True)], unit="none", w=12, h=8,
             desc="Kernel scratch directories of the selected nodes: ok, pending, invalid (malformed resource.txt).",
             no_value="no node reporting"),
    )

    d.row("Nodes")
    d.add(
        table("Nodes (now)",
              [TAB(f"{per_node} (instance:gpu_alloc_fgpu_allocated:sum{{%S}})", F),
               TAB(f"{per_node} (instance:gpu_alloc_fgpu_capacity:sum{{%S}})", F),
               TAB(f'{per_node} (instance_slot:gpu_alloc_node_headroom:max{{%S, slot="cuda.shares", fragmentation="$fragmentation"}})', F),
               TAB(f'{per_node} (instance_slot:gpu_alloc_node_max_single_device_free:max{{%S, slot="cuda.shares"}})', F),
               TAB(f'{per_node} (instance_slot:gpu_alloc_node_fragmentation_ratio:max{{%S, slot="cuda.shares"}})', F),
               TAB(f"{per_node} (instance:gpu_alloc_idle_fgpu_allocated:sum{{%S}})", F),
               TAB(f"{per_node} (instance:gpu_alloc_device_utilization_ratio:avg{{%S}})", F),
               TAB(f"{per_node} (instance:gpu_alloc_device_memory_used:ratio{{%S}})", F)],
              unit="none", w=24, h=10, links=[node_link()],
              rename={"Value #A": "fGPU allocated", "Value #B": "fGPU capacity", "Value #C": "headroom", "Value #D": "largest on one GPU",
                      "Value #E": "fragmentation", "Value #F": "idle fGPU", "Value #G": "mean utilisation",
                      "Value #H": "memory used"},
              column_units={"fragmentation": "percentunit", "mean utilisation": "percentunit", "memory used": "percentunit"},
              desc="One row per node (recorded series). Empty cells: not measured on that node (no telemetry, fractional slot absent).",
              no_value="no node reporting"),
    )

    d.row("Where can a session start?")
    ZONE_ONLY = "rows per node and shape stay in each zone's Prometheus: empty on the global level"  # noqa: N806
    # Per node and configured request shape (--fleet.shape), from the fleet rules'
    # instance_shape* series: would the agent place it (both fragmentation modes, with the reason
    # it would not), what the manager sees left of the shape's slot, HAMi's node score and whether
    # HAMi's binpack (highest score) or spread (lowest) would pick the node among the selected
    # nodes that place it with fragmentation $fragmentation.
    verdict = "instance_shape:gpu_alloc_node_request_placeable:reason"
    hami = "instance_shape:gpu_alloc_node_hami_score:shape_slot"
    placing = f'({hami}{{%S}} * on (job, instance, shape) group_right () ({verdict}{{%S, fragmentation="$fragmentation"}} == 1))'

    def mode(fragmentation: str) -> str:
        # label_join copies the reason into a column of its own per mode (absent while placeable).
        return (f'max without (reason, fragmentation) (label_join({verdict}{{%S, fragmentation="{fragmentation}"}}, '
                f'"reason_{fragmentation}", "", "reason"))')

    def first(op: str) -> str:
        return f"max without (reason, fragmentation) ({placing} == bool on (shape) group_left () {op} by (shape) ({placing}))"

    flags = [value_map({"0": ("-", "transparent"), "1": ("first", OK)})]
    yes_no = [value_map({"0": ("no", BAD), "1": ("yes", OK)})]
    columns = [{"matcher": {"id": "byName", "options": name}, "properties": [{"id": "mappings", "value": maps}]}
               for name, maps in (("placeable (allowed)", yes_no), ("placeable (disallowed)", yes_no),
                                  ("HAMi binpack", flags), ("HAMi spread", flags))]
    where = table(
        "Where can a session of each shape start?",
        [TAB(mode("allowed"), F, empty_ok=ZONE_ONLY), TAB(mode("disallowed"), F, empty_ok=ZONE_ONLY),
         TAB("instance_shape:gpu_alloc_node_remaining:shape_slot{%S}", F, empty_ok=ZONE_ONLY),
         TAB(f"{hami}{{%S}}", F, empty_ok=ZONE_ONLY),
         TAB(first("max"), F, empty_ok="no selected node places the shape"),
         TAB(first("min"), F, empty_ok="no selected node places the shape")],
        unit="none", w=24, h=12, links=[node_link(), *columns],
        rename={"Value #A": "placeable (allowed)", "Value #B": "placeable (disallowed)", "reason_allowed": "why not (allowed)",
                "reason_disallowed": "why not (disallowed)", "Value #C": "remaining of the slot", "Value #D": "HAMi node score",
                "Value #E": "HAMi binpack", "Value #F": "HAMi spread"},
        desc="One row per node and request shape (--fleet.shape; filter the shape column): whether the node's agent would place "
             "it now with fragmentation allowed and disallowed, and why not (capacity, fragmented, numa, mig_profile_missing, "
             "stale_allocation); what the manager sees left of the shape's slot; HAMi's node score (10 x core + memory used "
             "ratio, 0-20). Sorted by that score: HAMi's binpack sends the session to the highest-scored node that places it, "
             "spread to the lowest ('first', among the selected nodes, with fragmentation $fragmentation). docs/headroom.md. "
             "These rows stay in each zone's Prometheus (20 series per node): choose a zone as the data source; the global "
             "level has the per-shape results (predicted failures, placeable agents).",
        no_value="on a zone's Prometheus only (rows per node and shape stay in the zone), or the fleet rules not loaded")
    where.options["sortBy"] = [{"displayName": "HAMi node score", "desc": True}]
    where.custom = {"filterable": True}
    d.add(where)

    d.row("Fragmentation hot spots")
    d.add(
        table("Most fragmented nodes", [TAB('topk(10, instance_slot:gpu_alloc_node_fragmentation_ratio:max{%S, slot="cuda.shares"})', F)],
              unit="percentunit", hide=("Time", "__name__", "job", "slot"), rename={"Value": "fragmentation"}, links=[node_link()],
              desc="Nodes whose free fGPU sits mostly on partly used GPUs.", no_value="no fractional GPU node"),
        table("Stranded free fGPU",
              # on (zone): a global view holds every zone's thresholds (a zone's own have no zone label).
              [TAB('instance_slot:gpu_alloc_device_free:sum{%S, slot="cuda.shares"} >= on (zone) group_left () global:gpu_alloc_node_free_fgpu:threshold'
                   ' and on (job, instance, slot) (instance_slot:gpu_alloc_node_max_single_device_free:max{%S, slot="cuda.shares"}'
                   ' < on (zone) group_left () global:gpu_alloc_node_max_single_device_free:threshold)', F,
                   empty_ok="lists only fragmented nodes")],
              unit="none", hide=("Time", "__name__", "job", "slot"), rename={"Value": "free fGPU"}, links=[node_link()],
              desc=f"Nodes with at least {thr('gpu_alloc_node_free_fgpu'):g} fGPU free but less than {thr('gpu_alloc_node_max_single_device_free'):g} "
                   "on any one GPU (GpuAllocNodeFragmented).",
              no_value="no fragmented node"),
    )

    d.row("Kernels: top allocations, memory, idle")
    d.add(
        table("Top kernels by fGPU", [TAB(top_kernels("gpu_alloc_kernel_fgpu_allocated", "sum"), F)], unit="none", w=8, h=10,
              rename={"Value": "fGPU"}, links=[kernel_link(), node_link()],
              desc="The 20 largest GPU allocations of the selected nodes (recorded once a minute). " + TOP_KERNELS_SCOPE,
              no_value="no kernel holds a GPU"),
        table("Top kernels by GPU memory used", [TAB(top_kernels("gpu_alloc_kernel_memory_used_bytes", "sum"), F)], unit="bytes",
              w=8, h=10, rename={"Value": "memory used"}, links=[kernel_link(), node_link()],
              desc="Measured GPU memory of each kernel's processes, the 20 largest of the selected nodes. " + TOP_KERNELS_SCOPE,
              no_value="no kernel process on a GPU, or attribution off"),
        table("Longest idle kernels", [TAB(top_kernels("gpu_alloc_kernel_idle_seconds", "min"), F)], unit="s", w=8, h=10,
              rename={"Value": "idle for"}, links=[kernel_link(), node_link()],
              desc="Kernels whose every allocated GPU has been idle longest, the 20 of the selected nodes. " + TOP_KERNELS_SCOPE,
              no_value="per-kernel use not measured"),
    )

    d.row("GPU ledger: per user, last day")
    per_user = "sum by (user_id, project_id) (instance_user:{m}:increase1d{{%S}}) or zone_user:{m}:increase1d{{%S}}"
    d.add(
        table("GPU-hours and kWh per user (last 24 h)",
              [TAB(per_user.format(m="gpu_alloc_user_allocated_gpu_hours"), F),
               TAB(per_user.format(m="gpu_alloc_user_busy_gpu_hours"), F, empty_ok="only where busy time is measured"),
               TAB(per_user.format(m="gpu_alloc_user_energy_kwh"), F, empty_ok="only where the GPUs report energy")],
              unit="none", w=24, h=8,
              rename={"Value #A": "GPU-hours held", "Value #B": "GPU-hours busy", "Value #C": "kWh"},
              column_units={"GPU-hours held": "h", "GPU-hours busy": "h", "kWh": "kwatth"},
              desc="The exporter's lossless per-user counters over the last day (recorded every 5 minutes): "
                   "per node in a zone, summed over the zone's nodes where only the zone sums cross (all nodes selected).",
              no_value="no kernel held a GPU in the last day, or the ledger rules are not loaded"),
    )

    d.row("Health summary")
    d.add(
        table("Node health (now)",
              [TAB(f"{per_node} (instance:gpu_alloc_devices_down:sum{{%S}})", F),
               TAB(f"{per_node} (instance:gpu_alloc_xid_critical_recent:count{{%S}})", F),
               TAB(f"{per_node} (instance:gpu_alloc_ecc_uncorrected_errors:increase1h{{%S}})", F, empty_ok="only on GPUs with ECC"),
               TAB(f"{per_node} (instance:gpu_alloc_throttled_devices:sum{{%S}})", F, empty_ok="only where throttle reasons are reported"),
               TAB(f"{per_node} (instance:gpu_alloc_collector_failures:sum{{%S}})", F),
               TAB(f"{per_node} (instance:gpu_alloc_watcher_healthy:min{{%S}})", F),
               TAB(f"{per_node} (instance:gpu_alloc_overcommitted_devices:sum{{%S}})", F),
               TAB(f"{per_node} (instance:gpu_alloc_isolation_breaches:sum{{%S}})", F),
               TAB(f"{per_node} (instance:gpu_alloc_unattributed_processes:sum{{%S}})", F, empty_ok="only while unattributed processes run"),
               TAB(f"{per_node} (instance:gpu_alloc_stale_kernels:sum{{%S}})", F)],
              unit="none", w=24, h=10, links=[node_link()],
              rename={"Value #A": "GPUs down", "Value #B": "critical XIDs (1h)", "Value #C": "uncorrected ECC (1h)", "Value #D": "throttled GPUs",
                      "Value #E": "collector failures", "Value #F": "watcher healthy", "Value #G": "overcommitted devices",
                      "Value #H": "isolation breaches", "Value #I": "unattributed processes", "Value #J": "stale kernels"},
              desc="One row per node. Empty cells mean not measured there (no telemetry, no ECC, attribution off), never zero.",
              no_value="no node reporting"),
    )
    d.add(
        ts("Fleet health over time", [T("sum(zone:gpu_alloc_devices_down:sum)", "GPUs down", "", fleet=True),
                                      T("sum(zone:gpu_alloc_throttled_devices:sum)", "GPUs throttled", "", fleet=True,
                                        empty_ok="only where throttle reasons are reported"),
                                      T("sum(zone:gpu_alloc_xid_critical_recent:sum)", "critical XIDs (1h)", "", fleet=True),
                                      T("sum(zone:gpu_alloc_collector_failures:sum)", "collector failures", "", fleet=True)],
           unit="none", desc="Fleet totals of the health columns over time, from each zone's recorded totals (the agent and node "
                             "filters do not apply).", no_value="no node reporting"),
        table("Firing gpu-alloc alerts", [TAB('ALERTS{alertname=~"GpuAlloc.*", alertstate="firing"}', "",
                                              empty_ok="nothing fires on a healthy fleet")],
              unit="none", hide=("Time", "__name__", "alertstate", "Value"), links=[node_link()],
              desc="Alerts of alerts/gpu-alloc.rules.yml firing now.", no_value="no gpu-alloc alert firing"),
    )
    return d


# --- kernel ------------------------------------------------------------------------------------


def kernel() -> Dashboard:
    K, N = KERNEL_SEL, KERNEL_NODE_SEL
    variables = [
        *_common_vars(),
        # One node, never All: every query below is bounded to one node's series (links from
        # alerts and tables pass var-instance), and the kernel list is that node's kernels only.
        query_var("instance", "Node", 'label_values(gpu_alloc_build_info{job=~"$job", agent_id=~"$agent"}, instance)',
                  description="The node the kernel runs on (alerts and tables pass it in the link)"),
        # An instant query of the node's kernels: Prometheus 2.42 answers label_values(…, kernel_id)
        # by intersecting the node's series with every kernel_id value of the zone (0.9 s at 57,000
        # kernels), the instant query reads the node's ~60 series (BENCHMARKS.md, "Fleet").
        query_var("kernel_id", "Kernel", 'query_result(gpu_alloc_kernel_info{job=~"$job", instance="$instance"})',
                  regex='/kernel_id="([^"]+)"/',
                  description="Backend.AI kernel id (the scratch directory name) on the selected node"),
    ]
    d = Dashboard(KERNEL_UID, "gpu-alloc / Kernel",
                  "One Backend.AI kernel: what it holds, what it uses, whether it is idle or stale, and the devices it shares.",
                  TAGS, variables, _links())
    on_its_devices = f"and on (job, instance, device_id) gpu_alloc_kernel_allocated{{{K}}}"

    d.row("Allocation")
    d.add(
        table("Kernel", [TAB("gpu_alloc_kernel_info{%S}", K)], unit="none", hide=("Time", "__name__", "job", "Value"), links=[node_link()], w=8, h=5,
              desc="Node and parse state of the kernel's resource.txt.", no_value="kernel not found (ended, or another node selected)"),
        stat("Stale", [I("gpu_alloc_kernel_stale{%S}", "{{instance}} {{reason}}", K, empty_ok="series exist only for stale kernels")], unit="none",
             mappings=[value_map({"1": ("STALE", BAD)})], w=8, h=5,
             desc="A scratch directory without a running container (GpuAllocStaleKernel).", no_value="not stale (or liveness not checked)"),
        stat("Isolation", [I("max by (job, instance) (gpu_alloc_kernel_isolation_breach{%S})", "{{instance}}", K)], unit="none",
             mappings=[value_map({"0": ("isolated", OK), "1": ("BREACH", BAD)})], w=8, h=5,
             desc="1 if the kernel runs a process on a device it was not allocated (GpuAllocIsolationBreach).",
             no_value="no process on a GPU, or attribution off"),
    )
    d.add(
        table("Allocation (now)", [TAB("gpu_alloc_kernel_allocated{%S}", K), TAB("gpu_alloc_kernel_allocated_bytes{%S}", K, empty_ok="only with cuda.mem")],
              unit="none", hide=("Time", "__name__", "job", "kernel_id"), rename={"Value #A": "amount", "Value #B": "bytes"},
              column_units={"bytes": "bytes"}, desc="Slots the kernel holds per device.", no_value="holds no accelerator"),
        ts("Allocation over time", [T("gpu_alloc_kernel_allocated{%S}", "{{instance}} {{device_id}} {{slot}}", K)], unit="none", decimals=2,
           desc="What the kernel held over time.", no_value="holds no accelerator"),
    )

    d.row("Measured use")
    d.add(
        ts("GPU memory: used vs allocated",
           [T("gpu_alloc_kernel_memory_used_bytes{%S}", "{{instance}} {{device_id}} used", K),
            T('gpu_alloc_kernel_allocated_bytes{%S, slot="cuda.mem"}', "{{instance}} {{device_id}} allocated", K, empty_ok="only with cuda.mem")],
           unit="bytes", dashed=".* allocated$",
           desc=f"Memory of the kernel's processes against its cuda.mem allocation (GpuAllocKernelMemoryNearLimit at {thr('gpu_alloc_kernel_memory_used_ratio'):.0%}). "
                "cuda.mem belongs to legacy plugins: with current ones only used is drawn, and a kernel's limit is its shares x unit_mem.",
           no_value="no process on a GPU, or attribution off (allocated: cuda.mem, legacy plugins only)"),
        ts("Utilisation", [T("gpu_alloc_kernel_utilization_ratio{%S}", "{{instance}} {{device_id}}", K)], unit="percentunit", min=0, max=1,
           desc="SM utilisation of the kernel's processes on each device.", no_value="not measurable (MIG) or attribution off"),
    )
    idle = thr("gpu_alloc_kernel_idle_seconds")
    d.add(
        ts("Idle and without process", [T("gpu_alloc_kernel_idle_seconds{%S}", "{{instance}} {{device_id}} idle", K),
                                        T("gpu_alloc_kernel_no_process_seconds{%S}", "{{instance}} {{device_id}} no process", K)],
           unit="s", thresholds=[(None, OK), (idle, WARN)],
           desc=f"How long the kernel has been below the idle threshold, or without any process, on each device (GpuAllocAllocatedButIdle at {idle / 3600:g} h).",
           no_value="attribution off"),
        ts("Processes", [T("gpu_alloc_kernel_processes{%S}", "{{instance}} {{device_id}}", K)], unit="none", decimals=0,
           desc="Compute processes of the kernel per device.", no_value="attribution off"),
    )

    d.row("Its devices (shared with other kernels)")
    d.add(
        ts("Device utilisation", [T(f"gpu_alloc_device_utilization_ratio{{%S}} {on_its_devices}", "{{instance}} {{device_id}}", N)],
           unit="percentunit", min=0, max=1, desc="Whole-device utilisation of the GPUs the kernel holds (all tenants).",
           no_value="not reported (MIG) or telemetry off"),
        ts("Device memory used", [T(f"gpu_alloc_device_memory_used_bytes{{%S}} {on_its_devices}", "{{instance}} {{device_id}} used", N),
                                  T(f"gpu_alloc_device_memory_total_bytes{{%S}} {on_its_devices}", "{{instance}} {{device_id}} total", N)],
           unit="bytes", dashed=".* total$", desc="Memory of the GPUs the kernel holds (all tenants).", no_value="telemetry off, or MIG device"),
    )
    d.add(
        ts("Device temperature", [T(f"gpu_alloc_device_temperature_celsius{{%S}} {on_its_devices}", "{{instance}} {{device_id}}", N)],
           unit="celsius", desc="Temperature of the GPUs the kernel holds.", no_value="telemetry off, or MIG device"),
        table("Other kernels on its devices",
              [TAB(f'gpu_alloc_kernel_allocated{{%S, kernel_id!="$kernel_id"}} {on_its_devices}', N,
                   empty_ok="a kernel alone on its devices has no co-tenants")],
              unit="none", hide=("Time", "__name__", "job"), rename={"Value": "amount"}, links=[kernel_link()],
              desc="Co-tenants: kernels holding a share of the same devices.", no_value="alone on its devices"),
    )
    return d


def sessions() -> Dashboard:
    """Backend.AI's sessions and users on one node: who holds which GPU, allocated against measured
    use by user and by session, the longest-idle sessions and GPU-hours (chargeback).

    Identity sits on one info series per kernel (``gpu_alloc_kernel_identity_info``); every panel
    joins it with ``group_left``, so no per-kernel family carries identity labels."""
    N = KERNEL_NODE_SEL
    who = 'gpu_alloc_kernel_identity_info{%S, user_id=~"$user", session_id=~"$session"}'
    join = f"on (job, instance, kernel_id) group_left (user_id, session_id) {who}"
    variables = [
        *_common_vars(),
        query_var("instance", "Node", 'label_values(gpu_alloc_build_info{job=~"$job", agent_id=~"$agent"}, instance)',
                  description="One node: every query below is bounded to its kernels"),
        query_var("user", "User", 'label_values(gpu_alloc_kernel_identity_info{job=~"$job", instance="$instance"}, user_id)',
                  multi=True, include_all=True, description="Backend.AI owner user id (recovery.json; undefined when unknown)"),
        query_var("session", "Session",
                  'label_values(gpu_alloc_kernel_identity_info{job=~"$job", instance="$instance", user_id=~"$user"}, session_id)',
                  multi=True, include_all=True, description="Backend.AI session id"),
    ]
    d = Dashboard(SESSIONS_UID, "gpu-alloc / Sessions and users",
                  "Backend.AI sessions and users on one node: who holds each GPU, allocated against measured use, idle sessions, GPU-hours.",
                  TAGS, variables, _links())
    # GPUs held per kernel (a MIG slice or an fGPU share as its fraction of the physical GPU).
    held = "sum by (job, instance, kernel_id) (gpu_alloc_kernel_gpu_share_ratio{%S})"
    used = f"({held} * on (job, instance, kernel_id) gpu_alloc_kernel_measured_utilization_ratio{{%S}})"

    d.row("Allocated against measured use")
    for by, label in (("user_id", "user"), ("session_id", "session")):
        d.add(
            ts(f"GPUs by {label}: allocated and used",
               [T(f"sum by (instance, {by}) ({held} * {join})", f"{{{{instance}}}} {{{{{by}}}}} allocated", N),
                T(f"sum by (instance, {by}) ({used} * {join})", f"{{{{instance}}}} {{{{{by}}}}} used", N,
                  empty_ok="no measured use (MIG, no process list, or attribution off)")],
               unit="none", decimals=2, dashed=".* used$",
               desc=f"Physical GPUs each {label} holds (fGPU shares as a fraction of the GPU, MIG slices as theirs), and the part "
                    "its processes keep busy (held × measured SM utilisation). A failed measurement leaves the used line out, never 0.",
               no_value="no kernel with an identity (recovery.json) on this node"),
        )

    d.row("Who holds each GPU")
    d.add(
        table("Holders per GPU",
              [TAB("gpu_alloc_kernel_gpu_share_ratio{%S} * on (job, instance, kernel_id) group_left (user_id, session_id, session_type) "
                   + who.replace("%S", "%S"), N)],
              unit="none", hide=("Time", "__name__", "job", "instance", "agent_id", "project_id"), rename={"Value": "share of the GPU"},
              links=[kernel_link()], w=24,
              desc="Every kernel on each physical GPU with its session, user and share (fGPU, whole GPU or MIG slice): the blast "
                   "radius when a GPU fails (GpuAllocSessionsOnUnhealthyGpu).",
              no_value="no kernel holds a GPU"),
    )

    d.row("Idle sessions and GPU-hours")
    d.add(
        table("Longest-idle sessions",
              [TAB(f"topk(10, max by (instance, session_id, user_id) (max by (job, instance, kernel_id) (gpu_alloc_kernel_idle_seconds{{%S}}) * {join}))",
                   N, empty_ok="no kernel below the idle threshold")],
              unit="s", hide=("Time",), rename={"Value": "idle for"},
              desc="Sessions whose kernels have been below the idle threshold longest (the longest of their devices).",
              no_value="no idle session (or attribution off)"),
        bargauge("GPU-hours by user (chargeback, over the range)",
                 [I(f"sum by (instance, user_id) (increase(gpu_alloc_kernel_allocated_gpu_seconds_total{{%S}}[$__range]) * {join}) / 3600",
                    "{{instance}} {{user_id}}", N)],
                 unit="none", decimals=2,
                 desc="Allocated GPU-hours per user over the dashboard's range, from counters the exporter integrates itself "
                      "(exact however Prometheus scrapes; increase() spans restarts). Kernels ended more than 10 minutes before "
                      "the range's end are no longer joined to a user: docs/backendai.md has the fleet query.",
                 no_value="no kernel with an identity held a GPU in the range"),
    )

    # The GPU ledger (recorded by the gpu-alloc-ledger group every 5 minutes, over the last day).
    d.row("Ledger: GPU-hours and energy per day")
    owner = '{%S, user_id=~"$user"}'
    d.add(
        bargauge("GPU-hours per user and project, last day: held and busy",
                 [I(f"instance_user:gpu_alloc_user_allocated_gpu_hours:increase1d{owner}", "{{instance}} {{user_id}} {{project_id}} held", N,
                    empty_ok="no kernel held a GPU in the last day, or the ledger rules have not run yet"),
                  I(f"instance_user:gpu_alloc_user_busy_gpu_hours:increase1d{owner}", "{{instance}} {{user_id}} {{project_id}} busy", N,
                    empty_ok="no GPU's busy time measured (MIG, no per-process counters, attribution off)")],
                 unit="none", decimals=2,
                 desc="GPU-hours each user's kernels held on this node in the last 24 h, per project, and the busy part (busy "
                      "seconds of their processes × the share held). From the exporter's per-user counters: every session counts in "
                      "full, however short and however Prometheus scrapes.",
                 no_value="no kernel held a GPU in the last day"),
        bargauge("Energy per user and project, last day",
                 [I(f"instance_user:gpu_alloc_user_energy_kwh:increase1d{owner}", "{{instance}} {{user_id}} {{project_id}}", N)],
                 unit="kwatth", decimals=3,
                 desc="kWh of the GPUs charged to each user's kernels in the last 24 h, split per --accounting.energy-split "
                      "(default: the larger of the share held and the part of the activity).",
                 no_value="no GPU energy counter, or no kernel in the last day"),
    )
    session = '{%S, user_id=~"$user", session_id=~"$session"}'
    d.add(
        bargauge("GPU-hours per session, last day",
                 [I(f"topk(20, instance_session:gpu_alloc_kernel_allocated_gpu_hours:increase1d{session})",
                    "{{instance}} {{session_id}} {{user_id}}", N)],
                 unit="none", decimals=2,
                 desc="The 20 sessions that held the most GPU-hours on this node in the last 24 h (kernels whose identity was read).",
                 no_value="no session with an identity held a GPU in the last day"),
        bargauge("Energy per session, last day",
                 [I(f"topk(20, instance_session:gpu_alloc_kernel_energy_kwh:increase1d{session})", "{{instance}} {{session_id}} {{user_id}}", N)],
                 unit="kwatth", decimals=3, desc="kWh charged to the 20 most energy-hungry sessions on this node in the last 24 h.",
                 no_value="no GPU energy counter, or no session with an identity in the last day"),
    )
    d.add(
        stat("Busy against held, last hour", [I("instance:gpu_alloc_busy_over_allocated:ratio1h{%S}", "{{instance}}", N,
                                                 empty_ok="only where busy time is measured (per-process samples, no MIG)")],
             unit="percentunit", decimals=1, w=6,
             desc="Busy GPU-seconds over GPU-seconds held by the node's kernels in the last hour, on the GPUs whose busy time "
                  "is measured.", no_value="no GPU's busy time measured"),
        stat("Unallocated share, last hour", [I("instance:gpu_alloc_unallocated:ratio1h{%S}", "{{instance}}", N)],
             unit="percentunit", decimals=1, w=6,
             desc="The part of the node's GPU time that no kernel held in the last hour (allocated + unallocated = elapsed).",
             no_value="no GPU known to the ledger"),
        ts("GPU power: charged to kernels and unattributed",
           [T("sum by (instance) (rate(gpu_alloc_device_attributed_energy_joules_total{%S}[$__rate_interval]))", "{{instance}} kernels", N),
            T("sum by (instance) (rate(gpu_alloc_device_unattributed_energy_joules_total{%S}[$__rate_interval]))", "{{instance}} unattributed", N)],
           unit="watt", stack=True,
           desc="The GPUs' energy counters split by the ledger: the part charged to kernels and the rest (idle capacity, "
                "unallocated shares). The two add up to the GPUs' power.",
           no_value="no GPU energy counter"),
    )
    return d


def dashboards() -> dict[str, Dashboard]:
    """File name (in ``dashboards/``) → dashboard."""
    return {"gpu-alloc-node.json": node(), "gpu-alloc-fleet.json": fleet(), "gpu-alloc-kernel.json": kernel(),
            "gpu-alloc-sessions.json": sessions()}


def rendered() -> dict[Path, str]:
    """Output path → JSON text (the committed form), for every dashboard."""
    return {OUT / name: dumps(d.build()) for name, d in dashboards().items()}


def expected_empty() -> dict[tuple[str, str, str], str]:
    """(dashboard uid, panel title, refId) → why that query may return no series on a healthy node."""
    out = {}
    for d in dashboards().values():
        for p in d.panels():
            for i, t in enumerate(p.targets):
                if t.empty_ok:
                    out[(d.uid, p.title, chr(ord("A") + i))] = t.empty_ok
    return out
