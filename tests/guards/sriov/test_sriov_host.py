"""The VF guard's host side on the simulated kernel: observe, restore, numvfs, the snapshot file."""

from __future__ import annotations

import errno
import json
import os
import threading
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

import pytest

from nodeagent.core.actions import RestoreVf, SetNumVfs
from nodeagent.core.paths import HostPaths
from nodeagent.core.snapshot import FileFact, NodeSnapshot
from nodeagent.core.sriov import SriovGuard
from nodeagent.core.sriov_model import SNAPSHOT_VERSION, SriovObservation
from nodeagent.guards.sriov.act import SriovExecutor
from nodeagent.guards.sriov.netlink import PyrouteOps, parse_vfinfo, write_sysfs
from nodeagent.guards.sriov.observe import SriovObserver, SriovStore
from nodeagent.host.act import EXECUTORS, Actuator
from nodeagent.host.fs import HostRoot
from nodeagent.sim.kernel import PF_FIELDS, SimKernel
from nodeagent.sim.modtree import RDMA_MODULES, Generation, depmod, install_generation
from nodeagent.sim.netlink import SimSriovOps
from tests.waiting import WAIT

KVER = "6.1.0-sim"
PF, PF_PCI = "enp1s0f0", "0000:01:00.0"


@pytest.fixture
def kernel(tmp_path: Path) -> SimKernel:
    k = SimKernel(tmp_path, KVER)
    d = tmp_path / "lib/modules" / KVER
    install_generation(d, KVER, Generation("g", "MOFED", "25.07"), RDMA_MODULES)
    depmod(d)
    k.add_pf(PF, PF_PCI, totalvfs=8, vf_delay=lambda i: 0.1)
    k.probe("mlx5_core", str(d))
    k.sched.run(k.sched.now() + 2)
    k.write_sriov_numvfs(PF, 4)
    k.sched.run(k.sched.now() + 5)
    return k


def observer(k: SimKernel, ops: SimSriovOps | None = None) -> SriovObserver:
    host = HostRoot(k.root)
    return SriovObserver(host, ops or SimSriovOps(k), SriovStore(host))


def test_observer_reads_every_vf_through_the_pf_wherever_its_netdev_is(kernel: SimKernel) -> None:
    kernel.set_vf(PF, 1, vlan=7, trust=True)
    kernel.set_link(f"{PF}v1", mtu=9000, admin_up=True)
    kernel.move_vf_to_netns(PF, 2, "cni-1234", "net1")
    kernel.bind_vf(PF, 3, "vfio-pci")
    cache = kernel.root / "var/lib/cni/sriov"
    cache.mkdir(parents=True)
    pod_vf = kernel.pfs[PF].vfs[2].pci
    (cache / "abcdef0123456789-net1").write_text(
        json.dumps({"name": "rdma-net", "deviceID": pod_vf, "ContIFNames": "net1"})
    )
    (cache / "broken-net2").write_text("{not json")
    (cache / "deep-net3").write_text("[" * 30_000 + "]" * 30_000)  # deeper than json goes
    obs = observer(kernel).observe()
    pf = obs.pfs[PF_PCI]
    assert (pf.driver, pf.netdev, pf.numvfs, pf.totalvfs) == ("mlx5_core", PF, 4, 8)
    v1, v2, v3 = pf.vf(1), pf.vf(2), pf.vf(3)
    assert v1 is not None and v2 is not None and v3 is not None
    assert (v1.pci, v1.driver, v1.netdev) == ("0000:01:00.4", "mlx5_core", f"{PF}v1")
    assert v1.settings["vlan"] == 7 and v1.settings["trust"] is True
    assert v1.settings["mtu"] == 9000 and v1.settings["admin_up"] is True
    assert (v2.netdev, v2.driver) == (None, "mlx5_core")  # in the pod's netns
    assert set(v2.settings) == set(PF_FIELDS)  # read through the PF all the same
    assert (v3.netdev, v3.driver) == (None, "vfio-pci")
    assert [(a.vf_pci, a.network, a.pod_ifname) for a in obs.attachments] == [
        (pod_vf, "rdma-net", "net1")
    ]
    assert any("broken-net2" in p for p in obs.problems)
    assert any("deep-net3" in p for p in obs.problems)


