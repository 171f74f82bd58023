"""The storage guard against a real kernel: the real chain, a real flock, a real user.

The RDMA storage chain MOFED refuses on is loaded for real; MOFED is marked
pending in the guest's /run by another process holding a real ``flock`` on
``run/mellanox/drivers/.lock`` (the agent reads /proc/locks and never takes
it). One enforce-mode pass must remove every storage module and what of its
chain nothing else needs, in an order the kernel accepts, touching nothing
else, and hold them out with the modprobe.d file (which the real ``modprobe``
then obeys). A real user — an NVMe-oF target port over RDMA in configfs,
which holds ``nvmet_rdma`` — makes the agent refuse, naming the port. When
MOFED is ready (flag created, lock released) the hold file goes and the
chain comes back.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.agent import Agent
from nodeagent.config import Config
from nodeagent.core.actions import UnloadModule
from nodeagent.core.storage import StoragePolicy
from nodeagent.host.fs import HostRoot
from nodeagent.host.kmod import LibKmod
from nodeagent.host.moddep import module_dependencies
from nodeagent.host.observe import Observer
from tests.kobuild import require_tool
from tests.realkernel.loaded import moddir, observed_names
from tests.realkernel.storage_setup import HOLD, LOCK, MOFED, READY, STORAGE, force_back, run

pytestmark = pytest.mark.realkernel

CHAIN = ("rpcrdma", "nvme_rdma", "nvmet_rdma", "ib_isert", "ib_srpt")
STATE = Path("/run/nodeagent/state.json")
PORT = Path("/sys/kernel/config/nvmet/ports/1")
SUBSYS = Path("/sys/kernel/config/nvmet/subsystems/nqn.2026-11.io.nodeagent:storage-test")
HOLDER = "import fcntl, sys, time; f = open(sys.argv[1], 'w'); fcntl.flock(f, fcntl.LOCK_EX); "
HOLDER += "print('locked', flush=True); time.sleep(600)"


@contextlib.contextmanager
def mofed_pending() -> Iterator[subprocess.Popen[str]]:
    """Another process holds a FLOCK on MOFED's lock; the ready flag is absent."""
    MOFED.mkdir(parents=True, exist_ok=True)
    READY.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(LOCK)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def _agent() -> Agent:
    # The guest has no ConnectX: the test's MOFED stand-in is why the guard applies.
    storage = StoragePolicy(enabled=True)
    return Agent(
        Config(host_root="/", mode="enforce", uevents=False, policies={"storage": storage})
    )


@pytest.fixture
def clean() -> Iterator[set[str]]:
    """Fresh agent memory, no hold file, no ready flag; afterwards the modules as before."""
    before = observed_names()
    assert not STORAGE & before
    STATE.unlink(missing_ok=True)
    yield before
    HOLD.unlink(missing_ok=True)
    READY.unlink(missing_ok=True)
    STATE.unlink(missing_ok=True)
    force_back(before)


