"""Plan latency: a MOFED restart's protective steps while another guard's slow work is in flight.

When a MOFED restart begins, the agent must unload an idle ``nvidia_peermem``
and withdraw ``run/nodeagent/peermem.gate`` at once. This measures, from
outside, how long both take when some other step is slow at that moment:

    .venv/bin/python bench/plan_latency.py [--trials 100] [--scenario NAME ...] [--max-wait 40]

Scenarios (the slow step; durations are options):

- ``none``: nothing in flight.
- ``storage-reload-blocked``: the storage guard loading back a storage module it
  removed (``ib_iser``), its load call blocked 30 s. The removal is triggered by a
  ``storage.pending_markers`` file, so MOFED's ready flag, and with it the peermem
  gate, stay open and published while the load-back is in flight.
- ``modprobe-hangs``: the same load-back through the real ``ModprobeTools``
  (kmod.py), whose ``modprobe`` is a script here that hangs until released: only
  ModprobeTools' own timeout (300 s) would end it.
- ``vf-restores``: 64 VF restores (8 netlink writes each, 0.5 s per write) after
  ``sriov_numvfs`` went to 0 and back, through a fake ``SriovOps``.
- ``numvfs-slow``: the agent's own ``sriov_numvfs`` write taking 10 s.

Each scenario gets a fresh temp host root (bench/gate_latency.py's 250-module node
with 6000-line modules.dep files, plus one SR-IOV PF) and the real agent loop
(``Agent.run`` in a thread, enforce mode, real inotify; the fake kernel pokes a wake
source where a real kernel would send a uevent). A trial starts the slow step, then
at a random offset into it (uniform 0-2 s, seeded) begins a MOFED restart as MOFED
does (takes ``.lock``, visible in the host root's ``proc/locks``, and removes
``.driver-ready``), with ``nvidia_peermem`` loaded and idle and the gate open. It
measures restart -> the module backend's ``remove("nvidia_peermem")`` and restart ->
the gate file no longer reading open (``GateFiles.read``, what ``nodeagent wait``
reads), capped at ``--max-wait``. Until MOFED is ready again it also counts every
publish of the gate file (inotify) and every ``wait`` reading that answers open,
sampled every 50 ms from one sample period after the restart on. A publish is a
violation when the file was written (its mtime) after the ready flag's unlink
began; one written between taking ``.lock`` and that unlink is counted apart: the
peermem gate does not read MOFED's lock. Then it releases
the slow step and brings the node back to ready for the next trial.

Exit 0 whatever the figures (a measurement); 1 when the harness itself fails.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import fcntl
import json
import logging
import math
import os
import random
import select
import shlex
import shutil
import struct
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gate_latency import FLAG, KVER, build_node, sysfs_module

from nodeagent import __version__
from nodeagent.agent import Agent
from nodeagent.config import Config, config_from_mapping
from nodeagent.host.events import Poke
from nodeagent.host.fs import HostRoot
from nodeagent.host.gatefile import GateFiles, GateReading
from nodeagent.host.kmod import ModprobeTools

SCENARIOS = ("none", "storage-reload-blocked", "modprobe-hangs", "vf-restores", "numvfs-slow")
PEERMEM = "nvidia_peermem"
STORAGE_MODULE = "ib_iser"  # a storage module nothing on this node uses (no mounts to name)
LOCK = "run/mellanox/drivers/.lock"
STORAGE_MARKER = "run/nodeagent-bench/storage-pending"  # a storage.pending_markers entry
STATE_DIR = "run/nodeagent"
HOLD_FILE = "etc/modprobe.d/nodeagent-storage-hold.conf"  # the storage guard's default
GATE = f"{STATE_DIR}/peermem.gate"
STATUS = f"{STATE_DIR}/status.json"
PF_PCI, PF_NETDEV = "0000:01:00.0", "enp1s0f0"
PCI = "sys/bus/pci/devices"
SETTLE_S = 0.3  # after the slow step is done: a late publish still lands in the window
HARNESS_WAIT_S = 60.0  # for anything the harness itself waits on


class HarnessError(Exception):
    """The bench could not set the node up as intended (not a figure about the agent)."""


def wait_until(cond: Callable[[], bool], timeout: float, what: str, step: float = 0.005) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise HarnessError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(step)


# -- the slow step ------------------------------------------------------------------------


class SlowStep:
    """One slow call site: armed per trial; a call holds until released or its time is up."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.armed = False
        self.began = threading.Event()
        self.began_at: float | None = None
        self.done = threading.Event()
        self.released = threading.Event()
        self._lock = threading.Lock()

    def arm(self) -> None:
        with self._lock:
            self.began.clear()
            self.done.clear()
            self.released.clear()
            self.began_at = None
            self.armed = True

    def disarm(self) -> None:
        with self._lock:
            self.armed = False
        self.released.set()

    def enter(self) -> bool:
        """Called at the start of the slow call; True when this call is to be slow."""
        with self._lock:
            if not self.armed:
                return False
            if self.began_at is None:
                self.began_at = time.monotonic()
                self.began.set()
            return True

    def hold(self, seconds: float | None = None) -> None:
        self.released.wait(self.seconds if seconds is None else seconds)

    def release(self) -> None:
        self.released.set()


