"""The VF guard: snapshot every SR-IOV PF's VFs while stable; restore each VF when it is back.

Seed 003: after ``openibd restart`` MOFED recreates 50 VFs and restores them in
a serial loop with a fixed 4 s bind delay; the first VF whose netdev is not
there yet makes it exit. This guard restores every VF on its own: the moment
that VF's PCI device (and, if it had one, its host netdev) exists, with
bounded retries and a per-VF deadline. One VF that never comes back is
reported on its own and blocks no other.

Per PF, a phase (the table ``_PHASES`` dispatches on it):

- ``stable``    driver bound, MOFED ready (mlx5), every VF present: the saved
                snapshot follows the node (an owner's change updates it), from
                what was read only: a PF or VF read with a problem keeps its
                snapshot, a field not read keeps its value;
- ``disrupted`` its VFs went away (driver unbound, ``sriov_numvfs`` lowered):
                the snapshot is frozen;
- ``restoring`` the PF is back: ``sriov_numvfs`` is set back after a grace
                period when the agent owns it, and each VF is restored as it
                appears (k of n);
- ``restored``  every VF has its config back; behaves as ``stable``;
- ``degraded``  some VFs did not come back or could not be set by their
                deadline (which, why). The guard's ``ok`` is false only here.

Config that already matches is never rewritten, so MOFED's restore and this one
can both run, in either order, with the same end state. Pure: time comes in the
snapshot; the host layer reads VFs through the PF (``IFLA_VFINFO_LIST``) and
carries out ``RestoreVf``/``SetNumVfs``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal

from nodeagent.core import applicability, fields
from nodeagent.core.actions import Action, ActionOutcome, RestoreVf, SetNumVfs
from nodeagent.core.guard import GuardDecision, Verdict, backoff_delay
from nodeagent.core.mofed import MOFED_MODES, MofedMarkers, MofedMode
from nodeagent.core.names import is_decimal
from nodeagent.core.needs import Needs
from nodeagent.core.paths import HostPaths
from nodeagent.core.snapshot import NodeSnapshot
from nodeagent.core.sriov_model import (
    NETDEV_SIDE,
    PF_SIDE,
    VF_FIELDS,
    PfSnapshot,
    SavedPf,
    SavedVf,
    SriovValueError,
    VfSnapshot,
    read_problems,
    same_config,
    saved_from_observed,
    saved_pf_from_json,
    saved_pf_to_json,
)
from nodeagent.core.telemetry import MetricFamily, Sample

GUARD = "sriov"
Phase = Literal["stable", "disrupted", "restoring", "restored", "degraded"]
PHASES: tuple[Phase, ...] = ("stable", "restored", "disrupted", "restoring", "degraded")
# The guard's words: a PF's phase, or ``unknown`` while a PF could not be read before it
# was ever snapshotted, or no PF could be seen at all (not ok: nothing guards those VFs).
VERDICTS: tuple[str, ...] = (*PHASES, "unknown")
NUMVFS_OWNERS = ("agent", "sriov-operator", "mofed")
VfStatus = Literal["waiting", "restored", "failed"]
ZERO_MAC = "00:00:00:00:00:00"


@dataclass(frozen=True)
class SriovPolicy:
    enabled: applicability.Enabled = "auto"
    numvfs_owner: str = "agent"  # who sets sriov_numvfs back: agent | sriov-operator | mofed
    numvfs_grace_s: float = 30.0  # PF back -> the agent sets numvfs if nobody else did
    vf_deadline_s: float = 300.0  # PF back -> a VF not restored by then is reported
    retry_base_s: float = 0.25  # a failed VF restore backs off 0.25 s, 0.5 s ... up to
    retry_max_s: float = 10.0
    poll_s: float = 2.0  # while restoring: the slow poll behind uevents
    pf_gone_s: float = 600.0  # a PF whose PCI device stays gone this long is degraded
    mofed: MofedMode = "container"  # "host": no MOFED ready flag to wait for
    mofed_drivers: tuple[str, ...] = ("mlx5_core",)
    parallel: int = 16  # VF restores carried out at once


# [sriov]: one row a policy field, in the order they are checked.
POLICY_FIELDS: tuple[fields.Setting, ...] = (
    fields.Setting("enabled", "enabled", applicability.parse_enabled),
    fields.Setting("numvfs_owner", "numvfs_owner", fields.one_of(NUMVFS_OWNERS)),
    fields.Setting("mofed", "mofed", fields.one_of(MOFED_MODES)),
    fields.Setting("mofed_drivers", "mofed_drivers", fields.modules),
    fields.Setting("numvfs_grace_seconds", "numvfs_grace_s", fields.number(0.0, 86400.0)),
    fields.Setting("vf_deadline_seconds", "vf_deadline_s", fields.number(0.1, 86400.0)),
    fields.Setting("retry_base_seconds", "retry_base_s", fields.number(0.01, 3600.0)),
    fields.Setting("retry_max_seconds", "retry_max_s", fields.number(0.01, 86400.0)),
    fields.Setting("poll_seconds", "poll_s", fields.number(0.05, 3600.0)),
    fields.Setting("pf_gone_seconds", "pf_gone_s", fields.number(1.0, 30 * 86400.0)),
    fields.Setting("parallel", "parallel", fields.whole(1, 256)),
)


def parse_policy(table: Mapping[str, Any], pol: SriovPolicy) -> SriovPolicy:
    """``[sriov]`` of the config file over ``pol``; NodeagentError naming a bad value."""
    return fields.apply_settings("sriov", table, POLICY_FIELDS, pol)


@dataclass(frozen=True)
class VfRestore:
    status: VfStatus = "waiting"
    deadline: float = 0.0
    attempts: int = 0
    next_try: float | None = None
    ready_at: float | None = None  # the first pass that saw its device (and netdev) back
    done_at: float | None = None
    written: tuple[str, ...] = ()
    error: str | None = None
    reported: bool = False  # its outcome is in the timeline
    ident: int | None = None  # the VF device incarnation it was restored on (see VfSnapshot)


@dataclass(frozen=True)
class PfMemory:
    saved: SavedPf
    phase: Phase = "stable"
    since: float = 0.0
    why: str = ""  # what disrupted it
    back_at: float | None = None  # the PF's driver and netdev came back
    gone_at: float | None = None  # its PCI device has been absent since
    numvfs_asked_at: float | None = None
    numvfs_error: str | None = None
    numvfs_quiet_since: float | None = None  # PF back and MOFED not mid-restart since
    restores: Mapping[int, VfRestore] = field(default_factory=lambda: MappingProxyType({}))
    unsupported: tuple[str, ...] = ()  # fields its driver refused with EOPNOTSUPP (once)
    unread: tuple[str, ...] = ()  # this pass's read problems: nothing saved or restored from them
    unconfirmed: bool = False  # adopted from the file while unreadable: compared on a clean read


@dataclass(frozen=True)
class SriovMemory:
    pfs: Mapping[str, PfMemory] = field(default_factory=lambda: MappingProxyType({}))


# -- one pass over one PF ---------------------------------------------------------------


@dataclass
class _Pass:
    snap: NodeSnapshot
    policy: SriovPolicy
    mofed: MofedMarkers
    actions: list[Action] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    wake: list[float] = field(default_factory=list)

    @property
    def now(self) -> float:
        return self.snap.now


def _bound(obs: PfSnapshot | None) -> bool:
    return obs is not None and obs.driver is not None and obs.netdev is not None


def _vfs_gone(obs: PfSnapshot | None, saved: SavedPf) -> str | None:
    """Why the PF's VFs are gone, or None while they are all there."""
    if obs is None:
        return "its PCI device is gone"
    if obs.driver is None:
        return f"driver {saved.driver or '?'} unbound"
    present = sum(1 for v in obs.vfs if v.pci is not None)
    numvfs = present if obs.numvfs is None else obs.numvfs  # unreadable: the devices say
    if numvfs < saved.numvfs or present < saved.numvfs:
        return f"sriov_numvfs {obs.numvfs} (was {saved.numvfs})"
    recreated = [
        sv.index
        for sv in saved.vfs
        if sv.ident is not None
        and (ov := obs.vf(sv.index)) is not None
        and ov.ident is not None
        and ov.ident != sv.ident
    ]
    if recreated:  # numvfs went to 0 and back between two passes
        return f"{len(recreated)} VFs destroyed and created again (new PCI devices)"
    rebound = [sv.index for sv in saved.vfs if _netdev_recreated(sv, obs.vf(sv.index))]
    if rebound:  # e.g. a driver container that unbinds and rebinds every VF on start
        return f"{len(rebound)} VF netdevs created again with other settings (driver rebound)"
    return None