def test_pending_mofed_removes_the_chain_holds_it_and_loads_it_back(clean: set[str]) -> None:
    require_tool("modprobe")
    before = clean
    lk = LibKmod()
    for name in CHAIN:
        lk.probe(name, moddir())
    loaded = observed_names()
    pulled = loaded - before
    assert set(CHAIN) <= pulled and {"ib_core", "rdma_cm", "sunrpc"} <= pulled

    with mofed_pending() as holder:
        result = _agent().run_once(["test"])
        verdict = result.verdicts["storage"]
        assert verdict.verdict == "blocking", verdict.reasons
        assert f"pid {holder.pid}" in verdict.reasons[0]
        assert all(o.ok for o in result.outcomes), [o.error for o in result.outcomes]
        unloads = [o.action.module for o in result.outcomes if isinstance(o.action, UnloadModule)]
        after = observed_names()
        # Every storage module and what of its chain nothing else needs is gone, in an
        # order the kernel accepted (no EBUSY above), and nothing else was touched.
        assert not STORAGE & after
        assert set(unloads) == loaded - after and set(unloads) <= pulled
        assert before <= after
        # What stays: what an NVMe-rooted node boots from (nvme_core, nvme_fabrics) with
        # their dependencies, and modules no module holds (crypto algorithms the kept ones
        # took a handle on, refcnt > 0 or not): nothing left is held only by removed modules.
        kept = {"nvme", "nvme_core", "nvme_fabrics"} & pulled
        kept |= {d for k in kept for d in module_dependencies(moddir(), k)}
        mods, _ = Observer(HostRoot("/"), Config()).read_loaded_modules()
        left = after - before
        assert kept <= left, (sorted(left), sorted(kept))
        for name in left - kept:
            holders = mods[name].holders
            assert not holders or set(holders) & after, (name, holders, sorted(left))
        # The hold file keeps them out: the host's own modprobe refuses them.
        text = HOLD.read_text()
        assert text.startswith("# Written by nodeagent") and "install rpcrdma /bin/false" in text
        p = subprocess.run(["modprobe", "rpcrdma"], capture_output=True, text=True)
        assert p.returncode != 0 and "rpcrdma" not in observed_names(), p.stderr
        # A second pass while MOFED is still pending: holding, nothing more to do.
        result = _agent().run_once(["test"])
        assert result.verdicts["storage"].verdict == "holding" and result.outcomes == ()

    # MOFED is ready: the lock is released, the flag exists.
    READY.touch()
    result = _agent().run_once(["test"])
    assert result.verdicts["storage"].verdict == "clear"
    assert all(o.ok for o in result.outcomes), [o.error for o in result.outcomes]
    assert not HOLD.exists()
    back = observed_names()
    assert {"rpcrdma", "nvme_rdma", "nvmet_rdma", "ib_isert", "ib_srpt"} <= back


def test_a_real_user_is_refused_and_named(clean: set[str]) -> None:
    before = clean
    lk = LibKmod()
    lk.probe("nvmet_rdma", moddir())
    try:
        SUBSYS.mkdir()
        (SUBSYS / "attr_allow_any_host").write_text("1\n")
        PORT.mkdir()
        (PORT / "addr_trtype").write_text("rdma\n")
        (PORT / "addr_adrfam").write_text("ipv4\n")
        (PORT / "addr_traddr").write_text("0.0.0.0\n")
        (PORT / "addr_trsvcid").write_text("4420\n")
        os.symlink(SUBSYS, PORT / "subsystems" / SUBSYS.name)  # enables the port
        mods, _ = Observer(HostRoot("/"), Config()).read_loaded_modules()
        assert mods["nvmet_rdma"].refcnt and not mods["nvmet_rdma"].holders

        with mofed_pending():
            result = _agent().run_once(["test"])
        verdict = result.verdicts["storage"]
        assert verdict.verdict == "in-use" and not verdict.ok, verdict.reasons
        assert any(
            r.startswith("nvmet_rdma is in use: NVMe-oF target port 1 (rdma 0.0.0.0:4420")
            and SUBSYS.name in r
            for r in verdict.reasons
        ), verdict.reasons
        assert result.outcomes == () and "nvmet_rdma" in observed_names() and not HOLD.exists()
    finally:
        with contextlib.suppress(OSError):
            (PORT / "subsystems" / SUBSYS.name).unlink()
        with contextlib.suppress(OSError):
            PORT.rmdir()
        with contextlib.suppress(OSError):
            SUBSYS.rmdir()
    assert before <= observed_names()


NQN = "nqn.2026-11.io.nodeagent:loopback"
RXE_ADDR = "10.99.0.1"