# -- the module backend -------------------------------------------------------------------


class BenchKernel:
    """``ModuleOps`` on the temp sysfs: records removals, pokes a uevent per change."""

    def __init__(self, root: Path, uevents: Poke, slow: SlowStep | None) -> None:
        self.root = root
        self.uevents = uevents
        self.slow = slow  # storage-reload-blocked: every probe holds while armed
        self.removed: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    def removed_since(self, name: str, t0: float) -> float | None:
        with self._lock:
            return next((t for t, n in self.removed if n == name and t >= t0), None)

    def insert_fd(self, fd: int, name: str, params: Sequence[str]) -> None:
        sysfs_module(self.root, name, "C" * 23)
        self.uevents.poke(f"module add {name}")

    def insert_file(self, path: str, params: Sequence[str]) -> None:
        raise AssertionError("the agent loads verified files by descriptor")

    def remove(self, name: str) -> None:
        t = time.monotonic()
        with self._lock:
            self.removed.append((t, name))
        shutil.rmtree(self.root / "sys/module" / name)
        self.uevents.poke(f"module remove {name}")

    def probe(self, name: str, moddir: str, params: Sequence[str] = ()) -> None:
        slow = self.slow
        if slow is not None and slow.enter():
            slow.hold()
            slow.done.set()
        sysfs_module(self.root, name, "D" * 23, note=False)
        self.uevents.poke(f"module add {name}")


# Waits while its hold file exists (or until the bench process is gone), then "loads"
# the module named last on its command line, as modprobe would.
FAKE_MODPROBE = """#!/bin/sh
for a in "$@"; do name="$a"; done
while [ -e '{hold}' ] && kill -0 "$PPID" 2>/dev/null; do sleep 0.05; done
d='{root}/sys/module/'"$name"
mkdir -p "$d/holders" && echo live > "$d/initstate" && echo 0 > "$d/refcnt"
"""


class HangingModprobe(ModprobeTools):
    """The real ``ModprobeTools`` (probe runs the fake ``modprobe`` above); removals and
    descriptor loads go to the bench kernel, which records them."""

    def __init__(
        self, kernel: BenchKernel, bindir: Path, slow: SlowStep, hold: Path, timeout: float
    ) -> None:
        super().__init__(path=f"{bindir}:/usr/bin:/bin", timeout=timeout)
        self.kernel = kernel
        self.slow = slow
        self.hold = hold

    def insert_fd(self, fd: int, name: str, params: Sequence[str]) -> None:
        self.kernel.insert_fd(fd, name, params)

    def remove(self, name: str) -> None:
        self.kernel.remove(name)

    def probe(self, name: str, moddir: str, params: Sequence[str] = ()) -> None:
        slow = self.slow.enter()
        try:
            super().probe(name, moddir, params)
        finally:
            if slow:
                self.slow.done.set()
            self.kernel.uevents.poke(f"module add {name}")


def write_fake_modprobe(bindir: Path, root: Path, hold: Path) -> None:
    bindir.mkdir(parents=True)
    script = bindir / "modprobe"
    script.write_text(FAKE_MODPROBE.format(hold=hold, root=root))
    script.chmod(0o755)


# -- the SR-IOV PF: sysfs and a fake netlink ------------------------------------------------

VF_DEFAULTS: dict[str, Any] = {
    "mac": "00:00:00:00:00:00",
    "vlan": 0,
    "qos": 0,
    "spoofchk": True,
    "trust": False,
    "link_state": "auto",
    "min_tx_rate": 0,
    "max_tx_rate": 0,
}
LINK_DEFAULTS: dict[str, Any] = {"mtu": 1500, "admin_up": False}


def vf_pci(i: int) -> str:
    n = 3 + i
    return f"0000:01:{n // 8:02x}.{n % 8}"


