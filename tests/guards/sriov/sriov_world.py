"""A tiny pure SR-IOV world for the guard's tests: one PF, its VFs, netdevs that appear on cue.

``World.observe(now)`` builds the ``NodeSnapshot`` the guard decides over (with
``read_failure`` set, as the host observer reports that read failing: see
``READ_FAILURES``);
``World.perform(action)`` carries a ``RestoreVf``/``SetNumVfs`` out on the
world's own state and counts every field write per VF, the way the host
layer does (only fields that differ are written).
"""

from __future__ import annotations

import errno
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from nodeagent.core.actions import Action, ActionOutcome, RestoreVf, SetNumVfs
from nodeagent.core.snapshot import FileFact, NodeSnapshot
from nodeagent.core.sriov import SriovGuard, SriovPolicy
from nodeagent.core.sriov_model import (
    NETDEV_SIDE,
    PF_SIDE,
    PfSnapshot,
    SriovObservation,
    VfSnapshot,
)

PF_PCI = "0000:01:00.0"
_IDENT = itertools.count(1000)  # every VF device created gets a new identity (sysfs inode)
DEFAULTS: dict[str, Any] = {
    "mac": "00:00:00:00:00:00",
    "vlan": 0,
    "qos": 0,
    "spoofchk": True,
    "trust": False,
    "link_state": "auto",
    "min_tx_rate": 0,
    "max_tx_rate": 0,
    "mtu": 1500,
    "admin_up": False,
}


def _settings_unread(pf: PfSnapshot) -> PfSnapshot:
    """The PF's IFLA_VFINFO_LIST read failed: no PF-side settings, one problem on the PF."""
    vfs = tuple(
        replace(
            v, settings=MappingProxyType({k: x for k, x in v.settings.items() if k in NETDEV_SIDE})
        )
        for v in pf.vfs
    )
    return replace(pf, vfs=vfs, problems=("VF settings of enp1s0f0 unreadable: EBUSY",))


def _links_unread(pf: PfSnapshot) -> PfSnapshot:
    """The link dump failed: no netdev settings, a problem on every VF with a netdev."""
    vfs = tuple(
        replace(
            v,
            settings=MappingProxyType({k: x for k, x in v.settings.items() if k in PF_SIDE}),
            problems=(f"VF {v.index}: settings of its netdev {v.netdev} not read (no link dump)",),
        )
        if v.netdev is not None
        else v
        for v in pf.vfs
    )
    return replace(pf, vfs=vfs)


def _malformed_vlan(pf: PfSnapshot) -> PfSnapshot:
    """One VF's vlan did not parse: left out, a problem on that VF."""
    vfs = tuple(
        replace(
            v,
            settings=MappingProxyType({k: x for k, x in v.settings.items() if k != "vlan"}),
            problems=("VF 1: vlan: 70000 is not an integer in 0..4095",),
        )
        if v.index == 1
        else v
        for v in pf.vfs
    )
    return replace(pf, vfs=vfs)


def _field_missing(pf: PfSnapshot) -> PfSnapshot:
    """No problem reported, but the mtu of every VF is not in the read."""
    vfs = tuple(
        replace(v, settings=MappingProxyType({k: x for k, x in v.settings.items() if k != "mtu"}))
        for v in pf.vfs
    )
    return replace(pf, vfs=vfs)


def _numvfs_malformed(pf: PfSnapshot) -> PfSnapshot:
    return replace(
        pf,
        numvfs=None,
        problems=("sys/bus/pci/devices/0000:01:00.0/sriov_numvfs is 'four', not a count",),
    )


# How a read fails -> what the host observer hands over then (guards/sriov/observe.py's
# SriovObserver).
READ_FAILURES: dict[str, Callable[[PfSnapshot], PfSnapshot]] = {
    "VF settings unreadable": _settings_unread,
    "link dump failed": _links_unread,
    "a malformed value": _malformed_vlan,
    "a field not in the read": _field_missing,
    "sriov_numvfs malformed": _numvfs_malformed,
}


def vf_pci(i: int) -> str:
    n = 3 + i
    return f"0000:01:{n // 8:02x}.{n % 8}"


def wanted(i: int) -> dict[str, Any]:
    return {
        "mac": f"02:00:00:00:{i // 256:02x}:{i % 256:02x}",
        "vlan": 100 + i,
        "qos": i % 8,
        "spoofchk": False,
        "trust": True,
        "link_state": "enable",
        "min_tx_rate": 0,
        "max_tx_rate": 1000 + i,
        "mtu": 9000,
        "admin_up": True,
    }


@dataclass
class WorldVf:
    index: int
    pci: bool = True  # the PCI device exists
    netdev: str | None = None
    settings: dict[str, Any] = field(default_factory=lambda: dict(DEFAULTS))
    ident: int = field(default_factory=lambda: next(_IDENT))
    netdev_ident: int | None = None  # the netdev's ifindex


