"""SR-IOV facts as values: what one VF's config is, what a PF looks like now, what was saved.

One table, ``VF_FIELDS``, says for every VF setting where it is set (through
the PF with ``IFLA_VFINFO_LIST``, or on the VF's own netdev), how a value is
checked, and whether MOFED's own restore keeps it. Everything else (the
observation, the saved snapshot, its JSON schema) is built from that table.

Pure: no I/O. ``guards/sriov/observe.py`` reads the node into these values and
writes the saved snapshot to ``var/lib/nodeagent/sriov.json``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

Via = Literal["pf", "netdev"]
LINK_STATES = ("auto", "enable", "disable")
SNAPSHOT_SCHEMA = "nodeagent-sriov"
SNAPSHOT_VERSION = 1
MAX_VFS = 65535  # sriov_totalvfs is a 16-bit field in the SR-IOV capability

_MAC = re.compile(r"[0-9a-f]{2}(:[0-9a-f]{2}){5}")
_GUID = re.compile(r"[0-9a-f]{2}(:[0-9a-f]{2}){7}")
# The kernel prints the domain with %04x: VMD and some hosts have 5-digit domains.
_PCI = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


class SriovValueError(ValueError):
    """A value that is not what the field says it is (one line, naming field and value)."""


def _mac(v: Any) -> str:
    if not isinstance(v, str) or not _MAC.fullmatch(v.lower()):
        raise SriovValueError(f"{v!r} is not a MAC address (xx:xx:xx:xx:xx:xx)")
    return v.lower()


def _guid(v: Any) -> str:
    if not isinstance(v, str) or not _GUID.fullmatch(v.lower()):
        raise SriovValueError(f"{v!r} is not a GUID (8 colon-separated bytes)")
    return v.lower()


def _int_in(lo: int, hi: int) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise SriovValueError(f"{v!r} is not an integer in {lo}..{hi}")
        return v

    return check


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise SriovValueError(f"{v!r} is not true or false")
    return v


def _link_state(v: Any) -> str:
    if v not in LINK_STATES:
        raise SriovValueError(f"{v!r} is not one of {', '.join(LINK_STATES)}")
    return str(v)


@dataclass(frozen=True)
class VfField:
    name: str
    via: Via
    check: Callable[[Any], Any]  # returns the normalized value or raises SriovValueError
    mofed_restores: bool  # the DOCA driver container's own restore keeps this field


VF_FIELDS: Mapping[str, VfField] = MappingProxyType(
    {
        f.name: f
        for f in (
            VfField("mac", "pf", _mac, True),  # the admin MAC (ip link set <pf> vf N mac)
            VfField("vlan", "pf", _int_in(0, 4095), False),
            VfField("qos", "pf", _int_in(0, 7), False),
            VfField("spoofchk", "pf", _bool, False),
            VfField("trust", "pf", _bool, False),
            VfField("link_state", "pf", _link_state, False),
            VfField("min_tx_rate", "pf", _int_in(0, 1 << 32), False),
            VfField("max_tx_rate", "pf", _int_in(0, 1 << 32), False),
            VfField("node_guid", "pf", _guid, True),  # InfiniBand only
            VfField("port_guid", "pf", _guid, True),
            VfField("mtu", "netdev", _int_in(68, 65535), True),
            VfField("admin_up", "netdev", _bool, True),
            VfField("address", "netdev", _mac, True),  # the netdev's own MAC
        )
    }
)
PF_SIDE = tuple(n for n, f in VF_FIELDS.items() if f.via == "pf")
NETDEV_SIDE = tuple(n for n, f in VF_FIELDS.items() if f.via == "netdev")

Settings = Mapping[str, Any]


def check_settings(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Validate and normalize a settings mapping; SriovValueError names ``where`` and the field."""
    out: dict[str, Any] = {}
    for name, value in raw.items():
        spec = VF_FIELDS.get(name)
        if spec is None:
            raise SriovValueError(f"{where}: unknown VF setting {name!r}")
        try:
            out[name] = spec.check(value)
        except SriovValueError as exc:
            raise SriovValueError(f"{where}: {name}: {exc}") from None
    return out


