"""The peermem gate as a pure function: node states in, verdict/reasons/actions out."""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeagent.core.actions import ActionOutcome, LoadModuleFile, UnloadModule
from nodeagent.core.peermem import PEERMEM, RDMA_STACK, PeermemGate, PeermemMemory, PeermemPolicy
from nodeagent.core.snapshot import DiskModule, FileId, NodeSnapshot
from tests.snapshots import (
    BLACKLIST,
    CRC_OK,
    CRC_OTHER,
    GEN_A,
    GEN_B,
    PEER_SYMS,
    READY,
    blacklist_file,
    disk,
    flag,
    healthy,
    loaded,
    with_disk,
    with_files,
    with_modules,
    with_validations,
)

GATE = PeermemGate()


def decide(snap: NodeSnapshot, memory: PeermemMemory | None = None, gate: PeermemGate = GATE):
    return gate.decide(snap, memory or gate.initial_memory())


def test_healthy_node_opens_and_loads_peermem_from_the_gpu_driver_root() -> None:
    d = decide(healthy())
    assert d.verdict.verdict == "open", d.verdict.reasons
    assert d.verdict.reasons == ()
    assert d.actions == (
        LoadModuleFile(
            guard="peermem",
            module=PEERMEM,
            path=healthy().disk["nvidia_peermem"].path or "",
            params=(),
            reason=d.actions[0].reason,
        ),
    )
    assert d.actions[0].path.startswith("run/nvidia/driver/")


def test_evidence_carries_the_gpu_markers_and_the_mofed_lock() -> None:
    snap = with_validations(healthy(), ".driver-ctr-ready", "toolkit-ready")
    ev = decide(snap).verdict.evidence
    assert ev["gpu_validations"] == [".driver-ctr-ready", "toolkit-ready"]
    assert ev["mofed_lock_present"] is False


def test_load_carries_configured_parameters() -> None:
    gate = PeermemGate(PeermemPolicy(load_params=("peerdirect_support=0",)))
    (action,) = decide(healthy(), gate=gate).actions
    assert isinstance(action, LoadModuleFile)
    assert action.params == ("peerdirect_support=0",)


def test_seed_001_at_1157_flag_absent_new_mlx5_core_half_loaded() -> None:
    """11:57: old HCA driver unloaded, new mlx5_core still 'coming', no ready flag yet."""
    snap = healthy(GEN_A)
    snap = with_modules(
        snap,
        mlx5_core=loaded("mlx5_core", GEN_A["mlx5_core"], initstate="coming"),
        mlx5_ib=None,
        ib_uverbs=None,
    )
    snap = with_files(snap, flag(False))
    d = decide(snap)
    assert d.verdict.verdict == "closed"
    reasons = "\n".join(d.verdict.reasons)
    assert "MOFED ready flag run/mellanox/drivers/.driver-ready is absent" in reasons
    assert "mlx5_core is not live (initstate coming)" in reasons
    assert "mlx5_ib is not loaded" in reasons
    assert "ib_uverbs is not loaded" in reasons
    assert not any(isinstance(a, LoadModuleFile) for a in d.actions)


def test_flag_that_survived_a_mlx5_core_reload_is_stale_until_recreated() -> None:
    gate = GATE
    mem = gate.initial_memory()
    # 1. mlx5_core leaves while the old flag is still there (RESTORE_DRIVER=false case).
    going = with_modules(
        healthy(), mlx5_core=loaded("mlx5_core", GEN_B["mlx5_core"], initstate="going")
    )
    d = gate.decide(going, mem)
    assert any("MOFED restart began" in e for e in d.events)
    # 2. the stack is back, the flag is the same incarnation: stale.
    d = gate.decide(healthy(), d.memory)
    assert d.verdict.verdict == "closed"
    assert any("stale" in r for r in d.verdict.reasons)
    assert d.actions == ()
    # 3. MOFED touches the flag (new mtime): fresh, open.
    fresh = with_files(healthy(), flag(True, inode=100, mtime=2))
    d = gate.decide(fresh, d.memory)
    assert d.verdict.verdict == "open", d.verdict.reasons
    assert any("(re)created" in e for e in d.events)


def test_blacklist_file_present_closes_the_gate() -> None:
    snap = with_files(healthy(), blacklist_file(True))
    d = decide(snap)
    assert d.verdict.verdict == "closed"
    assert any("restarting openibd" in r for r in d.verdict.reasons)


