"""A simulated Linux kernel behind the same host boundary the agent uses.

``SimKernel`` implements ``nodeagent.host.kmod.ModuleOps`` and keeps, under a
temp host root, exactly the files the agent's observer reads:

- ``sys/module/<m>/{initstate,refcnt,srcversion,holders/<h>,notes/.note.gnu.build-id}``
  (``holders`` entries are symlinks, the note is the raw ELF note);
- ``proc/sys/kernel/osrelease``;
- the PCI/net shape of SR-IOV (``sys/class/net/<pf>/device/sriov_numvfs``,
  ``virtfnN`` links, a VF's ``net/<ifname>`` appearing late).

What it decides comes from the ``.ko`` files themselves (read with the agent's
own ELF reader): a module's name, its srcversion and build-id, the symbol CRCs
it needs (``__versions``) and those it exports. Loading resolves every needed
symbol against the loaded modules as the kernel does: no exporter ->
``Unknown symbol X (err -2)``/``ENOENT``; another CRC -> ``disagrees about
version of symbol X`` + ``Unknown symbol X (err -22)``/``EINVAL``. Those lines
go to a simulated kernel log, which ``kernel_messages`` reads back like
``/dev/kmsg``.

Processes and filesystems, for the fanotify hold (``sim/fanotify.py``): every
``modprobe`` an actor runs is a process (``comm`` modprobe) that opens each
module file through the permission contract before it inserts it, as libkmod
does; a container runtime mounts a new overlay superblock for each start of a
container (``mount_overlay``), and a bind mount shows one at a second path, on the
same superblock (``bind_mount``: the GPU driver container's root at
``/run/nvidia/driver``). The process table is written where the agent's
``/proc`` reader looks (``proc_dir``) only once a fanotify group exists, so a
run without the hold sees no change at all. The agent's own loads (a thread,
not an actor) are not put through the contract: the shipped responder allows
its own pid first, which the real-kernel tests check.

Module add/remove and VF net/pci changes emit uevents: kept in ``uevents`` and
pushed to ``uevent_source``, a pipe with ``fileno()``/``drain()`` that the
agent takes as a wake source. Module init and exit take a little virtual time
(``init_delay``, ``exit_delay``), so an observer can see ``coming``/``going``.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import shutil
import struct
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType

from nodeagent.core.names import (
    normalize_module_name,
    validate_module_name,
    validate_module_param,
)
from nodeagent.host.events import Poke
from nodeagent.host.fanotify import PermEvent
from nodeagent.host.kmod import ModuleOpError
from nodeagent.host.moddep import find_module, module_dependencies
from nodeagent.host.modfile import (
    ModuleFile,
    ModuleFileError,
    module_name_from_path,
    read_module_fd,
    read_module_file,
)
from nodeagent.sim.clock import Scheduler
from nodeagent.sim.fanotify import SimFanotify

__all__ = [
    "LINK_FIELDS",
    "PF_FIELDS",
    "KernelLine",
    "ModState",
    "SimKernel",
    "SimPF",
    "SimVF",
    "Uevent",
    "VfConfig",
    "WakePipe",
    "build_id_note",
]


def build_id_note(build_id: bytes) -> bytes:
    """The bytes of ``/sys/module/<m>/notes/.note.gnu.build-id``: one raw GNU ELF note."""
    note = struct.pack("<III", 4, len(build_id), 3) + b"GNU\0" + build_id
    return note + b"\0" * (-len(note) % 4)


@dataclass(frozen=True)
class Uevent:
    t: float
    action: str  # add | remove | move
    subsystem: str  # module | net | pci
    name: str  # the kobject's sys_name
    devpath: str

    def describe(self) -> str:
        return f"uevent {self.action} {self.subsystem} {self.name}"


@dataclass(frozen=True)
class KernelLine:
    t: float
    text: str


class WakePipe(Poke):
    """The agent's self-pipe wake source, counting what was pushed and drained.

    ``produced``/``consumed`` count pushes and drained pushes (updated under the
    same lock as the pending list, so ``pending`` is exact); ``on_drain`` runs
    in the draining thread (the simulator uses it to know a pass is coming).

    A drain reads the pipe and takes the pending list under the lock a push writes
    under (``Poke.drain``), so the pipe is readable exactly while something is
    pending. Unlocked in between, a push landing there (the harness's thread, while
    the agent's drains after a wake by inotify) had its reason taken and its byte
    left: the agent's next pass read the fence as pending (not fresh: its gate
    withdrawn, the hold closed), the drain of that byte gave no reason, so no pass
    followed, and ``pending`` said 0: the harness settled on the gate the agent had
    decided open and withdrawn (a held load never let go, ~1 run in 40-150 of
    kernel-upgrade-race in the -hold mode).
    """

    def __init__(self) -> None:
        super().__init__()
        self.produced = 0
        self.consumed = 0
        self.on_drain: Callable[[int], None] | None = None

    def push(self, description: str) -> None:
        with self._lock:
            self.produced += 1
            self.poke(description)

    def _taken(self, out: list[str]) -> None:
        self.consumed = self.produced

    def drain(self) -> list[str]:
        with self._lock:  # (re-entrant: Poke.drain takes it again for the list)
            out = super().drain()
        if self.on_drain is not None:
            self.on_drain(len(out))
        return out

    @property
    def pending(self) -> int:
        return self.produced - self.consumed


HOST_SB = 1  # the host's root filesystem
EXT4_SUPER_MAGIC = 0xEF53
OVERLAYFS_SUPER_MAGIC = 0x794C7630


@dataclass
class SimProc:
    pid: int
    comm: str
    cmdline: tuple[str, ...]
    root: str  # host-relative directory its root is ("" : the host's)
    who: str  # the container (or actor) it belongs to, for timelines


@dataclass
class ModState:
    name: str
    path: str  # as the node sees it: "/run/nvidia/driver/lib/modules/..."
    info: ModuleFile
    state: str  # coming | live | going
    uses: tuple[str, ...]  # the modules whose symbols it resolved (it holds them)
    holders: set[str] = field(default_factory=set)
    users: int = 0  # references that are not modules (a mount, an open device)
    params: tuple[str, ...] = ()

    @property
    def refcnt(self) -> int:
        return len(self.holders) + self.users


@dataclass(frozen=True)
class VfConfig:
    """What ``ip link set <pf> vf N ...`` and ``ip link set <vf-netdev> ...`` set."""

    mac: str = "00:00:00:00:00:00"
    vlan: int = 0
    qos: int = 0
    trust: bool = False
    spoofchk: bool = True
    link_state: str = "auto"  # auto | enable | disable
    min_tx_rate: int = 0
    max_tx_rate: int = 0
    mtu: int = 1500
    admin_up: bool = False

    def differences(self, other: VfConfig) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]


# What is set through the PF (``ip link set <pf> vf N ...``), and on the VF's own netdev.
PF_FIELDS = ("mac", "vlan", "qos", "trust", "spoofchk", "link_state", "min_tx_rate", "max_tx_rate")
LINK_FIELDS = ("mtu", "admin_up", "mac")


@dataclass
class SimVF:
    index: int
    pci: str
    final_name: str
    netdev: str | None = None  # the current interface name, once it exists
    config: VfConfig = field(default_factory=VfConfig)
    driver: str | None = None  # bound driver: the PF's VF driver, "vfio-pci", or None
    netns: str | None = None  # a pod's network namespace holds its netdev (not the host's)


@dataclass
class SimPF:
    ifname: str
    pci: str
    totalvfs: int
    driver: str
    # seconds after sriov_numvfs is written (or the previous VF's netdev) until a VF's netdev
    vf_delay: Callable[[int], float]
    rename_delay: float
    probe_delay: float  # driver live -> PF netdev
    present: bool = False  # the PF netdev exists (driver bound)
    vfs: list[SimVF] = field(default_factory=list)
    generation: int = 0  # bumps whenever the VFs are destroyed: stale timers see it
    autoprobe: bool = True  # sriov_drivers_autoprobe: new VFs get their driver on their own

    def vf_pci(self, i: int) -> str:
        dom_bus, devfn = self.pci.rsplit(":", 1)
        dev, fn = (int(x, 16) for x in devfn.split("."))
        n = dev * 8 + fn + 3 + i
        return f"{dom_bus}:{n // 8:02x}.{n % 8}"


class SimKernel:
    """The simulated kernel (see the module doc). Implements ``ModuleOps``."""

    PCI_PARENT = "sys/devices/pci0000:00/0000:00:01.0"

    def __init__(
        self,
        root: str | os.PathLike[str],
        kver: str,
        sched: Scheduler | None = None,
        *,
        init_delay: float = 0.3,
        exit_delay: float = 0.3,
    ) -> None:
        self.root = Path(root)
        self.kver = kver
        self.sched = sched or Scheduler()
        self.init_delay = init_delay
        self.exit_delay = exit_delay
        self.init_messages: dict[str, str] = {}  # what a module's init prints, e.g. rpcrdma
        self.modules: dict[str, ModState] = {}
        self.kmsg: list[KernelLine] = []
        self.uevents: list[Uevent] = []
        self.uevent_source = WakePipe()
        self.pfs: dict[str, SimPF] = {}
        self.op_log: list[tuple[float, str, str]] = []  # (t, who, what) for timelines
        self.version = 0  # bumps on every change a reader could see (the simulator's "dirty")
        self._lock = threading.RLock()
        self._n = itertools.count()
        self._builtin = {"kernel", "printk"}
        # driver hooks: a module going live binds its devices, going unbinds them
        self._on_live: dict[str, list[Callable[[], None]]] = {}
        # Files a module creates while it is live (path under the root -> text), e.g.
        # nvidia's /proc/driver/nvidia/version; written at live, removed at going.
        self.proc_files: dict[str, tuple[str, str]] = {}
        self._on_going: dict[str, list[Callable[[], None]]] = {}
        # Filesystems (mount prefix, host-relative -> superblock), processes, fanotify groups.
        self.superblocks: dict[str, int] = {"": HOST_SB}
        self.binds: dict[str, str] = {}  # bind mounts: where (host-relative) -> what
        self._sb_ids = itertools.count(HOST_SB + 1)
        self.fanotify_groups: list[SimFanotify] = []
        self.procs: dict[int, SimProc] = {1: SimProc(1, "systemd", ("/sbin/init",), "", "host")}
        self.proc_history: dict[int, SimProc] = {}
        self.proc_dir = self.root / ".sim-proc"  # the agent's /proc for the hold
        self.proc_hooks: list[Callable[[SimProc], None]] = []  # a process started
        self._pids = itertools.count(1000)
        self._setup_tree()

    # -- files ----------------------------------------------------------------

    def _setup_tree(self) -> None:
        r = self.root
        (r / "sys/module").mkdir(parents=True, exist_ok=True)
        for name in self._builtin:  # builtin modules: a directory, no initstate
            (r / "sys/module" / name / "parameters").mkdir(parents=True, exist_ok=True)
        (r / "sys/class/net").mkdir(parents=True, exist_ok=True)
        (r / "sys/bus/pci/devices").mkdir(parents=True, exist_ok=True)
        (r / self.PCI_PARENT).mkdir(parents=True, exist_ok=True)
        (r / "proc/sys/kernel").mkdir(parents=True, exist_ok=True)
        self._write(r / "proc/sys/kernel/osrelease", self.kver + "\n")
        (r / "lib/modules" / self.kver).mkdir(parents=True, exist_ok=True)
        (r / "etc/modprobe.d").mkdir(parents=True, exist_ok=True)

    def _write(self, path: Path, text: str | bytes) -> None:
        self.version += 1
        data = text.encode() if isinstance(text, str) else text
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.sim{next(self._n)}")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def _rmtree(self, path: Path) -> None:
        if not path.exists() and not path.is_symlink():
            return
        self.version += 1
        trash = self.root / "sys/.sim-trash" / f"{path.name}.{next(self._n)}"
        trash.parent.mkdir(parents=True, exist_ok=True)
        # Gone from its place in one step, and kept in the trash: sysfs (kernfs) does not
        # hand a removed directory's inode number to the next device soon, a filesystem
        # freeing it would at once, and the agent tells a VF created again by its inode.
        os.rename(path, trash)

    def _unlink(self, path: Path) -> None:
        self.version += 1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def node_path(self, real: str | os.PathLike[str]) -> str:
        """``<root>/run/x`` -> ``/run/x`` (paths in messages are the node's, not the temp dir's)."""
        p = Path(os.path.abspath(real))
        try:
            return "/" + p.relative_to(self.root).as_posix()
        except ValueError:
            return str(p)

    def real_path(self, path: str | os.PathLike[str]) -> Path:
        """A path as given to a module operation: absolute under the root, or node-relative."""
        p = Path(path)
        if p.is_absolute():
            try:
                p.relative_to(self.root)
                return p
            except ValueError:
                return self.root / p.relative_to("/")
        return self.root / p

    # -- filesystems and processes (the fanotify hold) ---------------------------

    def fanotify_group(self) -> SimFanotify:
        """``fanotify_init``: a new permission group; the process table becomes visible."""
        group = SimFanotify(self)
        self.fanotify_groups.append(group)
        for proc in self.procs.values():
            self._write_proc(proc)
        return group

    def event_path(self, event: PermEvent) -> str:
        """The opened file's path, as ``/proc/self/fd/<fd>`` would give it."""
        for g in self.fanotify_groups:
            path = g.path_of(event)
            if path != "?":
                return path
        return "?"

    def mount_overlay(self, rel: str) -> int:
        """A container runtime's overlay for one start, reachable at ``rel``: a new
        superblock (the previous one there, if any, is gone with its marks)."""
        self.unmount(rel)
        sb = next(self._sb_ids)
        self.superblocks[rel.strip("/")] = sb
        return sb

    def bind_mount(self, src: str, dst: str) -> int:
        """``mount --rbind <src> <dst>``: the filesystem at ``src`` seen at ``dst`` too, the
        same superblock (its marks cover both paths). The files are copied to ``dst``, which
        is left an empty directory at the unmount: what is under ``src`` must not change
        while it is bound (nothing writes the driver's root after its mount)."""
        src, dst = src.strip("/"), dst.strip("/")
        self.unmount(dst)
        sb = self.superblock_of(src)
        target = self.root / dst
        shutil.copytree(self.root / src, target, symlinks=True, dirs_exist_ok=True)
        self.superblocks[dst] = sb
        self.binds[dst] = src
        self.version += 1
        return sb

    def is_mounted(self, rel: str) -> bool:
        """``findmnt -r -o TARGET | grep <rel>``: something is mounted at ``rel``."""
        return rel.strip("/") in self.superblocks

    def unmount(self, rel: str) -> None:
        """``umount``: ``rel`` shows what is under it again (a bind: an empty directory).
        The superblock goes, with its marks, once no mount shows it (a bind of a
        container's root keeps that root's filesystem after the container is gone)."""
        rel = rel.strip("/")
        sb = self.superblocks.pop(rel, None)
        if self.binds.pop(rel, None) is not None:
            target = self.root / rel
            for child in list(target.iterdir()) if target.is_dir() else ():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
            self.version += 1
        if sb is not None and sb not in self.superblocks.values():
            for g in self.fanotify_groups:
                g.drop_superblock(sb)

    def superblock_of(self, path: str | os.PathLike[str]) -> int:
        """The superblock a path (host-relative, or absolute under the root) is on."""
        rel = self.node_path(self.real_path(path)).strip("/")
        best, sb = -1, HOST_SB
        for prefix, s in self.superblocks.items():
            if (prefix == "" or rel == prefix or rel.startswith(prefix + "/")) and len(
                prefix
            ) > best:
                best, sb = len(prefix), s
        return sb

    def superblock_at(self, path: str) -> int | None:
        """What ``stat`` would say of ``path``: ``<proc_dir>/<pid>/root`` is that process's
        root; None where nothing is."""
        p = Path(path)
        if p.parent.parent == self.proc_dir and p.name == "root":
            proc = self.procs.get(int(p.parent.name)) if p.parent.name.isdigit() else None
            return None if proc is None else self.superblock_of(proc.root)
        return self.superblock_of(path) if self.real_path(path).exists() else None

    def fs_type_at(self, path: str) -> int | None:
        sb = self.superblock_at(path)
        if sb is None:
            return None
        return EXT4_SUPER_MAGIC if sb == HOST_SB else OVERLAYFS_SUPER_MAGIC

    def spawn_proc(self, comm: str, cmdline: Sequence[str], root: str = "", who: str = "") -> int:
        pid = next(self._pids)
        while pid == os.getpid():  # the agent's own pid is the responder's first rule
            pid = next(self._pids)
        proc = SimProc(pid, comm, tuple(cmdline), root.strip("/"), who or comm)
        self.procs[pid] = proc
        self.proc_history[pid] = proc
        if self.fanotify_groups:
            self._write_proc(proc)
        for hook in list(self.proc_hooks):
            hook(proc)
        return pid

    def exit_proc(self, pid: int) -> None:
        if self.procs.pop(pid, None) is not None:
            shutil.rmtree(self.proc_dir / str(pid), ignore_errors=True)

    def _write_proc(self, proc: SimProc) -> None:
        d = self.proc_dir / str(proc.pid)
        d.mkdir(parents=True, exist_ok=True)
        (d / "comm").write_text(proc.comm + "\n")
        (d / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in proc.cmdline))
        # Field 22, the start time in clock ticks (100 a second): with the pid, which process.
        started = round(self.sched.now() * 100)
        (d / "stat").write_text(f"{proc.pid} ({proc.comm}) S {'0 ' * 18}{started} 0\n")

    def _open_for_load(self, path: Path, pid: int) -> None:
        """An opener's ``open()`` of a module file: one event per group marking its
        filesystem, and a wait (virtual time) until each answers; denied -> EPERM."""
        sb = self.superblock_of(path)
        actor = self.sched.current_actor()
        for group in [g for g in self.fanotify_groups if sb in g.marks]:
            pending = group.deliver(self.node_path(path), pid, actor)
            while pending.answer is None and not group.closed:
                self.sched.sleep(float("inf"))
            if pending.answer is False:
                name = module_name_from_path(path)
                raise ModuleOpError("load", name, errno.EPERM, f"open {self.node_path(path)}")

    # -- logs and events ------------------------------------------------------

    def now(self) -> float:
        return self.sched.now()

    def log(self, text: str) -> None:
        self.version += 1
        self.kmsg.append(KernelLine(self.now(), text))

    def kernel_messages(self, module: str, keep: int = 8) -> list[str]:
        """Recent kernel lines about ``module`` (``<module>: ...``): the agent's kmsg reader."""
        prefix = f"{module}:"
        return [line.text for line in self.kmsg if line.text.startswith(prefix)][-keep:]

    def _uevent(self, action: str, subsystem: str, name: str, devpath: str) -> None:
        self.version += 1
        ev = Uevent(self.now(), action, subsystem, name, devpath)
        self.uevents.append(ev)
        self.uevent_source.push(ev.describe())

    def _note(self, what: str) -> None:
        actor = self.sched.current_actor()
        who = actor.name if actor is not None else threading.current_thread().name
        self.op_log.append((self.now(), who, what))

    # -- module state ---------------------------------------------------------

    def module(self, name: str) -> ModState | None:
        return self.modules.get(normalize_module_name(name))

    def is_live(self, name: str) -> bool:
        m = self.module(name)
        return m is not None and m.state == "live"

    def _exporter(self, symbol: str, exclude: str) -> ModState | None:
        for m in self.modules.values():
            if m.name != exclude and m.state != "going" and symbol in m.info.exported_crcs:
                return m
        return None

    def _sysdir(self, name: str) -> Path:
        return self.root / "sys/module" / name

    def _write_attr(self, name: str, attr: str, value: str) -> None:
        d = self._sysdir(name)
        if d.is_dir():
            self._write(d / attr, value + "\n")

    def _refresh_refcnt(self, name: str) -> None:
        m = self.modules.get(name)
        if m is not None:
            self._write_attr(name, "refcnt", str(m.refcnt))

    # -- ModuleOps ------------------------------------------------------------

    def insert_file(self, path: str, params: Sequence[str]) -> None:
        """Load exactly this file, like insmod / init_module(2)."""
        params = tuple(validate_module_param(p) for p in params)
        real = self.real_path(path)
        shown = self.node_path(real)
        guess = module_name_from_path(real)
        try:
            info = read_module_file(real)
        except ModuleFileError as exc:
            if not real.exists():
                raise ModuleOpError("load", guess, errno.ENOENT, shown) from None
            self.log(f"{guess}: invalid module format ({exc})")
            raise ModuleOpError("load", guess, errno.ENOEXEC, shown) from None
        self._insert(info, shown, params)

    def insert_fd(self, fd: int, name: str, params: Sequence[str]) -> None:
        """Load the module open at ``fd``, like finit_module(2)."""
        params = tuple(validate_module_param(p) for p in params)
        shown = self.node_path(os.readlink(f"/proc/self/fd/{fd}"))
        try:
            info = read_module_fd(fd, shown)
        except ModuleFileError as exc:
            self.log(f"{name}: invalid module format ({exc})")
            raise ModuleOpError("load", name, errno.ENOEXEC, shown) from None
        self._insert(info, shown, params)

    def _insert(self, info: ModuleFile, shown: str, params: tuple[str, ...]) -> None:
        name = validate_module_name(info.name)
        with self._lock:
            try:
                self._check_load(name, info, shown)
            except ModuleOpError as exc:
                self._note(f"load {name} failed ({errno.errorcode.get(exc.errno, exc.errno)})")
                raise
            uses = tuple(
                sorted(
                    {
                        m.name
                        for sym in info.required_crcs
                        if (m := self._exporter(sym, name)) is not None
                    }
                )
            )
            state = ModState(name, shown, info, "coming", uses, params=params)
            self.modules[name] = state
            self._make_sysdir(state)
            for provider in uses:
                self.modules[provider].holders.add(name)
                holder = self._sysdir(provider) / "holders" / name
                with contextlib.suppress(FileExistsError):
                    os.symlink(f"../../{name}", holder)
                self._refresh_refcnt(provider)
            self._note(f"load {name}")
            self._uevent("add", "module", name, f"/module/{name}")
        self.sched.sleep(self.init_delay)  # the module's init runs
        with self._lock:
            state.state = "live"
            self._write_attr(name, "initstate", "live")
            if name in self.init_messages:
                self.log(self.init_messages[name])
            if name in self.proc_files:
                rel, text = self.proc_files[name]
                self._write(self.root / rel, text)
            for hook in list(self._on_live.get(name, ())):
                hook()

    def _check_load(self, name: str, info: ModuleFile, shown: str) -> None:
        if name in self.modules or name in self._builtin:
            raise ModuleOpError("load", name, errno.EEXIST, f"{shown}: module is already loaded")
        if info.vermagic is not None and info.vermagic.split()[0] != self.kver:
            self.log(f"{name}: version magic '{info.vermagic}' should be '{self.kver} ...'")
            raise ModuleOpError("load", name, errno.ENOEXEC, shown)
        for sym in sorted(info.exported_crcs):
            owner = self._exporter(sym, name)
            if owner is not None:
                self.log(f"{name}: exports duplicate symbol {sym} (owned by {owner.name})")
                raise ModuleOpError("load", name, errno.ENOEXEC, shown)
        err = 0
        for sym, want in info.required_crcs.items():
            provider = self._exporter(sym, name)
            if provider is None:
                self.log(f"{name}: Unknown symbol {sym} (err -2)")
                err = errno.ENOENT
            elif provider.info.exported_crcs[sym] != want:
                self.log(f"{name}: disagrees about version of symbol {sym}")
                self.log(f"{name}: Unknown symbol {sym} (err -22)")
                err = errno.EINVAL
        if err:
            raise ModuleOpError("load", name, err, shown)

    def _make_sysdir(self, m: ModState) -> None:
        stage = self.root / "sys/.sim-staging" / f"{m.name}.{next(self._n)}"
        (stage / "holders").mkdir(parents=True)
        (stage / "initstate").write_text("coming\n")
        (stage / "refcnt").write_text("0\n")
        if m.info.srcversion:
            (stage / "srcversion").write_text(m.info.srcversion + "\n")
        if m.info.build_id:
            (stage / "notes").mkdir()
            (stage / "notes/.note.gnu.build-id").write_bytes(
                build_id_note(bytes.fromhex(m.info.build_id))
            )
        if m.params:
            (stage / "parameters").mkdir()
            for p in m.params:
                key, _, value = p.partition("=")
                (stage / "parameters" / key).write_text((value or "Y") + "\n")
        os.rename(stage, self._sysdir(m.name))  # /sys/module/<m> appears in one step

    def remove(self, name: str) -> None:
        """Unload, like rmmod (non-blocking delete_module(2))."""
        name = validate_module_name(name)
        with self._lock:
            m = self.modules.get(name)
            if m is None:
                if name in self._builtin:
                    raise ModuleOpError("unload", name, errno.ENOENT, "module is builtin")
                raise ModuleOpError("unload", name, errno.ENOENT, "module is not currently loaded")
            if m.state != "live":
                raise ModuleOpError("unload", name, errno.EBUSY, f"module is {m.state}")
            if m.holders:
                raise ModuleOpError(
                    "unload", name, errno.EBUSY, "in use by: " + " ".join(sorted(m.holders))
                )
            if m.users:
                raise ModuleOpError("unload", name, errno.EBUSY, f"in use (refcnt {m.refcnt})")
            m.state = "going"
            self._write_attr(name, "initstate", "going")
            if name in self.proc_files:
                self._unlink(self.root / self.proc_files[name][0])
            self._note(f"unload {name}")
            for hook in list(self._on_going.get(name, ())):
                hook()
        self.sched.sleep(self.exit_delay)  # the module's exit runs
        with self._lock:
            self._rmtree(self._sysdir(name))
            del self.modules[name]
            for provider in m.uses:
                p = self.modules.get(provider)
                if p is not None:
                    p.holders.discard(name)
                    self._unlink(self._sysdir(provider) / "holders" / name)
                    self._refresh_refcnt(provider)
            self._uevent("remove", "module", name, f"/module/{name}")

    def probe(self, name: str, moddir: str, params: Sequence[str] = ()) -> None:
        """Load with dependencies from ``moddir``'s modules.dep, like ``modprobe -d``."""
        self.modprobe(name, moddir, params)

    def probe_plan(
        self, name: str, moddir: str, params: Sequence[str] = ()
    ) -> tuple[tuple[str, str], ...]:
        """What ``probe`` would insert, in order, nothing inserted (libkmod's dry run)."""
        name = validate_module_name(name)
        real_dir = self.real_path(moddir)
        if find_module(real_dir, name) is None:
            where = self.node_path(real_dir)
            raise ModuleOpError("probe", name, errno.ENOENT, f"module {name} not found in {where}")
        with self._lock:
            order = [*reversed(module_dependencies(real_dir, name)), name]
            return tuple(
                (dep, " ".join(params) if dep == name else "")
                for dep in order
                if dep not in self.modules
            )

    def modprobe(
        self,
        name: str,
        moddir: str | os.PathLike[str],
        params: Sequence[str] = (),
        *,
        install_rules: bool = False,
    ) -> list[str]:
        """modprobe: the module and its dependencies, last-listed first; returns what it loaded.

        ``install_rules``: honour ``install <m> /bin/false`` (refuse) and
        ``install <m> /bin/true`` (skip) lines in ``<root>/etc/modprobe.d/*.conf``,
        as the host's own modprobe does (a pod's chroot modprobe reads its own).
        """
        name = validate_module_name(name)
        real_dir = self.real_path(moddir)
        path = find_module(real_dir, name)
        if path is None:
            where = self.node_path(real_dir)
            raise ModuleOpError("probe", name, errno.ENOENT, f"module {name} not found in {where}")
        rules = self.install_rules() if install_rules else {}
        loaded: list[str] = []
        # An actor's modprobe is a process whose opens go through the permission contract.
        actor = self.sched.current_actor()
        pid = (
            self.spawn_proc("modprobe", ("modprobe", name), who=actor.name)
            if actor is not None and self.fanotify_groups
            else None
        )
        try:
            return self._modprobe(name, real_dir, params, rules, loaded, pid)
        finally:
            if pid is not None:
                self.exit_proc(pid)

    def _modprobe(
        self,
        name: str,
        real_dir: Path,
        params: Sequence[str],
        rules: dict[str, str],
        loaded: list[str],
        pid: int | None,
    ) -> list[str]:
        for dep in [*reversed(module_dependencies(real_dir, name)), name]:
            if dep in self.modules:
                continue
            rule = rules.get(dep)
            if rule is not None:
                if rule in ("/bin/true", "true", "/usr/bin/true"):
                    continue
                if rule in ("/bin/false", "false", "/usr/bin/false"):
                    raise ModuleOpError(
                        "probe",
                        name,
                        errno.EPERM,
                        f"Error running install command '{rule}' for module {dep}: retcode 1",
                    )
            dep_path = find_module(real_dir, dep)
            if dep_path is None:
                raise ModuleOpError(
                    "probe", name, errno.ENOENT, f"module {dep} not found in modules.dep"
                )
            try:
                if pid is not None:
                    self._open_for_load(Path(dep_path), pid)
                    if dep in self.modules:  # loaded while the open waited: EEXIST, which
                        continue  # kmod takes as success
                self.insert_file(str(dep_path), params if dep == name else ())
            except ModuleOpError as exc:
                if exc.errno == errno.EEXIST:
                    continue
                raise ModuleOpError(
                    "probe", name, exc.errno, f"inserting {dep} from {self.node_path(real_dir)}"
                ) from None
            loaded.append(dep)
        return loaded

    def install_rules(self) -> dict[str, str]:
        rules: dict[str, str] = {}
        d = self.root / "etc/modprobe.d"
        for conf in sorted(d.glob("*.conf")) if d.is_dir() else ():
            with contextlib.suppress(OSError):
                for line in conf.read_text().splitlines():
                    parts = line.split(None, 2)
                    if len(parts) == 3 and parts[0] == "install":
                        rules.setdefault(normalize_module_name(parts[1]), parts[2].strip())
        return rules

    # -- references that are not modules (a mount, an open device) -------------

    def get_module(self, name: str) -> None:
        with self._lock:
            m = self.modules[name]
            m.users += 1
            self._refresh_refcnt(name)

    def put_module(self, name: str) -> None:
        with self._lock:
            m = self.modules[name]
            m.users = max(0, m.users - 1)
            self._refresh_refcnt(name)

    # -- drivers and devices --------------------------------------------------

    def add_pci_device(
        self, pci: str, vendor: str, pci_class: str, attrs: Mapping[str, str] = MappingProxyType({})
    ) -> Path:
        """A PCI function as sysfs shows it: its IDs and ``attrs``, then its link in
        bus/pci/devices (a reader that finds the link finds every attribute). Its directory."""
        dev = self.root / self.PCI_PARENT / pci
        dev.mkdir(parents=True, exist_ok=True)
        self._write(dev / "vendor", vendor + "\n")
        self._write(dev / "class", pci_class + "\n")
        for name, value in attrs.items():
            self._write(dev / name, value + "\n")
        _symlink(
            f"../../../devices/pci0000:00/0000:00:01.0/{pci}",
            self.root / "sys/bus/pci/devices" / pci,
        )
        return dev

    def add_pf(
        self,
        ifname: str,
        pci: str,
        *,
        totalvfs: int = 64,
        driver: str = "mlx5_core",
        vf_delay: Callable[[int], float] | None = None,
        rename_delay: float = 0.8,
        probe_delay: float = 1.0,
        vendor: str = "0x15b3",
    ) -> SimPF:
        """An SR-IOV capable NIC function bound to ``driver`` while that module is live."""
        pf = SimPF(
            ifname,
            pci,
            totalvfs,
            driver,
            vf_delay or (lambda _i: 1.0),
            rename_delay,
            probe_delay,
        )
        self.pfs[ifname] = pf
        sriov = {"sriov_totalvfs": f"{totalvfs}", "sriov_numvfs": "0"}
        dev = self.add_pci_device(pci, vendor, "0x020000", sriov)  # Ethernet
        self._on_live.setdefault(driver, []).append(lambda: self._driver_bound(pf))
        self._on_going.setdefault(driver, []).append(lambda: self._driver_unbound(pf))
        self._write(dev / "sriov_drivers_autoprobe", "1\n")
        if self.is_live(driver):
            self._bind_link(pf.pci, driver)
            self._netdev_add(pf.pci, pf.ifname)
            pf.present = True
        return pf

    def _bind_link(self, pci: str, driver: str | None) -> None:
        """``<device>/driver``: a symlink to the driver, present while one is bound."""
        link = self.root / self.PCI_PARENT / pci / "driver"
        if driver is None:
            self._unlink(link)
        else:
            _symlink(f"../../../bus/pci/drivers/{driver}", link)
            self.version += 1

    def _driver_bound(self, pf: SimPF) -> None:
        gen = pf.generation

        def appear() -> None:
            if pf.generation == gen and self.is_live(pf.driver) and not pf.present:
                with self._lock:
                    pf.present = True
                    self._bind_link(pf.pci, pf.driver)
                    self._netdev_add(pf.pci, pf.ifname)

        self.sched.call_later(pf.probe_delay, appear)

    def _driver_unbound(self, pf: SimPF) -> None:
        self._destroy_vfs(pf)
        if pf.present:
            pf.present = False
            self._netdev_remove(pf.pci, pf.ifname)
        self._bind_link(pf.pci, None)
        pf.generation += 1

    def _netdev_add(self, pci: str, ifname: str) -> None:
        d = self.root / self.PCI_PARENT / pci / "net" / ifname
        d.mkdir(parents=True, exist_ok=True)
        self._write(d / "ifindex", f"{next(self._n) + 2}\n")
        _symlink(f"../../../{pci}", d / "device")
        _symlink(
            f"../../devices/pci0000:00/0000:00:01.0/{pci}/net/{ifname}",
            self.root / "sys/class/net" / ifname,
        )
        self._uevent("add", "net", ifname, f"/devices/pci0000:00/0000:00:01.0/{pci}/net/{ifname}")

    def _netdev_remove(self, pci: str, ifname: str) -> None:
        self._unlink(self.root / "sys/class/net" / ifname)
        self._rmtree(self.root / self.PCI_PARENT / pci / "net" / ifname)
        self._uevent(
            "remove", "net", ifname, f"/devices/pci0000:00/0000:00:01.0/{pci}/net/{ifname}"
        )

    def _pf(self, ifname: str) -> SimPF:
        pf = self.pfs.get(ifname)
        if pf is None:
            raise OSError(errno.ENODEV, f'Cannot find device "{ifname}"')
        return pf

    def write_sriov_numvfs(self, pf_name: str, n: int) -> None:
        """``echo n > /sys/class/net/<pf>/device/sriov_numvfs``; OSError as write(2) fails."""
        pf = self._pf(pf_name)
        with self._lock:
            if not self.is_live(pf.driver) or not pf.present:
                raise OSError(errno.ENOENT, "no driver bound to the PF")
            if not 0 <= n <= pf.totalvfs:
                raise OSError(errno.ERANGE, f"{n} is more than sriov_totalvfs {pf.totalvfs}")
            cur = len(pf.vfs)
            if n == cur:
                return
            if cur and n:
                raise OSError(errno.EBUSY, f"{cur} VFs already enabled; write 0 first")
            self._note(f"sriov_numvfs {pf_name} {n}")
            if n == 0:
                self._destroy_vfs(pf)
                return
            dev = self.root / self.PCI_PARENT / pf.pci
            for i in range(n):
                vf = SimVF(i, pf.vf_pci(i), f"{pf.ifname}v{i}")
                pf.vfs.append(vf)
                vdev = self.root / self.PCI_PARENT / vf.pci
                vdev.mkdir(parents=True, exist_ok=True)
                _symlink(f"../{pf.pci}", vdev / "physfn")
                _symlink(f"../{vf.pci}", dev / f"virtfn{i}")
                _symlink(
                    f"../../../devices/pci0000:00/0000:00:01.0/{vf.pci}",
                    self.root / "sys/bus/pci/devices" / vf.pci,
                )
                self._uevent("add", "pci", vf.pci, f"/devices/pci0000:00/0000:00:01.0/{vf.pci}")
            self._write(dev / "sriov_numvfs", f"{n}\n")
            if not pf.autoprobe:
                return  # VFs without a driver until someone binds them (bind_vf)
            gen = pf.generation
            t = 0.0
            for vf in pf.vfs:  # VF probes run one after another
                t += pf.vf_delay(vf.index)
                self.sched.call_later(t, self._vf_appear(pf, vf, gen))

    def _vf_appear(self, pf: SimPF, vf: SimVF, gen: int) -> Callable[[], None]:
        def appear() -> None:
            if pf.generation != gen:
                return
            with self._lock:
                vf.driver = pf.driver
                self._bind_link(vf.pci, vf.driver)
                vf.netdev = self._free_ethname()
                self._netdev_add(vf.pci, vf.netdev)
            self.sched.call_later(pf.rename_delay, rename)

        def rename() -> None:  # udev gives it its predictable name
            if pf.generation != gen or vf.netdev is None:
                return
            with self._lock:
                old = vf.netdev
                base = self.root / self.PCI_PARENT / vf.pci / "net"
                os.rename(base / old, base / vf.final_name)
                self._unlink(self.root / "sys/class/net" / old)
                _symlink(
                    f"../../devices/pci0000:00/0000:00:01.0/{vf.pci}/net/{vf.final_name}",
                    self.root / "sys/class/net" / vf.final_name,
                )
                vf.netdev = vf.final_name
                self._uevent(
                    "move",
                    "net",
                    vf.final_name,
                    f"/devices/pci0000:00/0000:00:01.0/{vf.pci}/net/{vf.final_name}",
                )

        return appear

    def _free_ethname(self) -> str:
        """The kernel's name for a new netdev: the lowest free ethN."""
        taken = set(os.listdir(self.root / "sys/class/net"))
        return next(f"eth{i}" for i in itertools.count() if f"eth{i}" not in taken)

    def _destroy_vfs(self, pf: SimPF) -> None:
        dev = self.root / self.PCI_PARENT / pf.pci
        for vf in pf.vfs:
            if vf.netdev is not None and vf.netns is None:
                self._netdev_remove(vf.pci, vf.netdev)
            self._unlink(dev / f"virtfn{vf.index}")
            self._unlink(self.root / "sys/bus/pci/devices" / vf.pci)
            self._rmtree(self.root / self.PCI_PARENT / vf.pci)
            self._uevent("remove", "pci", vf.pci, f"/devices/pci0000:00/0000:00:01.0/{vf.pci}")
        pf.vfs = []
        pf.generation += 1
        self._write(dev / "sriov_numvfs", "0\n")

    def vf_netdev(self, pf_name: str, index: int) -> str | None:
        """The VF's interface name as ``ls /sys/class/net/<pf>/device/virtfnN/net/`` shows it."""
        pf = self._pf(pf_name)
        if index >= len(pf.vfs):
            return None
        d = self.root / self.PCI_PARENT / pf.vfs[index].pci / "net"
        names = sorted(os.listdir(d)) if d.is_dir() else []
        return names[0] if names else None

    def set_vf(self, pf_name: str, index: int, **changes: object) -> None:
        """``ip link set <pf> vf <index> mac|vlan|qos|trust|spoofchk|state|*_tx_rate ...``."""
        pf = self._pf(pf_name)
        if not pf.present:
            raise OSError(errno.ENODEV, f'Cannot find device "{pf_name}"')
        if index >= len(pf.vfs):
            raise OSError(errno.EINVAL, f"VF {index} does not exist on {pf_name}")
        bad = set(changes) - set(PF_FIELDS)
        if bad:
            raise ValueError(f"not a VF attribute: {sorted(bad)}")
        vf = pf.vfs[index]
        vf.config = replace(vf.config, **changes)  # type: ignore[arg-type]
        self.version += 1

    def set_link(self, ifname: str, **changes: object) -> None:
        """``ip link set <ifname> mtu|up|address ...`` on a VF netdev."""
        bad = set(changes) - set(LINK_FIELDS)
        if bad:
            raise ValueError(f"not a link attribute: {sorted(bad)}")
        vf = self.host_vf(ifname)
        if vf is None:
            raise OSError(errno.ENODEV, f'Cannot find device "{ifname}"')
        vf.config = replace(vf.config, **changes)  # type: ignore[arg-type]
        self.version += 1

    def host_vf(self, ifname: str) -> SimVF | None:
        """The VF whose netdev is ``ifname`` in the host's network namespace."""
        for pf in self.pfs.values():
            for vf in pf.vfs:
                if vf.netdev == ifname and vf.netns is None:
                    return vf
        return None

    def pf_by_pci(self, pci: str) -> SimPF:
        for pf in self.pfs.values():
            if pf.pci == pci:
                return pf
        raise OSError(errno.ENODEV, f"no PF at {pci}")

    # -- where a VF is: its driver, its netdev's namespace ---------------------------------

    def bind_vf(self, pf_name: str, index: int, driver: str | None = None) -> None:
        """``driver_override`` + ``drivers_probe``: bind a VF (its netdev appears at once).

        ``driver``: the PF's own VF driver by default; ``vfio-pci`` takes the VF
        with no netdev (a VM or DPDK owns it).
        """
        pf = self._pf(pf_name)
        vf = pf.vfs[index]
        with self._lock:
            self._unbind_vf(vf)
            vf.driver = driver or pf.driver
            self._bind_link(vf.pci, vf.driver)
            if vf.driver != "vfio-pci":
                vf.netdev = self._free_ethname()
                self._netdev_add(vf.pci, vf.netdev)
            self._note(f"bind VF{index} {vf.pci} to {vf.driver}")

    def _unbind_vf(self, vf: SimVF) -> None:
        if vf.netdev is not None and vf.netns is None:
            self._netdev_remove(vf.pci, vf.netdev)
        vf.netdev = None
        vf.netns = None
        vf.driver = None
        self._bind_link(vf.pci, None)

    def move_vf_to_netns(self, pf_name: str, index: int, netns: str, ifname: str) -> None:
        """What sriov-cni does at pod attach: the VF's netdev leaves the host namespace."""
        vf = self._pf(pf_name).vfs[index]
        with self._lock:
            if vf.netdev is None or vf.netns is not None:
                raise OSError(errno.ENODEV, f"VF {index} has no host netdev")
            self._netdev_remove(vf.pci, vf.netdev)
            vf.netdev = ifname
            vf.netns = netns

    def vf_configs(self, pf_name: str) -> list[VfConfig]:
        return [vf.config for vf in self._pf(pf_name).vfs]


def _symlink(target: str, link: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(link)
    os.symlink(target, link)
