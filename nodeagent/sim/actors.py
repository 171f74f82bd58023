"""The parties that touch the node's modules, replaying what the shipped containers do.

Each actor is a thread on the simulator's virtual clock that reads like the
script it models. The operator containers behave as the shipped ones do in the
node's deployment mode (``node.mode``, ``nodeagent/sim/modes.py``) and know
nothing of nodeagent:

- ``mofed_container``: the Network Operator's MOFED/DOCA driver container
  (clear the ready flag, unload an idle nvidia_peermem, compile in the driver
  toolkit, install, write the blacklist, ``openibd restart``, restore VFs
  serially with a fixed delay and exit on the first VF whose netdev is missing,
  set the ready flag); refuses to start over loaded storage modules unless
  ``UNLOAD_STORAGE_MODULES``;
- ``gpu_driver_container`` (+ its init container ``k8s-driver-manager``, which
  waits once per pod for the ready flag or any ``mlx5_core``, per the mode):
  ``nvidia-driver init`` in its order: unloads nvidia's modules and unmounts
  the previous root from ``/run/nvidia/driver``, builds ``nvidia_peermem``
  against the MOFED headers present at that moment into its own root (the
  runtime's overlay), loads ``nvidia``, ``nvidia_uvm``, ``nvidia_modeset`` and
  then ``nvidia_peermem`` from there with no wait (``driver.rdma.enabled``), and
  only then bind-mounts its root at ``/run/nvidia/driver``; ``_shutdown`` (an
  exit before that, or SIGTERM) unloads and unmounts;
- ``peermem_sidecar``: ``nvidia-peermem-ctr`` (``reload_nvidia_peermem``):
  waits for the ready flag (or ``mlx5_core``) and ``.driver-ctr-ready``, loads
  once, exits 1 on failure; its startup and liveness probes restart it when
  ``mlx5_core`` is loaded and ``nvidia_peermem`` is not;
- ``nfs_mount``: the host mounting an NFS-over-RDMA share.

``Container`` restarts a body that exits, with Kubernetes' back-off: at once,
then 10 s, 20 s, 40 s ... capped at 300 s, reset after 10 minutes of running.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from nodeagent.core.storage import STORAGE_MODULES as STORAGE_NAMES
from nodeagent.host.kmod import ModuleOpError
from nodeagent.sim.clock import Actor
from nodeagent.sim.modtree import (
    GPU_MODULES,
    PEER_MEMORY_API,
    RDMA_MODULES,
    STORAGE_MODULES,
    Generation,
    srcversion_of,
)
from nodeagent.sim.node import BLACKLIST, CTR_READY, GPU_DRIVER_ROOT, LOCK, READY, Node

__all__ = [
    "STORAGE_MODULE_NAMES",
    "Container",
    "ContainerExit",
    "GpuSpec",
    "Killed",
    "MofedSpec",
    "Probe",
    "Terminated",
    "container_root",
    "gpu_driver_container",
    "host_modprobe",
    "mofed_container",
    "nfs_mount",
    "peermem_sidecar",
]

INF = float("inf")
PEERMEM = "nvidia_peermem"
STORAGE_MODULE_NAMES = list(STORAGE_NAMES)  # what MOFED refuses on (the agent's default)
STORAGE_MESSAGE = (
    "Storage modules are loaded for current driver, terminating prior driver reload "
    'failure due to UNLOAD_STORAGE_MODULES not set to "true"'
)
# openibd: upper layers first, ib_core last; then the HCA driver back bottom-up.
UNLOAD_ORDER = [
    "rpcrdma",
    "ib_ipoib",
    "rdma_ucm",
    "ib_umad",
    "mlx5_ib",
    "ib_uverbs",
    "rdma_cm",
    "ib_cm",
    "iw_cm",
    "mlx5_core",
    "ib_core",
]
LOAD_ORDER = ("mlx5_core", "mlx5_ib", "ib_umad", "ib_ipoib", "rdma_ucm")
COMPARED = ("mlx5_core", "mlx5_ib", "ib_core")  # what MOFED compares by srcversion


class ContainerExit(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(f"exit {code}")
        self.code = code


class Terminated(Exception):
    """SIGTERM: the pod is being deleted or replaced."""


class Killed(ContainerExit):
    """kubelet killed the container (a failed probe); it restarts like any exit."""

    def __init__(self, why: str) -> None:
        super().__init__(137)
        self.why = why


@dataclass(frozen=True)
class Probe:
    """A container's startup and liveness probes, as kubelet runs them.

    The startup probe runs every ``startup_period_s`` from ``startup_delay_s``
    until it succeeds (``startup_failures`` failures kill the container); then
    the liveness probe runs every ``live_period_s`` and one failure kills it.
    """

    check: Callable[[], str | None]  # None: success; else the probe's output
    startup_delay_s: float = 10.0
    startup_period_s: float = 10.0
    startup_failures: int = 120
    live_period_s: float = 30.0


def tool_error(exc: ModuleOpError) -> str:
    """What kmod's modprobe prints for a failed insert."""
    if exc.errno == errno.ENOENT and "not found" in (exc.detail or ""):
        return f"modprobe: FATAL: Module {exc.module} not found"
    reason = {
        errno.ENOENT: "Unknown symbol in module, or unknown parameter (see dmesg)",
        errno.EINVAL: "Invalid argument",
        errno.ENOEXEC: "Exec format error",
        errno.EPERM: exc.detail or "Operation not permitted",
    }.get(exc.errno, exc.detail or "error")
    return f"modprobe: ERROR: could not insert '{exc.module}': {reason}"


