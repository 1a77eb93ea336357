"""Results → Prometheus: the collector registry and its parts, and the families of each concern."""