def test_an_nvme_of_loopback_controller_over_soft_roce_is_refused_by_name(
    clean: set[str],
) -> None:
    """Soft-RoCE (rdma_rxe) on a dummy netdev, an NVMe-oF target over nvmet_rdma and the
    host connected to it over nvme_rdma: the agent refuses, naming the controller."""
    require_tool("ip", "iproute2")
    require_tool("rdma", "iproute2")
    lk = LibKmod()
    for name in ("dummy", "null_blk", "rdma_rxe", "nvmet_rdma", "nvme_rdma"):
        lk.probe(name, moddir())
    subsys = Path("/sys/kernel/config/nvmet/subsystems") / NQN
    port = Path("/sys/kernel/config/nvmet/ports/2")
    ctrl: str | None = None
    try:
        for argv in (
            ("ip", "link", "add", "na_dummy0", "type", "dummy"),
            ("ip", "addr", "add", f"{RXE_ADDR}/24", "dev", "na_dummy0"),
            ("ip", "link", "set", "na_dummy0", "up"),
            ("rdma", "link", "add", "na_rxe0", "type", "rxe", "netdev", "na_dummy0"),
        ):
            p = run(*argv)
            assert p.returncode == 0, (argv, p.stderr)
        subsys.mkdir()
        (subsys / "attr_allow_any_host").write_text("1\n")
        ns = subsys / "namespaces/1"
        ns.mkdir()
        (ns / "device_path").write_text("/dev/nullb0\n")  # null_blk's first device
        (ns / "enable").write_text("1\n")
        port.mkdir()
        for attr, value in (
            ("addr_trtype", "rdma"),
            ("addr_adrfam", "ipv4"),
            ("addr_traddr", RXE_ADDR),
            ("addr_trsvcid", "4420"),
        ):
            (port / attr).write_text(value + "\n")
        os.symlink(subsys, port / "subsystems" / NQN)
        before_ctrls = (
            set(os.listdir("/sys/class/nvme")) if Path("/sys/class/nvme").exists() else set()
        )
        fd = os.open("/dev/nvme-fabrics", os.O_RDWR)  # what `nvme connect` does
        try:
            os.write(fd, f"transport=rdma,traddr={RXE_ADDR},trsvcid=4420,nqn={NQN}".encode())
            reply = os.read(fd, 4096).decode()
        finally:
            os.close(fd)
        ctrl = next(iter(set(os.listdir("/sys/class/nvme")) - before_ctrls))
        assert f"instance={ctrl.removeprefix('nvme')}" in reply, reply
        assert Path(f"/sys/class/nvme/{ctrl}/transport").read_text().strip() == "rdma"
        # The connection holds no reference on nvme_rdma (fabrics drops it once the
        # controller exists): only the controller itself says the module is in use.
        mods, _ = Observer(HostRoot("/"), Config()).read_loaded_modules()
        assert mods["nvme_rdma"].refcnt == 0, mods["nvme_rdma"]

        with mofed_pending():
            result = _agent().run_once(["test"])
        verdict = result.verdicts["storage"]
        assert verdict.verdict == "in-use" and not verdict.ok, verdict.reasons
        assert any(
            r.startswith(f"nvme_rdma is in use: NVMe-oF controller {ctrl} (subsystem {NQN})")
            for r in verdict.reasons
        ), verdict.reasons
        assert result.outcomes == () and {"nvme_rdma", "nvmet_rdma"} <= observed_names()
        assert Path(f"/sys/class/nvme/{ctrl}").exists()
    finally:
        if ctrl is not None:
            with contextlib.suppress(OSError):
                Path(f"/sys/class/nvme/{ctrl}/delete_controller").write_text("1\n")
        with contextlib.suppress(OSError):
            (port / "subsystems" / NQN).unlink()
        with contextlib.suppress(OSError):
            port.rmdir()
        with contextlib.suppress(OSError):
            (subsys / "namespaces/1/enable").write_text("0\n")
        with contextlib.suppress(OSError):
            (subsys / "namespaces/1").rmdir()
        with contextlib.suppress(OSError):
            subsys.rmdir()
        run("rdma", "link", "delete", "na_rxe0")
        run("ip", "link", "del", "na_dummy0")
