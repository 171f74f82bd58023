"""The simulated kernel's fanotify contract, and the seeds' own deployment with the hold.

The contract is tested on ``SimKernel`` with actors on its clock; the
scenarios run the real agent, whose shipped ``Responder`` and ``RootScanner``
answer the simulated kernel (``nodeagent/sim/fanotify.py``). The operator
containers are the same in every mode: only the agent's deployment differs.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import pytest

from nodeagent.host.kmod import ModuleOpError
from nodeagent.sim.clock import Scheduler
from nodeagent.sim.fanotify import SimFanotify
from nodeagent.sim.kernel import HOST_SB, SimKernel
from nodeagent.sim.modes import MODES
from nodeagent.sim.modtree import RDMA_MODULES, depmod, install_generation
from nodeagent.sim.render import to_json
from nodeagent.sim.scenarios import SCENARIOS, RunResult, run_scenario
from tests.sim.trees import KVER, OLD, gpu_tree, moddir

# -- the contract ----------------------------------------------------------------


@pytest.fixture
def kernel(tmp_path: Path) -> SimKernel:
    k = SimKernel(tmp_path, KVER, Scheduler())
    install_generation(moddir(tmp_path), KVER, OLD, RDMA_MODULES)
    depmod(moddir(tmp_path))
    k.modprobe("ib_core", moddir(tmp_path))  # loaded before anyone watches
    gpu_tree(k, OLD)
    k.modprobe("nvidia", moddir(tmp_path, "run/nvidia/driver"))
    k.mount_overlay("run/nvidia/driver")  # the driver container's root, this start
    return k


def _modprobe_actor(k: SimKernel, out: dict[str, object]) -> None:
    def body() -> None:
        try:
            out["loaded"] = k.modprobe("nvidia_peermem", moddir(k.root, "run/nvidia/driver"))
        except ModuleOpError as exc:
            out["error"] = exc.errno
        out["at"] = k.now()

    k.sched.spawn("nvidia-driver-ctr", body)


def _waiting_open(kernel: SimKernel) -> tuple[SimFanotify, dict[str, object]]:
    """A group marking the driver root, and the driver container's modprobe opening there."""
    group = kernel.fanotify_group()
    group.mark_filesystem(str(kernel.root / "run/nvidia/driver"))
    out: dict[str, object] = {}
    _modprobe_actor(kernel, out)
    kernel.sched.run(1.0)
    return group, out


def test_an_open_on_a_marked_filesystem_waits_for_the_answer(kernel: SimKernel) -> None:
    group, out = _waiting_open(kernel)
    (event,) = group.read()  # one open (its dependencies are loaded): one event
    assert group.path_of(event).endswith("kernel/drivers/video/nvidia-peermem.ko")
    proc = kernel.procs[event.pid]  # the opener is a process the agent's /proc shows
    assert proc.comm == "modprobe" and proc.who == "nvidia-driver-ctr"
    assert (kernel.proc_dir / str(event.pid) / "comm").read_text() == "modprobe\n"
    kernel.sched.run(100.0)
    assert out == {} and kernel.module("nvidia_peermem") is None  # still waiting, 100 s on
    group.respond(event, True)
    kernel.sched.run(101.0)
    assert out["loaded"] == ["nvidia_peermem"]
    assert out["at"] == pytest.approx(100.0 + kernel.init_delay)  # answered at 100 s, then init
    assert event.pid not in kernel.procs  # modprobe exited


def test_a_denied_open_fails_with_eperm(kernel: SimKernel) -> None:
    group, out = _waiting_open(kernel)
    (event,) = group.read()
    group.respond(event, False)
    kernel.sched.run(2.0)
    assert out["error"] == errno.EPERM and kernel.module("nvidia_peermem") is None


def test_a_dead_listener_lets_every_waiting_open_go(kernel: SimKernel) -> None:
    group, out = _waiting_open(kernel)
    group.close()
    kernel.sched.run(2.0)
    assert out["loaded"] == ["nvidia_peermem"]
    assert kernel.fanotify_groups == []


def test_each_container_start_is_a_new_superblock_and_takes_its_marks_along(
    kernel: SimKernel,
) -> None:
    group = kernel.fanotify_group()
    first = kernel.superblock_of("run/nvidia/driver/lib")
    assert first != HOST_SB and kernel.superblock_of("lib/modules") == HOST_SB
    group.mark_filesystem(str(kernel.root / "run/nvidia/driver"))
    assert group.marked_devices() == {first}
    second = kernel.mount_overlay("run/nvidia/driver")  # the next start
    assert second != first and group.marked_devices() == set()
    out: dict[str, object] = {}
    _modprobe_actor(kernel, out)  # the new start's open: not marked, no event, no wait
    kernel.sched.run(1.0)
    assert out["loaded"] == ["nvidia_peermem"] and group.read() == []


