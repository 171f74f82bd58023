"""The VF guard's host side: read SR-IOV PFs and VFs, keep the snapshot file, carry out restores.

- ``SriovObserver`` reads every PCI function with ``sriov_totalvfs`` under
  ``sys/bus/pci/devices``: driver, netdev, ``sriov_numvfs``, and per
  ``virtfnN`` the VF's PCI address, driver and host netdev; the per-VF
  settings come through the PF (``SriovOps.vf_settings``, netlink), the host
  netdevs' own settings from one link dump; and sriov-cni's cache
  (``var/lib/cni/sriov``) says which pod sandbox each VF was attached to.
- ``SriovStore`` keeps ``var/lib/nodeagent/sriov.json``: versioned, written
  atomically and only when it changes, never replaced by an empty snapshot; a
  corrupt or unknown-version file is moved aside and reported.
- ``act.py`` carries out the guard's actions.

Malformed sysfs values and failed netlink reads never raise: they become
``problems`` on the PF or VF whose facts they are, so the guard keeps what it
saved instead of taking the missing settings for empty ones.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from nodeagent.core.names import is_decimal
from nodeagent.core.sriov_model import (
    MAX_VFS,
    NETDEV_SIDE,
    PF_SIDE,
    VF_FIELDS,
    CniAttachment,
    PersistedSnapshot,
    PfSnapshot,
    SavedPf,
    SriovObservation,
    SriovValueError,
    VfSnapshot,
    is_pci_address,
    snapshot_from_json,
    snapshot_to_json,
)
from nodeagent.errors import NodeagentError
from nodeagent.guards.sriov.netlink import SriovOps
from nodeagent.host.fs import HostRoot
from nodeagent.host.state import strict_json

PCI_DEVICES = "sys/bus/pci/devices"
SNAPSHOT_REL = "var/lib/nodeagent/sriov.json"
CNI_CACHE_REL = "var/lib/cni/sriov"
IFINDEX_MAX = 2**31 - 1  # a positive int in the kernel: 65536 is a valid one on a busy node


class Sysfs:
    """SR-IOV sysfs reads, every one resolved inside the host root (as if chrooted).

    sysfs's own links are relative and stay inside; a planted absolute link
    resolves inside the root too, never in the container's filesystem.
    """

    def __init__(self, host: HostRoot) -> None:
        self.host = host

    def _stat(self, rel: str, problems: list[str] | None = None) -> os.stat_result | None:
        try:
            fd = self.host.open(rel, os.O_PATH, follow=True)
        except (OSError, NodeagentError) as exc:
            _absent(rel, exc, problems)
            return None
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    def link_name(self, rel: str, problems: list[str] | None = None) -> str | None:
        """The last component of a symlink's target (``driver`` -> ``mlx5_core``)."""
        parent, _, name = rel.rpartition("/")
        try:
            dfd = self.host.open(parent, os.O_PATH | os.O_DIRECTORY, follow=True)
        except (OSError, NodeagentError) as exc:
            _absent(parent, exc, problems)
            return None
        try:
            return os.path.basename(os.readlink(name, dir_fd=dfd))
        except OSError as exc:
            _absent(rel, exc, problems)
            return None
        finally:
            os.close(dfd)

    def listdir(self, rel: str, problems: list[str] | None = None) -> list[str]:
        try:
            return self.host.listdir(rel)
        except (OSError, NodeagentError) as exc:
            _absent(rel, exc, problems)
            return []

    def ident(self, rel: str, problems: list[str] | None = None) -> int | None:
        """The inode of a sysfs directory: a device destroyed and created again gets another."""
        st = self._stat(rel, problems)
        return None if st is None else st.st_ino

    def first_netdev(self, dev: str, problems: list[str] | None = None) -> str | None:
        names = self.listdir(f"{dev}/net", problems)
        return names[0] if names else None

    def exists(self, rel: str) -> bool:
        return self._stat(rel) is not None

    def read_count(
        self, rel: str, problems: list[str], *, most: int = MAX_VFS, what: str = "a VF count"
    ) -> int | None:
        """A decimal count in ``0..most``: non-blocking, regular files only. Missing,
        unreadable or malformed, it is a problem (the kernel always writes these)."""
        try:
            raw = self.host.read_text(rel, 64)
        except FileNotFoundError:
            problems.append(f"{rel} missing")
            return None
        except (OSError, NodeagentError) as exc:
            problems.append(f"{rel} unreadable: {getattr(exc, 'strerror', None) or exc}")
            return None
        text = raw[:-1] if raw.endswith("\n") else raw  # sysfs: digits and one newline
        if not is_decimal(text) or len(text) > 10 or int(text) > most:
            problems.append(f"{rel} is {text[:20]!r}, not {what} (0..{most})")
            return None
        return int(text)


