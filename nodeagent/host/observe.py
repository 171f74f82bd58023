"""Read what the guards declared they need into one immutable NodeSnapshot.

Level-triggered: every pass re-reads everything the guards declared, and
only that (``Needs``: named /sys/module entries and the storage chain's
closure, .ko files, marker files, listings, locks, mounts, NVMe controllers,
SR-IOV PFs), so a pass costs the same on a 50-module node and a 5000-module
one. Malformed values never raise: they become ``problems`` on the fact they
concern, which the guards turn into reasons. Parsed .ko files are cached by
their identity (device, inode, mtime, ctime, size); ``modules.dep`` is
indexed once per file identity. The descriptor each cached .ko was read from
stays open: a load inserts that very file (``verified_fd``), never a second
lookup by path. Every path resolves inside the host root (``fs.HostRoot``).

The readers of /proc/locks, mountinfo, NVMe controllers and SR-IOV PFs are
injectable (``Readers``), as ``ModuleOps`` is for module operations, so the
simulator and tests plug in the same way for every guard. The defaults of the
storage guard's are ``host/storage_facts.py``; SR-IOV's comes from the VF
guard's host side (``guards/sriov/``).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import astuple, dataclass, replace
from types import MappingProxyType
from typing import Any, Protocol

from nodeagent.core.identity import identity_mismatch
from nodeagent.core.names import is_decimal, is_module_name, normalize_module_name
from nodeagent.core.needs import DiskNeed, Needs
from nodeagent.core.paths import HostPaths
from nodeagent.core.snapshot import (
    DiskModule,
    HeldModule,
    LoadedModule,
    NodeSnapshot,
    PciDevice,
    TextFact,
)
from nodeagent.core.sriov_model import EMPTY_SRIOV, SriovObservation, is_pci_address
from nodeagent.errors import NodeagentError
from nodeagent.host.fs import HostRoot, reopen
from nodeagent.host.moddep import Memo, find_module, module_dependencies
from nodeagent.host.modfile import (
    ModuleFile,
    ModuleFileError,
    parse_build_id_note,
    read_module_fd,
)
from nodeagent.host.storage_facts import (
    read_mountinfo,
    read_nvme,
    read_nvmet_ports,
    read_proc_locks,
)

# A reader returns its facts and the one-line problems met reading them.
Reader = Callable[[], tuple[tuple[Any, ...], list[str]]]
_CHAIN_LIMIT = 512  # modules in one chain closure; a real RDMA storage chain has ~30
_KO_CACHE_MAX = 64  # each entry holds an open descriptor
_KoKey = tuple[str, int, int, int, int, int]


SriovReader = Callable[[], tuple[SriovObservation, list[str]]]
HeldReader = Callable[[], tuple[tuple[HeldModule, ...], list[str]]]


PCI_DEVICES = "sys/bus/pci/devices"
_HEX_ID = re.compile(r"0x[0-9a-fA-F]{1,6}")


def no_sriov() -> tuple[SriovObservation, list[str]]:
    """Without a netlink reader (``guards/sriov/observe.py``'s ``SriovObserver.read``): no
    SR-IOV PFs."""
    return EMPTY_SRIOV, []


def no_held() -> tuple[tuple[HeldModule, ...], list[str]]:
    """Without a hold (``guards/peermem/side.py``'s reader): no held module files."""
    return (), []


@dataclass(frozen=True)
class Readers:
    """Injectable sources of the facts that are not plain files or /sys/module entries.

    ``None`` means the default reader under the host root (``HostReaders``).
    """

    locks: Reader | None = None
    mounts: Reader | None = None
    nvme: Reader | None = None
    nvmet_ports: Reader | None = None
    sriov: SriovReader = no_sriov
    held: HeldReader = no_held


class HasPaths(Protocol):
    """What the observer reads of the configuration: its paths (``Config`` has them; the
    host layer does not import the configuration)."""

    @property
    def paths(self) -> HostPaths: ...


INITSTATES = ("live", "coming", "going")
_SRCVERSION = re.compile(r"[0-9A-Fa-f]{1,64}")


class Observer:
    def __init__(
        self,
        host: HostRoot,
        cfg: HasPaths,
        needs: Needs | None = None,
        readers: Readers | None = None,
    ) -> None:
        """``needs``: the union of the guards' (``Reconciler.needs()``); none by default."""
        self.host = host
        self.cfg = cfg
        self.needs = needs or Needs()
        readers = readers or Readers()
        self.read_locks: Reader = readers.locks or (lambda: read_proc_locks(host, cfg.paths.locks))
        self.read_mounts: Reader = readers.mounts or (
            lambda: read_mountinfo(host, cfg.paths.mountinfo)
        )
        self.read_nvme: Reader = readers.nvme or (lambda: read_nvme(host, cfg.paths.nvme_class))
        self.read_nvmet_ports: Reader = readers.nvmet_ports or (
            lambda: read_nvmet_ports(host, cfg.paths.nvmet_ports)
        )
        self.read_sriov: SriovReader = readers.sriov
        self.read_held: HeldReader = readers.held
        # When the loop's watch last saw each of ``needs.opens`` opened (the run loop sets
        # it to its FileWatch's; an agent driven pass by pass sees no opening).
        self.opened_at: Callable[[str], float | None] = lambda _rel: None
        # identity key -> (parse result, the descriptor it was read from)
        self._ko_cache: dict[_KoKey, tuple[ModuleFile | str, int]] = {}
        self._verified: dict[str, tuple[int, _KoKey]] = {}  # rel path -> the last pass's file
        self._deps: Memo | None = None  # during observe(): each modules.dep read once
        # (path, name) -> (the parse it was made from, its DiskModule): made again when the
        # parse cache gives another parse; cleared with that cache.
        self._disk_made: dict[tuple[str, str], tuple[ModuleFile, DiskModule]] = {}
        # PCI address -> its IDs, read once while the address is listed (a device's IDs
        # do not change; one gone and another at the same address between two passes
        # is read again at the agent's next start).
        self._pci: dict[str, PciDevice] = {}

    # -- loaded modules -----------------------------------------------------

    def read_loaded_modules(self) -> tuple[dict[str, LoadedModule], list[str]]:
        """Every loaded module (a full /sys/module scan: for tools and tests, not passes)."""
        base = self.cfg.paths.sys_module
        modules: dict[str, LoadedModule] = {}
        try:
            entries = os.listdir(self.host.path(base))
        except FileNotFoundError:
            return modules, [f"{base} does not exist: this kernel has no loadable modules"]
        except OSError as exc:
            return modules, [f"{base} is unreadable: {exc.strerror}"]
        for name in sorted(entries):
            mod = self.read_loaded_module(name)
            if mod is not None:
                modules[mod.name] = mod
        return modules, []

    def read_loaded_module(self, name: str) -> LoadedModule | None:
        """None for builtin modules (no initstate) and for names the kernel cannot have made."""
        if not is_module_name(name):
            return None
        d = f"{self.cfg.paths.sys_module}/{name}"
        problems: list[str] = []
        raw_state = self._attr(d, "initstate", problems)
        if raw_state is None and not problems:
            return None  # builtin: no initstate
        initstate: str | None = None
        if raw_state is not None:
            if raw_state in INITSTATES:
                initstate = raw_state
            else:
                problems.append(f"initstate is {raw_state[:40]!r} (expected live, coming or going)")
        refcnt: int | None = None
        raw_ref = self._attr(d, "refcnt", problems)
        if raw_ref is not None:
            if is_decimal(raw_ref):
                refcnt = int(raw_ref)
            else:
                problems.append(f"refcnt is {raw_ref[:40]!r} (not a number)")
        srcversion: str | None = None
        raw_src = self._attr(d, "srcversion", problems)
        if raw_src is not None:
            if _SRCVERSION.fullmatch(raw_src):
                srcversion = raw_src.upper()
            else:
                problems.append(f"srcversion is {raw_src[:40]!r} (not hexadecimal)")
        build_id: str | None = None
        note_rel = f"{d}/notes/.note.gnu.build-id"
        try:
            raw_note = self.host.read_bytes(note_rel, 4096)
        except FileNotFoundError:
            raw_note = None
        except OSError as exc:
            problems.append(f"build-id note unreadable: {exc.strerror}")
            raw_note = None
        if raw_note is not None:
            try:
                build_id = parse_build_id_note(raw_note, f"/{note_rel}")
            except ModuleFileError as exc:
                problems.append(str(exc))
        holders = tuple(
            normalize_module_name(h)
            for h in self.host.listing(f"{d}/holders", problems)
            if is_module_name(h)
        )
        if (raw_ref is None or problems) and self._gone(d):
            # Unloaded while it was read (its directory went after initstate was read): not
            # loaded, not "refcnt unreadable", which a guard takes for a possible user and
            # would stop the very removal that unloaded it.
            return None
        return LoadedModule(
            name=normalize_module_name(name),
            initstate=initstate,
            refcnt=refcnt,
            srcversion=srcversion,
            build_id=build_id,
            holders=holders,
            problems=tuple(problems),
        )

    def _gone(self, d: str) -> bool:
        try:
            self.host.read_text(f"{d}/initstate", 4096)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return False

    def _attr(self, d: str, attr: str, problems: list[str]) -> str | None:
        try:
            return self.host.read_text(f"{d}/{attr}", 4096).strip()
        except FileNotFoundError:
            return None
        except OSError as exc:
            problems.append(f"{attr} unreadable: {exc.strerror}")
            return None

    # -- modules on disk ------------------------------------------------------

    def read_disk_module(self, name: str, kernel: str, trees: Iterable[str]) -> DiskModule:
        """The file modules.dep names for ``name`` in the first driver tree that lists it."""
        dirs = [tree_moddir(t, kernel) for t in trees]
        for rel_dir in dirs:
            moddir = self.host.path_text(rel_dir)
            found = find_module(moddir, name, self._open_in_root, self._deps)
            if found is None:
                continue
            rel = self.host.rel_of(found)
            parsed = self._parse_ko(rel)
            if isinstance(parsed, str):
                return DiskModule(name=name, path=rel, problem=parsed)
            # The same parse gives the same DiskModule: kept with it, not rebuilt per pass
            # (its CRC tables are copied into read-only mappings: thousands on a real node).
            made = self._disk_made.get((rel, name))
            if made is None or made[0] is not parsed:
                made = self._disk_made[(rel, name)] = (parsed, disk_module(parsed, rel, name))
            return made[1]
        return DiskModule(
            name=name, path=None, problem=f"not in modules.dep under {' or '.join(dirs)}"
        )

    def chain_facts(
        self, tree: str, planned: Sequence[str], trees: Iterable[str]
    ) -> tuple[list[DiskModule], dict[str, tuple[LoadedModule, DiskModule]]]:
        """What ``identity.chain_refusals`` compares, for an insert from ``tree`` that
        adds ``planned`` (libkmod's dry run, in order): each planned module's file in that
        tree, and each loaded module they depend on with the file among ``trees`` that
        is the loaded one (else the first found: its identity then says it is not). For
        the executor, on an observer of its own (the loop's caches are not shared across
        threads); the parse cache is dropped after, no descriptor kept."""
        try:
            kernel, problems = self.read_kernel()
            if problems:
                raise NodeagentError(problems[0])
            # libkmod judged "already loaded" from its own /sys; the host root's is the
            # node's: a planned module live there is a provider, not an insert.
            lives = {n: self.read_loaded_module(n) for n in planned}
            inserts = [n for n in planned if lives[n] is None]
            disks = [self.read_disk_module(name, kernel, (tree,)) for name in inserts]
            loaded: dict[str, tuple[LoadedModule, DiskModule]] = {}
            for dep in sorted({d for m in disks for d in m.depends} - set(inserts)):
                live = lives.get(dep) or self.read_loaded_module(dep)
                if live is None:
                    continue
                files = [self.read_disk_module(dep, kernel, (t,)) for t in trees]
                same = [f for f in files if f.path and identity_mismatch(live, f) is None]
                loaded[dep] = (live, (same or files)[0])
            return disks, loaded
        finally:
            self._drop_cache()

    def _open_in_root(self, path: str) -> int:
        """modules.dep, identified without being opened (moddep reads it only when it is
        not the one it parsed before: ``reopen``)."""
        return self.host.open(self.host.rel_of(path), os.O_PATH, follow=True)

    def _parse_ko(self, rel: str) -> ModuleFile | str:
        """Parse the .ko at ``rel`` (resolved inside the root); a string says what is wrong."""
        # Identified without being opened: on a filesystem the hold marks, an open of the
        # target is a round trip through the responder at every pass (issue 39); only a
        # file not seen before is opened, through the same descriptor's inode.
        try:
            path_fd, st = self.host.identify(rel, follow=True)
        except OSError as exc:
            self._verified.pop(rel, None)
            return f"cannot read {rel}: {exc.strerror or exc}"
        key: _KoKey = (rel, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)
        cached = self._ko_cache.get(key)
        if cached is not None:
            os.close(path_fd)
            result, fd = cached
        else:
            try:
                fd = reopen(path_fd)
            except OSError as exc:
                self._verified.pop(rel, None)
                return f"cannot read {rel}: {exc.strerror or exc}"
            finally:
                os.close(path_fd)
            try:
                result = read_module_fd(fd, rel)
            except ModuleFileError as exc:
                result = str(exc)
            if len(self._ko_cache) >= _KO_CACHE_MAX:
                self._drop_cache()
            self._ko_cache[key] = (result, fd)
        if isinstance(result, str):
            self._verified.pop(rel, None)
        else:
            self._verified[rel] = (fd, key)
        return result

    def _drop_cache(self) -> None:
        for _result, fd in self._ko_cache.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._ko_cache.clear()
        self._verified.clear()
        self._disk_made.clear()

    def verified_fd(self, rel: str) -> int | None:
        """The open descriptor of the .ko this observer last read and parsed at ``rel``.

        None when it was not read cleanly, or the file behind the descriptor
        changed since (size, mtime or ctime): it must be verified again first.
        """
        entry = self._verified.get(rel)
        if entry is None:
            return None
        fd, key = entry
        try:
            st = os.fstat(fd)
        except OSError:
            return None
        if (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size) != key[1:]:
            return None
        return fd

    def close(self) -> None:
        self._drop_cache()

    # -- the whole node -------------------------------------------------------

    def read_kernel(self) -> tuple[str, list[str]]:
        rel = self.cfg.paths.osrelease
        try:
            kernel = self.host.read_text(rel, 256).strip()
        except OSError as exc:
            return "unknown", [f"kernel release unreadable at {rel}: {exc.strerror}"]
        if not kernel or "/" in kernel or ".." in kernel or not kernel.isprintable():
            return "unknown", [f"kernel release at {rel} is malformed: {kernel[:60]!r}"]
        return kernel, []

    def read_text_fact(self, rel: str) -> TextFact:
        """A small text file (first 4 KiB); absent or unreadable is a fact, not an error."""
        try:
            return TextFact(rel, self.host.read_text(rel, 4096))
        except FileNotFoundError:
            return TextFact(rel, None, "absent")
        except OSError as exc:
            return TextFact(rel, None, f"unreadable: {exc.strerror}")

    def observe(self, now: float) -> NodeSnapshot:
        self._deps = {}
        try:
            return self._observe(now)
        finally:
            self._deps = None

    def _observe(self, now: float) -> NodeSnapshot:
        needs = self.needs
        kernel, problems = self.read_kernel()
        # Listings before the trees: a driver root mounted between the two would otherwise
        # be seen mounted with its file not found ("cannot verify"), and a mount wakes no
        # pass; in this order the file is found, or the root is seen empty (issue 65).
        listings = {d: tuple(self.host.listing(d, problems)) for d in sorted(needs.listings)}
        disk = self._read_disk(needs.disk, kernel)
        wanted = set(needs.modules)
        for d in needs.disk:
            if d.follow_depends:
                wanted.update(disk[d.name].depends)
        modules = self._read_modules(wanted, problems)
        if needs.chains:
            self._read_chains(needs.chains, needs.chain_trees, kernel, modules, problems)
        unread: dict[str, tuple[str, ...]] = {}  # snapshot field -> what its reader missed
        locks = self._run("locks", self.read_locks, unread) if needs.locks else ()
        mounts = self._run("mounts", self.read_mounts, unread) if needs.mounts else ()
        nvme = self._run("nvme", self.read_nvme, unread) if needs.nvme else ()
        ports = self._run("nvmet_ports", self.read_nvmet_ports, unread) if needs.nvme else ()
        problems.extend(p for found in unread.values() for p in found)
        sriov, sriov_problems = self.read_sriov() if needs.sriov else no_sriov()
        problems.extend(sriov_problems)
        pci = self.read_pci(problems) if needs.pci else None
        held, held_problems = self.read_held() if needs.held else no_held()
        problems.extend(held_problems)
        # A marker whose presence means "stop" counts as present in an odd form.
        files = self.host.file_facts(sorted(needs.files), odd=needs.present_if_odd)
        for rel in needs.opens & files.keys():
            files[rel] = replace(files[rel], opened_at=self.opened_at(rel))
        return NodeSnapshot(
            now=now,
            kernel=kernel,
            modules=MappingProxyType(dict(sorted(modules.items()))),
            disk=MappingProxyType(disk),
            files=MappingProxyType(files),
            listings=MappingProxyType(listings),
            texts=MappingProxyType({t: self.read_text_fact(t) for t in sorted(needs.texts)}),
            locks=locks,
            mounts=mounts,
            nvme=nvme,
            nvmet_ports=ports,
            sriov=sriov,
            problems=tuple(problems),
            read_problems=MappingProxyType(unread),
            pci=pci,
            held=held,
        )

    def read_pci(self, problems: list[str]) -> MappingProxyType[str, PciDevice] | None:
        """Every PCI function's vendor and class; None when the bus cannot be listed (no
        device is then known absent: core/applicability.py reads that as "applies")."""
        try:
            listed = self.host.listdir(PCI_DEVICES, strict=True)
        except FileNotFoundError:
            return None
        except (OSError, NodeagentError) as exc:
            problems.append(f"{PCI_DEVICES} unreadable: {getattr(exc, 'strerror', None) or exc}")
            return None
        addresses = [a for a in listed if is_pci_address(a)]
        known = {a: d for a in addresses if (d := self._pci.get(a)) and None not in astuple(d)}
        self._pci = {a: known.get(a) or self._read_pci_device(a) for a in addresses}
        return MappingProxyType(dict(self._pci))

    def _read_pci_device(self, address: str) -> PciDevice:
        ids: list[int | None] = []
        for attr in ("vendor", "class"):
            try:
                raw = self.host.read_text(f"{PCI_DEVICES}/{address}/{attr}", 64).strip()
                ids.append(int(raw, 16) if _HEX_ID.fullmatch(raw) else None)
            except (OSError, NodeagentError):
                ids.append(None)  # unreadable: it may be any device (fail closed)
        return PciDevice(vendor=ids[0], pci_class=ids[1])

    def markers_unchanged(self, snap: NodeSnapshot) -> bool:
        """Every marker file still as ``snap`` saw it (presence and identity): a few stats.

        Checked right before a gate is published, so a ready flag removed after
        the observation is caught even before its inotify event reaches the loop.
        """
        now = self.host.file_facts(snap.files, odd=self.needs.present_if_odd)
        return all(
            (now[rel].present, now[rel].ident) == (seen.present, seen.ident)
            for rel, seen in snap.files.items()
        )

    @staticmethod
    def _run(field: str, reader: Reader, unread: dict[str, tuple[str, ...]]) -> tuple[Any, ...]:
        facts, found = reader()
        if found:
            unread[field] = tuple(found)
        return facts

    def _read_disk(self, wanted: tuple[DiskNeed, ...], kernel: str) -> dict[str, DiskModule]:
        trees = {d.name: d.trees for d in wanted}
        disk: dict[str, DiskModule] = {}
        for d in wanted:
            disk[d.name] = self.read_disk_module(d.name, kernel, d.trees)
        for d in wanted:
            if not d.follow_depends:
                continue
            for dep in disk[d.name].depends:  # normalized by the .ko reader
                if dep not in disk:
                    disk[dep] = self.read_disk_module(dep, kernel, trees.get(dep, d.trees))
        return disk

    def _read_modules(self, names: Iterable[str], problems: list[str]) -> dict[str, LoadedModule]:
        base = self.cfg.paths.sys_module
        if not os.path.isdir(self.host.path(base)):
            problems.append(f"{base} does not exist: this kernel has no loadable modules")
            return {}
        modules: dict[str, LoadedModule] = {}
        for name in sorted(names):
            mod = self.read_loaded_module(name)
            if mod is not None:
                modules[mod.name] = mod
        return modules

    def _read_chains(
        self,
        roots: Iterable[str],
        trees: tuple[str, ...],
        kernel: str,
        modules: dict[str, LoadedModule],
        problems: list[str],
    ) -> None:
        """Add what removing ``roots`` involves: the loaded roots, the modules holding
        them (transitively), and every module those depend on per modules.dep (with
        its holders' names, to tell whether it would still be needed)."""
        dirs = [self.host.path(tree_moddir(t, kernel)) for t in trees]
        tried: set[str] = set()

        def read(name: str) -> LoadedModule | None:
            if name not in modules and name not in tried:
                tried.add(name)
                mod = self.read_loaded_module(name)
                if mod is not None:
                    modules[mod.name] = mod
            return modules.get(name)

        up: set[str] = set()
        todo = sorted(roots)
        while todo and len(up) < _CHAIN_LIMIT:
            name = todo.pop()
            mod = read(name) if name not in up else None
            if mod is None:
                continue
            up.add(name)
            todo.extend(h for h in mod.holders if h not in up)
        if todo:
            problems.append(f"module chain larger than {_CHAIN_LIMIT} modules; truncated")
        for name in sorted(up):
            for d in dirs:
                for dep in module_dependencies(d, name, self._open_in_root, self._deps):
                    read(dep)


def disk_module(parsed: ModuleFile, rel: str | None = None, name: str | None = None) -> DiskModule:
    """A parsed .ko as the guards see it; ``rel`` is its path under the host root (default: /)."""
    return DiskModule(
        name=name or parsed.name,
        path=rel if rel is not None else parsed.path.lstrip("/"),
        srcversion=parsed.srcversion.upper() if parsed.srcversion else None,
        build_id=parsed.build_id,
        depends=parsed.depends,
        required_crcs=MappingProxyType(dict(parsed.required_crcs)),
        exported_crcs=MappingProxyType(dict(parsed.exported_crcs)),
    )


def tree_moddir(tree: str, kernel: str) -> str:
    """``lib/modules/<kernel>`` under a driver root ("" is the host's own)."""
    return f"{tree}/lib/modules/{kernel}" if tree else f"lib/modules/{kernel}"
