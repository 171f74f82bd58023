"""The hold's responder, a process of its own: ``python -m nodeagent.guards.peermem.process_main``.

The agent starts it (``guards/peermem/process.py``) before it marks anything,
with five descriptors and nothing else to read: the fanotify group (shared),
the gate's lease (a memfd: ``guards/peermem/lease.py``), an eventfd the agent
writes when the gate changes, the read end of a pipe the agent writes once, at
its stop (this process then lets every held open go and exits, so the group's
last descriptor goes with the agent; an end without that word is the agent's
death: with an adoption socket, the sixth descriptor, it holds on for the next
agent: ``Adoption``), and the write end of a pipe for what it tells the agent: ``ready`` once
everything it needs is imported, each held open that ended, each notice, and
its state (counts, what it holds) for status.

It answers with the same ``Responder`` as the in-process thread; only its
gate is the lease, so a stalled agent loop (no renewal) reads closed: a module
load waits, every other open is answered at once. It opens no file after
``ready`` but under ``/proc``; it never blocks on the agent (its messages wait
in a bounded buffer while the pipe is full), and it writes no traceback (one
would read source files): a fatal error is one line on stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from nodeagent.guards.peermem.budget import Caps, open_descriptors
from nodeagent.guards.peermem.heldfiles import read_held_fd
from nodeagent.guards.peermem.lease import HeldVerdicts, read_lease, read_verdicts
from nodeagent.guards.peermem.openers import Openers
from nodeagent.guards.peermem.responder import Responder, Rounds
from nodeagent.host.fanotify import FanotifyGroup, IgnoreMarks

OUTBOX_MAX = 4 << 20  # bytes of messages kept while the agent does not read (it is stalled)
STATE_MAX = 64 << 10  # a state message is added only while less than this is waiting
STATE_EVERY_S = 0.1  # at most this often; state is "latest wins", reports are never dropped
# A beat at least this often: the agent takes a silent responder for stuck. A message of
# its own, a few bytes, never the state: what openers make the state say (their paths)
# must never silence it (issue 51: 64 held opens at a 3.5 KB path grew the state past
# STATE_MAX, so no state and no heartbeat went out, and the agent killed it as stuck).
HEARTBEAT_S = 1.0
BEAT = b'{"t":"beat"}\n'
# The state lists the held opens in at most HELD_BYTES of JSON, each path cut to
# PATH_LISTED characters (its start and its end, where the file's name is); the count is
# exact however many are listed (the caps allow 256 held: short paths list them all).
HELD_BYTES = 48 << 10
PATH_LISTED = 256
FINAL_FLUSH_S = 2.0  # at exit, how long the last reports may wait for the agent to read
ADOPT_TIMEOUT_S = 2.0  # an adopting agent's request and this process's answer, each
PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class Outbox:
    """JSON lines to the agent through a non-blocking pipe; what does not fit waits here."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = bytearray()
        self.dropped = 0  # messages that found the buffer full (the agent stalled for long)
        # False once the agent's end is closed (it is gone): what waits is kept, within
        # OUTBOX_MAX, for an agent that adopts this process (``Adoption``).
        self.attached = True

    def put(self, msg: dict[str, Any], limit: int = OUTBOX_MAX) -> bool:
        return self.put_line(json.dumps(msg, separators=(",", ":")).encode() + b"\n", limit)

    def put_line(self, line: bytes, limit: int = OUTBOX_MAX) -> bool:
        if len(self.buf) + len(line) > limit:
            self.dropped += 1
            return False
        self.buf += line
        return True

    def flush(self) -> None:
        while self.buf and self.attached:
            try:
                n = os.write(self.fd, self.buf)
            except BlockingIOError:
                return
            except InterruptedError:
                continue
            except OSError:  # EPIPE: nobody reads any more
                self.attached = False
                return
            del self.buf[:n]

    def drain(self, seconds: float) -> None:
        """At exit: wait for the agent to read what is left, a little."""
        deadline = time.monotonic() + seconds
        poller = select.poll()
        poller.register(self.fd, select.POLLOUT)
        while self.buf and self.attached:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            with contextlib.suppress(InterruptedError):
                poller.poll(int(left * 1000) + 1)
            self.flush()