def _absent(rel: str, exc: Exception, problems: list[str] | None) -> None:
    """A read that found nothing: absent when the kernel says so (``ENOENT``,
    ``ENOTDIR``); anything else (``EACCES``, ``EIO``, a symlink refused) is unreadable,
    never absent, and goes to ``problems``: a VF read as gone would be restored again."""
    if problems is not None and not isinstance(exc, FileNotFoundError | NotADirectoryError):
        problems.append(f"{rel} unreadable: {getattr(exc, 'strerror', None) or exc}")


def _clean(
    settings: Mapping[str, Any], sides: tuple[str, ...], where: str
) -> tuple[dict[str, Any], list[str]]:
    out: dict[str, Any] = {}
    problems = []
    for name in sides:
        if name not in settings:
            continue
        try:
            out[name] = VF_FIELDS[name].check(settings[name])
        except SriovValueError as exc:
            problems.append(f"{where}: {name}: {exc}")
    return out, problems


def _virtfn_suffix(name: str) -> str | None:
    """The index digits of a PF's ``virtfnN`` link; None for any other entry."""
    suffix = name[len("virtfn") :]
    return suffix if name.startswith("virtfn") and is_decimal(suffix) else None


def _pci_or_problem(name: str | None, rel: str, problems: list[str]) -> str | None:
    """A VF's PCI address from its ``virtfnN`` link, checked as the snapshot's reader
    checks it: anything else (``../..``) is a problem, never a name saved and refused later."""
    if name is None or is_pci_address(name):
        return name
    problems.append(f"{rel} links to {name[:40]!r}, not a PCI device")
    return None


