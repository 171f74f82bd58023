"""The recorded timeline as a picture: lanes over time, gate spans, per-VF restore bars.

Pure: a list of timeline records (``nodeagent/timeline.py``) in, a ``Picture``
out; the text and HTML renderers draw it. The lanes are the seeds' columns:
MOFED, GPU driver, agent and kernel. MOFED, GPU driver and kernel are the node
as the agent saw it at each recorded decision (the peermem guard's evidence);
the agent lane is what the agent did (its actions, its guards' events); each
guard's verdict over time is a gate lane; a ``restore VF`` action makes a bar
per VF, from its first attempt to its first success. A load the peermem hold
held (a ``held-open`` record, written when the hold ended, with how long it
lasted) makes a bar in the GPU driver lane, from the moment the loader's open
was held to the moment it was let go.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DRAWABLE",
    "LANES",
    "HeldBar",
    "Lane",
    "Marker",
    "Picture",
    "Segment",
    "VfBar",
    "build_picture",
    "record_time",
]

LANES = ("MOFED", "GPU driver", "agent", "kernel")
Tone = str  # "ok" | "warn" | "bad" | "idle"

# RestoreVf.describe(): "restore VF <index> (<vf pci>) of <pf pci>"
_RESTORE_VF = re.compile(r"^restore VF (\d+) \(([^)]*)\) of (\S+)")


@dataclass(frozen=True)
class Segment:
    start: float
    end: float
    label: str
    tone: Tone


@dataclass(frozen=True)
class Marker:
    t: float
    label: str
    tone: Tone


@dataclass(frozen=True)
class HeldBar:
    """One open the hold held: from ``start`` (held) to ``end`` (let go, the record's
    time), whose (``pid``, ``opener``: its comm), of which file, and how it ended."""

    start: float
    end: float
    pid: object
    opener: str
    path: str
    ended: str

    @property
    def tone(self) -> Tone:
        return "idle" if self.ended == "gate opened" else "bad"

    def label(self) -> str:
        return (
            f"{self.opener} (pid {self.pid}) held opening {self.path.rsplit('/', 1)[-1]}: "
            f"{self.ended}"
        )


@dataclass
class Lane:
    name: str
    segments: list[Segment] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    held: list[HeldBar] = field(default_factory=list)  # the GPU driver lane's held loads


@dataclass
class VfBar:
    pf: str
    index: int
    vf_pci: str
    start: float
    end: float  # first success, else the last attempt
    ok: bool
    attempts: int = 0
    failures: int = 0


@dataclass
class Picture:
    start: float
    end: float
    lanes: list[Lane]  # LANES, in order
    gates: list[Lane]  # one per guard: its verdict over time
    vfs: list[VfBar]
    kernel: str | None = None
    modes: tuple[str, ...] = ()  # the agent's observe/enforce modes in the span

    def lane(self, name: str) -> Lane:
        return next(lane for lane in self.lanes if lane.name == name)

    def headline(self, fmt: Callable[[float], str]) -> list[str]:
        """The span, the kernel and the agent's mode(s): the renderers' header parts."""
        parts = [f"{fmt(self.start)} – {fmt(self.end)}"]
        if self.kernel:
            parts.append(f"kernel {self.kernel}")
        if self.modes:
            parts.append(f"agent mode {'/'.join(self.modes)}")
        return parts


class _States:
    """Consecutive states of one lane, merged while the label stays the same."""

    def __init__(self) -> None:
        self.points: list[tuple[float, str, Tone]] = []

    def at(self, t: float, label: str, tone: Tone) -> None:
        if not self.points or self.points[-1][1:] != (label, tone):
            self.points.append((t, label, tone))

    def segments(self, end: float) -> list[Segment]:
        out = []
        for i, (t, label, tone) in enumerate(self.points):
            stop = self.points[i + 1][0] if i + 1 < len(self.points) else end
            out.append(Segment(t, max(t, stop), label, tone))
        return out


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, Mapping):
            return None
        d = d.get(k)
    return d


def _mofed_state(ev: Mapping[str, Any]) -> tuple[str, Tone]:
    if ev.get("mofed_mode") == "host":
        return "host MOFED (no container)", "idle"
    if _get(ev, "mofed_blacklist", "present"):
        return "restarting openibd (blacklist present)", "bad"
    if not _get(ev, "mofed_ready_flag", "present"):
        return "not ready" + ("; lock held" if ev.get("mofed_lock_present") else ""), "warn"
    if _get(ev, "mofed_ready_flag", "stale"):
        return "ready flag stale (a restart since)", "warn"
    return "ready", "ok"


def _gpu_state(ev: Mapping[str, Any]) -> tuple[str, Tone]:
    nvidia = ev.get("nvidia")
    if not _get(nvidia, "loaded"):
        return "nvidia not loaded", "idle"
    state = _get(nvidia, "initstate")
    if state != "live":
        return f"nvidia {state}", "warn"
    validations = ev.get("gpu_validations") or []
    ready = any("driver-ctr-ready" in str(v) for v in validations)
    return ("nvidia loaded; driver container ready" if ready else "nvidia loaded"), "ok"


def _kernel_state(ev: Mapping[str, Any]) -> tuple[str, Tone]:
    stack = ev.get("rdma_stack")
    if not isinstance(stack, Mapping) or not stack:
        return "RDMA stack unknown", "idle"
    live = sum(1 for m in stack.values() if _get(m, "initstate") == "live")
    loaded = sum(1 for m in stack.values() if _get(m, "loaded"))
    if live == len(stack):
        label, tone = "RDMA stack live", "ok"
    elif loaded == 0:
        label, tone = "RDMA stack unloaded", "bad"
    else:
        label, tone = f"RDMA {live}/{len(stack)} live", "warn"
    peermem = ev.get("peermem")
    if _get(peermem, "loaded"):
        state = _get(peermem, "initstate")
        label += " · peermem" + ("" if state == "live" else f" {state}")
    return label, tone


_LANE_STATE: dict[str, Callable[[Mapping[str, Any]], tuple[str, Tone]]] = {
    "MOFED": _mofed_state,
    "GPU driver": _gpu_state,
    "kernel": _kernel_state,
}


# The times the renderers can draw (UTC dates from 1970-01-01 to 9999-12-31): gmtime
# and strftime overflow or misprint beyond, and an agent never writes such a time.
DRAWABLE = (0.0, 253402300799.0)


def record_time(rec: Mapping[str, Any]) -> float | None:
    """The record's ``ts``, or None when it is not a number within DRAWABLE (NaN, 1e999)."""
    t = rec.get("ts")
    if isinstance(t, bool) or not isinstance(t, int | float):
        return None
    if not DRAWABLE[0] <= t <= DRAWABLE[1]:  # also False for NaN
        return None
    return float(t)


