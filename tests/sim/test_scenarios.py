"""The seed scenarios, without and with the real agent (its own loop, real inotify, enforce)."""

from __future__ import annotations

import difflib
import json
from typing import Any

import pytest

from nodeagent.sim.clock import SimError
from nodeagent.sim.harness import agent_guards
from nodeagent.sim.render import to_json
from nodeagent.sim.scenarios import SCENARIOS, RunResult, run_scenario

_cache: dict[tuple[str, bool, int], RunResult] = {}


def run(name: str, agent: bool, seed: int = 1) -> RunResult:
    key = (name, agent, seed)
    if key not in _cache:
        _cache[key] = run_scenario(SCENARIOS[name], agent=agent, seed=seed)
    return _cache[key]


def r_ops(r: RunResult) -> list[tuple[float, str, str]]:
    return list(r.module_ops)


def texts(r: RunResult, column: str) -> list[str]:
    return [e.text for e in r.events if e.column == column]


def test_kernel_upgrade_race_without_agent_crashes_the_driver_with_einval() -> None:
    r = run("kernel-upgrade-race", agent=False)
    gpu = texts(r, "GPU driver")
    einval = "modprobe: ERROR: could not insert 'nvidia_peermem': Invalid argument"
    assert einval in gpu
    assert gpu.index(einval) < gpu.index("nvidia-driver-ctr exited 1; restarting")
    failed_at = next(e.t for e in r.events if e.text == einval)
    assert r.verdict.ready_flag_at is not None
    assert failed_at < r.verdict.ready_flag_at, "mid-restart, before MOFED's ready flag"
    kmsg = [text for _t, text in r.kernel_log]
    assert (
        "nvidia_peermem: disagrees about version of symbol ib_register_peer_memory_client" in kmsg
    )
    assert r.verdict.driver_restarts >= 1
    assert r.verdict.peermem_failed_loads >= 1


def test_kernel_upgrade_race_with_agent_is_not_prevented_in_the_seeds_mode() -> None:
    # The driver container loads nvidia_peermem itself, as the shipped one does; nothing
    # shipped waits on the agent's gate, so its EINVAL and restart happen with the agent too.
    r = run("kernel-upgrade-race", agent=True)
    v = r.verdict
    assert r.mode.name == "operator-peermem-dm09"
    assert v.peermem_failed_by == {"nvidia-driver-ctr": 1}
    assert v.driver_restarts == 1
    assert any(
        x.startswith("1 failed nvidia_peermem load(s) by nvidia-driver-ctr: not prevented")
        for x in v.not_prevented
    )
    assert "modprobe: ERROR: could not insert 'nvidia_peermem': Invalid argument" in texts(
        r, "GPU driver"
    )
    # What the agent does: keeps its own loads for a final stack (after the ready flag) ...
    agent = texts(r, "agent")
    assert "peermem gate open" in agent
    opened = next(e.t for e in r.events if e.text == "peermem gate open")
    assert v.ready_flag_at is not None and opened >= v.ready_flag_at
    loads = [t for t, who, what in r_ops(r) if who == "nodeagent" and what == "load nvidia_peermem"]
    assert loads and all(t >= v.ready_flag_at for t in loads)
    assert v.healthy_at is not None and v.mofed_installed and v.peermem_loaded


def test_the_operator_containers_know_nothing_of_the_agent() -> None:
    # Same mode, same seed: the GPU driver column reads the same up to the first moment
    # the agent changes the node (its first module operation).
    without, with_agent = run("kernel-upgrade-race", False), run("kernel-upgrade-race", True)
    first_agent_op = min(t for t, who, _what in r_ops(with_agent) if who == "nodeagent")
    before = lambda r: [  # noqa: E731
        (e.t, e.text) for e in r.events if e.column == "GPU driver" and e.t < first_agent_op
    ]
    assert before(without) == before(with_agent) and before(without)
    assert not any("nodeagent" in e.text for e in with_agent.events if e.column != "agent")


def test_mofed_upgrade_agent_unloads_peermem_when_the_restart_begins() -> None:
    without, with_agent = run("mofed-upgrade", False), run("mofed-upgrade", True)
    assert "pre-start: unloaded nvidia_peermem" in texts(without, "MOFED")
    agent = texts(with_agent, "agent")
    assert "unload nvidia_peermem: ok" in agent
    first_unload = next(e.t for e in with_agent.events if e.text == "unload nvidia_peermem: ok")
    assert first_unload < 1.0  # at the SIGTERM (ready flag removed), not 34 s later
    for r in (without, with_agent):
        assert r.verdict.peermem_loaded and r.verdict.mofed_installed


