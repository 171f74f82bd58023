"""Carry out the VF guard's ``RestoreVf`` and ``SetNumVfs`` (an executor of ``host/act.py``).

Names are resolved from PCI addresses when it acts (udev renames a new VF's
netdev); only the fields that differ are written, one netlink attribute group
at a time, so an ``EOPNOTSUPP`` names the field the driver lacks (recorded as
``unsupported``, not an error); then every field is read back.
"""

from __future__ import annotations

import errno
import functools
from collections.abc import Callable, Mapping
from typing import Any

from nodeagent.core.actions import RestoreVf, SetNumVfs
from nodeagent.errors import StepFailed
from nodeagent.guards.sriov.netlink import FIELD_GROUPS, LINK_FIELDS, SriovOps
from nodeagent.guards.sriov.observe import PCI_DEVICES, Sysfs
from nodeagent.host.fs import HostRoot

Detail = tuple[tuple[str, str], ...]  # (field, "written" | "unsupported" | "read back ...")


class SriovExecutor:
    """Carries out the VF guard's actions through ``SriovOps`` (see the module doc).

    ``RestoreVf`` returns its per-field results (written, unsupported); a
    field that cannot be set or does not read back fails the step with them.
    """

    def __init__(self, host: HostRoot, ops: SriovOps) -> None:
        self.host = host
        self.sys = Sysfs(host)
        self.ops = ops

    def handlers(self) -> Mapping[type, Callable[[Any], Detail | None]]:
        return {RestoreVf: self.restore, SetNumVfs: self.numvfs}

    def numvfs(self, action: SetNumVfs) -> None:
        if action.through_zero:
            self.ops.set_numvfs(action.pf_pci, 0)
        self.ops.set_numvfs(action.pf_pci, action.numvfs)

    def _pf_netdev(self, pf_pci: str) -> str:
        name = self.sys.first_netdev(f"{PCI_DEVICES}/{pf_pci}")
        if name is None:
            raise OSError(errno.ENODEV, f"PF {pf_pci} has no netdev")
        return name

    def restore(self, action: RestoreVf) -> Detail:
        pf = self._pf_netdev(action.pf_pci)
        want_pf = dict(action.pf_settings)
        want_link = dict(action.link_settings)
        detail: dict[str, str] = {}
        errors: list[str] = []
        have = self.ops.vf_settings(pf).get(action.index)
        if have is None:
            raise OSError(errno.ENODEV, f"{pf} reports no VF {action.index}")
        for fields in FIELD_GROUPS.values():
            mine = {f: want_pf[f] for f in fields if f in want_pf}
            if not mine or all(have.get(f) == v for f, v in mine.items()):
                continue
            values = {f: want_pf.get(f, have.get(f)) for f in fields}  # vlan+qos, min+max
            values = {f: v for f, v in values.items() if v is not None}
            _write(
                functools.partial(self.ops.set_vf, pf, action.index, values), mine, detail, errors
            )
        netdev = None
        if want_link:
            netdev = self.sys.first_netdev(f"{PCI_DEVICES}/{action.vf_pci}")
            if netdev is None:
                errors.append(f"VF {action.index} has no netdev for {', '.join(sorted(want_link))}")
            else:
                now = self.ops.links().get(netdev, {})
                for name in LINK_FIELDS:  # mtu and address before bringing it up
                    if name in want_link and now.get(name) != want_link[name]:
                        value = want_link[name]
                        set_it = functools.partial(self.ops.set_link, netdev, name, value)
                        _write(set_it, {name: value}, detail, errors)
        # Read back: the fields that were to be set must now hold their values.
        back = dict(self.ops.vf_settings(pf).get(action.index) or {})
        if netdev is not None:
            back.update(self.ops.links().get(netdev, {}))
        checked = {**want_pf, **(want_link if netdev is not None else {})}
        for name, value in checked.items():
            if detail.get(name) == "unsupported" or detail.get(name, "").startswith("error"):
                continue
            if back.get(name) != value:
                detail[name] = f"read back {back.get(name)!r}"
                errors.append(f"{name} reads back {back.get(name)!r}, not {value!r}")
        result = tuple(sorted(detail.items()))
        if errors:
            raise StepFailed("; ".join(errors), detail=result)
        return result


def _write(
    do: Callable[[], None], fields: Mapping[str, Any], detail: dict[str, str], errors: list[str]
) -> None:
    """One netlink write; EOPNOTSUPP marks its fields unsupported (recorded, not an error)."""
    try:
        do()
    except OSError as exc:
        if exc.errno == errno.EOPNOTSUPP:
            for f in fields:
                detail[f] = "unsupported"
            return
        for f in fields:
            detail[f] = f"error: {exc.strerror or exc}"
        errors.append(f"{', '.join(fields)}: {exc.strerror or exc}")
        return
    for f in fields:
        detail[f] = "written"