@dataclass
class Container:
    """One container with ``restartPolicy: Always`` (see the module doc)."""

    node: Node
    name: str
    column: str
    body: Callable[[Container], None]
    init: Callable[[Container], None] | None = None  # an init container: once per pod
    startup_s: float = 3.0
    restarts: int = 0
    exits: list[tuple[float, int]] = field(default_factory=list)
    state: str = "waiting"
    pod: dict[str, Any] = field(default_factory=dict)  # survives restarts (emptyDir volumes)
    actor: Actor | None = None
    probe: Probe | None = None
    run_id: int = 0  # which start of the container a probe belongs to
    # The pod's other containers: kubelet starts them once this pod's init container is done.
    pod_mates: list[Container] = field(default_factory=list)
    # What the runtime makes of each start: a new overlay root reachable at ``rootfs``
    # (host-relative; the GPU driver container's script bind-mounts its own at
    # /run/nvidia/driver itself, late: ``_gpu_body``) and the entrypoint's process, as
    # /proc shows it.
    rootfs: str | None = None
    cmdline: tuple[str, ...] = ()
    # Each start's overlay begins as the image has it: no module tree (a new upper
    # directory); False keeps what is there (a test's tree set up beforehand).
    fresh_root: bool = False

    def start(self, delay: float = 0.0) -> Container:
        self.actor = self.node.sched.spawn(self.name, self._main, delay)
        return self

    def terminate(self) -> None:
        if self.actor is not None:
            self.actor.interrupt(Terminated())

    def say(self, text: str) -> None:
        self.node.emit(self.column, text)

    def _main(self) -> None:
        try:
            if self.init is not None:
                self.state = "init"
                self.init(self)
            for mate in self.pod_mates:
                mate.start()
            in_a_row = 0
            while True:
                self.state = "running"
                started = self.node.now()
                self.run_id += 1
                if self.probe is not None:
                    self.node.sched.spawn(
                        f"{self.name}-probe", functools.partial(self._probe, self.run_id)
                    )
                try:
                    with self._runtime():
                        self.body(self)
                    code = 0
                except ContainerExit as exc:
                    code = exc.code
                if self.node.now() - started >= 600:
                    in_a_row = 0
                delay = 0.0 if in_a_row == 0 else min(300.0, 10.0 * 2 ** (in_a_row - 1))
                in_a_row += 1
                self.exits.append((self.node.now(), code))
                self.state = "CrashLoopBackOff" if delay else "restarting"
                how = f"back-off {delay:.0f}s (CrashLoopBackOff)" if delay else "restarting"
                self.say(f"{self.name} exited {code}; {how}")
                self.node.sleep(delay + self.startup_s)
                self.restarts += 1
                self.say(f"{self.name} restart #{self.restarts}")
        except Terminated:
            self.state = "terminated"
            self.say(f"{self.name} terminated")

    @contextlib.contextmanager
    def _runtime(self) -> Iterator[None]:
        """One start as the container runtime makes it: its root, its process."""
        k = self.node.kernel
        if self.rootfs is not None:
            if self.fresh_root:
                shutil.rmtree(self.node.root / self.rootfs, ignore_errors=True)
                (self.node.root / self.rootfs).mkdir(parents=True)
            k.mount_overlay(self.rootfs)
        pid = None
        if self.cmdline:
            comm = self.cmdline[1 if len(self.cmdline) > 1 else 0].rsplit("/", 1)[-1][:15]
            pid = k.spawn_proc(comm, self.cmdline, self.rootfs or "", self.name)
        try:
            yield
        finally:
            if pid is not None:
                k.exit_proc(pid)
            if self.rootfs is not None:
                k.unmount(self.rootfs)

    def _probe(self, run: int) -> None:
        """kubelet's probes for one start of the container; a failure kills that start."""
        p = self.probe
        assert p is not None
        current = lambda: self.run_id == run and self.state == "running"  # noqa: E731
        self.node.sleep(p.startup_delay_s)
        failures = 0
        while current():
            out = p.check()
            if out is None:
                break
            failures += 1
            if failures >= p.startup_failures:
                self._kill(f"Startup probe failed: {out}")
                return
            self.node.sleep(p.startup_period_s)
        while current():
            self.node.sleep(p.live_period_s)
            if not current():
                return
            out = p.check()
            if out is not None:
                self._kill(f"Liveness probe failed: {out}")
                return

    def _kill(self, why: str) -> None:
        self.say(f"{self.name}: {why}; kubelet restarts it")
        if self.actor is not None:
            self.actor.interrupt(Killed(why))


