"""The seeds, end to end on the real Debian 6.1 kernel (QEMU): the kernel-upgrade race.

Seeds 000-002 replayed with built modules and processes that behave as the shipped
containers do (``nodeagent/sim/actors.py`` models the same ones):

- **modules:** an ``ib_core`` in two builds, the inbox one and MOFED's, exporting the
  peer-memory symbol ``ib_register_peer_memory_client`` with different prototypes (so
  different CRCs, as MOFED's and the inbox ``ib_core`` differ); ``mlx5_core``,
  ``ib_uverbs`` and ``mlx5_ib`` in both builds; ``nvidia``; ``nvidia-peermem.ko`` built
  against MOFED's ``ib_core`` and ``nvidia``. The inbox stack is loaded as a node boots
  (PCI enumeration); MOFED's build sits in MOFED's tree, ``/run/mellanox/drivers``;
- **the MOFED container:** a process in its own mount namespace running an
  ``openibd``-like restart in the seeds' order: its flock on ``.lock`` (held to its
  exit), the ready flag removed, the driver build, the host blacklist written, the stack
  unloaded (upper layers first), MOFED's modules inserted from ``updates/``, the
  blacklist removed, the flag written;
- **the GPU driver container:** an overlay root in its own mount namespace, its command
  line ``nvidia-driver init``, its image's module tree holding the kernel's own
  ``ib_core`` (the inbox one) next to ``nvidia.ko`` and ``nvidia-peermem.ko``; its init
  container (``k8s-driver-manager`` v0.9) waits for any ``mlx5_core`` in
  ``/proc/modules``, which the inbox stack satisfies at once; in the real ``init``'s
  order (``gpu-driver-container`` ubuntu22.04/nvidia-driver 825-846, rhel9 872-889) it
  unmounts ``/run/nvidia/driver`` (``_unmount_rootfs``), and after its build runs
  ``modprobe nvidia`` and ``modprobe -a nvidia-peermem`` (``_load_driver``) from its own
  root, mid-restart; a failed load exits it non-zero (the kubelet starts it again, a new
  overlay); only after its loads returned does it ``mount --rbind / /run/nvidia/driver``
  (``_mount_rootfs``), which the host sees through the pod's Bidirectional ``/run/nvidia``
  (a shared mount the container's namespace has a peer of), and its EXIT trap unmounts it
  (``_shutdown``). So the host's ``/run/nvidia/driver`` is an empty mount point while it
  loads, as on a node: the agent finds no ``nvidia-peermem.ko`` there until then;
- **the agent:** the real ``nodeagent run`` process (``guest_agent.py``), the
  peermem-hold component's config, ``--mode enforce``.

The durations of the seeds (minutes of driver builds) are the test's to give: each
container's build lasts until the test says go, at the seeds' relative order (MOFED's
unload done, then the GPU container's load, then MOFED's insert). Where the agent's
part is a held load, the test waits for that hold (the load would wait however long
MOFED's insert took). Each replay is a plain function returning a row: the bench
(``bench/seeds_real.py``) prints the same rows as a table. The upgrade replay's row says
what ``/run/nvidia/driver`` was at the load, after it and after the container's stop
(``driver_root``); with the agent, the gate's notes while the held load went on, and how
long after the root's mount the gate had checked ``nvidia-peermem.ko`` there. The
restart replay's healthy node has the image itself at ``/run/nvidia/driver`` (a driver
container past its ``init``; none runs).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.realkernel.guest_agent import GuestAgent
from tests.realkernel.loaded import kernel_lines, versions
from tests.realkernel.modbuild import KModule
from tests.realkernel.mofed_container import (
    BLACKLIST,
    MOFED_PROLOGUE,
    MOFED_ROOT,
    READY,
    RESTARTS,
    WAIT,
    Mofed,
    start_mofed,
)

from .. import containerroot, waiting
from ..containerroot import Container

PEER_SYM = "ib_register_peer_memory_client"


# The driver pod's volume run-nvidia (hostPath /run/nvidia, mountPropagation: Bidirectional,
# gpu-operator assets/state-driver/0500_daemonset.yaml 111-113) and the root its
# container's _mount_rootfs rbinds under it.
GPU_RUN = Path("/run/nvidia")
GPU_ROOT = GPU_RUN / "driver"


TOP = Path("/tmp/na-seeds")


STACK = ("mlx5_core", "ib_core", "ib_uverbs", "mlx5_ib")  # load order (providers first)


OURS = ("nvidia_peermem", "nvidia", "mlx5_ib", "ib_uverbs", "mlx5_core", "ib_core")  # unload


def _module(name: str, build: str, body: str, uses: tuple[KModule, ...] = ()) -> KModule:
    version = f'MODULE_VERSION("{build}");\n' if build else ""
    src = f'#include <linux/module.h>\n{body}\nMODULE_LICENSE("GPL");\n{version}'
    return KModule(name, {f"{name}.c": src}, uses=uses)


def _init(calls: str) -> str:
    """An init that calls its providers (so it needs them), and an exit (so it unloads)."""
    return (
        f"static int __init m_init(void) {{ return {calls}; }}\n"
        "static void __exit m_exit(void) {}\n"
        "module_init(m_init);\nmodule_exit(m_exit);\n"
    )


def _stack(build: str, peer_args: str) -> dict[str, KModule]:
    """One build of the RDMA stack: its ``ib_core``'s peer-memory symbol has ``peer_args``."""
    ib_core = _module(
        "ib_core",
        build,
        f"int {PEER_SYM}({peer_args}) {{ return 0; }}\nEXPORT_SYMBOL({PEER_SYM});\n"
        "int ib_na_core(void) { return 0; }\nEXPORT_SYMBOL(ib_na_core);\n",
    )
    mlx5_core = _module(
        "mlx5_core", build, "int mlx5_na_core(void) { return 0; }\nEXPORT_SYMBOL(mlx5_na_core);\n"
    )
    ib_uverbs = _module(
        "ib_uverbs",
        build,
        "extern int ib_na_core(void);\n"
        "int ib_na_uverbs(void) { return ib_na_core(); }\nEXPORT_SYMBOL(ib_na_uverbs);\n",
        (ib_core,),
    )
    mlx5_ib = _module(
        "mlx5_ib",
        build,
        "extern int ib_na_core(void);\nextern int ib_na_uverbs(void);\n"
        "extern int mlx5_na_core(void);\n"
        + _init("ib_na_core() + ib_na_uverbs() + mlx5_na_core()"),
        (ib_core, ib_uverbs, mlx5_core),
    )
    return {"ib_core": ib_core, "mlx5_core": mlx5_core, "ib_uverbs": ib_uverbs, "mlx5_ib": mlx5_ib}