class ApartResponder(Responder):
    """The responder of this process: after each round it sends what ended and its state."""

    def __init__(
        self,
        *args: Any,
        watch_fds: Mapping[int, Callable[[], None]],
        outbox: Outbox,
        marks: IgnoreMarks,
        orphan_s: float,
        **kw: Any,
    ) -> None:
        rounds = Rounds(watch_fds=watch_fds, after_step=self.after_round, ignore=marks.add)
        super().__init__(*args, rounds=rounds, **kw)
        self.outbox = outbox
        self.marks = marks
        self.orphan_s = orphan_s  # how long it holds for an agent that died, unadopted
        self.orphaned_at: float | None = None  # its agent died without a stop (Adoption)
        self._state_sent = 0.0
        self._state_sig: tuple[int, int, int] = (-1, -1, -1)  # what the last state said
        self._state_due = False
        self._beat_sent = 0.0
        self._files_sent = 0  # the ``files_changed`` the agent was last told of

    def _timeout_ms(self) -> int | None:
        timeout = super()._timeout_ms()
        due = STATE_EVERY_S if self._state_due or self.outbox.buf else HEARTBEAT_S
        if self.orphaned_at is not None:  # (its end is due too)
            due = min(due, max(0.0, self.orphaned_at + self.orphan_s - time.monotonic()))
        cap = int(due * 1000)  # a state throttled, the pipe was full, or the heartbeat
        return cap if timeout is None else min(timeout, cap)

    def after_round(self) -> None:
        """Send what it has; an orphan nobody adopted in ``orphan_s`` stops (lets go)."""
        if self.orphaned_at is not None and time.monotonic() - self.orphaned_at >= self.orphan_s:
            self._stopping = True
        self.send()

    def send(self) -> None:
        out = self.outbox
        while self.reports:
            if not out.put({"t": "report", **asdict(self.reports[0])}):
                break
            self.reports.popleft()
        while self.notices:
            if not out.put({"t": "notice", "notice": self.notices[0]}):
                break
            self.notices.popleft()
        # The held files whenever their set changed: never dropped (tried again next round).
        changed = self.files_changed
        if changed != self._files_sent and out.put({"t": "held-files", "files": self.held_files()}):
            self._files_sent = changed
        # Cheap first (this runs after every event): what may have changed, and when.
        sig = (sum(self.counts.values()), len(self._held), self.reported)
        now = time.monotonic()
        if sig != self._state_sig:  # (its life is said by the beat, not by the state)
            self._state_due = True
        beat_due = out.attached and now - self._beat_sent >= HEARTBEAT_S  # (none for nobody)
        if beat_due and out.put_line(BEAT, OUTBOX_MAX + len(BEAT)):
            self._beat_sent = now
        if self._state_due and now - self._state_sent >= STATE_EVERY_S:
            held = self.held()
            state = {
                "t": "state",
                "counts": self.counts,
                "held_count": len(held),
                "held": _listed(held),
                "peak": self.peak_descriptors,
                "fds": open_descriptors(),
                "dropped": out.dropped,
                "ignore": self.marks.status(),
            }
            if out.put(state, limit=STATE_MAX):
                self._state_sig, self._state_sent, self._state_due = sig, now, False
        if out.buf and out.attached:
            out.flush()


def _listed(held: list[tuple[int, str, str, float]]) -> list[list[Any]]:
    """What the state lists of ``held``: in order, while it fits in HELD_BYTES."""
    out: list[list[Any]] = []
    size = 0
    for pid, opener, path, seconds in held:
        entry = [pid, opener[:32], _cut(path), round(seconds, 3)]
        size += len(json.dumps(entry, separators=(",", ":"))) + 1
        if size > HELD_BYTES:
            break
        out.append(entry)
    return out


