"""``gpu-alloc-exporter demo``: a living Backend.AI node, and sample scratch trees for tests.

- :mod:`exporter.demo.node`: the living node (simulated NVML devices, sessions placed by the
  agent's allocator, planted events on a schedule);
- :mod:`exporter.demo.host`: the node's ``/proc`` and cgroup tree;
- :mod:`exporter.demo.tree`: ``resource.txt`` as the agent writes it, and a still sample node.
"""

from exporter.demo.tree import (
    DEMO_DEVICES,
    append_cid,
    build_demo_tree,
    demo_devices,
    recovery_json,
    resource_lines,
    write_kernel,
    write_recovery,
)

__all__ = ["DEMO_DEVICES", "append_cid", "build_demo_tree", "demo_devices", "recovery_json", "resource_lines", "write_kernel",
           "write_recovery"]