INBOX = _stack("inbox", "void *client")


MOFED = _stack("mofed", "void *client, void *invalidate")  # MOFED's prototype: another CRC


NVIDIA = _module(
    "nvidia",
    "580.95.05",
    "int nvidia_p2p_get_pages(void) { return 0; }\nEXPORT_SYMBOL(nvidia_p2p_get_pages);\n",
)


PEERMEM = _module(
    "nvidia-peermem",
    "",
    f"extern int {PEER_SYM}(void *client, void *invalidate);\n"
    "extern int nvidia_p2p_get_pages(void);\n"
    + _init(f"{PEER_SYM}((void *)0, (void *)0) + nvidia_p2p_get_pages()"),
    (MOFED["ib_core"], NVIDIA),
)


# The same module built against the inbox ib_core (a GPU image whose nvidia-peermem was
# built before MOFED's headers were there): its __versions name the inbox CRC of the
# peer-memory symbol, which MOFED's ib_core never exports.
PEERMEM_INBOX = _module(
    "nvidia-peermem",
    "",
    f"extern int {PEER_SYM}(void *client);\n"
    "extern int nvidia_p2p_get_pages(void);\n"
    + _init(f"{PEER_SYM}((void *)0) + nvidia_p2p_get_pages()"),
    (INBOX["ib_core"], NVIDIA),
)


