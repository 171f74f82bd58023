"""The storage guard in the real agent loop on a temp host root: the hold file's life."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nodeagent.agent import Agent
from nodeagent.config import Config
from nodeagent.core.guard import Verdict
from nodeagent.core.storage import LOCK_LOOK_S, LOCK_RELOOK_S
from tests.storage_node import HOLD, LOCK, MOUNTINFO, ROOT_MOUNT, node
from tests.waiting import WAIT, until


class Kernel:
    """Module operations mirrored into the temp sysfs (removal only, as this test needs)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.removed: list[str] = []

    def insert_file(self, path: str, params: object) -> None:
        raise AssertionError("no load expected")

    def probe(self, name: str, moddir: str, params: object = ()) -> None:
        raise AssertionError("no load expected")

    def remove(self, name: str) -> None:
        d = self.root / "sys/module" / name
        for f in ("initstate", "refcnt"):
            (d / f).unlink()
        (d / "holders").rmdir()
        d.rmdir()
        self.removed.append(name)


def storage_pass(root: Path) -> tuple[Verdict, Kernel]:
    """One enforce-mode pass of a fresh agent: the storage verdict, and what it removed."""
    kernel = Kernel(root)
    agent = Agent(
        Config(host_root=str(root), mode="enforce", uevents=False),
        module_ops=kernel,  # type: ignore[arg-type]
        kernel_log=lambda m: [],
    )
    return agent.run_once(["start"]).verdicts["storage"], kernel


def test_the_hold_file_is_written_then_removed_when_the_agent_stops(tmp_path: Path) -> None:
    root = node(tmp_path)
    kernel = Kernel(root)
    agent = Agent(
        Config(host_root=str(root), mode="enforce", uevents=False, resync_seconds=3600),
        module_ops=kernel,  # type: ignore[arg-type]
        kernel_log=lambda m: [],
    )
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        # The removal pass, its plan in the worker, then the pass that absorbs it.
        until(lambda: agent.memory["storage"].holding, "the hold was never taken")
        assert kernel.removed == ["rpcrdma"]
        text = (root / HOLD).read_text()
        assert "install rpcrdma /bin/false" in text and "install xprtrdma /bin/false" in text
        assert agent.memory["storage"].holding
    finally:
        agent.stop()
        thread.join(WAIT)
    assert not thread.is_alive()
    assert not (root / HOLD).exists()  # MOFED is still pending, but the agent is gone


def test_a_stale_hold_file_is_removed_on_the_first_pass(tmp_path: Path) -> None:
    root = node(tmp_path)
    (root / "proc/locks").write_text("")  # MOFED not pending
    (root / HOLD).parent.mkdir(parents=True)
    (root / HOLD).write_text("install rpcrdma /bin/false\n")
    agent = Agent(
        Config(host_root=str(root), mode="enforce", uevents=False),
        module_ops=Kernel(root),  # type: ignore[arg-type]
        kernel_log=lambda m: [],
    )
    result = agent.run_once(["start"])
    assert result.verdicts["storage"].verdict == "clear"
    assert [o.action.describe() for o in result.outcomes] == [f"remove {HOLD}"]
    assert not (root / HOLD).exists()


NVME1 = "sys/class/nvme/nvme1"
PORT1 = "sys/kernel/config/nvmet/ports/1"


def local_controller(root: Path) -> None:
    (root / NVME1).mkdir(parents=True)
    for attr, value in (("transport", "pcie"), ("subsysnqn", "nqn.2014.08.org.nvmexpress:x")):
        (root / NVME1 / attr).write_text(value + "\n")


def tcp_port(root: Path) -> None:
    (root / PORT1 / "subsystems").mkdir(parents=True)
    for attr, value in (
        ("addr_trtype", "tcp"),
        ("addr_traddr", "10.0.0.9"),
        ("addr_trsvcid", "4420"),
    ):
        (root / PORT1 / attr).write_text(value + "\n")


def as_fifo(rel: str) -> Callable[[Path], None]:
    def go(root: Path) -> None:
        (root / rel).unlink()
        os.mkfifo(root / rel)

    return go


def as_directory(rel: str) -> Callable[[Path], None]:
    def go(root: Path) -> None:
        (root / rel).unlink()
        (root / rel).mkdir()

    return go