def _cut(path: str) -> str:
    """At most PATH_LISTED characters: the start and the end (the file's name), cut between."""
    if len(path) <= PATH_LISTED:
        return path
    keep = PATH_LISTED - 1
    return path[: keep // 4] + "\u2026" + path[-(keep - keep // 4) :]


def _drain_eventfd(fd: int) -> None:
    with contextlib.suppress(BlockingIOError, InterruptedError):
        os.eventfd_read(fd)


class Adoption:
    """The agent's death without a stop, and its adoption by the next agent (issue 52).

    The life pipe says how the agent ended: a clean stop writes a byte before it closes
    its end (this process lets every held open go and exits); an end with no byte is a
    death. With a listening socket (``adopt``: bound by the agent in its state directory),
    a death makes this process an orphan: it keeps holding, its gate closed whatever the
    lease said, its reports kept for the next agent, and it waits for that agent to
    connect. The socket is served only while orphaned; the peer must be root
    (``SO_PEERCRED``). The agent sends the new ends of the two pipes (``SCM_RIGHTS``);
    they take the old ones' numbers (``dup2``: everything that waits on them goes on),
    and this process answers with the group, the lease and the eventfd, so the agent
    marks through the same group and writes the same lease. Nobody within ``orphan_s``
    (the hold's budget): it lets go and exits, as a stop would. Without a socket a death
    is a stop."""

    def __init__(
        self,
        responder: ApartResponder,
        *,
        life_fd: int,
        listener: socket.socket | None,
        group_fd: int,
        lease_fd: int,
        wake_fd: int,
    ) -> None:
        self.responder = responder
        self.life_fd = life_fd
        self.listener = listener
        self.group_fd, self.lease_fd, self.wake_fd = group_fd, lease_fd, wake_fd
        self.told_stop = False
        self._plug_w = -1  # the write end of the pipe that stands for a dead agent's end

    def gate_open(self) -> bool:
        """The lease, while an agent writes it; closed while orphaned."""
        return self.responder.orphaned_at is None and read_lease(self.lease_fd)

    def verdicts(self) -> HeldVerdicts | None:
        """The verdicts on held files, while an agent writes them; none while orphaned
        (every held file waits: the gate reads closed)."""
        if self.responder.orphaned_at is not None:
            return HeldVerdicts()
        return read_verdicts(self.lease_fd)

    def on_life(self) -> None:
        try:
            data = os.read(self.life_fd, 64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:  # a clean stop's word; its end follows
            self.told_stop = True
            return
        if self.told_stop or self.listener is None:
            self.responder._stopping = True
            return
        if self.responder.orphaned_at is None:
            self._orphan()

    def _orphan(self) -> None:
        r, w = os.pipe2(os.O_CLOEXEC)  # never readable: the dead end stops waking the poll
        os.dup2(r, self.life_fd, inheritable=False)
        os.close(r)
        self._plug_w = w
        # The dead agent's pid may be reused: only this process's own opens go at once now.
        self.responder.own_pids = frozenset({os.getpid()})
        self.responder.orphaned_at = time.monotonic()
        self.responder.outbox.attached = False
        self.responder.wake()  # a round now: its gate reads closed from here on

    def on_listener(self) -> None:
        assert self.listener is not None
        try:
            conn, _ = self.listener.accept()
        except OSError:  # (nothing, or the peer gave up)
            return
        with conn:
            conn.settimeout(ADOPT_TIMEOUT_S)
            with contextlib.suppress(OSError, ValueError):
                self._adopt(conn)

    def _adopt(self, conn: socket.socket) -> None:
        pid, uid, _ = PEERCRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size)
        )
        if uid != 0 and uid != os.geteuid():
            return  # (a root-only directory: never, but never trusted)
        msg, fds, _, _ = socket.recv_fds(conn, 1024, 2)  # (read first: unread, a close resets)
        try:
            if self.responder.orphaned_at is None:
                self.on_life()  # its agent's end may have closed a moment ago
            if self.responder.orphaned_at is None:
                conn.send(b'{"t":"busy"}')
                return
            request = json.loads(msg)
            if not isinstance(request, dict) or request.get("t") != "adopt" or len(fds) != 2:
                raise ValueError("not an adoption")
            responder = self.responder
            held = responder.held()
            reply = {
                "t": "adopted",
                "pid": os.getpid(),
                "held_count": len(held),
                "held": _listed(held),
                "orphaned_s": round(time.monotonic() - (responder.orphaned_at or 0.0), 3),
            }
            socket.send_fds(
                conn,
                [json.dumps(reply).encode()],
                [self.group_fd, self.lease_fd, self.wake_fd],
            )
            life_r, out_w = fds
            os.dup2(life_r, self.life_fd, inheritable=False)
            os.dup2(out_w, responder.outbox.fd, inheritable=False)
            os.set_blocking(self.life_fd, False)
            os.set_blocking(responder.outbox.fd, False)
        finally:
            for fd in fds:
                os.close(fd)
        if self._plug_w >= 0:
            os.close(self._plug_w)
            self._plug_w = -1
        # The new agent's own opens are answered at once, as the dead one's were.
        responder.own_pid = pid
        responder.own_pids = frozenset({pid, os.getpid()})
        self.told_stop = False
        responder.orphaned_at = None
        responder.outbox.attached = True
        responder._state_due, responder._state_sent = True, 0.0
        responder._files_sent = -1  # the new agent hears what is held, and judges it
        responder.wake()


