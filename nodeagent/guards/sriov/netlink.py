"""SR-IOV through rtnetlink (pyroute2): read every VF through its PF, set one field group at a time.

Per-VF settings are read from the PF's ``IFLA_VFINFO_LIST`` (``RTM_GETLINK``
with ``RTEXT_FILTER_VF``), so VFs moved into a pod's network namespace or
bound to ``vfio-pci`` are covered as well as those with a host netdev. Writes
go one netlink attribute group at a time (``mac``; ``vlan`` with ``qos``;
``rate`` with min/max; ``spoofchk``; ``trust``; ``link_state``; the IB GUIDs),
so an ``EOPNOTSUPP`` names the field the driver lacks. pyroute2 notes: the
key is ``link_state`` (not ``state``), and the ``vf`` dict is consumed by the
request builder, so a fresh one is built for every call.

``SriovOps`` is the boundary the VF guard's host code uses; ``PyrouteOps`` is
the real one, the simulator has its own.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

from nodeagent.host.fs import HostRoot

log = logging.getLogger("nodeagent.netlink")

LINK_STATE_CODES = {"auto": 0, "enable": 1, "disable": 2}
LINK_STATE_NAMES = {v: k for k, v in LINK_STATE_CODES.items()}
IFF_UP = 0x1
ZERO_GUID = "00:00:00:00:00:00:00:00"
# One netlink attribute may carry several fields: they are written together.
FIELD_GROUPS: Mapping[str, tuple[str, ...]] = {
    "mac": ("mac",),
    "vlan": ("vlan", "qos"),
    "rate": ("min_tx_rate", "max_tx_rate"),
    "spoofchk": ("spoofchk",),
    "trust": ("trust",),
    "link_state": ("link_state",),
    "node_guid": ("node_guid",),
    "port_guid": ("port_guid",),
}
GROUP_OF = {f: g for g, fields in FIELD_GROUPS.items() for f in fields}
LINK_FIELDS = ("mtu", "address", "admin_up")  # in the order they are written


class SriovOps(Protocol):
    """What the VF guard's host code needs from the kernel (OSError with errno on failure)."""

    def vf_settings(self, pf_ifname: str) -> dict[int, dict[str, Any]]:
        """Per VF index: the PF-side settings (mac, vlan, qos, spoofchk, trust, link_state, ...)."""
        ...

    def set_vf(self, pf_ifname: str, index: int, values: Mapping[str, Any]) -> None:
        """Set one field group (``FIELD_GROUPS``) of one VF through its PF."""
        ...

    def links(self) -> dict[str, dict[str, Any]]:
        """Every netdev in the agent's (host) namespace: mtu, admin_up, address."""
        ...

    def set_link(self, ifname: str, name: str, value: Any) -> None:
        """Set one of ``LINK_FIELDS`` on a netdev."""
        ...

    def set_numvfs(self, pf_pci: str, numvfs: int) -> None:
        """Write ``sriov_numvfs`` of the PF at this PCI address."""
        ...


def _oserror(exc: Exception) -> OSError:
    code = getattr(exc, "code", None)
    if isinstance(code, int) and code > 0:
        return OSError(code, os.strerror(code))
    return OSError(errno.EIO, str(exc) or type(exc).__name__)


def _vf_request(index: int, values: Mapping[str, Any]) -> dict[str, Any]:
    """A new ``vf=`` dict for one pyroute2 call (pyroute2 pops keys from it)."""
    group = {GROUP_OF[k] for k in values}
    if len(group) != 1:
        raise ValueError(f"one field group per call, got {sorted(values)}")
    (g,) = group
    req: dict[str, Any] = {"vf": index}
    if g == "vlan":
        req["vlan"] = {"vlan": values.get("vlan", 0), "qos": values.get("qos", 0)}
    elif g == "rate":
        req["rate"] = {
            "min_tx_rate": values.get("min_tx_rate", 0),
            "max_tx_rate": values.get("max_tx_rate", 0),
        }
    elif g == "link_state":
        req["link_state"] = LINK_STATE_CODES[values["link_state"]]
    elif g in ("spoofchk", "trust"):
        req[g] = int(bool(values[g]))
    elif g in ("node_guid", "port_guid"):
        req[f"ib_{g}"] = values[g]
    else:
        req["mac"] = values["mac"]
    return req


def _flag(value: Any) -> bool | None:
    """spoofchk/trust: 0 or 1; drivers that lack the setting report -1 (as u32)."""
    return bool(value) if value in (0, 1) else None


def parse_vfinfo(vfinfo: Any) -> dict[int, dict[str, Any]]:
    """``IFLA_VFINFO_LIST`` as pyroute2 decodes it -> per VF index, our field names."""
    out: dict[int, dict[str, Any]] = {}
    if vfinfo is None:
        return out
    for info in vfinfo.get_attrs("IFLA_VF_INFO"):
        mac = info.get_attr("IFLA_VF_MAC")
        if mac is None:
            continue
        index = int(mac["vf"])
        s: dict[str, Any] = {"mac": str(mac["mac"]).lower()}
        vlan = info.get_attr("IFLA_VF_VLAN")
        if vlan is not None:
            s["vlan"], s["qos"] = int(vlan["vlan"]), int(vlan["qos"])
        rate = info.get_attr("IFLA_VF_RATE")
        if rate is not None:
            s["min_tx_rate"], s["max_tx_rate"] = int(rate["min_tx_rate"]), int(rate["max_tx_rate"])
        for attr, key in (("IFLA_VF_SPOOFCHK", "spoofchk"), ("IFLA_VF_TRUST", "trust")):
            got = info.get_attr(attr)
            flag = _flag(got[key]) if got is not None else None
            if flag is not None:
                s[key] = flag
        ls = info.get_attr("IFLA_VF_LINK_STATE")
        if ls is not None and int(ls["link_state"]) in LINK_STATE_NAMES:
            s["link_state"] = LINK_STATE_NAMES[int(ls["link_state"])]
        for attr, key in (
            ("IFLA_VF_IB_NODE_GUID", "node_guid"),
            ("IFLA_VF_IB_PORT_GUID", "port_guid"),
        ):
            got = info.get_attr(attr)
            if got is not None and got[f"ib_{key}"] != ZERO_GUID:
                s[key] = str(got[f"ib_{key}"]).lower()
        out[index] = s
    return out


