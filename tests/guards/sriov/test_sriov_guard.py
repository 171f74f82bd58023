"""The VF guard, pure: phases, per-VF restore, numvfs ownership, bad input, and a property."""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace
from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeagent.core.actions import RestoreVf, SetNumVfs
from nodeagent.core.snapshot import NodeSnapshot
from nodeagent.core.sriov import SriovGuard, SriovMemory, SriovPolicy
from nodeagent.core.sriov_model import (
    PersistedSnapshot,
    SriovValueError,
    saved_pf_from_json,
    snapshot_from_json,
    snapshot_to_json,
)
from tests.guards.sriov.sriov_world import PF_PCI, POLICY, READ_FAILURES, Run, World, wanted
from tests.waiting import WAIT


def stable_then_unloaded(n: int = 4, policy: SriovPolicy = POLICY) -> Run:
    run = Run(World(n).configured(), policy)
    run.step(0.0)
    assert run.phase() == "stable"
    run.world.unload()
    run.step(1.0)
    assert run.phase() == "disrupted"
    return run


def test_snapshot_is_taken_only_while_mofed_is_ready() -> None:
    world = World(2).configured()
    world.mofed_ready = False
    run = Run(world)
    run.step(0.0)
    assert PF_PCI not in run.memory.pfs
    world.mofed_ready = True
    run.step(1.0)
    saved = run.memory.pfs[PF_PCI].saved
    assert saved.numvfs == 2 and saved.vf(1) is not None
    assert saved.vf(1).settings["vlan"] == 101  # type: ignore[union-attr]


def test_owner_change_while_stable_updates_the_snapshot() -> None:
    run = Run(World(2).configured())
    run.step(0.0)
    run.world.vfs[1].settings["mtu"] = 1800
    run.step(1.0)
    assert run.memory.pfs[PF_PCI].saved.vf(1).settings["mtu"] == 1800  # type: ignore[union-attr]
    assert any("changed by its owner" in e and "VF 1: mtu" in e for e in run.events)
    assert not run.actions


def _snapshot_file(run: Run) -> str:
    """What the agent writes to sriov.json after the pass (SriovStore's serialization)."""
    saved = {pci: m.saved for pci, m in run.memory.pfs.items()}
    return json.dumps(snapshot_to_json(saved), indent=1, sort_keys=True)


@pytest.mark.parametrize("failure", list(READ_FAILURES))
def test_a_failed_read_keeps_the_snapshot_and_the_next_restore_brings_every_vf_back(
    failure: str,
) -> None:
    """A stable PF read badly (netlink, a malformed value, a field missing) is not an owner's
    change: the snapshot and its file stay as they were, the PF stays stable, nothing is
    written; after a real unload and reload every VF gets its original settings back."""
    run = Run(World(3).configured())
    run.step(0.0)
    saved, file = run.memory.pfs[PF_PCI].saved, _snapshot_file(run)
    run.world.read_failure = failure
    run.step(1.0)
    run.step(2.0)
    assert run.memory.pfs[PF_PCI].saved == saved
    assert _snapshot_file(run) == file
    assert run.phase() == "stable" and not run.actions
    assert not any("changed by its owner" in e for e in run.events)
    if failure != "a field not in the read":  # a read with a problem says so, once
        kept = [e for e in run.events if "snapshot kept" in e]
        assert len(kept) == 1 and "VF settings unreadable" in kept[0]
        assert run.verdict()["pfs"][PF_PCI]["snapshot_kept"]  # type: ignore[index]
    run.world.read_failure = None
    run.world.unload()
    run.step(3.0)
    run.world.reload()
    for i in range(3):
        run.world.netdev_appears(i)
    run.step(4.0)
    run.step(5.0)
    assert run.phase() == "restored"
    for i in range(3):
        assert {k: run.world.vfs[i].settings[k] for k in wanted(i)} == wanted(i)