# -- MOFED ------------------------------------------------------------------------


@dataclass(frozen=True)
class MofedSpec:
    gen: Generation
    version: str  # e.g. "25.07-0.9.7.0"
    unload_storage: bool = False  # UNLOAD_STORAGE_MODULES
    nfsrdma: bool = False  # ENABLE_NFSRDMA: MOFED builds its own storage modules too
    prestart_s: float = 0.0  # start -> the storage-module check (preStart: CA certificates ...)
    dtk_start_s: float = 7.0
    compile_start_s: float = 10.0
    compile_s: float = 140.0
    install_wait_s: float = 145.0  # compile end -> install (DTK flag poll, the other build)
    install_s: float = 2.0
    unload_gap_s: float = 2.0
    load_gap_s: float = 8.0
    post_load_s: float = 0.0  # HCA loaded -> ready flag (other restore steps)
    vf_restore_start_s: float = 21.0  # numvfs written -> first VF restored (BIND_DELAY_SEC ...)
    vf_restore_s: float = 6.45  # per VF, serially
    vf_link_s: float = 0.6  # within one VF: read its netdev name -> set it


def mofed_container(node: Node, spec: MofedSpec, name: str = "mofed-container") -> Container:
    return Container(node, name, "MOFED", lambda c: _mofed_body(node, spec, c))


def _installed_matches(node: Node, gen: Generation) -> bool:
    for m in COMPARED:
        loaded = node.kernel.module(m)
        if loaded is None or loaded.info.srcversion != srcversion_of(m, gen):
            return False
    return True


MOFED_PID = 4242  # the entrypoint's pid, as proc/locks shows it