def test_unmarked_filesystems_and_no_group_change_nothing(kernel: SimKernel) -> None:
    out: dict[str, object] = {}
    _modprobe_actor(kernel, out)
    kernel.sched.run(1.0)
    assert out["loaded"] == ["nvidia_peermem"]
    assert not kernel.proc_dir.exists()  # no group: no process table written at all


def test_the_scanner_and_the_responder_read_the_simulated_proc(kernel: SimKernel) -> None:
    """The shipped scanner finds a driver container's start through the simulated /proc."""
    from nodeagent.core.hold import DRIVER_CONTAINER_RULES
    from nodeagent.guards.peermem.roots import RootScanner

    group = kernel.fanotify_group()
    pid = kernel.spawn_proc(
        "nvidia-driver",
        ("/bin/bash", "/usr/local/bin/nvidia-driver", "init"),
        "run/nvidia/driver",
        "nvidia-driver-ctr",
    )
    scanner = RootScanner(
        group.open_root,
        group.marked_devices,
        DRIVER_CONTAINER_RULES,
        proc=str(kernel.proc_dir),
        dev_of=kernel.superblock_at,
        may_load=lambda pid: None,
        clock=kernel.now,
    )
    scanner.prepare()
    scanner.scan()
    (root,) = scanner.roots()
    assert root.pid == pid and root.dev == kernel.superblock_of("run/nvidia/driver")
    assert group.marked_devices() == {root.dev}
    kernel.unmount("run/nvidia/driver")  # the container's overlay goes
    scanner.scan()
    assert scanner.roots() == []


# -- the seeds' own deployment, with the hold --------------------------------------------

_cache: dict[tuple[str, bool, str | None], RunResult] = {}


def run(name: str, agent: bool, mode: str | None = None) -> RunResult:
    key = (name, agent, mode)
    if key not in _cache:
        _cache[key] = run_scenario(SCENARIOS[name], agent=agent, mode=mode)
    return _cache[key]


def test_the_hold_modes_are_the_operator_modes_plus_the_agents_component() -> None:
    for name in ("operator-peermem-hold", "operator-peermem-dm09-hold"):
        hold, plain = MODES[name], MODES[name.removesuffix("-hold")]
        assert hold.hold and not plain.hold
        assert hold.settings[: len(plain.settings)] == plain.settings
        assert "hold_loads" in hold.settings[-1] and "peermem-hold" in hold.settings[-1]
        # What the operator containers read is the same.
        assert (hold.rdma, hold.host_mofed, hold.manager_waits_for, hold.loaders) == (
            plain.rdma,
            plain.host_mofed,
            plain.manager_waits_for,
            plain.loaders,
        )


def test_the_seeds_are_prevented_in_their_own_deployment_with_the_hold() -> None:
    without = run("kernel-upgrade-race", agent=True, mode="operator-peermem-dm09")
    assert without.verdict.peermem_failed_loads == 1 and without.verdict.driver_restarts == 1
    r = run("kernel-upgrade-race", agent=True, mode="operator-peermem-dm09-hold")
    v = r.verdict
    assert v.peermem_failed_loads == 0 and v.peermem_failed_by == {}
    assert v.driver_restarts == 0
    assert v.healthy_at is not None and v.mofed_installed and v.peermem_loaded
    # The driver container's own modprobe was held until the gate opened, after the flag.
    assert v.held_opens is not None and len(v.held_opens) == 1
    (held,) = v.held_opens
    assert held.startswith("nvidia-driver-ctr's modprobe held ")
    assert held.endswith("nvidia-peermem.ko: gate opened")
    seconds = float(held.split(" held ")[1].split(" s ")[0])
    assert 60 < seconds < 200
    gpu = [e for e in r.events if e.column == "GPU driver"]
    asked = next(e.t for e in gpu if "modprobe -a nvidia-peermem" in e.text)
    assert v.ready_flag_at is not None and asked < v.ready_flag_at  # asked mid-restart
    assert not any("Invalid argument" in e.text for e in gpu)
    agent = [e.text for e in r.events if e.column == "agent"]
    assert "marked nvidia-driver-ctr's root (its overlay for this start)" in agent
    # What stays is named, not hidden: the sidecar's own probe restarts it once.
    assert all(x.startswith("nvidia-peermem-ctr restarts") for x in v.not_prevented)


def test_the_hold_run_is_deterministic() -> None:
    a = run_scenario(
        SCENARIOS["kernel-upgrade-race"], agent=True, mode="operator-peermem-dm09-hold"
    )
    b = run("kernel-upgrade-race", agent=True, mode="operator-peermem-dm09-hold")
    assert a.events == b.events and a.verdict == b.verdict


@pytest.mark.parametrize("name", ["storage-module-race", "vf-restore", "mofed-upgrade"])
def test_the_other_scenarios_pass_in_the_hold_mode_too(name: str) -> None:
    plain = run(name, agent=True, mode="operator-peermem")
    held = run(name, agent=True, mode="operator-peermem-hold")
    assert held.verdict.healthy_at is not None
    assert held.verdict.peermem_failed_loads == plain.verdict.peermem_failed_loads == 0
    assert held.verdict.driver_restarts <= plain.verdict.driver_restarts
    assert held.verdict.vfs_config_back == plain.verdict.vfs_config_back


