"""Helpers for the end-to-end monitoring test (real exporter, Prometheus and Alertmanager)."""
