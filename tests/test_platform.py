"""The guard platform: declared needs, plans with strategies, the executor table."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from nodeagent.config import Config
from nodeagent.core.actions import Plan, UnloadModule, WriteFile
from nodeagent.core.needs import HOST_TREE, DiskNeed, Needs
from nodeagent.core.snapshot import FileLock
from nodeagent.core.sriov_model import EMPTY_SRIOV, SriovObservation
from nodeagent.guards.registry import GUARDS
from nodeagent.host.act import Actuator, Handler, NodeHands
from nodeagent.host.fs import HostRoot
from nodeagent.host.observe import Observer, Readers
from nodeagent.loop.workers import execute_plan
from tests.waiting import WAIT


@dataclass(frozen=True)
class Ping:
    """An action type no built-in executor knows (as a future netlink action would be)."""

    guard: str
    n: int
    reason: str = "test"

    def describe(self) -> str:
        return f"ping {self.n}"


class PingExecutor:
    """A fake executor: records calls; a step fails when its number is in ``fail``."""

    def __init__(self, fail: set[int] = frozenset(), gate: threading.Barrier | None = None) -> None:
        self.fail = fail
        self.done: list[int] = []
        self.active = 0
        self.peak = 0
        self.lock = threading.Lock()
        self.gate = gate

    def __call__(self, hands: NodeHands) -> PingExecutor:
        return self

    def handlers(self) -> Mapping[type, Handler]:
        return {Ping: self.ping}

    def ping(self, action: Ping) -> None:
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            if self.gate is not None:
                self.gate.wait(WAIT)  # released only when ``bound`` steps are in flight together
            if action.n in self.fail:
                raise OSError(5, "refused")
            with self.lock:
                self.done.append(action.n)
        finally:
            with self.lock:
                self.active -= 1


class NoOps:
    def insert_file(self, path: str, params: Any) -> None:
        raise AssertionError("no module operations here")

    remove = probe = insert_file


def actuator(tmp_path: Path, ex: PingExecutor, *more: Any) -> Actuator:
    return Actuator(HostRoot(tmp_path), NoOps(), lambda m: [], executors=(ex, *more))  # type: ignore[arg-type]


def test_sequence_stops_at_the_first_failure_and_reports_it(tmp_path: Path) -> None:
    ex = PingExecutor(fail={2})
    plan = Plan("g", tuple(Ping("g", n) for n in (1, 2, 3)))  # type: ignore[arg-type]
    outcomes = execute_plan(plan, actuator(tmp_path, ex).perform)[0]
    assert ex.done == [1]
    assert [o.ok for o in outcomes] == [True, False]
    assert outcomes[1].errno == 5 and "ping 2" in (outcomes[1].error or "")


def test_parallel_runs_every_step_with_at_most_bound_at_once(tmp_path: Path) -> None:
    bound = 3
    ex = PingExecutor(fail={4}, gate=threading.Barrier(bound))
    steps = tuple(Ping("vf", n) for n in range(9))
    plan = Plan("vf", steps, "parallel", bound)  # type: ignore[arg-type]
    outcomes = execute_plan(plan, actuator(tmp_path, ex).perform)[0]
    # The barrier only opens with `bound` steps in flight: all nine ran, three at a time.
    assert ex.peak == bound
    assert sorted(ex.done) == [0, 1, 2, 3, 5, 6, 7, 8]
    assert [o.action for o in outcomes] == list(steps)  # outcomes in step order
    assert [o.ok for o in outcomes].count(False) == 1 and not outcomes[4].ok


def test_executor_table_by_action_type(tmp_path: Path) -> None:
    ex = PingExecutor()
    act = actuator(tmp_path, ex)
    assert act.perform(Ping("g", 7)).ok and ex.done == [7]  # type: ignore[arg-type]
    # The built-in executors are not there unless listed; an action without one fails cleanly.
    o = act.perform(UnloadModule("g", "rpcrdma", "test"))
    assert not o.ok and "no executor" in (o.error or "")
    with pytest.raises(ValueError, match="two executors handle Ping"):
        actuator(tmp_path, ex, PingExecutor())


def test_file_executor_writes_atomically_and_refuses_a_symlink(tmp_path: Path) -> None:
    act = Actuator(HostRoot(tmp_path), NoOps(), lambda m: [])  # type: ignore[arg-type]
    assert act.perform(WriteFile("g", "etc/x.conf", "hello\n", "test")).ok
    assert (tmp_path / "etc/x.conf").read_text() == "hello\n"
    (tmp_path / "etc/y.conf").symlink_to(tmp_path / "victim")
    o = act.perform(WriteFile("g", "etc/y.conf", "no\n", "test"))
    assert not o.ok and "symlink" in (o.error or "")
    assert not (tmp_path / "victim").exists()


def test_needs_union_and_derived_watch_dirs() -> None:
    a = Needs(
        modules=frozenset({"a"}),
        files=frozenset({"run/x/.ready"}),
        disk=(DiskNeed("m", ("run/x",)),),
        locks=True,
    )
    b = Needs(
        modules=frozenset({"b"}),
        listings=frozenset({"run/v"}),
        disk=(DiskNeed("m", (HOST_TREE,)), DiskNeed("n", (HOST_TREE,))),
        watch=frozenset({"etc/modprobe.d"}),
        sriov=True,
    )
    u = Needs.union([a, b])
    assert u.modules == {"a", "b"} and u.locks and u.sriov and not u.mounts
    assert [(d.name, d.trees) for d in u.disk] == [("m", ("run/x",)), ("n", (HOST_TREE,))]
    assert u.watch_dirs() == ["etc/modprobe.d", "run/v", "run/x"]


def sysmod(root: Path, name: str, holders: tuple[str, ...] = (), refcnt: int = 0) -> None:
    d = root / "sys/module" / name
    (d / "holders").mkdir(parents=True, exist_ok=True)
    (d / "initstate").write_text("live\n")
    (d / "refcnt").write_text(f"{refcnt}\n")
    for h in holders:
        (d / "holders" / h).symlink_to(f"../../{h}")


@pytest.fixture
def node(tmp_path: Path) -> Path:
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/osrelease").write_text("6.1.0-test\n")
    for i in range(300):
        sysmod(tmp_path, f"unrelated{i}")
    return tmp_path


def test_observer_reads_only_declared_modules(node: Path) -> None:
    sysmod(node, "wanted")
    needs = Needs(modules=frozenset({"wanted", "absent"}))
    snap = Observer(HostRoot(node), Config(host_root=str(node)), needs).observe(1.0)
    assert list(snap.modules) == ["wanted"]


def test_chain_closure_is_holders_up_and_modules_dep_down(node: Path) -> None:
    moddir = node / "lib/modules/6.1.0-test"
    moddir.mkdir(parents=True)
    (moddir / "modules.dep").write_text(
        "kernel/rpcrdma.ko: kernel/rdma_cm.ko kernel/ib_core.ko kernel/sunrpc.ko\n"
        "kernel/rdma_cm.ko: kernel/ib_core.ko\nkernel/ib_core.ko:\nkernel/sunrpc.ko:\n"
        "kernel/top.ko: kernel/rpcrdma.ko\n"
    )
    sysmod(node, "ib_core", holders=("rdma_cm", "rpcrdma", "mlx5_ib"))
    sysmod(node, "rdma_cm", holders=("rpcrdma",))
    sysmod(node, "sunrpc", holders=("rpcrdma", "nfs"))
    sysmod(node, "rpcrdma", holders=("top",))
    sysmod(node, "top")
    sysmod(node, "mlx5_ib")  # holds ib_core, but is not part of the chain: not read
    needs = Needs(chains=frozenset({"rpcrdma", "nvme_rdma"}), chain_trees=(HOST_TREE,))
    snap = Observer(HostRoot(node), Config(host_root=str(node)), needs).observe(1.0)
    assert sorted(snap.modules) == ["ib_core", "rdma_cm", "rpcrdma", "sunrpc", "top"]
    assert snap.modules["sunrpc"].holders == ("nfs", "rpcrdma")


def test_readers_are_injectable_and_only_run_when_declared(node: Path) -> None:
    calls: list[str] = []
    lock = FileLock("FLOCK", "WRITE", 42, (0, 25), 7)

    def locks() -> tuple[tuple[Any, ...], list[str]]:
        calls.append("locks")
        return (lock,), ["a reader problem"]

    observed = SriovObservation(problems=("pf0",))

    def sriov() -> tuple[SriovObservation, list[str]]:
        calls.append("sriov")
        return observed, []

    readers = Readers(locks=locks, sriov=sriov)
    cfg = Config(host_root=str(node))
    snap = Observer(HostRoot(node), cfg, Needs(locks=True), readers).observe(1.0)
    assert snap.locks == (lock,) and "a reader problem" in snap.problems
    assert snap.sriov == EMPTY_SRIOV
    snap = Observer(HostRoot(node), cfg, Needs(sriov=True), readers).observe(1.0)
    assert snap.sriov is observed and snap.locks == ()
    assert calls == ["locks", "sriov"]


def test_every_guard_declares_needs_and_parses_its_own_policy() -> None:
    cfg = Config()
    for entry in GUARDS:
        guard = entry.build(entry.default_policy, cfg.paths)
        assert guard.name == entry.name and isinstance(guard.gate, bool)
        assert isinstance(guard.needs(), Needs)
        assert entry.parse_policy({}, entry.default_policy) == entry.default_policy


CHECK_IMPORTS = """
import json, sys
from nodeagent.cli import main
rc = main(["check", "--host-root", sys.argv[1], "--json"])
print(json.dumps(sorted(sys.modules)))
"""


def test_check_imports_only_what_it_uses(node: Path) -> None:
    p = subprocess.run(
        [sys.executable, "-c", CHECK_IMPORTS, str(node)], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    doc = json.loads("\n".join(lines[:-1]))
    assert set(doc) == {"kernel", "guards"} | ({"problems"} & set(doc))
    for g in doc["guards"].values():
        # ("notes": what a verdict rests on, only where there is something to say)
        assert set(g) - {"notes"} == {"verdict", "ok", "reasons", "evidence"}
        assert isinstance(g["ok"], bool) and all(isinstance(n, str) for n in g.get("notes", []))
    loaded = set(json.loads(lines[-1]))
    unwanted = {
        "tenacity",
        "zstandard",
        "watchdog",
        "pyudev",
        "nodeagent.host.kmod",
        "nodeagent.host.act",
        "nodeagent.host.events",
        "nodeagent.agent",
        "nodeagent.loop.agent",
        "nodeagent.loop.workers",
        "nodeagent.guards.peermem.responder",
        "nodeagent.guards.peermem.start",
        "nodeagent.guards.peermem.process",
        "nodeagent.guards.peermem.roots",
    }
    assert not loaded & unwanted, sorted(loaded & unwanted)


def test_an_unload_finding_its_module_gone_is_done_and_other_errors_still_fail(
    tmp_path: Path,
) -> None:
    """ENOENT: the module is not loaded (an agent killed mid-removal, restarted, meets what
    its last call took away): the unload's job is done, and a chain goes on past it."""
    import errno

    from nodeagent.host.kmod import ModuleOpError

    class GoneOps(NoOps):
        def remove(self, name: str) -> None:  # type: ignore[override]
            raise ModuleOpError("unload", name, errno.ENOENT if name == "ib_srp" else errno.EPERM)

    act = Actuator(HostRoot(tmp_path), GoneOps(), lambda m: [], first_wait_s=0.001)  # type: ignore[arg-type]
    gone = act.perform(UnloadModule("storage", "ib_srp", "test"))
    assert gone.ok and gone.errno is None and gone.detail == (("module", "already unloaded"),)
    refused = act.perform(UnloadModule("storage", "rpcrdma", "test"))
    assert not refused.ok and refused.errno == errno.EPERM
