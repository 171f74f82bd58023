"""``nodeagent timeline [--since T] [--format text|html]``: read the records, draw them."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime

from nodeagent.config import Config
from nodeagent.errors import NodeagentError
from nodeagent.host.fs import HostRoot
from nodeagent.timeline import Timeline
from nodeagent.timeline_view.html import render_html
from nodeagent.timeline_view.picture import DRAWABLE, Picture, build_picture, record_time
from nodeagent.timeline_view.text import render_text

__all__ = ["FORMATS", "clock_for", "parse_since", "timeline_main"]

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}
FORMATS: dict[str, Callable[[Picture, Callable[[float], str], str], str]] = {
    "text": render_text,
    "html": render_html,
}


def parse_since(value: str, now: float) -> float:
    """``30m``/``2h``/``1d`` ago, an ISO 8601 time (UTC unless it says), or epoch seconds;
    a time the picture can draw (DRAWABLE), else NodeagentError."""
    t = _since_time(value, now)
    if not DRAWABLE[0] <= t <= DRAWABLE[1]:  # also False for NaN
        raise NodeagentError(
            f"--since: {value!r} is not a time between 1970-01-01 and 9999-12-31 UTC"
        )
    return t


def _since_time(value: str, now: float) -> float:
    v = value.strip()
    m = _DURATION.match(v)
    if m:
        return now - float(m.group(1)) * _UNIT[m.group(2)]
    try:
        return float(v)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(v.replace("Z", "+00:00"))
    except ValueError:
        raise NodeagentError(
            f"--since: {value!r} is not a time (a duration like 30m or 2h, an ISO 8601 "
            "time like 2026-11-23T10:00:00Z, or epoch seconds)"
        ) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def clock_for(pic: Picture) -> Callable[[float], str]:
    """UTC wall-clock times; with the date when the picture spans more than one day."""
    day = lambda t: time.gmtime(t)[:3]  # noqa: E731
    pattern = "%H:%M:%S" if day(pic.start) == day(pic.end) else "%Y-%m-%d %H:%M:%S"
    return lambda t: time.strftime(pattern, time.gmtime(t))


def timeline_main(cfg: Config, since: str | None, fmt: str) -> int:
    now = time.time()
    start = parse_since(since, now) if since is not None else None
    timeline = Timeline(
        HostRoot(cfg.host_root), cfg.paths.timeline_dir, cfg.timeline_max_bytes, cfg.timeline_keep
    )
    read = list(timeline.records())
    records = [r for r in read if record_time(r) is not None]
    skipped = timeline.skipped + len(read) - len(records)
    if skipped:  # said once, on stderr: the picture on stdout stays clean
        print(
            f"nodeagent: {skipped} records skipped: torn, not a JSON object, or no time "
            f"(ts) between 1970 and 9999 in {timeline.rel}*",
            file=sys.stderr,
        )
    if not records:
        print(f"nodeagent: no timeline records in {timeline.rel}", file=sys.stderr)
        return 1
    pic = build_picture(records, since=start)
    title = f"nodeagent timeline ({time.strftime('%Y-%m-%d', time.gmtime(pic.start))} UTC)"
    sys.stdout.write(FORMATS[fmt](pic, clock_for(pic), title))
    return 0