def _mofed_body(node: Node, spec: MofedSpec, c: Container) -> None:
    k = node.kernel
    say = c.say
    node.flock(LOCK, MOFED_PID, held=True)  # the entrypoint's flock on .lock, held to exit
    try:
        say("Unsetting driver ready state")
        node.remove(READY)
        if spec.prestart_s:
            node.sleep(spec.prestart_s)
        storage = [m for m in STORAGE_MODULE_NAMES if k.module(m) is not None]
        if storage:
            if not spec.unload_storage:
                say(STORAGE_MESSAGE)
                raise ContainerExit(1)
            for m in storage:
                try:
                    k.remove(m)
                except ModuleOpError as exc:
                    say(f"rmmod: ERROR: {exc}")
                    raise ContainerExit(1) from None
        if not c.pod.get("built"):
            if k.module(PEERMEM) is not None:  # pre-start: only here, long before the restart
                try:
                    k.remove(PEERMEM)
                    say("pre-start: unloaded nvidia_peermem")
                except ModuleOpError as exc:
                    say(f"pre-start: could not unload nvidia_peermem ({exc.detail})")
            say("Awaiting driver toolkit to complete NIC driver build")
            node.dtk_busy = True
            node.sleep(spec.dtk_start_s)
            say("DTK driver build script start")
            node.sleep(spec.compile_start_s)
            say(f"Starting compilation of driver version {spec.version}")
            node.sleep(spec.compile_s)
            node.write_headers(spec.gen, RDMA_MODULES)
            say(f"DTK driver build script end (headers of MOFED {spec.gen.version} in place)")
            node.dtk_busy = False
            c.pod["built"] = True
            node.sleep(spec.install_wait_s)
        say(f"Installing MOFED {spec.version} packages")
        node.install(spec.gen, RDMA_MODULES, "mofed")
        if spec.nfsrdma:
            node.install(spec.gen, STORAGE_MODULES, "mofed")
        node.sleep(spec.install_s)
        if _installed_matches(node, spec.gen):
            say("Driver already loaded (srcversion match): skipping reload")
        else:
            _openibd_restart(node, spec, c)
        node.sleep(spec.post_load_s)
        say(f"Current mlx5_core driver version: {spec.version}; setting driver ready state")
        node.write(READY)
        node.sleep(INF)
    except Terminated:
        say("Terminate event caught: unsetting driver readiness")
        node.remove(READY)
        raise
    finally:
        node.dtk_busy = False
        if node.exists(BLACKLIST):  # the EXIT trap
            node.remove(BLACKLIST)
        node.flock(LOCK, MOFED_PID, held=False)


def _openibd_restart(node: Node, spec: MofedSpec, c: Container) -> None:
    k = node.kernel
    say = c.say
    loaded = k.module("mlx5_core")
    have = loaded.info.srcversion if loaded else None
    say(f"srcversion mismatch (loaded {have}, installed {srcversion_of('mlx5_core', spec.gen)})")
    # MOFED saves only the VFs whose netdev is in the host's namespace: not those
    # moved into a pod, nor those bound to vfio-pci.
    saved = {
        pf.ifname: (
            len(pf.vfs),
            [
                (vf.index, vf.pci, vf.netdev, vf.config)
                for vf in pf.vfs
                if vf.netdev is not None and vf.netns is None
            ],
        )
        for pf in k.pfs.values()
        if pf.vfs
    }
    node.write_blacklist()
    say("openibd restart: Unloading HCA driver")
    for m in UNLOAD_ORDER:
        if k.module(m) is None:
            continue
        try:
            k.remove(m)
        except ModuleOpError as exc:
            say(f"rmmod: ERROR: Module {m} is {exc.detail}; Unloading HCA driver: [FAILED]")
            raise ContainerExit(1) from None
        node.sleep(spec.unload_gap_s)
    say("Loading HCA driver and Access Layer")
    for m in LOAD_ORDER:
        try:
            k.modprobe(m, node.mofed_moddir)
        except ModuleOpError as exc:
            say(f"{tool_error(exc)}; Loading HCA driver and Access Layer: [FAILED]")
            raise ContainerExit(1) from None
        node.sleep(spec.load_gap_s)
    say("Loading HCA driver and Access Layer: [  OK  ]")
    node.remove(BLACKLIST)
    for pf_name, (numvfs, vfs) in saved.items():
        _restore_vfs(node, spec, c, pf_name, numvfs, vfs)