@dataclass
class World:
    n: int
    driver: str | None = "mlx5_core"
    numvfs: int = 0
    totalvfs: int = 64
    mofed_ready: bool = True
    mofed_blacklist: bool = False  # openibd restart in progress
    vfs: dict[int, WorldVf] = field(default_factory=dict)
    writes: dict[int, int] = field(default_factory=dict)  # VF index -> RestoreVf writes
    fields_written: dict[int, list[str]] = field(default_factory=dict)
    unsupported: set[str] = field(default_factory=set)  # fields the "driver" refuses
    fail_next: dict[int, int] = field(default_factory=dict)  # VF -> failures to inject
    read_failure: str | None = None  # a key of READ_FAILURES: the next reads fail that way

    def configured(self) -> World:
        """Every VF present with its wanted config (the stable node the snapshot is taken of)."""
        self.numvfs = self.n
        self.vfs = {
            i: WorldVf(i, True, f"enp1s0f0v{i}", {**DEFAULTS, **wanted(i)}, netdev_ident=100 + i)
            for i in range(self.n)
        }
        return self

    def unload(self) -> None:
        self.driver = None
        self.numvfs = 0
        self.vfs = {}

    def reload(self, numvfs: int | None = None) -> None:
        """The driver is back and (by default) its VFs' PCI devices, without netdevs yet."""
        self.driver = "mlx5_core"
        self.numvfs = self.n if numvfs is None else numvfs
        self.vfs = {i: WorldVf(i, True, None) for i in range(self.numvfs)}

    def netdev_appears(self, i: int) -> None:
        self.vfs[i].netdev = f"enp1s0f0v{i}"
        self.vfs[i].netdev_ident = next(_IDENT)

    def rebind(self, i: int) -> None:
        """The VF's driver unbound and bound again: same device, a new netdev, its defaults."""
        v = self.vfs[i]
        v.netdev = None
        v.netdev_ident = None
        for k in NETDEV_SIDE:
            if k in DEFAULTS:
                v.settings[k] = DEFAULTS[k]

    def observe(self, now: float) -> NodeSnapshot:
        vfs = []
        for i in sorted(self.vfs):
            v = self.vfs[i]
            settings = {k: v.settings[k] for k in PF_SIDE if k in v.settings}
            if v.netdev is not None:
                settings.update({k: v.settings[k] for k in NETDEV_SIDE if k in v.settings})
            vfs.append(
                VfSnapshot(
                    index=i,
                    pci=vf_pci(i) if v.pci else None,
                    driver="mlx5_core" if v.pci else None,
                    netdev=v.netdev,
                    settings=MappingProxyType(settings),
                    ident=v.ident,
                    netdev_ident=v.netdev_ident,
                )
            )
        pf = PfSnapshot(
            pci=PF_PCI,
            driver=self.driver,
            netdev="enp1s0f0" if self.driver else None,
            numvfs=self.numvfs,
            totalvfs=self.totalvfs,
            vfs=tuple(vfs),
        )
        if self.read_failure is not None:
            pf = READ_FAILURES[self.read_failure](pf)
        ready = "run/mellanox/drivers/.driver-ready"
        blacklist = "etc/modprobe.d/blacklist-ofed-modules.conf"
        return NodeSnapshot(
            now=now,
            kernel="6.1.0-test",
            modules=MappingProxyType({}),
            disk=MappingProxyType({}),
            files=MappingProxyType(
                {
                    ready: FileFact(ready, self.mofed_ready),
                    blacklist: FileFact(blacklist, self.mofed_blacklist),
                }
            ),
            sriov=SriovObservation(pfs=MappingProxyType({PF_PCI: pf})),
        )

    def perform(self, action: Action) -> ActionOutcome:
        if isinstance(action, SetNumVfs):
            self.reload(action.numvfs)
            return ActionOutcome(action=action, ok=True)
        assert isinstance(action, RestoreVf)
        v = self.vfs.get(action.index)
        if v is None or not v.pci:
            return ActionOutcome(action, ok=False, errno=errno.ENODEV, error="no such VF")
        if self.fail_next.get(action.index, 0) > 0:
            self.fail_next[action.index] -= 1
            return ActionOutcome(action, ok=False, errno=errno.EIO, error="EIO (injected)")
        detail = []
        for name, value in (*action.pf_settings, *action.link_settings):
            if name in self.unsupported:
                detail.append((name, "unsupported"))
                continue
            if v.settings.get(name) != value:
                v.settings[name] = value
                detail.append((name, "written"))
                self.fields_written.setdefault(action.index, []).append(name)
        self.writes[action.index] = self.writes.get(action.index, 0) + 1
        return ActionOutcome(action=action, ok=True, detail=tuple(detail))


POLICY = SriovPolicy(numvfs_grace_s=30, vf_deadline_s=60, poll_s=2, retry_base_s=0.5)


class Run:
    """Drive the guard over a World: a pass decides, actions are performed and absorbed."""

    def __init__(self, world: World, policy: SriovPolicy = POLICY) -> None:
        self.world = world
        self.guard = SriovGuard(policy)
        self.memory = self.guard.initial_memory()
        self.events: list[str] = []
        self.actions: list[object] = []
        self.wake_at: float | None = None
        self.snap: NodeSnapshot | None = None

    def step(self, now: float) -> None:
        self.snap = self.world.observe(now)
        d = self.guard.decide(self.snap, self.memory)
        self.memory = d.memory
        self.events += d.events
        self.wake_at = d.wake_at
        for a in d.actions:
            self.actions.append(a)
            self.memory = self.guard.absorb(self.memory, self.world.perform(a), now)

    def phase(self) -> str:
        return self.memory.pfs[PF_PCI].phase

    def verdict(self) -> dict[str, object]:
        assert self.snap is not None
        v = self.guard.verdict(self.snap, self.memory)
        return {"verdict": v.verdict, "ok": v.ok, "reasons": v.reasons, **v.evidence}