class ReloadWhileRead(SimSriovOps):
    """MOFED's reload lands while the agent observes: right after its settings read (or its
    link dump), the VFs are destroyed and created again, bare, and bound."""

    def __init__(self, k: SimKernel, at: str) -> None:
        super().__init__(k)
        self.k, self.at, self.armed = k, at, False

    def _reload(self) -> None:
        if self.armed:
            self.armed = False
            self.k.write_sriov_numvfs(PF, 0)
            self.k.write_sriov_numvfs(PF, 4)
            self.k.sched.run(self.k.sched.now() + 5)  # the new VFs probed, netdevs back

    def vf_settings(self, pf_ifname: str) -> dict[int, dict[str, Any]]:
        got = super().vf_settings(pf_ifname)
        if self.at == "vf_settings":
            self._reload()
        return got

    def links(self) -> dict[str, dict[str, Any]]:
        got = super().links()
        if self.at == "links":
            self._reload()
        return got


@pytest.mark.parametrize("at", ["vf_settings", "links"])
def test_vfs_created_again_while_observed_are_not_read_with_the_old_settings(
    kernel: SimKernel, at: str
) -> None:
    """Issue 35's torn read (found under load by test_sriov_restart): the settings were
    read from the VFs before a reload and the sysfs walk saw the new, bare ones; the guard
    took them for restored with nothing written. Each such VF is now a problem (nothing
    is written or judged on it) and the next observation reads it whole."""
    for i in range(4):
        kernel.set_vf(PF, i, vlan=10 + i)
        kernel.set_link(f"{PF}v{i}", mtu=9000)
    ops = ReloadWhileRead(kernel, at)
    obs = observer(kernel, ops)
    first = obs.observe().pfs[PF_PCI]
    assert [v.settings["vlan"] for v in first.vfs] == [10, 11, 12, 13]
    assert not any(v.problems for v in first.vfs)
    ops.armed = True
    torn = obs.observe().pfs[PF_PCI]
    assert [v.index for v in torn.vfs] == [0, 1, 2, 3]
    for v, old in zip(torn.vfs, first.vfs, strict=True):
        assert v.ident != old.ident  # a new device
        assert any("its device changed while it was read" in p for p in v.problems), v
    again = obs.observe().pfs[PF_PCI]  # whole: the bare VFs as they are
    assert not any(v.problems for v in again.vfs)
    assert [v.settings["vlan"] for v in again.vfs] == [0, 0, 0, 0]


@pytest.mark.parametrize(
    ("plant", "problem"),
    [
        (lambda f: f.write_text("four\n"), "is 'four', not a VF count (0..65535)"),
        (lambda f: f.write_text("9" * 26 + "\n"), "not a VF count (0..65535)"),
        (lambda f: (f.unlink(), os.mkfifo(f)), "unreadable: is a FIFO"),  # never blocks
        (lambda f: (f.unlink(), f.mkdir()), "unreadable"),
    ],
    ids=["word", "huge", "fifo", "directory"],
)
def test_malformed_sysfs_values_are_problems_not_crashes(
    kernel: SimKernel, plant: Any, problem: str
) -> None:
    dev = kernel.root / kernel.PCI_PARENT / PF_PCI
    plant(dev / "sriov_numvfs")
    pf = observer(kernel).observe().pfs[PF_PCI]
    assert pf.numvfs is None
    assert len(pf.problems) == 1
    assert pf.problems[0].startswith(f"sys/bus/pci/devices/{PF_PCI}/sriov_numvfs ")
    assert problem in pf.problems[0]


BAD_COUNTS = ["four", "-1", "+4", "\u0664", "4\0", "1" + "0" * 30]


def _plant(f: Path, how: str) -> None:
    if how == "missing":
        f.unlink()
    elif how == "fifo":
        f.unlink()
        os.mkfifo(f)
    elif how == "directory":
        f.unlink()
        f.mkdir()
    elif how == "link-out":
        f.unlink()
        f.symlink_to("/etc/hostname")  # resolved inside the root: not there
    else:
        f.write_text(how + "\n")


def _first_vf_ifindex(k: SimKernel) -> Path:
    vf = k.pfs[PF].vfs[0]
    (netdev,) = os.listdir(k.root / k.PCI_PARENT / vf.pci / "net")
    return k.root / k.PCI_PARENT / vf.pci / "net" / netdev / "ifindex"