def _netdev_recreated(sv: SavedVf, ov: VfSnapshot | None) -> bool:
    """Same VF device, a new host netdev (another ifindex) whose own settings differ."""
    if ov is None or ov.problems or sv.netdev_ident is None or ov.netdev_ident is None:
        return False  # (a VF not read cleanly: judged on a clean read)
    if sv.ident is None or ov.ident != sv.ident or ov.netdev_ident == sv.netdev_ident:
        return False
    return any(
        k in ov.settings and ov.settings[k] != v for k, v in sv.settings.items() if k in NETDEV_SIDE
    )


def _with_idents(saved: SavedPf, obs: PfSnapshot) -> SavedPf:
    """The saved config, now meaning the VF devices that exist (after a restore)."""
    vfs = []
    for sv in saved.vfs:
        ov = obs.vf(sv.index)
        vfs.append(
            replace(
                sv,
                ident=ov.ident if ov is not None else None,
                netdev_ident=ov.netdev_ident if ov is not None else None,
            )
        )
    return replace(saved, vfs=tuple(vfs))


def _mofed_managed(p: _Pass, obs: PfSnapshot) -> bool:
    return p.policy.mofed == "container" and obs.driver in p.policy.mofed_drivers


def _mofed_restarting(p: _Pass, obs: PfSnapshot) -> bool:
    """MOFED's blacklist file exists only while ``openibd restart`` runs."""
    return _mofed_managed(p, obs) and p.snap.file(p.mofed.blacklist).present


def _mofed_ready(p: _Pass, obs: PfSnapshot) -> bool:
    if not _mofed_managed(p, obs):
        return True
    return p.snap.file(p.mofed.ready).present and not p.snap.file(p.mofed.blacklist).present


def _stable_now(p: _Pass, obs: PfSnapshot | None) -> bool:
    if obs is None or not _bound(obs) or not obs.numvfs:
        return False
    indexes = {v.index for v in obs.vfs if v.pci is not None}
    return indexes >= set(range(obs.numvfs)) and _mofed_ready(p, obs)