def _restore_vfs(
    node: Node, spec: MofedSpec, c: Container, pf_name: str, numvfs: int, vfs: list[Any]
) -> None:
    """MOFED's restore: serial, a fixed delay instead of waiting, exit on the first failure.

    It saved each VF's MAC, MTU and admin state (not trust, spoofchk, link
    state, VLAN/QoS or rates), and restores exactly those.
    """
    k = node.kernel
    say = c.say
    say(f"restore_sriov_config: {pf_name} up, echo {numvfs} > sriov_numvfs")
    try:
        k.write_sriov_numvfs(pf_name, numvfs)
    except OSError as exc:
        say(f"restore_sriov_config: write sriov_numvfs failed: {exc.strerror}")
        raise ContainerExit(1) from None
    node.sleep(spec.vf_restore_start_s)
    for index, pci, _old_name, cfg in vfs:
        name = k.vf_netdev(pf_name, index)
        if name is None:
            say(
                f"VF{index} {pci}: /sys/class/net/{pf_name}/device/virtfn{index}/net/ not found: "
                '"dev argument required"; VF restore failed, exiting'
            )
            raise ContainerExit(1)
        k.set_vf(pf_name, index, mac=cfg.mac)
        node.sleep(spec.vf_link_s)
        try:
            k.set_link(name, mtu=cfg.mtu, admin_up=cfg.admin_up)
        except OSError:
            say(f'VF{index} {pci}: Cannot find device "{name}"; VF restore failed, exiting')
            raise ContainerExit(1) from None
        say(f"VF{index} {pci} {name}: restored (MAC, MTU, state)")
        node.sleep(spec.vf_restore_s - spec.vf_link_s)


# -- GPU driver -------------------------------------------------------------------


@dataclass(frozen=True)
class GpuSpec:
    gen: Generation
    manager_s: float = 35.0  # k8s-driver-manager: shut down GPU clients, look for the NIC
    poll_s: float = 5.0
    build_s: float = 140.0  # first start: compile in the driver toolkit
    install_s: float = 45.0  # nvidia-installer (rebuilds nvidia-peermem.ko on every start)
    modprobe_gap_s: float = 2.0
    # KERNEL_MODULE_TYPE: "auto" picks the open modules from branch 560 on (580 here).
    kernel_module_type: str = "open"
    driver_version: str = "580.95.05"


NVIDIA_VERSION_FILE = "proc/driver/nvidia/version"


def nvidia_banner(spec: GpuSpec, arch: str) -> str:
    """The first lines of /proc/driver/nvidia/version, as each kind of module prints them."""
    kind = (
        f"Open Kernel Module for {arch}"
        if spec.kernel_module_type == "open"
        else (f"{arch} Kernel Module")
    )
    return (
        f"NVRM version: NVIDIA UNIX {kind}  {spec.driver_version}  Release Build  (sim)\n"
        "GCC version:  gcc version 11.4.1 (GCC)\n"
    )


# Where the runtime's overlay of each start of a container is on the host (CRI-O's
# layout, the seeds' OpenShift; the simulator names it by the container's name, not its id).
def container_root(name: str) -> str:
    return f"var/lib/containers/storage/overlay/{name}/merged"


def gpu_driver_container(node: Node, spec: GpuSpec, name: str = "nvidia-driver-ctr") -> Container:
    # What the nvidia module it builds shows while loaded.
    node.kernel.proc_files["nvidia"] = (NVIDIA_VERSION_FILE, nvidia_banner(spec, node.arch))
    return Container(
        node,
        name,
        "GPU driver",
        lambda c: _gpu_body(node, spec, c),
        init=lambda c: _driver_manager(node, spec, c),
        # The runtime's overlay for each start, new and without a module tree: what the
        # script installs into and its modprobe loads from; the script bind-mounts it at
        # /run/nvidia/driver only after its loads (_gpu_body). Its entrypoint as shipped
        # (command nvidia-driver, args init).
        rootfs=container_root(name),
        fresh_root=True,
        cmdline=("/bin/bash", "/usr/local/bin/nvidia-driver", "init"),
    )


def _mofed_loaded(node: Node) -> bool:
    """What the operators' "MOFED is there" checks look at: the ready flag, or any mlx5_core."""
    if node.mode.manager_waits_for == "mlx5_core":
        return node.kernel.module("mlx5_core") is not None  # a substring match in /proc/modules
    return node.exists(READY)