PEERMEM_BUILT_AGAINST = {"mofed": PEERMEM, "inbox": PEERMEM_INBOX}


# Module-level, so the host builds them before the boot (modbuild).
BUILDS = (*INBOX.values(), *MOFED.values(), NVIDIA, PEERMEM, PEERMEM_INBOX)


# The GPU driver container's entrypoint, in nvidia-driver init's order (gpu-driver-container
# ubuntu22.04/nvidia-driver 825-846: _unload_driver, _unmount_rootfs, the install,
# _load_driver || exit 1, _mount_rootfs, _wait_for_signal; rhel9 882-889 with _load at
# 872-876): its root unmounted from /run/nvidia/driver at the start (_unmount_rootfs,
# 549-555, the same words), its build lasting until the test says go (stdin closed
# first: it ends without loading), _load_driver's loads as the seed logs them, and only
# after they returned its root rbind-mounted at /run/nvidia/driver (_mount_rootfs,
# 540-546; the host sees it through the Bidirectional /run/nvidia: Node.start_gpu), /sys
# kept out of it as there (runbindable). Its /sys is the runtime's (a privileged pod's):
# mounted first here, as modprobe reads /sys/module/<m>/initstate to skip a module that is
# loaded (without it, it opens and inserts every dependency, the kernel saying EEXIST). A failed
# load exits 1 (rhel9's set -e; ubuntu's `_load_driver || exit 1` does not exit there:
# operators-real-scripts.md, row 2); at every exit the EXIT trap unmounts the root
# (_shutdown, 577-583; the replay unloads no module, as before).
GPU_ENTRY = """#!/bin/sh
RUN_DIR=/run/nvidia
_mount_rootfs() {
  echo "Mounting NVIDIA driver rootfs..."
  mount --make-runbindable /sys
  mount --make-private /sys
  mkdir -p ${RUN_DIR}/driver
  mount --rbind / ${RUN_DIR}/driver
}
_unmount_rootfs() {
  echo "Unmounting NVIDIA driver rootfs..."
  if findmnt -r -o TARGET | grep "${RUN_DIR}/driver" > /dev/null; then
    umount -l -R ${RUN_DIR}/driver
  fi
}
mkdir -p /sys && mount -t sysfs sysfs /sys || exit 1
trap _unmount_rootfs EXIT
_unmount_rootfs
read go || exit 0
/usr/sbin/modprobe nvidia || exit 1
echo "Loading NVIDIA Peer Memory kernel module..."
/usr/sbin/modprobe -a nvidia-peermem 2>&1
rc=$?
echo "modprobe-rc=$rc"
[ "$rc" = 0 ] || exit 1
_mount_rootfs
echo "Done, now waiting for signal"
read x
exit 0
"""


# What the entrypoint runs besides kmod (its image holds them with their libraries).
GPU_TOOLS = ("mount", "umount", "findmnt", "grep", "mkdir")


MOFED_ENTRY = (
    MOFED_PROLOGUE
    + f"""read built || exit 0
say "openibd restart: Unloading HCA driver"
printf 'blacklist mlx5_core\\nblacklist mlx5_ib\\nblacklist ib_core\\n' > {BLACKLIST}
for m in mlx5_ib ib_uverbs mlx5_core ib_core; do
  if grep -q "^$m " /proc/modules; then
    rmmod "$m" 2>&1 || {{ say "Unloading HCA driver: [FAILED]"; exit 1; }}
  fi
done
say "HCA driver unloaded"
read insert || exit 0
say "Loading HCA driver and Access Layer"
for m in mlx5_core mlx5_ib; do
  modprobe -d "$D" "$m" 2>&1 || {{ say "Loading HCA driver and Access Layer: [FAILED]"; exit 1; }}
done
rm -f {BLACKLIST}
say "Loading HCA driver and Access Layer: [  OK  ]"
read flag || exit 0
: > "$D/.driver-ready"
say "Setting driver ready state"
read stop
"""
)