def garbage(rel: str) -> Callable[[Path], None]:
    def go(root: Path) -> None:
        (root / rel).write_bytes(b"rd\x00ma\n")

    return go


def fifo_for_dir(rel: str) -> Callable[[Path], None]:
    def go(root: Path) -> None:
        shutil.rmtree(root / rel)
        os.mkfifo(root / rel)

    return go


def nothing(root: Path) -> None:
    pass


# module, its users' files (readable), what breaks one, what the reason then names
UNREADABLE_USERS = [
    pytest.param("rpcrdma", nothing, as_fifo(MOUNTINFO), MOUNTINFO, id="mountinfo-fifo"),
    pytest.param("rpcrdma", nothing, as_directory(MOUNTINFO), MOUNTINFO, id="mountinfo-dir"),
    pytest.param(
        "nvme_rdma",
        local_controller,
        as_directory(f"{NVME1}/transport"),
        "NVMe controller nvme1: transport unknown (transport unreadable: is a directory",
        id="nvme-transport-dir",
    ),
    pytest.param(
        "nvme_rdma",
        local_controller,
        as_fifo(f"{NVME1}/transport"),
        "NVMe controller nvme1: transport unknown (transport unreadable: is a FIFO",
        id="nvme-transport-fifo",
    ),
    pytest.param(
        "nvme_rdma",
        local_controller,
        garbage(f"{NVME1}/transport"),
        "transport is 'rd\\x00ma' (not a transport name)",
        id="nvme-transport-garbage",
    ),
    pytest.param(
        "nvme_rdma",
        local_controller,
        fifo_for_dir("sys/class/nvme"),
        "NVMe controllers: sys/class/nvme unreadable: Not a directory",
        id="nvme-class-fifo",
    ),
    pytest.param(
        "nvmet_rdma",
        tcp_port,
        as_fifo(f"{PORT1}/addr_trtype"),
        "NVMe-oF target port 1: transport unknown (addr_trtype unreadable: is a FIFO",
        id="nvmet-trtype-fifo",
    ),
    pytest.param(
        "nvmet_rdma",
        tcp_port,
        as_directory(f"{PORT1}/addr_traddr"),
        "NVMe-oF target port 1: addr_traddr unreadable: is a directory",
        id="nvmet-traddr-dir",
    ),
]


@pytest.mark.parametrize(("module", "lay_out", "break_it", "names"), UNREADABLE_USERS)
@pytest.mark.parametrize("broken", [False, True], ids=["readable", "unreadable"])
def test_an_unreadable_user_source_keeps_the_module_loaded(
    tmp_path: Path,
    module: str,
    lay_out: Callable[[Path], None],
    break_it: Callable[[Path], None],
    names: str,
    broken: bool,
) -> None:
    root = node(tmp_path, module)
    lay_out(root)
    if broken:
        break_it(root)
    verdict, kernel = storage_pass(root)
    if not broken:  # the control: the same node, read cleanly, has the module removed
        assert verdict.verdict == "blocking" and kernel.removed == [module]
        return
    assert (verdict.verdict, verdict.ok, kernel.removed) == ("in-use", False, [])
    assert not (root / HOLD).exists()
    (why,) = [r for r in verdict.reasons if r.startswith(f"cannot tell whether {module}")]
    assert names in why and why.endswith("; not removing")


def symlinked(rel: str) -> Callable[[Path], None]:
    def go(root: Path) -> None:
        real = root / f"{rel}-real"
        (root / rel).rename(real)
        (root / rel).symlink_to(real.name)  # the same locked file, one link away

    return go


MOFED_DIR = "run/mellanox/drivers"
READY = f"{MOFED_DIR}/.driver-ready"


def ready_as(kind: str) -> Callable[[Path], None]:
    """MOFED's lock not held (with it held, MOFED is pending whatever the flag is)."""

    def go(root: Path) -> None:
        (root / "proc/locks").write_text("")
        (root / f"{MOFED_DIR}/flag-real").touch()
        if kind == "symlink":
            (root / READY).symlink_to("flag-real")
        else:
            (root / READY).mkdir()

    return go