class SriovObserver:
    def __init__(
        self,
        host: HostRoot,
        ops: SriovOps | None,
        store: SriovStore,
        cni_cache: str = CNI_CACHE_REL,
    ) -> None:
        self.host = host
        self.sys = Sysfs(host)
        self.ops = ops
        self.store = store
        self.cni_cache = cni_cache

    def read(self) -> tuple[SriovObservation, list[str]]:
        """The observer's ``Readers.sriov``: the facts, and node-wide problems (none here)."""
        return self.observe(), []

    def observe(self) -> SriovObservation:
        problems: list[str] = []
        pfs: dict[str, PfSnapshot] = {}
        blind: list[str] = []
        found: list[str] = []
        for pci in self._devices(blind):
            dev = f"{PCI_DEVICES}/{pci}"
            if not is_pci_address(pci):  # the kernel names them so: nothing else is a PF
                if self.sys.exists(f"{dev}/sriov_totalvfs"):
                    problems.append(f"{dev[:80]}: not a PCI address; not read as a PF")
                continue
            # A PF has both; one of them missing is a PF read badly, not a plain device.
            if not (
                self.sys.exists(f"{dev}/sriov_totalvfs") or self.sys.exists(f"{dev}/sriov_numvfs")
            ):
                continue
            found.append(pci)
        # Which VF devices exist, before any setting is read: a VF whose device is not the
        # same one after the walk was created again in between (MOFED's reload), and the
        # settings read belong to the one before it.
        before = {pci: self._vf_idents(pci) for pci in found}
        links = self._links(problems) if found else None
        for pci in found:
            pfs[pci] = self.read_pf(pci, links, before[pci])
        return SriovObservation(
            pfs=MappingProxyType(pfs),
            attachments=self.read_cni_cache(problems) if pfs else (),
            persisted=self.store.load(),
            problems=tuple(problems),
            blind=tuple(blind),
        )

    def _devices(self, blind: list[str]) -> list[str]:
        """The PCI device list; unreadable, a problem that blinds the guard. A root with no
        PCI bus at all (``sys/bus/pci`` absent) has no PFs: nothing to guard."""
        if not self.sys.exists(PCI_DEVICES):
            if self.sys.exists("sys/bus/pci"):
                blind.append(f"{PCI_DEVICES} missing")
            return []
        try:
            return self.host.listdir(PCI_DEVICES, strict=True)
        except (OSError, NodeagentError) as exc:
            blind.append(f"{PCI_DEVICES} unreadable: {getattr(exc, 'strerror', None) or exc}")
            return []

    def _vf_idents(self, pci: str) -> dict[int, int | None]:
        """Each VF's device (its sysfs directory's inode), by index."""
        dev = f"{PCI_DEVICES}/{pci}"
        return {
            int(suffix): self.sys.ident(f"{dev}/{n}")
            for n in self.sys.listdir(dev)
            if (suffix := _virtfn_suffix(n)) is not None and len(suffix) <= 5
        }

    def _links(self, problems: list[str]) -> dict[str, dict[str, Any]] | None:
        """Every host netdev's settings; None when they could not be read."""
        if self.ops is None:
            return None
        try:
            return self.ops.links()
        except OSError as exc:
            problems.append(f"netlink link dump failed: {exc.strerror or exc}")
            return None

    def read_pf(
        self,
        pci: str,
        links: Mapping[str, Mapping[str, Any]] | None,
        before: Mapping[int, int | None],
    ) -> PfSnapshot:
        """One PF; ``links`` None: the netdevs' settings were not read (a problem per VF).
        ``before``: each VF's device as read before any setting (``_vf_idents``)."""
        sysfs = self.sys
        dev = f"{PCI_DEVICES}/{pci}"
        problems: list[str] = []
        driver = sysfs.link_name(f"{dev}/driver", problems)
        netdev = sysfs.first_netdev(dev, problems) if driver else None
        numvfs = sysfs.read_count(f"{dev}/sriov_numvfs", problems)
        totalvfs = sysfs.read_count(f"{dev}/sriov_totalvfs", problems)
        vf_settings: dict[int, dict[str, Any]] = {}
        if netdev is not None and self.ops is not None:
            try:
                vf_settings = self.ops.vf_settings(netdev)
            except OSError as exc:
                problems.append(f"VF settings of {netdev} unreadable: {exc.strerror or exc}")
        elif netdev is not None:
            problems.append("no netlink: VF settings not read")
        indexes = []
        for n in sysfs.listdir(dev, problems):
            suffix = _virtfn_suffix(n)
            if suffix is None:
                continue
            if len(suffix) > 5 or int(suffix) >= MAX_VFS:
                problems.append(f"{dev}/{n[:24]}: not a VF index (0..{MAX_VFS - 1})")
                continue
            indexes.append(int(suffix))
        vfs = []
        for i in sorted(indexes):
            where = f"VF {i}"
            bad: list[str] = []
            vf_link = sysfs.link_name(f"{dev}/virtfn{i}", bad)
            vf_pci = _pci_or_problem(vf_link, f"{dev}/virtfn{i}", bad)
            vdev = f"{PCI_DEVICES}/{vf_pci}" if vf_pci else None
            vf_driver = sysfs.link_name(f"{vdev}/driver", bad) if vdev else None
            vf_netdev = sysfs.first_netdev(vdev, bad) if vdev else None
            settings, bad_settings = _clean(vf_settings.get(i, {}), PF_SIDE, where)
            bad += bad_settings
            netdev_ident = None
            if vdev and vf_netdev:
                netdev_ident = sysfs.read_count(
                    f"{vdev}/net/{vf_netdev}/ifindex", bad, most=IFINDEX_MAX, what="an ifindex"
                )
            ident = sysfs.ident(vdev, bad) if vdev else None
            if vdev and (ident is None or before.get(i) != ident):
                # Not the device whose settings were read: a torn read, never "restored".
                bad.append(f"{where}: its device changed while it was read; read again")
            if vf_netdev is not None and links is None:
                bad.append(f"{where}: settings of its netdev {vf_netdev} not read (no link dump)")
            elif vf_netdev is not None and links is not None and vf_netdev in links:
                link, bad2 = _clean(links[vf_netdev], NETDEV_SIDE, where)
                settings.update(link)
                bad += bad2
            vfs.append(
                VfSnapshot(
                    index=i,
                    pci=vf_pci,
                    driver=vf_driver,
                    netdev=vf_netdev,
                    settings=MappingProxyType(settings),
                    problems=tuple(bad),
                    ident=ident,
                    netdev_ident=netdev_ident,
                )
            )
        return PfSnapshot(
            pci=pci,
            driver=driver,
            netdev=netdev,
            numvfs=numvfs,
            totalvfs=totalvfs,
            vfs=tuple(vfs),
            problems=tuple(problems),
        )

    def read_cni_cache(self, problems: list[str]) -> tuple[CniAttachment, ...]:
        """sriov-cni's ``<container>-<ifname>`` files: the NetConf it saved at attach time."""
        out = []
        for name in self.host.listing(self.cni_cache, problems):
            rel = f"{self.cni_cache}/{name}"
            try:
                conf = json.loads(self.host.read_bytes(rel, 1 << 16))
            except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
                problems.append(f"{rel}: unreadable sriov-cni cache entry ({exc})")
                continue
            if not isinstance(conf, dict) or not isinstance(conf.get("deviceID"), str):
                problems.append(f"{rel}: sriov-cni cache entry without a deviceID")
                continue
            if not is_pci_address(conf["deviceID"]):
                problems.append(f"{rel}: deviceID {conf['deviceID'][:40]!r} is not a PCI address")
                continue
            container, _, ifname = name.rpartition("-")
            out.append(
                CniAttachment(
                    vf_pci=conf["deviceID"],
                    container=container or name,
                    network=str(conf.get("name") or "?"),
                    pod_ifname=str(conf.get("ContIFNames") or ifname),
                )
            )
        return tuple(out)