def _unload_ours() -> None:
    for _ in range(3):  # a holder left by an odd state goes first on the next round
        for name in OURS:
            if name in versions():
                subprocess.run(["rmmod", name], capture_output=True)


def _dmesg_count() -> int:
    return len(kernel_lines(0))


def _mounted(path: Path) -> bool:
    """A mount at ``path`` in this (the host's) mount namespace. Not ``os.path.ismount``:
    the self-bind of /run/nvidia is the same file system as /run."""
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(path) for line in f)


def _unmount(path: Path) -> None:
    """Every mount stacked at ``path``, with what is under them (a leftover of a broken run)."""
    for _ in range(8):
        if not _mounted(path):
            return
        subprocess.run(["umount", "-R", "-l", str(path)], capture_output=True)


@dataclass
class Node:
    """The guest as a GPU node: trees, the containers started so far, the kernel log."""

    kver: str
    built: Callable[[KModule], Path]
    lower: Path = TOP / "gpu-image"
    starts: Path = TOP / "starts"
    dmesg_from: int = 0
    gpu: list[tuple[Container, Path]] = field(default_factory=list)
    mofeds: list[Mofed] = field(default_factory=list)

    def boot(self) -> None:
        """The inbox stack loaded, as PCI enumeration loads it; no ready flag (/run is new)."""
        for name in STACK:
            subprocess.run(["insmod", str(self.built(INBOX[name]))], check=True)
        READY.unlink(missing_ok=True)
        BLACKLIST.unlink(missing_ok=True)

    def start_mofed(self) -> Mofed:
        """A MOFED container start (a restart is another start, with its own log)."""
        return start_mofed(MOFED_ENTRY, TOP, self.mofeds)

    def start_gpu(self) -> Container:
        """A driver pod start: its init container's wait (v0.9: any mlx5_core), then the
        driver container, a new overlay, with the host's /run/nvidia bound in as the pod's
        Bidirectional volume: its own ``mount --rbind / /run/nvidia/driver``
        (``_mount_rootfs``) is what puts its root at the host's /run/nvidia/driver, when
        its script gets there. The real propagation rather than the harness rbinding
        ``/proc/<pid>/root`` there from the host's namespace: with the script's own mount
        the root appears when the script gets there (after ``_load_driver`` returned,
        ubuntu22.04 842-843) and goes at its ``_unmount_rootfs`` or EXIT trap, in the
        container's mount namespace as on a node; nothing of it is the harness's timing."""
        until(lambda: "mlx5_core" in versions(), "k8s-driver-manager: an mlx5_core")
        log = TOP / f"gpu-{len(self.gpu)}.log"
        with log.open("wb") as out:
            c = containerroot.start(self.lower, self.starts, bidirectional=GPU_RUN, output=out)
        self.gpu.append((c, log))
        return c

    def stop_gpu(self) -> None:
        """The driver pods stopped (stdin closed: the entrypoint's EXIT trap unmounts)."""
        for c, _log in self.gpu:
            c.stop()

    def driver_root(self) -> str:
        """What the host's /run/nvidia/driver is: "empty" (a mount point, nothing mounted),
        "the container's root" (a running driver container's, the same overlay), or else
        what it holds."""
        if not _mounted(GPU_ROOT):
            n = len(list(GPU_ROOT.iterdir()))
            return "empty" if n == 0 else f"not mounted, {n} entries"
        here = os.stat(GPU_ROOT)
        for c, _log in self.gpu:
            with contextlib.suppress(OSError):
                root = os.stat(f"/proc/{c.pid}/root")
                if (root.st_dev, root.st_ino) == (here.st_dev, here.st_ino):
                    return "the container's root"
        return "mounted, no running container's root"

    def mount_image_root(self) -> None:
        """A node whose driver container finished its init: its root at /run/nvidia/driver
        (``_mount_rootfs``), which the image itself stands for (no container runs)."""
        subprocess.run(["mount", "--rbind", str(self.lower), str(GPU_ROOT)], check=True)

    def gpu_log(self, i: int = -1) -> str:
        return self.gpu[i][1].read_text(errors="replace")

    def kernel_words(self) -> list[str]:
        words = ("nvidia_peermem", "ib_core", "mlx5")
        return [line for line in kernel_lines(self.dmesg_from) if any(w in line for w in words)]


