"""gpu-alloc-exporter: live GPU allocation of Backend.AI kernels as Prometheus metrics."""

__version__ = "0.1.0"
