"""StorageGuard: keep the RDMA storage modules out of MOFED's way while it installs.

Seed 004: an NFS-over-RDMA mount loads ``rpcrdma`` and its RDMA chain before
the MOFED pod starts; MOFED then refuses ("Storage modules are loaded for
current driver ...") and crash-loops, and the node loses every GPU. This
guard acts per node, in order, only when safe, and puts things back:

- **MOFED pending** (core/mofed.py): the ready flag is absent and MOFED holds
  its ``.lock`` (a FLOCK in /proc/locks; never taken by the agent) or the
  agent saw the flag removed (or a configured marker says so).
- **Verdicts**: ``clear`` (nothing loaded, or MOFED not pending), ``blocking``
  (storage modules loaded while MOFED is pending: MOFED will refuse),
  ``in-use`` (loaded, and used by something that is not a module: an RDMA
  mount, an NVMe-oF controller ...; or who uses it cannot be read),
  ``holding`` (the agent removed them and holds them out until MOFED is ready),
  ``unknown`` (the flag absent, storage modules loaded, /proc/locks unreadable:
  MOFED may be installing; no action, not ok; a hold already there is kept).
- **Actions** (policy ``unload`` | ``hold`` | ``off``): remove the loaded storage
  modules and what of their chain nothing else needs, holders first, in the
  order the holders graph gives (sequence: stop at the first failure); with
  ``hold``, first write a modprobe.d file of ``install <m> /bin/false`` lines,
  removed as soon as MOFED is ready (and on agent stop); then load back what
  was removed, from MOFED's tree. Never a module with non-module users; never
  ``nvme``, ``nvme_core`` or ``nvme_fabrics`` (an NVMe-rooted node boots from them).

Only the chain's own top modules' users count: the lower modules it pulls in
(crypto modules under nvme/target, seen on a real 6.1 kernel) can have
references without holders, and must not block it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from nodeagent.core import applicability, fields
from nodeagent.core import policy as cfgval
from nodeagent.core.actions import (
    Action,
    ActionOutcome,
    LoadModule,
    RemoveFile,
    UnloadModule,
    WriteFile,
)
from nodeagent.core.guard import GuardDecision, Verdict, backoff_delay
from nodeagent.core.identity import module_evidence
from nodeagent.core.modgraph import RemovalBlocked, holders_closure, removal_order
from nodeagent.core.mofed import MOFED_MODES, MofedMode, pending_signals, unreadable_markers
from nodeagent.core.needs import HOST_TREE, Needs
from nodeagent.core.paths import HostPaths
from nodeagent.core.snapshot import LoadedModule, NodeSnapshot, NvmeController, NvmetPort
from nodeagent.errors import NodeagentError

STORAGE_MODULES: tuple[str, ...] = (
    "ib_iser",
    "ib_isert",
    "ib_srp",
    "ib_srpt",
    "nvme_rdma",
    "nvmet_rdma",
    "rpcrdma",
    "xprtrdma",
)
ALIASES = {"xprtrdma": "rpcrdma"}  # the module is rpcrdma; xprtrdma is its alias
# What an NVMe-rooted node boots from: never removed (doca-driver-build 479/480).
NEVER_REMOVE = frozenset({"nvme", "nvme_core", "nvme_fabrics"})
HOLD_FILE = "etc/modprobe.d/nodeagent-storage-hold.conf"
# A module seen going is looked at again this soon (its removal uevent wakes the loop too).
GOING_RECHECK_S = 1.0
# MOFED's next attempt (a pod restart reopening its existing lock: gofrs/flock opens the
# file, then flocks it) takes a flock, which no inotify watch sees; its opening does (the
# guard asks for it: ``Needs.opens``). A pass woken by the opening may come before the
# flock: while the lock was opened less than LOCK_LOOK_S ago, unheld, the flag absent and
# storage modules loaded, the lock table is read again every LOCK_RELOOK_S. MOFED checks
# the storage modules ~1.7 s after taking the lock (seed 004's log). Bounded: a few
# passes after each opening, none otherwise (MOFED stopped for good costs nothing).
LOCK_LOOK_S = 0.5
LOCK_RELOOK_S = 0.1

StoragePolicyName = Literal["unload", "hold", "off"]
BackoffPhase = Literal["remove", "load"]
PHASES: tuple[BackoffPhase, ...] = ("remove", "load")
POLICIES: tuple[StoragePolicyName, ...] = ("unload", "hold", "off")


@dataclass(frozen=True)
class StoragePolicy:
    enabled: applicability.Enabled = "auto"
    mofed: MofedMode = "container"  # "none": no MOFED on the node, nothing to guard
    policy: StoragePolicyName = "hold"
    modules: tuple[str, ...] = STORAGE_MODULES
    reload: bool = True
    hold_file: str = HOLD_FILE
    # More files whose presence means "MOFED is about to install" (e.g. an init marker).
    pending_markers: tuple[str, ...] = ()
    retry_base_s: float = 5.0
    retry_max_s: float = 300.0

    @property
    def roots(self) -> tuple[str, ...]:
        """The module names to look for (aliases resolved), in config order, once each."""
        return tuple(dict.fromkeys(ALIASES.get(m, m) for m in self.modules))


# Where modprobe reads configuration (modprobe.d(5)); a hold file elsewhere holds nothing.
MODPROBE_DIRS = (
    "etc/modprobe.d",
    "run/modprobe.d",
    "usr/local/lib/modprobe.d",
    "lib/modprobe.d",
    "usr/lib/modprobe.d",
)
_CONF_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}\.conf")


def _hold_file(where: str, value: Any) -> str:
    """A ``.conf`` file of our own in a modprobe.d directory: the agent writes and removes it,
    so it must not name anything else (MOFED's blacklist, its ready flag)."""
    rel = cfgval.check_relpath(where, value)
    parent, _, name = rel.strip("/").rpartition("/")
    if parent not in MODPROBE_DIRS or not _CONF_NAME.fullmatch(name):
        raise NodeagentError(
            f"config {where}: {value!r} must be a NAME.conf file in one of "
            f"{', '.join(MODPROBE_DIRS)}"
        )
    if name == "blacklist-ofed-modules.conf":
        raise NodeagentError(f"config {where}: {value!r} is MOFED's own file")
    return rel


# [storage]: one row a policy field, in the order they are checked.
POLICY_FIELDS: tuple[fields.Setting, ...] = (
    fields.Setting("enabled", "enabled", applicability.parse_enabled),
    fields.Setting("mofed", "mofed", fields.one_of(MOFED_MODES)),
    fields.Setting("policy", "policy", fields.one_of(POLICIES)),
    fields.Setting("modules", "modules", fields.modules),
    fields.Setting("reload", "reload", fields.flag),
    fields.Setting("hold_file", "hold_file", _hold_file),
    fields.Setting("pending_markers", "pending_markers", fields.paths),
    fields.Setting("retry_base_seconds", "retry_base_s", fields.number(0.01, 3600)),
    fields.Setting("retry_max_seconds", "retry_max_s", fields.number(0.01, 86400)),
)


def parse_policy(table: Mapping[str, Any], pol: StoragePolicy) -> StoragePolicy:
    """``[storage]`` of the config file over ``pol``; NodeagentError naming a bad value."""
    return fields.apply_settings("storage", table, POLICY_FIELDS, pol)


@dataclass(frozen=True)
class StorageMemory:
    flag_seen: bool = False  # the ready flag was present on the last pass
    flag_removed: bool = False  # ... and then went: MOFED is restarting
    removed: tuple[str, ...] = ()  # storage modules the agent removed, to load back
    holding: bool = False  # the agent wrote the hold file (and has not removed it)
    failures: int = 0
    retry_at: float | None = None
    last_error: str | None = None
    # Which phase the backoff holds back: "remove" (the removal, the hold file) or "load"
    # (the load-back). A load-back owed once MOFED is ready never waits on a removal's
    # backoff. None (a memory saved before it was kept): both.
    backoff_of: BackoffPhase | None = None
    # The load-back's last refusal before any insert (a module built against another
    # stack than the one loaded): the verdict says it until a load-back goes in.
    load_refused: str | None = None


# Saved memory (state.json): one row a StorageMemory field, in the order they are checked;
# an unknown field is ignored.
MEMORY_FIELDS: tuple[fields.Saved, ...] = (
    fields.Saved("removed", fields.MODULES, []),
    fields.Saved("flag_seen", fields.BOOL, False),
    fields.Saved("flag_removed", fields.BOOL, False),
    fields.Saved("holding", fields.BOOL, False),
    fields.Saved("last_error", fields.optional(fields.TEXT)),
    fields.Saved("failures", fields.COUNT, 0),
    fields.Saved("retry_at", fields.optional(fields.TIME)),
    fields.Saved("backoff_of", fields.optional(fields.word(PHASES))),
    fields.Saved("load_refused", fields.optional(fields.TEXT)),
)


# What an admin does about a load-back refused for its CRCs (``other-stack``).
OTHER_STACK_REMEDY = (
    "nothing of its chain was inserted (the kernel would refuse a module built against "
    "another RDMA stack than the one loaded); with NVIDIA's DOCA driver container, set "
    "ENABLE_NFSRDMA=true in the NicClusterPolicy's driver env so MOFED builds its own "
    "storage modules (then recreate the MOFED pod on this node), or keep the storage "
    "modules out of this node's use"
)


def hold_file_text(modules: tuple[str, ...]) -> str:
    """``install <m> /bin/false`` for each module (once), under a header saying who and why."""
    lines = [
        "# Written by nodeagent (storage guard): MOFED is installing its RDMA stack and",
        "# refuses to start while these storage modules are loaded (UNLOAD_STORAGE_MODULES).",
        "# Removed as soon as MOFED is ready; an RDMA mount meanwhile fails fast and is retried.",
    ]
    lines += [f"install {m} /bin/false" for m in dict.fromkeys(modules)]
    return "\n".join(lines) + "\n"


class StorageGuard:
    name = "storage"
    gate = False
    # Its own words for nodeagent_guard_state (without them the metric offered open/closed).
    verdict_words: tuple[str, ...] = (
        "clear",
        "holding",
        "blocking",
        "in-use",
        "unknown",
        "other-stack",
    )

    def __init__(self, policy: StoragePolicy | None = None, paths: HostPaths | None = None) -> None:
        self.policy = policy or StoragePolicy()
        self.paths = paths or HostPaths()
        self.mofed = self.paths.mofed

    def needs(self) -> Needs:
        return Needs(
            chains=frozenset(self.policy.roots),
            chain_trees=(HOST_TREE, self.paths.mofed_driver_root),
            files=self.mofed.files | {self.policy.hold_file, *self.policy.pending_markers},
            opens=frozenset({self.mofed.lock}),
            locks=True,
            mounts=True,
            nvme=True,
            pci=self.policy.enabled == "auto",
        )

    def not_applicable(self, snap: NodeSnapshot, memory: StorageMemory) -> str | None:
        """Why nothing here can refuse to install over the storage modules; None: it
        applies (always while it owes something: its hold file, modules to load back)."""
        if memory.removed or memory.holding or snap.file(self.policy.hold_file).present:
            return None
        if self.policy.mofed == "none":
            return (
                'no MOFED on this node ([storage] mofed = "none"): nothing refuses to '
                "install over the storage modules"
            )
        nics = applicability.devices(
            snap, applicability.MELLANOX_VENDOR, applicability.NETWORK_CLASS
        )
        facts = [snap.file(f) for f in sorted(self.mofed.files)]
        signs = [f for f in facts if f.present or f.problem not in (None, "not observed")]
        if nics == [] and not signs:
            return (
                "no MOFED on this node (none of its files, no PCI network device of vendor "
                "0x15b3): nothing refuses to install over the storage modules"
            )
        return None

    # -- memory -------------------------------------------------------------

    def initial_memory(self) -> StorageMemory:
        return StorageMemory()

    def memory_to_json(self, memory: StorageMemory) -> dict[str, Any]:
        return {
            "flag_seen": memory.flag_seen,
            "flag_removed": memory.flag_removed,
            "removed": list(memory.removed),
            "holding": memory.holding,
            "failures": memory.failures,
            "retry_at": memory.retry_at,
            "last_error": memory.last_error,
            "backoff_of": memory.backoff_of,
            "load_refused": memory.load_refused,
        }

    def memory_from_json(self, data: Mapping[str, Any]) -> StorageMemory:
        try:
            memory = StorageMemory(**fields.read_record(data, MEMORY_FIELDS))
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"storage memory is malformed: {exc}") from None
        # Bounded by what the guard could have written: it only ever records the chain's
        # top modules it removed, once each (20,000 names would be 20,000 load-backs).
        could = (*self.policy.roots, *StoragePolicy().roots)
        if len(memory.removed) > len(set(could)) or len(set(memory.removed)) < len(memory.removed):
            raise ValueError(
                f"storage memory is malformed: removed names {len(memory.removed)} modules "
                f"(or one twice); the guard removes at most {len(set(could))}, once each"
            )
        stray = [m for m in memory.removed if m not in could]
        if stray:
            raise ValueError(
                f"storage memory is malformed: removed names {stray[0][:64]!r}, not a storage "
                "module the guard could have removed"
            )
        return memory

    @staticmethod
    def _backing_off(memory: StorageMemory, phase: BackoffPhase, now: float) -> bool:
        """Is ``phase`` held back by the backoff of an earlier failure of that phase?"""
        if memory.retry_at is None or now >= memory.retry_at:
            return False
        return memory.backoff_of in (None, phase)

    # -- the decision ---------------------------------------------------------

    def decide(self, snap: NodeSnapshot, memory: StorageMemory) -> GuardDecision[StorageMemory]:
        pol = self.policy
        ready = snap.file(self.mofed.ready).present
        flag_removed = not ready and (memory.flag_removed or memory.flag_seen)
        memory = replace(memory, flag_seen=ready, flag_removed=flag_removed)
        pending = list(pending_signals(snap, self.mofed, flag_removed))
        pending += [f"{m} exists" for m in pol.pending_markers if snap.file(m).present]
        hold = snap.file(pol.hold_file)
        loaded = [m for m in pol.roots if m in snap.modules]
        # The flag absent and the lock table, the lock or the flag itself unreadable: MOFED
        # may be installing right now.
        unread = [*snap.read_problems.get("locks", ()), *unreadable_markers(snap, self.mofed)]
        locks_unread = unread if not ready and not pending else ()
        lock_unknown = (
            f"cannot tell whether MOFED is about to install ({'; '.join(locks_unread)})"
            if locks_unread
            else ""
        )
        evidence: dict[str, Any] = {
            "policy": pol.policy,
            "mofed_pending": pending,
            "mofed_ready": ready,
            "loaded": {m: module_evidence(snap.modules[m]) for m in loaded},
            "hold_file": {"path": hold.path, "present": hold.present},
            "removed_by_agent": list(memory.removed),
        }
        if hold.problem and hold.problem != "not observed":
            evidence["hold_file"]["problem"] = hold.problem
        if memory.last_error:
            evidence["last_error"] = memory.last_error

        reasons: list[str] = []
        actions: list[Action] = []
        wake_at: float | None = None
        lets_finish = False
        if pending and loaded:
            tops = holders_closure(snap.modules, loaded)
            users, unseen = self._users(snap, sorted(tops))
            evidence["users"] = users
            if unseen:
                evidence["unseen"] = unseen
            if users or unseen:  # fail closed: what the agent cannot read may be a user
                verdict = "in-use"
                reasons += [f"{m} is in use: {'; '.join(u)}" for m, u in users.items()]
                reasons += [
                    f"cannot tell whether {m} is in use: {'; '.join(u)}; not removing"
                    for m, u in unseen.items()
                ]
                reasons.append(
                    "MOFED (" + "; ".join(pending) + ") will refuse to install while "
                    f"{', '.join(loaded)} {'is' if len(loaded) == 1 else 'are'} loaded; "
                    "the agent does not remove modules with users, or that it cannot "
                    "tell are unused"
                )
            else:
                verdict = "blocking"
                reasons.append(
                    f"storage modules {', '.join(loaded)} are loaded while MOFED is pending ("
                    + "; ".join(pending)
                    + "): MOFED will refuse to install"
                )
                unknown = sorted(m for m in tops if snap.modules[m].refcnt is None)
                try:
                    order = removal_order(snap.modules, self._removal_set(snap, tops))
                except RemovalBlocked as exc:
                    reasons.append(f"cannot order the removal: {exc}")
                    order = []
                if unknown:  # fail closed: a user the agent cannot see may be there
                    reasons.append(
                        f"cannot tell whether {', '.join(unknown)} "
                        f"{'is' if len(unknown) == 1 else 'are'} in use (refcnt unreadable); "
                        "not removing"
                    )
                    order = []
                # A module already going is being unloaded (by the kernel, for a caller that
                # may be gone: an agent killed mid-removal): not asked again, looked at again.
                going = [m for m in order if snap.modules[m].initstate == "going"]
                if going:
                    order = [m for m in order if m not in going]
                    reasons.append(f"{', '.join(going)} being unloaded (going)")
                    wake_at = snap.now + GOING_RECHECK_S
                evidence["removal_order"] = order
                if order and pol.policy != "off":
                    if self._backing_off(memory, "remove", snap.now):
                        wake_at = _sooner(wake_at, memory.retry_at)
                    else:
                        # A hold file in place is kept as it is: rewritten, the write
                        # would differ from the one a running removal made (the chain
                        # seen mid-way is shorter) and supersede it.
                        if pol.policy == "hold" and not hold.present:
                            actions.append(
                                WriteFile(
                                    self.name,
                                    pol.hold_file,
                                    hold_file_text((*pol.modules, *order)),
                                    "hold the storage modules out while MOFED installs",
                                )
                            )
                        why = "MOFED is pending and refuses to install over storage modules"
                        actions += [UnloadModule(self.name, m, why) for m in order]
                        # Intent before action: memory (saved, fsynced, before the plan
                        # starts) names what is about to go, so an agent killed mid-plan
                        # still loads back everything it may have removed.
                        intent = (*memory.removed, *(m for m in order if m in pol.roots))
                        memory = replace(memory, removed=tuple(dict.fromkeys(intent)))
        elif hold.present and (pending or (memory.removed and not ready) or lock_unknown):
            # Until MOFED is ready: a crash-looping MOFED is not pending between its tries,
            # and a lock the agent cannot read may be MOFED's: the hold stays.
            verdict = "holding"
            # The removal in flight belongs to this hold (its own steps wake passes: the
            # hold file's write, each module's going): nothing new, and it runs to its end.
            lets_finish = True
            if lock_unknown:
                reasons.append(f"keeping the hold: {lock_unknown}")
        elif loaded and lock_unknown:
            verdict = "unknown"  # fail closed: no action, and not ok
            reasons.append(
                f"{lock_unknown}; storage modules {', '.join(loaded)} are loaded, and MOFED "
                "refuses to install over them: the agent acts once it can read the lock"
            )
        else:
            verdict = "clear"
            if hold.present and pol.policy != "off":
                actions.append(
                    RemoveFile(
                        self.name,
                        pol.hold_file,
                        "MOFED is ready" if ready else "MOFED is not pending (stale hold file)",
                    )
                )
            if ready and memory.removed:
                # What is loaded needs no loading back (an intent whose removal never
                # happened, or a module someone else loaded); one going is on its way out
                # (an unload a killed agent began): it is owed a load-back once gone.
                live = {m for m, mod in snap.modules.items() if mod.initstate != "going"}
                memory = replace(memory, removed=tuple(m for m in memory.removed if m not in live))
            if not memory.removed:
                memory = replace(memory, load_refused=None)
            elif ready and memory.load_refused and pol.reload and pol.policy != "off":
                verdict = "other-stack"
                reasons.append(f"{memory.load_refused}; {OTHER_STACK_REMEDY}")
            if ready and memory.removed and pol.reload and pol.policy != "off":
                if any(m in snap.modules for m in memory.removed):
                    wake_at = snap.now + GOING_RECHECK_S  # loaded back once its unload ends
                if self._backing_off(memory, "load", snap.now):
                    wake_at = _sooner(wake_at, memory.retry_at)
                else:
                    actions += [
                        LoadModule(
                            self.name,
                            m,
                            (self.paths.mofed_driver_root, HOST_TREE),
                            "MOFED is ready: loading back what the agent removed",
                        )
                        for m in memory.removed
                        if m not in snap.modules
                    ]
        lock = snap.file(self.mofed.lock)
        opened_s_ago = None if lock.opened_at is None else snap.now - lock.opened_at
        if (
            verdict == "clear"
            and loaded
            and not ready
            and lock.present
            and pol.policy != "off"
            and opened_s_ago is not None
            and opened_s_ago < LOCK_LOOK_S
        ):
            wake_at = _sooner(wake_at, snap.now + LOCK_RELOOK_S)
            evidence["lock_opened_seconds_ago"] = round(opened_s_ago, 3)
            reasons.append(
                f"MOFED opened its lock {self.mofed.lock} {opened_s_ago:.2f} s ago and holds "
                f"no flock on it yet: the lock table is read again every {LOCK_RELOOK_S:g} s "
                f"until {LOCK_LOOK_S:g} s after the opening"
            )
        ok = verdict in ("clear", "holding")
        return GuardDecision(
            verdict=Verdict(self.name, verdict, ok, tuple(reasons), evidence),
            actions=tuple(actions),
            memory=memory,
            wake_at=wake_at,
            strategy="sequence",
            lets_finish=lets_finish,
        )

    def _removal_set(self, snap: NodeSnapshot, tops: set[str]) -> set[str]:
        """The top modules and every loaded module only they hold (transitively),
        except what an NVMe-rooted node boots from and modules used from elsewhere."""
        out = set(tops) - NEVER_REMOVE
        grew = True
        while grew:
            grew = False
            for name, mod in snap.modules.items():
                if name in out or name in NEVER_REMOVE or not mod.holders:
                    continue
                if (
                    all(h in out for h in mod.holders)
                    and mod.refcnt is not None
                    and (mod.outside_refs == 0)
                ):
                    out.add(name)
                    grew = True
        return out

    def _users(
        self, snap: NodeSnapshot, tops: list[str]
    ) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
        """Non-module users of the chain's top modules, named where the node says who;
        and, per top module, what the agent could not read of who might use it.

        A named user counts even with no reference: the kernel lets ``nvme_rdma`` go
        with a live controller (its exit deletes the controllers; fabrics drops the
        module reference once the controller is made), so the refcount alone would
        not stop the agent from cutting an NVMe-oF connection. For the same reason a
        controller whose transport cannot be read, or a mount table that cannot be
        read, is not taken for "no user".
        """
        users: dict[str, list[str]] = {}
        unseen: dict[str, list[str]] = {}
        for name in tops:
            mod: LoadedModule = snap.modules[name]
            named, unread = _NAMERS.get(name, _nobody)(snap)
            if unread:
                unseen[name] = unread
            if mod.outside_refs == 0 and not named:
                continue
            refs = f"refcnt {mod.refcnt}, module holders: {', '.join(mod.holders) or 'none'}"
            users[name] = named or [f"{refs}; used by something that is not a module"]
        return users, unseen

    def absorb(self, memory: StorageMemory, outcome: ActionOutcome, now: float) -> StorageMemory:
        if not outcome.performed:
            if isinstance(outcome.action, UnloadModule):  # decided, not done (observe mode):
                return _loaded(memory, outcome.action, self.policy)  # the intent goes
            return memory
        action = outcome.action
        if outcome.ok:
            done = _DONE.get(type(action))
            if done is not None:
                memory = done(memory, action, self.policy)
            return replace(
                memory,
                failures=0,
                retry_at=None,
                last_error=None,
                backoff_of=None,
                load_refused=None if isinstance(action, LoadModule) else memory.load_refused,
            )
        if ("refused", "crcs") in outcome.detail:
            memory = replace(memory, load_refused=outcome.error)
        phase: BackoffPhase = "load" if isinstance(action, LoadModule) else "remove"
        # A failure of the other phase starts this one's backoff afresh.
        failures = (memory.failures if memory.backoff_of in (None, phase) else 0) + 1
        delay = backoff_delay(failures, self.policy.retry_base_s, self.policy.retry_max_s)
        return replace(
            memory,
            failures=failures,
            retry_at=now + delay,
            last_error=outcome.error or f"{action.describe()} failed",
            backoff_of=phase,
        )

    def on_stop(self, memory: StorageMemory) -> tuple[Action, ...]:
        if not memory.holding:
            return ()
        return (RemoveFile(self.name, self.policy.hold_file, "the agent is stopping"),)