def test_srcversion_mismatch_names_module_and_both_identities() -> None:
    snap = with_modules(healthy(), ib_core=loaded("ib_core", GEN_A["ib_core"]))
    d = decide(snap)
    assert d.verdict.verdict == "closed"
    (reason,) = [r for r in d.verdict.reasons if r.startswith("ib_core")]
    assert GEN_A["ib_core"] in reason and GEN_B["ib_core"] in reason
    assert "not the one on disk" in reason


def test_build_id_match_without_srcversion_opens() -> None:
    """Debian's in-tree modules have no srcversion: the GNU build-id decides."""
    snap = healthy()
    bid = "ab" * 20
    for name in RDMA_STACK:
        snap = with_modules(snap, **{name: loaded(name, None, build_id=bid)})
        snap = with_disk(snap, **{name: replace(snap.disk[name], srcversion=None, build_id=bid)})
    d = decide(snap)
    assert d.verdict.verdict == "open", d.verdict.reasons


def test_build_id_mismatch_closes() -> None:
    snap = with_modules(healthy(), mlx5_core=loaded("mlx5_core", None, build_id="aa" * 20))
    snap = with_disk(snap, mlx5_core=disk("mlx5_core", None, build_id="bb" * 20))
    d = decide(snap)
    assert any("build-id " + "aa" * 20 in r and "bb" * 20 in r for r in d.verdict.reasons)


def test_no_identity_to_compare_closes_with_a_reason() -> None:
    snap = with_modules(healthy(), mlx5_ib=loaded("mlx5_ib", None))
    d = decide(snap)
    assert any(r.startswith("mlx5_ib: cannot tell") for r in d.verdict.reasons)


def test_module_missing_on_disk_closes() -> None:
    missing = replace(disk("mlx5_ib", None), path=None, problem="not in modules.dep")
    snap = with_disk(healthy(), mlx5_ib=missing)
    d = decide(snap)
    assert any("no module file on disk" in r for r in d.verdict.reasons)


def test_nvidia_absent_closes() -> None:
    d = decide(with_modules(healthy(), nvidia=None))
    assert d.verdict.reasons == ("nvidia is not loaded",)
    assert d.actions == ()


def test_unreadable_initstate_is_a_reason_not_a_crash() -> None:
    bad = loaded(
        "ib_uverbs",
        GEN_B["ib_uverbs"],
        initstate=None,
        problems=("initstate is 'garbage' (expected live, coming or going)",),
    )
    d = decide(with_modules(healthy(), ib_uverbs=bad))
    assert "ib_uverbs is not live (initstate unreadable)" in d.verdict.reasons


def test_abi_preflight_crc_mismatch_closes_with_the_2868_reason() -> None:
    snap = healthy()
    ib = replace(
        snap.disk["ib_core"], exported_crcs=MappingProxyType(dict.fromkeys(PEER_SYMS, CRC_OTHER))
    )
    d = decide(with_disk(snap, ib_core=ib))
    # MOFED is ready and final: no wait helps. The verdict says what to do, first.
    assert d.verdict.verdict == "rebuild" and not d.verdict.ok
    first = d.verdict.reasons[0]
    assert first.startswith("nvidia-peermem.ko (") and "built against another ib_core" in first
    assert "recreate the GPU driver pod" in first and "gpu-operator#2868" in first
    assert (
        "nvidia_peermem needs ib_register_peer_memory_client CRC 0x368a11cb "
        "but the loaded ib_core exports 0x8d5feb7b"
    ) in d.verdict.reasons
    assert d.verdict.evidence["release_held"] is True  # a held load may go: it fails anyway
    assert d.verdict.evidence["abi"]["mismatched"]
    assert d.actions == ()
    samples = {s.family: s.value for s in GATE.metric_samples(d.verdict, ()) if not s.labels}
    assert samples["nodeagent_peermem_rebuild_needed"] == 1.0


def test_a_crc_mismatch_while_mofed_is_not_ready_is_only_closed() -> None:
    """Mid-restart the loaded ib_core is not MOFED's last word: keep holding, no rebuild."""
    snap = healthy()
    ib = replace(
        snap.disk["ib_core"], exported_crcs=MappingProxyType(dict.fromkeys(PEER_SYMS, CRC_OTHER))
    )
    d = decide(with_files(with_disk(snap, ib_core=ib), flag(False)))
    assert d.verdict.verdict == "closed"
    assert d.verdict.evidence["release_held"] is False
    samples = {s.family: s.value for s in GATE.metric_samples(d.verdict, ()) if not s.labels}
    assert samples["nodeagent_peermem_rebuild_needed"] == 0.0


