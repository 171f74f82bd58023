"""Is the loaded module the file on disk, and do a consumer's symbol CRCs match its providers?

Pure checks shared by the guards: module identity (srcversion, else GNU
build-id) and the ABI preflight (the CRCs a .ko's ``__versions`` requires
against those its loaded providers' files export), plus the evidence shape
both guards report for a module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nodeagent.core.snapshot import EMPTY, DiskModule, LoadedModule


def _fmt_identity(mod: LoadedModule | DiskModule, kind: str) -> str:
    value = mod.srcversion if kind == "srcversion" else mod.build_id
    return f"{kind} {value}" if value else f"no {kind}"


def identity_mismatch(loaded: LoadedModule, disk: DiskModule) -> str | None:
    """None when the loaded module is the file on disk; else the reason, naming both identities."""
    if disk.path is None:
        return (
            f"{loaded.name}: no module file on disk to compare with ({disk.problem or 'not found'})"
        )
    if disk.problem:
        return f"{loaded.name}: cannot read {disk.path}: {disk.problem}"
    # srcversion is the stronger identity (MOFED itself compares it); build-id
    # covers kernels that set no srcversion on in-tree modules (Debian).
    for kind in ("srcversion", "build_id"):
        have = getattr(loaded, kind)
        want = getattr(disk, kind)
        if have and want:
            if have == want:
                return None
            label = "build-id" if kind == "build_id" else kind
            return (
                f"{loaded.name}: the loaded module ({label} {have}) is not the one on disk "
                f"at {disk.path} ({label} {want})"
            )
    return (
        f"{loaded.name}: cannot tell whether the loaded module is the one at {disk.path}: "
        f"loaded has {_fmt_identity(loaded, 'srcversion')}, {_fmt_identity(loaded, 'build_id')}; "
        f"file has {_fmt_identity(disk, 'srcversion')}, {_fmt_identity(disk, 'build_id')}"
    )


def abi_mismatches(
    consumer: DiskModule,
    providers: Mapping[str, tuple[LoadedModule | None, DiskModule]],
) -> tuple[list[str], dict[str, Any]]:
    """Compare the CRCs ``consumer``'s .ko requires with those its loaded providers export.

    ``providers`` maps each module the consumer depends on to (its loaded
    state, its file on disk). A provider's CRCs are only trusted when its
    loaded identity matches that file; otherwise the check is reported as not
    possible. The kernel refuses a consumer whose CRC for a symbol differs
    from the provider's ("disagrees about version of symbol", EINVAL).
    """
    evidence: dict[str, Any] = {"checked": [], "unverifiable": [], "mismatched": []}
    reasons: list[str] = []
    if consumer.path is None or consumer.problem:
        # A file that cannot be read is not "unverifiable": the gate cannot vouch for it.
        reasons.append(
            f"cannot verify {consumer.name}.ko: {consumer.problem or 'no module file found'}"
        )
        return reasons, evidence
    if not consumer.required_crcs:
        evidence["unverifiable"].append(f"{consumer.name}.ko: no __versions CRCs to check")
        return reasons, evidence
    for provider_name, (loaded, provider) in providers.items():
        if loaded is None:
            continue  # the gate's liveness conditions already speak for it
        if provider.problem and provider.path is not None:
            reasons.append(f"cannot verify {provider_name}: {provider.problem}")
            continue
        if provider.path is None or provider.problem:
            evidence["unverifiable"].append(
                f"{provider_name}: {provider.problem or 'no module file found'}"
            )
            continue
        if identity_mismatch(loaded, provider) is not None:
            evidence["unverifiable"].append(
                f"{provider_name}: loaded module is not {provider.path}, its CRCs are unknown"
            )
            continue
        for symbol, need in sorted(consumer.required_crcs.items()):
            have = provider.exported_crcs.get(symbol)
            if have is None:
                continue
            evidence["checked"].append(symbol)
            if have != need:
                evidence["mismatched"].append(symbol)
                reasons.append(
                    f"{consumer.name} needs {symbol} CRC {need:#010x} "
                    f"but the loaded {provider_name} exports {have:#010x}"
                )
    return reasons, evidence


def chain_refusals(
    planned: Sequence[DiskModule],
    loaded: Mapping[str, tuple[LoadedModule, DiskModule]],
) -> list[str]:
    """What the kernel would refuse of an insert, before any module of it goes in.

    ``planned``: the modules the insert adds, in its order (libkmod's dry run), each
    as read from the tree it would come from. ``loaded``: the loaded modules they
    depend on, each with the file its identity was checked against. A planned
    module's CRCs are compared with those of its providers: one planned before it
    (the same tree, its file), or one loaded whose identity matches its file (one that
    does not match, or has no file, is not checked: the kernel decides, as without
    this check). A planned file that cannot be read is a reason too: nothing vouches
    for it. Empty when the whole chain agrees.
    """
    reasons: list[str] = []
    exports: dict[str, tuple[str, Mapping[str, int]]] = {}  # provider -> (whose, CRCs)
    for name, (live, disk) in loaded.items():
        if disk.path is not None and not disk.problem and identity_mismatch(live, disk) is None:
            exports[name] = (f"the loaded {name} ({disk.path})", disk.exported_crcs)
    for mod in planned:
        if mod.path is None or mod.problem:
            reasons.append(f"cannot read {mod.name}: {mod.problem or 'no module file found'}")
            continue
        for dep in mod.depends:
            whose, crcs = exports.get(dep, ("", EMPTY))
            for symbol, need in sorted(mod.required_crcs.items()):
                have = crcs.get(symbol)
                if have is not None and have != need:
                    reasons.append(
                        f"{mod.name} ({mod.path}) needs {symbol} CRC {need:#010x} but "
                        f"{whose} exports {have:#010x}"
                    )
        exports[mod.name] = (f"{mod.name} ({mod.path}), inserted before it", mod.exported_crcs)
    return reasons


def module_evidence(mod: LoadedModule | None) -> dict[str, Any]:
    if mod is None:
        return {"loaded": False}
    ev: dict[str, Any] = {
        "loaded": True,
        "initstate": mod.initstate,
        "refcnt": mod.refcnt,
        "srcversion": mod.srcversion,
        "build_id": mod.build_id,
    }
    if mod.holders:
        ev["holders"] = list(mod.holders)
    if mod.problems:
        ev["problems"] = list(mod.problems)
    return ev


def disk_evidence(disk: DiskModule) -> dict[str, Any]:
    ev: dict[str, Any] = {
        "path": disk.path,
        "srcversion": disk.srcversion,
        "build_id": disk.build_id,
    }
    if disk.problem:
        ev["problem"] = disk.problem
    return ev
