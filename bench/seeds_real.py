"""The seeds on the real Debian 6.1 kernel (QEMU): each replay without the agent and with it.

    .venv/bin/python bench/seeds_real.py

Builds the replays' modules on this machine (as the real-kernel tests do, cached),
boots the guest once, and runs there the same replays as ``tests/realkernel/
test_seeds_*_real.py``: the shipped-like containers racing, the real kernel refusing,
and the real ``nodeagent run`` process (the peermem-hold component's config,
``--mode enforce``) in the with-agent runs. Prints one table shaped like ``nodeagent
simulate --compare``'s verdict: each seed, without the agent and with it. The figures
are the replays' own counts; the time is the guest's (TCG: about 20x slower than this
machine for Python).

Needs root and QEMU (``tests/realkernel/setup.py`` prepares the kernel); says why and
exits 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.realkernel import modbuild, vm  # noqa: E402
from tests.realkernel import replay_storage as storage  # noqa: E402
from tests.realkernel import replay_upgrade as upgrade  # noqa: E402
from tests.realkernel import replay_vf as vf  # noqa: E402
from tests.realkernel import setup as rksetup  # noqa: E402

MARK = "SEEDS-ROWS "
AGENT_RUN = "nodeagent run --config deploy/components/peermem-hold/agent.toml --mode enforce"
Replay = Callable[[Callable[[modbuild.KModule], Path], bool], dict[str, Any]]


def _upgrade(**how: str) -> Replay:
    """The upgrade replay with another GPU image (``built_against``) or load (``load_at``)."""
    return lambda built, with_agent: upgrade.replay_upgrade(built, with_agent, **how)


def replays() -> list[tuple[str, Replay, tuple[modbuild.KModule, ...]]]:
    """(name, replay, the modules it needs built), in the table's order."""
    return [
        ("upgrade", upgrade.replay_upgrade, upgrade.BUILDS),
        ("upgrade-inbox-peermem", _upgrade(built_against="inbox"), upgrade.BUILDS),
        ("upgrade-flag-pending", _upgrade(load_at=upgrade.FLAG_PENDING), upgrade.BUILDS),
        (
            "upgrade-flag-pending-inbox-peermem",
            _upgrade(built_against="inbox", load_at=upgrade.FLAG_PENDING),
            upgrade.BUILDS,
        ),
        ("restart", upgrade.replay_restart_over_peermem, upgrade.BUILDS),
        ("storage", lambda _built, with_agent: storage.replay_storage(with_agent), ()),
        ("vf", lambda _built, with_agent: vf.replay_vf_restore(with_agent), ()),
    ]


# -- in the guest ------------------------------------------------------------------------


def in_guest(only: list[str]) -> int:
    manifest = modbuild.load_manifest(os.environ.get("NODEAGENT_REALKERNEL_MODULES"))
    kver = os.uname().release

    def built(spec: modbuild.KModule) -> Path:
        return modbuild.lookup(manifest, spec, kver)

    rows = []
    for name, replay, _specs in replays():
        if only and name not in only:
            continue
        for with_agent in (False, True):
            t = time.monotonic()
            try:
                row = replay(built, with_agent)
            except Exception as exc:  # a replay that broke is a row saying so, not a lost table
                row = {"seed": name, "agent": with_agent, "error": f"{type(exc).__name__}: {exc}"}
            row["seconds"] = round(time.monotonic() - t, 1)
            rows.append(row)
            print(f"{name} agent={with_agent}: {row['seconds']} s", file=sys.stderr, flush=True)
    print(MARK + json.dumps(rows), flush=True)
    return 0


# -- the table ---------------------------------------------------------------------------


def _words(lines: list[str], *needles: str) -> str:
    """The first line holding a needle, its dmesg timestamp cut."""
    for line in lines:
        if any(n in line for n in needles):
            return line.split("] ", 1)[-1].strip()
    return ""


def _yes(value: object) -> str:
    return "yes" if value else "no"


# (row key, measure, how its value reads), in the table's order; a row shows those it has.
MEASURES: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("failed_loads", "failed nvidia_peermem loads", str),
    ("container_exits", "GPU driver-container exits", str),
    ("mofed_exits", "MOFED container exits", str),
    ("refusals", "MOFED install refusals", str),
    ("mofed_ready", "MOFED ready at the end", _yes),
    ("mofed_installed", "MOFED installed", _yes),
    ("storage_back", "storage modules back", _yes),
    ("vfs_back", "VFs with their config back", _yes),
    ("peermem_loaded", "nvidia_peermem loaded at the end", _yes),
    ("ib_core", "ib_core at the end (build)", str),
    ("seconds", "replay time in the guest (s)", str),
)


def measures(row: dict[str, Any]) -> dict[str, str]:
    if "error" in row:
        return {"replay": f"broke: {row['error'][:120]}"}
    return {label: how(row[key]) for key, label, how in MEASURES if key in row}