def until(pred: Callable[[], object], what: str) -> None:
    waiting.until(pred, what, WAIT)


def _build_trees(node: Node, peermem: KModule = PEERMEM) -> None:
    """MOFED's tree (its ``updates/``) and the GPU driver image (its tree, with the kernel's
    own ``ib_core``), each with its modules.dep; the host's /run/nvidia a shared mount (the
    pod's Bidirectional volume: the host sees what the container mounts there) with
    /run/nvidia/driver an empty mount point: the container mounts its root there after its
    load (``GPU_ENTRY``), where the agent reads the GPU driver's root from then on."""
    kver, built = node.kver, node.built
    updates = MOFED_ROOT / f"lib/modules/{kver}/updates"
    updates.mkdir(parents=True, exist_ok=True)
    for name, spec in MOFED.items():
        shutil.copy(built(spec), updates / f"{name}.ko")
    subprocess.run(["depmod", "-b", str(MOFED_ROOT), kver], check=True)

    drivers = "kernel/drivers"
    containerroot.driver_image(
        node.lower,
        GPU_ENTRY,
        kver,
        {
            f"{drivers}/video/nvidia.ko": built(NVIDIA),
            f"{drivers}/video/nvidia-peermem.ko": built(peermem),
            f"{drivers}/infiniband/core/ib_core.ko": built(INBOX["ib_core"]),
        },
        [shutil.which(t) or f"/usr/bin/{t}" for t in GPU_TOOLS],
    )
    GPU_ROOT.mkdir(parents=True, exist_ok=True)
    # On a node /run is shared (systemd); the guest's mounts are private: a self-bind of
    # /run/nvidia made shared is the hostPath the kubelet requires for Bidirectional.
    subprocess.run(["mount", "--bind", str(GPU_RUN), str(GPU_RUN)], check=True)
    subprocess.run(["mount", "--make-rshared", str(GPU_RUN)], check=True)


@contextlib.contextmanager
def seed_node(built: Callable[[KModule], Path], peermem: KModule = PEERMEM) -> Iterator[Node]:
    kver = os.uname().release
    for name in OURS:  # a real module of one of these names, left by an earlier test
        assert name not in versions(), f"{name} is loaded before the replay: {versions()}"
    _unmount(GPU_ROOT)
    _unmount(GPU_RUN)
    subprocess.run(["umount", "-R", "-l", str(TOP)], capture_output=True)
    shutil.rmtree(TOP, ignore_errors=True)
    shutil.rmtree(MOFED_ROOT / "lib", ignore_errors=True)
    TOP.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(TOP)], check=True)
    (TOP / "starts").mkdir()
    node = Node(kver, built, dmesg_from=_dmesg_count())
    try:
        _build_trees(node, peermem)
        yield node
    finally:
        node.stop_gpu()
        for mofed in node.mofeds:
            mofed.stop()
        _unload_ours()
        READY.unlink(missing_ok=True)
        BLACKLIST.unlink(missing_ok=True)
        shutil.rmtree(MOFED_ROOT / "lib", ignore_errors=True)
        _unmount(GPU_ROOT)
        _unmount(GPU_RUN)
        subprocess.run(["umount", "-R", "-l", str(TOP)], capture_output=True)


EINVAL_WORDS = "could not insert 'nvidia_peermem': Invalid argument"