# The VFs each failure leaves without a clean read (a field merely absent is no problem).
UNREAD_VFS = {
    "VF settings unreadable": {0, 1},
    "link dump failed": {0, 1},
    "a malformed value": {1},
    "a field not in the read": set(),
    "sriov_numvfs malformed": {0, 1},
}


@pytest.mark.parametrize("failure", list(READ_FAILURES))
def test_a_failed_read_while_restoring_writes_nothing_on_it(failure: str) -> None:
    run = stable_then_unloaded(2)
    run.world.reload()
    run.world.netdev_appears(0)
    run.world.netdev_appears(1)
    run.world.read_failure = failure
    run.step(2.0)
    run.step(3.0)
    written = {a.index for a in run.actions if isinstance(a, RestoreVf)}
    assert not written & UNREAD_VFS[failure]
    assert not [a for a in run.actions if isinstance(a, SetNumVfs)]
    if UNREAD_VFS[failure]:
        assert run.phase() == "restoring"
    run.world.read_failure = None
    run.step(4.0)
    run.step(5.0)
    assert run.phase() == "restored"
    for i in range(2):
        assert {k: run.world.vfs[i].settings[k] for k in wanted(i)} == wanted(i)


def test_an_adopted_snapshot_read_badly_is_kept_and_compared_on_the_first_clean_read() -> None:
    """Memory lost, the node unreadable: not a disruption; the first clean read decides."""
    run = Run(World(2).configured())
    run.step(0.0)
    persisted = PersistedSnapshot(
        snapshot_from_json(json.loads(_snapshot_file(run))),
    )
    world = run.world
    world.vfs[1].settings["vlan"] = 7  # changed while no agent watched
    world.read_failure = "VF settings unreadable"
    from dataclasses import replace

    guard = SriovGuard(POLICY)
    snap = world.observe(5.0)
    d = guard.decide(replace(snap, sriov=replace(snap.sriov, persisted=persisted)), SriovMemory())
    assert d.memory.pfs[PF_PCI].phase == "stable" and not d.actions
    assert d.memory.pfs[PF_PCI].saved.vf(1).settings["vlan"] == 101  # type: ignore[union-attr]
    world.read_failure = None
    snap = world.observe(6.0)
    d = guard.decide(replace(snap, sriov=replace(snap.sriov, persisted=persisted)), d.memory)
    assert d.memory.pfs[PF_PCI].phase == "restoring"  # differs: restored, not adopted as is
    assert [a.index for a in d.actions if isinstance(a, RestoreVf)] == [1]


def test_disruption_freezes_the_snapshot_and_restores_each_vf_as_it_appears() -> None:
    run = stable_then_unloaded(4)
    assert "driver mlx5_core unbound" in run.memory.pfs[PF_PCI].why
    run.world.reload()
    run.step(2.0)
    assert run.phase() == "restoring"
    assert not run.actions  # no netdev yet: nothing to write
    run.world.netdev_appears(2)
    run.step(2.5)
    assert [a.index for a in run.actions if isinstance(a, RestoreVf)] == [2]
    assert run.verdict()["pfs"][PF_PCI]["restoring"] == "1/4"  # type: ignore[index]
    for i in (0, 3, 1):
        run.world.netdev_appears(i)
        run.step(3.0 + i)
    run.step(10.0)
    assert run.phase() == "restored"
    assert run.world.writes == {0: 1, 1: 1, 2: 1, 3: 1}
    for i in range(4):
        assert all(run.world.vfs[i].settings[k] == v for k, v in wanted(i).items())
    assert any("VF 2 (0000:01:00.5) restored" in e for e in run.events)
    assert run.verdict()["verdict"] == "restored" and run.verdict()["ok"] is True


