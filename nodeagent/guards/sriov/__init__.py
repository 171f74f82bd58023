"""The VF guard's host side, one wing: everything of SR-IOV that touches the node.

- ``side.py``: ``SriovSide``, what the loop runs (guards/side.py's contract);
- ``observe.py``: PFs and VFs read from sysfs and netlink, the snapshot file;
- ``act.py``: the executor of ``RestoreVf`` and ``SetNumVfs``;
- ``netlink.py``: ``SriovOps`` (the wing's port) over pyroute2, and sysfs writes.

The decision is ``core/sriov.py``. A wing imports only ``guards/side.py``, ``host/``
and ``core/``; only the registry, the simulator, benches and tests import it
(tests/test_shape.py).
"""