@pytest.mark.parametrize(
    ("where", "how"),
    [
        (w, h)
        for w in ("sriov_numvfs", "sriov_totalvfs")
        for h in [*BAD_COUNTS, "65536", "missing", "fifo", "directory", "link-out"]
    ]
    + [("ifindex", h) for h in [*BAD_COUNTS, "missing", "fifo", "directory", "link-out"]],
)
def test_a_pf_never_snapshotted_that_reads_badly_is_named_and_not_ok(
    kernel: SimKernel, where: str, how: str
) -> None:
    """Before its first snapshot, a PF whose count or a VF's ifindex is missing, malformed
    or unreadable is not guarded: the verdict says so (``unknown``, not ok) and names the
    file, instead of a silent ``stable`` with nothing saved."""
    dev = kernel.root / kernel.PCI_PARENT / PF_PCI
    f = _first_vf_ifindex(kernel) if where == "ifindex" else dev / where
    _plant(f, how)
    obs = observer(kernel).observe()
    d = SriovGuard().decide(mofed_ready_snapshot(10.0, obs), SriovGuard().initial_memory())
    assert (d.verdict.verdict, d.verdict.ok) == ("unknown", False)
    assert PF_PCI not in d.memory.pfs  # nothing saved from a bad read
    (reason,) = d.verdict.reasons
    assert reason.startswith(f"PF {PF_PCI} not guarded: read failed: ")
    assert f"/{where} " in reason
    assert d.verdict.evidence["unguarded"][PF_PCI]


def test_a_large_ifindex_is_an_ifindex(kernel: SimKernel) -> None:
    """65536 is past a VF count, not past an ifindex (a busy node's veths get there)."""
    _plant(_first_vf_ifindex(kernel), "65536")
    obs = observer(kernel).observe()
    assert not obs.pfs[PF_PCI].problems and not obs.pfs[PF_PCI].vfs[0].problems
    assert obs.pfs[PF_PCI].vfs[0].netdev_ident == 65536


@pytest.mark.parametrize("how", ["fifo", "file", "loop"])
def test_an_unreadable_pci_device_list_blinds_the_guard_and_judges_no_pf_gone(
    kernel: SimKernel, how: str
) -> None:
    guard = SriovGuard()
    first = guard.decide(
        mofed_ready_snapshot(10.0, observer(kernel).observe()), guard.initial_memory()
    )
    assert first.memory.pfs[PF_PCI].phase == "stable"
    devices = kernel.root / "sys/bus/pci/devices"
    devices.rename(devices.with_name("devices-away"))
    if how == "fifo":
        os.mkfifo(devices)
    elif how == "file":
        devices.write_text("")
    else:
        devices.symlink_to("devices")
    obs = observer(kernel).observe()
    assert obs.blind and not obs.pfs
    d = guard.decide(mofed_ready_snapshot(20.0, obs), first.memory)
    assert (d.verdict.verdict, d.verdict.ok) == ("unknown", False)
    assert "sys/bus/pci/devices" in d.verdict.reasons[0]
    assert d.memory == first.memory and not d.actions  # no PF judged gone from it


def test_a_fifo_for_the_cni_cache_is_a_problem_not_an_empty_cache(kernel: SimKernel) -> None:
    cache = kernel.root / "var/lib/cni/sriov"
    cache.parent.mkdir(parents=True)
    os.mkfifo(cache)
    obs = observer(kernel).observe()
    assert obs.attachments == ()
    assert any(p.startswith("var/lib/cni/sriov unreadable") for p in obs.problems), obs.problems


def test_a_pf_linked_out_of_the_root_is_read_and_written_inside_it(
    kernel: SimKernel, tmp_path: Path
) -> None:
    """An absolute link under sys/bus/pci/devices resolves inside the host root, as if
    chrooted: the container's own files are neither read nor written."""
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "sriov_numvfs").write_text("3\n")
    (outside / "sriov_totalvfs").write_text("8\n")
    link = kernel.root / "sys/bus/pci/devices/0000:09:00.0"
    link.symlink_to(outside)
    obs = observer(kernel).observe()
    assert "0000:09:00.0" not in obs.pfs
    with pytest.raises(OSError):
        write_sysfs(HostRoot(kernel.root), "sys/bus/pci/devices/0000:09:00.0/sriov_numvfs", "0\n")
    assert (outside / "sriov_numvfs").read_text() == "3\n"