def _warm_up() -> None:
    """Read a module of each compression once, from a memfd, before ``ready``: the
    parser and its decompressors (zstandard is imported on first use) must not be
    imported after marks exist (an import opens files, and could wait on this hold)."""
    import gzip
    import lzma

    with contextlib.suppress(ImportError):
        import zstandard

        _ = zstandard.ZstdCompressor
    fd = os.memfd_create("nodeagent-warm-up", os.MFD_CLOEXEC)
    try:
        payloads = [b"\x7fELF" + bytes(60), lzma.compress(b"x"), gzip.compress(b"x")]
        if "zstandard" in sys.modules:
            payloads.append(sys.modules["zstandard"].ZstdCompressor().compress(b"x"))
        for payload in payloads:
            os.ftruncate(fd, 0)
            os.pwrite(fd, payload, 0)
            read_held_fd(fd, "warm-up.ko")
    finally:
        os.close(fd)


def serve(spec: dict[str, Any]) -> int:
    group = FanotifyGroup.adopt(int(spec["group"]))
    lease_fd, wake_fd, life_fd = int(spec["lease"]), int(spec["wake"]), int(spec["life"])
    outbox = Outbox(int(spec["out"]))
    os.set_blocking(life_fd, False)
    os.set_blocking(outbox.fd, False)
    listener = None
    if spec.get("adopt") is not None:
        # Listened to here, so a connecting agent's SO_PEERCRED names this process.
        listener = socket.socket(fileno=int(spec["adopt"]))
        listener.listen(1)
        listener.setblocking(False)
    budget_s = float(spec["budget_s"])
    adoption: Adoption
    responder = ApartResponder(
        group,
        gate_open=lambda: adoption.gate_open(),
        verdicts=lambda: adoption.verdicts(),
        budget_s=budget_s,
        openers=Openers(
            proc=str(spec.get("proc", "/proc")),
            own_pid=int(spec["agent_pid"]),
            also_own=(os.getpid(),),
        ),
        caps=Caps(
            held_per_container=int(spec["held_per_container"]),
            held_total=int(spec["held_total"]),
            burst_quiet_s=float(spec["burst_quiet_s"]),
        ),
        watch_fds={
            life_fd: lambda: adoption.on_life(),
            wake_fd: lambda: _drain_eventfd(wake_fd),
            **({listener.fileno(): lambda: adoption.on_listener()} if listener else {}),
        },
        outbox=outbox,
        marks=IgnoreMarks(group, mode=str(spec.get("ignore", "auto"))),
        orphan_s=budget_s,
    )
    adoption = Adoption(
        responder,
        life_fd=life_fd,
        listener=listener,
        group_fd=group.fileno(),
        lease_fd=lease_fd,
        wake_fd=wake_fd,
    )
    # Everything it will use once marks exist, used once now (imports, the lease, JSON,
    # a module file of each compression).
    read_lease(lease_fd)
    read_verdicts(lease_fd)
    _warm_up()
    responder.send()
    outbox.put({"t": "ready", "pid": os.getpid()})
    outbox.flush()
    responder.serve()  # until its agent stops (or dies, unadopted): every held open is let go
    if listener is not None:
        listener.close()  # (the agent that stopped it removes the file)
    responder._state_due, responder._state_sent = True, 0.0  # its last state, whatever it is
    responder.send()
    outbox.drain(FINAL_FLUSH_S)
    group.close()
    return 0


def main(argv: Sequence[str]) -> int:
    # Ctrl-C in a terminal reaches the agent's session only: the agent stops this one.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        spec = json.loads(argv[1])
        return serve(spec)
    except Exception as exc:  # one line, no traceback: formatting one reads source files
        with contextlib.suppress(Exception):
            os.write(2, f"nodeagent hold responder: {type(exc).__name__}: {exc}\n".encode())
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
