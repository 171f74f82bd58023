"""The picture as text: gate spans, one row per moment a lane changed, VF restore bars."""

from __future__ import annotations

import textwrap
from collections.abc import Callable

from nodeagent.timeline_view.picture import LANES, Picture

__all__ = ["printable", "render_text"]

TimeFormat = Callable[[float], str]
CELL = 30
BAR = 48


def _span(seconds: float) -> str:
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def printable(s: str) -> str:
    """A string from the node, safe for a terminal: control characters as escapes."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)


def _row(cells: list[str], widths: list[int]) -> list[str]:
    cells = [printable(c) for c in cells]
    wrapped = [textwrap.wrap(c, w) or [""] for c, w in zip(cells, widths, strict=True)]
    height = max(len(w) for w in wrapped)
    lines = []
    for i in range(height):
        parts = [
            (w[i] if i < len(w) else "").ljust(width)
            for w, width in zip(wrapped, widths, strict=True)
        ]
        lines.append(" │ ".join(parts).rstrip())
    return lines


def _gate_lines(pic: Picture, fmt: TimeFormat) -> list[str]:
    lines = []
    for gate in pic.gates:
        lines.append(f"  {printable(gate.name)}")
        for seg in gate.segments:
            span = f"{fmt(seg.start)}–{fmt(seg.end)} ({_span(seg.end - seg.start)})"
            lines.append(f"    {span} {printable(seg.label)}")
    return lines or ["  (no decisions recorded)"]


def _bar(pic: Picture, start: float, end: float) -> str:
    total = pic.end - pic.start
    if total <= 0:
        return "█"
    a = int((start - pic.start) / total * BAR)
    b = max(a + 1, round((end - pic.start) / total * BAR))
    return " " * a + "█" * (b - a) + " " * max(0, BAR - b)


def render_text(pic: Picture, fmt: TimeFormat, title: str = "nodeagent timeline") -> str:
    first, *rest = pic.headline(fmt)
    head = printable(", ".join([f"{title}: {first} ({_span(pic.end - pic.start)})", *rest]))
    out = [head, "", "gates:", *_gate_lines(pic, fmt), ""]

    # One row per second in which something changed: the lane's state at the end of that
    # second (as the seeds' tables show it), and every marker.
    rows: dict[str, dict[str, tuple[str | None, list[str]]]] = {}
    order: list[str] = []
    events = [
        (seg.start, lane.name, f"[{seg.label}]", True)
        for lane in pic.lanes
        for seg in lane.segments
    ]
    events += [(m.t, lane.name, m.label, False) for lane in pic.lanes for m in lane.markers]
    for t, lane_name, text, is_state in sorted(events, key=lambda e: e[0]):
        key = fmt(t)
        if key not in rows:
            rows[key] = {}
            order.append(key)
        state, marks = rows[key].get(lane_name, (None, []))
        rows[key][lane_name] = (text, marks) if is_state else (state, [*marks, text])
    widths = [8, *[CELL] * len(LANES)]
    out += _row(["time", *LANES], widths)
    out.append("═" * (sum(widths) + 3 * len(LANES)))
    for key in order:
        cells = []
        for name in LANES:
            state, marks = rows[key].get(name, (None, []))
            cells.append("; ".join([state, *marks] if state else marks))
        out += _row([key, *cells], widths)

    held = pic.lane("GPU driver").held
    if held:
        out += ["", f"held loads ({len(held)}; bar = held → let go, in the GPU driver lane):"]
        for h in held:
            out.append(
                f"  │{_bar(pic, h.start, h.end)}│ {fmt(h.start)}–{fmt(h.end)} "
                + printable(f"{h.opener} (pid {h.pid}) opening {h.path}: {h.ended}")
            )
    if pic.vfs:
        out += ["", f"VF restores ({len(pic.vfs)}; bar = first attempt → first success):"]
        for b in pic.vfs:
            state = "ok" if b.ok else "NOT restored"
            out.append(
                f"  {printable(b.pf)} VF{b.index:<3} │{_bar(pic, b.start, b.end)}│ {fmt(b.start)}–"
                f"{fmt(b.end)} {state}, {b.attempts} attempt(s), {b.failures} failed"
            )
    return "\n".join(out) + "\n"