def is_pci_address(v: object) -> bool:
    """dddd[dddd]:bb:dd.f, lower case, as sysfs names PCI functions."""
    return isinstance(v, str) and _PCI.fullmatch(v) is not None


def check_pci(v: Any, where: str) -> str:
    if not is_pci_address(v):
        raise SriovValueError(f"{where}: {v!r} is not a PCI address (dddd[dddd]:bb:dd.f)")
    return v


# -- what the node looks like now ---------------------------------------------------------


@dataclass(frozen=True)
class VfSnapshot:
    """One VF as observed: its PCI device (if present) and its settings."""

    index: int
    pci: str | None  # None: the PF's virtfnN link is missing (VF not created)
    driver: str | None  # the bound driver (mlx5_core, igbvf, vfio-pci), None when unbound
    netdev: str | None  # its netdev in the host network namespace, if any
    settings: Settings  # PF-side fields from IFLA_VFINFO_LIST, netdev fields when netdev
    problems: tuple[str, ...] = ()
    # Identity of this incarnation of the VF's PCI device (its sysfs inode): a VF
    # destroyed and created again between two passes is a new device.
    ident: int | None = None
    netdev_ident: int | None = None  # its host netdev's ifindex (a rebound driver: a new one)


@dataclass(frozen=True)
class PfSnapshot:
    """One SR-IOV capable PCI function (it has ``sriov_totalvfs``)."""

    pci: str
    driver: str | None  # None: no driver bound (unloaded)
    netdev: str | None
    numvfs: int | None
    totalvfs: int | None
    eswitch_mode: str | None = None
    vfs: tuple[VfSnapshot, ...] = ()
    problems: tuple[str, ...] = ()

    def vf(self, index: int) -> VfSnapshot | None:
        for v in self.vfs:
            if v.index == index:
                return v
        return None


@dataclass(frozen=True)
class CniAttachment:
    """One entry of sriov-cni's cache (/var/lib/cni/sriov/<container>-<ifname>)."""

    vf_pci: str
    container: str  # the pod sandbox's container ID
    network: str  # the NetworkAttachmentDefinition's network name
    pod_ifname: str  # e.g. net1

    def describe(self) -> str:
        return f"sandbox {self.container[:12]} ({self.network}, {self.pod_ifname})"


@dataclass(frozen=True)
class SavedVf:
    index: int
    pci: str | None
    driver: str | None
    netdev: str | None  # host netdev name when saved (None: in a pod netns, vfio, unbound)
    settings: Settings
    ident: int | None = None  # the VF device incarnation it was saved from (see VfSnapshot)
    netdev_ident: int | None = None  # the ifindex of the netdev it was saved from


@dataclass(frozen=True)
class SavedPf:
    """A PF's VFs as they were while it was stable: what a restore brings back."""

    pci: str
    netdev: str | None
    driver: str | None
    numvfs: int
    eswitch_mode: str | None
    vfs: tuple[SavedVf, ...]
    saved_at: float
    attachments: tuple[CniAttachment, ...] = ()

    def vf(self, index: int) -> SavedVf | None:
        for v in self.vfs:
            if v.index == index:
                return v
        return None


@dataclass(frozen=True)
class PersistedSnapshot:
    """``var/lib/nodeagent/sriov.json`` as read at this pass (None fields: absent)."""

    pfs: Mapping[str, SavedPf] = field(default_factory=lambda: MappingProxyType({}))
    problem: str | None = None  # corrupt, unknown version, a bad value: reported


@dataclass(frozen=True)
class SriovObservation:
    pfs: Mapping[str, PfSnapshot] = field(default_factory=lambda: MappingProxyType({}))
    attachments: tuple[CniAttachment, ...] = ()
    persisted: PersistedSnapshot = field(default_factory=PersistedSnapshot)
    problems: tuple[str, ...] = ()
    # What kept the guard from seeing PFs at all (the PCI device list unreadable): no PF
    # is judged gone from this read, and the guard is not ok.
    blind: tuple[str, ...] = ()


