"""Records to the host journal through systemd's native protocol.

One datagram per record to ``<host root>/run/systemd/journal/socket``, as
``sd_journal_send`` would send it: ``NAME=value`` lines, or ``NAME``, a
little-endian 64-bit length and the bytes for values with a newline. A record
too large for one datagram goes in a sealed memfd whose descriptor is passed
instead (what libsystemd does). Fields: ``MESSAGE`` (one line for a person),
``MESSAGE_ID`` (stable per record kind: ``message_id``), ``PRIORITY``,
``SYSLOG_IDENTIFIER=nodeagent`` and ``NODEAGENT_<KEY>`` for every key of the
record (``guard`` -> ``NODEAGENT_GUARD``, ``module`` -> ``NODEAGENT_MODULE``,
``pci`` -> ``NODEAGENT_PCI``; lists one item a line, objects as JSON).

This exporter only reads records; the stderr JSON lines (``nodeagent.log``)
are written whatever happens here. No socket (no journald, or the path is not
mounted): stderr only, said once, and sending resumes when the socket returns.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import socket
import stat
import struct
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from nodeagent.core.conditions import event_of

log = logging.getLogger("nodeagent.journal")

IDENTIFIER = "nodeagent"
# uuid5(this, "nodeagent.<kind>") is a record kind's MESSAGE_ID: stable across
# versions and hosts, and defined for kinds added later without a table edit.
MESSAGE_ID_NAMESPACE = uuid.UUID("5b0d64a4-3f57-4c07-9f0e-0a5e1d7c2b91")
# The record kinds the agent writes today (docs/operations.md lists their ids).
KNOWN_KINDS = (
    "start",
    "stop",
    "decision",
    "action",
    "plan-superseded",
    "hold-started",
    "held-open",
    "hold-root-marked",
    "hold-root-gone",
    "hold-overflow",
    "hold-over-cap",
    "hold-fault",
    "hold-responder-died",
    "hold-ended-unclean",
    "hold-adopted",
    "hold-not-adoptable",
    "hold-reports-lost",
    "draining",
    "gate-withdrawal",
    "pass-error",
    "state-problem",
)
# Beyond this a record is sent without its evidence (journald's own cap is larger).
MAX_ENTRY_BYTES = 8 * 1024 * 1024
SKIPPED_KEYS = frozenset({"kind", "ts"})
ABSENT_ERRNOS = frozenset(
    {errno.ENOENT, errno.ECONNREFUSED, errno.ENOTDIR, errno.EACCES, errno.ENOTSOCK}
)
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL

# syslog priorities
ERR, WARNING, NOTICE, INFO = 3, 4, 5, 6


def message_id(kind: str) -> str:
    return uuid.uuid5(MESSAGE_ID_NAMESPACE, f"nodeagent.{kind}").hex


def field_name(key: str) -> str:
    """``NODEAGENT_<KEY>``: journald accepts A-Z, 0-9 and '_' in client field names."""
    return "NODEAGENT_" + re.sub(r"[^A-Z0-9]", "_", key.upper())[:54]


def _decision_message(rec: Mapping[str, Any]) -> str:
    reasons = rec.get("reasons") or []
    tail = ": " + "; ".join(str(r) for r in reasons) if reasons else ""
    return f"{rec.get('guard')}: {rec.get('verdict')}{tail}"


def _action_message(rec: Mapping[str, Any]) -> str:
    done = "done" if rec.get("performed") else "decided (observe mode)"
    result = "ok" if rec.get("ok") else f"failed: {rec.get('error')}"
    return f"{rec.get('guard')}: {rec.get('action')} — {done}, {result}"


MESSAGES: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "decision": _decision_message,
    "action": _action_message,
    "start": lambda r: f"nodeagent started (mode {r.get('mode')}, host root {r.get('host_root')})",
    "stop": lambda r: "nodeagent stopped",
    "plan-superseded": lambda r: (
        f"{r.get('guard')}: plan superseded by a newer decision; not done: "
        + ("; ".join(str(a) for a in r.get("not_done") or []) or "nothing")
    ),
    "hold-started": lambda r: (
        "holding module loaders' opens of nvidia-peermem.ko on "
        + (", ".join(str(m) for m in r.get("marked") or []) or "no host tree")
        + (
            "; marking the roots of " + ", ".join(f"'{c}'" for c in r.get("containers") or [])
            if r.get("containers")
            else ""
        )
    ),
    "held-open": lambda r: (
        f"{r.get('opener')} (pid {r.get('pid')}) held {r.get('seconds')} s opening "
        f"{r.get('path')}: {r.get('ended')}"
    ),
    "hold-root-marked": lambda r: (
        f"marked the root of {r.get('command')} (pid {r.get('pid')}, filesystem {r.get('dev')}): "
        "its loads of nvidia-peermem.ko are held while the gate is closed"
    ),
    "hold-root-gone": lambda r: (
        f"the marked root of pid {r.get('pid')} (filesystem {r.get('dev')}) is gone: "
        "its overlay was unmounted"
    ),
    "gate-withdrawal": lambda r: (
        f"gate {r.get('gate')}: its file is withdrawn now"
        if r.get("ok")
        else f"gate {r.get('gate')}: cannot withdraw its file: {r.get('problem')}"
    ),
    "pass-error": lambda r: f"pass failed: {r.get('error')}",
    "state-problem": lambda r: f"state problem: {r.get('problem')}",
    "hold-overflow": lambda r: f"{r.get('count')} fanotify queue overflow(s): {r.get('meaning')}",
    "hold-over-cap": lambda r: f"{r.get('count')} opens past the hold's caps: {r.get('meaning')}",
    "hold-fault": lambda r: (
        f"hold responder: {r.get('count')} x {r.get('fault')}: {r.get('meaning')}"
    ),
    "hold-responder-died": lambda r: (
        f"hold responder (pid {r.get('pid')}) {r.get('how')}: {r.get('meaning')}"
    ),
    "hold-ended-unclean": lambda r: f"the last agent's hold ended unclean: {r.get('meaning')}",
    "hold-adopted": lambda r: (
        f"hold responder (pid {r.get('responder_pid')}) adopted with "
        f"{r.get('held_count')} held open(s): {r.get('meaning')}"
    ),
    "hold-not-adoptable": lambda r: f"hold responder not adoptable: {r.get('error')}",
    "hold-reports-lost": lambda r: f"{r.get('count')} hold report(s) lost: {r.get('meaning')}",
    "draining": lambda r: (
        f"stopping after a drain of at most {r.get('seconds')} s: a load is held, gate closed"
    ),
}


def _decision_priority(rec: Mapping[str, Any]) -> int:
    ok = rec.get("ok", rec.get("verdict") == "open")
    return INFO if ok else NOTICE


def _action_priority(rec: Mapping[str, Any]) -> int:
    if not rec.get("ok"):
        return ERR
    return NOTICE if rec.get("performed") else INFO


PRIORITIES: dict[str, Callable[[Mapping[str, Any]], int]] = {
    "decision": _decision_priority,
    "action": _action_priority,
    "plan-superseded": lambda r: NOTICE,
    "held-open": lambda r: NOTICE if r.get("ended") == "gate opened" else WARNING,
    "gate-withdrawal": lambda r: NOTICE if r.get("ok") else ERR,
    "pass-error": lambda r: ERR,
    "state-problem": lambda r: WARNING,
    "hold-overflow": lambda r: ERR if r.get("gate_closed") else WARNING,
    "hold-over-cap": lambda r: WARNING,
    "hold-fault": lambda r: ERR,
    "hold-responder-died": lambda r: ERR,
    "hold-ended-unclean": lambda r: ERR,
    "hold-adopted": lambda r: NOTICE,
    "hold-not-adoptable": lambda r: WARNING,
    "hold-reports-lost": lambda r: WARNING,
    "draining": lambda r: NOTICE,
}


def message(rec: Mapping[str, Any]) -> str:
    """One line for a person; a record that is a Warning event for node-problem-detector
    starts with ``nodeagent-event <kind>: `` (the stable token NPD's journald monitor
    matches: it sees MESSAGE and SYSLOG_IDENTIFIER, not MESSAGE_ID)."""
    kind = str(rec.get("kind", "record"))
    fmt = MESSAGES.get(kind)
    if fmt is not None:
        text = fmt(rec)
    else:
        rest = {k: v for k, v in rec.items() if k not in SKIPPED_KEYS}
        text = f"{kind}: {json.dumps(rest, default=str)[:500]}"
    event = event_of(rec)
    return text if event is None else f"nodeagent-event {event[0]}: {text}"


def _value(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float):
        return str(value)
    if isinstance(value, list | tuple) and all(
        isinstance(v, str | int | float) and not isinstance(v, bool) for v in value
    ):
        return "\n".join(str(v) for v in value) if value else None
    return json.dumps(value, default=str, sort_keys=True, separators=(",", ":"))


def journal_fields(rec: Mapping[str, Any]) -> list[tuple[str, str]]:
    kind = str(rec.get("kind", "record"))
    priority = PRIORITIES.get(kind, lambda r: INFO)(rec)
    fields = [
        ("MESSAGE", message(rec)),
        ("MESSAGE_ID", message_id(kind)),
        ("PRIORITY", str(priority)),
        ("SYSLOG_IDENTIFIER", IDENTIFIER),
        ("NODEAGENT_KIND", kind),
    ]
    for key, value in rec.items():
        if key in SKIPPED_KEYS:
            continue
        text = _value(value)
        if text is not None:
            fields.append((field_name(key), text))
    return fields


def encode(fields: Iterable[tuple[str, str]]) -> bytes:
    out = bytearray()
    for name, value in fields:
        data = value.encode("utf-8", "replace")
        if b"\n" in data:
            out += name.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += name.encode() + b"=" + data + b"\n"
    return bytes(out)


class JournalExporter:
    """Sends every record to the journal socket; never raises into the agent loop.

    The socket is opened as an ``O_PATH`` descriptor by ``open_socket`` (in the
    agent: resolved inside the host root, as if chrooted, the last component
    never followed) and records go to ``/proc/self/fd/<n>``, that very inode: an
    absolute symlink in the path cannot send them outside the root, and a
    symlink or anything but a socket at the end is refused. A journald restart
    makes a new socket: a refused send opens the path again once.
    """

    name = "journal"

    def __init__(self, socket_path: str, open_socket: Callable[[], int] | None = None) -> None:
        self.socket_path = socket_path
        self._open_socket = open_socket or (
            lambda: os.open(socket_path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        )
        self._target: int | None = None  # the O_PATH descriptor of the socket
        # Non-blocking: a slow journald must never stall the loop; a full queue drops
        # the journal's copy of a record (stderr and the timeline still have it).
        self._sock = socket.socket(
            socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
        )
        self.available: bool | None = None  # None: nothing sent yet
        self.sent = 0
        self.dropped = 0

    def _address(self, reopen: bool) -> str:
        """``/proc/self/fd/<n>`` of the socket, opened now if not yet (or ``reopen``)."""
        if reopen:
            self._forget()
        if self._target is None:
            fd = self._open_socket()
            try:
                mode = os.fstat(fd).st_mode
                if not stat.S_ISSOCK(mode):
                    what = "a symlink" if stat.S_ISLNK(mode) else "not a socket"
                    raise OSError(errno.ENOTSOCK, f"is {what}; not followed")
            except BaseException:
                os.close(fd)
                raise
            self._target = fd
        return f"/proc/self/fd/{self._target}"

    def _forget(self) -> None:
        fd, self._target = self._target, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def on_record(self, rec: Mapping[str, Any]) -> None:
        fields = journal_fields(rec)
        data = encode(fields)
        if len(data) > MAX_ENTRY_BYTES:
            fields = [f for f in fields if f[0] != "NODEAGENT_EVIDENCE"]
            data = encode([*fields, ("NODEAGENT_TRUNCATED", "evidence left out: too large")])
        self._send(data)

    def on_pass(self, result: object, exc: Exception | None) -> None:
        """Passes carry nothing for the journal beyond their records."""

    def _send(self, data: bytes) -> None:
        try:
            try:
                self._send_to(data, self._address(reopen=False))
            except (ConnectionRefusedError, FileNotFoundError):
                self._send_to(data, self._address(reopen=True))  # journald made a new one
        except BlockingIOError:
            if not self.dropped:
                log.warning("journal socket %s is full: dropping records there", self.socket_path)
            self.dropped += 1
            return
        except OSError as exc:
            self._unavailable(exc)
            return
        if self.available is False:
            log.warning(
                "journal socket %s is back: records go to the journal again", self.socket_path
            )
        self.available = True
        self.sent += 1

    def _send_to(self, data: bytes, address: str) -> None:
        try:
            self._sock.sendto(data, address)
        except OSError as exc:
            if exc.errno not in (errno.EMSGSIZE, errno.ENOBUFS):
                raise
            self._send_memfd(data, address)

    def _send_memfd(self, data: bytes, address: str) -> None:
        fd = os.memfd_create("nodeagent-journal", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            # journald only accepts a sealed memfd: the content can no longer change.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
            self._sock.sendmsg([], rights, 0, address)
        finally:
            os.close(fd)

    def _unavailable(self, exc: OSError) -> None:
        if self.available is False:
            return
        what = "absent" if exc.errno in ABSENT_ERRNOS else "refusing records"
        log.warning(
            "journal socket %s %s (%s): records go to stderr only",
            self.socket_path,
            what,
            exc.strerror or exc,
        )
        self.available = False

    def close(self) -> None:
        self._forget()
        with contextlib.suppress(OSError):
            self._sock.close()
