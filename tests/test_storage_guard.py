"""The storage guard as a pure function: node states in, verdict/reasons/plan out (seed 004)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import pytest

from nodeagent.core.actions import ActionOutcome, LoadModule, RemoveFile, UnloadModule, WriteFile
from nodeagent.core.snapshot import (
    FileFact,
    FileId,
    FileLock,
    LoadedModule,
    Mount,
    NodeSnapshot,
    NvmeController,
    NvmetPort,
)
from nodeagent.core.storage import HOLD_FILE, StorageGuard, StoragePolicy

READY = "run/mellanox/drivers/.driver-ready"
LOCK = "run/mellanox/drivers/.lock"
LOCK_DEV, LOCK_INO = (0, 25), 4711
GUARD = StorageGuard()


def mod(name: str, *holders: str, refcnt: int | None = None) -> LoadedModule:
    return LoadedModule(
        name=name,
        initstate="live",
        refcnt=len(holders) if refcnt is None else refcnt,
        srcversion=None,
        build_id=None,
        holders=tuple(holders),
    )


def node(
    *mods: LoadedModule,
    now: float = 0.0,
    ready: bool = False,
    locked: bool = False,
    hold: bool = False,
    mounts: tuple[Mount, ...] = (),
    nvme: tuple[NvmeController, ...] = (),
    ports: tuple[NvmetPort, ...] = (),
) -> NodeSnapshot:
    files = {
        READY: FileFact(READY, ready, FileId(9, 1, 1) if ready else None),
        LOCK: FileFact(LOCK, True, FileId(LOCK_INO, 1, 1), device=LOCK_DEV),
        HOLD_FILE: FileFact(HOLD_FILE, hold, FileId(5, 1, 1) if hold else None),
    }
    locks = (FileLock("FLOCK", "WRITE", 4242, LOCK_DEV, LOCK_INO),) if locked else ()
    return NodeSnapshot(
        now=now,
        kernel="5.15.0-170-generic",
        modules=MappingProxyType({m.name: m for m in mods}),
        disk=MappingProxyType({}),
        files=MappingProxyType(files),
        locks=locks,
        mounts=mounts,
        nvme=nvme,
        nvmet_ports=ports,
    )


# Seed 004's node: in-tree mlx5 (20 s), sunrpc (30 s), rpcrdma and its chain (1107 s).
INBOX = (
    mod("mlx5_core", "mlx5_ib"),
    mod("mlx5_ib"),
    mod("ib_uverbs", "mlx5_ib"),
)
CHAIN = (
    mod("ib_core", "mlx5_ib", "ib_uverbs", "rdma_cm", "ib_cm", "iw_cm", "rpcrdma"),
    mod("rdma_cm", "rpcrdma"),
    mod("ib_cm", "rdma_cm"),
    mod("iw_cm", "rdma_cm"),
    mod("sunrpc", "rpcrdma"),
    mod("rpcrdma"),
)


def seed_004(t: float) -> NodeSnapshot:
    mods: tuple[LoadedModule, ...] = ()
    if t >= 20:
        mods += (*INBOX, mod("ib_core", "mlx5_ib", "ib_uverbs"))
    if t >= 30:
        mods += (mod("sunrpc"),)
    if t >= 1107:
        mods = (*INBOX, *CHAIN)
    return node(*mods, now=t, locked=t >= 1200)


def run(snaps: list[NodeSnapshot], guard: StorageGuard = GUARD, performed: bool = True):
    mem = guard.initial_memory()
    out = []
    for snap in snaps:
        d = guard.decide(snap, mem)
        mem = d.memory
        for a in d.actions:
            mem = guard.absorb(mem, ActionOutcome(a, ok=True, performed=performed), snap.now)
        out.append(d)
    return out, mem


def test_seed_004_clear_until_mofed_is_pending_then_blocking_with_an_ordered_plan() -> None:
    decisions, mem = run([seed_004(t) for t in (20, 30, 1107, 1200)])
    assert [d.verdict.verdict for d in decisions] == ["clear", "clear", "clear", "blocking"]
    assert all(d.actions == () for d in decisions[:3])
    blocking = decisions[-1]
    assert not blocking.verdict.ok and blocking.strategy == "sequence"
    assert "rpcrdma" in blocking.verdict.reasons[0] and "pid 4242" in blocking.verdict.reasons[0]
    hold, *unloads = blocking.actions
    assert isinstance(hold, WriteFile) and hold.path == HOLD_FILE
    assert hold.content.startswith("# Written by nodeagent (storage guard)")
    assert "install rpcrdma /bin/false\n" in hold.content
    assert "install xprtrdma /bin/false\n" in hold.content
    order = [a.module for a in unloads if isinstance(a, UnloadModule)]
    # Holders first, computed from the graph: ib_core stays (mlx5_ib holds it).
    assert order == ["rpcrdma", "rdma_cm", "sunrpc", "ib_cm", "iw_cm"]
    assert mem.removed == ("rpcrdma",) and mem.holding


def test_after_removal_holding_then_ready_removes_hold_and_loads_back_from_mofed() -> None:
    _, mem = run([seed_004(1200)])
    held = node(*INBOX, mod("ib_core", "mlx5_ib"), now=1201, locked=True, hold=True)
    d = GUARD.decide(held, mem)
    assert (d.verdict.verdict, d.verdict.ok, d.actions) == ("holding", True, ())
    # MOFED crash-loops: between its tries it is not pending, the hold stays until ready.
    d = GUARD.decide(replace(held, locks=()), d.memory)
    assert d.verdict.verdict == "holding" and d.actions == ()
    ready = replace(
        held,
        locks=(),
        files=MappingProxyType({**held.files, READY: FileFact(READY, True, FileId(1, 2, 2))}),
    )
    d = GUARD.decide(ready, d.memory)
    assert d.verdict.verdict == "clear" and d.verdict.ok
    remove, load = d.actions
    assert isinstance(remove, RemoveFile) and remove.path == HOLD_FILE
    assert load == LoadModule("storage", "rpcrdma", ("run/mellanox/drivers", ""), load.reason)
    mem = GUARD.absorb(d.memory, ActionOutcome(remove, ok=True), 1300)
    mem = GUARD.absorb(mem, ActionOutcome(load, ok=True), 1300)
    assert mem.removed == () and not mem.holding


def test_an_active_rdma_mount_is_in_use_named_and_untouched() -> None:
    mount = Mount("/mnt/shared", "10.24.0.5:/shared", "nfs4", ("rw", "vers=4.1", "proto=rdma"))
    snap = node(*INBOX, *CHAIN[:-1], mod("rpcrdma", refcnt=1), locked=True, mounts=(mount,))
    d = GUARD.decide(snap, GUARD.initial_memory())
    assert d.verdict.verdict == "in-use" and not d.verdict.ok and d.actions == ()
    assert d.verdict.reasons[0] == (
        "rpcrdma is in use: NFS-over-RDMA mount /mnt/shared (10.24.0.5:/shared)"
    )


def test_an_nvme_of_rdma_controller_is_named() -> None:
    ctrl = NvmeController("nvme1", "rdma", "nqn.2026-11.io.example:vol1", "traddr=10.0.0.9")
    snap = node(
        mod("nvme_core", "nvme_fabrics", "nvme_rdma"),
        mod("nvme_fabrics", "nvme_rdma"),
        mod("nvme_rdma", refcnt=1),
        locked=True,
        nvme=(ctrl,),
    )
    d = GUARD.decide(snap, GUARD.initial_memory())
    assert d.verdict.verdict == "in-use"
    assert (
        "NVMe-oF controller nvme1 (subsystem nqn.2026-11.io.example:vol1)" in d.verdict.reasons[0]
    )


def test_a_controller_counts_even_when_the_module_has_no_reference() -> None:
    # The kernel drops nvme_rdma's reference once a controller is made: refcnt 0.
    ctrl = NvmeController("nvme1", "rdma", "nqn.2026-11.io.example:vol1")
    snap = node(mod("nvme_fabrics", "nvme_rdma"), mod("nvme_rdma"), locked=True, nvme=(ctrl,))
    d = GUARD.decide(snap, GUARD.initial_memory())
    assert d.verdict.verdict == "in-use" and d.actions == ()
    assert d.verdict.reasons[0].startswith("nvme_rdma is in use: NVMe-oF controller nvme1")


def test_an_nvme_root_disk_keeps_nvme_nvme_core_and_nvme_fabrics() -> None:
    local = NvmeController("nvme0", "pcie", "nqn.2014.08.org.nvmexpress:root")
    snap = node(
        mod("nvme", refcnt=2),  # the root disk: used, not by a module
        mod("nvme_core", "nvme", "nvme_fabrics", "nvme_rdma"),
        mod("nvme_fabrics", "nvme_rdma"),
        mod("nvme_rdma"),
        mod("rdma_cm", "nvme_rdma"),
        mod("ib_core", "rdma_cm", "nvme_rdma"),
        mod("crc64_rocksoft_generic", refcnt=1),  # a crypto module's handle: not a user
        locked=True,
        nvme=(local,),
    )
    d = GUARD.decide(snap, GUARD.initial_memory())
    assert d.verdict.verdict == "blocking"
    order = [a.module for a in d.actions if isinstance(a, UnloadModule)]
    assert order == ["nvme_rdma", "rdma_cm", "ib_core"]


def test_mofed_ready_is_clear_with_storage_loaded() -> None:
    snap = node(*INBOX, *CHAIN, ready=True)
    d = GUARD.decide(snap, GUARD.initial_memory())
    assert (d.verdict.verdict, d.verdict.ok, d.actions) == ("clear", True, ())


def test_the_flag_seen_removed_is_pending_without_the_lock() -> None:
    mem = GUARD.decide(node(*INBOX, ready=True), GUARD.initial_memory()).memory
    d = GUARD.decide(node(*INBOX, *CHAIN), mem)
    assert d.verdict.verdict == "blocking"
    assert "was removed" in d.verdict.reasons[0]


def test_a_holders_cycle_refuses_to_guess() -> None:
    snap = node(mod("rpcrdma", "loopy"), mod("loopy", "rpcrdma"), locked=True)
    d = GUARD.decide(snap, GUARD.initial_memory())
    assert d.verdict.verdict == "blocking" and d.actions == ()
    assert any("holders cycle among loopy, rpcrdma" in r for r in d.verdict.reasons)


def test_policies_unload_and_off() -> None:
    unload = StorageGuard(StoragePolicy(policy="unload"))
    d = unload.decide(seed_004(1200), unload.initial_memory())
    assert d.actions and not any(isinstance(a, WriteFile) for a in d.actions)
    off = StorageGuard(StoragePolicy(policy="off"))
    d = off.decide(seed_004(1200), off.initial_memory())
    assert d.verdict.verdict == "blocking" and d.actions == ()


def test_a_stale_hold_file_is_removed_at_start_unless_mofed_is_pending() -> None:
    d = GUARD.decide(node(*INBOX, hold=True), GUARD.initial_memory())
    assert d.verdict.verdict == "clear" and [type(a) for a in d.actions] == [RemoveFile]
    d = GUARD.decide(node(*INBOX, hold=True, locked=True), GUARD.initial_memory())
    assert d.verdict.verdict == "holding" and d.actions == ()


def test_a_failed_unload_backs_off_and_stops_the_plan_there() -> None:
    d = GUARD.decide(seed_004(1200), GUARD.initial_memory())
    failed = ActionOutcome(d.actions[1], ok=False, errno=16, error="rmmod rpcrdma: EBUSY")
    mem = GUARD.absorb(d.memory, failed, 1200)
    assert mem.failures == 1 and mem.retry_at == 1205 and mem.last_error == "rmmod rpcrdma: EBUSY"
    again = GUARD.decide(replace(seed_004(1200), now=1203), mem)
    assert again.actions == () and again.wake_at == 1205
    assert again.verdict.evidence["last_error"] == "rmmod rpcrdma: EBUSY"


def test_observe_mode_changes_no_memory_and_on_stop_removes_only_its_own_hold() -> None:
    _, mem = run([seed_004(1200)], performed=False)
    assert mem.removed == () and not mem.holding
    assert GUARD.on_stop(mem) == ()
    _, mem = run([seed_004(1200)])
    (stop,) = GUARD.on_stop(mem)
    assert stop == RemoveFile("storage", HOLD_FILE, stop.reason)


def test_memory_round_trips_and_bad_memory_is_refused() -> None:
    _, mem = run([seed_004(1200)])
    assert GUARD.memory_from_json(GUARD.memory_to_json(mem)) == mem
    with pytest.raises(ValueError, match="storage memory is malformed: removed"):
        GUARD.memory_from_json({"removed": "rpcrdma"})


def test_policy_parsing_names_bad_values() -> None:
    from nodeagent.core.storage import parse_policy
    from nodeagent.errors import NodeagentError

    pol = parse_policy({"policy": "unload", "modules": ["rpcrdma", "xprtrdma"]}, StoragePolicy())
    assert pol.policy == "unload" and pol.roots == ("rpcrdma",)
    for table, msg in (
        ({"policy": "yank"}, "config storage.policy: expected 'unload' or 'hold' or 'off'"),
        ({"modules": ["rpcrdma", "bad name!"]}, "invalid kernel module name 'bad name!'"),
        ({"hold_file": "/etc/x"}, "must be relative to the host root"),
        ({"reload": "yes"}, "config storage.reload: expected true or false"),
        ({"unknown": 1}, "config [storage] has unknown key 'unknown'"),
    ):
        with pytest.raises(NodeagentError, match=msg.replace("[", r"\[").replace("(", r"\(")):
            parse_policy(table, StoragePolicy())


def test_an_unreadable_refcnt_is_not_taken_for_unused() -> None:
    blind = replace(mod("rpcrdma"), refcnt=None, problems=("refcnt is 'x' (not a number)",))
    snap = node(*INBOX, *CHAIN[:-1], blind, locked=True)
    d = GUARD.decide(snap, GUARD.initial_memory())
    assert d.verdict.verdict == "blocking" and not d.verdict.ok and d.actions == ()
    assert "cannot tell whether rpcrdma is in use (refcnt unreadable)" in d.verdict.reasons[-1]
    # A lower module of the chain with an unreadable refcnt stays where it is.
    snap = node(
        *INBOX, *CHAIN[:-2], replace(mod("sunrpc", "rpcrdma"), refcnt=None), CHAIN[-1], locked=True
    )
    order = [a.module for a in GUARD.decide(snap, GUARD.initial_memory()).actions[1:]]
    assert "sunrpc" not in order and order[0] == "rpcrdma"


# Fail closed on the readers of who uses the chain: what cannot be read may be a user.
NVME_CHAIN = (mod("nvme_core", "nvme_fabrics", "nvme_rdma"), mod("nvme_fabrics", "nvme_rdma"))
BLIND_CTRL = NvmeController("nvme1", "unknown", "", problem="transport unreadable: Is a directory")
NQN = ("nqn.2026-11.io.example:vol1",)


def unread(snap: NodeSnapshot, source: str, problem: str) -> NodeSnapshot:
    """``snap`` with the reader of ``source`` (a snapshot field) having met ``problem``."""
    return replace(snap, read_problems=MappingProxyType({source: (problem,)}))


@pytest.mark.parametrize(
    ("make", "says"),
    [
        pytest.param(
            lambda: node(*NVME_CHAIN, mod("nvme_rdma"), locked=True, nvme=(BLIND_CTRL,)),
            "cannot tell whether nvme_rdma is in use: NVMe controller nvme1: "
            "transport unknown (transport unreadable: Is a directory)",
            id="controller-transport-unreadable",
        ),
        pytest.param(
            lambda: node(
                *NVME_CHAIN,
                mod("nvme_rdma"),
                locked=True,
                nvme=(NvmeController("nvme1", "unknown", ""),),
            ),
            "cannot tell whether nvme_rdma is in use: NVMe controller nvme1: "
            "transport unknown (not reported)",
            id="controller-transport-missing",
        ),
        pytest.param(
            lambda: unread(
                node(*NVME_CHAIN, mod("nvme_rdma"), locked=True),
                "nvme",
                "sys/class/nvme unreadable: Permission denied",
            ),
            "cannot tell whether nvme_rdma is in use: "
            "NVMe controllers: sys/class/nvme unreadable: Permission denied",
            id="controllers-unlisted",
        ),
        pytest.param(
            lambda: unread(
                node(*INBOX, *CHAIN, locked=True),
                "mounts",
                "proc/1/mountinfo is unreadable: is a FIFO, not a regular file",
            ),
            "cannot tell whether rpcrdma is in use: "
            "mounts: proc/1/mountinfo is unreadable: is a FIFO, not a regular file",
            id="mountinfo-unreadable",
        ),
        pytest.param(
            lambda: node(
                mod("nvmet_rdma"),
                locked=True,
                ports=(
                    NvmetPort("1", "unknown", ":", NQN, "addr_trtype unreadable: No such file"),
                ),
            ),
            "cannot tell whether nvmet_rdma is in use: NVMe-oF target port 1: "
            "transport unknown (addr_trtype unreadable: No such file)",
            id="port-transport-unreadable",
        ),
        pytest.param(
            lambda: node(
                mod("nvmet_rdma"), locked=True, ports=(NvmetPort("1", "unknown", ":", NQN),)
            ),
            "cannot tell whether nvmet_rdma is in use: NVMe-oF target port 1: "
            "transport unknown (not reported)",
            id="port-transport-missing",
        ),
        pytest.param(
            lambda: node(
                mod("nvmet_rdma"),
                locked=True,
                ports=(NvmetPort("1", "tcp", ":4420", (), "subsystems unreadable: Is a FIFO"),),
            ),
            "cannot tell whether nvmet_rdma is in use: NVMe-oF target port 1: "
            "subsystems unreadable: Is a FIFO",
            id="port-subsystems-unreadable",
        ),
    ],
)
def test_a_user_reader_that_cannot_see_keeps_the_chain_in_use(
    make: Callable[[], NodeSnapshot], says: str
) -> None:
    d = GUARD.decide(make(), GUARD.initial_memory())
    assert (d.verdict.verdict, d.verdict.ok) == ("in-use", False)
    assert not any(isinstance(a, UnloadModule) for a in d.actions) and d.actions == ()
    assert says + "; not removing" in d.verdict.reasons


def test_the_same_nodes_read_cleanly_are_removed() -> None:
    # Controls for the table above: what made them in-use was only the unreadable part.
    pcie = NvmeController("nvme0", "pcie", "nqn.2014.08.org.nvmexpress:root")
    for snap in (
        node(*NVME_CHAIN, mod("nvme_rdma"), locked=True, nvme=(pcie,)),
        node(*INBOX, *CHAIN, locked=True),
        node(mod("nvmet_rdma"), locked=True, ports=(NvmetPort("1", "tcp", ":4420", NQN),)),
    ):
        d = GUARD.decide(snap, GUARD.initial_memory())
        assert d.verdict.verdict == "blocking"
        assert any(isinstance(a, UnloadModule) for a in d.actions)


def test_an_unreadable_reader_holds_back_only_the_module_it_could_name_users_of() -> None:
    # A local controller's odd transport cannot be an NVMe-oF user when nvme_rdma is not loaded.
    snap = unread(
        node(*INBOX, *CHAIN, locked=True, nvme=(BLIND_CTRL,)),
        "nvmet_ports",
        "sys/kernel/config/nvmet/ports unreadable: Input/output error",
    )
    d = GUARD.decide(snap, GUARD.initial_memory())
    assert d.verdict.verdict == "blocking"
    order = [a.module for a in d.actions if isinstance(a, UnloadModule)]
    assert order[0] == "rpcrdma" and "nvme_rdma" not in order


def test_an_unreadable_lock_table_with_the_flag_absent_is_not_clear() -> None:
    """MOFED may be installing right now: the agent neither calls that clear nor acts."""
    locks = "proc/locks is unreadable: is a FIFO, not a regular file"
    d = GUARD.decide(unread(node(*INBOX, *CHAIN), "locks", locks), GUARD.initial_memory())
    assert (d.verdict.verdict, d.verdict.ok, d.actions) == ("unknown", False, ())
    assert d.verdict.reasons[0].startswith(
        f"cannot tell whether MOFED is about to install ({locks})"
    )
    # A hold already there stays (a stale one is removed only when the lock reads clear).
    d = GUARD.decide(unread(node(*INBOX, hold=True), "locks", locks), GUARD.initial_memory())
    assert (d.verdict.verdict, d.verdict.ok, d.actions) == ("holding", True, ())
    assert d.verdict.reasons == (
        f"keeping the hold: cannot tell whether MOFED is about to install ({locks})",
    )
    # Nothing loaded and nothing held: nothing at stake, clear.
    d = GUARD.decide(unread(node(*INBOX), "locks", locks), GUARD.initial_memory())
    assert (d.verdict.verdict, d.verdict.ok) == ("clear", True)
    # MOFED ready: the lock does not matter.
    d = GUARD.decide(
        unread(node(*INBOX, *CHAIN, ready=True), "locks", locks), GUARD.initial_memory()
    )
    assert (d.verdict.verdict, d.verdict.ok) == ("clear", True)


def test_memory_a_restart_would_refuse_is_not_saved_and_the_last_good_part_is_kept() -> None:
    """The reconciler reads each changed part back with its guard's own reader before it
    is written: a refused part keeps what was saved before, and says why, by guard."""
    from nodeagent.core.reconcile import Reconciler

    guard = StorageGuard(StoragePolicy())
    rec = Reconciler([guard])
    good = rec.initial_memory()
    doc, refused = rec.memory_to_save(good, None)
    assert refused == {} and doc["storage"] == guard.memory_to_json(good["storage"])

    class Refusing(StorageGuard):
        def memory_to_json(self, memory: Any) -> dict[str, Any]:
            return {**super().memory_to_json(memory), "removed": ["not a module!"]}

    rec2 = Reconciler([Refusing(StoragePolicy())])
    doc2, refused2 = rec2.memory_to_save(good, doc)
    assert list(refused2) == ["storage"]
    assert "storage memory not saved: a restart would refuse it" in refused2["storage"]
    assert doc2["storage"] == doc["storage"]  # the last good part
    doc3, _ = rec2.memory_to_save(good, None)
    assert "storage" not in doc3  # nothing good yet: that guard starts fresh, as it would


def test_every_verdict_the_guard_gives_is_one_of_its_words() -> None:
    """nodeagent_guard_state offers a guard's verdict_words: a verdict outside them would
    never show (the storage guard once had none and offered open/closed)."""
    seen = {d.verdict.verdict for d in run([seed_004(t) for t in (20, 30, 1107, 1200)])[0]}
    seen |= {"holding", "in-use", "unknown"}  # the other tests' verdicts, by name
    assert seen <= set(GUARD.verdict_words)
    assert set(GUARD.verdict_words) == {
        "clear",
        "holding",
        "blocking",
        "in-use",
        "unknown",
        "other-stack",
    }


# -- convergence after a crash (issue 37): phases, going modules, bounded memory -----------


def ready_node(*mods: LoadedModule, now: float) -> NodeSnapshot:
    return node(*mods, now=now, ready=True)


def test_a_removal_backoff_never_delays_the_load_back_owed_once_mofed_is_ready() -> None:
    d = GUARD.decide(seed_004(1200), GUARD.initial_memory())  # removal planned, intent saved
    failed = ActionOutcome(d.actions[1], ok=False, errno=16, error="unload rpcrdma: EBUSY")
    mem = GUARD.absorb(d.memory, failed, 1200)
    assert mem.retry_at == 1205 and mem.backoff_of == "remove"
    # MOFED ready at once: rpcrdma went after all (its unload finished), nothing waits.
    back = GUARD.decide(ready_node(*INBOX, mod("ib_core", "mlx5_ib"), now=1201), mem)
    assert [a.module for a in back.actions if isinstance(a, LoadModule)] == ["rpcrdma"]
    # A load-back that fails backs off itself, counted afresh.
    (load,) = [a for a in back.actions if isinstance(a, LoadModule)]
    mem = GUARD.absorb(back.memory, ActionOutcome(load, ok=False, error="load: ENOENT"), 1201)
    assert (mem.backoff_of, mem.failures, mem.retry_at) == ("load", 1, 1206)
    again = GUARD.decide(ready_node(*INBOX, mod("ib_core", "mlx5_ib"), now=1202), mem)
    assert again.actions == () and again.wake_at == 1206


def test_a_memory_saved_before_phases_were_kept_backs_off_both_as_before() -> None:
    mem = GUARD.memory_from_json(
        {"removed": ["rpcrdma"], "failures": 1, "retry_at": 1205.0, "last_error": "x"}
    )
    assert mem.backoff_of is None
    d = GUARD.decide(ready_node(*INBOX, mod("ib_core", "mlx5_ib"), now=1201), mem)
    assert not [a for a in d.actions if isinstance(a, LoadModule)] and d.wake_at == 1205


def going(m: LoadedModule) -> LoadedModule:
    return replace(m, initstate="going")


def test_a_module_already_going_is_not_unloaded_again_and_is_looked_at_soon() -> None:
    snap = seed_004(1200)
    mods = {**snap.modules, "rpcrdma": going(snap.modules["rpcrdma"])}
    d = GUARD.decide(replace(snap, modules=MappingProxyType(mods)), GUARD.initial_memory())
    unloads = [a.module for a in d.actions if isinstance(a, UnloadModule)]
    assert "rpcrdma" not in unloads and unloads  # the rest of the chain still goes
    assert any("rpcrdma being unloaded (going)" in r for r in d.verdict.reasons)
    assert d.wake_at == 1201.0


def test_a_going_module_is_still_owed_its_load_back() -> None:
    """An agent killed mid-unload: the restarted one sees the module going, MOFED ready.
    It is not 'loaded, needs nothing': once gone, it is loaded back."""
    mem = replace(GUARD.initial_memory(), removed=("rpcrdma",))
    d = GUARD.decide(ready_node(*INBOX, going(mod("rpcrdma")), now=1300), mem)
    assert d.memory.removed == ("rpcrdma",) and d.wake_at == 1301.0
    assert not [a for a in d.actions if isinstance(a, LoadModule)]
    d = GUARD.decide(ready_node(*INBOX, now=1301), d.memory)
    assert [a.module for a in d.actions if isinstance(a, LoadModule)] == ["rpcrdma"]


def test_saved_memory_is_bounded_by_what_the_guard_could_have_written() -> None:
    many = [f"mod{i}" for i in range(20_000)]
    with pytest.raises(ValueError, match="removed names 20000 modules"):
        GUARD.memory_from_json({"removed": many})
    with pytest.raises(ValueError, match="'ext4', not a storage module"):
        GUARD.memory_from_json({"removed": ["rpcrdma", "ext4"]})
    with pytest.raises(ValueError, match="or one twice"):
        GUARD.memory_from_json({"removed": ["rpcrdma", "rpcrdma"]})
    ok = GUARD.memory_from_json({"removed": ["rpcrdma", "nvme_rdma", "ib_srp"]})
    assert ok.removed == ("rpcrdma", "nvme_rdma", "ib_srp")
    # A module the configured chain names is one the guard could have removed.
    custom = StorageGuard(StoragePolicy(modules=("rpcrdma", "my_rdma_fs")))
    assert custom.memory_from_json({"removed": ["my_rdma_fs"]}).removed == ("my_rdma_fs",)


def test_a_load_back_refused_for_its_crcs_is_named_with_its_remedy_until_one_goes_in() -> None:
    """The executor refuses a chain built against another stack before any insert
    (``tests/test_load_crcs.py``); the guard says so, not ok, with what to do, keeps
    trying at its backoff (MOFED may be rebuilt), and forgets it once a load-back goes
    in. Saved across a restart."""
    mem = replace(GUARD.initial_memory(), removed=("rpcrdma",))
    d = GUARD.decide(ready_node(*INBOX, mod("ib_core", "mlx5_ib"), now=1300), mem)
    (load,) = [a for a in d.actions if isinstance(a, LoadModule)]
    why = "rpcrdma not loaded from the host's tree: the kernel would refuse it: rpcrdma needs X"
    refused = ActionOutcome(load, ok=False, errno=22, error=why, detail=(("refused", "crcs"),))
    mem = GUARD.absorb(d.memory, refused, 1300)
    mem = GUARD.memory_from_json(GUARD.memory_to_json(mem))  # a restart keeps it
    d = GUARD.decide(ready_node(*INBOX, mod("ib_core", "mlx5_ib"), now=1301), mem)
    assert (d.verdict.verdict, d.verdict.ok) == ("other-stack", False)
    assert why in d.verdict.reasons[0] and "ENABLE_NFSRDMA=true" in d.verdict.reasons[0]
    assert d.actions == () and d.wake_at == 1305  # tried again at its backoff
    d = GUARD.decide(ready_node(*INBOX, mod("ib_core", "mlx5_ib"), now=1305), d.memory)
    (load,) = [a for a in d.actions if isinstance(a, LoadModule)]
    mem = GUARD.absorb(d.memory, ActionOutcome(load, ok=True), 1305)
    d = GUARD.decide(ready_node(*INBOX, mod("ib_core", "mlx5_ib"), mod("rpcrdma"), now=1306), mem)
    assert (d.verdict.verdict, d.verdict.ok) == ("clear", True) and d.memory.load_refused is None


def test_holding_lets_the_removal_finish_and_a_hold_in_place_is_not_rewritten() -> None:
    """Two halves of one rule: a pass during the removal must not stop it
    (``tests/test_storage_agent.py`` runs it in the real loop)."""
    d = GUARD.decide(seed_004(1200), GUARD.initial_memory())
    assert isinstance(d.actions[0], WriteFile) and not d.plan.lets_finish
    held = node(*INBOX, now=1201, hold=True, locked=True)
    h = GUARD.decide(held, d.memory)
    assert h.verdict.verdict == "holding" and h.actions == () and h.plan.lets_finish
    again = GUARD.decide(replace(seed_004(1201), files=held.files), d.memory)
    assert again.verdict.verdict == "blocking"
    assert not any(isinstance(a, WriteFile) for a in again.actions)