def vf_wanted(i: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The configured VF: PF-side settings, netdev settings (8 netlink writes from defaults)."""
    mac = f"02:00:00:00:{i // 256:02x}:{i % 256:02x}"
    pf = {
        "mac": mac,
        "vlan": 100 + i,
        "qos": i % 8,
        "spoofchk": False,
        "trust": True,
        "link_state": "enable",
        "min_tx_rate": 0,
        "max_tx_rate": 1000 + i,
    }
    return pf, {"mtu": 9000, "admin_up": True, "address": mac}


class FakeNic:
    """One PF with ``n`` VFs: its sysfs under the host root and its netlink state.

    It is also the fake ``SriovOps`` the agent gets: reads are instant; a write
    holds on the slow step while armed (``slow_writes`` / ``slow_numvfs``).
    """

    def __init__(self, root: Path, n: int, uevents: Poke, slow: SlowStep) -> None:
        self.root = root
        self.n = n
        self.uevents = uevents
        self.slow = slow
        self.slow_writes = False
        self.slow_numvfs = False
        self.write_s = slow.seconds
        self.vfs: dict[int, dict[str, Any]] = {}  # PF-side settings per VF index
        self._links: dict[str, dict[str, Any]] = {}
        self.numvfs = 0
        self._ifindex = 100
        self._lock = threading.Lock()
        pf = root / PCI / PF_PCI
        (pf / "net" / PF_NETDEV).mkdir(parents=True)
        (pf / "driver").symlink_to("../../../../bus/pci/drivers/mlx5_core")
        (pf / "sriov_totalvfs").write_text(f"{n}\n")
        (pf / "sriov_numvfs").write_text("0\n")
        self._links[PF_NETDEV] = {"mtu": 1500, "admin_up": True, "address": "02:00:00:00:ff:ff"}
        (root / "var/lib/cni/sriov").mkdir(parents=True)

    def _next_ifindex(self) -> int:
        self._ifindex += 1
        return self._ifindex

    def _apply_numvfs(self, count: int) -> None:
        """As the kernel: VFs destroyed, or created with defaults and fresh netdevs."""
        with self._lock:
            pf = self.root / PCI / PF_PCI
            for i in list(self.vfs):
                (pf / f"virtfn{i}").unlink()
                shutil.rmtree(self.root / PCI / vf_pci(i))
                self._links.pop(f"{PF_NETDEV}v{i}", None)
            self.vfs = {}
            for i in range(count):
                d = self.root / PCI / vf_pci(i)
                netdev = f"{PF_NETDEV}v{i}"
                (d / "net" / netdev).mkdir(parents=True)
                (d / "net" / netdev / "ifindex").write_text(f"{self._next_ifindex()}\n")
                (d / "driver").symlink_to("../../../../bus/pci/drivers/mlx5_core")
                (pf / f"virtfn{i}").symlink_to(f"../{vf_pci(i)}")
                self.vfs[i] = dict(VF_DEFAULTS)
                address = f"aa:00:00:00:{i // 256:02x}:{i % 256:02x}"
                self._links[netdev] = {**LINK_DEFAULTS, "address": address}
            self.numvfs = count
            (pf / "sriov_numvfs").write_text(f"{count}\n")
        self.uevents.poke(f"pci sriov_numvfs {count}")

    def kernel_numvfs(self, count: int) -> None:
        """sriov_numvfs written by someone else (a driver reset, the SR-IOV operator)."""
        self._apply_numvfs(count)

    def configure(self) -> None:
        """Every VF with its wanted config (the node the agent takes its snapshot of)."""
        self._apply_numvfs(self.n)
        with self._lock:
            for i in range(self.n):
                pf, link = vf_wanted(i)
                self.vfs[i].update(pf)
                self._links[f"{PF_NETDEV}v{i}"].update(link)
        self.uevents.poke("pci configured")

    def all_configured(self) -> bool:
        with self._lock:
            if len(self.vfs) != self.n:
                return False
            for i in range(self.n):
                pf, link = vf_wanted(i)
                have = self._links.get(f"{PF_NETDEV}v{i}", {})
                if self.vfs[i] != pf or any(have.get(k) != link[k] for k in ("mtu", "admin_up")):
                    return False
            return True

    def _write(self) -> None:
        if self.slow_writes and self.slow.enter():
            self.slow.hold(self.write_s)

    # SriovOps
    def vf_settings(self, pf_ifname: str) -> dict[int, dict[str, Any]]:
        if pf_ifname != PF_NETDEV:
            raise OSError(19, f"no netdev {pf_ifname!r}")
        with self._lock:
            return {i: dict(s) for i, s in self.vfs.items()}

    def set_vf(self, pf_ifname: str, index: int, values: Mapping[str, Any]) -> None:
        self._write()
        with self._lock:
            if index not in self.vfs:
                raise OSError(19, f"no VF {index}")
            self.vfs[index].update(values)

    def links(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {k: dict(v) for k, v in self._links.items()}

    def set_link(self, ifname: str, name: str, value: Any) -> None:
        self._write()
        with self._lock:
            if ifname not in self._links:
                raise OSError(19, f"no netdev {ifname!r}")
            self._links[ifname][name] = value

    def set_numvfs(self, pf_pci: str, numvfs: int) -> None:
        if self.slow_numvfs and self.slow.enter():
            self.slow.hold()
            self.slow.done.set()
        if numvfs == self.numvfs:
            return  # the kernel: writing the current count is a no-op
        if numvfs and self.numvfs:
            raise OSError(16, "sriov_numvfs: VFs already enabled")  # EBUSY, as the kernel
        self._apply_numvfs(numvfs)


# -- the gate, watched from outside ---------------------------------------------------------

IN_CLOSE_WRITE, IN_MOVED_FROM, IN_MOVED_TO = 0x8, 0x40, 0x80
IN_DELETE = 0x200
_EVENT = struct.Struct("iIII")


class Inotify:
    """A bare inotify descriptor on one directory (ctypes): event names as they happen."""

    def __init__(self, directory: Path, mask: int) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = int(libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC))
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        if libc.inotify_add_watch(self.fd, os.fsencode(directory), mask) < 0:
            err = ctypes.get_errno()
            os.close(self.fd)
            raise OSError(err, f"inotify_add_watch {directory}")

    def read(self) -> list[tuple[int, str]]:
        out: list[tuple[int, str]] = []
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return out
            off = 0
            while off + _EVENT.size <= len(data):
                _wd, mask, _cookie, size = _EVENT.unpack_from(data, off)
                name = data[off + _EVENT.size : off + _EVENT.size + size].rstrip(b"\0")
                out.append((mask, os.fsdecode(name)))
                off += _EVENT.size + size

    def close(self) -> None:
        os.close(self.fd)


@dataclass
class GateTrial:
    """What the watcher saw of the gate between a restart and MOFED ready again."""

    t0: float
    t0_wall: float
    withdrawn_at: float | None = None
    closed_at_restart: bool = False
    went_stale: bool = False  # read closed while the file was still there (3 resyncs old)
    publishes: list[float] = field(default_factory=list)  # seconds after t0
    # of those, published by a pass that began before the restart (its confirmed_at)
    early_passes: int = 0
    # Wall time just before MOFED's unlink of the ready flag: the restart as the peermem
    # gate can see it (it does not read MOFED's .lock, taken a moment earlier).
    flag_wall: float | None = None
    # publishes written (the gate file's mtime) before that: lock taken, flag still there
    before_flag: int = 0
    wait_open: list[float] = field(default_factory=list)  # samples answering open, after t0


class GateWatch:
    """Every publish of the gate file (inotify) and ``wait``'s reading, sampled."""

    def __init__(self, root: Path, sample_s: float) -> None:
        self.gates = GateFiles(HostRoot(str(root)), STATE_DIR)
        self.sample_s = sample_s
        (root / STATE_DIR).mkdir(parents=True, exist_ok=True)
        mask = IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE
        self.inotify = Inotify(root / STATE_DIR, mask)
        self.trial: GateTrial | None = None
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="gate-watch", daemon=True)
        self.thread.start()

    def reading(self) -> GateReading:
        return self.gates.read("peermem", time.time())  # what `nodeagent wait` asks

    def is_open(self) -> bool:
        return self.reading().is_open

    def confirmed_at(self) -> float | None:
        reading = self.gates.read("peermem", time.time())
        return reading.confirmed_at if reading.is_open else None

    def begin(self, t0: float) -> None:
        trial = GateTrial(t0, time.time())
        if not self.is_open():
            trial.withdrawn_at, trial.closed_at_restart = t0, True
        with self.lock:
            self.trial = trial

    def flag_removing(self) -> None:
        with self.lock:
            if self.trial is not None:
                self.trial.flag_wall = time.time()

    def _written_at(self) -> float | None:
        """The gate file's mtime (wall): when the agent wrote the copy renamed into place."""
        try:
            return os.stat(self.gates.host.path(self.gates.rel("peermem"))).st_mtime
        except OSError:
            return None

    def end(self) -> GateTrial:
        with self.lock:
            trial, self.trial = self.trial, None
        assert trial is not None
        return trial

    def _note(self, now: float, reading: GateReading, sample: bool, published: int = 0) -> None:
        is_open = reading.is_open
        with self.lock:
            t = self.trial
            if t is None or now < t.t0:
                return
            if published:
                written = self._written_at()
                if written is not None and t.flag_wall is not None and written < t.flag_wall:
                    t.before_flag += published
                    published = 0
                t.publishes += [now - t.t0] * published
                confirmed = reading.confirmed_at  # of the last one, if it is still there
                t.early_passes += confirmed is not None and confirmed < t.t0_wall
            if not is_open and t.withdrawn_at is None:
                t.withdrawn_at = now
                t.went_stale = reading.confirmed_at is not None
            # From one sample period after the restart on: the agent's own reaction
            # time (a few ms) is what the withdrawal latency measures.
            if sample and is_open and now >= t.t0 + self.sample_s:
                t.wait_open.append(now - t.t0)

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self.inotify.fd, select.POLLIN)
        next_sample = time.monotonic()
        while not self.stopping.is_set():
            ready = poller.poll(max(0.0, next_sample - time.monotonic()) * 1000)
            now = time.monotonic()
            if ready:
                events = [m for m, name in self.inotify.read() if name == "peermem.gate"]
                if events:
                    # renamed into place (the agent's atomic write) or written in place
                    published = sum(1 for m in events if m & (IN_MOVED_TO | IN_CLOSE_WRITE))
                    self._note(now, self.reading(), False, published)
            if now >= next_sample:
                self._note(now, self.reading(), True)
                next_sample = max(next_sample + self.sample_s, now)

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(2)
        self.inotify.close()