def _wanted(sv: SavedVf, ov: VfSnapshot, unsupported: tuple[str, ...]) -> dict[str, Any]:
    """What to bring back on this VF now: PF-side fields always; netdev fields where it has one."""
    sides = PF_SIDE + (NETDEV_SIDE if sv.netdev is not None and ov.netdev is not None else ())
    want = {k: v for k, v in sv.settings.items() if k in sides and k not in unsupported}
    if sv.settings.get("mac", ZERO_MAC) != ZERO_MAC:
        # An admin MAC governs the VF's address: the driver takes it on its next
        # (re)load (igb: "Reload the VF driver"), and may refuse the VF setting its own.
        want.pop("address", None)
    return want


def _changed_vfs(old: SavedPf, new: SavedPf) -> list[str]:
    out = []
    for nv in new.vfs:
        ov = old.vf(nv.index)
        if ov is None:
            out.append(f"VF {nv.index} new")
            continue
        diff = sorted(
            k
            for k in set(nv.settings) | set(ov.settings)
            if nv.settings.get(k) != ov.settings.get(k)
        )
        if diff:
            out.append(f"VF {nv.index}: {', '.join(diff)}")
    return out


def _disrupt(p: _Pass, mem: PfMemory, why: str) -> PfMemory:
    p.events.append(
        f"PF {mem.saved.pci}: VFs gone ({why}); snapshot of {len(mem.saved.vfs)} VFs frozen"
    )
    return replace(
        mem,
        phase="disrupted",
        since=p.now,
        why=why,
        back_at=None,
        gone_at=p.now if why == "its PCI device is gone" else None,
        numvfs_asked_at=None,
        numvfs_error=None,
        numvfs_quiet_since=None,
        restores=MappingProxyType({}),
    )


def _note_unread(p: _Pass, mem: PfMemory, obs: PfSnapshot | None) -> PfMemory:
    """Every phase: this pass's read problems, one event when they start and when they end."""
    unread = read_problems(obs) if obs is not None else ()
    if bool(unread) != bool(mem.unread):
        p.events.append(
            f"PF {mem.saved.pci}: VF settings unreadable ({'; '.join(unread[:3])}"
            f"{' ...' if len(unread) > 3 else ''}): snapshot kept, nothing restored from this read"
            if unread
            else f"PF {mem.saved.pci}: VF settings readable again"
        )
    return mem if unread == mem.unread else replace(mem, unread=unread)


def _track(p: _Pass, mem: PfMemory, obs: PfSnapshot | None) -> PfMemory:
    """stable / restored: follow the owner's changes, from what was read; notice a disruption.
    A read with problems (a listing or a link that failed with anything but ENOENT) is
    no evidence of VFs gone: the snapshot is kept and the first clean read compares (a
    VF created again meanwhile shows by its device's identity)."""
    if obs is not None and read_problems(obs):
        return mem
    why = _vfs_gone(obs, mem.saved)
    if why is not None:  # (a PF still bound, e.g. numvfs 0 and back: restoring at once)
        return _disrupted(p, _disrupt(p, mem, why), obs)
    if obs is None or not _stable_now(p, obs):
        return mem
    if mem.unconfirmed:  # adopted while unreadable: this first clean read is the comparison
        if mem.unread:
            return mem
        adopted = _adopt(p, mem.saved.pci, mem.saved, obs)
        return _PHASES[adopted.phase](p, adopted, obs) if adopted.phase != "stable" else adopted
    # A PF whose VF settings were not read keeps its snapshot whole; so does one with a
    # new VF read badly (nothing saved to keep for it).
    if obs.problems or any(v.problems and mem.saved.vf(v.index) is None for v in obs.vfs):
        return mem
    new = saved_from_observed(obs, p.snap.sriov.attachments, p.now, mem.saved)
    if same_config(new, mem.saved):
        return mem
    changed = _changed_vfs(mem.saved, new)
    if changed:
        p.events.append(
            f"PF {mem.saved.pci}: VF config changed by its owner; snapshot updated "
            f"({'; '.join(changed[:4])}{' ...' if len(changed) > 4 else ''})"
        )
    return replace(mem, saved=new)


def _disrupted(p: _Pass, mem: PfMemory, obs: PfSnapshot | None) -> PfMemory:
    if obs is None:
        gone_at = mem.gone_at if mem.gone_at is not None else p.now
        if p.now >= gone_at + p.policy.pf_gone_s:
            p.events.append(f"PF {mem.saved.pci}: vanished for good ({p.policy.pf_gone_s:.0f} s)")
            why = f"vanished: its PCI device has been gone for {p.now - gone_at:.0f} s"
            return replace(mem, phase="degraded", since=p.now, gone_at=gone_at, why=why)
        p.wake.append(gone_at + p.policy.pf_gone_s)
        return replace(mem, gone_at=gone_at)
    if not _bound(obs):
        return replace(mem, gone_at=None)
    deadline = p.now + p.policy.vf_deadline_s
    p.events.append(
        f"PF {mem.saved.pci}: back ({obs.driver}, {obs.netdev}); restoring {len(mem.saved.vfs)} VFs"
    )
    mem = replace(
        mem,
        phase="restoring",
        since=p.now,
        back_at=p.now,
        gone_at=None,
        restores=MappingProxyType({v.index: VfRestore(deadline=deadline) for v in mem.saved.vfs}),
    )
    return _restoring(p, mem, obs)


