"""The simulated kernel's rtnetlink, as the VF guard's host code sees it (``SriovOps``).

Per-VF settings are read and set through the PF, as with ``IFLA_VFINFO_LIST``:
VFs whose netdev is in a pod's namespace or that are bound to ``vfio-pci``
are there too. ``links()`` lists only the host namespace's netdevs. A field
named in ``unsupported`` fails with ``EOPNOTSUPP``, as a driver that lacks it
does (igb has no link state); the InfiniBand GUIDs are always unsupported
here (the simulated VFs are Ethernet).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from typing import Any

from nodeagent.sim.kernel import PF_FIELDS, SimKernel, VfConfig

__all__ = ["SimSriovOps"]

# Our field name -> the simulated VF's config attribute (the sim keeps one MAC per VF).
_LINK_ATTR = {"mtu": "mtu", "admin_up": "admin_up", "address": "mac"}


def _eopnotsupp(what: str) -> OSError:
    return OSError(errno.EOPNOTSUPP, f"{os.strerror(errno.EOPNOTSUPP)} ({what})")


class SimSriovOps:
    def __init__(self, kernel: SimKernel, unsupported: frozenset[str] = frozenset()) -> None:
        self.kernel = kernel
        self.unsupported = unsupported
        self.calls: list[tuple[str, str, int | None, tuple[str, ...]]] = []  # (op, dev, vf, fields)

    def _pf_named(self, ifname: str) -> Any:
        pf = self.kernel.pfs.get(ifname)
        if pf is None or not pf.present:
            raise OSError(errno.ENODEV, f"no netdev {ifname!r}")
        return pf

    def vf_settings(self, pf_ifname: str) -> dict[int, dict[str, Any]]:
        pf = self._pf_named(pf_ifname)
        out: dict[int, dict[str, Any]] = {}
        for vf in pf.vfs:
            cfg: VfConfig = vf.config
            s = {f: getattr(cfg, f) for f in PF_FIELDS if f not in self.unsupported}
            out[vf.index] = s
        return out

    def set_vf(self, pf_ifname: str, index: int, values: Mapping[str, Any]) -> None:
        self.calls.append(("set_vf", pf_ifname, index, tuple(sorted(values))))
        for name in values:
            if name in self.unsupported or name not in PF_FIELDS:
                raise _eopnotsupp(name)
        self._pf_named(pf_ifname)
        self.kernel.set_vf(pf_ifname, index, **dict(values))

    def links(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for pf in self.kernel.pfs.values():
            if pf.present:
                out[pf.ifname] = {"mtu": 1500, "admin_up": True, "address": "b8:ce:f6:00:00:01"}
            for vf in pf.vfs:
                if vf.netdev is not None and vf.netns is None:
                    out[vf.netdev] = {k: getattr(vf.config, a) for k, a in _LINK_ATTR.items()}
        return out

    def set_link(self, ifname: str, name: str, value: Any) -> None:
        self.calls.append(("set_link", ifname, None, (name,)))
        if name in self.unsupported or name not in _LINK_ATTR:
            raise _eopnotsupp(name)
        self.kernel.set_link(ifname, **{_LINK_ATTR[name]: value})

    def set_numvfs(self, pf_pci: str, numvfs: int) -> None:
        self.calls.append(("set_numvfs", pf_pci, None, (str(numvfs),)))
        pf = self.kernel.pf_by_pci(pf_pci)
        self.kernel.write_sriov_numvfs(pf.ifname, numvfs)
