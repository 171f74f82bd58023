"""The picture as one self-contained HTML file: inline SVG and CSS, no script, no fetch.

Nothing in the file points anywhere: no ``src``, ``href``, ``url(`` or
``xmlns`` (inline SVG in HTML needs none), so opening it makes no network
request. Every string that came from the node (reasons, errors, kernel lines,
module and device names) is escaped.
"""

from __future__ import annotations

import html
from collections.abc import Callable

from nodeagent.timeline_view.picture import HeldBar, Lane, Marker, Picture, Segment

__all__ = ["render_html"]

TimeFormat = Callable[[float], str]

WIDTH = 1400
LEFT = 150  # lane names
RIGHT = 20
ROW = 34
HELD_ROW = 14  # under a lane's states: the loads the hold held
VF_ROW = 12
TONES = {"ok": "#2e7d32", "warn": "#f9a825", "bad": "#c62828", "idle": "#9e9e9e"}
STYLE = """
body { font: 13px/1.4 sans-serif; margin: 16px; color: #212121; background: #fff; }
h1 { font-size: 18px; margin: 0 0 4px; }
p.meta { margin: 0 0 12px; color: #555; }
svg text { font: 11px sans-serif; }
svg .lane { font-weight: bold; font-size: 12px; }
svg .seg { fill: #fff; }
svg .heldtext { fill: #0d47a1; font-size: 10px; }
svg .axis { fill: #555; }
table { border-collapse: collapse; margin-top: 16px; width: 100%; }
td, th { border-bottom: 1px solid #ddd; padding: 2px 6px; text-align: left; vertical-align: top; }
td.t { white-space: nowrap; font-family: monospace; }
.ok { color: #2e7d32; } .warn { color: #8d6e00; } .bad { color: #c62828; } .idle { color: #555; }
"""


def _e(s: object) -> str:
    return html.escape(str(s), quote=True)


class _Svg:
    def __init__(self, pic: Picture) -> None:
        self.pic = pic
        self.parts: list[str] = []
        self.grid: list[str] = []  # drawn first, under the lanes
        self.y = 30

    def x(self, t: float) -> float:
        span = self.pic.end - self.pic.start
        if span <= 0:
            return float(LEFT)
        return LEFT + (t - self.pic.start) / span * (WIDTH - LEFT - RIGHT)

    def add(self, s: str) -> None:
        self.parts.append(s)

    def axis(self, fmt: TimeFormat, bottom: float) -> None:
        for i in range(9):
            t = self.pic.start + (self.pic.end - self.pic.start) * i / 8
            x = self.x(t)
            anchor = "start" if i == 0 else "end" if i == 8 else "middle"
            self.grid.append(
                f'<line x1="{x:.1f}" y1="18" x2="{x:.1f}" y2="{bottom:.0f}" stroke="#eee"/>'
                f'<text class="axis" x="{x:.1f}" y="12" text-anchor="{anchor}">{_e(fmt(t))}</text>'
            )

    def segment(self, seg: Segment, y: float, h: float, fmt: TimeFormat) -> None:
        x0, x1 = self.x(seg.start), self.x(seg.end)
        w = max(x1 - x0, 1.5)
        tip = f"{fmt(seg.start)}–{fmt(seg.end)} {seg.label}"
        color = TONES.get(seg.tone, TONES["idle"])
        self.add(
            f'<rect x="{x0:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{color}" '
            f'rx="2"><title>{_e(tip)}</title></rect>'
        )
        room = int(w / 6.2)  # characters that fit at 11px
        if h >= 14 and room >= 4:
            label = seg.label if len(seg.label) <= room else seg.label[: room - 1] + "…"
            self.add(
                f'<text class="seg" x="{x0 + 3:.1f}" y="{y + h / 2 + 4:.1f}">{_e(label)}</text>'
            )

    def marker(self, m: Marker, y: float, fmt: TimeFormat) -> None:
        x = self.x(m.t)
        color = TONES.get(m.tone, TONES["idle"])
        self.add(
            f'<path d="M{x:.1f} {y:.1f} l5 6 l-5 6 l-5 -6 z" fill="{color}" stroke="#fff">'
            f"<title>{_e(fmt(m.t))} {_e(m.label)}</title></path>"
        )

    def held(self, bar: HeldBar, lane: str, y: float, fmt: TimeFormat) -> None:
        """A held load: a bar from its hold to its release, naming whose open, of what
        file, and how the hold ended (``data-*``: the times, in the records' seconds)."""
        x0, x1 = self.x(bar.start), self.x(bar.end)
        w = max(x1 - x0, 1.5)
        h = HELD_ROW - 3
        tip = (
            f"{fmt(bar.start)}–{fmt(bar.end)} held: {bar.opener} (pid {bar.pid}) opening "
            f"{bar.path}; ended: {bar.ended}"
        )
        color = "#1565c0" if bar.tone == "idle" else TONES["bad"]
        self.add(
            f'<rect class="held" data-lane="{_e(lane)}" data-start="{bar.start:.3f}" '
            f'data-end="{bar.end:.3f}" x="{x0:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h}" '
            f'fill="{color}" rx="2"><title>{_e(tip)}</title></rect>'
        )
        # The label beside the bar (the strip is otherwise empty), on its left near the end.
        label = bar.label()
        if x1 + 4 + len(label) * 5.6 <= WIDTH:
            at = f'x="{x1 + 4:.1f}"'
        else:
            at = f'x="{max(x0 - 4, LEFT):.1f}" text-anchor="end"'
        self.add(f'<text class="heldtext" {at} y="{y + h - 2:.1f}">{_e(label)}</text>')

    def lane(self, lane: Lane, fmt: TimeFormat, label: str | None = None) -> None:
        y = self.y
        extra = HELD_ROW if lane.held else 0
        name = _e(label or lane.name)
        self.add(f'<text class="lane" x="4" y="{y + ROW / 2 + 4:.1f}">{name}</text>')
        self.add(
            f'<rect class="lanebox" data-lane="{_e(lane.name)}" x="{LEFT}" y="{y:.1f}" '
            f'width="{WIDTH - LEFT - RIGHT}" height="{ROW - 6 + extra}" '
            'fill="#fafafa" stroke="#e0e0e0"/>'
        )
        for seg in lane.segments:
            self.segment(seg, y + 2, ROW - 10, fmt)
        for bar in lane.held:
            self.held(bar, lane.name, y + ROW - 7, fmt)
        for m in lane.markers:
            self.marker(m, y + ROW - 14, fmt)
        self.y += ROW + extra