# -- one scenario: a node, the agent, the trials ---------------------------------------------


@dataclass
class Trial:
    offset: float
    unload: float | None  # seconds; None: not seen within --max-wait
    gate: float | None
    publishes: list[float]
    early_passes: int
    before_flag: int
    wait_open: list[float]
    closed_at_restart: bool
    went_stale: bool
    peermem_absent_at_restart: bool


@dataclass
class NodeSize:
    loaded: int
    dep_lines: dict[str, int]
    vfs: int


class AgentLog(logging.Handler):
    """The agent's warnings and errors, counted (the bench prints a summary, not a stream)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0
        self.first: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        if len(self.first) < 3:
            self.first.append(record.getMessage()[:200])


class Node:
    def __init__(self, root: Path, scenario: str, args: argparse.Namespace) -> None:
        self.root = root
        self.scenario = scenario
        self.args = args
        self.size = self._build()
        self.uevents = Poke()  # stands in for the kernel's uevents (none in a temp dir)
        seconds = {
            "storage-reload-blocked": args.storage_block,
            "vf-restores": args.vf_write,
            "numvfs-slow": args.numvfs_write,
        }.get(scenario, 0.0)
        self.slow = SlowStep(seconds)
        self.kernel = BenchKernel(
            root, self.uevents, self.slow if scenario == "storage-reload-blocked" else None
        )
        self.module_ops: Any = self.kernel
        self.hold = root.parent / "modprobe.hold"
        if scenario == "modprobe-hangs":
            bindir = root.parent / "bin"
            write_fake_modprobe(bindir, root, self.hold)
            self.module_ops = HangingModprobe(
                self.kernel, bindir, self.slow, self.hold, args.modprobe_timeout
            )
        self.nic = FakeNic(root, args.vfs, self.uevents, self.slow)
        self.nic.slow_writes = scenario == "vf-restores"
        self.nic.slow_numvfs = scenario == "numvfs-slow"
        self.nic.configure()
        self.lock_fd: int | None = None
        self.flag_made_at = time.time()
        self.watch = GateWatch(root, args.sample_ms / 1000)
        self.cfg = self._config()
        self.log = AgentLog()
        agent_log = logging.getLogger("nodeagent")
        agent_log.addHandler(self.log)
        agent_log.propagate = False
        self.agent = Agent(
            self.cfg,
            module_ops=self.module_ops,
            kernel_log=lambda m: [],
            wake_sources=[self.uevents],
            guard_ports={"sriov": self.nic},
        )
        self.thread = threading.Thread(target=self.agent.run, name="nodeagent", daemon=True)
        self.thread.start()

    def _build(self) -> NodeSize:
        root = self.root
        loaded, _ = build_node(root, loaded=249)
        sysfs_module(root, STORAGE_MODULE, "E" * 23, note=False)
        mofed_dep = root / f"run/mellanox/drivers/lib/modules/{KVER}/modules.dep"
        with mofed_dep.open("a") as f:
            f.write(f"updates/{STORAGE_MODULE}.ko: updates/ib_core.ko\n")
        (root / FLAG).touch()
        (root / LOCK).touch()
        (root / "proc/1").mkdir(parents=True)
        (root / "proc/1/mountinfo").write_text("")
        (root / "proc/locks").write_text("")
        (root / STORAGE_MARKER).parent.mkdir(parents=True)
        trees = {
            "MOFED": mofed_dep,
            "GPU driver": root / f"run/nvidia/driver/lib/modules/{KVER}/modules.dep",
            "host": root / f"lib/modules/{KVER}/modules.dep",
        }
        lines = {k: len(p.read_text().splitlines()) for k, p in trees.items()}
        return NodeSize(loaded + 1, lines, self.args.vfs)

    def _config(self) -> Config:
        agent_numvfs = self.scenario == "numvfs-slow"
        cfg = config_from_mapping(
            {
                "host_root": str(self.root),
                "mode": "enforce",
                "uevents": False,
                "journal": False,
                "storage": {"pending_markers": [STORAGE_MARKER]},
                "sriov": {
                    "numvfs_owner": "agent" if agent_numvfs else "sriov-operator",
                    "numvfs_grace_seconds": self.args.numvfs_grace,
                },
            }
        )
        if hasattr(cfg, "step_timeout_seconds"):  # plans in per-guard workers (the new agent)
            changes: dict[str, Any] = {"step_timeout_seconds": self.args.step_timeout}
            cfg = dataclasses.replace(cfg, **changes)
        return cfg

    # -- reading the node and the agent's status, from outside -------------------------------

    def status(self) -> dict[str, Any]:
        try:
            doc = json.loads((self.root / STATUS).read_bytes())
        except (OSError, ValueError):
            return {}
        return doc if isinstance(doc, dict) else {}

    def guard(self, name: str) -> dict[str, Any]:
        g = self.status().get("guards", {}).get(name)
        return g if isinstance(g, dict) else {}

    def loaded(self, module: str) -> bool:
        return (self.root / "sys/module" / module).is_dir()

    def pf_phase(self) -> str | None:
        pf = self.guard("sriov").get("evidence", {}).get("pfs", {}).get(PF_PCI) or {}
        phase = pf.get("phase")
        return phase if isinstance(phase, str) else None

    def storage_removed(self) -> list[str]:
        removed = self.guard("storage").get("evidence", {}).get("removed_by_agent")
        return removed if isinstance(removed, list) else []

    def not_ready(self) -> list[str]:
        """What keeps the node from ready: MOFED ready, peermem loaded, its gate open since
        the flag, the storage module back, the VFs configured and the guards settled."""
        confirmed = self.watch.confirmed_at()
        storage = self.guard("storage")
        missing = {
            "gate open since the flag": confirmed is not None and confirmed >= self.flag_made_at,
            "peermem loaded": self.loaded(PEERMEM),
            f"{STORAGE_MODULE} loaded": self.loaded(STORAGE_MODULE),
            # (its evidence's removed_by_agent may lag a pass behind: not asked)
            "storage clear": storage.get("verdict") == "clear",
            "no hold file": not (self.root / HOLD_FILE).exists(),
            "PF stable": self.pf_phase() in ("stable", "restored"),
            "VFs configured": self.nic.all_configured(),
        }
        return [k for k, ok in missing.items() if not ok]

    def wait_ready(self) -> None:
        end = time.monotonic() + HARNESS_WAIT_S
        while missing := self.not_ready():
            if time.monotonic() > end:
                raise HarnessError(f"the node not ready after {HARNESS_WAIT_S:g} s: {missing}")
            time.sleep(0.01)

    # -- MOFED ----------------------------------------------------------------------------

    def restart_begin(self) -> float:
        """As MOFED's entrypoint: take .lock (in the host's /proc/locks), remove the flag."""
        t0 = time.monotonic()
        self.watch.begin(t0)
        fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_EX)
        self.lock_fd = fd
        st = os.fstat(fd)
        where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        line = f"1: FLOCK  ADVISORY  WRITE {os.getpid()} {where} 0 EOF\n"
        self._write_proc_locks(line)
        self.watch.flag_removing()
        (self.root / FLAG).unlink()
        return t0

    def restart_end(self) -> None:
        self.flag_made_at = time.time()
        (self.root / FLAG).touch()
        self._write_proc_locks("")
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None

    def _write_proc_locks(self, text: str) -> None:
        tmp = self.root / "proc/.locks.tmp"
        tmp.write_text(text)
        tmp.replace(self.root / "proc/locks")

    # -- the slow step -------------------------------------------------------------------

    def start_slow(self) -> float | None:
        """Set the node so the scenario's slow step begins; when it began (monotonic)."""
        s = self.scenario
        if s == "none":
            return None
        if s in ("storage-reload-blocked", "modprobe-hangs"):
            wait_until(
                lambda: self.loaded(STORAGE_MODULE) and not self.storage_removed(),
                HARNESS_WAIT_S,
                "the storage guard's status to show nothing removed",
            )
            # Removed on a pending marker (MOFED's flag stays: the gate stays open) ...
            (self.root / STORAGE_MARKER).touch()
            wait_until(
                lambda: (
                    not self.loaded(STORAGE_MODULE)
                    and (self.root / HOLD_FILE).exists()
                    and self.storage_removed() == [STORAGE_MODULE]
                ),
                HARNESS_WAIT_S,
                "the storage guard to remove the storage module (its status saying so)",
            )
            self.slow.arm()
            if s == "modprobe-hangs":
                self.hold.touch()
            # ... and loaded back when the marker goes.
            (self.root / STORAGE_MARKER).unlink()
        elif s == "vf-restores":
            self.nic.kernel_numvfs(0)
            wait_until(
                lambda: self.pf_phase() == "restoring", HARNESS_WAIT_S, "the VF guard to restore"
            )
            self.slow.arm()
            self.nic.kernel_numvfs(self.args.vfs)
        elif s == "numvfs-slow":
            self.slow.arm()
            self.nic.kernel_numvfs(0)  # a driver reset; the agent sets it back
        if not self.slow.began.wait(HARNESS_WAIT_S):
            raise HarnessError(f"{s}: the slow step did not begin")
        assert self.slow.began_at is not None
        return self.slow.began_at

    def release_slow(self) -> None:
        if self.scenario == "modprobe-hangs":
            self.hold.unlink(missing_ok=True)
        self.slow.release()

    def slow_finished(self) -> bool:
        s = self.scenario
        if s in ("storage-reload-blocked", "modprobe-hangs", "numvfs-slow"):
            return self.slow.done.is_set()
        if s == "vf-restores":
            return self.nic.all_configured()
        return True

    # -- a trial -------------------------------------------------------------------------

    def trial(self, rng: random.Random) -> Trial:
        self.wait_ready()
        offset = rng.uniform(0, self.args.offset_max)
        began = self.start_slow()
        start = began if began is not None else time.monotonic()
        time.sleep(max(0.0, start + offset - time.monotonic()))
        peermem_absent = not self.loaded(PEERMEM)
        t0 = self.restart_begin()
        cap = t0 + self.args.max_wait
        wait_until(
            lambda: (
                time.monotonic() > cap
                or (
                    self.kernel.removed_since(PEERMEM, t0) is not None
                    and self.watch.trial is not None
                    and self.watch.trial.withdrawn_at is not None
                )
            ),
            self.args.max_wait + 5,
            "the measurement",
            0.01,
        )
        removed_at = self.kernel.removed_since(PEERMEM, t0)
        with self.watch.lock:
            assert self.watch.trial is not None
            withdrawn_at = self.watch.trial.withdrawn_at
        # Let the slow step go, and wait until the agent has done all it has to.
        self.release_slow()
        wait_until(self.slow_finished, HARNESS_WAIT_S, "the slow step to finish")
        wait_until(
            lambda: not self.loaded(PEERMEM) and not self.watch.is_open(),
            HARNESS_WAIT_S,
            "peermem unloaded and the gate withdrawn after the release",
        )
        time.sleep(SETTLE_S)
        gate = self.watch.end()
        self.slow.disarm()
        self.restart_end()

        def within(t: float | None) -> float | None:
            return None if t is None or t - t0 > self.args.max_wait else t - t0

        return Trial(
            offset=offset,
            unload=None if peermem_absent else within(removed_at),
            gate=within(withdrawn_at),
            publishes=gate.publishes,
            early_passes=gate.early_passes,
            before_flag=gate.before_flag,
            wait_open=gate.wait_open,
            closed_at_restart=gate.closed_at_restart,
            went_stale=gate.went_stale and within(withdrawn_at) is not None,
            peermem_absent_at_restart=peermem_absent,
        )

    def stop(self) -> None:
        self.release_slow()
        self.slow.disarm()
        self.agent.stop()
        self.thread.join(10)
        self.watch.close()
        if self.lock_fd is not None:
            os.close(self.lock_fd)
        logging.getLogger("nodeagent").removeHandler(self.log)
        if self.thread.is_alive():
            raise HarnessError("the agent did not stop within 10 s")