def test_without_the_hold_the_outputs_carry_no_hold_fields() -> None:
    r = run("kernel-upgrade-race", agent=True, mode="operator-peermem-dm09")
    doc = to_json([r], seed=1, speed=None)
    assert "held_opens" not in doc["scenarios"][0]["runs"][0]["verdict"]
    assert "nodeagent_hold" not in doc["deployment_modes"]["operator-peermem-dm09"]
    held = run("kernel-upgrade-race", agent=True, mode="operator-peermem-dm09-hold")
    doc = to_json([held], seed=1, speed=None)
    assert doc["deployment_modes"]["operator-peermem-dm09-hold"]["nodeagent_hold"] == "fanotify"
    assert json.dumps(doc)  # serialisable


def _end(node: Any, harness: Any) -> None:
    """A harness's run ended as run_scenario ends it: the agent stopped, the actors unwound."""
    node.closed = True
    harness.stop()
    node.sched.close()
    harness.join()
    node.kernel.uevent_source.close()


def test_a_stale_peermem_build_is_let_go_and_named_not_held_for_the_budget(
    tmp_path: Path,
) -> None:
    """gpu-operator#2868 with the hold: MOFED ready, nvidia-peermem.ko built against other
    ib_core CRCs. No wait helps: the driver container's held load goes at once and fails as
    before; the verdict says to recreate the pod."""
    from nodeagent.sim.actors import Container
    from nodeagent.sim.harness import AgentHarness
    from nodeagent.sim.modtree import GPU_MODULES
    from nodeagent.sim.node import READY, Node
    from nodeagent.sim.scenarios import MOFED_2507, NVIDIA

    node = Node(tmp_path, KVER, seed=0, mode=MODES["operator-peermem-hold"])
    node.kernel.init_delay = node.kernel.exit_delay = 0.0  # the scene: modules at rest
    with node.sched.world:
        node.install(MOFED_2507, RDMA_MODULES, "mofed")
        node.write_headers(MOFED_2507, RDMA_MODULES)
        stale = {s: c ^ 0xFFFF for s, c in (node.headers() or {}).items()}
        node.install(NVIDIA, GPU_MODULES, "gpu", against=stale)
        for m in ("mlx5_core", "mlx5_ib", "ib_uverbs"):
            node.kernel.modprobe(m, node.mofed_moddir)
        node.kernel.modprobe("nvidia", node.gpu_moddir)
        node.write(READY)
    harness = AgentHarness(node)
    harness.start()
    node.sched.settle = harness.settle
    out: dict[str, object] = {}

    def body(c: Container) -> None:
        node.sleep(5.0)  # the container's install before its load
        try:
            node.kernel.modprobe("nvidia_peermem", node.gpu_moddir)
            out["rc"] = 0
        except ModuleOpError as exc:
            out["rc"] = exc.errno
        out["at"] = node.now()
        node.sleep(float("inf"))

    driver = Container(
        node,
        "nvidia-driver-ctr",
        "GPU driver",
        body,
        rootfs="run/nvidia/driver",
        cmdline=("/bin/bash", "/usr/local/bin/nvidia-driver", "init"),
    )
    try:
        driver.start()
        node.sched.run(60.0)
        status = json.loads((node.root / "run/nodeagent/status.json").read_text())
        peermem = status["guards"]["peermem"]
        assert peermem["verdict"] == "rebuild", peermem["reasons"]
        assert "recreate the GPU driver pod" in peermem["reasons"][0]
        assert status["hold"]["container_roots"], "the driver container's root was not marked"
        assert out["rc"] == errno.EINVAL  # the kernel refuses it, as without the hold
        assert isinstance(out["at"], float) and out["at"] < 10.0  # not held for the budget
        assert status["hold"]["held"] == []
    finally:
        _end(node, harness)


def test_the_stepped_responder_and_scanner_report_through_the_fence(tmp_path: Path) -> None:
    """What the responder and the container scanner report (stepped in the harness's thread)
    wakes the agent through the fence, whose passes ``settle`` waits for; not through the
    side's ``ctx.wake`` (the agent's own poke: a pass ``settle`` does not count, poked while
    the agent's thread may be draining it)."""
    from nodeagent.host.events import pending
    from nodeagent.sim.harness import AgentHarness
    from nodeagent.sim.node import Node

    node = Node(tmp_path, KVER, seed=0, mode=MODES["operator-peermem-hold"])
    harness = AgentHarness(node)
    harness.start()
    try:
        side = harness.agent.peermem_hold
        assert side.hold is not None and side.containers is not None
        with node.sched.world:  # no pass between the reports and the looks
            before = harness.fence.produced
            side.hold.on_report()
            side.containers.on_report()
            assert harness.fence.produced == before + 2
            assert not pending([harness.agent.agent.poke])
    finally:
        _end(node, harness)