EMPTY_SRIOV = SriovObservation()


def read_problems(pf: PfSnapshot) -> tuple[str, ...]:
    """What went wrong reading this PF and its VFs (netlink, a malformed value): none, clean."""
    return pf.problems + tuple(p for v in pf.vfs for p in v.problems)


def _saved_vf(v: VfSnapshot, before: SavedVf | None) -> SavedVf:
    """``v`` as saved: only what was read. A VF whose read had a problem keeps what was
    saved before, whole; a field not read keeps its saved value. A VF whose host netdev is
    away for now (its driver being rebound, moved into a pod) keeps the netdev saved
    before, on the same device."""
    if before is not None and v.problems:
        return before
    settings = {**before.settings, **v.settings} if before is not None else dict(v.settings)
    netdev, netdev_ident = v.netdev, v.netdev_ident
    if (
        v.netdev is None
        and before is not None
        and before.netdev is not None
        and before.ident is not None
        and before.ident == v.ident
    ):
        netdev, netdev_ident = before.netdev, before.netdev_ident
    return SavedVf(
        v.index, v.pci, v.driver, netdev, MappingProxyType(settings), v.ident, netdev_ident
    )


def saved_from_observed(
    pf: PfSnapshot,
    attachments: tuple[CniAttachment, ...],
    now: float,
    before: SavedPf | None = None,
) -> SavedPf:
    """The snapshot of ``pf`` as read (see ``_saved_vf``); the caller takes none from a PF
    whose own read had a problem (``PfSnapshot.problems``: its VF settings were not read)."""
    vf_pcis = {v.pci for v in pf.vfs}
    return SavedPf(
        pci=pf.pci,
        netdev=pf.netdev,
        driver=pf.driver,
        numvfs=pf.numvfs or 0,
        eswitch_mode=pf.eswitch_mode,
        vfs=tuple(_saved_vf(v, before.vf(v.index) if before else None) for v in pf.vfs),
        saved_at=now,
        attachments=tuple(a for a in attachments if a.vf_pci in vf_pcis),
    )


def same_config(a: SavedPf, b: SavedPf) -> bool:
    """Equal apart from when it was saved."""

    def key(s: SavedPf) -> Any:
        return (
            s.pci,
            s.netdev,
            s.driver,
            s.numvfs,
            s.eswitch_mode,
            tuple((v.index, v.pci, v.driver, v.netdev, sorted(v.settings.items())) for v in s.vfs),
            s.attachments,
        )

    return bool(key(a) == key(b))


# -- the saved snapshot's JSON schema (versioned) -------------------------------------------


def saved_pf_to_json(pf: SavedPf) -> dict[str, Any]:
    return {
        "pci": pf.pci,
        "netdev": pf.netdev,
        "driver": pf.driver,
        "numvfs": pf.numvfs,
        "eswitch_mode": pf.eswitch_mode,
        "saved_at": pf.saved_at,
        "vfs": [
            {
                "index": v.index,
                "pci": v.pci,
                "driver": v.driver,
                "netdev": v.netdev,
                "settings": dict(sorted(v.settings.items())),
                "ident": v.ident,
                "netdev_ident": v.netdev_ident,
            }
            for v in pf.vfs
        ],
        "attachments": [
            {
                "vf_pci": a.vf_pci,
                "container": a.container,
                "network": a.network,
                "pod_ifname": a.pod_ifname,
            }
            for a in pf.attachments
        ],
    }


def _opt_int(v: Any, where: str) -> int | None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
        raise SriovValueError(f"{where}: {v!r} is not an integer")
    return v


def _opt_str(d: Mapping[str, Any], key: str, where: str) -> str | None:
    v = d.get(key)
    if v is not None and not isinstance(v, str):
        raise SriovValueError(f"{where}: {key} is {v!r}, not a string")
    return v


