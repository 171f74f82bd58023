"""The VF guard against real SR-IOV: QEMU's igb (an 82576 PF) and igbvf netdevs that appear late.

The session's VM has one igb PF when QEMU is >= 8 (tests/realkernel/setup.py
installs one from Debian's backports). VFs are created with
``sriov_drivers_autoprobe`` 0 and bound one by one (``driver_override`` +
``drivers_probe``) in a random order at random delays, so their netdevs appear
out of order, as after a MOFED ``openibd restart`` (seed 003). The agent runs
its real loop (kernel uevents, pyroute2); the test reads every field back with
iproute2's JSON output, independently of the agent's own netlink code.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from typing import Any

import pytest

from nodeagent.agent import Agent
from nodeagent.config import Config
from nodeagent.core.actions import RestoreVf
from nodeagent.core.sriov import SriovMemory, SriovPolicy
from nodeagent.guards.sriov.act import SriovExecutor
from nodeagent.guards.sriov.netlink import PyrouteOps
from nodeagent.host.act import EXECUTORS, Actuator
from nodeagent.host.fs import HostRoot
from nodeagent.host.kmod import default_module_ops
from tests.realkernel.igb_vfs import (
    PCI,
    bind,
    configure,
    igb_pf,
    link,
    numvfs,
    sh,
    vf_pci,
    vfinfo,
    wanted,
)

pytestmark = pytest.mark.realkernel

NVFS = 2  # each igbvf probe takes ~2-4 s under TCG


def test_agent_restores_every_vf_as_its_late_netdev_appears() -> None:
    pf, pf_if = igb_pf()
    sh("ip", "link", "set", pf_if, "up")  # igb rate limits need the PF's link up
    numvfs(pf, NVFS)
    for i in range(NVFS):
        configure(pf_if, i, bind(vf_pci(pf, i)))
    # Woken by the kernel's uevents; the 2 s poll is only the fallback.
    policy = SriovPolicy(mofed="host", numvfs_owner="sriov-operator", poll_s=2.0)
    cfg = Config(host_root="/", mode="enforce", policies={"sriov": policy})
    agent = Agent(cfg)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()

    def pf_memory() -> Any:
        mem = agent.memory.get("sriov")
        return mem.pfs.get(pf) if isinstance(mem, SriovMemory) else None

    def wait(cond: Any, what: str, seconds: float = 60) -> None:
        end = time.monotonic() + seconds
        while not cond():
            if time.monotonic() > end:
                raise AssertionError(f"{what} not within {seconds}s; memory: {pf_memory()}")
            time.sleep(0.1)

    try:
        wait(lambda: pf_memory() is not None and len(pf_memory().saved.vfs) == NVFS, "snapshot")
        saved = pf_memory().saved
        assert saved.vf(1).settings["vlan"] == 11 and saved.vf(1).netdev is not None
        numvfs(pf, NVFS)  # to 0 and back: blank VFs, no drivers, no netdevs
        wait(lambda: pf_memory().phase == "restoring", "restoring")
        order = list(range(NVFS))
        random.Random(os.getpid()).shuffle(order)
        for i in order:  # netdevs appear out of order, at random delays
            time.sleep(random.uniform(0.0, 0.5))
            bind(vf_pci(pf, i))
        wait(lambda: pf_memory().phase == "restored", "all VFs restored")
    finally:
        agent.stop()
        thread.join(30)
    have = vfinfo(pf_if)
    for i in range(NVFS):
        w = wanted(i)
        assert {k: have[i][k] for k in w if k != "mtu"} == {
            k: v for k, v in w.items() if k != "mtu"
        }
        netdev = sorted(os.listdir(PCI / vf_pci(pf, i) / "net"))[0]
        assert link(netdev) == {"mtu": w["mtu"], "up": True}
    restores = pf_memory().restores
    assert all(r.status == "restored" and r.written for r in restores.values())
    # link state was never set, so never written: igb's refusal of it is the next test
    assert "link_state" not in {f for r in restores.values() for f in r.written}
    numvfs(pf, 0)


def test_a_field_the_driver_lacks_is_unsupported_not_an_error() -> None:
    pf, pf_if = igb_pf()
    numvfs(pf, 1)
    vf = vf_pci(pf, 0)
    bind(vf)
    ops = PyrouteOps(HostRoot("/"))
    try:
        with pytest.raises(OSError) as err:
            ops.set_vf(pf_if, 0, {"link_state": "enable"})
        assert err.value.errno == errno.EOPNOTSUPP  # igb has no ndo_set_vf_link_state
        host = HostRoot("/")
        sriov = (lambda hands: SriovExecutor(hands.host, ops),)
        act = Actuator(host, default_module_ops(), lambda _m: [], executors=(*EXECUTORS, *sriov))
        out = act.perform(
            RestoreVf(
                "sriov",
                pf,
                0,
                vf,
                (("link_state", "enable"), ("trust", True)),
                (),
                "test",
            )
        )
        assert out.ok, out.error
        assert dict(out.detail) == {"link_state": "unsupported", "trust": "written"}
        assert ops.vf_settings(pf_if)[0]["trust"] is True
    finally:
        ops.close()
        numvfs(pf, 0)