# -- figures -------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    """Nearest rank; a capped trial counts as longer than any measured one."""
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(len(s) * q / 100) - 1))]


def show(v: float, cap: float) -> str:
    if v == float("inf"):
        return f"> {cap:g} s, capped"
    return f"{v * 1000:.1f} ms" if v < 1 else f"{v:.2f} s"


def stats(values: list[float | None], cap: float) -> str:
    vals = [float("inf") if v is None else v for v in values]
    if not vals:
        return "n/a"
    return " / ".join(show(x, cap) for x in (pct(vals, 50), pct(vals, 99), max(vals)))


DESCRIBE = {
    "none": "nothing in flight",
    "storage-reload-blocked": "storage load-back blocked {storage_block:g} s",
    "modprobe-hangs": "real ModprobeTools, its modprobe hangs ({modprobe_timeout:g} s timeout)",
    "vf-restores": "{vfs} VF restores, {vf_write:g} s per netlink write",
    "numvfs-slow": "the agent's sriov_numvfs write taking {numvfs_write:g} s",
}


def report(name: str, trials: list[Trial], args: argparse.Namespace, log: AgentLog) -> None:
    cap = args.max_wait
    what = DESCRIBE[name].format(**vars(args))
    unload = [t.unload for t in trials if not t.peermem_absent_at_restart]
    print(f"\n{name}: {what}; {len(trials)} trials")
    print(f"  restart -> peermem unload    p50 / p99 / max: {stats(unload, cap)}")
    print(f"  restart -> gate withdrawn    p50 / p99 / max: {stats([t.gate for t in trials], cap)}")
    capped_u = sum(1 for v in unload if v is None)
    capped_g = sum(1 for t in trials if t.gate is None)
    if capped_u or capped_g:
        print(f"  capped at {cap:g} s: unload {capped_u}, gate {capped_g} of {len(trials)}")
    pubs = [p for t in trials for p in t.publishes]
    pub_trials = sum(1 for t in trials if t.publishes)
    line = f"  gate published open after the flag was removed: {len(pubs)} (in {pub_trials} trials)"
    if pubs:
        line += f"; at {', '.join(show(p, cap) for p in sorted(pubs)[:5])}"
        line += " ..." if len(pubs) > 5 else ""
        early = sum(t.early_passes for t in trials)
        line += f"; {early} read back with a confirmed_at from before the restart"
    print(line)
    before = sum(t.before_flag for t in trials)
    print(
        f"  gate published between taking .lock and removing the flag: {before} "
        "(the gate does not read MOFED's lock; written before the unlink, by the file's mtime)"
    )
    opens = [w for t in trials for w in t.wait_open]
    open_trials = sum(1 for t in trials if t.wait_open)
    line = f"  wait answered open after restart: {len(opens)} samples (in {open_trials} trials)"
    if opens:
        line += f"; the last {show(max(opens), cap)} after the restart"
    print(line)
    odd = sum(t.closed_at_restart for t in trials), sum(t.peermem_absent_at_restart for t in trials)
    stale = sum(t.went_stale for t in trials)
    if stale:
        print(f"  gate read closed by going stale (3 resyncs), not withdrawn: {stale} trials")
    if any(odd):
        print(f"  gate already closed at the restart: {odd[0]}; peermem not loaded: {odd[1]}")
    if log.count:
        print(f"  agent log: {log.count} warnings/errors, first: {'; '.join(log.first)}")