def test_an_unreadable_peermem_file_is_closed_not_rebuild() -> None:
    snap = healthy()
    pm = replace(snap.disk[PEERMEM], problem="truncated ELF")
    d = decide(with_disk(snap, nvidia_peermem=pm))
    assert d.verdict.verdict == "closed" and d.verdict.evidence["release_held"] is False


def test_abi_preflight_unverifiable_provider_is_evidence_not_a_reason() -> None:
    snap = with_modules(healthy(), nvidia=loaded("nvidia", None))  # no identity for nvidia
    d = decide(snap)
    assert d.verdict.verdict == "open"
    assert "ib_register_peer_memory_client" in d.verdict.evidence["abi"]["checked"]


def test_a_saved_retry_further_ahead_than_its_cap_is_reanchored() -> None:
    """Saved under another clock (a restart after the wall clock stepped back an hour): the
    backoff is clamped to its cap once, not honoured for an hour."""
    snap = healthy()
    far = replace(GATE.initial_memory(), failures=3, retry_at=snap.now + 3600)
    d = decide(snap, far)
    assert d.memory.retry_at == snap.now + GATE.policy.retry_max_s
    again = decide(replace(snap, now=snap.now + 1), d.memory)
    assert again.memory.retry_at == d.memory.retry_at  # not moved again


def test_host_mofed_mode_ignores_the_container_markers() -> None:
    gate = PeermemGate(PeermemPolicy(mofed="host"))
    snap = with_files(healthy(), flag(False))
    d = decide(snap, gate=gate)
    assert d.verdict.verdict == "open", d.verdict.reasons


def test_restart_unloads_idle_peermem_at_once() -> None:
    base = with_modules(healthy(), nvidia_peermem=loaded(PEERMEM, "P" * 23, refcnt=0))
    d = decide(base)
    assert d.actions == ()
    d2 = GATE.decide(with_files(base, flag(False)), d.memory)
    assert [type(a) for a in d2.actions] == [UnloadModule]
    assert d2.actions[0].module == PEERMEM


def test_restart_unloads_peermem_only_once_it_is_live() -> None:
    # Another party's load still in its init: the kernel would refuse the unload (EBUSY).
    coming = loaded(PEERMEM, "P" * 23, refcnt=0, initstate="coming")
    snap = with_files(with_modules(healthy(), nvidia_peermem=coming), flag(False))
    d = decide(snap)
    assert d.actions == ()
    live = with_modules(snap, nvidia_peermem=replace(coming, initstate="live"))
    assert [type(a) for a in GATE.decide(live, d.memory).actions] == [UnloadModule]


def test_restart_leaves_busy_peermem_and_says_who_holds_it() -> None:
    busy = loaded(PEERMEM, "P" * 23, refcnt=3, holders=("gdrdrv",))
    snap = with_files(with_modules(healthy(), nvidia_peermem=busy), flag(False))
    d = decide(snap)
    assert d.actions == ()
    assert any("refcnt 3" in e and "gdrdrv" in e for e in d.events)


def test_failed_load_backs_off_exponentially_and_keeps_the_kernel_reason() -> None:
    gate = PeermemGate(PeermemPolicy(retry_base_s=5, retry_max_s=60))
    snap = healthy(now=1000)
    d = gate.decide(snap, gate.initial_memory())
    (load,) = d.actions
    failed = ActionOutcome(
        action=load,
        ok=False,
        errno=22,
        error="load nvidia_peermem: Invalid argument (EINVAL)",
        kernel_messages=(
            "nvidia_peermem: disagrees about version of symbol ib_register_peer_memory_client",
        ),
    )
    mem = gate.absorb(d.memory, failed, now=1000)
    assert mem.retry_at == 1005 and mem.failures == 1
    assert "disagrees about version" in (mem.last_error or "")
    assert gate.decide(replace(snap, now=1004), mem).actions == ()
    assert gate.decide(replace(snap, now=1004), mem).wake_at == 1005
    assert len(gate.decide(replace(snap, now=1005), mem).actions) == 1
    for _ in range(10):
        mem = gate.absorb(mem, failed, now=2000)
    assert mem.retry_at == 2060  # capped