def _driver_manager(node: Node, spec: GpuSpec, c: Container) -> None:
    c.say("k8s-driver-manager: shutting down GPU clients")
    node.sleep(spec.manager_s)
    if not node.mode.rdma:  # it waits for MOFED only with GPUDirect RDMA enabled
        c.say("k8s-driver-manager: done")
        return
    what = "mlx5_core in /proc/modules" if node.mode.manager_waits_for == "mlx5_core" else READY
    c.say(f"k8s-driver-manager: Mellanox device found at 0000:01:00.0; waiting for {what}")
    while not _mofed_loaded(node):
        node.sleep(spec.poll_s)
    c.say(f"k8s-driver-manager: MOFED found ({what}); done")


# The GPU driver container's entrypoint is NVIDIA/gpu-driver-container's nvidia-driver
# (../shared/operators/gpu-driver-container/, pinned at 06a208c). Line numbers below are
# rhel9/nvidia-driver's (the seeds' RHCOS; its set -e makes a failed peermem load exit)
# and ubuntu22.04/nvidia-driver's where the step is the same.
# ubuntu22.04's rmmod order (472-490). rhel9 lists nvidia before nvidia-peermem (533-541),
# an rmmod that fails on nvidia while nvidia_peermem holds it: not modelled.
GPU_UNLOAD_ORDER = ("nvidia_modeset", "nvidia_uvm", "nvidia_peermem", "nvidia")


def _unload_driver(node: Node, c: Container) -> bool:
    """``_unload_driver`` (rhel9 439-551; ubuntu22.04 388-503): refuses, unloading nothing,
    when any of nvidia's modules has a user other than the rest of them (rhel9 542-545);
    else one ``rmmod`` of those loaded (547-549)."""
    k = node.kernel
    loaded = {m: st for m in GPU_UNLOAD_ORDER if (st := k.module(m)) is not None}
    if not loaded:
        return True
    deps = sum(1 for m in loaded if m != "nvidia")
    nvidia = loaded.get("nvidia")
    if (nvidia is not None and nvidia.refcnt > deps) or any(
        st.refcnt for m, st in loaded.items() if m != "nvidia"
    ):
        c.say("Could not unload NVIDIA driver kernel modules, driver is in use")
        return False
    for m in loaded:
        try:
            k.remove(m)
        except ModuleOpError as exc:  # rmmod's own error (set -e: the script exits)
            c.say(f"rmmod: ERROR: Module {m} is {exc.detail}")
            return False
    return True


def _unmount_rootfs(node: Node, c: Container) -> None:
    """``_unmount_rootfs`` (rhel9 603-608; ubuntu22.04 549-554): ``umount -l -R
    /run/nvidia/driver`` when findmnt lists it."""
    if node.kernel.is_mounted(GPU_DRIVER_ROOT):
        c.say("Unmounting NVIDIA driver rootfs (/run/nvidia/driver)")
        node.kernel.unmount(GPU_DRIVER_ROOT)