def test_storage_race_fails_without_the_agent() -> None:
    r = run("storage-module-race", False)
    mofed = texts(r, "MOFED")
    assert any(t.startswith("Storage modules are loaded for current driver") for t in mofed)
    assert r.verdict.mofed_restarts >= 3 and not r.verdict.mofed_installed
    assert r.verdict.healthy_at is None
    assert not any(t.startswith("NFS-over-RDMA share mounted") for t in texts(r, "kernel"))


def test_storage_race_with_the_agent_installs_mofed_reloads_rpcrdma_and_mounts() -> None:
    r = run("storage-module-race", True)
    v = r.verdict
    assert v.missing_guards == ()
    assert v.mofed_installed and v.mofed_restarts == 0 and v.healthy_at is not None
    mofed, agent, kernel = texts(r, "MOFED"), texts(r, "agent"), texts(r, "kernel")
    assert not any(t.startswith("Storage modules are loaded") for t in mofed)
    blocking = next(t for t in agent if t.startswith("storage: blocking: "))
    assert "rpcrdma" in blocking and "MOFED holds its lock" in blocking
    hold = agent.index("write etc/modprobe.d/nodeagent-storage-hold.conf: ok")
    unloads = [t for t in agent if t.startswith("unload ")]
    assert unloads[0] == "unload rpcrdma: ok" and agent.index(unloads[0]) > hold
    assert "unload ib_core: ok" not in unloads  # mlx5_ib still holds it
    # A mount retried meanwhile fails fast on the hold file ...
    assert any("install command '/bin/false'" in t for t in kernel)
    # ... and after MOFED's ready flag: the hold goes, rpcrdma comes back from MOFED's tree.
    ready = next(e.t for e in r.events if "setting driver ready state" in e.text)
    removed = next(e for e in r.events if e.text.startswith("remove etc/modprobe.d/"))
    loaded = next(e for e in r.events if e.text.startswith("load rpcrdma from "))
    assert ready <= removed.t <= loaded.t and loaded.text.endswith(": ok")
    assert "NFS-over-RDMA share mounted on /mnt/shared; rpcrdma in use" in kernel


def test_vf_scenarios_replay_mofeds_restore_failures() -> None:
    phase1, phase2 = run("vf-restore", False), run("mofed-upgrade", False)
    assert any('VF0 0000:01:00.3: Cannot find device "eth0"' in t for t in texts(phase1, "MOFED"))
    mofed2 = texts(phase2, "MOFED")
    restored = [t for t in mofed2 if t.endswith("restored (MAC, MTU, state)")]
    assert len(restored) == 16  # seed 1 gives the seed's VF16
    assert any(t.startswith("VF16 0000:01:02.3: ") and "dev argument required" in t for t in mofed2)
    for r in (phase1, phase2):
        assert r.verdict.vfs_total == 50 and r.verdict.vfs_config_back == 0
        assert r.verdict.mofed_restarts == 1 and r.verdict.mofed_installed
    assert phase2.verdict.vfs_partly_back == 16  # VF0-15: MAC, MTU, state; never trust, VLAN...
    # MOFED does not even save the VFs in pods (46, 47) or bound to vfio-pci (48, 49).
    assert not any(t.startswith(("VF46 ", "VF48 ")) for t in mofed2)


@pytest.mark.parametrize("name", ["vf-restore", "mofed-upgrade"])
def test_with_the_agent_every_vf_gets_its_whole_config_back(name: str) -> None:
    r = run(name, True)
    v = r.verdict
    assert v.missing_guards == ()
    assert (v.vfs_total, v.vfs_config_back, v.vfs_partly_back) == (50, 50, 0)
    assert v.mofed_installed and v.healthy_at is not None
    agent = texts(r, "agent")
    restored = [t for t in agent if t.startswith("sriov: VF ") and " restored " in t]
    assert len(restored) == 50
    assert any("all 50 VFs restored" in t for t in agent)
    # MOFED still fails as in the seed: the agent does not depend on it, nor fight it.
    assert any("VF restore failed, exiting" in t for t in texts(r, "MOFED"))
    assert "sriov" in agent_guards()