def build_picture(
    records: Iterable[Mapping[str, Any]],
    *,
    since: float | None = None,
    until: float | None = None,
) -> Picture:
    """``records`` oldest first. ``since``: drop what ended before it (a state that holds
    at ``since`` starts there). ``until``: where the last state ends (default: the last
    record's time)."""
    recs = [(t, r) for r in records if (t := record_time(r)) is not None]
    states = {name: _States() for name in _LANE_STATE}
    gates: dict[str, _States] = {}
    agent = _States()
    markers: dict[str, list[Marker]] = {name: [] for name in LANES}
    vfs: dict[tuple[str, int], VfBar] = {}
    held: list[HeldBar] = []
    kernel: str | None = None
    modes: list[str] = []

    for t, rec in recs:
        kind = rec.get("kind")
        if kind == "start":
            mode = str(rec.get("mode"))
            agent.at(t, f"running ({mode})", "ok")
            if mode not in modes:
                modes.append(mode)
        elif kind == "stop":
            agent.at(t, "stopped", "idle")
        elif kind == "decision":
            guard = str(rec.get("guard"))
            kernel = str(rec["kernel"]) if rec.get("kernel") else kernel
            reasons = _texts(rec.get("reasons"))
            word = str(rec.get("verdict"))
            # Each guard has its own verdict words; "ok" says whether anything is wrong.
            ok = bool(rec.get("ok", word == "open"))
            lane = f"{guard} gate" if rec.get("gate", guard == "peermem") else guard
            label = word if ok or not reasons else f"{word}: {reasons[0]}"
            gates.setdefault(lane, _States()).at(t, label, "ok" if ok else "bad")
            for e in _texts(rec.get("events")):
                markers["agent"].append(Marker(t, f"{guard}: {e}", "idle"))
            ev = rec.get("evidence")
            if guard == "peermem" and isinstance(ev, Mapping):
                for name, state_of in _LANE_STATE.items():
                    states[name].at(t, *state_of(ev))
        elif kind == "action":
            _action(t, rec, markers, vfs)
        elif kind == "held-open":
            ended = str(rec.get("ended"))
            markers["agent"].append(
                Marker(
                    t,
                    f"held {rec.get('opener')} (pid {rec.get('pid')}) {rec.get('seconds')} s: "
                    f"{ended}",
                    "idle" if ended == "gate opened" else "bad",
                )
            )
            seconds = rec.get("seconds")
            if isinstance(seconds, int | float) and not isinstance(seconds, bool) and seconds >= 0:
                held.append(
                    HeldBar(
                        max(DRAWABLE[0], t - float(seconds)),
                        t,
                        rec.get("pid"),
                        str(rec.get("opener")),
                        str(rec.get("path")),
                        ended,
                    )
                )
        elif kind in ("hold-root-marked", "hold-root-gone"):
            change = "marked" if kind == "hold-root-marked" else "gone"
            markers["agent"].append(
                Marker(
                    t, f"container root {change}: pid {rec.get('pid')} ({rec.get('dev')})", "idle"
                )
            )
        elif kind == "plan-superseded":
            left = ", ".join(_texts(rec.get("not_done"))) or "nothing"
            markers["agent"].append(
                Marker(t, f"{rec.get('guard')}: plan superseded; not done: {left}", "idle")
            )
        elif kind in ("pass-error", "state-problem"):
            what = rec.get("error") or rec.get("problem")
            markers["agent"].append(Marker(t, f"{kind}: {what}", "bad"))

    first = recs[0][0] if recs else 0.0
    last = recs[-1][0] if recs else 0.0
    start = first if since is None else max(first, since)
    end = max(start, last if until is None else until)
    lanes = []
    for name in LANES:
        segs = (agent if name == "agent" else states[name]).segments(end)
        marks = [m for m in markers[name] if m.t >= start]
        holds = [
            HeldBar(max(b.start, start), b.end, b.pid, b.opener, b.path, b.ended)
            for b in held
            if name == "GPU driver" and b.end >= start
        ]
        lanes.append(Lane(name, _clip(segs, start, end), marks, holds))
    gate_lanes = [Lane(g, _clip(s.segments(end), start, end)) for g, s in sorted(gates.items())]
    bars = [b for b in vfs.values() if b.end >= start or not b.ok]
    bars.sort(key=lambda b: (b.pf, b.index))
    return Picture(start, end, lanes, gate_lanes, bars, kernel, tuple(modes))


