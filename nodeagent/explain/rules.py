"""The rules that turn one node's evidence into incidents, in one place. Pure.

The peermem family is decided per failed load: a "disagrees" line and an ``Invalid
argument`` from the same load (the same file within ``SAME_LOAD_LINES`` lines, or stamps
within ``SAME_LOAD_S``) are an ABI mismatch; an ``Invalid argument`` while MOFED's log
shows a restart under way is the load race; one with neither is its own kind, which
names both causes. No rule correlates two nodes' lines."""

from __future__ import annotations

from dataclasses import dataclass, field

from nodeagent.explain.incidents import INCIDENTS
from nodeagent.explain.stamps import Stamp

SAME_LOAD_LINES = 20  # a kernel line this near a failed insert, in one file: the same load
SAME_LOAD_S = 2.0  # or stamped this near it
WINDOW_SLACK_S = 5.0  # around a restart window: the two tools' clocks and flushes
KEEP = 200  # evidence lines kept per signature and node (for the rules; bounded)


@dataclass(frozen=True, slots=True)
class Evidence:
    file: str
    line: int
    text: str
    signature: str
    stamp: Stamp | None = None
    fields: tuple[tuple[str, str], ...] = ()

    def get(self, name: str) -> str | None:
        return dict(self.fields).get(name)


@dataclass
class Found:
    """One node's evidence, by signature name."""

    by_sig: dict[str, list[Evidence]] = field(default_factory=dict)
    cut: int = 0  # the fewest lines of a kind kept when more were there (0: none cut)

    def add(self, ev: Evidence, keep: int = KEEP) -> None:
        got = self.by_sig.setdefault(ev.signature, [])
        if len(got) < keep:
            got.append(ev)
        else:
            self.cut = min(self.cut or keep, keep)

    def trim(self, keep: int) -> None:
        """Each kind's first ``keep`` lines (a bundle's node count grew)."""
        for name, got in self.by_sig.items():
            if len(got) > keep:
                self.by_sig[name] = got[:keep]
                self.cut = min(self.cut or keep, keep)

    def __getitem__(self, name: str) -> list[Evidence]:
        return self.by_sig.get(name, [])


@dataclass
class Finding:
    kind: str
    evidence: list[Evidence] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _near(a: Evidence, b: Evidence) -> bool:
    """The same load: one file within a few lines, or stamped within seconds."""
    if a.file == b.file and abs(a.line - b.line) <= SAME_LOAD_LINES:
        return True
    return (
        a.stamp is not None
        and b.stamp is not None
        and a.stamp.clock == b.stamp.clock
        and abs(a.stamp.t - b.stamp.t) <= SAME_LOAD_S
    )


@dataclass(frozen=True)
class Window:
    """MOFED restarting: from a restart's first line to the next ready line (or on)."""

    begin: Evidence
    end: Evidence | None

    def holds(self, s: Stamp) -> bool | None:
        """None: not on this window's clock."""
        b = self.begin.stamp
        if b is None or b.clock != s.clock:
            return None
        e = self.end.stamp if self.end else None
        return b.t - WINDOW_SLACK_S <= s.t and (e is None or s.t <= e.t + WINDOW_SLACK_S)


def restart_windows(found: Found) -> list[Window]:
    ends = [e for e in found["mofed-ready"] if e.stamp]
    out = []
    for b in found["mofed-restarting"] + found["openibd-restart-begin"]:
        end = None
        if b.stamp:
            after = [e for e in ends if e.stamp and e.stamp.clock == b.stamp.clock]
            after = [e for e in after if e.stamp and b.stamp and e.stamp.t >= b.stamp.t]
            end = min(after, key=lambda e: e.stamp.t if e.stamp else 0.0, default=None)
        out.append(Window(b, end))
    return out


def _first_after(b: Evidence, evs: list[Evidence]) -> Evidence | None:
    return min(
        (e for e in evs if e.file == b.file and e.line > b.line), key=lambda e: e.line, default=None
    )


def unfinished_restarts(found: Found) -> list[Evidence]:
    """openibd restarts a container ran (exec_cmd, traced or logged) that its log does not
    see end well: the trace's exit_code after it is not 0, or nothing after it in that
    file says the stack loaded (openibd's OK, the ready flag)."""
    out = []
    exits = found["openibd-trace-exit"]
    oks = found["openibd-ok"] + found["mofed-ready"]
    for b in found["openibd-restart-begin"]:
        code = _first_after(b, exits)
        if code is not None:
            if code.get("code") != "0":
                out.append(code)
        elif _first_after(b, oks) is None:
            out.append(b)
    return out


def _during_restart(ev: Evidence, windows: list[Window]) -> tuple[bool | None, Window | None]:
    """(True, the window) when ``ev``'s time is in one; False when its time is known on a
    window's clock and in none; None when no window's time can be compared with it."""
    if ev.stamp is None:
        return None, None
    answers = [(w.holds(ev.stamp), w) for w in windows]
    for held, w in answers:
        if held:
            return True, w
    return (False, None) if any(h is False for h, _ in answers) else (None, None)