def mofed_ready_snapshot(now: float, sriov: SriovObservation) -> NodeSnapshot:
    ready = HostPaths().mofed.ready
    return NodeSnapshot(
        now=now,
        kernel=KVER,
        modules=MappingProxyType({}),
        disk=MappingProxyType({}),
        files=MappingProxyType({ready: FileFact(ready, True)}),
        sriov=sriov,
    )


class FailingOps(SimSriovOps):
    """The simulated netlink with the observer's reads failing as the flags say."""

    def __init__(self, kernel: SimKernel) -> None:
        super().__init__(kernel)
        self.vf_read_fails = False
        self.dump_fails = False

    def vf_settings(self, pf_ifname: str) -> dict[int, dict[str, Any]]:
        if self.vf_read_fails:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
        return super().vf_settings(pf_ifname)

    def links(self) -> dict[str, dict[str, Any]]:
        if self.dump_fails:
            raise OSError(errno.ENOBUFS, os.strerror(errno.ENOBUFS))
        return super().links()


@pytest.mark.parametrize(
    ("vf_read_fails", "dump_fails"), [(True, False), (False, True), (True, True)]
)
def test_failed_netlink_reads_leave_the_snapshot_file_as_it_was(
    kernel: SimKernel, vf_read_fails: bool, dump_fails: bool
) -> None:
    """Observer, guard and store together: a stable PF whose VF reads fail keeps its
    snapshot and sriov.json byte for byte, writes nothing, and says why."""
    kernel.set_vf(PF, 1, vlan=7, trust=True)
    kernel.set_link(f"{PF}v1", mtu=9000, admin_up=True)
    host = HostRoot(kernel.root)
    ops = FailingOps(kernel)
    store = SriovStore(host)
    obs = SriovObserver(host, ops, store)
    guard = SriovGuard()
    memory = guard.initial_memory()

    def one_pass(now: float) -> tuple[object, list[str]]:
        nonlocal memory
        snap = mofed_ready_snapshot(now, obs.observe())
        d = guard.decide(snap, memory)
        memory = d.memory
        store.save({pci: m.saved for pci, m in memory.pfs.items()})
        assert not d.actions
        return guard.verdict(snap, memory), list(d.events)

    one_pass(1.0)
    path = kernel.root / "var/lib/nodeagent/sriov.json"
    before, saved = path.read_bytes(), memory.pfs[PF_PCI].saved
    assert saved.vf(1).settings["vlan"] == 7  # type: ignore[union-attr]
    ops.vf_read_fails, ops.dump_fails = vf_read_fails, dump_fails
    _, events = one_pass(2.0)
    verdict, _ = one_pass(3.0)
    assert path.read_bytes() == before
    assert memory.pfs[PF_PCI].saved == saved and memory.pfs[PF_PCI].phase == "stable"
    assert [e for e in events if "snapshot kept" in e] != []
    kept = verdict.evidence["pfs"][PF_PCI]["snapshot_kept"]  # type: ignore[attr-defined]
    if vf_read_fails:
        assert f"VF settings of {PF} unreadable: {os.strerror(errno.EBUSY)}" in kept
    if dump_fails:
        assert f"VF 1: settings of its netdev {PF}v1 not read (no link dump)" in kept
    ops.vf_read_fails = ops.dump_fails = False
    kernel.set_vf(PF, 1, vlan=8)  # the owner's change, read cleanly: the snapshot follows
    _, events = one_pass(4.0)
    assert memory.pfs[PF_PCI].saved.vf(1).settings["vlan"] == 8  # type: ignore[union-attr]
    assert any("readable again" in e for e in events)
    assert json.loads(path.read_text())["pfs"][0]["vfs"][1]["settings"]["vlan"] == 8


def actuator(k: SimKernel, ops: SimSriovOps) -> Actuator:
    """The agent's own actuator: the executor table sends VF actions to the SR-IOV executor."""
    sriov = (lambda hands: SriovExecutor(hands.host, ops),)  # the VF guard's host side's
    return Actuator(HostRoot(k.root), k, k.kernel_messages, executors=(*EXECUTORS, *sriov))


