"""What node-problem-detector shows of the node: one condition per guard, Warning events.

NPD runs a custom plugin in its own container (a shell and coreutils, no
Python): ``deploy/npd/nodeagent-npd-check`` only reads what the agent
publishes under ``<state dir>/npd/``, and this module says what that is:

- ``<guard>``: the guard's condition, ``key=value`` lines: ``status`` (``ok`` or
  ``problem``), ``verdict``, ``decided`` (the boot-time clock, whole seconds,
  when this verdict was first decided), ``boot_id``, ``message`` (one line of
  at most 80 characters, operator words);
- ``heartbeat``: ``boot_id`` and ``beat`` (boot-time seconds), renewed by the
  agent's loop every ``RENEW_S`` like the gate lease, so a healthy idle agent
  is never stale and a dead one is within seconds;
- ``events/<kind>``: the last time (``at``) something worth a Warning event
  happened (``EVENT_KINDS``), with its ``message``.

For a condition the plugin exits 0 (OK), 1 (problem) or 3 (Unknown: no
heartbeat, a stale one or one ahead of the clock, another boot, a file it
cannot parse), as NPD reads exit codes. NPD raises a Warning for any exit but
0 of a temporary rule, so for an event it exits 1 only for one of this boot at
most its window old and not ahead of the clock, else 0. Times are whole
seconds in decimal (the plugin drops leading zeros and refuses more than 12
digits). Pure.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from nodeagent.core.applicability import WORDS as SHELVED
from nodeagent.core.guard import Verdict

MESSAGE_MAX = 80  # NPD's default max_output_length
# A condition type per guard: True means a problem (NPD's permanent rules).
CONDITION_TYPES = {
    "peermem": "RDMAModuleOrder",
    "storage": "RDMAStorageChain",
    "sriov": "SRIOVVFConfig",
}
# The Warning events NPD's temporary rules emit, by kind (also the file name).
EVENT_KINDS = (
    "peermem-load-failed",  # a load of nvidia_peermem failed (the agent's, or held ones')
    "peermem-held-past-budget",  # a held load let go when its budget ran out, gate closed
    "storage-in-use",  # storage modules in use while MOFED waits to install
    "vf-degraded",  # a PF's VFs not back, or not set, by their deadline
)
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]+")


def condition_type(guard: str) -> str:
    return CONDITION_TYPES.get(guard, f"Nodeagent{guard.title().replace('-', '')}")


def one_line(text: str, limit: int = MESSAGE_MAX) -> str:
    """Printable ASCII on one line, at most ``limit`` characters ('...' where cut)."""
    flat = " ".join(_UNPRINTABLE.sub(" ", text).split())
    return flat if len(flat) <= limit else flat[: limit - 3].rstrip() + "..."


def condition_message(v: Verdict) -> str:
    if v.ok and not (v.verdict in SHELVED and v.reasons):
        return one_line(f"{v.guard} {v.verdict}")
    why = v.reasons[0] if v.reasons else "not ok"
    return one_line(f"{v.guard} {v.verdict}: {why}")


def condition_text(v: Verdict, decided: float, boot: str) -> str:
    return "".join(
        f"{k}={val}\n"
        for k, val in (
            ("version", 1),
            ("status", "ok" if v.ok else "problem"),
            ("verdict", one_line(v.verdict, 40)),
            ("decided", int(decided)),
            ("boot_id", boot),
            ("message", condition_message(v)),
        )
    )


def heartbeat_text(beat: float, boot: str) -> str:
    return f"version=1\nboot_id={boot}\nbeat={int(beat)}\n"


def event_text(at: float, boot: str, message: str) -> str:
    return f"version=1\nboot_id={boot}\nat={int(at)}\nmessage={one_line(message)}\n"


def event_of(rec: Mapping[str, Any]) -> tuple[str, str] | None:
    """The Warning event a record is, as (kind, message), or None."""
    kind, guard = rec.get("kind"), rec.get("guard")
    if kind == "action" and guard == "peermem" and rec.get("performed", True):
        what = str(rec.get("action") or "")
        if what.startswith("load") and not rec.get("ok"):
            return "peermem-load-failed", f"nvidia_peermem load failed: {rec.get('error')}"
    if kind == "held-open" and rec.get("ended") == "budget expired":
        return "peermem-held-past-budget", (
            f"held {rec.get('opener')} load of nvidia-peermem {rec.get('seconds')} s: "
            f"{rec.get('ended')}"
        )
    if kind == "decision" and not rec.get("ok"):
        reasons = rec.get("reasons") or ["?"]
        first = str(reasons[0]) if isinstance(reasons, list) and reasons else "?"
        if guard == "storage" and rec.get("verdict") == "in-use":
            return "storage-in-use", f"storage chain in use while MOFED waits: {first}"
        if guard == "sriov" and rec.get("verdict") == "degraded":
            return "vf-degraded", f"VFs degraded: {first}"
    return None


__all__ = [
    "CONDITION_TYPES",
    "EVENT_KINDS",
    "condition_message",
    "condition_text",
    "condition_type",
    "event_of",
    "event_text",
    "heartbeat_text",
    "one_line",
]