def test_memory_round_trips_through_json_and_rejects_garbage() -> None:
    mem = PeermemMemory(
        restart_pending=True,
        stale_flag=FileId(1, 2, 3),
        failures=2,
        retry_at=5.5,
        last_error="x",
        last_signals=("a",),
    )
    assert GATE.memory_from_json(GATE.memory_to_json(mem)) == mem
    for bad in (
        {"stale_flag": "nope"},
        {"failures": "many"},
        {"restart_pending": "yes"},
        {"last_signals": [1]},
    ):
        with pytest.raises(ValueError, match="peermem memory is malformed"):
            GATE.memory_from_json(bad)


# -- property: over any sequence of snapshots ---------------------------------


def _variant(
    flag_state: int,
    blacklist: bool,
    mlx5: str,
    stack_gen: str,
    nvidia: bool,
    peermem: str,
    abi_ok: bool,
    now: float,
) -> NodeSnapshot:
    snap = healthy(GEN_B, now=now)
    if flag_state == 0:
        snap = with_files(snap, flag(False))
    else:
        snap = with_files(snap, flag(True, mtime=flag_state))
    if blacklist:
        snap = with_files(snap, blacklist_file(True))
    if mlx5 == "absent":
        snap = with_modules(snap, mlx5_core=None)
    elif mlx5 != "live":
        snap = with_modules(snap, mlx5_core=loaded("mlx5_core", GEN_B["mlx5_core"], initstate=mlx5))
    if stack_gen == "A":
        snap = with_modules(snap, ib_core=loaded("ib_core", GEN_A["ib_core"]))
    if not nvidia:
        snap = with_modules(snap, nvidia=None)
    if peermem != "absent":
        snap = with_modules(
            snap, nvidia_peermem=loaded(PEERMEM, "P" * 23, refcnt=0 if peermem == "idle" else 1)
        )
    if not abi_ok:
        ib = replace(
            snap.disk["ib_core"],
            exported_crcs=MappingProxyType(dict.fromkeys(PEER_SYMS, CRC_OTHER)),
        )
        snap = with_disk(snap, ib_core=ib)
    return snap


snapshots = st.builds(
    _variant,
    flag_state=st.integers(0, 3),
    blacklist=st.booleans(),
    mlx5=st.sampled_from(["live", "coming", "going", "absent"]),
    stack_gen=st.sampled_from(["A", "B"]),
    nvidia=st.booleans(),
    peermem=st.sampled_from(["absent", "idle", "busy"]),
    abi_ok=st.booleans(),
    now=st.floats(0, 1e6),
)


def _conditions_hold(snap: NodeSnapshot, stale: bool) -> bool:
    mods = snap.modules
    return (
        "nvidia" in mods
        and mods["nvidia"].live
        and snap.file(READY).present
        and not stale
        and not snap.file(BLACKLIST).present
        and all(n in mods and mods[n].live for n in RDMA_STACK)
        and mods["ib_core"].srcversion == GEN_B["ib_core"]
        and snap.disk["ib_core"].exported_crcs[PEER_SYMS[0]]
        == snap.disk["nvidia_peermem"].required_crcs[PEER_SYMS[0]]
    )


@settings(max_examples=300, deadline=None)
@given(st.lists(snapshots, min_size=1, max_size=12))
def test_property_no_load_while_any_condition_fails_and_unload_on_restart(seq) -> None:
    mem = GATE.initial_memory()
    stale_flag: FileId | None = None
    pending = False
    prev_signals = False
    for snap in seq:
        signals = (
            not snap.file(READY).present
            or snap.file(BLACKLIST).present
            or "mlx5_core" not in snap.modules
            or snap.modules["mlx5_core"].initstate == "going"
        )
        # Independent model of the stale-flag rule.
        if signals:
            pending = True
            stale_flag = snap.file(READY).ident if snap.file(READY).present else None
        elif pending and snap.file(READY).ident != stale_flag:
            pending = False
        d = GATE.decide(snap, mem)
        loads = [a for a in d.actions if isinstance(a, LoadModuleFile)]
        unloads = [a for a in d.actions if isinstance(a, UnloadModule)]
        if loads:
            assert _conditions_hold(snap, pending), d.verdict.reasons
        assert (d.verdict.verdict == "open") == _conditions_hold(snap, pending)
        peer = snap.modules.get(PEERMEM)
        if signals and not prev_signals and peer is not None and peer.refcnt == 0:
            assert unloads, "first snapshot of a MOFED restart must unload idle peermem"
        if peer is not None and peer.refcnt:
            assert not unloads
        prev_signals = signals
        mem = d.memory