def run_scenario(name: str, args: argparse.Namespace, header: list[bool]) -> None:
    base = args.tmpdir or ("/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    with tempfile.TemporaryDirectory(prefix="nodeagent-bench-plan-", dir=base) as tmp:
        root = Path(tmp) / "host"
        root.mkdir()
        node = Node(root, name, args)
        try:
            if not header[0]:
                header[0] = True
                print_input(node, tmp)
            rng = random.Random(f"{args.seed}:{name}")
            trials = []
            for i in range(args.trials):
                began = time.monotonic()
                trials.append(node.trial(rng))
                if args.progress:
                    t = trials[-1]
                    print(
                        f"  [{name} {i + 1}/{args.trials}] offset {t.offset:.2f} s, unload "
                        f"{t.unload}, gate {t.gate}; {time.monotonic() - began:.1f} s",
                        file=sys.stderr,
                    )
        finally:
            node.stop()
        report(name, trials, args, node.log)


def print_input(node: Node, tmp: str) -> None:
    s = node.size
    deps = ", ".join(f"{n} ({k})" for k, n in s.dep_lines.items())
    has_timeout = hasattr(node.cfg, "step_timeout_seconds")
    print(
        f"# input: {s.loaded} loaded modules; modules.dep lines: {deps}; "
        f"1 PF with {s.vfs} VFs (8 netlink writes to restore each); host root under {tmp}"
    )
    print(
        "# agent: "
        + (
            f"Config.step_timeout_seconds = {node.args.step_timeout:g} s"
            if has_timeout
            else "Config has no step_timeout_seconds (this agent joins every guard's plan)"
        )
    )
    a = node.args
    print(
        f"# restart: MOFED takes .lock and removes .driver-ready, at U(0, {a.offset_max:g} s) "
        f"into the slow step (seed {a.seed}); each measurement capped at {a.max_wait:g} s"
    )
    print(
        "# gate checks, from the restart until MOFED is ready again: every publish of "
        f"{GATE} (inotify); `nodeagent wait peermem`'s reading every {a.sample_ms:g} ms, "
        f"from {a.sample_ms:g} ms after the restart"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--scenario", action="append", choices=SCENARIOS, help="repeatable; all")
    ap.add_argument("--max-wait", type=float, default=40.0, help="cap per measurement, s")
    ap.add_argument("--offset-max", type=float, default=2.0, help="restart at U(0, this) s")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--storage-block", type=float, default=30.0, help="s the load-back blocks")
    ap.add_argument("--modprobe-timeout", type=float, default=300.0, help="ModprobeTools'")
    ap.add_argument("--vfs", type=int, default=64)
    ap.add_argument("--vf-write", type=float, default=0.5, help="s per netlink write")
    ap.add_argument("--numvfs-write", type=float, default=10.0, help="s for sriov_numvfs")
    ap.add_argument("--numvfs-grace", type=float, default=1.0, help="sriov.numvfs_grace_seconds")
    ap.add_argument("--step-timeout", type=float, default=600.0, help="if the agent has one")
    ap.add_argument("--sample-ms", type=float, default=50.0, help="wait's sampling period")
    ap.add_argument("--tmpdir", default=None, help="where the temp host roots go")
    ap.add_argument("--progress", action="store_true", help="one stderr line per trial")
    args = ap.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    if args.trials < 1 or args.vfs < 1 or args.max_wait <= 0 or args.sample_ms <= 0:
        ap.error("--trials, --vfs, --max-wait and --sample-ms must be positive")
    scenarios = list(dict.fromkeys(args.scenario or SCENARIOS))
    argv0 = [".venv/bin/python", "bench/plan_latency.py"]
    print(f"# command: {shlex.join([*argv0, *(sys.argv[1:] if argv is None else argv)])}")
    print(
        f"# machine: {os.cpu_count()} cpus, python {sys.version.split()[0]}, "
        f"nodeagent {__version__}"
    )
    header = [False]
    try:
        for name in scenarios:
            run_scenario(name, args, header)
    except HarnessError as exc:
        print(f"harness error: {exc}", file=sys.stderr)
        return 1
    except Exception:
        traceback.print_exc()
        print("harness error (above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