def _exited(c: Container) -> int | None:
    return c.proc.poll()


def _load_ended(node: Node, c: Container) -> bool:
    """The driver container's load failed (it exited) or went on (its _mount_rootfs)."""
    log = next(log for x, log in node.gpu if x is c).read_text(errors="replace")
    return _exited(c) is not None or "Done, now waiting" in log


def _held_records(agent: GuestAgent) -> list[dict[str, Any]]:
    return [r for r in agent.records() if r.get("kind") == "held-open"]


def _peermem(agent: GuestAgent) -> dict[str, Any]:
    """status.json's peermem verdict ({} before the first)."""
    return ((agent.status() or {}).get("guards") or {}).get("peermem") or {}


def _gate_notes(agent: GuestAgent) -> list[str]:
    """The peermem verdict's notes (what an open gate rests on)."""
    return [str(n) for n in _peermem(agent).get("notes") or []]


def _abi(agent: GuestAgent) -> dict[str, Any]:
    """The peermem verdict's ABI preflight: ``checked``, ``deferred`` and the rest."""
    return dict((_peermem(agent).get("evidence") or {}).get("abi") or {})


def _gate_since(agent: GuestAgent, ts: float) -> list[str]:
    """The peermem gate's decisions in the timeline from ``ts`` on, each its verdict and
    first reason, a repeat of the one before left out."""
    out: list[str] = []
    for r in agent.records():
        if r.get("kind") != "decision" or r.get("guard") != "peermem" or r.get("ts", 0) < ts:
            continue
        said = str(r.get("verdict")) + "".join(f": {x}" for x in (r.get("reasons") or [])[:1])
        if not out or out[-1] != said:
            out.append(said)
    return out


def _held_count(agent: GuestAgent) -> int:
    """How many opens the hold has held so far (status.json's hold counts)."""
    return int((agent.hold().get("counts") or {}).get("held") or 0)