def test_an_outcome_absorbed_after_the_vf_reads_back_restored_keeps_what_it_wrote() -> None:
    """A worker's outcome reaches memory a pass after its step: the VF may read back
    restored first; what the step wrote still lands in the VF's record."""
    run = stable_then_unloaded(1)
    run.world.reload()
    run.world.netdev_appears(0)
    snap = run.world.observe(2.0)
    d = run.guard.decide(snap, run.memory)
    (restore,) = [a for a in d.actions if isinstance(a, RestoreVf)]
    outcome = run.world.perform(restore)  # the worker runs it; its outcome waits
    mem = run.guard.decide(run.world.observe(2.5), d.memory).memory
    assert mem.pfs[PF_PCI].restores[0].status == "restored"
    assert mem.pfs[PF_PCI].restores[0].written == ()
    mem = run.guard.absorb(mem, outcome, 3.0)
    assert set(mem.pfs[PF_PCI].restores[0].written) == {
        n for n, r in outcome.detail if r == "written"
    }
    assert mem.pfs[PF_PCI].restores[0].written


def test_vfs_destroyed_and_created_again_between_two_passes_are_a_disruption() -> None:
    """numvfs 0 and back faster than a pass: same count, new devices, blank config."""
    run = Run(World(3).configured())
    run.step(0.0)
    run.world.reload()  # new VF devices (new identities), no netdevs, default config
    run.step(1.0)
    assert run.phase() == "restoring"
    assert "3 VFs destroyed and created again" in run.memory.pfs[PF_PCI].why
    assert run.memory.pfs[PF_PCI].saved.vf(0).settings["vlan"] == 100  # type: ignore[union-attr]
    for i in range(3):
        run.world.netdev_appears(i)
    run.step(2.0)
    run.step(2.0)
    assert run.phase() == "restored" and run.world.writes == {0: 1, 1: 1, 2: 1}
    run.step(3.0)  # the restored devices are the snapshot's devices now: no new disruption
    assert run.phase() == "restored"


def test_a_restored_vf_whose_device_is_recreated_mid_restore_is_restored_again() -> None:
    run = stable_then_unloaded(2)
    run.world.reload()
    run.world.netdev_appears(0)
    run.step(2.0)
    assert run.memory.pfs[PF_PCI].restores[0].status == "restored"
    run.world.vfs[0] = type(run.world.vfs[0])(0)  # VF 0 destroyed and created again, blank
    run.step(2.5)
    assert run.memory.pfs[PF_PCI].restores[0].status == "waiting"
    run.world.netdev_appears(0)
    run.world.netdev_appears(1)
    run.step(3.0)
    run.step(3.0)
    assert run.phase() == "restored"
    assert run.world.writes == {0: 2, 1: 1}


def test_a_vf_driver_rebound_on_every_start_gets_its_netdev_settings_back() -> None:
    """The DOCA entrypoint unbinds and rebinds every VF: a new netdev with its defaults.

    While the netdev is away the snapshot keeps what it had; the new netdev is a
    disruption of that VF only (its PF-side config is intact and not rewritten).
    """
    run = Run(World(2).configured())
    run.step(0.0)
    run.world.rebind(1)
    run.step(1.0)  # unbound: no netdev for now
    assert run.phase() == "stable"
    saved = run.memory.pfs[PF_PCI].saved.vf(1)
    assert saved is not None and saved.netdev == "enp1s0f0v1" and saved.settings["mtu"] == 9000
    run.world.netdev_appears(1)  # bound again: a new netdev, MTU 1500 and down
    run.step(2.0)
    run.step(2.0)
    assert "1 VF netdevs created again" in run.memory.pfs[PF_PCI].why
    assert run.phase() == "restored"
    assert {i: sorted(f) for i, f in run.world.fields_written.items()} == {1: ["admin_up", "mtu"]}
    run.step(3.0)
    assert run.phase() == "restored"  # the new netdev is the snapshot's now