def restore_action(k: SimKernel, index: int, **want: Any) -> RestoreVf:
    vf = k.pfs[PF].vfs[index]
    pf_side = {f: v for f, v in want.items() if f in PF_FIELDS}
    link = {f: v for f, v in want.items() if f not in PF_FIELDS}
    return RestoreVf(
        "sriov", PF_PCI, index, vf.pci, tuple(sorted(pf_side.items())), tuple(link.items()), "test"
    )


def test_restore_writes_only_what_differs_and_reads_it_back(kernel: SimKernel) -> None:
    ops = SimSriovOps(kernel)
    act = actuator(kernel, ops)
    kernel.set_vf(PF, 0, vlan=5)  # already right
    action = restore_action(
        kernel, 0, mac="02:00:00:00:00:09", vlan=5, qos=2, trust=True, mtu=9000, admin_up=True
    )
    out = act.perform(action)
    assert out.ok, out.error
    assert dict(out.detail) == {
        "mac": "written",
        "qos": "written",
        "vlan": "written",  # vlan and qos are one netlink attribute: written together
        "trust": "written",
        "mtu": "written",
        "admin_up": "written",
    }
    cfg = kernel.vf_configs(PF)[0]
    assert (cfg.mac, cfg.vlan, cfg.qos, cfg.trust, cfg.mtu, cfg.admin_up) == (
        "02:00:00:00:00:09",
        5,
        2,
        True,
        9000,
        True,
    )
    ops.calls.clear()
    again = act.perform(action)
    assert again.ok and again.detail == () and ops.calls == []  # matches: nothing rewritten


def test_eopnotsupp_names_the_field_and_the_rest_is_restored(kernel: SimKernel) -> None:
    ops = SimSriovOps(kernel, unsupported=frozenset({"link_state"}))
    out = actuator(kernel, ops).perform(
        restore_action(kernel, 1, link_state="enable", spoofchk=False)
    )
    assert out.ok
    assert dict(out.detail) == {"link_state": "unsupported", "spoofchk": "written"}


def test_a_vf_whose_netdev_is_missing_fails_on_its_own(kernel: SimKernel) -> None:
    kernel.bind_vf(PF, 2, "vfio-pci")
    out = actuator(kernel, SimSriovOps(kernel)).perform(restore_action(kernel, 2, vlan=9, mtu=9000))
    assert not out.ok
    assert out.error == "VF 2 has no netdev for mtu"
    assert dict(out.detail)["vlan"] == "written"


def test_numvfs_goes_through_zero(kernel: SimKernel) -> None:
    act = actuator(kernel, SimSriovOps(kernel))
    out = act.perform(SetNumVfs("sriov", PF_PCI, 6, True, "test"))
    assert out.ok and len(kernel.pfs[PF].vfs) == 6
    refused = act.perform(SetNumVfs("sriov", PF_PCI, 7, False, "test"))  # 6 -> 7 directly
    assert not refused.ok and refused.errno == errno.EBUSY


# -- the snapshot file -----------------------------------------------------------------------


def saved_pfs(k: SimKernel) -> dict[str, Any]:
    from nodeagent.core.sriov_model import saved_from_observed

    obs = observer(k).observe()
    return {PF_PCI: saved_from_observed(obs.pfs[PF_PCI], obs.attachments, 1.0)}


def test_the_store_writes_only_what_its_reader_accepts(kernel: SimKernel) -> None:
    """A snapshot the next start would refuse is not written: the error names the value,
    and the file keeps the last good snapshot."""
    from dataclasses import replace

    from nodeagent.errors import NodeagentError

    store = SriovStore(HostRoot(kernel.root))
    good = saved_pfs(kernel)
    assert store.save(good)
    written = (kernel.root / "var/lib/nodeagent/sriov.json").read_bytes()
    pf = good[PF_PCI]
    bad = {PF_PCI: replace(pf, vfs=(replace(pf.vfs[0], pci=".."), *pf.vfs[1:]))}
    with pytest.raises(NodeagentError, match=r"would be refused on restart .*'\.\.' is not a PCI"):
        store.save(bad)
    assert (kernel.root / "var/lib/nodeagent/sriov.json").read_bytes() == written
    assert SriovStore(HostRoot(kernel.root)).load().pfs == good