def _ask_numvfs(p: _Pass, mem: PfMemory, obs: PfSnapshot) -> PfMemory:
    if obs.numvfs is None:  # unreadable: never written on a guess
        return mem
    want = mem.saved.numvfs
    if obs.totalvfs is not None:
        want = min(want, obs.totalvfs)
    have = obs.numvfs
    if have >= want or p.policy.numvfs_owner != "agent" or mem.back_at is None:
        return mem
    if _mofed_restarting(p, obs):  # openibd restart is loading modules: it writes numvfs next
        return replace(mem, numvfs_quiet_since=None)
    quiet = mem.numvfs_quiet_since if mem.numvfs_quiet_since is not None else p.now
    mem = replace(mem, numvfs_quiet_since=quiet)
    due = quiet + p.policy.numvfs_grace_s
    if mem.numvfs_asked_at is not None:
        due = max(due, mem.numvfs_asked_at + p.policy.numvfs_grace_s)
    if p.now < due:
        p.wake.append(due)
        return mem
    p.actions.append(
        SetNumVfs(
            guard=GUARD,
            pf_pci=mem.saved.pci,
            numvfs=want,
            through_zero=have > 0,
            reason=f"sriov_numvfs is {have}, the snapshot has {want}; nobody set it back "
            f"within {p.policy.numvfs_grace_s:.0f} s",
        )
    )
    return replace(mem, numvfs_asked_at=p.now)


def _restore_one(p: _Pass, mem: PfMemory, sv: SavedVf, r: VfRestore, obs: PfSnapshot) -> VfRestore:
    totalvfs = obs.totalvfs
    if totalvfs is not None and sv.index >= totalvfs:
        return replace(
            r,
            status="failed",
            done_at=p.now,
            error=f"VF index {sv.index} is past sriov_totalvfs {totalvfs}",
        )
    if r.deadline - p.now > p.policy.vf_deadline_s:
        # Saved under another clock (a restart after a clock step): no VF deadline is
        # further ahead than its own length.
        r = replace(r, deadline=p.now + p.policy.vf_deadline_s)
    ov = obs.vf(sv.index)
    ready = ov is not None and ov.pci is not None and (sv.netdev is None or ov.netdev is not None)
    if ov is None or not ready or obs.problems or ov.problems:
        # Not there yet, or its settings not read: nothing is written on a guess.
        if p.now >= r.deadline:
            if ov is None or ov.pci is None:
                error = f"its PCI device did not appear within {p.policy.vf_deadline_s:.0f} s"
            elif not ready:
                error = f"its netdev did not appear within {p.policy.vf_deadline_s:.0f} s"
            else:
                error = (
                    f"its settings could not be read: {'; '.join((obs.problems + ov.problems)[:2])}"
                )
            return replace(r, status="failed", done_at=p.now, error=error)
        p.wake.append(r.deadline)
        return r
    if r.ready_at is None:
        r = replace(r, ready_at=p.now)
    want = _wanted(sv, ov, mem.unsupported)
    if all(ov.settings.get(k) == v for k, v in want.items()):
        return replace(r, status="restored", done_at=p.now, error=None, ident=ov.ident)
    if p.now >= r.deadline and r.attempts > 0:
        return replace(r, status="failed", done_at=p.now)
    if r.next_try is not None and p.now < r.next_try:
        p.wake.append(r.next_try)
        return r
    pf_settings = tuple(sorted((k, v) for k, v in want.items() if k in PF_SIDE))
    link_settings = tuple(sorted((k, v) for k, v in want.items() if k in NETDEV_SIDE))
    diff = sorted(k for k, v in want.items() if ov.settings.get(k) != v)
    p.actions.append(
        RestoreVf(
            guard=GUARD,
            pf_pci=mem.saved.pci,
            index=sv.index,
            vf_pci=ov.pci or "",
            pf_settings=pf_settings,
            link_settings=link_settings,
            reason=f"differs in {', '.join(diff)}",
        )
    )
    return replace(r, ident=ov.ident)


def _device_changed(r: VfRestore, ov: VfSnapshot | None) -> bool:
    if ov is None or ov.pci is None:
        return True
    return r.ident is not None and ov.ident is not None and ov.ident != r.ident