def test_config_that_already_matches_is_not_rewritten() -> None:
    """MOFED (or anyone) got there first: the guard reads, sees a match, writes nothing."""
    run = stable_then_unloaded(3)
    run.world.reload()
    for i in range(3):
        run.world.netdev_appears(i)
        run.world.vfs[i].settings.update(wanted(i))
    run.step(5.0)
    run.step(6.0)
    assert run.phase() == "restored"
    assert run.actions == []
    assert any("already matched" in e for e in run.events)


def test_a_vf_that_never_appears_is_reported_alone_and_blocks_no_other() -> None:
    run = stable_then_unloaded(4)
    run.world.reload()
    run.step(2.0)
    for i in (0, 1, 3):
        run.world.netdev_appears(i)
    run.step(3.0)
    assert run.phase() == "restoring"
    assert run.wake_at is not None and run.wake_at <= 2.0 + 60
    run.step(62.5)
    assert run.phase() == "degraded"
    v = run.verdict()
    assert v["verdict"] == "degraded" and v["ok"] is False
    assert v["reasons"] == (
        f"PF {PF_PCI} VF 2 (0000:01:00.5): its netdev did not appear within 60 s",
    )
    assert run.world.writes == {0: 1, 1: 1, 3: 1}
    # It shows up late: it gets its config back and the PF is whole again.
    run.world.netdev_appears(2)
    run.step(70.0)
    run.step(71.0)
    assert run.phase() == "restored"
    assert run.world.writes[2] == 1


def test_a_saved_vf_deadline_further_ahead_than_its_length_is_reanchored() -> None:
    """A restore deadline saved under another clock (a restart after the wall clock stepped
    back an hour) is clamped to ``vf_deadline_s`` once, not waited out for an hour."""
    run = stable_then_unloaded(2)
    run.world.reload()
    run.step(2.0)
    assert run.phase() == "restoring"
    pf = run.memory.pfs[PF_PCI]
    far = {i: replace(r, deadline=2.0 + 3600) for i, r in pf.restores.items()}
    run.memory = replace(
        run.memory,
        pfs=MappingProxyType(
            {**run.memory.pfs, PF_PCI: replace(pf, restores=MappingProxyType(far))}
        ),
    )
    run.step(3.0)
    assert all(r.deadline <= 3.0 + 60 for r in run.memory.pfs[PF_PCI].restores.values())
    assert run.wake_at is not None and run.wake_at <= 3.0 + 60
    run.step(63.5)
    assert run.phase() == "degraded"  # within its own length of the clamp, not an hour


def test_failed_restore_backs_off_and_retries() -> None:
    run = stable_then_unloaded(2)
    run.world.reload()
    run.world.fail_next[0] = 2
    run.world.netdev_appears(0)
    run.world.netdev_appears(1)
    run.step(2.0)
    r0 = run.memory.pfs[PF_PCI].restores[0]
    assert r0.attempts == 1 and r0.next_try == 2.5 and "EIO" in (r0.error or "")
    run.step(2.2)  # before the backoff: nothing new for VF 0
    assert sum(1 for a in run.actions if isinstance(a, RestoreVf) and a.index == 0) == 1
    run.step(2.5)
    assert run.memory.pfs[PF_PCI].restores[0].next_try == 3.5  # 0.5 s, then 1 s
    run.step(3.5)
    run.step(3.6)
    assert run.phase() == "restored"


def test_eopnotsupp_is_recorded_once_and_not_retried() -> None:
    run = stable_then_unloaded(2)
    run.world.unsupported = {"link_state"}
    run.world.reload()
    run.world.netdev_appears(0)
    run.world.netdev_appears(1)
    run.step(2.0)
    run.step(3.0)
    run.step(4.0)
    mem = run.memory.pfs[PF_PCI]
    assert mem.unsupported == ("link_state",)
    assert run.phase() == "restored"
    assert run.world.writes == {0: 1, 1: 1}
    assert run.verdict()["pfs"][PF_PCI]["unsupported_fields"] == ["link_state"]  # type: ignore[index]


