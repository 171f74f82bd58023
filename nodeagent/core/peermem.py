"""PeermemGate: where the agent decides to load or unload ``nvidia_peermem``.

``nvidia_peermem`` binds the GPU driver to the RDMA core (``ib_core``'s
peer-memory API). Loaded against an RDMA stack that is mid-``openibd restart``,
or built against another ``ib_core`` than the one loaded, the kernel refuses it
with ``EINVAL`` and the GPU driver pod crash-loops (seeds 000-002). The gate
opens only when the evidence says the stack under it is the final one:

1. ``nvidia`` is loaded and live;
2. the MOFED ready flag exists and was (re)created after the agent last saw a
   MOFED restart (flag removed, blacklist written, ``mlx5_core`` leaving);
3. MOFED's ``blacklist-ofed-modules.conf`` is absent (present = mid-restart);
4. ``mlx5_core``, ``mlx5_ib``, ``ib_core``, ``ib_uverbs`` are loaded and live;
5. each of those is the module on disk (srcversion, else GNU build-id);
6. the symbol CRCs ``nvidia_peermem.ko`` needs match those its loaded
   providers export (the ABI preflight), where both can be read.

Host-MOFED mode (no MOFED container) skips 2 and 3.

Actions: gate open + peermem absent -> load it from the GPU driver root; a MOFED
restart seen + peermem loaded with refcnt 0 -> unload it at once so
``openibd restart`` does not fail on it. Failed loads back off exponentially.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from nodeagent.core import applicability, fields
from nodeagent.core.actions import ActionOutcome, LoadModuleFile, UnloadModule
from nodeagent.core.gpudirect import classify
from nodeagent.core.guard import GuardDecision, Verdict, backoff_delay, is_count
from nodeagent.core.hold import DRIVER_CONTAINER_RULES, parse_rules
from nodeagent.core.identity import (
    abi_mismatches,
    disk_evidence,
    identity_mismatch,
    module_evidence,
)
from nodeagent.core.mofed import (
    MOFED_MODES,
    MofedMode,
    RestartTrack,
    restart_signals,
    track_restart,
)
from nodeagent.core.needs import HOST_TREE, DiskNeed, Needs
from nodeagent.core.paths import HostPaths
from nodeagent.core.snapshot import DiskModule, FileId, HeldModule, NodeSnapshot
from nodeagent.core.telemetry import MetricFamily, Sample
from nodeagent.errors import NodeagentError

PEERMEM = "nvidia_peermem"
NVIDIA = "nvidia"
RDMA_STACK: tuple[str, ...] = ("mlx5_core", "mlx5_ib", "ib_core", "ib_uverbs")


@dataclass(frozen=True)
class PeermemPolicy:
    enabled: applicability.Enabled = "auto"
    mofed: MofedMode = "container"
    rdma_stack: tuple[str, ...] = RDMA_STACK
    load_params: tuple[str, ...] = ()
    retry_base_s: float = 5.0
    retry_max_s: float = 300.0
    # Hold anyone's open of nvidia-peermem.ko by a module loader while the gate is closed
    # (guards/peermem/): "off" or "fanotify". The budget stays below the driver container's
    # startup probe (120 x 10 s): past it the open is allowed and reported.
    hold_loads: str = "off"
    hold_budget_s: float = 900.0
    # Under the host root: filesystems marked at start. None by default: /lib/modules is
    # rarely a mount of its own, so marking it marks the host's root filesystem (every open
    # on the node through the responder); the driver containers' roots are marked instead.
    hold_roots: tuple[str, ...] = ()
    # Processes whose root is marked as they start (core/hold.py), how often
    # /proc is looked at for them; () marks no container root.
    hold_containers: tuple[str, ...] = DRIVER_CONTAINER_RULES
    hold_scan_s: float = 0.1


HOLD_MODES = ("off", "fanotify")


def _container_rules(where: str, value: Any) -> tuple[str, ...]:
    """Command rules (core/hold.py); an empty list marks no container root."""
    if not isinstance(value, list):
        raise NodeagentError(f"config {where}: expected a list of command rules, got {value!r}")
    return () if value == [] else parse_rules(where, value)


# [peermem]: one row a policy field, in the order they are checked.
POLICY_FIELDS: tuple[fields.Setting, ...] = (
    fields.Setting("enabled", "enabled", applicability.parse_enabled),
    fields.Setting("mofed", "mofed", fields.one_of(MOFED_MODES)),
    fields.Setting("load_params", "load_params", fields.params),
    fields.Setting("retry_base_seconds", "retry_base_s", fields.number(0.01, 3600)),
    fields.Setting("retry_max_seconds", "retry_max_s", fields.number(0.01, 86400)),
    fields.Setting("rdma_stack", "rdma_stack", fields.modules),
    fields.Setting("hold_loads", "hold_loads", fields.one_of(HOLD_MODES)),
    fields.Setting("hold_budget_seconds", "hold_budget_s", fields.number(1, 1190)),
    fields.Setting("hold_roots", "hold_roots", fields.paths),
    fields.Setting("hold_containers", "hold_containers", _container_rules),
    fields.Setting("hold_scan_seconds", "hold_scan_s", fields.number(0.01, 10)),
)


def parse_policy(table: Mapping[str, Any], pol: PeermemPolicy) -> PeermemPolicy:
    """``[peermem]`` of the config file over ``pol``; NodeagentError naming a bad value."""
    return fields.apply_settings("peermem", table, POLICY_FIELDS, pol)


@dataclass(frozen=True)
class PeermemMemory:
    # A MOFED restart was seen and no fresh ready flag has appeared since.
    restart_pending: bool = False
    # The flag incarnation present when the restart was seen: it is stale.
    stale_flag: FileId | None = None
    failures: int = 0
    retry_at: float | None = None
    last_error: str | None = None
    # The restart signals of the last pass, to report a restart once, when it begins.
    last_signals: tuple[str, ...] = ()


# The gate's conditions, by the name its metrics use (nodeagent_peermem_condition_holding).
PEERMEM_CONDITIONS: tuple[str, ...] = (
    "nvidia_live",
    "mofed_ready_flag",
    "mofed_ready_flag_fresh",
    "mofed_not_restarting",
    "rdma_stack_live",
    "rdma_stack_on_disk",
    "abi_crcs_match",
)


class PeermemGate:
    name = "peermem"
    gate = True
    # "rebuild": MOFED is ready and final, but nvidia-peermem.ko was built against another
    # ib_core (gpu-operator#2868): no wait helps, the driver pod must rebuild it.
    verdict_words: tuple[str, ...] = ("open", "closed", "rebuild")
    metric_families: tuple[MetricFamily, ...] = (
        MetricFamily(
            "nodeagent_peermem_condition_holding",
            "gauge",
            "1 while this condition fails and so holds the peermem gate closed",
            ("condition",),
        ),
        MetricFamily(
            "nodeagent_peermem_mofed_ready",
            "gauge",
            "1 while MOFED says its stack is final (container: fresh ready flag, no blacklist; "
            "host: the RDMA stack loaded and live)",
        ),
        MetricFamily(
            "nodeagent_peermem_rebuild_needed",
            "gauge",
            "1 while MOFED is ready but nvidia-peermem.ko was built against another ib_core "
            "(symbol CRCs differ): recreate the GPU driver pod to rebuild it",
        ),
        MetricFamily(
            "nodeagent_peermem_load_failures",
            "gauge",
            "consecutive failed nvidia_peermem loads (the retry backoff's count)",
        ),
        MetricFamily(
            "nodeagent_gpudirect_dmabuf_capable",
            "gauge",
            "1 when GPUDirect RDMA can use DMA-BUF (open kernel modules, kernel >= 5.12: "
            "peermem not required), 0 when it needs nvidia_peermem; absent while unknown",
            ("modules",),
        ),
    )

    def __init__(self, policy: PeermemPolicy | None = None, paths: HostPaths | None = None) -> None:
        self.policy = policy or PeermemPolicy()
        self.paths = paths or HostPaths()
        self.mofed = self.paths.mofed

    def needs(self) -> Needs:
        pol, paths = self.policy, self.paths
        stack_trees = (HOST_TREE,) if pol.mofed == "host" else (paths.mofed_driver_root, HOST_TREE)
        return Needs(
            modules=frozenset({NVIDIA, PEERMEM, "mlx5_core", *pol.rdma_stack}),
            disk=(
                *(DiskNeed(name, stack_trees) for name in pol.rdma_stack),
                DiskNeed(PEERMEM, (paths.gpu_driver_root, HOST_TREE), follow_depends=True),
            ),
            files=self.mofed.files,
            present_if_odd=frozenset({self.mofed.blacklist}),
            listings=frozenset(
                {
                    paths.validations,
                    paths.memory_peers,
                    paths.gpu_driver_root,
                    f"{paths.mofed_driver_root}/lib/modules",  # its tree for which kernels
                }
            ),
            texts=frozenset({paths.nvidia_version}),
            pci=self.policy.enabled == "auto",
            held=pol.hold_loads != "off",
        )

    def not_applicable(self, snap: NodeSnapshot, memory: PeermemMemory) -> str | None:
        """Why the gate has nothing to guard here, from what the node has (not what is
        loaded: a GPU whose driver is not loaded yet is a GPU); None: it applies."""
        if self.policy.mofed == "none":
            return (
                'no MOFED on this node ([peermem] mofed = "none"): nvidia_peermem needs '
                "MOFED's peer-memory API; GPUDirect RDMA here goes through DMA-BUF or not at all"
            )
        gpus = applicability.devices(snap, applicability.NVIDIA_VENDOR, applicability.DISPLAY_CLASS)
        if gpus == []:
            return (
                "no NVIDIA GPU on this node (no PCI display device of vendor 0x10de): "
                "nvidia_peermem has nothing to serve"
            )
        nics = applicability.devices(
            snap, applicability.MELLANOX_VENDOR, applicability.NETWORK_CLASS
        )
        if nics == []:
            return (
                "no RDMA NIC on this node (no PCI network device of vendor 0x15b3, "
                "ConnectX/BlueField): GPUDirect RDMA cannot happen, nvidia_peermem is never needed"
            )
        return None

    # -- telemetry ------------------------------------------------------------

    def metric_samples(self, verdict: Verdict, actions: Sequence[ActionOutcome]) -> list[Sample]:
        ev = verdict.evidence
        holding = set(ev.get("holding", ()))
        out = [
            Sample("nodeagent_peermem_condition_holding", {"condition": c}, float(c in holding))
            for c in PEERMEM_CONDITIONS
        ]
        out.append(Sample("nodeagent_peermem_mofed_ready", {}, float(bool(ev.get("mofed_ready")))))
        out.append(
            Sample("nodeagent_peermem_rebuild_needed", {}, float(verdict.verdict == "rebuild"))
        )
        failures = (ev.get("peermem") or {}).get("failures", 0)
        out.append(Sample("nodeagent_peermem_load_failures", {}, float(failures)))
        gpudirect = ev.get("gpudirect") or {}
        if gpudirect.get("dmabuf_capable") is not None:
            modules = {"modules": str(gpudirect.get("modules"))}  # open | proprietary
            capable = float(bool(gpudirect["dmabuf_capable"]))
            out.append(Sample("nodeagent_gpudirect_dmabuf_capable", modules, capable))
        return out

    def mofed_ready(self, snap: NodeSnapshot, memory: PeermemMemory) -> bool:
        if self.policy.mofed == "container":
            return (
                snap.file(self.mofed.ready).present
                and not memory.restart_pending
                and not snap.file(self.mofed.blacklist).present
            )
        return all(
            (m := snap.module(name)) is not None and m.live for name in self.policy.rdma_stack
        )

    # -- memory -------------------------------------------------------------

    def initial_memory(self) -> PeermemMemory:
        return PeermemMemory()

    def memory_to_json(self, memory: PeermemMemory) -> dict[str, Any]:
        stale = memory.stale_flag
        return {
            "restart_pending": memory.restart_pending,
            "stale_flag": None if stale is None else [stale.inode, stale.mtime_ns, stale.ctime_ns],
            "failures": memory.failures,
            "retry_at": memory.retry_at,
            "last_error": memory.last_error,
            "last_signals": list(memory.last_signals),
        }

    def memory_from_json(self, data: Mapping[str, Any]) -> PeermemMemory:
        """Strict: every field of the right JSON type, numbers finite (ValueError otherwise)."""
        try:
            return PeermemMemory(**fields.read_record(data, MEMORY_FIELDS, reject_unknown=True))
        except ValueError as exc:
            raise ValueError(f"peermem memory is malformed: {exc}") from None

    # -- the decision ---------------------------------------------------------

    def decide(self, snap: NodeSnapshot, memory: PeermemMemory) -> GuardDecision[PeermemMemory]:
        pol = self.policy
        events: list[str] = []
        evidence: dict[str, Any] = {"mofed_mode": pol.mofed}
        reasons: list[str] = []
        notes: list[str] = []  # what an open gate rests on that an operator should know
        holding: list[str] = []  # the PEERMEM_CONDITIONS that fail, for the metrics

        def fail(condition: str, reason: str) -> None:
            reasons.append(reason)
            if condition not in holding:
                holding.append(condition)

        # Memory first: a restart seen now makes the current ready flag stale.
        ready = snap.file(self.mofed.ready)
        signals = restart_signals(snap, self.mofed, pol.mofed)
        restart_began = bool(signals) and not memory.last_signals
        track, mofed_events = track_restart(
            RestartTrack(memory.restart_pending, memory.stale_flag, memory.last_signals),
            signals,
            ready,
            pol.mofed,
        )
        events.extend(mofed_events)
        if signals:
            # A new RDMA generation: earlier load failures say nothing about it.
            memory = replace(memory, failures=0, retry_at=None)
        memory = replace(
            memory,
            restart_pending=track.pending,
            stale_flag=track.stale_flag,
            last_signals=track.last_signals,
        )
        if memory.retry_at is not None and memory.retry_at - snap.now > pol.retry_max_s:
            # Saved under another clock (a restart after the clock stepped back): no backoff
            # is longer than its cap, so it is re-anchored there, once.
            memory = replace(memory, retry_at=snap.now + pol.retry_max_s)

        # Context for the operator (not conditions): the GPU stack's own markers and
        # whether MOFED holds its lock.
        evidence["gpu_validations"] = list(snap.listing(self.paths.validations))
        evidence["mofed_lock_present"] = snap.file(self.mofed.lock).present

        # 1. nvidia
        nvidia = snap.module(NVIDIA)
        evidence["nvidia"] = module_evidence(nvidia)
        if nvidia is None:
            fail("nvidia_live", "nvidia is not loaded")
        elif not nvidia.live:
            state = nvidia.initstate or "unreadable"
            fail("nvidia_live", f"nvidia is not live (initstate {state})")

        # 2, 3. the MOFED container's own markers
        if pol.mofed == "container":
            evidence["mofed_ready_flag"] = {
                "path": ready.path,
                "present": ready.present,
                "stale": memory.restart_pending and ready.present,
            }
            if not ready.present:
                fail(
                    "mofed_ready_flag",
                    f"MOFED ready flag {ready.path} is absent"
                    + (f" ({ready.problem})" if ready.problem else ""),
                )
            elif memory.restart_pending:
                fail(
                    "mofed_ready_flag_fresh",
                    f"MOFED ready flag {ready.path} is stale: it predates the last MOFED restart "
                    "the agent saw",
                )
            bl = snap.file(self.mofed.blacklist)
            evidence["mofed_blacklist"] = {"path": bl.path, "present": bl.present}
            if bl.present:
                odd = f"; {bl.problem}" if bl.problem else ""
                fail("mofed_not_restarting", f"MOFED is restarting openibd ({bl.path} exists{odd})")

        # 4, 5. the RDMA stack, live and the one on disk
        stack_ev: dict[str, Any] = {}
        unshared = self._mofed_tree_unshared(snap)
        if unshared is not None:
            notes.append(unshared)
            evidence["mofed_tree_on_host"] = False
        for name in pol.rdma_stack:
            loaded = snap.module(name)
            disk = snap.disk_module(name)
            stack_ev[name] = {**module_evidence(loaded), "disk": disk_evidence(disk)}
            if loaded is None:
                fail("rdma_stack_live", f"{name} is not loaded")
                continue
            if not loaded.live:
                fail(
                    "rdma_stack_live",
                    f"{name} is not live (initstate {loaded.initstate or 'unreadable'})",
                )
                continue
            if unshared is not None:
                # MOFED's files are not on the host: the only file to compare with is the
                # host's inbox build, and the loaded module being that one says MOFED's
                # stack is not loaded; another says nothing against it.
                inbox = disk.path is not None and not disk.path.startswith(
                    f"{self.paths.mofed_driver_root}/"
                )
                if inbox and identity_mismatch(loaded, disk) is None:
                    fail(
                        "rdma_stack_on_disk",
                        f"{name}: the loaded module is the host's inbox build ({disk.path}), "
                        "not MOFED's: MOFED's stack is not loaded",
                    )
                continue
            mismatch = identity_mismatch(loaded, disk)
            if mismatch:
                fail("rdma_stack_on_disk", mismatch)
        evidence["rdma_stack"] = stack_ev

        # 6. ABI preflight: only meaningful once the stack is otherwise right.
        stack_reasons = list(reasons)  # 1-5: what a held file's own verdict waits on too
        peermem_disk = snap.disk_module(PEERMEM)
        unmounted = self._driver_root_unmounted(snap, peermem_disk)
        if unmounted is not None:
            # The GPU driver container loads peermem from its own root and mounts that
            # root here only after the load (nvidia-driver init: _load_driver, then
            # _mount_rootfs): no file to judge yet, and none the agent could load. The
            # gate vouches for the stack; the hold judges the file a loader opens.
            abi_reasons: list[str] = []
            abi_ev: dict[str, Any] = {
                "checked": [],
                "unverifiable": [],
                "mismatched": [],
                "deferred": unmounted,
            }
            notes.append(unmounted)
        else:
            abi_reasons, abi_ev = abi_mismatches(
                peermem_disk,
                {d: (snap.module(d), snap.disk_module(d)) for d in peermem_disk.depends},
            )
        evidence["abi"] = abi_ev
        for r in abi_reasons:
            fail("abi_crcs_match", r)
        # Everything else final and the CRCs disagree: waiting cannot help (gpu-operator
        # #2868). Say what to do, and let a held load go: the kernel refuses it, as before.
        rebuild = holding == ["abi_crcs_match"] and bool(abi_ev.get("mismatched"))
        if rebuild:
            reasons.insert(
                0,
                f"nvidia-peermem.ko ({peermem_disk.path}) was built against another ib_core "
                f"than the one MOFED has loaded ({len(abi_ev['mismatched'])} symbol CRCs "
                "differ), so the kernel refuses it with 'Invalid argument' however long it "
                "waits: recreate the GPU driver pod on this node (kubectl delete pod of the "
                "nvidia-driver-daemonset here) so it rebuilds nvidia-peermem against the MOFED "
                "now loaded (gpu-operator#2868)",
            )
        # The files loaders' opens of are held now, each judged as the disk's would be.
        held = [self._judge_held(snap, h, stack_reasons) for h in snap.held]
        held_rebuild = [e for e in held if e["verdict"] == "rebuild"]
        if held_rebuild and not rebuild and not stack_reasons:
            rebuild = True
            if "abi_crcs_match" not in holding:
                holding.append("abi_crcs_match")
            reasons.insert(
                0,
                held_rebuild[0]["reason"]
                + ": the kernel refuses it however long it waits: recreate the GPU driver "
                "pod on this node so it rebuilds nvidia-peermem against the MOFED now "
                "loaded (gpu-operator#2868)",
            )
        if snap.held:
            evidence["held"] = held
        evidence["release_held"] = rebuild
        evidence["holding"] = holding
        evidence["mofed_ready"] = self.mofed_ready(snap, memory)

        # Which GPUDirect path the node can take. It only informs (a closed gate says
        # whether peermem is needed at all); it is never a reason to unload peermem:
        # applications on a DMA-BUF node may still fall back to it.
        gpudirect = classify(
            snap.text(self.paths.nvidia_version),
            snap.kernel,
            snap.listing(self.paths.memory_peers),
        )
        evidence["gpudirect"] = gpudirect.to_json()
        if reasons and gpudirect.dmabuf_capable is not None:
            reasons.append(gpudirect.reason())

        verdict = Verdict(
            guard=self.name,
            verdict="rebuild" if rebuild else "closed" if reasons else "open",
            ok=not reasons,
            reasons=tuple(reasons),
            evidence=evidence,
            notes=tuple(notes),
        )

        actions, wake_at, more_events = self._actions(snap, memory, verdict, signals, restart_began)
        events.extend(more_events)
        # The unload at a MOFED restart is protective: it must not wait behind anything.
        urgent = any(isinstance(a, UnloadModule) for a in actions)
        evidence["peermem"] = {
            **module_evidence(snap.module(PEERMEM)),
            "disk": disk_evidence(snap.disk_module(PEERMEM)),
            "failures": memory.failures,
            "retry_at": memory.retry_at,
            "last_error": memory.last_error,
        }
        return GuardDecision(
            verdict=verdict,
            actions=actions,
            memory=memory,
            events=tuple(events),
            wake_at=wake_at,
            urgent=urgent,
        )

    def _actions(
        self,
        snap: NodeSnapshot,
        memory: PeermemMemory,
        verdict: Verdict,
        signals: tuple[str, ...],
        restart_began: bool,
    ) -> tuple[tuple[LoadModuleFile | UnloadModule, ...], float | None, list[str]]:
        peermem = snap.module(PEERMEM)
        events: list[str] = []
        if signals:
            # The kernel refuses to unload a module that is not live (EBUSY): one still
            # coming is unloaded on the pass that sees it live.
            if peermem is None or peermem.initstate in ("going", "coming"):
                return (), None, events
            if peermem.refcnt == 0:
                return (
                    (
                        UnloadModule(
                            guard=self.name,
                            module=PEERMEM,
                            reason="MOFED restart began (" + "; ".join(signals) + "): "
                            "unloading nvidia_peermem so openibd restart can unload ib_core",
                        ),
                    ),
                    None,
                    events,
                )
            if restart_began:
                holders = ", ".join(peermem.holders) or "no module holders"
                events.append(
                    f"nvidia_peermem is in use (refcnt {peermem.refcnt}, {holders}); not "
                    "unloading it: openibd restart will fail until its users stop"
                )
            return (), None, events

        if not verdict.ok or peermem is not None:
            return (), None, events
        if memory.retry_at is not None and snap.now < memory.retry_at:
            return (), memory.retry_at, events
        disk = snap.disk_module(PEERMEM)
        if (verdict.evidence.get("abi") or {}).get("deferred"):
            return (), None, events  # no driver root yet: nothing to load from (its note)
        if disk.path is None or disk.problem:
            if memory.last_error is None:
                events.append(
                    "gate open but nvidia_peermem.ko cannot be loaded: "
                    + (disk.problem or "no module file found")
                )
            return (), None, events
        load = LoadModuleFile(
            guard=self.name,
            module=PEERMEM,
            path=disk.path,
            params=self.policy.load_params,
            reason="peermem gate open: the RDMA stack under it is loaded, live and final",
        )
        return (load,), None, events

    def _judge_held(
        self, snap: NodeSnapshot, h: HeldModule, stack_reasons: list[str]
    ) -> dict[str, Any]:
        """One held file's verdict: ``go`` (the stack is final and the file agrees with
        it), ``rebuild`` (the stack is final and the kernel refuses the file however long
        it waits: let it go, said), or ``wait`` (anything else, an unreadable file too:
        never trusted); with the reason, judged as a disk module is (``abi_mismatches``
        against the loaded providers' files)."""
        verdict, reason = "wait", ""
        mod = h.module
        release = (h.vermagic or "").split(" ", 1)[0]
        if mod.problem:
            reason = f"cannot verify the held {h.path}: {mod.problem}"
        elif stack_reasons:
            more = len(stack_reasons) - 1
            reason = stack_reasons[0] + (f" (+{more} more)" if more else "")
        elif release and release != snap.kernel:
            verdict = "rebuild"
            reason = (
                f"the held {h.path} was built for kernel {release} (its vermagic), the "
                f"node runs {snap.kernel}"
            )
        else:
            abi, ev = abi_mismatches(
                mod, {d: (snap.module(d), snap.disk_module(d)) for d in mod.depends}
            )
            if ev["mismatched"]:
                verdict = "rebuild"
                named = "; ".join(r for r in abi if " CRC " in r)
                reason = (
                    f"the held {h.path} was built against another ib_core than the one "
                    f"MOFED has loaded ({named})"
                )
            elif abi:
                reason = abi[0]
            else:
                verdict = "go"
                reason = (
                    f"the RDMA stack is final and the held {h.path} agrees with it "
                    f"({len(ev['checked'])} symbol CRCs checked)"
                )
        return {"file": list(h.file), "path": h.path, "verdict": verdict, "reason": reason}

    def _mofed_tree_unshared(self, snap: NodeSnapshot) -> str | None:
        """With MOFED in a container whose module tree is not on the host (DOCA's driver
        container shares only its kernel headers at ``run/mellanox/drivers/usr/src``:
        legacy ``entrypoint.sh`` ``mount_rootfs``, Go ``driver.go`` 486), what condition 5
        means: the note saying so; None where MOFED's tree is there (or MOFED is the
        host's). An unreadable directory is not an absent one (fail closed)."""
        if self.policy.mofed != "container":
            return None
        where = f"{self.paths.mofed_driver_root}/lib/modules"
        if not _lacks(snap, where, snap.kernel):
            return None
        return (
            f"MOFED's module files are not on the host ({where}/{snap.kernel} absent: "
            "its driver container keeps them in its own root): the fresh ready flag "
            "vouches that the loaded RDMA stack is MOFED's, the stack is checked only not "
            "to be the host's inbox build, and a provider's symbol CRCs are checked only "
            "where its file is on the host"
        )

    def _driver_root_unmounted(self, snap: NodeSnapshot, disk: DiskModule) -> str | None:
        """What the gate means while the GPU driver root is not mounted (empty or absent,
        and ``nvidia-peermem.ko`` in no tree): the note saying so; None otherwise. An
        unreadable root is not an empty one: it stays a reason (fail closed)."""
        root = self.paths.gpu_driver_root
        if disk.path is not None or not _lacks(snap, root):
            return None
        return (
            f"nvidia-peermem.ko not checked: the GPU driver root {root} is not mounted yet "
            "(the GPU driver container mounts it only after its own load of nvidia-peermem) "
            "and no tree has one: the gate vouches for the RDMA stack only, and the agent "
            "loads nothing until the root is mounted"
        )

    def on_stop(self, memory: PeermemMemory) -> tuple[()]:
        return ()  # nvidia_peermem stays as it is: the next agent judges it afresh

    def absorb(self, memory: PeermemMemory, outcome: ActionOutcome, now: float) -> PeermemMemory:
        if not outcome.performed or not isinstance(outcome.action, LoadModuleFile):
            return memory
        if outcome.ok:
            return replace(memory, failures=0, retry_at=None, last_error=None)
        failures = memory.failures + 1
        delay = backoff_delay(failures, self.policy.retry_base_s, self.policy.retry_max_s)
        error = outcome.error or "load failed"
        if outcome.kernel_messages:
            error += " — kernel: " + " | ".join(outcome.kernel_messages[-4:])
        return replace(memory, failures=failures, retry_at=now + delay, last_error=error)


def _lacks(snap: NodeSnapshot, directory: str, name: str | None = None) -> bool:
    """Is ``directory`` known to hold nothing (or not ``name``): read, empty or absent? An
    unreadable one (a symlink, a file) is not known to lack anything (fail closed)."""
    if any(p.startswith(f"{directory} unreadable") for p in snap.problems):
        return False
    listed = snap.listing(directory)
    return not listed if name is None else name not in listed


# Saved memory (state.json): one row a PeermemMemory field, in the order they are checked;
# an unknown field is refused.
MEMORY_FIELDS: tuple[fields.Saved, ...] = (
    fields.Saved("restart_pending", fields.BOOL, False),
    fields.Saved(
        "stale_flag",
        fields.optional(
            fields.Check(
                "{key} is not [inode, mtime_ns, ctime_ns] (got {value})",
                lambda x: isinstance(x, list) and len(x) == 3 and all(is_count(n) for n in x),
                lambda x: FileId(*x),
            )
        ),
    ),
    fields.Saved("failures", fields.COUNT, 0),
    fields.Saved("retry_at", fields.optional(fields.TIME)),
    fields.Saved("last_error", fields.optional(fields.TEXT)),
    fields.Saved("last_signals", fields.STRINGS, []),
)