class PyrouteOps:
    """``SriovOps`` over pyroute2 ``IPRoute`` sockets: one per call in flight.

    A netlink call that hangs (a driver stuck in its VF handler) holds only its
    own socket: the other VFs' writes open or reuse another, so one slow VF
    delays no other (a single socket under a lock would queue every VF behind
    it). Idle sockets are kept for reuse, up to ``IDLE_MAX``; one whose call
    failed other than with a netlink error reply is closed, not reused.
    """

    IDLE_MAX = 4

    def __init__(self, host: HostRoot, connect: Callable[[], Any] | None = None) -> None:
        self.host = host
        self._connect = connect or _iproute
        self._idle: list[Any] = []
        self._busy = 0
        self._lock = threading.Lock()
        self._closed = False

    @contextmanager
    def _ip(self) -> Iterator[Any]:
        with self._lock:
            if self._closed:
                raise OSError(errno.EBADF, "netlink closed: the agent is stopping")
            ipr = self._idle.pop() if self._idle else None
            self._busy += 1
        reuse = False
        try:
            if ipr is None:
                ipr = self._connect()
            try:
                yield ipr
                reuse = True
            except OSError:
                raise
            except Exception as exc:  # NetlinkError and friends carry an errno as .code
                reuse = isinstance(getattr(exc, "code", None), int)
                raise _oserror(exc) from None
        finally:
            with self._lock:
                self._busy -= 1
                keep = reuse and not self._closed and len(self._idle) < self.IDLE_MAX
                if keep:
                    self._idle.append(ipr)
            if ipr is not None and not keep:
                _close_quietly(ipr)

    @property
    def sockets(self) -> tuple[int, int]:
        """(idle, in use): for tests and status."""
        with self._lock:
            return len(self._idle), self._busy

    def _index(self, ipr: Any, ifname: str) -> int:
        found = ipr.link_lookup(ifname=ifname)
        if not found:
            raise OSError(errno.ENODEV, f"no netdev {ifname!r}")
        return int(found[0])

    def vf_settings(self, pf_ifname: str) -> dict[int, dict[str, Any]]:
        with self._ip() as ipr:
            msg = ipr.link("get", index=self._index(ipr, pf_ifname), ext_mask=1)[0]
            return parse_vfinfo(msg.get_attr("IFLA_VFINFO_LIST"))

    def set_vf(self, pf_ifname: str, index: int, values: Mapping[str, Any]) -> None:
        with self._ip() as ipr:
            ipr.link("set", index=self._index(ipr, pf_ifname), vf=_vf_request(index, values))

    def links(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        with self._ip() as ipr:
            for msg in ipr.get_links():
                name = msg.get_attr("IFLA_IFNAME")
                if not name:
                    continue
                out[name] = {
                    "mtu": int(msg.get_attr("IFLA_MTU") or 0),
                    "admin_up": bool(msg["flags"] & IFF_UP),
                    "address": str(msg.get_attr("IFLA_ADDRESS") or "").lower(),
                }
        return out

    def set_link(self, ifname: str, name: str, value: Any) -> None:
        if name not in LINK_FIELDS:
            raise ValueError(f"not a link field: {name!r}")
        with self._ip() as ipr:
            index = self._index(ipr, ifname)
            if name == "admin_up":
                ipr.link("set", index=index, state="up" if value else "down")
            else:
                ipr.link("set", index=index, **{name: value})

    def set_numvfs(self, pf_pci: str, numvfs: int) -> None:
        write_sysfs(self.host, f"sys/bus/pci/devices/{pf_pci}/sriov_numvfs", f"{int(numvfs)}\n")

    def close(self) -> None:
        """Close the idle sockets; one still in a call is closed when the call returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for ipr in idle:
            _close_quietly(ipr)


def _iproute() -> Any:
    from pyroute2 import IPRoute  # imported here: the core path never needs it

    return IPRoute()


def _close_quietly(ipr: Any) -> None:
    try:
        ipr.close()
    except Exception as exc:  # a socket that will not close is still dropped
        log.debug("closing a netlink socket: %s", exc)


def write_sysfs(host: HostRoot, rel: str, text: str) -> None:
    """One write(2) to a sysfs attribute, as ``echo`` does (no temp file, no rename).

    Resolved inside the host root and non-blocking; only a regular file (a sysfs
    attribute is one) is written: never a FIFO, a device or a path out of the root.
    """
    fd = host.open(rel, os.O_WRONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{rel} is not a regular file; not written")
        os.write(fd, text.encode())
    finally:
        os.close(fd)
