"""Allocation and telemetry combined: capacity, placement, headroom, simulate, liveness and
process attribution. Pure functions over snapshots, plus the attribution tracker's caches."""
