"""The holders graph read through the Observer, and removal_order, against a real kernel.

The whole storage chain MOFED refuses on is loaded with LibKmod.probe; the
order computed from /sys/module/*/holders must take out exactly what the
chain pulled in, with no EBUSY anywhere, and the kernel must agree with the
graph when the order is wrong.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

import pytest

from nodeagent.config import Config
from nodeagent.core.modgraph import RemovalBlocked, holders_closure, pulled_in, removal_order
from nodeagent.core.snapshot import LoadedModule
from nodeagent.host.fs import HostRoot
from nodeagent.host.kmod import LibKmod, ModuleOpError
from nodeagent.host.moddep import find_module
from nodeagent.host.observe import Observer

pytestmark = pytest.mark.realkernel

STORAGE = ("rpcrdma", "xprtrdma", "nvme_rdma", "nvmet_rdma", "ib_isert", "ib_srpt")


def _observe() -> dict[str, LoadedModule]:
    mods, problems = Observer(HostRoot("/"), Config()).read_loaded_modules()
    assert problems == []
    return mods


def _proc_modules_users() -> dict[str, set[str]]:
    """Module -> its users, from /proc/modules (a source independent of holders/)."""
    users: dict[str, set[str]] = {}
    for line in Path("/proc/modules").read_text().splitlines():
        fields = line.split()
        users[fields[0]] = {u for u in fields[3].split(",") if u and u != "-" and u[0] != "["}
    return users


def _force_back(before: set[str]) -> None:
    """Best effort after a failure: remove what is new, whatever holds what."""
    for _ in range(10):
        extra = set(_observe()) - before
        if not extra:
            return
        for name in sorted(extra):
            with contextlib.suppress(ModuleOpError):
                LibKmod().remove(name)


def test_storage_chain_removed_in_holders_order() -> None:
    moddir = f"/usr/lib/modules/{os.uname().release}"
    chain = [m for m in STORAGE if find_module(moddir, m) is not None]
    assert {"rpcrdma", "nvme_rdma", "nvmet_rdma", "ib_isert", "ib_srpt"} <= set(chain)
    lk = LibKmod()
    before = set(_observe())
    assert not set(chain) & before
    try:
        for name in chain:
            lk.probe(name, moddir)
        after = _observe()
        targets = pulled_in(before, after, chain)
        assert set(chain) <= targets
        assert {"ib_core", "rdma_cm", "ib_cm", "iw_cm", "sunrpc"} <= targets
        assert all(after[m].live for m in targets)

        # The Observer's holders are the kernel's module users (/proc/modules).
        users = _proc_modules_users()
        for name in targets:
            assert set(after[name].holders) == users[name], name
        assert {"rpcrdma", "nvme_rdma", "nvmet_rdma", "ib_isert", "ib_srpt"} <= set(
            after["rdma_cm"].holders
        )
        # Nothing loaded before holds what the chain pulled in: removable as a whole.
        assert holders_closure(after, chain) <= targets

        # removal_order refuses a part that something outside still holds ...
        with pytest.raises(RemovalBlocked, match=r"rdma_cm is held by .*rpcrdma"):
            removal_order(after, ["rdma_cm"])
        # ... and so does the kernel: the wrong order is EBUSY, and changes nothing.
        for name in ("rdma_cm", "ib_core", "sunrpc"):
            with pytest.raises(ModuleOpError) as ei:
                lk.remove(name)
            assert ei.value.errno == errno.EBUSY, ei.value
        assert set(_observe()) == set(after)

        order = removal_order(after, targets)
        assert sorted(order) == sorted(targets)
        pos = {m: i for i, m in enumerate(order)}
        for name in order:  # every user goes before what it uses
            assert all(pos[u] < pos[name] for u in users[name]), (name, users[name], order)
        for name in order:
            lk.remove(name)  # no EBUSY anywhere
            assert not Path("/sys/module", name).exists()
    finally:
        _force_back(before)
    assert set(_observe()) == before