# The lines that say what failed, in the tools' and MOFED's own words.
TOOL_NEEDLES = (
    "modprobe: ERROR",
    "rmmod: ERROR",
    "Storage modules are loaded",
    "VF restore failed",
)


def words(row: dict[str, Any]) -> list[str]:
    """What the kernel, the tools and the agent said, in their own words."""
    out = []
    kernel = _words(
        row.get("kernel_words", []),
        "disagrees about version",
        "Unknown symbol",
        "mount(2)",
        "Registered rdma transport",
    )
    if kernel:
        out.append(f"the kernel: {kernel}")
    tools = _words(row.get("tool_words", []), *TOOL_NEEDLES)
    if tools:
        out.append(f"the tools: {tools}")
    mofed = _words(row.get("mofed_words", []), *TOOL_NEEDLES)
    if mofed:
        out.append(f"MOFED: {mofed}")
    if row.get("held") and not row.get("records"):
        h = row["held"][0]
        out.append(f"held: {h['opener']}'s open of {Path(h['path']).name} (no record)")
    for r in row.get("records", []):  # each held open, and why it went where it says one
        why = f": {r['why']}" if r.get("why") else ""
        name = Path(str(r.get("path"))).name
        out.append(f"held: {r.get('opener')}'s open of {name} (ended: {r.get('ended')}{why})")
    rebuild = [d for d in row.get("gate_since_flag", []) if d.startswith("rebuild")]
    if rebuild:
        out.append(f"the gate: {rebuild[0]}")
    if row.get("driver_root"):
        out.append(f"/run/nvidia/driver: {'; '.join(row['driver_root'])}")
    for note in row.get("gate_notes", [])[:1]:
        out.append(f"the gate's note: {note}")
    if "abi_checked_after_s" in row:
        after = row["abi_checked_after_s"]
        out.append(f"nvidia-peermem.ko checked on the mounted root: {after} s after its mount")
    if row.get("gate_after_release"):
        out.append(f"the gate after the release: {' -> '.join(row['gate_after_release'])}")
    return out


def table(rows: list[dict[str, Any]]) -> str:
    by_seed: dict[str, dict[bool, dict[str, Any]]] = {}
    for r in rows:
        by_seed.setdefault(str(r.get("seed")), {})[bool(r.get("agent"))] = r
    width = 22
    lines = [f"{'seed / measure':36s}  {'without the agent':{width}s}  with nodeagent"]
    for seed, pair in by_seed.items():
        lines.append(seed)
        without = pair.get(False, {"error": "not run"})
        with_ = pair.get(True, {"error": "not run"})
        a, b = measures(without), measures(with_)
        order = [label for _k, label, _h in MEASURES] + ["replay"]
        for label in (x for x in order if x in a or x in b):
            lines.append(f"  {label:34s}  {a.get(label, '-'):{width}s}  {b.get(label, '-')}")
        for who, row in (("without", without), ("with", with_)):
            lines += [f"    {who}, {w}" for w in words(row)]
    return "\n".join(lines)


# -- on this machine ---------------------------------------------------------------------


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", default=[], help="a replay by name (repeatable)")
    ap.add_argument("--in-guest", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.in_guest:
        return in_guest(args.only)
    if os.geteuid() != 0:
        print("bench/seeds_real.py: needs root (QEMU's setup, the guest's modules); skipped")
        return 0
    t0 = time.monotonic()
    try:
        kernel = rksetup.ensure()
    except rksetup.SetupError as exc:
        print(f"bench/seeds_real.py: no real kernel here ({exc}); skipped")
        return 0
    specs = [s for name, _r, ss in replays() if not args.only or name in args.only for s in ss]
    manifest = modbuild.build_all(specs, kernel)
    t_build = time.monotonic() - t0
    shared = vm.new_run_dir("seeds-")
    (shared / "modules.json").write_text(json.dumps(manifest, indent=1))
    guest_argv = [sys.executable, "bench/seeds_real.py", "--in-guest"]
    for name in args.only:
        guest_argv += ["--only", name]
    env = {
        "NODEAGENT_IN_GUEST": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "NODEAGENT_REALKERNEL_MODULES": f"{rksetup.GUEST_SHARED}/modules.json",
    }
    res = vm.boot(guest_argv, timeout=2400, kernel=kernel, env=env, cwd=REPO, shared=shared)
    rows: list[dict[str, Any]] = []
    for line in res.output.splitlines():
        if line.startswith(MARK):
            rows = json.loads(line[len(MARK) :])
    print(f"# command: .venv/bin/python bench/seeds_real.py {shlex.join(argv)}".rstrip())
    print(f"# guest: kernel {kernel.kver}, accel {res.accel}, 2 vCPUs, 1 GiB")
    print(f"# with nodeagent: {AGENT_RUN}, its own process in the guest")
    print(f"# time: module builds {t_build:.1f} s, boot + replays {res.seconds:.1f} s")
    if not rows:
        print("bench/seeds_real.py: the guest printed no rows; its output:\n" + res.output[-4000:])
        return 1
    print(table(rows))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