class SriovStore:
    """``var/lib/nodeagent/sriov.json`` (see the module doc)."""

    def __init__(self, host: HostRoot, rel: str = SNAPSHOT_REL, *, read_only: bool = False) -> None:
        self.host = host
        self.rel = rel
        self.read_only = read_only
        self._read_ident: Any = None
        self._loaded = PersistedSnapshot()
        self._written: bytes | None = None
        self._saved_pfs: dict[str, SavedPf] = {}  # what was last written, by identity
        self.reports: list[str] = []  # set-aside reports not yet taken by the agent

    def load(self) -> PersistedSnapshot:
        """The file's content, re-read only when the file changed; a bad file is moved aside."""
        fact = self.host.file_fact(self.rel)
        ident = (fact.present, fact.ident, fact.problem)
        if ident == self._read_ident:
            return self._loaded
        self._read_ident = ident
        if not fact.present:
            problem = (
                self._set_aside(f"is not a regular file ({fact.problem})") if fact.problem else None
            )
            self._loaded = PersistedSnapshot(problem=problem)
            return self._loaded
        try:
            data = self.host.read_bytes(self.rel, 1 << 24)
            pfs = snapshot_from_json(strict_json(data))
        # SriovValueError is a ValueError; RecursionError: nesting deeper than the parser goes
        except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
            self._loaded = PersistedSnapshot(problem=self._set_aside(f"is corrupt: {exc}"))
            return self._loaded
        self._written = data
        self._loaded = PersistedSnapshot(pfs=MappingProxyType(pfs))
        return self._loaded

    def _set_aside(self, why: str) -> str:
        if self.read_only:
            return f"{self.rel} {why}"
        dst = f"{self.rel.rpartition('/')[2]}.corrupt"
        try:
            self.host.set_aside(self.rel, dst)
            where = f"moved to {dst}"
        except (OSError, NodeagentError) as exc:
            where = f"could not move it aside: {getattr(exc, 'strerror', None) or exc}"
        self._read_ident = None
        msg = f"{self.rel} {why}; {where}; the snapshot starts from what the node shows"
        self.reports.append(msg)
        return msg

    def save(self, pfs: Mapping[str, SavedPf]) -> bool:
        """Write the snapshot if it changed; an empty one never replaces a file. True if written."""
        if not pfs:
            return False
        if pfs.keys() == self._saved_pfs.keys() and all(pfs[k] is self._saved_pfs[k] for k in pfs):
            return False  # the guard's values are immutable: the same objects, the same file
        data = (json.dumps(snapshot_to_json(pfs), indent=1, sort_keys=True) + "\n").encode()
        if data == self._written:
            self._saved_pfs = dict(pfs)
            return False
        try:  # what is written is what a restart accepts: read back with the reader's rules
            snapshot_from_json(json.loads(data))
        except SriovValueError as exc:
            raise NodeagentError(
                f"{self.rel} not written, it would be refused on restart ({exc}); "
                "the file keeps the last good snapshot"
            ) from None
        self.host.write_atomic(self.rel, data)
        self._written = data
        self._saved_pfs = dict(pfs)
        self._read_ident = None
        return True


__all__ = ["PCI_DEVICES", "SriovObserver", "SriovStore"]
