"""An agent restarted in the middle of a VF restore: the next one finishes it from the saved
snapshot, never from the half-restored VFs it finds.

The real agent loop on the simulated kernel (its sysfs under a temp root, its
netlink the simulator's). The first agent restores three of eight VFs, then its
netlink writes hang and its loop is frozen inside a pass: from the node's side
that is a killed process (it writes nothing more; the single-agent lock lives
in the CLI, not here). A second agent starts on the same root.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from nodeagent.agent import Agent, PassResult
from nodeagent.config import Config
from nodeagent.core.sriov import SriovMemory, SriovPolicy
from nodeagent.sim.kernel import PF_FIELDS, SimKernel, VfConfig
from nodeagent.sim.modtree import RDMA_MODULES, Generation, depmod, install_generation
from nodeagent.sim.netlink import SimSriovOps
from tests.waiting import WAIT, until

KVER = "6.1.0-restart"
PF, PF_PCI = "enp1s0f0", "0000:01:00.0"
N = 8
RESTORED_BEFORE_THE_KILL = {0, 1, 2}


def wanted(i: int) -> VfConfig:
    return VfConfig(
        mac=f"02:00:00:00:00:{i:02x}",
        vlan=100 + i,
        trust=True,
        spoofchk=False,
        max_tx_rate=1000 + i,
        mtu=9000,
        admin_up=True,
    )


def build(root: Path) -> tuple[SimKernel, list[VfConfig]]:
    k = SimKernel(root, KVER, init_delay=0.0, exit_delay=0.0)
    moddir = root / "lib/modules" / KVER
    install_generation(moddir, KVER, Generation("b", "MOFED test", "25.10"), RDMA_MODULES)
    depmod(moddir)
    k.add_pf(PF, PF_PCI, totalvfs=16, probe_delay=0.0)
    k.probe("mlx5_core", str(moddir))
    k.sched.run(k.sched.now() + 1)
    (root / "run/mellanox/drivers").mkdir(parents=True, exist_ok=True)
    (root / "run/mellanox/drivers/.driver-ready").write_text("")
    k.pfs[PF].autoprobe = False
    k.write_sriov_numvfs(PF, N)
    want = [wanted(i) for i in range(N)]
    for i, cfg in enumerate(want):
        k.bind_vf(PF, i)
        k.set_vf(PF, i, **{f: getattr(cfg, f) for f in PF_FIELDS})
        netdev = k.vf_netdev(PF, i)
        assert netdev is not None
        k.set_link(netdev, mtu=cfg.mtu, admin_up=cfg.admin_up)
    return k, want


class DiesMidRestore(SimSriovOps):
    """Netlink that writes the first VFs, then hangs (the process is about to die)."""

    def __init__(self, kernel: SimKernel) -> None:
        super().__init__(kernel)
        self.armed = False
        self.hung = threading.Event()
        self.release = threading.Event()

    def set_vf(self, pf_ifname: str, index: int, values: Any) -> None:
        if self.armed and index not in RESTORED_BEFORE_THE_KILL:
            self.hung.set()
            self.release.wait(WAIT)
            raise OSError("the process is gone")  # nothing written after the "kill"
        super().set_vf(pf_ifname, index, values)


def start(k: SimKernel, ops: SimSriovOps) -> tuple[Agent, threading.Thread]:
    cfg = Config(
        host_root=str(k.root),
        mode="enforce",
        uevents=False,
        policies={"sriov": SriovPolicy(numvfs_owner="mofed", poll_s=0.5)},
    )
    agent = Agent(
        cfg,
        module_ops=k,
        kernel_log=k.kernel_messages,
        wake_sources=[k.uevent_source],
        guard_ports={"sriov": ops},
    )
    thread = threading.Thread(target=agent.run, name="nodeagent", daemon=True)
    thread.start()
    return agent, thread


def restored(k: SimKernel, want: list[VfConfig]) -> set[int]:
    return {vf.index for vf in k.pfs[PF].vfs if vf.config == want[vf.index]}


def saved_settings(agent: Agent) -> dict[int, dict[str, Any]] | None:
    mem = agent.memory.get("sriov")
    if not isinstance(mem, SriovMemory) or PF_PCI not in mem.pfs:
        return None
    return {v.index: dict(v.settings) for v in mem.pfs[PF_PCI].saved.vfs}


def test_a_restart_in_the_middle_of_a_vf_restore_finishes_it_from_the_saved_snapshot(
    tmp_path: Path,
) -> None:
    k, want = build(tmp_path)
    first_ops = DiesMidRestore(k)
    first, first_thread = start(k, first_ops)
    frozen, thaw = threading.Event(), threading.Event()
    second: Agent | None = None
    try:
        k.uevent_source.push("test: configured")
        until(
            lambda: (
                (s := saved_settings(first)) is not None
                and len(s) == N
                and all(v.get("mtu") == 9000 for v in s.values())
            ),
            "the first agent took no snapshot of the configured VFs",
        )
        snapshot_before = saved_settings(first)

        first_ops.armed = True
        k.write_sriov_numvfs(PF, 0)  # MOFED's reload: the VFs go, then come back bare
        k.write_sriov_numvfs(PF, N)
        for i in range(N):
            k.bind_vf(PF, i)
        k.uevent_source.push("test: VFs back")
        until(
            lambda: first_ops.hung.is_set() and restored(k, want) >= RESTORED_BEFORE_THE_KILL,
            "the first agent's restore did not get under way",
        )
        assert restored(k, want) == RESTORED_BEFORE_THE_KILL

        # The "kill": the first agent's loop stops inside its next pass, for good.
        observe = first.observer.observe

        def stuck(*a: Any, **kw: Any) -> Any:
            frozen.set()
            thaw.wait(2 * WAIT)
            return observe(*a, **kw)

        first.observer.observe = stuck  # type: ignore[method-assign]
        first.poke.poke("test: freeze")
        assert frozen.wait(WAIT)

        second, second_thread = start(k, SimSriovOps(k))
        k.uevent_source.push("test: second agent")
        until(
            lambda: restored(k, want) == set(range(N)),
            "after the restart, not every VF was restored",
        )
        # What it restored from is what was saved before the restore began, and it
        # still holds that: the half-restored VFs never became the snapshot.
        assert saved_settings(second) == snapshot_before
        mem = second.memory["sriov"]
        assert isinstance(mem, SriovMemory)
        until(
            lambda: second.memory["sriov"].pfs[PF_PCI].phase == "restored",  # type: ignore[attr-defined]
            "the second agent's restore never reached its phase 'restored'",
        )
        second.stop()
        second_thread.join(WAIT)
        assert not second_thread.is_alive()
    finally:
        if second is not None:
            second.stop()
        first_ops.release.set()
        thaw.set()
        first.stop()
        first_thread.join(WAIT)


def once(k: SimKernel) -> tuple[Agent, PassResult]:
    """A fresh agent (a start) on the node, one pass with its plans carried out."""
    cfg = Config(
        host_root=str(k.root),
        mode="enforce",
        uevents=False,
        policies={"sriov": SriovPolicy(numvfs_owner="mofed")},
    )
    agent = Agent(
        cfg, module_ops=k, kernel_log=k.kernel_messages, guard_ports={"sriov": SimSriovOps(k)}
    )
    result = agent.run_once()
    agent.close()
    return agent, result


def test_a_virtfn_link_that_is_not_a_pci_device_is_never_persisted(tmp_path: Path) -> None:
    """``virtfn0 -> ../..``: the VF is read with a problem, not saved as '..'. Before, the
    agent wrote it to sriov.json, refused its own file on restart and set it aside,
    losing every saved VF config."""
    k, _want = build(tmp_path)
    first, _ = once(k)
    before = saved_settings(first)
    assert before is not None and len(before) == N
    link = k.root / k.PCI_PARENT / PF_PCI / "virtfn0"
    link.unlink()
    link.symlink_to("../..")
    _, bad = once(k)
    (vf0,) = [v for v in bad.snapshot.sriov.pfs[PF_PCI].vfs if v.index == 0]
    assert vf0.pci is None and "links to '..', not a PCI device" in vf0.problems[0]
    again, result = once(k)  # the restart
    assert result.snapshot.sriov.persisted.problem is None
    assert saved_settings(again) == before
    saved = json.loads((k.root / "var/lib/nodeagent/sriov.json").read_text())
    assert saved["pfs"][0]["vfs"][0]["pci"] == k.pfs[PF].vfs[0].pci
    assert not list((k.root / "var/lib/nodeagent").glob("sriov.json.*"))  # nothing set aside