def test_numvfs_is_set_after_the_grace_period_when_the_agent_owns_it() -> None:
    run = stable_then_unloaded(3)
    run.world.reload(numvfs=0)
    run.step(2.0)
    assert run.phase() == "restoring" and not run.actions
    assert run.wake_at is not None and run.wake_at <= 32.0
    run.step(32.0)
    assert [a for a in run.actions if isinstance(a, SetNumVfs)] == [
        SetNumVfs("sriov", PF_PCI, 3, False, run.actions[0].reason)  # type: ignore[attr-defined]
    ]
    assert run.world.numvfs == 3


def test_numvfs_lower_than_the_snapshot_goes_through_zero() -> None:
    run = stable_then_unloaded(3)
    run.world.reload(numvfs=1)
    run.step(2.0)
    run.step(40.0)
    sets = [a for a in run.actions if isinstance(a, SetNumVfs)]
    assert sets and sets[0].through_zero and sets[0].numvfs == 3


@pytest.mark.parametrize("owner", ["sriov-operator", "mofed"])
def test_numvfs_owned_by_another_party_is_never_written(owner: str) -> None:
    policy = SriovPolicy(numvfs_owner=owner, numvfs_grace_s=30, vf_deadline_s=60)
    run = stable_then_unloaded(3, policy)
    run.world.reload(numvfs=0)
    for t in (2.0, 40.0, 61.0, 63.0):
        run.step(t)
    assert not [a for a in run.actions if isinstance(a, SetNumVfs)]
    assert run.phase() == "degraded"  # and it says so, per VF


def test_pf_that_vanished_for_good_is_degraded() -> None:
    run = Run(World(2).configured(), SriovPolicy(pf_gone_s=100))
    run.step(0.0)
    run.world.observe = lambda now: _without_pf(World.observe(run.world, now))  # type: ignore[method-assign]
    run.step(1.0)
    assert run.phase() == "disrupted"
    run.step(50.0)
    assert run.phase() == "disrupted"
    run.step(101.0)
    assert run.phase() == "degraded"
    assert "vanished" in run.verdict()["reasons"][0]  # type: ignore[index]


def _without_pf(snap: NodeSnapshot) -> NodeSnapshot:
    from dataclasses import replace

    return replace(snap, sriov=replace(snap.sriov, pfs=MappingProxyType({})))


def test_vf_index_past_totalvfs_fails_on_its_own() -> None:
    run = stable_then_unloaded(3)
    run.world.reload()
    run.world.totalvfs = 2
    for i in range(3):
        run.world.netdev_appears(i)
    run.step(2.0)
    run.step(3.0)
    assert run.phase() == "degraded"
    assert run.verdict()["reasons"] == (
        f"PF {PF_PCI} VF 2 (0000:01:00.5): VF index 2 is past sriov_totalvfs 2",
    )
    assert run.world.writes == {0: 1, 1: 1}


def test_memory_round_trips_through_json() -> None:
    run = stable_then_unloaded(3)
    run.world.reload()
    run.world.netdev_appears(1)
    run.step(2.0)
    doc = json.loads(json.dumps(run.guard.memory_to_json(run.memory)))
    back = run.guard.memory_from_json(doc)
    assert run.guard.memory_to_json(back) == doc
    with pytest.raises(ValueError, match="phase 'exploded'"):
        bad = json.loads(json.dumps(doc))
        bad["pfs"][PF_PCI]["phase"] = "exploded"
        run.guard.memory_from_json(bad)


def test_persisted_snapshot_is_adopted_when_memory_is_lost() -> None:
    run = stable_then_unloaded(2)
    persisted = snapshot_from_json(
        json.loads(json.dumps(snapshot_to_json({PF_PCI: run.memory.pfs[PF_PCI].saved})))
    )
    fresh = Run(run.world)
    fresh.world.reload()
    snap = fresh.world.observe(5.0)
    from dataclasses import replace

    snap = replace(snap, sriov=replace(snap.sriov, persisted=PersistedSnapshot(persisted)))
    d = fresh.guard.decide(snap, SriovMemory())
    assert d.memory.pfs[PF_PCI].phase == "restoring"
    assert any("adopted the persisted snapshot" in e for e in d.events)


