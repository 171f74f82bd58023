"""Plan workers: the loop never waits on a plan; supersede, urgent lanes, step timeouts.

Unit tests drive ``PlanWorkers`` with a fake ``perform``; the agent-level tests
run the real ``Agent`` on a temp host root (the storage guard reloading while
MOFED restarts), and the real ``ModprobeTools`` calling a ``modprobe`` that
hangs.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from nodeagent.agent import Agent
from nodeagent.cli import main
from nodeagent.config import Config
from nodeagent.core.actions import Action, ActionOutcome, LoadModule, Plan, UnloadModule
from nodeagent.host.act import Actuator
from nodeagent.host.fs import HostRoot
from nodeagent.host.kmod import ModprobeTools
from nodeagent.loop.workers import PlanWorkers
from tests.storage_node import HOLD, LOCK, node
from tests.waiting import WAIT, until


def unload(guard: str, module: str) -> UnloadModule:
    return UnloadModule(guard, module, "test")


class Steps:
    """A fake ``perform``: records each step; a step named in ``blocked`` waits for release."""

    def __init__(self, *blocked: str) -> None:
        self.blocked = {m: threading.Event() for m in blocked}
        self.entered = {m: threading.Event() for m in blocked}
        self.started: list[str] = []
        self.ended: list[str] = []
        self.left: list[str] = []  # blocked steps that stopped waiting: released or gave up
        self.lock = threading.Lock()

    def __call__(self, action: Action) -> ActionOutcome:
        name = getattr(action, "module", "?")
        with self.lock:
            self.started.append(name)
        if name in self.blocked:
            self.entered[name].set()
            released = self.blocked[name].wait(WAIT)
            with self.lock:
                self.left.append(name)
            assert released, f"{name} never released"
        with self.lock:
            self.ended.append(name)
        return ActionOutcome(action=action, ok=True)

    def release(self) -> None:
        for e in self.blocked.values():
            e.set()


def workers(steps: Steps, timeout: float = 30.0) -> PlanWorkers:
    return PlanWorkers(("peermem", "storage"), steps, step_timeout_s=lambda _a: timeout)


def finished_of(w: PlanWorkers) -> list:
    assert w.wait_idle(WAIT)
    return w.take_finished()


def test_submit_returns_at_once_and_one_guards_block_delays_no_other() -> None:
    steps = Steps("rpcrdma")
    w = workers(steps)
    try:
        storage = Plan("storage", (unload("storage", "rpcrdma"),))
        w.submit({"storage": storage})
        # The next pass: storage's decision unchanged (a submit without it would say
        # "storage: nothing to do now" and cancel its plan if not begun yet), peermem's new.
        w.submit(
            {"storage": storage, "peermem": Plan("peermem", (unload("peermem", "nvidia_peermem"),))}
        )
        # Only this thread releases rpcrdma, after this: a submit that waited on its plan
        # would have returned only once the step gave up waiting.
        assert "rpcrdma" not in steps.left, "submit waited on a plan"
        assert steps.entered["rpcrdma"].wait(WAIT)
        until(lambda: "nvidia_peermem" in steps.ended, "peermem's step waited behind storage's")
        assert "rpcrdma" not in steps.ended
    finally:
        steps.release()
    done = finished_of(w)
    assert sorted(f.plan.guard for f in done) == ["peermem", "storage"]
    assert all(o.ok for f in done for o in f.outcomes)


def test_the_same_decision_again_does_not_restart_the_plan() -> None:
    steps = Steps("a")
    w = workers(steps)
    plan = Plan("storage", (unload("storage", "a"), unload("storage", "b")))
    w.submit({"storage": plan})
    assert steps.entered["a"].wait(WAIT)
    w.submit({"storage": plan})  # decided again from an observation taken mid-step
    w.submit({"storage": Plan("storage", (unload("storage", "b"),))})  # what is left of it
    steps.release()
    (done,) = finished_of(w)
    assert steps.started == ["a", "b"] and not done.superseded


def test_what_an_ended_plan_did_is_not_started_again_before_its_end_is_taken() -> None:
    """A pass began before the load-back ended and saw the module not there yet: its
    decision (the load again) starts nothing; once the end is taken, the same decision is
    a new attempt (issue 55: the load-back decided twice)."""
    steps = Steps()
    w = workers(steps)
    load = LoadModule("storage", "rpcrdma", ("lib/modules",), "test")
    w.submit({"storage": Plan("storage", (unload("storage", "hold"), load))})
    assert w.wait_idle(WAIT)
    w.submit({"storage": Plan("storage", (load,))})  # decided before the end was taken
    assert w.wait_idle(WAIT)
    assert steps.started == ["hold", "rpcrdma"]
    (done,) = w.take_finished()
    assert not done.superseded and not done.not_done
    w.submit({"storage": Plan("storage", (load,))})  # a pass that took the end
    (again,) = finished_of(w)
    assert steps.started == ["hold", "rpcrdma", "rpcrdma"] and again.outcomes[0].ok


def test_a_new_decision_supersedes_at_the_next_safe_point() -> None:
    steps = Steps("a")
    w = workers(steps)
    w.submit({"storage": Plan("storage", tuple(unload("storage", m) for m in "abc"))})
    assert steps.entered["a"].wait(WAIT)
    w.submit({"storage": Plan("storage", (unload("storage", "x"),))})
    assert "b" not in steps.started
    steps.release()
    old, new = finished_of(w)
    # The step in flight ended on its own; nothing of the old plan started after it.
    assert [o.action.describe() for o in old.outcomes] == ["unload a"]
    assert [a.describe() for a in old.not_done] == ["unload b", "unload c"]
    assert old.superseded
    assert steps.started == ["a", "x"] and not new.superseded


def test_nothing_to_do_cancels_what_was_not_started() -> None:
    steps = Steps("a")
    w = workers(steps)
    w.submit({"storage": Plan("storage", (unload("storage", "a"), unload("storage", "b")))})
    assert steps.entered["a"].wait(WAIT)
    w.submit({})  # the guard decides nothing now
    steps.release()
    (old,) = finished_of(w)
    assert old.superseded and steps.started == ["a"]


def test_an_urgent_plan_starts_while_the_guards_step_is_in_flight() -> None:
    steps = Steps("nvidia_peermem_load")
    w = workers(steps)
    slow = UnloadModule("peermem", "nvidia_peermem_load", "a slow step")
    w.submit({"peermem": Plan("peermem", (slow, unload("peermem", "later")))})
    assert steps.entered["nvidia_peermem_load"].wait(WAIT)
    w.submit({"peermem": Plan("peermem", (unload("peermem", "nvidia_peermem"),), urgent=True)})
    until(lambda: "nvidia_peermem" in steps.ended, "the urgent step waited behind the slow one")
    steps.release()
    done = finished_of(w)
    assert "later" not in steps.started  # the slow plan was superseded by the urgent one
    assert any(f.plan.urgent for f in done) and any(f.superseded for f in done)


def test_a_step_past_its_timeout_is_abandoned_named_and_the_worker_moves_on() -> None:
    steps = Steps("hangs")
    # Only the hanging step has the short timeout (the behaviour under test): the steps
    # that return get the usual one, however long a busy machine takes to run them.
    w = PlanWorkers(
        ("storage",),
        steps,
        step_timeout_s=lambda a: 0.2 if getattr(a, "module", "") == "hangs" else WAIT,
    )
    try:
        w.submit({"storage": Plan("storage", (unload("storage", "hangs"), unload("storage", "x")))})
        (first,) = finished_of(w)
        (timed_out,) = first.outcomes
        assert not timed_out.ok and timed_out.errno == errno.ETIMEDOUT
        assert "unload hangs: timed out after 0.2 s" in (timed_out.error or "")
        assert [a.describe() for a in first.not_done] == ["unload x"]  # a sequence stops
        assert w.abandoned() == ["unload hangs"]
        # The worker is free: the next plan runs although the abandoned step still hangs.
        w.submit({"storage": Plan("storage", (unload("storage", "y"),))})
        (second,) = finished_of(w)
        assert second.outcomes[0].ok and "hangs" not in steps.ended
    finally:
        steps.release()
    # The abandoned step ended on its own, later.
    until(lambda: w.abandoned() == [], "the released step never ended")


def hanging_tool(tmp_path: Path) -> tuple[str, Path]:
    """A ``modprobe`` that writes its pid, then hangs until killed."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    pidfile = tmp_path / "modprobe.pid"
    tool = bindir / "modprobe"
    tool.write_text(f"#!/bin/sh\necho $$ > {pidfile}\nexec /bin/sleep 600\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return str(bindir), pidfile


def test_a_hanging_modprobe_is_killed_at_the_step_timeout(tmp_path: Path) -> None:
    bindir, pidfile = hanging_tool(tmp_path)
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/osrelease").write_text("6.1.0-test\n")
    tools = ModprobeTools(path=bindir)
    act = Actuator(HostRoot(tmp_path), tools, lambda m: [])
    w = PlanWorkers(("storage",), act.perform, step_timeout_s=lambda _a: 0.5)
    began = time.monotonic()
    w.submit({"storage": Plan("storage", (LoadModule("storage", "rpcrdma", ("",), "test"),))})
    (done,) = finished_of(w)
    took = time.monotonic() - began
    (outcome,) = done.outcomes
    assert not outcome.ok and outcome.errno == errno.ETIMEDOUT, outcome
    assert took < 30, took  # not the tool's own 300 s
    # The step's own thread ends once the tool is killed and reaped (on a busy machine
    # maybe past the worker's grace, so it may be listed abandoned for a moment); a tool
    # left running would hold it for 600 s.
    until(lambda: w.abandoned() == [], "the hung modprobe's step never ended")
    # Reaped by then, so no pid file now means the tool was killed before it wrote one.
    written = pidfile.read_text().strip() if pidfile.exists() else ""
    if written:
        pid = int(written)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            pass  # killed with its step
        else:
            os.kill(pid, 9)
            raise AssertionError("the hung modprobe outlived its step")


class ReloadKernel:
    """Module operations mirrored into the temp sysfs; the load of ``hang`` waits for release."""

    def __init__(self, root: Path, hang: str) -> None:
        self.root = root
        self.hang = hang
        self.entered = threading.Event()
        self.release = threading.Event()
        self.left = threading.Event()  # the load of ``hang`` stopped waiting
        self.calls: list[str] = []

    def insert_file(self, path: str, params: object) -> None:
        raise AssertionError("no insmod expected")

    def probe(self, name: str, moddir: str, params: object = ()) -> None:
        self.calls.append(f"load {name}")
        if name == self.hang:
            self.entered.set()
            released = self.release.wait(WAIT)
            self.left.set()
            assert released
        d = self.root / "sys/module" / name
        (d / "holders").mkdir(parents=True)
        (d / "initstate").write_text("live\n")
        (d / "refcnt").write_text("0\n")

    def remove(self, name: str) -> None:
        self.calls.append(f"unload {name}")
        d = self.root / "sys/module" / name
        for f in ("initstate", "refcnt"):
            (d / f).unlink()
        (d / "holders").rmdir()
        d.rmdir()


def test_a_mofed_restart_during_a_storage_reload_supersedes_it(tmp_path: Path) -> None:
    root = node(tmp_path, "rpcrdma")
    second = root / "sys/module/nvme_rdma"
    (second / "holders").mkdir(parents=True)
    (second / "initstate").write_text("live\n")
    (second / "refcnt").write_text("0\n")
    locks = (root / "proc/locks").read_text()
    kernel = ReloadKernel(root, hang="nvme_rdma")  # the first of the reload's loads
    records: list[dict] = []
    agent = Agent(
        Config(host_root=str(root), mode="enforce", uevents=False),
        module_ops=kernel,  # type: ignore[arg-type]
        kernel_log=lambda m: [],
        on_record=records.append,
    )
    # MOFED pending: both storage modules removed, the hold file written.
    agent.run_once(["pending"])
    assert sorted(kernel.calls) == ["unload nvme_rdma", "unload rpcrdma"]
    assert (root / HOLD).exists()
    # MOFED ready: the reload begins and hangs in its first load.
    (root / "proc/locks").write_text("")
    (root / "run/mellanox/drivers/.driver-ready").write_text("")
    kernel.calls.clear()
    agent.run_pass(["ready"])
    assert kernel.entered.wait(WAIT)
    # MOFED restarts while that load is in flight: the pass does not wait on it.
    (root / "run/mellanox/drivers/.driver-ready").unlink()
    (root / LOCK).touch()
    (root / "proc/locks").write_text(locks)
    result = agent.run_pass(["restart"])
    # Only this thread releases the load, after this: a pass that waited on it would
    # have returned only once the load gave up waiting.
    assert not kernel.left.is_set(), "the pass waited on the hung load"
    assert result.verdicts["storage"].evidence["mofed_pending"]  # the new decision
    kernel.release.set()
    agent.finish_plans(WAIT)
    superseded = [r for r in records if r["kind"] == "plan-superseded"]
    assert len(superseded) == 1, "\n".join(
        str((r["kind"], r.get("guard"), r.get("action"), r.get("verdict"), r.get("reasons")))
        for r in records
    )
    assert superseded[0]["done"][-1] == "load nvme_rdma from /run/mellanox/drivers or the host"
    assert superseded[0]["not_done"] == ["load rpcrdma from /run/mellanox/drivers or the host"]
    assert "load rpcrdma" not in kernel.calls  # never started after the restart
    # The in-flight load landed during the restart: the next passes take it out again.
    for _ in range(3):
        agent.run_once(["again"])
    assert not (root / "sys/module/nvme_rdma").exists()
    assert (root / HOLD).exists()


def test_status_lists_the_step_in_flight_then_the_abandoned_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = node(tmp_path, "rpcrdma")
    hung = threading.Event()
    entered = threading.Event()

    class HangingKernel(ReloadKernel):
        def remove(self, name: str) -> None:
            entered.set()
            hung.wait(WAIT)

    cfg = Config(host_root=str(root), mode="enforce", uevents=False, step_timeout_seconds=0.3)
    agent = Agent(cfg, module_ops=HangingKernel(root, hang=""), kernel_log=lambda m: [])  # type: ignore[arg-type]
    # A step's timeout runs from when it is read: the unload's is read only once the test
    # has seen the step in flight, however long the second pass takes on a busy machine.
    clock_runs = threading.Event()
    timeout_of = agent.workers.steps.timeout_s

    def held_timeout(action: Action) -> float:
        if action.describe() == "unload rpcrdma":
            assert clock_runs.wait(WAIT)
        return timeout_of(action)

    agent.workers.steps.timeout_s = held_timeout
    try:
        agent.run_pass(["first"])  # the hold file, then the unload of rpcrdma: it hangs
        until(
            lambda: agent.workers.in_flight() == {"storage": ["unload rpcrdma"]},
            "the unload never started",
        )
        agent.run_pass(["second"])
        status = json.loads((root / "run/nodeagent/status.json").read_text())
        assert status["plans_in_flight"] == {"storage": ["unload rpcrdma"]}
        main(["status", "--host-root", str(root)])
        assert "in flight: storage: unload rpcrdma" in capsys.readouterr().out
        clock_runs.set()
        assert entered.wait(WAIT)
        assert agent.workers.wait_idle(WAIT)  # past its timeout: abandoned, the worker free
        agent.run_pass(["third"])
        status = json.loads((root / "run/nodeagent/status.json").read_text())
        assert "step still running after its timeout: unload rpcrdma" in status["problems"]
    finally:
        clock_runs.set()
        hung.set()
        agent.close()


def test_one_hung_step_of_a_parallel_plan_delays_no_later_step() -> None:
    """Per-VF isolation: a parallel plan superseded while one step hangs ends at once; the
    next plan's steps run; the hung step is not started twice and its outcome comes back."""
    steps = Steps("vf0")
    w = workers(steps)
    hung, done = unload("storage", "vf0"), unload("storage", "vf1")
    later = unload("storage", "vf2")
    try:
        w.submit({"storage": Plan("storage", (hung, done), "parallel", bound=4)})
        assert steps.entered["vf0"].wait(WAIT)
        # vf1 restored: the next decision no longer wants it. (Waiting for that is the
        # test's premise; issue 35 saw it superseded before it began under load, and then
        # it is rightly handed back as not done: the test below.)
        until(lambda: "vf1" in steps.ended, "vf1 never ended")
        # A VF appears: the decision now also wants vf2 (and still vf0, not restored yet).
        w.submit({"storage": Plan("storage", (hung, later), "parallel", bound=4)})
        # Not behind the hung vf0: vf2 ends while vf0 still hangs (it is never released
        # before this), whatever the machine's load.
        until(lambda: "vf2" in steps.ended, "vf2 waited behind the hung vf0")
        assert "vf0" not in steps.ended
        assert steps.started.count("vf0") == 1  # never started twice while it runs
        assert any("vf0" in s and "superseded" in s for s in w.in_flight().get("storage", []))
        assert w.busy()
        steps.release()
        outcomes = [o.action for f in finished_of(w) for o in f.outcomes]
        assert hung in outcomes and later in outcomes and done in outcomes
    finally:
        steps.release()
        w.close(WAIT)


def test_a_step_superseded_before_it_began_comes_back_as_not_done() -> None:
    """Every step of a superseded parallel plan is accounted for: an outcome (now or when
    its detached run ends) or not done, never lost. vf1 waits behind two hung steps
    (bound 2) when the plan is superseded: the order load produced in issue 35, where
    vf1 had not begun, here every time."""
    steps = Steps("vf0", "vf9")
    w = workers(steps)
    hung, other, waiting = (
        unload("storage", "vf0"),
        unload("storage", "vf9"),
        unload("storage", "vf1"),
    )
    later = unload("storage", "vf2")
    try:
        w.submit({"storage": Plan("storage", (hung, other, waiting), "parallel", bound=2)})
        assert steps.entered["vf0"].wait(WAIT) and steps.entered["vf9"].wait(WAIT)
        w.submit({"storage": Plan("storage", (hung, later), "parallel", bound=4)})
        until(lambda: "vf2" in steps.ended, "vf2 never ran")
        steps.release()
        finished = finished_of(w)
        ran = [o.action for f in finished for o in f.outcomes]
        not_done = [a for f in finished for a in f.not_done]
        assert sorted(ran + not_done, key=str) == sorted([hung, other, waiting, later], key=str)
        (first,) = [f for f in finished if waiting in f.not_done]
        assert first.superseded and "vf1" not in steps.started
        assert ran.count(hung) == 1  # detached, its outcome came back once
    finally:
        steps.release()
        w.close(WAIT)


def test_stepped_workers_run_a_parallel_plan_in_the_callers_thread_in_order() -> None:
    """The simulator's mode: a parallel plan's steps one after another in the thread that
    calls run_pending (threads of their own touched the simulated node in an order the OS
    chose), each still run whatever the others did."""
    seen: list[tuple[str, int]] = []

    def perform(action: Action) -> ActionOutcome:
        name = getattr(action, "module", "?")
        seen.append((name, threading.get_ident()))
        return ActionOutcome(action=action, ok=name != "vf1", error="no" if name == "vf1" else None)

    w = PlanWorkers(("storage",), perform, step_timeout_s=lambda _a: 30.0, threaded=False)
    steps = tuple(unload("storage", f"vf{i}") for i in range(4))
    w.submit({"storage": Plan("storage", steps, "parallel", bound=4)})
    assert seen == []  # nothing runs before run_pending
    w.run_pending()
    assert seen == [(f"vf{i}", threading.get_ident()) for i in range(4)]
    (finished,) = w.take_finished()
    assert [o.ok for o in finished.outcomes] == [True, False, True, True]
    assert w.run_now(Plan("storage", steps[:2], "parallel", bound=2)) and all(
        t == threading.get_ident() for _n, t in seen[4:]
    )