# -- before the GPU driver container has mounted its root (issue 65) ------------------
# The real `nvidia-driver init` loads nvidia-peermem and only then bind-mounts its root at
# run/nvidia/driver (gpu-driver-container ubuntu22.04/nvidia-driver 842-843): until then
# no tree the agent reads has the file.

DRIVER_ROOT = "run/nvidia/driver"


def unmounted(snap: NodeSnapshot, listed: tuple[str, ...] = ()) -> NodeSnapshot:
    gone = DiskModule(
        name=PEERMEM,
        path=None,
        problem=f"not in modules.dep under {DRIVER_ROOT}/lib/modules/k or lib/modules/k",
    )
    snap = with_disk(snap, nvidia_peermem=gone)
    return replace(snap, listings=MappingProxyType({**snap.listings, DRIVER_ROOT: listed}))


def test_with_the_driver_root_not_mounted_the_gate_vouches_for_the_stack_and_says_so() -> None:
    d = decide(unmounted(healthy()))
    assert d.verdict.verdict == "open" and d.verdict.ok, d.verdict.reasons
    (note,) = d.verdict.notes
    assert "not mounted yet" in note and DRIVER_ROOT in note
    assert d.verdict.evidence["abi"]["deferred"] == note
    assert d.verdict.to_json()["notes"] == [note]
    assert d.actions == ()  # nothing to load from: the agent loads nothing
    assert d.events == ()  # and says nothing each pass: the note is the word


def test_with_the_driver_root_not_mounted_a_mofed_restart_still_closes_the_gate() -> None:
    snap = with_files(unmounted(healthy()), flag(present=False))
    d = decide(snap)
    assert d.verdict.verdict == "closed" and not d.verdict.ok
    assert any("ready flag" in r for r in d.verdict.reasons)


def test_a_mounted_driver_root_without_peermem_still_closes_the_gate() -> None:
    d = decide(unmounted(healthy(), listed=("lib", "usr")))
    assert d.verdict.verdict == "closed" and d.verdict.notes == ()
    assert any(r.startswith("cannot verify nvidia_peermem.ko") for r in d.verdict.reasons)


def test_an_unreadable_driver_root_is_not_an_unmounted_one() -> None:
    snap = unmounted(healthy())
    snap = replace(snap, problems=(f"{DRIVER_ROOT} unreadable: Too many levels of symbolic links",))
    d = decide(snap)
    assert d.verdict.verdict == "closed" and d.verdict.notes == ()


# -- the held file judged, not the one by its name on disk (issue 65) -----------------

HELD_PATH = "/lib/modules/k/kernel/drivers/video/nvidia-peermem.ko"


def held(crc: int = CRC_OK, vermagic: str | None = None, problem: str | None = None):
    from nodeagent.core.snapshot import HeldModule

    mod = DiskModule(
        name=PEERMEM,
        path=HELD_PATH,
        depends=("ib_core", "nvidia"),
        required_crcs=MappingProxyType(dict.fromkeys(PEER_SYMS, crc)),
        problem=problem,
    )
    return HeldModule((1, 2, 3, 4), HELD_PATH, mod, vermagic)


def with_held(snap: NodeSnapshot, *files) -> NodeSnapshot:
    return replace(unmounted(snap), held=files)


def test_a_held_file_that_agrees_with_the_final_stack_goes() -> None:
    d = decide(with_held(healthy(), held(vermagic=f"{healthy().kernel} SMP mod_unload")))
    (entry,) = d.verdict.evidence["held"]
    assert entry["verdict"] == "go" and entry["file"] == [1, 2, 3, 4]
    assert "agrees with it (2 symbol CRCs checked)" in entry["reason"]
    assert d.verdict.verdict == "open"


def test_a_held_file_waits_while_the_stack_is_not_final_whatever_its_crcs() -> None:
    snap = with_files(with_held(healthy(), held(), held(CRC_OTHER)), flag(present=False))
    d = decide(snap)
    assert [e["verdict"] for e in d.verdict.evidence["held"]] == ["wait", "wait"]
    assert "ready flag" in d.verdict.evidence["held"][1]["reason"]
    assert d.verdict.verdict == "closed"