def _restoring(p: _Pass, mem: PfMemory, obs: PfSnapshot | None) -> PfMemory:
    if obs is None or not _bound(obs):
        return _disrupt(p, mem, _vfs_gone(obs, mem.saved) or "PF netdev gone")
    mem = _ask_numvfs(p, _revive_late(p, mem, obs), obs)
    restores = dict(mem.restores)
    for sv in mem.saved.vfs:
        r = restores.get(sv.index) or VfRestore(deadline=p.now + p.policy.vf_deadline_s)
        if r.status == "restored" and _device_changed(r, obs.vf(sv.index)):
            # Restored on a device that is gone or was created again: not restored any more.
            r = VfRestore(deadline=max(r.deadline, p.now + p.policy.vf_deadline_s))
        if r.status == "waiting":
            restores[sv.index] = _restore_one(p, mem, sv, r, obs)
    mem = replace(mem, restores=MappingProxyType(restores))
    mem = _report(p, mem)
    waiting = [r for r in restores.values() if r.status == "waiting"]
    if waiting:
        # The slow poll behind uevents, on a grid from when the PF came back, so every
        # pass asks for the same next poll instead of one more timer each.
        start = mem.back_at if mem.back_at is not None else p.now
        ticks = int((p.now - start) // p.policy.poll_s) + 1
        p.wake.append(start + ticks * p.policy.poll_s)
        return mem
    failed = {i: r for i, r in restores.items() if r.status == "failed"}
    took = p.now - (mem.back_at or p.now)
    n = len(mem.saved.vfs)
    if failed:
        p.events.append(
            f"PF {mem.saved.pci}: degraded: {n - len(failed)}/{n} VFs restored; "
            + "; ".join(f"VF {i}: {r.error}" for i, r in sorted(failed.items())[:4])
        )
        return replace(mem, phase="degraded", since=p.now, saved=_with_idents(mem.saved, obs))
    p.events.append(f"PF {mem.saved.pci}: all {n} VFs restored, {took:.2f} s after it came back")
    return replace(mem, phase="restored", since=p.now, saved=_with_idents(mem.saved, obs))


def _report(p: _Pass, mem: PfMemory) -> PfMemory:
    """One timeline line per VF outcome: when it appeared, when restored, what was written."""
    restores = dict(mem.restores)
    for i, r in sorted(restores.items()):
        if r.status == "waiting" or r.reported:
            continue
        sv = mem.saved.vf(i)
        pci = sv.pci if sv is not None else "?"
        if r.status == "restored":
            after = (
                f" {r.done_at - r.ready_at:.3f} s after it appeared"
                if r.done_at is not None and r.ready_at is not None
                else ""
            )
            what = f"wrote {', '.join(r.written)}" if r.written else "already matched"
            p.events.append(f"VF {i} ({pci}) restored{after} ({what})")
        else:
            p.events.append(f"VF {i} ({pci}) not restored: {r.error}")
        restores[i] = replace(r, reported=True)
    return replace(mem, restores=MappingProxyType(restores))


def _degraded(p: _Pass, mem: PfMemory, obs: PfSnapshot | None) -> PfMemory:
    if obs is None:
        return mem
    why = _vfs_gone(obs, mem.saved)
    if why is not None and mem.restores:
        return _disrupt(p, mem, why)
    if not mem.restores and _bound(obs):  # a PF that vanished and is back
        return _disrupted(p, replace(mem, phase="disrupted"), obs)
    revived = _revive_late(p, mem, obs)
    if revived is not mem:
        return _restoring(p, replace(revived, phase="restoring"), obs)
    return mem


def _revive_late(p: _Pass, mem: PfMemory, obs: PfSnapshot) -> PfMemory:
    """A VF that failed for want of its device gets another chance when it shows up late."""
    restores = dict(mem.restores)
    for i, r in mem.restores.items():
        ov = obs.vf(i)
        sv = mem.saved.vf(i)
        if (
            r.status == "failed"
            and r.ready_at is None
            and ov is not None
            and ov.pci is not None
            and sv is not None
            and (sv.netdev is None or ov.netdev is not None)
            and (obs.totalvfs is None or i < obs.totalvfs)
        ):
            restores[i] = VfRestore(deadline=p.now + p.policy.vf_deadline_s)
    if restores == dict(mem.restores):
        return mem
    return replace(mem, restores=MappingProxyType(restores))


_PHASES: Mapping[Phase, Callable[[_Pass, PfMemory, PfSnapshot | None], PfMemory]] = {
    "stable": _track,
    "restored": _track,
    "disrupted": _disrupted,
    "restoring": _restoring,
    "degraded": _degraded,
}


# -- the guard ------------------------------------------------------------------------------


def _adopt(p: _Pass, pci: str, saved: SavedPf, obs: PfSnapshot | None) -> PfMemory:
    """A PF known only from the persisted snapshot (the agent's memory was lost).

    If the node does not match the snapshot now, the VFs changed while no agent
    watched: that is handled as a disruption, so the snapshot is restored.
    """
    mem = PfMemory(saved=saved, phase="stable", since=p.now)
    if obs is not None and _stable_now(p, obs):
        if read_problems(obs):  # cannot compare: kept, and compared on the first clean read
            return replace(mem, unconfirmed=True)
        now = saved_from_observed(obs, p.snap.sriov.attachments, p.now)
        if same_config(now, saved):
            return mem
    p.events.append(f"PF {pci}: adopted the persisted snapshot ({len(saved.vfs)} VFs)")
    return replace(mem, phase="disrupted", why="differs from the persisted snapshot")


def _pf_evidence(mem: PfMemory, obs: PfSnapshot | None) -> dict[str, Any]:
    n = len(mem.saved.vfs)
    restored = sum(1 for r in mem.restores.values() if r.status == "restored")
    ev: dict[str, Any] = {
        "phase": mem.phase,
        "since": mem.since,
        "netdev": obs.netdev if obs is not None else mem.saved.netdev,
        "driver": obs.driver if obs is not None else None,
        "numvfs": obs.numvfs if obs is not None else None,
        "vfs": n,
    }
    if mem.phase == "disrupted":
        ev["why"] = mem.why
    if mem.restores:
        ev["restored"] = restored
        ev["restoring"] = f"{restored}/{n}"
        failed = {str(i): r.error for i, r in sorted(mem.restores.items()) if r.status == "failed"}
        if failed:
            ev["failed"] = failed
        durations = [
            r.done_at - r.ready_at
            for r in mem.restores.values()
            if r.status == "restored" and r.done_at is not None and r.ready_at is not None
        ]
        if durations:
            ev["restore_seconds_max"] = round(max(durations), 6)
    if mem.unsupported:
        ev["unsupported_fields"] = list(mem.unsupported)
    if mem.unread:  # what could not be read this pass: the snapshot was kept
        ev["snapshot_kept"] = list(mem.unread)
    if mem.unconfirmed:
        ev["unconfirmed"] = "adopted from the file; compared with the node on a clean read"
    if mem.numvfs_error:
        ev["numvfs_error"] = mem.numvfs_error
    if mem.phase != "stable" and mem.saved.attachments:
        ev["pods_lost_interface"] = [
            f"{a.describe()} on VF {a.vf_pci}: the pod lost this interface and needs a restart"
            for a in mem.saved.attachments
        ]
    if obs is not None and mem.phase != "stable":
        rebind = []
        for sv in mem.saved.vfs:
            ov = obs.vf(sv.index)
            if ov is not None and ov.pci is not None and sv.driver and ov.driver != sv.driver:
                rebind.append(
                    f"VF {sv.index} was bound to {sv.driver}, now {ov.driver or 'no driver'} "
                    "(rebinding is the SR-IOV operator's, from its policy)"
                )
        if rebind:
            ev["driver_changed"] = rebind
    return ev


# Per PF (labels as DCGM's: pci_bus_id, device = the PF's netdev): bounded by the node.
METRIC_FAMILIES = (
    MetricFamily(
        "nodeagent_sriov_vfs",
        "gauge",
        "VFs of a PF by restore state (saved: in the snapshot; restored, waiting, failed)",
        ("pci_bus_id", "device", "state"),
    ),
    MetricFamily(
        "nodeagent_sriov_vf_restores_total",
        "counter",
        "VF restores carried out, by outcome (ok, failed)",
        ("pci_bus_id", "device", "outcome"),
    ),
    MetricFamily(
        "nodeagent_sriov_vf_restore_seconds",
        "histogram",
        "how long one VF restore took (netlink writes and read-back)",
        ("pci_bus_id", "device"),
    ),
)


class SriovGuard:
    name = GUARD
    gate = False  # it reports; nothing waits on it
    verdict_words = VERDICTS
    metric_families = METRIC_FAMILIES

    def __init__(self, policy: SriovPolicy | None = None, paths: HostPaths | None = None) -> None:
        self.policy = policy or SriovPolicy()
        self.paths = paths or HostPaths()
        self.mofed = self.paths.mofed

    def needs(self) -> Needs:
        return Needs(files=frozenset({self.mofed.ready, self.mofed.blacklist}), sriov=True)

    def initial_memory(self) -> SriovMemory:
        return SriovMemory()

    def not_applicable(self, snap: NodeSnapshot, memory: SriovMemory) -> str | None:
        """No PF that can have VFs, and nothing guarded or saved; None: it applies (also
        when the PCI bus could not be read)."""
        obs = snap.sriov
        if memory.pfs or obs.persisted.pfs or obs.blind or obs.problems:
            return None
        if any(pf.totalvfs is None or pf.totalvfs > 0 for pf in obs.pfs.values()):
            return None
        return "no SR-IOV PF on this node (no PCI device with sriov_totalvfs > 0): no VF to restore"

    def metric_samples(self, verdict: Verdict, outcomes: Sequence[ActionOutcome]) -> list[Sample]:
        pfs = verdict.evidence.get("pfs") or {}
        out = []
        for pci, ev in pfs.items():
            labels = {"pci_bus_id": pci, "device": str(ev.get("netdev") or "")}
            failed = len(ev.get("failed") or {})
            restored = int(ev.get("restored") or 0)
            counts = {"saved": int(ev.get("vfs") or 0), "restored": restored, "failed": failed}
            if ev.get("phase") == "restoring":
                counts["waiting"] = counts["saved"] - restored - failed
            out += [
                Sample("nodeagent_sriov_vfs", {**labels, "state": k}, v) for k, v in counts.items()
            ]
        for o in outcomes:
            if not isinstance(o.action, RestoreVf) or not o.performed:
                continue
            pci = o.action.pf_pci
            labels = {"pci_bus_id": pci, "device": str((pfs.get(pci) or {}).get("netdev") or "")}
            outcome = "ok" if o.ok else "failed"
            out.append(Sample("nodeagent_sriov_vf_restores_total", {**labels, "outcome": outcome}))
            if o.seconds is not None:
                out.append(Sample("nodeagent_sriov_vf_restore_seconds", labels, o.seconds))
        return out

    def on_stop(self, memory: SriovMemory) -> tuple[()]:
        return ()  # VF config stays as it is; the snapshot file keeps what to restore

    def decide(self, snap: NodeSnapshot, memory: SriovMemory) -> GuardDecision[SriovMemory]:
        p = _Pass(snap, self.policy, self.mofed)
        obs_pfs = snap.sriov.pfs
        if snap.sriov.blind:  # no PF seen: none is judged gone, nothing is done
            return GuardDecision(verdict=self.verdict(snap, memory), actions=(), memory=memory)
        pfs = dict(memory.pfs)
        for pci, saved in snap.sriov.persisted.pfs.items():
            if pci not in pfs:
                pfs[pci] = _adopt(p, pci, saved, obs_pfs.get(pci))
        for pci, obs in obs_pfs.items():
            if pci not in pfs and _stable_now(p, obs) and not read_problems(obs):
                saved = saved_from_observed(obs, snap.sriov.attachments, snap.now)
                pfs[pci] = PfMemory(saved=saved, phase="stable", since=snap.now)
                p.events.append(f"PF {pci} ({obs.netdev}): snapshot of {len(saved.vfs)} VFs taken")
        for pci in sorted(pfs):
            mem = _note_unread(p, pfs[pci], obs_pfs.get(pci))
            pfs[pci] = _PHASES[mem.phase](p, mem, obs_pfs.get(pci))
        memory = SriovMemory(MappingProxyType(pfs))
        if p.actions:  # look again at once: read back, report each VF's outcome
            p.wake.append(snap.now)
        return GuardDecision(
            verdict=self.verdict(snap, memory),
            actions=tuple(p.actions),
            memory=memory,
            events=tuple(p.events),
            wake_at=min(p.wake) if p.wake else None,
            strategy="parallel",  # each VF on its own: one slow or failing VF delays no other
            bound=self.policy.parallel,
        )

    def verdict(self, snap: NodeSnapshot, memory: SriovMemory) -> Verdict:
        reasons: list[str] = []
        pfs_ev: dict[str, Any] = {}
        for pci, mem in sorted(memory.pfs.items()):
            obs = snap.sriov.pfs.get(pci)
            pfs_ev[pci] = _pf_evidence(mem, obs)
            if mem.phase == "degraded":
                failed = [(i, r) for i, r in sorted(mem.restores.items()) if r.status == "failed"]
                if not failed:
                    reasons.append(f"PF {pci}: {mem.why or 'vanished'}; its VFs cannot be restored")
                for i, r in failed:
                    sv = mem.saved.vf(i)
                    reasons.append(f"PF {pci} VF {i} ({sv.pci if sv else '?'}): {r.error}")
        for b in snap.sriov.blind:
            reasons.append(f"SR-IOV PFs not seen ({b}): no VF is guarded until they are")
        unguarded = {
            pci: list(bad)
            for pci, obs in sorted(snap.sriov.pfs.items())
            if pci not in memory.pfs and (bad := read_problems(obs))
        }
        for pci, failed_reads in unguarded.items():
            more = f" (+{len(failed_reads) - 2} more)" if len(failed_reads) > 2 else ""
            reasons.append(
                f"PF {pci} not guarded: read failed: {'; '.join(failed_reads[:2])}{more}"
            )
        state: str = _overall(memory)
        if (snap.sriov.blind or unguarded) and state != "degraded":
            state = "unknown"
        problems = [*snap.sriov.blind, *snap.sriov.problems]
        if snap.sriov.persisted.problem:
            problems.append(snap.sriov.persisted.problem)
        evidence: dict[str, Any] = {"state": state, "pfs": pfs_ev}
        if unguarded:
            evidence["unguarded"] = unguarded
        if problems:
            evidence["problems"] = problems
        return Verdict(
            guard=GUARD,
            verdict=state,
            ok=state not in ("degraded", "unknown"),
            reasons=tuple(reasons),
            evidence=evidence,
        )

    def absorb(self, memory: SriovMemory, outcome: ActionOutcome, now: float) -> SriovMemory:
        absorb = _ABSORB.get(type(outcome.action))
        return memory if absorb is None else absorb(self.policy, memory, outcome, now)

    # -- memory <-> JSON (state.json) ---------------------------------------------------------

    def memory_to_json(self, memory: SriovMemory) -> dict[str, Any]:
        return {
            "pfs": {
                pci: {
                    "saved": saved_pf_to_json(m.saved),
                    "phase": m.phase,
                    "since": m.since,
                    "why": m.why,
                    "back_at": m.back_at,
                    "gone_at": m.gone_at,
                    "numvfs_asked_at": m.numvfs_asked_at,
                    "numvfs_error": m.numvfs_error,
                    "numvfs_quiet_since": m.numvfs_quiet_since,
                    "unsupported": list(m.unsupported),
                    "unread": list(m.unread),
                    "unconfirmed": m.unconfirmed,
                    "restores": {
                        str(i): {
                            "status": r.status,
                            "deadline": r.deadline,
                            "attempts": r.attempts,
                            "next_try": r.next_try,
                            "ready_at": r.ready_at,
                            "done_at": r.done_at,
                            "written": list(r.written),
                            "error": r.error,
                            "reported": r.reported,
                            "ident": r.ident,
                        }
                        for i, r in sorted(m.restores.items())
                    },
                }
                for pci, m in sorted(memory.pfs.items())
            }
        }

    def memory_from_json(self, data: Mapping[str, Any]) -> SriovMemory:
        try:
            return SriovMemory(**fields.read_record(data, MEMORY_FIELDS))
        except (SriovValueError, fields.FieldError, TypeError, KeyError) as exc:
            raise ValueError(f"sriov memory: {exc}") from None


def _absorb_numvfs(
    policy: SriovPolicy, memory: SriovMemory, outcome: ActionOutcome, now: float
) -> SriovMemory:
    action = outcome.action
    assert isinstance(action, SetNumVfs)
    mem = memory.pfs.get(action.pf_pci)
    if mem is None:
        return memory
    err = None if outcome.ok or not outcome.performed else outcome.error
    return _with_pf(memory, replace(mem, numvfs_error=err))


def _absorb_restore(
    policy: SriovPolicy, memory: SriovMemory, outcome: ActionOutcome, now: float
) -> SriovMemory:
    action = outcome.action
    assert isinstance(action, RestoreVf)
    mem = memory.pfs.get(action.pf_pci)
    if mem is None:
        return memory
    r = mem.restores.get(action.index)
    # A worker's outcome arrives a pass or more after its step: the VF may already read
    # back restored (then what the step wrote still belongs to its record), or be gone.
    late = r is not None and r.status == "restored" and outcome.performed and outcome.ok
    if r is None or (r.status != "waiting" and not late):
        return memory
    unsupported = set(mem.unsupported)
    written = list(r.written)
    for name, result in outcome.detail:
        if result == "unsupported" and name in VF_FIELDS:
            unsupported.add(name)
        elif result == "written" and name not in written:
            written.append(name)
    if late:
        r = replace(r, written=tuple(written))
    elif not outcome.performed:  # observe mode: decided and recorded, not done
        r = replace(r, next_try=now + policy.retry_max_s)
    elif outcome.ok:
        r = replace(r, status="restored", done_at=now, written=tuple(written), error=None)
    else:
        attempts = r.attempts + 1
        delay = backoff_delay(attempts, policy.retry_base_s, policy.retry_max_s)
        r = replace(
            r,
            attempts=attempts,
            next_try=now + delay,
            written=tuple(written),
            error=outcome.error,
        )
    restores = dict(mem.restores)
    restores[action.index] = r
    return _with_pf(
        memory,
        replace(
            mem,
            restores=MappingProxyType(restores),
            unsupported=tuple(sorted(unsupported)),
        ),
    )


_ABSORB: Mapping[type, Callable[[SriovPolicy, SriovMemory, ActionOutcome, float], SriovMemory]] = {
    RestoreVf: _absorb_restore,
    SetNumVfs: _absorb_numvfs,
}


def _with_pf(memory: SriovMemory, mem: PfMemory) -> SriovMemory:
    pfs = dict(memory.pfs)
    pfs[mem.saved.pci] = mem
    return SriovMemory(MappingProxyType(pfs))


def _overall(memory: SriovMemory) -> Phase:
    """The guard's one word: its worst PF's phase (no PFs: stable)."""
    worst: Phase = "stable"
    for m in memory.pfs.values():
        if PHASES.index(m.phase) > PHASES.index(worst):
            worst = m.phase
    return worst


# -- saved memory: one table a record (state.json), each in the order its fields are checked;
# an unknown field is ignored.


def _restores(raw: Any, key: str) -> Mapping[int, VfRestore]:
    """``{"<VF index>": {RESTORE_FIELDS}}``, saved under ``<pci>.restores``."""
    pci = key.removesuffix(".restores")
    restores: dict[int, VfRestore] = {}
    for i, r in fields.OBJECT.read(raw, key).items():
        if not (isinstance(i, str) and is_decimal(i)):
            raise fields.FieldError(f"{key}: VF index {i!r} is not a number")
        where = f"{pci} VF {i}"
        record = fields.read_record(fields.OBJECT.read(r, where), RESTORE_FIELDS, f"{where}: ")
        restores[int(i)] = VfRestore(**record)
    return MappingProxyType(restores)


def _pfs(raw: Any, key: str) -> Mapping[str, PfMemory]:
    """``{"<pci>": {PF_FIELDS}}``, each kept under its snapshot's own PCI address."""
    pfs: dict[str, PfMemory] = {}
    for pci, d in fields.OBJECT.read(raw, key).items():
        mem = PfMemory(**fields.read_record(fields.OBJECT.read(d, str(pci)), PF_FIELDS, f"{pci}."))
        pfs[mem.saved.pci] = mem
    return MappingProxyType(pfs)


RESTORE_FIELDS: tuple[fields.Saved, ...] = (
    fields.Saved("status", fields.word(("waiting", "restored", "failed"))),
    fields.Saved("attempts", fields.COUNT, 0),
    fields.Saved("ident", fields.optional(fields.COUNT)),
    fields.Saved("reported", fields.BOOL, False),
    fields.Saved("deadline", fields.TIME, 0.0),
    fields.Saved("next_try", fields.optional(fields.TIME)),
    fields.Saved("ready_at", fields.optional(fields.TIME)),
    fields.Saved("done_at", fields.optional(fields.TIME)),
    fields.Saved("written", fields.STRINGS, []),
    fields.Saved("error", fields.optional(fields.TEXT)),
)
PF_FIELDS: tuple[fields.Saved, ...] = (
    fields.Saved("saved", fields.Custom(saved_pf_from_json)),
    fields.Saved("phase", fields.word(PHASES)),
    fields.Saved("restores", fields.Custom(_restores), {}),
    # (a field this version does not restore is dropped)
    fields.Saved(
        "unsupported",
        replace(fields.STRINGS, make=lambda x: tuple(u for u in x if u in VF_FIELDS)),
        [],
    ),
    fields.Saved("unconfirmed", fields.BOOL, False),
    fields.Saved("since", fields.TIME, 0.0),
    fields.Saved("why", fields.optional(fields.TEXT, "")),
    fields.Saved("back_at", fields.optional(fields.TIME)),
    fields.Saved("gone_at", fields.optional(fields.TIME)),
    fields.Saved("numvfs_asked_at", fields.optional(fields.TIME)),
    fields.Saved("numvfs_error", fields.optional(fields.TEXT)),
    fields.Saved("numvfs_quiet_since", fields.optional(fields.TIME)),
    fields.Saved("unread", fields.STRINGS, []),
)
MEMORY_FIELDS: tuple[fields.Saved, ...] = (fields.Saved("pfs", fields.Custom(_pfs)),)