def test_vfs_that_were_in_pods_or_vfio_get_their_pf_side_config_back() -> None:
    r = run("mofed-upgrade", True)
    agent = texts(r, "agent")
    for i in (46, 47, 48, 49):
        assert any(t.startswith(f"sriov: VF {i} ") and "vlan" in t for t in agent), i
        assert not any(t.startswith(f"sriov: VF {i} ") and "mtu" in t for t in agent), i


def test_same_seed_same_timeline() -> None:
    first = to_json(
        [run("kernel-upgrade-race", True), run("mofed-upgrade", True)], seed=1, speed=None
    )
    again = [
        run_scenario(SCENARIOS[name], agent=True, seed=1)
        for name in ("kernel-upgrade-race", "mofed-upgrade")
    ]
    second = to_json(again, seed=1, speed=None)
    first.pop("wall_seconds")
    second.pop("wall_seconds")
    assert first == second, _first_difference(first, second)


def _first_difference(a: dict[str, Any], b: dict[str, Any]) -> str:
    """Where two runs' documents part: the first lines of their diff."""
    lines = [json.dumps(d, indent=1, sort_keys=True).splitlines() for d in (a, b)]
    return "\n".join(list(difflib.unified_diff(*lines, lineterm="", n=2))[:40])


def test_another_seed_moves_the_vf_timings() -> None:
    a = run("mofed-upgrade", False, seed=1)
    b = run("mofed-upgrade", False, seed=5)
    fail = lambda r: next(t for t in texts(r, "MOFED") if "VF restore failed" in t)  # noqa: E731
    assert fail(a) != fail(b)


def test_a_failing_agent_pass_fails_the_simulation(monkeypatch: pytest.MonkeyPatch) -> None:
    from nodeagent.host.observe import Observer

    observe = Observer.observe

    def broken(self: Observer, now: float) -> Any:
        if now >= 100:
            raise RuntimeError("observer broke")
        return observe(self, now)

    monkeypatch.setattr(Observer, "observe", broken)
    with pytest.raises(SimError, match="observer broke"):
        run_scenario(SCENARIOS["kernel-upgrade-race"], agent=True)


def test_the_seed_node_shows_open_modules_and_the_agent_reports_dma_buf() -> None:
    # 580 with KERNEL_MODULE_TYPE=auto builds the open modules; el9's 5.14 is >= 5.12.
    r = run("kernel-upgrade-race", agent=True)
    peermem = [
        x for x in r.agent_records if x.get("kind") == "decision" and x["guard"] == "peermem"
    ]
    gpudirect = peermem[-1]["evidence"]["gpudirect"]
    assert gpudirect["modules"] == "open" and gpudirect["dmabuf_capable"] is True
    assert gpudirect["summary"] == "DMA-BUF capable; peermem not required"
    closed = [x for x in peermem if x["reasons"]]
    assert any(x["reasons"][-1].startswith("GPUDirect RDMA: DMA-BUF capable") for x in closed)
    assert r.verdict.peermem_loaded  # reported, never acted on: peermem stays loaded


@pytest.mark.parametrize(
    ("name", "words"),
    [
        (
            "nic-only-node",
            {"peermem": "not-applicable", "storage": "clear", "sriov": "not-applicable"},
        ),
        ("gpu-only-node", dict.fromkeys(("peermem", "storage", "sriov"), "not-applicable")),
    ],
)
def test_a_node_of_another_kind_is_not_a_broken_node(name: str, words: dict[str, str]) -> None:
    """Issue 54: the agent on a NIC-only and a GPU-only node says which guards do not apply,
    is ok throughout (no alert's input), does nothing, and the node is healthy as without."""
    without, with_agent = run(name, agent=False), run(name, agent=True)
    at_end = with_agent.verdict.guards_at_end or {}
    assert {g: w.split(":")[0] for g, w in at_end.items()} == words
    decisions = [r for r in with_agent.agent_records if r.get("kind") == "decision"]
    assert decisions and all(r["ok"] for r in decisions), [r for r in decisions if not r["ok"]]
    assert not [op for op in with_agent.module_ops if op[1] == "nodeagent"]
    assert not [r for r in with_agent.agent_records if r.get("kind") == "action"]
    assert with_agent.verdict.healthy_at == without.verdict.healthy_at is not None
