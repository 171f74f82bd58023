"""A log line's prefixes (kubectl, dmesg, journalctl, CRI, colour) taken off, and the time
it says: wall clock as seconds into the year, or seconds since boot. Pure."""

from __future__ import annotations

import re
from dataclasses import dataclass

_MONTH_NAMES = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_MONTHS = {m: i for i, m in enumerate(_MONTH_NAMES)}
_DAYS_BEFORE = (0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334)

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# Each prefix keeps its time in named groups: a month (number or name), day, H:M:S, or
# seconds since boot.
_PREFIXES = (
    # kubectl logs --prefix (the GPU Operator's must-gather): [pod/<pod>/<container>]
    re.compile(r"^\[pod/[^\]\s/]++/[^\]\s]++\]\s*"),
    # kubectl --timestamps (RFC 3339); journalctl -o short-iso
    re.compile(
        r"^\d{4}-(?P<mon>\d\d)-(?P<day>\d\d)T(?P<hms>\d\d:\d\d:\d\d)(?:\.\d+)?"
        r"(?:Z|[+-]\d\d:?\d\d)\s+"
    ),
    re.compile(r"^(?:stdout|stderr) [FP] "),  # a kubelet (CRI) log file, after its time
    re.compile(r"^\[\s*(?P<boot>\d+\.\d+)\]\s*"),  # dmesg
    # dmesg -T
    re.compile(
        r"^\[[A-Z][a-z]{2} (?P<mname>[A-Z][a-z]{2}) (?P<day>[ \d]\d) (?P<hms>\d\d:\d\d:\d\d) "
        r"\d{4}\]\s*"
    ),
    # journal; ++: a run given back never lets the rest match (it stops at the space,
    # or at the ':' that ends the prefix)
    re.compile(
        r"^(?P<mname>[A-Z][a-z]{2}) (?P<day>[ \d]\d) (?P<hms>\d\d:\d\d:\d\d) \S++ "
        r"[^:\s]++(?:\[\d+\])?:\s*"
    ),
)
# Times a tool writes inside its line (kept, not taken off): MOFED's and the DOCA driver
# container's "[26-Sep-24_05:02:12]", logrus' time="2025-11-21T11:51:41Z", klog's
# "I1121 11:51:41.123456".
_LOGRUS_TIME = re.compile(r"\btime=\"?\d{4}-(?P<mon>\d\d)-(?P<day>\d\d)T(?P<hms>\d\d:\d\d:\d\d)")
_INLINE_TIMES = (
    re.compile(r"^\[(?P<day>\d\d)-(?P<mname>[A-Z][a-z]{2})-\d\d_(?P<hms>\d\d:\d\d:\d\d)\]"),
    _LOGRUS_TIME,
    re.compile(r"^[IWEF](?P<mon>\d\d)(?P<day>\d\d) (?P<hms>\d\d:\d\d:\d\d)\.\d+ "),
)


@dataclass(frozen=True, slots=True)
class Stamp:
    """A time a line said: ``clock`` "wall" (seconds into the year) or "boot"."""

    clock: str
    t: float


def _stamp(m: re.Match[str]) -> Stamp | None:
    g = m.groupdict()
    if g.get("boot"):
        return Stamp("boot", float(g["boot"]))
    month = int(g["mon"]) - 1 if g.get("mon") else _MONTHS.get(g.get("mname") or "", -1)
    if not 0 <= month < 12:
        return None
    h, mi, s = (int(x) for x in g["hms"].split(":"))
    day = int(g["day"])
    return Stamp("wall", ((_DAYS_BEFORE[month] + day - 1) * 24 + h) * 3600 + mi * 60 + s)


def split(line: str) -> tuple[str, Stamp | None]:
    """The line as the tool wrote it (prefixes, colour and CR off) and the time it says."""
    line = line.rstrip("\r\n")
    if "\x1b" in line:  # colour is rare: the search for it costs a scan of the line
        line = _ANSI.sub("", line)
    line = line.replace("\r", "")
    stamp = None
    for prefix in _PREFIXES:
        m = prefix.match(line)
        if m:
            # the outer time wins: kubectl's when it holds a container's dmesg line
            stamp = stamp or _stamp(m)
            line = line[m.end() :]
    line = line.strip()
    if stamp is None:
        for inline in _INLINE_TIMES:
            # the logrus form is searched only where its word is (a search from every
            # position of a long line costs more than the rest of the line's reading)
            if inline is _LOGRUS_TIME and "time=" not in line:
                continue
            m = inline.search(line)
            if m:
                stamp = _stamp(m)
                break
    return line, stamp


def normalize(line: str) -> str:
    return split(line)[0]