def _sooner(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


# A namer: the users of one top module the node names, and what could not be read
# of them (a user may hide there).
Named = tuple[list[str], list[str]]


def _unread(snap: NodeSnapshot, field: str, what: str) -> list[str]:
    return [f"{what}: {p}" for p in snap.read_problems.get(field, ())]


def _rdma_proto(option: str) -> bool:
    """``proto=rdma`` or ``proto=rdma6`` (NFS over RDMA, IPv4 or IPv6), in any order and case."""
    key, _, value = option.partition("=")
    return key.strip().lower() == "proto" and value.strip().lower() in ("rdma", "rdma6")


def _rdma_mounts(snap: NodeSnapshot) -> Named:
    named = [
        f"NFS-over-RDMA mount {m.mount_point} ({m.source})"
        for m in snap.mounts
        if any(_rdma_proto(o) for o in m.options)
    ]
    return named, _unread(snap, "mounts", "mounts")


def _rdma_controllers(snap: NodeSnapshot) -> Named:
    named = [
        f"NVMe-oF controller {c.name} (subsystem {c.subsysnqn or 'unknown'})"
        for c in snap.nvme
        if c.transport == "rdma"
    ]
    return named, _unread(snap, "nvme", "NVMe controllers") + _misread(snap.nvme, "NVMe controller")


def _rdma_ports(snap: NodeSnapshot) -> Named:
    named = [
        f"NVMe-oF target port {p.name} (rdma {p.address}, subsystem {', '.join(p.subsystems)})"
        for p in snap.nvmet_ports
        if p.transport == "rdma" and p.subsystems
    ]
    unread = _unread(snap, "nvmet_ports", "NVMe-oF target ports")
    return named, unread + _misread(snap.nvmet_ports, "NVMe-oF target port")


def _misread(facts: Iterable[NvmeController | NvmetPort], what: str) -> list[str]:
    """The controllers or ports whose transport or anything else could not be read."""
    out: list[str] = []
    for f in facts:
        if f.transport == "unknown":
            out.append(f"{what} {f.name}: transport unknown ({f.problem or 'not reported'})")
        elif f.problem:
            out.append(f"{what} {f.name}: {f.problem}")
    return out


def _nobody(snap: NodeSnapshot) -> Named:
    return [], []


# Who uses which top module, as far as the node says (others: refcnt only).
_NAMERS = {"rpcrdma": _rdma_mounts, "nvme_rdma": _rdma_controllers, "nvmet_rdma": _rdma_ports}


def _unloaded(memory: StorageMemory, action: Any, pol: StoragePolicy) -> StorageMemory:
    if action.module in pol.roots and action.module not in memory.removed:
        return replace(memory, removed=(*memory.removed, action.module))
    return memory


def _loaded(memory: StorageMemory, action: Any, pol: StoragePolicy) -> StorageMemory:
    return replace(memory, removed=tuple(m for m in memory.removed if m != action.module))


# What a successful action changes in the guard's memory, by action type.
_DONE = {
    UnloadModule: _unloaded,
    LoadModule: _loaded,
    WriteFile: lambda memory, action, pol: replace(memory, holding=True),
    RemoveFile: lambda memory, action, pol: replace(memory, holding=False),
}