def _symbol_cause(ev: Evidence) -> str:
    """What one "Unknown symbol"/"disagrees"/"needs unknown symbol" line says, from the
    kernel's err (kernel/module/main.c simplify_symbols: -EINVAL from check_version's
    CRC mismatch, -EBUSY from a provider still in its init, -ENOENT (0 before 4.x: a
    NULL symbol) for none exported)."""
    how, err, sym = ev.get("how") or "", ev.get("err"), ev.get("symbol") or ""
    if how.startswith(("disagrees", "version magic")) or err == "-22":
        return "crc"
    if err == "-16":
        return "busy"
    return "no-gpu-driver" if sym.startswith("nvidia_p2p") else "no-peer-api"


def classify(found: Found) -> list[Finding]:
    """One node's incidents: the rules, in one place."""
    out: dict[str, Finding] = {}

    seen: dict[str, set[Evidence]] = {}  # each finding's evidence, for a look-up in O(1)

    def add(kind: str, *evs: Evidence, note: str = "") -> None:
        f = out.setdefault(kind, Finding(kind))
        has = seen.setdefault(kind, set())
        for ev in evs:
            if ev not in has:
                has.add(ev)
                f.evidence.append(ev)
        if note and note not in f.notes:
            f.notes.append(note)

    windows = restart_windows(found)
    symbols = found["peermem-symbol"]
    crc = [e for e in symbols if _symbol_cause(e) == "crc"]
    busy = [e for e in symbols if _symbol_cause(e) == "busy"] + found["peermem-busy-provider"]
    explained: set[int] = set()  # ids of symbol lines some failed insert already took

    for ins in found["peermem-einval"]:
        same = [e for e in crc if _near(e, ins)]
        explained.update(id(e) for e in same)
        during, w = _during_restart(ins, windows)
        if during:
            add("peermem-load-race", ins, w.begin if w else ins, *same)
        elif same:
            note = ""
            if windows and during is None:
                note = (
                    "MOFED restarted in these logs too, at a time they do not let me compare "
                    "with the load's: if the load fell in that restart, it was the race"
                )
            add("peermem-abi-mismatch", ins, *same, note=note)
        elif windows and during is None:
            add(
                "peermem-load-race",
                ins,
                windows[0].begin,
                note="the load's time and the restart's are not on one clock in these logs; "
                "MOFED restarted, and no kernel line says the symbols disagree",
            )
        else:
            note = ""
            if during is False:
                note = "MOFED restarted in these logs, but not at the time of this load"
            add("peermem-einval-unexplained", ins, note=note)

    for e in crc:
        if id(e) in explained:
            continue
        during, w = _during_restart(e, windows)
        if during and w:
            add("peermem-load-race", e, w.begin)
        else:
            add("peermem-abi-mismatch", e)
    for e in busy:
        add("peermem-load-race", e)
    for e in symbols:
        cause = _symbol_cause(e)
        if cause in ("no-peer-api", "no-gpu-driver"):
            add(f"peermem-{cause}", e)
    for e in found["peermem-no-gpu-driver-loaded"]:
        add("peermem-no-gpu-driver" if e.get("provider") == "nvidia" else "peermem-no-peer-api", e)
    if found["peermem-not-built"]:
        add("peermem-not-built", *found["peermem-not-built"])
    # a failure with no reason in these logs: only when nothing above explains a load, and
    # not beside a signature rejection (secure boot: not this tool's incident)
    if (
        found["peermem-load-failed"]
        and not any(k.startswith("peermem-") for k in out)
        and not found["module-signature-rejected"]
    ):
        add("peermem-load-failed", *found["peermem-load-failed"])

    if found["storage-modules-loaded"]:
        add("storage-blocks-mofed", *found["storage-modules-loaded"])
    if found["storage-symbol"]:
        add("storage-module-other-stack", *found["storage-symbol"])
    if found["rdma-symbol"]:
        add("rdma-module-other-stack", *found["rdma-symbol"])
    if found["module-in-use"]:
        add("openibd-module-in-use", *found["module-in-use"])
    # openibd failed: said by its own [FAILED] lines, by the container, or by a restart
    # its trace does not see end; the more specific kinds above own their lines
    failed = found["openibd-failed"] + unfinished_restarts(found)
    if failed:
        owner = next(
            (k for k in ("openibd-module-in-use", "storage-blocks-mofed") if k in out), None
        )
        if owner:
            add(owner, *failed)
        else:
            note = ""
            if not found["openibd-failed"]:
                note = (
                    "the container's log shows openibd restart start and not end well "
                    "(no exit code 0, no 'Loading HCA driver and Access Layer: [ OK ]', no "
                    "ready flag after it): it failed, or the log was cut mid-restart"
                )
            add("openibd-restart-failed", *failed, note=note)
    if found["vf-no-netdev"]:
        add("vf-restore-before-netdev", *found["vf-no-netdev"])
    order = {i.kind: n for n, i in enumerate(INCIDENTS)}
    return sorted(out.values(), key=lambda f: order[f.kind])