def test_store_writes_only_on_change_and_never_an_empty_snapshot(kernel: SimKernel) -> None:
    store = SriovStore(HostRoot(kernel.root))
    path = kernel.root / "var/lib/nodeagent/sriov.json"
    pfs = saved_pfs(kernel)
    assert store.save(pfs) is True
    doc = json.loads(path.read_text())
    assert doc["schema"] == "nodeagent-sriov" and doc["version"] == SNAPSHOT_VERSION
    mtime = path.stat().st_mtime_ns
    assert store.save(pfs) is False and store.save(dict(pfs)) is False
    assert store.save({}) is False  # never replaces a snapshot with nothing
    assert path.stat().st_mtime_ns == mtime
    assert store.load().pfs[PF_PCI] == pfs[PF_PCI]


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"{truncated", "is corrupt: "),
        (b'{"schema": "nodeagent-sriov", "version": 7, "pfs": []}', "schema version 7 is not 1"),
        (b"[" * 100_000 + b"]" * 100_000, "is corrupt: "),  # deeper than the parser goes
        (b'{"schema": "nodeagent-sriov", "version": 1, "pfs": [], "x": NaN}', "not a finite"),
        (
            json.dumps(
                {
                    "schema": "nodeagent-sriov",
                    "version": 1,
                    "pfs": [{"pci": PF_PCI, "numvfs": 1, "vfs": [], "attachments": 5}],
                }
            ).encode(),
            "attachments is not a list",
        ),
    ],
    ids=["truncated", "version", "deep", "nan", "attachments"],
)
def test_bad_snapshot_file_is_moved_aside_and_reported(
    kernel: SimKernel, content: bytes, why: str
) -> None:
    store = SriovStore(HostRoot(kernel.root))
    path = kernel.root / "var/lib/nodeagent/sriov.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    loaded = store.load()
    assert loaded.pfs == {} and loaded.problem is not None and why in loaded.problem
    assert "moved to sriov.json.corrupt" in loaded.problem
    assert (path.parent / "sriov.json.corrupt").read_bytes() == content  # kept, not lost
    assert store.reports == [loaded.problem]
    assert store.save(saved_pfs(kernel)) is True  # the node's snapshot goes in its place


def test_snapshot_file_that_is_a_symlink_is_not_followed(kernel: SimKernel) -> None:
    path = kernel.root / "var/lib/nodeagent/sriov.json"
    path.parent.mkdir(parents=True)
    target = kernel.root / "elsewhere.json"
    target.write_text("{}")
    os.symlink(target, path)
    store = SriovStore(HostRoot(kernel.root))
    loaded = store.load()
    assert loaded.problem is not None and "symlink" in loaded.problem
    assert target.read_text() == "{}"


# -- pyroute2's decoded IFLA_VFINFO_LIST -----------------------------------------------------


class _Nla:
    def __init__(self, attrs: dict[str, Any]) -> None:
        self.attrs = attrs

    def get_attr(self, name: str) -> Any:
        return self.attrs.get(name)

    def get_attrs(self, name: str) -> list[Any]:
        return self.attrs.get(name, [])


def test_parse_vfinfo_maps_netlink_attributes_to_field_names() -> None:
    info = _Nla(
        {
            "IFLA_VF_MAC": {"vf": 3, "mac": "02:AA:00:00:00:01"},
            "IFLA_VF_VLAN": {"vf": 3, "vlan": 100, "qos": 2},
            "IFLA_VF_RATE": {"vf": 3, "min_tx_rate": 0, "max_tx_rate": 500},
            "IFLA_VF_SPOOFCHK": {"vf": 3, "spoofchk": 0},
            "IFLA_VF_TRUST": {"vf": 3, "trust": 0xFFFFFFFF},  # the driver has no trust
            "IFLA_VF_LINK_STATE": {"vf": 3, "link_state": 2},
            "IFLA_VF_IB_NODE_GUID": {"vf": 3, "ib_node_guid": "00:00:00:00:00:00:00:00"},
        }
    )
    assert parse_vfinfo(_Nla({"IFLA_VF_INFO": [info]})) == {
        3: {
            "mac": "02:aa:00:00:00:01",
            "vlan": 100,
            "qos": 2,
            "min_tx_rate": 0,
            "max_tx_rate": 500,
            "spoofchk": False,
            "link_state": "disable",
        }
    }
    assert parse_vfinfo(None) == {}