def _svg(pic: Picture, fmt: TimeFormat) -> str:
    svg = _Svg(pic)
    for lane in pic.lanes:
        svg.lane(lane, fmt)
    svg.y += 8
    for gate in pic.gates:
        svg.lane(gate, fmt)
    if pic.vfs:
        svg.y += 8
        svg.add(f'<text class="lane" x="4" y="{svg.y + 10:.1f}">VF restores</text>')
        svg.y += 16
        for b in pic.vfs:
            y = svg.y
            name = f"{b.pf} VF{b.index}"
            svg.add(f'<text x="12" y="{y + VF_ROW - 2:.1f}">{_e(name)}</text>')
            tone = "ok" if b.ok else "bad"
            state = "restored" if b.ok else "not restored"
            label = f"{name} ({b.vf_pci}): {state}, {b.attempts} attempt(s), {b.failures} failed"
            svg.segment(Segment(b.start, b.end, label, tone), y + 1, VF_ROW - 2, fmt)
            svg.y += VF_ROW
    height = svg.y + 10
    svg.axis(fmt, height - 10)
    body = "".join(svg.grid + svg.parts)
    return (
        f'<svg width="{WIDTH}" height="{height:.0f}" viewBox="0 0 {WIDTH} {height:.0f}" '
        f'role="img" aria-label="nodeagent timeline">{body}</svg>'
    )


def _events(pic: Picture, fmt: TimeFormat) -> str:
    rows: list[tuple[float, str, str, str]] = []
    for lane in pic.lanes:
        rows += [(s.start, lane.name, s.label, s.tone) for s in lane.segments]
        rows += [(m.t, lane.name, m.label, m.tone) for m in lane.markers]
        rows += [
            (b.start, lane.name, f"{_held_row(b)} until {fmt(b.end)}: {b.ended}", b.tone)
            for b in lane.held
        ]
    for gate in pic.gates:
        rows += [(s.start, gate.name, s.label, s.tone) for s in gate.segments]
    rows.sort(key=lambda r: r[0])
    body = "".join(
        f'<tr><td class="t">{_e(fmt(t))}</td><td>{_e(lane)}</td>'
        f'<td class="{_e(tone)}">{_e(text)}</td></tr>'
        for t, lane, text, tone in rows
    )
    return f"<table><tr><th>time</th><th>lane</th><th>what</th></tr>{body}</table>"


def _held_row(bar: HeldBar) -> str:
    return f"held: {bar.opener} (pid {bar.pid}) opening {bar.path}"


def render_html(pic: Picture, fmt: TimeFormat, title: str = "nodeagent timeline") -> str:
    meta = " · ".join(pic.headline(fmt))
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e(title)}</title><style>{STYLE}</style></head><body>"
        f'<h1>{_e(title)}</h1><p class="meta">{_e(meta)}</p>'
        f"{_svg(pic, fmt)}{_events(pic, fmt)}</body></html>\n"
    )