def peermem_records(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The row's ``held-open`` records of ``nvidia-peermem.ko`` opens."""
    return [r for r in row.get("records", []) if str(r.get("path")).endswith("/nvidia-peermem.ko")]


SEEDS_ORDER = "unloaded"  # the GPU container's load after MOFED's unload (seeds 000-002)
FLAG_PENDING = "inserted"  # after MOFED's insert, before its ready flag


def replay_upgrade(
    built: Callable[[KModule], Path],
    with_agent: bool,
    built_against: str = "mofed",
    load_at: str = SEEDS_ORDER,
) -> dict[str, Any]:
    """Seeds 000-002: after a kernel upgrade MOFED rebuilds and restarts its stack while
    the GPU driver container, released by any mlx5_core, loads nvidia-peermem mid-restart.
    A row: the loads that failed, the driver container's exits, the kernel's and the
    tools' words, what is loaded at the end.

    ``built_against``: the ib_core the GPU image's ``nvidia-peermem.ko`` was built against
    ("mofed": the one MOFED loads; "inbox": the kernel's own, whose CRC of the peer-memory
    symbol MOFED's ib_core never exports). ``load_at``: where the driver container's load
    falls in MOFED's restart: after its unload (``SEEDS_ORDER``: the container's
    ``modprobe`` finds no ib_core and opens its image's first) or after its insert and
    before its ready flag (``FLAG_PENDING``: MOFED's ib_core live, ``modprobe`` opens
    ``nvidia-peermem.ko`` alone)."""
    seed = "000-002 kernel upgrade"
    if built_against != "mofed":
        seed += f", peermem built against the {built_against} ib_core"
    if load_at != SEEDS_ORDER:
        seed += ", loaded between MOFED's insert and its flag"
    row: dict[str, Any] = {"seed": seed, "agent": with_agent}
    agent = GuestAgent() if with_agent else None
    with seed_node(built, PEERMEM_BUILT_AGAINST[built_against]) as node:
        try:
            node.boot()
            if agent is not None:
                agent.start()
            mofed = node.start_mofed()
            gpu = node.start_gpu()
            if agent is not None:  # the driver's build outlasts the agent's /proc poll
                agent.until(
                    lambda: any(
                        r.get("pid") == gpu.pid for r in agent.hold().get("container_roots", [])
                    ),
                    "the agent marked the driver container's root",
                )
            mofed.step()  # MOFED's build done: blacklist, unload
            until(
                lambda: mofed.said("HCA driver unloaded") or mofed.proc.poll() is not None, "unload"
            )
            assert mofed.said("HCA driver unloaded"), mofed.log.read_text()
            if load_at == FLAG_PENDING:
                mofed.step()  # MOFED inserts its stack (its flag still to come)
                until(
                    lambda: mofed.said("Access Layer: [  OK  ]") or mofed.proc.poll() is not None,
                    "MOFED's insert",
                )
                assert mofed.said("Access Layer: [  OK  ]"), mofed.log.read_text()
            gpu.send("go")  # the driver's build done: its loads, mid-restart
            if agent is None:
                row["driver_root"] = [f"at the load: {node.driver_root()}"]
                until(lambda: _load_ended(node, gpu), "the driver container's load ended")
            else:
                agent.until(lambda: agent.hold().get("held"), "the driver container's load held")
                row["held"] = [dict(h) for h in agent.hold()["held"]]
                row["driver_root"] = [f"at the load: {node.driver_root()}"]
            notes: set[str] = set()  # the gate's notes while the held load goes on
            held_files: list[dict[str, Any]] = []  # the held files' verdicts, as judged
            flagged_at = time.time()
            if load_at != FLAG_PENDING:
                mofed.step()  # MOFED inserts its stack
            mofed.step()  # ... and writes its flag
            until(
                lambda: mofed.said("Setting driver ready state") or mofed.proc.poll() is not None,
                "MOFED ready",
            )
            row["mofed_ready"] = mofed.said("Setting driver ready state")
            if agent is None:
                for _ in range(RESTARTS):  # CrashLoopBackOff: the kubelet starts it again
                    if not _exited(node.gpu[-1][0]):
                        break  # its load went on (an image built against the inbox ib_core)
                    again = node.start_gpu()
                    again.send("go")
                    until(
                        lambda c=again: _load_ended(node, c),  # type: ignore[misc]
                        "the restarted container's load ended",
                    )
                row["driver_root"].append(f"after the load: {node.driver_root()}")
            else:

                def went_on() -> bool:
                    notes.update(_gate_notes(agent))
                    for h in agent.hold().get("held_files") or []:
                        if h not in held_files:
                            held_files.append(h)
                    return "modprobe-rc=" in node.gpu_log() or _exited(gpu) is not None

                until(went_on, "the held load went on")
                until(
                    lambda: "Done, now waiting" in node.gpu_log() or _exited(gpu) is not None,
                    "the driver container's _mount_rootfs or its exit",
                )
                row["driver_root"].append(f"after the load: {node.driver_root()}")
                if "Done, now waiting" in node.gpu_log():
                    # With the root mounted the gate checks the file there (the ABI
                    # preflight no longer deferred): open on MOFED's ib_core. A mount wakes
                    # no pass: the agent sees it at its next pass (an event, or the resync).
                    mounted_at = time.monotonic()
                    agent.until(
                        lambda: agent.verdict("peermem") == "open" and _abi(agent).get("checked"),
                        "the gate open, nvidia-peermem.ko checked on the mounted root",
                    )
                    row["abi_checked"] = _abi(agent)["checked"]
                    row["abi_checked_after_s"] = round(time.monotonic() - mounted_at, 1)
                # Each held open's record: written by the pass after its release.
                agent.until(
                    lambda: (n := _held_count(agent)) > 0 and len(_held_records(agent)) >= n,
                    "every held open's timeline record",
                )
                row["records"] = _held_records(agent)
                row["held_files"] = held_files
                row["gate_after_release"] = _gate_since(agent, row["records"][0]["ts"])
                row["gate_since_flag"] = _gate_since(agent, flagged_at)
                row["verdict_at_end"] = agent.verdict("peermem")
            logs = [node.gpu_log(i) for i in range(len(node.gpu))]
            row["failed_loads"] = sum(log.count(EINVAL_WORDS) for log in logs)
            row["container_exits"] = sum(1 for c, _ in node.gpu if _exited(c) not in (None, 0))
            row["tool_words"] = sorted(
                {line.strip() for log in logs for line in log.splitlines() if "modprobe: " in line}
            )
            row["kernel_words"] = node.kernel_words()
            loaded = versions()
            row["peermem_loaded"] = "nvidia_peermem" in loaded
            row["ib_core"] = loaded.get("ib_core")
            row["mofed_log"] = mofed.log.read_text(errors="replace").splitlines()
            row["gate_notes"] = sorted(notes)
            node.stop_gpu()
            row["driver_root"].append(f"after the stop: {node.driver_root()}")
        finally:
            if agent is not None:
                row["agent_exit"] = agent.stop()
                row["agent_log_tail"] = agent.tail()
    return row


def replay_restart_over_peermem(
    built: Callable[[KModule], Path], with_agent: bool
) -> dict[str, Any]:
    """Seeds 000-002, the other half: MOFED restarts its stack (a driver upgrade, a pod
    restart) on a healthy node where ``nvidia_peermem`` is loaded and idle; ``openibd``'s
    unload of ``ib_core`` meets it. A row: MOFED's exits and words, what is loaded at the end."""
    row: dict[str, Any] = {"seed": "000-002 MOFED restart, peermem idle", "agent": with_agent}
    agent = GuestAgent() if with_agent else None
    with seed_node(built) as node:
        try:
            # Healthy: MOFED's stack, its flag, nvidia and peermem on MOFED's ib_core, the
            # driver container's root at /run/nvidia/driver (its init done).
            node.mount_image_root()
            subprocess.run(["modprobe", "-d", str(MOFED_ROOT), "mlx5_ib"], check=True)
            READY.write_text("")
            for name in ("nvidia", "nvidia-peermem"):
                subprocess.run(["modprobe", "-d", str(GPU_ROOT), name], check=True)
            if agent is not None:
                agent.start()
                agent.until(lambda: agent.verdict("peermem") == "open", "the gate open")
            for start in range(1 + RESTARTS):
                mofed = node.start_mofed()  # its flag removed: MOFED is restarting
                if agent is not None and start == 0:  # its build lasts minutes on a node
                    until(lambda: "nvidia_peermem" not in versions(), "the idle peermem unloaded")
                mofed.step()  # build done: blacklist, unload
                until(
                    lambda m=mofed: m.said("HCA driver unloaded") or m.proc.poll() is not None,  # type: ignore[misc]
                    "MOFED's unload",
                )
                if mofed.said("HCA driver unloaded"):
                    mofed.step()  # insert
                    mofed.step()  # flag
                    until(lambda m=mofed: m.said("Setting driver ready state"), "MOFED ready")  # type: ignore[misc]
                    break
            row["mofed_exits"] = sum(1 for m in node.mofeds if m.proc.poll() not in (None, 0))
            words = [
                line for m in node.mofeds for line in m.log.read_text(errors="replace").splitlines()
            ]
            row["mofed_words"] = [
                w for w in words if "rmmod" in w or "[FAILED]" in w or "ready state" in w
            ]
            row["mofed_ready"] = any("Setting driver ready state" in w for w in words)
            if agent is not None:
                agent.until(lambda: "nvidia_peermem" in versions(), "the agent loaded peermem back")
            loaded = versions()
            row["peermem_loaded"] = "nvidia_peermem" in loaded
            row["ib_core"] = loaded.get("ib_core")
        finally:
            if agent is not None:
                row["agent_exit"] = agent.stop()
                row["agent_log_tail"] = agent.tail()
    return row
