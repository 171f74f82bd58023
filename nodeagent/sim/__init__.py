"""The node simulator: the seed incidents on a simulated GPU/RDMA node (docs/simulator.md).

``kernel`` (SimKernel: module operations, sysfs, uevents, SR-IOV), ``modtree``
and ``kofile`` (real .ko files and modules.dep), ``clock`` (the virtual clock),
``node`` (the host root and the timeline), ``actors`` (MOFED, GPU driver, host),
``harness`` (the real agent in a thread), ``scenarios``, ``render``, ``cli``.
"""
