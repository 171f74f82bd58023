"""The hold's part of status.json and its records of what the responder did, from a
responder and a scanner (``side.py`` asks; these only read them)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nodeagent.guards.peermem.roots import RootScanner
    from nodeagent.guards.peermem.start import HoldResponder

log = logging.getLogger("nodeagent")


def running_status(
    hold: HoldResponder,
    containers: RootScanner | None,
    *,
    state: str,
    marked: list[str],
    since: float | None,
    gate_open: bool,
    unlimited_queue: bool,
    restarts: int,
) -> dict[str, Any]:
    """The hold's part of status.json while a responder holds."""
    return {
        "state": state,
        "marked": marked,
        "since": since,
        "gate_open": gate_open,
        "queue": "unlimited" if unlimited_queue else "bounded",
        "held": [
            {"pid": p, "opener": o, "path": f, "seconds": round(t, 3)} for p, o, f, t in hold.held()
        ],
        "held_count": held_count(hold),  # exact: "held" may list only some
        "counts": dict(hold.counts),
        "responder": "answering" if hold.alive() else "stopped",
        # Its own process (pid), or a thread of the agent's (None); replaced after deaths.
        "responder_pid": hold.pid,
        "responder_restarts": restarts,
        # The responder a dead agent left, adopted by this one (issue 52).
        "responder_adopted": hold.adopted_from is not None,
        # Non-target files filtered in the kernel after their first open: how
        # (evictable, pinned, off), how many; None for a responder without them.
        "ignore_marks": hold.ignore_status(),
        # Descriptors: the limit (raised to the hard one at start), the reserve kept for
        # the rest of the agent, the caps on held opens fitted in what is left, in use now.
        "descriptors": descriptors(hold),
        "container_roots": [
            {
                "dev": r.dev_text(),
                "pid": r.pid,
                "rule": r.rule,
                "command": r.command,
                "noticed_ms": round(r.noticed_s * 1000, 1),
            }
            for r in (containers.roots() if containers else [])
        ],
        # Matches of the rules left unmarked, and why (e.g. no CAP_SYS_MODULE).
        "not_marked": [
            {"pid": pid, "command": command, "why": why}
            for pid, command, why in (list(containers.refused) if containers else [])
        ],
        # How starts are noticed: "exec events", or "polling /proc every 0.1 s: <why>".
        "container_scan": containers.status() if containers else None,
    }


def starting_status(
    state: str,
    *,
    start_failures: int,
    gate_open: bool,
    unlimited_queue: bool,
    starting: bool,
    restarts: int,
) -> dict[str, Any]:
    """Configured and not holding (starting, retrying, off): nothing marked, nothing
    held, and the state says why."""
    return {
        "state": state,
        "start_failures": start_failures,
        "marked": [],
        "since": None,
        "gate_open": gate_open,
        "queue": "unlimited" if unlimited_queue else "bounded",
        "held": [],
        "counts": {},
        "responder": "starting" if starting else "none",
        "responder_pid": None,
        "responder_restarts": restarts,
        "responder_adopted": False,
        "ignore_marks": None,
        "descriptors": None,
        "container_roots": [],
        "not_marked": [],
        "container_scan": None,
    }


def held_count(hold: HoldResponder | None) -> int:
    """Exact, where the responder lists only some."""
    return hold.held_count() if hold is not None else 0


def descriptors(hold: HoldResponder | None) -> dict[str, int] | None:
    budget = hold.descriptors if hold is not None else None
    if budget is None:
        return None
    from nodeagent.guards.peermem.budget import open_descriptors

    out = budget.status()
    out["in_use"] = open_descriptors()
    responder_fds = hold.descriptors_in_use() if hold is not None else None
    if responder_fds is not None:  # apart: held opens' descriptors are its own
        out["responder_in_use"] = responder_fds
    out["held_now"] = held_count(hold)
    return out


def record_holds(
    hold: HoldResponder,
    scanner: RootScanner | None,
    record: Callable[[dict[str, Any]], None],
    guard: str,
    lost_said: int,
    why_of: Callable[[Any], str | None] = lambda file: None,
) -> int:
    """Every held open that ended since the last pass, as a timeline record; one that
    went by its file's own verdict says why (``why_of``: the agent's reason for a file)."""
    while scanner is not None and scanner.reports:
        record(scanner.reports.popleft())
    # Bursts: an overflow (a held-class open may have gone), opens past a cap, a fault.
    while hold.notices:
        notice = hold.notices.popleft()
        log.warning("peermem hold: %s (%s times)", notice.get("meaning"), notice.get("count"))
        record({**notice, "guard": guard})
    lost = hold.reports_lost
    if lost > lost_said:
        record(
            {
                "kind": "hold-reports-lost",
                "guard": guard,
                "count": lost - lost_said,
                "meaning": "held opens ended while the agent's loop did not read their "
                "reports for long (stopped or starved): these are not in the timeline; "
                "the hold's counts (status) still include them",
            }
        )
        lost_said = lost
    while hold.reports:
        r = hold.reports.popleft()
        rec: dict[str, Any] = {
            "kind": "held-open",
            "guard": guard,
            "pid": r.pid,
            "opener": r.opener,
            "path": r.path,
            "seconds": round(r.seconds, 3),
            "ended": r.ended,
        }
        why = why_of(r.file) if r.file is not None else None
        if why is not None:
            rec["why"] = why
        record(rec)
    return lost_said