def _gpu_body(node: Node, spec: GpuSpec, c: Container) -> None:
    k = node.kernel
    say = c.say
    assert c.rootfs is not None
    own = c.rootfs  # the container's "/": where it installs and what its modprobe reads
    holding = False
    mounted = False

    def shutdown() -> None:
        """``_shutdown`` (rhel9 631-638; ubuntu22.04 577-584): ``_unload_driver`` (which
        first stops nvidia-persistenced, rhel9 447-460) and, only if that worked,
        ``_unmount_rootfs``."""
        nonlocal holding
        if holding and k.module("nvidia") is not None:
            k.put_module("nvidia")
        holding = False
        if _unload_driver(node, c):
            _unmount_rootfs(node, c)

    try:
        # init (rhel9 881-896; ubuntu22.04 790-847): `_unload_driver || exit 1` (890;
        # ubuntu22.04 825), `_unmount_rootfs` (891; 826): the previous start's root, if
        # still bound, goes from /run/nvidia/driver before anything is built.
        if not _unload_driver(node, c):
            raise ContainerExit(1)
        _unmount_rootfs(node, c)
        # _build (rhel9 893 -> 858-871): in the driver toolkit on OpenShift.
        if node.dtk_busy:
            say("Waiting for the driver toolkit (busy with MOFED)")
            while node.dtk_busy:
                node.sleep(spec.poll_s)
        # With GPUDirect RDMA the build links MOFED's headers, as they are right now.
        headers = node.headers() if node.mode.rdma else None
        first = not c.pod.get("built")
        if headers is not None and all(s in headers for s in PEER_MEMORY_API):
            hdr_gen = node.headers_version
            say(
                ("Compiling NVIDIA drivers" if first else "nvidia-installer: rebuilding")
                + f" nvidia-peermem.ko against the MOFED {hdr_gen} headers present now"
            )
            specs = GPU_MODULES
        else:
            say("No MOFED headers: nvidia-peermem.ko not built")
            specs = tuple(s for s in GPU_MODULES if s.name != PEERMEM)
        node.sleep(spec.build_s + spec.install_s if first else spec.install_s)
        node.install(spec.gen, specs, own, against=headers)  # into its own /lib/modules
        c.pod["built"] = True
        # _load (rhel9 873-879): _load_driver (874 -> 393-436; ubuntu22.04 842 -> 348-385),
        # from the container's own tree; /run/nvidia/driver is still empty.
        for m in ("nvidia", "nvidia_uvm", "nvidia_modeset"):  # rhel9 423-425
            k.modprobe(m, node.moddir(own))
            node.sleep(spec.modprobe_gap_s)
        say("Loaded nvidia, nvidia-uvm, nvidia-modeset")
        if node.mode.rdma:  # rhel9 428-433 (ubuntu22.04 377-382): no wait of its own
            say("Loading NVIDIA Peer Memory kernel module: modprobe -a nvidia-peermem")
            try:
                k.modprobe(PEERMEM, node.moddir(own))
            except ModuleOpError as exc:
                say(tool_error(exc))  # set -e: the script exits; its EXIT trap runs
                raise ContainerExit(1) from None
        k.get_module("nvidia")  # _start_daemons (rhel9 435): nvidia-persistenced holds it
        holding = True
        # _mount_rootfs (rhel9 875 -> 585-600; ubuntu22.04 843 -> 540-546): `mount --rbind /
        # /run/nvidia/driver`, only now. The sidecar's chroot loads through it.
        say("Mounting NVIDIA driver rootfs at /run/nvidia/driver")
        k.bind_mount(own, GPU_DRIVER_ROOT)
        mounted = True
        node.write(CTR_READY)
        # _wait_for_signal (rhel9 802-809): `trap - EXIT`; SIGTERM runs `_shutdown`.
        say("Done, now waiting for signal")
        node.sleep(INF)
    except Killed:
        raise  # SIGKILL (a failed probe): no trap runs; a bound root stays bound
    except Terminated:
        # SIGTERM: before _wait_for_signal the trap is `exit 1` (rhel9 855), so the EXIT
        # trap's _shutdown (856); in it, `_shutdown && exit 0` (805). Either way, _shutdown.
        say("Caught signal")
        shutdown()
        raise
    except ContainerExit:
        if not mounted:  # an exit before _wait_for_signal: the EXIT trap (rhel9 856)
            shutdown()
        raise
    finally:
        if holding and k.module("nvidia") is not None:
            k.put_module("nvidia")
        node.remove(CTR_READY)