# What breaks the agent's reading of MOFED's own markers, and what the reason names.
UNREADABLE_MOFED = [
    pytest.param(symlinked(LOCK), f"{LOCK} is a symlink", id="lock-symlink"),
    pytest.param(as_directory(LOCK), f"{LOCK} is a directory", id="lock-directory"),
    pytest.param(fifo_for_dir(MOFED_DIR), "cannot open its directory", id="mofed-dir-fifo"),
    pytest.param(ready_as("symlink"), f"{READY} is a symlink", id="ready-symlink"),
    pytest.param(ready_as("directory"), f"{READY} is a directory", id="ready-directory"),
]


@pytest.mark.parametrize(("break_it", "names"), UNREADABLE_MOFED)
def test_a_mofed_marker_that_cannot_be_read_is_unknown_never_clear(
    tmp_path: Path, break_it: Callable[[Path], None], names: str
) -> None:
    """MOFED's lock held (the control, read cleanly, removes rpcrdma) but its lock, its
    ready flag or its directory unreadable: whether MOFED is installing cannot be told,
    so nothing is removed and the verdict is ``unknown``, not ``clear``."""
    root = node(tmp_path)
    break_it(root)
    verdict, kernel = storage_pass(root)
    assert (verdict.verdict, verdict.ok, kernel.removed) == ("unknown", False, [])
    assert verdict.reasons[0].startswith("cannot tell whether MOFED is about to install (")
    assert names in verdict.reasons[0]


NFS_RDMA = "120 22 0:52 / /mnt/data rw,relatime shared:60 - nfs4 10.0.0.5:/export {opts}\n"


@pytest.mark.parametrize(
    "opts",
    [
        "rw,vers=4.2,rsize=1048576,proto=rdma,port=20049,addr=10.0.0.5",
        "rw,vers=4.2,proto=rdma6,port=20049,addr=fd00::5",
        "proto=rdma,rw,vers=3",
        "rw,vers=3,PROTO=RDMA",
    ],
    ids=["rdma", "rdma6", "first", "upper-case"],
)
def test_nfs_over_rdma_mounts_of_every_form_are_users(tmp_path: Path, opts: str) -> None:
    root = node(tmp_path)
    (root / MOUNTINFO).write_text(ROOT_MOUNT + NFS_RDMA.format(opts=opts))
    verdict, kernel = storage_pass(root)
    assert (verdict.verdict, kernel.removed) == ("in-use", [])
    assert "NFS-over-RDMA mount /mnt/data (10.0.0.5:/export)" in verdict.reasons[0]


def test_an_nvme_controller_with_a_long_instance_number_is_a_user(tmp_path: Path) -> None:
    root = node(tmp_path, "nvme_rdma")
    ctrl = root / "sys/class/nvme/nvme123456"
    ctrl.mkdir(parents=True)
    (ctrl / "transport").write_text("rdma\n")
    (ctrl / "subsysnqn").write_text("nqn.2014-08.org.example:target\n")
    verdict, kernel = storage_pass(root)
    assert (verdict.verdict, kernel.removed) == ("in-use", [])
    assert "NVMe-oF controller nvme123456" in verdict.reasons[0]


def test_a_mofed_attempt_that_reopens_its_lock_wakes_the_loop_by_its_opening(
    tmp_path: Path,
) -> None:
    """The agent started while MOFED crash-loops on the storage modules: its lock file is
    there (not held between attempts), its ready flag absent, rpcrdma loaded. The next
    attempt opens the lock and takes a flock, which no inotify watch sees (here
    /proc/locks is rewritten: a file no watch covers). Its opening wakes the loop, so the
    chain goes out with nothing else to wake it (the resync is an hour, no poll)."""
    root = node(tmp_path)
    held = (root / "proc/locks").read_text()
    (root / "proc/locks").write_text("")  # between two attempts
    kernel = Kernel(root)
    agent = Agent(
        Config(host_root=str(root), mode="enforce", uevents=False, resync_seconds=3600),
        module_ops=kernel,  # type: ignore[arg-type]
        kernel_log=lambda m: [],
    )
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        until(lambda: agent.passes >= 1 and agent.waiting.is_set(), "the first pass")
        assert kernel.removed == []
        first = agent.passes
        (root / "proc/locks").write_text(held)  # MOFED's next attempt takes its lock...
        fd = os.open(root / LOCK, os.O_RDONLY)  # ...having opened it (gofrs/flock)
        os.close(fd)
        # The pass counts itself once it ends; its plan may run before that (a full run's
        # failure under load: removed, passes still 1).
        until(
            lambda: kernel.removed == ["rpcrdma"] and agent.passes > first,
            "the chain removed by the woken pass",
        )
    finally:
        agent.stop()
        thread.join(WAIT)