def test_a_held_file_built_against_another_ib_core_is_let_go_as_rebuild_naming_both_crcs() -> None:
    d = decide(with_held(healthy(), held(CRC_OTHER)))
    (entry,) = d.verdict.evidence["held"]
    assert entry["verdict"] == "rebuild"
    sym = "ib_register_peer_memory_client"
    assert f"needs {sym} CRC {CRC_OTHER:#010x}" in entry["reason"]
    assert f"exports {CRC_OK:#010x}" in entry["reason"]
    # The gate says so too: recreate the driver pod; what it holds is let go.
    assert d.verdict.verdict == "rebuild" and not d.verdict.ok
    assert d.verdict.reasons[0].startswith(entry["reason"])
    assert d.verdict.evidence["release_held"] is True


def test_an_unreadable_held_file_is_never_trusted() -> None:
    d = decide(with_held(healthy(), held(problem="truncated ELF")))
    (entry,) = d.verdict.evidence["held"]
    assert entry["verdict"] == "wait" and "cannot verify the held" in entry["reason"]


def test_a_held_file_for_another_kernel_is_let_go_as_rebuild() -> None:
    d = decide(with_held(healthy(), held(vermagic="6.99.0-other SMP mod_unload")))
    (entry,) = d.verdict.evidence["held"]
    assert entry["verdict"] == "rebuild" and "built for kernel 6.99.0-other" in entry["reason"]


def test_the_gate_needs_the_held_files_only_with_the_hold_on() -> None:
    assert not GATE.needs().held
    assert PeermemGate(PeermemPolicy(hold_loads="fanotify")).needs().held


# -- MOFED's module tree not on the host (DOCA shares only its headers: issue 65) -----

INBOX_DIR = "lib/modules/k/kernel/drivers/infiniband"


def unshared(snap: NodeSnapshot, inbox_same_as_loaded: bool = False) -> NodeSnapshot:
    """No MOFED tree for this kernel on the host; the stack's files found are the host's
    inbox builds (other identities than the loaded ones, unless told)."""
    disks = {}
    for name in RDMA_STACK:
        sv = snap.modules[name].srcversion if inbox_same_as_loaded else "1NB0X00000000000000000"
        disks[name] = disk(name, sv, path=f"{INBOX_DIR}/{name}.ko")
    snap = with_disk(snap, **disks)
    listings = {**snap.listings, "run/mellanox/drivers/lib/modules": ("some-other-kernel",)}
    return replace(snap, listings=MappingProxyType(listings))


def test_with_mofeds_tree_not_on_the_host_the_fresh_flag_vouches_and_it_says_so() -> None:
    d = decide(unshared(healthy()))
    assert d.verdict.verdict == "open" and d.verdict.reasons == ()
    (note,) = d.verdict.notes
    assert "MOFED's module files are not on the host" in note
    assert d.verdict.evidence["mofed_tree_on_host"] is False
    # The providers' CRCs cannot be read from MOFED's files: unverifiable, as evidence.
    assert d.verdict.evidence["abi"]["checked"] == []
    assert any("ib_core" in u for u in d.verdict.evidence["abi"]["unverifiable"])


def test_with_mofeds_tree_not_on_the_host_the_inbox_stack_loaded_closes_the_gate() -> None:
    d = decide(unshared(healthy(), inbox_same_as_loaded=True))
    assert d.verdict.verdict == "closed"
    assert any("the host's inbox build" in r for r in d.verdict.reasons), d.verdict.reasons


def test_with_mofeds_tree_not_on_the_host_a_restart_still_closes_the_gate() -> None:
    d = decide(with_files(unshared(healthy()), flag(present=False)))
    assert d.verdict.verdict == "closed"


def test_an_unreadable_mofed_tree_is_not_an_absent_one() -> None:
    snap = unshared(healthy())
    snap = replace(snap, problems=("run/mellanox/drivers/lib/modules unreadable: Not a directory",))
    d = decide(snap)
    assert d.verdict.verdict == "closed" and d.verdict.notes == ()
    assert any("is not the one on disk" in r for r in d.verdict.reasons)


def test_host_mofed_is_never_judged_as_an_unshared_container_tree() -> None:
    gate = PeermemGate(PeermemPolicy(mofed="host"))
    d = gate.decide(unshared(healthy()), gate.initial_memory())
    assert d.verdict.verdict == "closed" and d.verdict.notes == ()
