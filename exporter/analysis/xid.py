"""A small catalogue of NVIDIA XID codes: what each means for a Backend.AI node and what to do.

Written for this exporter from the driver's public XID descriptions, in its own words, for the
codes that decide a device's health (:mod:`exporter.analysis.health`). ``effect`` is what the
code does to the device until a remedy is seen: ``lost`` (off the bus), ``needs_reset`` (the GPU
must be reset before it can be trusted), ``degraded`` (usable, but memory or a link is failing),
or ``none`` (an application's own fault: nothing to latch). An unknown code has no effect here
and says so; the driver's catalogue is authoritative.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CATALOGUE_VERSION", "UNKNOWN_MEANING", "XidInfo", "xid_info"]

CATALOGUE_VERSION = "2026.11"  # moves whenever an entry below changes
UNKNOWN_MEANING = "unknown XID, see the driver's catalogue"


@dataclass(frozen=True, slots=True)
class XidInfo:
    """One code: its meaning, the recommended action and its effect on the device's health."""

    xid: int
    meaning: str
    action: str
    effect: str  # "lost", "needs_reset", "degraded" or "none"


_RESET = "drain the node, let the sessions end, then reset the GPU"
_ENTRIES = (
    XidInfo(13, "a graphics engine exception in an application", "check the application; nothing to do on the GPU", "none"),
    XidInfo(31, "a memory page fault in an application", "check the application; nothing to do on the GPU", "none"),
    XidInfo(43, "an application stopped on a GPU fault", "check the application; nothing to do on the GPU", "none"),
    XidInfo(45, "the driver ended an application's work (preemptive cleanup)", "nothing to do on the GPU", "none"),
    XidInfo(48, "a double-bit ECC error in device memory", _RESET + "; replace it if errors recur", "needs_reset"),
    XidInfo(61, "an internal micro-controller breakpoint", _RESET, "needs_reset"),
    XidInfo(62, "an internal micro-controller halted", _RESET, "needs_reset"),
    XidInfo(63, "a row remap or page retirement was recorded", _RESET + " so the remap takes effect", "needs_reset"),
    XidInfo(64, "a row remap or page retirement failed", _RESET + "; replace the GPU if it fails again", "needs_reset"),
    XidInfo(74, "an NVLink error", _RESET + "; check the NVLink cabling or bridge if it recurs", "needs_reset"),
    XidInfo(79, "the GPU fell off the bus", "drain the node and reset the GPU or reboot; check power and seating", "lost"),
    XidInfo(92, "a high rate of single-bit ECC errors", "watch the ECC counters; plan a GPU reset", "degraded"),
    XidInfo(94, "a contained ECC error: one application was stopped", "the GPU keeps working; plan a reset to remap the row",
            "degraded"),
    XidInfo(95, "an uncontained ECC error: every application on the GPU is affected", _RESET, "needs_reset"),
    XidInfo(119, "a GSP firmware call timed out", _RESET + "; update the driver if it recurs", "needs_reset"),
    XidInfo(120, "the GSP firmware reported an error", _RESET + "; update the driver if it recurs", "needs_reset"),
    XidInfo(140, "an unrecovered ECC error in device memory", _RESET, "needs_reset"),
)
_CATALOGUE = {e.xid: e for e in _ENTRIES}


def xid_info(xid: int) -> XidInfo:
    """The entry for ``xid``; an unknown code gets :data:`UNKNOWN_MEANING` and no effect."""
    return _CATALOGUE.get(xid) or XidInfo(xid, UNKNOWN_MEANING, "see the driver's XID catalogue", "none")