class _FakeIPRoute:
    """Just enough of pyroute2's IPRoute for ``set_vf``: VF 0's write hangs until released."""

    opened: ClassVar[list[_FakeIPRoute]] = []

    def __init__(self, release: threading.Event, entered: threading.Event) -> None:
        self.release, self.entered = release, entered
        self.calls: list[int] = []
        self.closed = False
        _FakeIPRoute.opened.append(self)

    def link_lookup(self, ifname: str) -> list[int]:
        return [7]

    def link(self, command: str, index: int, vf: dict[str, Any]) -> None:
        self.calls.append(vf["vf"])
        if vf["vf"] == 0:
            self.entered.set()
            assert self.release.wait(WAIT)

    def close(self) -> None:
        self.closed = True


def test_a_hung_netlink_write_holds_only_its_own_socket(tmp_path: Path) -> None:
    """The real ``PyrouteOps`` with its socket factory replaced: VF 0's write hangs, the
    other VFs' writes go through other sockets meanwhile (one socket under one lock
    queued every VF behind the hung one); idle sockets are reused, and closed at close."""
    release, entered = threading.Event(), threading.Event()
    _FakeIPRoute.opened.clear()
    ops = PyrouteOps(HostRoot(str(tmp_path)), connect=lambda: _FakeIPRoute(release, entered))
    hung = threading.Thread(target=ops.set_vf, args=("pf", 0, {"trust": True}), daemon=True)
    hung.start()
    try:
        assert entered.wait(WAIT)
        for i in range(1, 6):  # each returns while VF 0's call still hangs
            ops.set_vf("pf", i, {"trust": True})
        assert hung.is_alive()
        assert ops.sockets == (1, 1)  # one idle (reused by VFs 1-5), one in the hung call
        assert len(_FakeIPRoute.opened) == 2
        assert _FakeIPRoute.opened[1].calls == [1, 2, 3, 4, 5]
        ops.close()
        assert _FakeIPRoute.opened[1].closed and not _FakeIPRoute.opened[0].closed
    finally:
        release.set()
        hung.join(WAIT)
    assert _FakeIPRoute.opened[0].closed  # closed when its call returned, not kept
    with pytest.raises(OSError, match="closed"):
        ops.set_vf("pf", 1, {"trust": True})


@pytest.mark.parametrize("err", [errno.EIO, errno.EACCES])
@pytest.mark.parametrize("which", ["the PF's directory", "a VF's net directory"])
def test_unreadable_is_never_absent(
    kernel: SimKernel, monkeypatch: pytest.MonkeyPatch, err: int, which: str
) -> None:
    """A listing that fails with anything but ENOENT is a problem on that pass, named,
    never "no VFs" or "no netdev" (which reads as VFs gone, and restores them again).
    Before: the PF read with no VFs and no problem."""
    guard = SriovGuard()
    first = guard.decide(
        mofed_ready_snapshot(10.0, observer(kernel).observe()), guard.initial_memory()
    )
    assert first.memory.pfs[PF_PCI].phase == "stable"
    vf0 = kernel.pfs[PF].vfs[0].pci
    bad = (
        f"sys/bus/pci/devices/{PF_PCI}"
        if which.startswith("the PF")
        else (f"sys/bus/pci/devices/{vf0}/net")
    )
    listdir = HostRoot.listdir

    def failing(self: HostRoot, rel: str, *a: Any, **kw: Any) -> list[str]:
        if rel == bad:
            raise OSError(err, os.strerror(err))
        return listdir(self, rel, *a, **kw)

    monkeypatch.setattr(HostRoot, "listdir", failing)
    obs = observer(kernel).observe()
    pf = obs.pfs[PF_PCI]
    said = [*pf.problems, *(p for v in pf.vfs for p in v.problems)]
    assert f"{bad} unreadable: {os.strerror(err)}" in said
    d = guard.decide(mofed_ready_snapshot(20.0, obs), first.memory)
    assert not d.actions  # nothing judged gone, nothing restored
    kept = d.memory.pfs[PF_PCI]
    assert kept.unread and replace(kept, unread=()) == first.memory.pfs[PF_PCI]