# -- bad input in the persisted snapshot ------------------------------------------------------


def _doc() -> dict[str, object]:
    run = Run(World(2).configured())
    run.step(0.0)
    return json.loads(json.dumps(snapshot_to_json({PF_PCI: run.memory.pfs[PF_PCI].saved})))


def test_snapshot_with_unknown_schema_version_is_refused() -> None:
    doc = _doc()
    doc["version"] = 99
    with pytest.raises(SriovValueError, match="schema version 99 is not 1"):
        snapshot_from_json(doc)


def test_snapshot_with_a_mac_that_does_not_parse_names_it() -> None:
    doc = _doc()
    doc["pfs"][0]["vfs"][1]["settings"]["mac"] = "02:00:zz:00:00:01"  # type: ignore[index]
    with pytest.raises(SriovValueError) as exc:
        snapshot_from_json(doc)
    assert str(exc.value) == (
        "pfs[0].vfs[1].settings: mac: '02:00:zz:00:00:01' is not a MAC address (xx:xx:xx:xx:xx:xx)"
    )


def test_a_pf_in_a_five_digit_pci_domain_round_trips() -> None:
    """VMD puts devices in domains like 10000: a snapshot of one is not 'corrupt'."""
    doc = _doc()
    doc["pfs"][0]["pci"] = "10000:e1:00.0"  # type: ignore[index]
    assert list(snapshot_from_json(doc)) == ["10000:e1:00.0"]


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("vfs", 0, "settings", "vlan"), 5000, "vlan: 5000 is not an integer in 0..4095"),
        (("vfs", 0, "settings", "link_state"), "up", "link_state: 'up' is not one of"),
        (("vfs", 0, "settings", "colour"), 1, "unknown VF setting 'colour'"),
        (("vfs", 1, "index"), 0, "VF 0 appears twice"),
        (("pci",), "01:00.0", "'01:00.0' is not a PCI address"),
        (("numvfs",), -1, "numvfs is -1, not a count"),
    ],
)
def test_snapshot_bad_values(path: tuple[object, ...], value: object, message: str) -> None:
    doc = _doc()
    target = doc["pfs"][0]  # type: ignore[index]
    for key in path[:-1]:
        target = target[key]  # type: ignore[index]
    target[path[-1]] = value  # type: ignore[index]
    with pytest.raises(SriovValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        saved_pf_from_json(doc["pfs"][0], "pfs[0]")  # type: ignore[index]


# -- the property ------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    st.integers(min_value=1, max_value=12).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.lists(st.floats(0.0, 90.0), min_size=n, max_size=n),
            st.sets(st.integers(0, n - 1), max_size=n),
            st.sampled_from(["agent", "mofed"]),
        )
    )
)
def test_any_appearance_order_restores_each_vf_that_appears_in_time_exactly_once(
    case: tuple[int, list[float], set[int], str],
) -> None:
    """For any order and timing of netdev appearances, every VF whose netdev appears ends
    restored, written once (one after its deadline too, when it shows up); the VFs that never
    appear are reported, alone."""
    n, times, never, _owner = case
    run = stable_then_unloaded(n, POLICY)
    run.world.reload()
    back = 2.0
    run.step(back)
    deadline = back + POLICY.vf_deadline_s
    schedule = sorted((t + back, i) for i, t in enumerate(times) if i not in never)
    now = back
    for t, i in schedule:
        # passes the guard asked for (timers) before this appearance
        while run.wake_at is not None and run.wake_at < t:
            now = run.wake_at
            run.step(now)
        run.world.netdev_appears(i)
        now = t
        run.step(now)
    while run.wake_at is not None and run.phase() == "restoring":
        now = max(now, run.wake_at)
        run.step(now)
    appeared = {i for _t, i in schedule}
    late = {i for t, i in schedule if t >= deadline}
    restores = run.memory.pfs[PF_PCI].restores
    for i in range(n):
        if i in appeared:
            assert restores[i].status == "restored", (i, restores[i])
            assert run.world.writes.get(i) == 1
            assert all(run.world.vfs[i].settings[k] == v for k, v in wanted(i).items())
        else:
            assert restores[i].status == "failed"
            assert run.world.writes.get(i, 0) == 0
    assert run.phase() == ("restored" if appeared == set(range(n)) else "degraded")
    assert late <= appeared