def saved_pf_from_json(d: Any, where: str) -> SavedPf:
    if not isinstance(d, Mapping):
        raise SriovValueError(f"{where}: not an object")
    pci = check_pci(d.get("pci"), f"{where}.pci")
    numvfs = d.get("numvfs")
    if isinstance(numvfs, bool) or not isinstance(numvfs, int) or not 0 <= numvfs <= MAX_VFS:
        raise SriovValueError(f"{where}: numvfs is {numvfs!r}, not a count")
    saved_at = d.get("saved_at", 0.0)
    if isinstance(saved_at, bool) or not isinstance(saved_at, int | float):
        raise SriovValueError(f"{where}: saved_at is {saved_at!r}, not a time")
    raw_vfs = d.get("vfs")
    if not isinstance(raw_vfs, list):
        raise SriovValueError(f"{where}: vfs is not a list")
    vfs = []
    seen: set[int] = set()
    for n, raw in enumerate(raw_vfs):
        w = f"{where}.vfs[{n}]"
        if not isinstance(raw, Mapping):
            raise SriovValueError(f"{w}: not an object")
        index = raw.get("index")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 65536:
            raise SriovValueError(f"{w}: index is {index!r}, not a VF index")
        if index in seen:
            raise SriovValueError(f"{w}: VF {index} appears twice")
        seen.add(index)
        vf_pci = raw.get("pci")
        if vf_pci is not None:
            check_pci(vf_pci, f"{w}.pci")
        settings = raw.get("settings")
        if not isinstance(settings, Mapping):
            raise SriovValueError(f"{w}: settings is not an object")
        vfs.append(
            SavedVf(
                index=index,
                pci=vf_pci,
                driver=_opt_str(raw, "driver", w),
                netdev=_opt_str(raw, "netdev", w),
                settings=MappingProxyType(check_settings(settings, f"{w}.settings")),
                ident=_opt_int(raw.get("ident"), f"{w}.ident"),
                netdev_ident=_opt_int(raw.get("netdev_ident"), f"{w}.netdev_ident"),
            )
        )
    raw_atts = d.get("attachments", [])
    if not isinstance(raw_atts, list):
        raise SriovValueError(f"{where}: attachments is not a list")
    atts = []
    for n, raw in enumerate(raw_atts):
        w = f"{where}.attachments[{n}]"
        if not isinstance(raw, Mapping):
            raise SriovValueError(f"{w}: not an object")
        atts.append(
            CniAttachment(
                vf_pci=check_pci(raw.get("vf_pci"), f"{w}.vf_pci"),
                container=str(raw.get("container") or ""),
                network=str(raw.get("network") or ""),
                pod_ifname=str(raw.get("pod_ifname") or ""),
            )
        )
    return SavedPf(
        pci=pci,
        netdev=_opt_str(d, "netdev", where),
        driver=_opt_str(d, "driver", where),
        numvfs=numvfs,
        eswitch_mode=_opt_str(d, "eswitch_mode", where),
        vfs=tuple(sorted(vfs, key=lambda v: v.index)),
        saved_at=float(saved_at),
        attachments=tuple(atts),
    )


def snapshot_to_json(pfs: Mapping[str, SavedPf]) -> dict[str, Any]:
    return {
        "schema": SNAPSHOT_SCHEMA,
        "version": SNAPSHOT_VERSION,
        "pfs": [saved_pf_to_json(pfs[k]) for k in sorted(pfs)],
    }


def snapshot_from_json(doc: Any) -> dict[str, SavedPf]:
    """Parse a whole snapshot document; SriovValueError (one line) on anything wrong."""
    if not isinstance(doc, Mapping) or doc.get("schema") != SNAPSHOT_SCHEMA:
        raise SriovValueError(f"not a {SNAPSHOT_SCHEMA} document")
    if doc.get("version") != SNAPSHOT_VERSION:
        raise SriovValueError(
            f"schema version {doc.get('version')!r} is not {SNAPSHOT_VERSION} (this agent's)"
        )
    raw = doc.get("pfs")
    if not isinstance(raw, list):
        raise SriovValueError("pfs is not a list")
    out: dict[str, SavedPf] = {}
    for n, item in enumerate(raw):
        pf = saved_pf_from_json(item, f"pfs[{n}]")
        out[pf.pci] = pf
    return out