def opened_pass(root: Path, seconds_ago: float | None) -> tuple[Verdict, float | None, float]:
    """One pass of a fresh agent whose watch saw MOFED's lock opened ``seconds_ago``:
    the storage verdict, the pass's wake_at and its start."""
    agent = Agent(
        Config(host_root=str(root), mode="enforce", uevents=False, resync_seconds=3600),
        module_ops=Kernel(root),  # type: ignore[arg-type]
        kernel_log=lambda m: [],
    )
    at = None if seconds_ago is None else agent.clock() - seconds_ago
    agent.observer.opened_at = lambda rel: at if rel == LOCK else None
    result = agent.run_once(["start"])
    agent.close()
    return result.verdicts["storage"], result.wake_at, result.started


def test_a_pass_that_comes_before_the_flock_looks_again_briefly(tmp_path: Path) -> None:
    """The opening woke a pass before MOFED's flock: the lock table is read again every
    LOCK_RELOOK_S, and only until LOCK_LOOK_S after the opening."""
    root = node(tmp_path)
    (root / "proc/locks").write_text("")  # opened, not yet flocked
    verdict, wake_at, started = opened_pass(root, 0.05)
    assert verdict.verdict == "clear"
    assert 0.0 < verdict.evidence["lock_opened_seconds_ago"] < LOCK_LOOK_S
    assert wake_at is not None and wake_at <= started + LOCK_RELOOK_S + 0.05
    for seconds_ago in (None, LOCK_LOOK_S + 0.1):  # never seen opened; or a while ago
        verdict, wake_at, _ = opened_pass(root, seconds_ago)
        assert "lock_opened_seconds_ago" not in verdict.evidence
        assert wake_at is None, f"opened {seconds_ago} s ago: a pass is still asked for"


@pytest.mark.parametrize("state", ["no lock file", "flag present", "nothing loaded"])
def test_an_opening_asks_for_no_pass_unless_mofed_has_run_and_not_finished(
    tmp_path: Path, state: str
) -> None:
    """Nodes without MOFED's lock, with MOFED installed, or with no storage module loaded
    pay nothing for an opening: no pass asked for."""
    root = node(tmp_path)
    (root / "proc/locks").write_text("")
    if state == "no lock file":
        (root / LOCK).unlink()
    elif state == "flag present":
        (root / "run/mellanox/drivers/.driver-ready").write_text("")
    else:
        shutil.rmtree(root / "sys/module/rpcrdma")
    verdict, wake_at, _ = opened_pass(root, 0.05)
    assert verdict.verdict == "clear"
    assert "lock_opened_seconds_ago" not in verdict.evidence
    assert wake_at is None


CHAIN_DEPS = ("rdma_cm", "iw_cm", "ib_cm")  # what rpcrdma pulls in, nothing else holding them


class SlowChain(Kernel):
    """Removal mirrored into sysfs (holders too); ``during`` runs inside a removal of
    ``slow`` (the step in flight) before it ends."""

    def __init__(self, root: Path, slow: str, during: Callable[[], None]) -> None:
        super().__init__(root)
        self.slow, self.during = slow, during

    def remove(self, name: str) -> None:
        if name == self.slow:
            self.during()
        for d in (self.root / "sys/module").glob(f"*/holders/{name}"):
            d.rmdir()
            (d.parent.parent / "refcnt").write_text(f"{len(list(d.parent.iterdir()))}\n")
        super().remove(name)


class ForcedPass:
    """Called inside a module operation (the step in flight): forces a pass of the agent
    and waits until one has run."""

    def __init__(self, why: str) -> None:
        self.why, self.passes = why, 0
        self.agent: Agent | None = None

    def attach(self, agent: Agent) -> Agent:
        """Count ``agent``'s passes (its loop calls ``run_pass``)."""
        run_pass = agent.run_pass

        def counted(woken_by: Any = ()) -> Any:
            try:
                return run_pass(woken_by)
            finally:
                self.passes += 1

        agent.run_pass = counted  # type: ignore[method-assign]
        self.agent = agent
        return agent

    def __call__(self) -> None:
        assert self.agent is not None
        seen = self.passes
        self.agent.poke.poke(self.why)
        until(lambda: self.passes > seen, f"no pass ran ({self.why})")