_JSON_LEAF = st.none() | st.booleans() | st.integers(-3, 2**64) | st.floats() | st.text(max_size=4)
_JSON = st.recursive(
    _JSON_LEAF,
    lambda inner: (
        st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=4), inner, max_size=2)
    ),
    max_leaves=6,
)


def _paths(node: object, path: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    out = [path]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*path, i))
    return out


@settings(max_examples=300, deadline=None)
@given(where=st.integers(min_value=0), value=_JSON)
def test_saved_memory_of_any_shape_is_parsed_or_refused_with_a_value_error(
    where: int, value: object
) -> None:
    """One node of a real memory document replaced by any JSON value: the guard either
    takes it or says why (ValueError, so the agent moves it aside); nothing else escapes."""
    run = stable_then_unloaded(2)
    run.world.reload()
    run.world.netdev_appears(0)
    run.step(2.0)
    doc = json.loads(json.dumps(run.guard.memory_to_json(run.memory)))
    paths = _paths(doc)[1:]
    path = paths[where % len(paths)]
    node = doc
    for key in path[:-1]:
        node = node[key]  # type: ignore[index]
    node[path[-1]] = value  # type: ignore[index]
    with contextlib.suppress(ValueError):
        run.guard.memory_from_json(doc)


def test_a_restore_in_progress_for_a_pf_that_went_away_is_cancelled() -> None:
    """Cancel at a safe point: the PF goes while its restore plan runs; the guard's next
    decision has no restore for it, and the worker starts none of the plan's other VFs."""
    import threading

    from nodeagent.core.actions import ActionOutcome, Plan
    from nodeagent.loop.workers import PlanWorkers

    run = stable_then_unloaded(4)
    run.world.reload()
    for i in range(4):
        run.world.netdev_appears(i)
    snap = run.world.observe(2.0)
    d = run.guard.decide(snap, run.memory)
    restores = [a for a in d.actions if isinstance(a, RestoreVf)]
    assert len(restores) == 4
    entered, release = threading.Event(), threading.Event()
    started: list[int] = []

    def perform(action: object) -> ActionOutcome:
        assert isinstance(action, RestoreVf)
        started.append(action.index)
        if len(started) == 1:
            entered.set()
            assert release.wait(WAIT)
        return ActionOutcome(action=action, ok=True)

    w = PlanWorkers(("sriov",), perform, step_timeout_s=lambda _a: 30.0)  # type: ignore[arg-type]
    try:
        w.submit({"sriov": Plan("sriov", tuple(restores), "parallel", bound=1)})
        assert entered.wait(WAIT)
        gone = run.guard.decide(_without_pf(run.world.observe(3.0)), d.memory)
        assert not [a for a in gone.actions if isinstance(a, RestoreVf)]
        w.submit({"sriov": Plan("sriov", gone.actions)})
        release.set()
        assert w.wait_idle(WAIT)
        (finished,) = w.take_finished()
        assert finished.superseded and len(finished.not_done) == 3
        assert len(started) == 1  # the step in flight ended; no other VF was started
    finally:
        release.set()
        w.close(WAIT)