def _texts(value: Any) -> list[str]:
    """A record's list of strings (reasons, events, kernel lines); anything else is none."""
    return [str(x) for x in value] if isinstance(value, list) else []


def _action(
    t: float,
    rec: Mapping[str, Any],
    markers: dict[str, list[Marker]],
    vfs: dict[tuple[str, int], VfBar],
) -> None:
    what = str(rec.get("action"))
    performed = bool(rec.get("performed", True))
    ok = bool(rec.get("ok"))
    if not performed:
        markers["agent"].append(Marker(t, f"would {what} (observe mode)", "idle"))
    elif ok:
        markers["agent"].append(Marker(t, f"{what}: ok", "ok"))
    else:
        markers["agent"].append(Marker(t, f"{what}: {rec.get('error')}", "bad"))
        for line in _texts(rec.get("kernel_messages"))[:2]:
            markers["kernel"].append(Marker(t, f"kmsg: {line}", "bad"))
    m = _RESTORE_VF.match(what)
    if m is None or not performed:
        return
    index, vf_pci, pf = int(m.group(1)), m.group(2), m.group(3)
    bar = vfs.get((pf, index))
    if bar is None:
        bar = vfs[(pf, index)] = VfBar(pf, index, vf_pci, t, t, ok=False)
    if bar.ok:  # restored before: a new restore of the same VF starts a new bar
        bar = vfs[(pf, index)] = VfBar(pf, index, vf_pci, t, t, ok=False)
    bar.attempts += 1
    bar.end = t
    if ok:
        bar.ok = True
    else:
        bar.failures += 1


def _clip(segs: list[Segment], start: float, end: float) -> list[Segment]:
    """The part of each segment inside [start, end]; one that ended before start is dropped."""
    return [
        Segment(max(s.start, start), min(s.end, end), s.label, s.tone)
        for s in segs
        if s.end > start or s.start >= start
    ]