def enforcing_agent(root: Path, kernel: Kernel) -> Agent:
    return Agent(
        Config(host_root=str(root), mode="enforce", uevents=False, resync_seconds=3600),
        module_ops=kernel,  # type: ignore[arg-type]
        kernel_log=lambda m: [],
    )


def chain_node(tmp_path: Path) -> Path:
    """rpcrdma and the chain it pulled in (modules.dep and holders), MOFED pending."""
    root = node(tmp_path)
    holders = {"rdma_cm": ["rpcrdma"], "iw_cm": ["rdma_cm"], "ib_cm": ["rdma_cm"]}
    for name, held_by in holders.items():
        d = root / "sys/module" / name
        (d / "holders").mkdir(parents=True)
        (d / "initstate").write_text("live\n")
        (d / "refcnt").write_text(f"{len(held_by)}\n")
        for h in held_by:
            (d / "holders" / h).mkdir()
    core = "kernel/drivers/infiniband/core"
    dep = root / "lib/modules/6.1.0-test/modules.dep"
    dep.parent.mkdir(parents=True)
    dep.write_text(
        f"kernel/net/sunrpc/xprtrdma/rpcrdma.ko: {core}/rdma_cm.ko {core}/iw_cm.ko "
        f"{core}/ib_cm.ko\n{core}/rdma_cm.ko: {core}/iw_cm.ko {core}/ib_cm.ko\n"
        f"{core}/iw_cm.ko:\n{core}/ib_cm.ko:\n"
    )
    return root


def test_a_pass_during_the_removal_never_supersedes_it(tmp_path: Path) -> None:
    """The removal's own steps wake passes (the hold file's write, each module's going):
    one that comes once the top module is gone decides ``holding`` with nothing to do,
    and that must not stop the removal it belongs to. Before: ``plan-superseded``, and
    ``iw_cm``, ``ib_cm`` left loaded (the notes of issue 51; issue 55)."""
    root = chain_node(tmp_path)
    forced = ForcedPass("test: a pass while rdma_cm goes")  # rpcrdma gone: "holding"
    kernel = SlowChain(root, "rdma_cm", forced)
    agent = forced.attach(enforcing_agent(root, kernel))
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        until(lambda: len(kernel.removed) >= 2 and not agent.workers.busy(), "the removal")
        assert sorted(kernel.removed) == ["ib_cm", "iw_cm", "rdma_cm", "rpcrdma"]
        assert kernel.removed[:2] == ["rpcrdma", "rdma_cm"]
    finally:
        agent.stop()
        thread.join(WAIT)
    assert not thread.is_alive()


class Reloads(SlowChain):
    """Also loads back, into sysfs; ``during`` runs inside each probe before it ends."""

    def __init__(self, root: Path, during: Callable[[], None]) -> None:
        super().__init__(root, "", lambda: None)
        self.probed: list[str] = []
        self.during_probe = during

    def probe(self, name: str, moddir: str, params: object = ()) -> None:
        self.probed.append(name)
        self.during_probe()
        d = self.root / "sys/module" / name
        (d / "holders").mkdir(parents=True)
        (d / "refcnt").write_text("0\n")
        (d / "initstate").write_text("live\n")


def test_the_load_back_is_decided_once_while_passes_come_during_it(tmp_path: Path) -> None:
    """MOFED ready: the hold file goes and rpcrdma is loaded back. The removal of the
    hold file, and a pass forced while the load is in flight, decide from a node where
    rpcrdma is not back yet: the load in flight stands, and is made once."""
    root = node(tmp_path)
    forced = ForcedPass("test: a pass while rpcrdma loads")
    kernel = Reloads(root, forced)
    agent = forced.attach(enforcing_agent(root, kernel))
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        until(lambda: agent.memory["storage"].holding, "the hold was never taken")
        (root / "proc/locks").write_text("")  # MOFED's install ended: its lock let go
        (root / "run/mellanox/drivers/.driver-ready").touch()
        agent.poke.poke("test: MOFED is ready")  # /proc/locks is not watched
        until(lambda: not agent.memory["storage"].removed, "never loaded back")
        assert kernel.probed == ["rpcrdma"] and not (root / HOLD).exists()
    finally:
        agent.stop()
        thread.join(WAIT)
    assert not thread.is_alive()