def peermem_sidecar(node: Node, driver: Container, poll_s: float = 10.0) -> Container | None:
    """nvidia-peermem-ctr (``reload_nvidia_peermem``) in ``driver``'s pod; None when the
    mode has no sidecar. It starts with the pod's containers, after ``k8s-driver-manager``.

    Waits (every 10 s) for MOFED (the ready flag, or ``mlx5_core`` with host
    MOFED) and ``.driver-ctr-ready``; already loaded -> sleeps; else one
    ``chroot /run/nvidia/driver modprobe nvidia-peermem``: success -> sleeps,
    failure -> exit 1. The chroot is the driver container's root as bound at
    ``/run/nvidia/driver`` (rhel9/nvidia-driver 987, ubuntu22.04 936): empty
    until that container's ``_mount_rootfs``, which comes before
    ``.driver-ctr-ready``. Its probes (``probe_nvidia_peermem``) fail while
    ``mlx5_core`` is loaded and ``nvidia_peermem`` is not, which restarts it.
    """
    if not node.mode.rdma:
        return None
    k = node.kernel
    host = node.mode.host_mofed

    def mofed_ready() -> bool:
        return k.module("mlx5_core") is not None if host else node.exists(READY)

    def body(c: Container) -> None:
        if not (mofed_ready() and node.exists(CTR_READY)):
            c.say("nvidia-peermem-ctr: waiting for mellanox ofed and nvidia drivers")
            while not (mofed_ready() and node.exists(CTR_READY)):
                node.sleep(poll_s)
        if k.module(PEERMEM) is not None:
            c.say("nvidia-peermem-ctr: nvidia-peermem module already loaded, skipping modprobe")
            node.sleep(INF)
        try:
            k.modprobe(PEERMEM, node.gpu_moddir)  # the host's run/nvidia/driver
        except ModuleOpError as exc:
            c.say(f"nvidia-peermem-ctr: {tool_error(exc)}")
            c.say("nvidia-peermem-ctr: failed to load nvidia-peermem module")
            raise ContainerExit(1) from None
        c.say("nvidia-peermem-ctr: successfully loaded nvidia-peermem module")
        node.sleep(INF)

    def probe() -> str | None:
        if k.module("mlx5_core") is not None and k.module(PEERMEM) is None:
            return "nvidia-peermem module is not loaded"
        return None

    sidecar = Container(node, "nvidia-peermem-ctr", "GPU driver", body, probe=Probe(probe))
    driver.pod_mates.append(sidecar)
    return sidecar


# -- the host ---------------------------------------------------------------------


def host_modprobe(node: Node, modules: tuple[str, ...], why: str) -> None:
    """The host loading modules (PCI enumeration, a service) from its own tree."""
    loaded = []
    for m in modules:
        try:
            loaded += node.kernel.modprobe(m, node.host_moddir, install_rules=True)
        except ModuleOpError as exc:
            node.emit("kernel", f"{why}: {tool_error(exc)}")
            return
    if loaded:
        node.emit("kernel", f"{why}: loaded {' '.join(loaded)}")


def nfs_mount(node: Node, retry_s: float = 30.0) -> Callable[[], None]:
    """A shared volume mounted over NFS-over-RDMA, retried as the kubelet retries it.

    ``mount -t nfs -o proto=rdma`` makes the kernel load the RDMA transport
    (``rpcrdma`` and its chain) before it connects. On this node the server is
    reached over the fabric, which is up only once MOFED's stack is ready: until
    then the connection fails, the mount is retried, and ``rpcrdma`` stays
    loaded with no user. Once mounted, the mount holds ``rpcrdma`` and ``sunrpc``.
    """

    def body() -> None:
        k = node.kernel
        said = ""
        while True:
            try:
                loaded = k.modprobe("rpcrdma", node.host_moddir, install_rules=True)
                extra = f" (loaded {' '.join(loaded)})" if loaded else ""
                why = "" if node.exists(READY) else f"RDMA connection to the server failed{extra}"
            except ModuleOpError as exc:
                why = tool_error(exc)
            if not why:
                break
            if why != said:  # the kubelet retries quietly; a new reason is worth a line
                node.emit("kernel", f"mount -t nfs -o proto=rdma: {why}; retrying")
                said = why
            node.sleep(retry_s)
        for m in ("rpcrdma", "sunrpc"):
            k.get_module(m)
        node.mount(NFS_MOUNTINFO)
        node.emit("kernel", "NFS-over-RDMA share mounted on /mnt/shared; rpcrdma in use")

    return body


NFS_MOUNTINFO = (
    "812 29 0:61 / /mnt/shared rw,relatime shared:402 - nfs4 10.24.0.5:/shared "
    "rw,vers=4.1,rsize=1048576,wsize=1048576,proto=rdma,port=20049,addr=10.24.0.5"
)
