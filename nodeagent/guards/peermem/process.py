"""The agent's side of the responder apart: start it, give it the gate, hear it, watch it.

Why apart: a responder thread shares its process's fate, and every open in
every marked filesystem waits on it. A stalled agent (the GIL held, a long
pass, memory pressure, a CPU quota, ``SIGSTOP``) would stall them all, gate or
no gate. ``guards/peermem/process_main.py`` answers in a process of its own; the agent
keeps what only it can do (decide, mark, record) and this handle:

- **the gate** is a lease the loop writes (``follow``, at each change and each
  heartbeat: ``guards/peermem/lease.py``); the process wakes on an eventfd. A loop
  that stops renewing leaves the lease to run out: loads wait, other opens go;
- **death, either way.** The agent keeps its own copy of the group (it marks
  through it), so the kernel lets pending opens go only when both are closed:
  - the agent stops: it writes ``STOP_WORD`` and closes its end of the life pipe;
    the process lets everything go and exits;
  - the agent dies (its end closes without the word; issue 52): the process holds
    on, its gate closed, and waits on ``ADOPT_SOCKET`` in the state directory for
    the next agent, which ``adopt``s it (the group, the lease and the eventfd come
    back over ``SCM_RIGHTS``); nobody within the hold's budget, it lets go and exits;
  - the process dies: the reader thread sees its pipe end, closes the agent's
    copy at once (the kernel allows what was pending), and says so; the
    hold's side starts a new group, process and marks on its next pass
    (``guards/peermem/side.py``);
- **what it did** comes back as JSON lines: held opens that ended and notices
  (recorded by the loop as before) and its state (counts, held opens) for
  status.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nodeagent
from nodeagent.guards.peermem.adopt import Adopted, bind_adopt_socket, remove_adopt_socket
from nodeagent.guards.peermem.budget import DescriptorBudget
from nodeagent.guards.peermem.heldfiles import HELD_FILES_MAX, file_key
from nodeagent.guards.peermem.lease import HoldLease
from nodeagent.guards.peermem.reports import BURST_QUIET_S, HoldReport
from nodeagent.host.fanotify import FanotifyGroup

READY_TIMEOUT_S = 15.0  # a Python start under a loaded node; the hold marks nothing before
# Silent this long (its heartbeat is every second) while the agent's reader kept polling: the
# responder is stuck, and every open in a marked filesystem with it. It is killed: the
# kernel lets what it held go, and a new one is started.
STUCK_S = 10.0
STOP_TIMEOUT_S = 2.0  # its held opens let go and its last reports read, else SIGKILL
STOP_WORD = b"s"  # written to the life pipe before its end closes: a stop, not a death
COUNT_KEYS = (
    "allowed",
    "held",
    "incapable",
    "unidentified",
    "overflow",
    "no_fd",
    "over_cap",
    "faults",
)


def exit_words(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


class ResponderProcess:
    """The responder apart, as the hold's side sees a responder (``responder.Responder``'s
    reading face: ``counts``, ``reports``, ``notices``, ``held``, ``alive``, ``follow``,
    ``wake``, ``stop``)."""

    def __init__(
        self,
        group: FanotifyGroup,
        *,
        budget_s: float,
        descriptors: DescriptorBudget | None,
        on_report: Callable[[], None] = lambda: None,
        proc: str = "/proc",
        burst_quiet_s: float = BURST_QUIET_S,
        python: str = sys.executable,
        ready_timeout_s: float = READY_TIMEOUT_S,
        ignore_marks: str = "auto",
        adopt_dir: str | None = None,
    ) -> None:
        """``on_report``: called from the reader thread (a pipe write: it must not block)
        when a report or a notice arrives, and when the process dies. ``ignore_marks``:
        ``auto`` (what the kernel supports), ``evictable``, ``pinned`` or ``off``
        (``host/fanotify.IgnoreMarks``; a test forces the fallbacks). ``adopt_dir``: the
        state directory, where the process waits to be adopted if this agent dies without
        a stop (``ADOPT_SOCKET``; None: it lets go at the agent's death)."""
        self.ignore_marks = ignore_marks
        self.adopt_dir = adopt_dir
        self.adopted_from: dict[str, Any] | None = None  # what it said when adopted
        self.group = group
        self.budget_s = budget_s
        self.descriptors: DescriptorBudget | None = descriptors
        self.on_report = on_report
        self.proc = proc
        self.burst_quiet_s = burst_quiet_s
        self.python = python
        self.ready_timeout_s = ready_timeout_s
        self.reports: collections.deque[HoldReport] = collections.deque(maxlen=1024)
        self.notices: collections.deque[dict[str, Any]] = collections.deque(maxlen=256)
        self.reported = 0
        self.died: str | None = None  # how the process ended, if it did while it mattered
        self.stuck = False  # killed by the agent for its silence
        self.stuck_s = STUCK_S
        self.beats = 0  # fixed-size heartbeats read (apart from its state)
        self.reports_lost = 0  # reports pushed out unread (the loop did not drain for long)
        self.pid: int | None = None
        self._counts: dict[str, int] = dict.fromkeys(COUNT_KEYS, 0)
        self._state: dict[str, Any] = {}
        self._held_files: list[Any] = []  # as it last said (parsed strictly by the side)
        self._state_at = 0.0
        self._lock = threading.Lock()
        self._stopping = False
        self._aborted = False  # abort(): the agent stopped while it started
        self._ready = False  # start() saw it answer, and no abort before
        self._popen: subprocess.Popen[bytes] | Adopted | None = None
        self._lease: HoldLease | None = None
        self._wake_fd = -1
        self._life_w = -1
        self._out_r = -1
        self._buf = bytearray()
        self._reader: threading.Thread | None = None

    # -- start ----------------------------------------------------------------------

    def start(self) -> None:
        """Start the process and wait until it answers (before anything is marked);
        OSError when it does not."""
        descriptors = self.descriptors
        assert descriptors is not None  # given at construction
        self._lease = HoldLease()
        self._wake_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        life_r, self._life_w = os.pipe2(os.O_CLOEXEC)
        self._out_r, out_w = os.pipe2(os.O_CLOEXEC)
        fds = {
            "group": self.group.fileno(),
            "lease": self._lease.fileno(),
            "wake": self._wake_fd,
            "life": life_r,
            "out": out_w,
        }
        listener = None
        if self.adopt_dir is not None:
            try:
                listener = bind_adopt_socket(self.adopt_dir)
                fds["adopt"] = listener.fileno()
            except OSError as exc:  # held loads go with this agent, as before: said
                self.notices.append(
                    {
                        "kind": "hold-not-adoptable",
                        "error": str(exc)[:200],
                        "meaning": "the responder cannot wait to be adopted: if this agent "
                        "dies while its pod lives, what it holds goes on at once",
                    }
                )
                self.reported += 1
        passed = tuple(fds.values())  # the only descriptors it inherits
        spec: dict[str, object] = {
            **fds,
            "agent_pid": os.getpid(),
            "budget_s": self.budget_s,
            "held_total": descriptors.held_total,
            "held_per_container": descriptors.held_per_container,
            "burst_quiet_s": self.burst_quiet_s,
            "proc": self.proc,
            "ignore": self.ignore_marks,
        }
        # Its own small environment: where this package is, nothing else inherited.
        env = {
            "PYTHONPATH": str(Path(nodeagent.__file__).resolve().parent.parent),
            "PYTHONDONTWRITEBYTECODE": "1",
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
        }
        try:
            self._popen = subprocess.Popen(
                [self.python, "-m", "nodeagent.guards.peermem.process_main", json.dumps(spec)],
                pass_fds=passed,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # a terminal's Ctrl-C is the agent's to handle
            )
        except OSError:
            self._close_fds()  # (the lease, the eventfd, our pipe ends: nothing left open)
            raise
        finally:
            os.close(life_r)
            os.close(out_w)
            if listener is not None:
                listener.close()  # (its copy is the process's)
        self.pid = self._popen.pid
        try:
            self._wait_ready()
            with self._lock:  # an abort now or later: not killed here, stopped by its caller
                if self._aborted:
                    raise OSError("the agent stopped while the responder process started")
                self._ready = True
        except OSError:
            self._kill()
            self._close_fds()
            raise
        self._reader = threading.Thread(
            target=self._read_loop, name="hold-responder-reader", daemon=True
        )
        self._reader.start()

    def _adopted(
        self,
        pid: int,
        lease: HoldLease,
        wake_fd: int,
        life_w: int,
        out_r: int,
        reply: dict[str, Any],
    ) -> None:
        """A responder left by a dead agent, now this one's (``adopt``): its reader starts."""
        self._popen = Adopted(pid)
        self.pid = pid
        self._lease, self._wake_fd, self._life_w, self._out_r = lease, wake_fd, life_w, out_r
        self.adopted_from = reply
        with self._lock:  # what it holds, as it said (its state follows on the pipe)
            self._state = {"held_count": reply.get("held_count", 0), "held": reply.get("held", [])}
            self._state_at = time.monotonic()
        self._ready = True
        self._reader = threading.Thread(
            target=self._read_loop, name="hold-responder-reader", daemon=True
        )
        self._reader.start()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        poller = select.poll()
        poller.register(self._out_r, select.POLLIN)
        while True:
            if self._aborted:  # (killed by abort, or about to be: its pipe ends then)
                raise OSError("the agent stopped while the responder process started")
            left = deadline - time.monotonic()
            if left <= 0:
                raise OSError(f"the responder process did not answer in {self.ready_timeout_s:g}s")
            ready: list[tuple[int, int]] = []
            with contextlib.suppress(InterruptedError):
                ready = poller.poll(int(left * 1000) + 1)
            if not ready:
                continue  # (its pipe blocks: a read now would wait past the deadline)
            chunk = self._read_chunk()
            if chunk is None:
                rc = self._popen.wait(STOP_TIMEOUT_S) if self._popen else None
                raise OSError(f"the responder process {exit_words(rc)} before it answered")
            for msg in self._lines(chunk):
                if msg.get("t") == "ready":
                    return
                self._take(msg)

    def abort(self) -> None:
        """From another thread, while ``start`` waits for it to answer: kill it, so that
        ``start`` sees its pipe end, closes what it opened and raises. Once ``start`` saw it
        answer, nothing: its caller stops it (``stop``)."""
        with self._lock:
            self._aborted = True
            popen = None if self._ready else self._popen
        if popen is not None:
            with contextlib.suppress(OSError):
                popen.kill()  # (nothing once reaped)

    # -- the loop's side ----------------------------------------------------------------

    def follow(self, is_open: bool, verdicts: Any = None, judge_all: bool = False) -> None:
        """The gate now (a fresh lease, or closed) and the held files' verdicts; a wake."""
        if self._lease is not None and self._lease.fd >= 0:
            self._lease.write(is_open, verdicts=verdicts, judge_all=judge_all)
        self.wake()

    def held_files(self) -> list[dict[str, Any]]:
        """What the responder last said of the files it holds (``heldfiles.py``'s form)."""
        with self._lock:
            return list(self._held_files)

    def wake(self) -> None:
        if self._wake_fd >= 0:
            with contextlib.suppress(OSError):
                os.eventfd_write(self._wake_fd, 1)

    @property
    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    @property
    def peak_descriptors(self) -> int:
        with self._lock:
            return int(self._state.get("peak", 0))

    def descriptors_in_use(self) -> int:
        """The process's descriptors as it last said (held opens keep one each)."""
        with self._lock:
            return int(self._state.get("fds", -1))

    def ignore_status(self) -> dict[str, Any] | None:
        """Its ignore marks as it last said: mode, how many, files seen that could be
        modules (never ignored)."""
        with self._lock:
            got = self._state.get("ignore")
            return dict(got) if isinstance(got, dict) else None

    def held(self) -> list[tuple[int, str, str, float]]:
        """The held opens the responder listed (at most its ``HELD_LISTED``; paths cut)."""
        with self._lock:
            since = time.monotonic() - self._state_at
            return [(p, o, f, s + since) for p, o, f, s in self._state.get("held", [])]

    def held_count(self) -> int:
        """How many opens it holds (exact, however many it listed)."""
        with self._lock:
            got = self._state.get("held_count")
            return int(got) if isinstance(got, int) else len(self._state.get("held", []))

    def alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None and self.died is None

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Close the life pipe (it lets every held open go and says so), read its last
        words, then close the agent's copy of the group: the kernel allows the rest."""
        self._stopping = True
        if self._life_w >= 0:
            with contextlib.suppress(OSError):  # a stop, not a death: it lets go and exits
                os.write(self._life_w, STOP_WORD)
            os.close(self._life_w)
            self._life_w = -1
        if self._popen is not None:
            try:
                self._popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self._kill()
        if self._reader is not None:
            self._reader.join(timeout)
        self.group.close()
        self._close_fds()
        if self.adopt_dir is not None:
            with contextlib.suppress(OSError):
                remove_adopt_socket(self.adopt_dir)

    # -- the reader thread ----------------------------------------------------------

    def _read_loop(self) -> None:
        poller = select.poll()
        poller.register(self._out_r, select.POLLIN)
        heard = time.monotonic()
        while True:
            ready: list[tuple[int, int]] = []
            with contextlib.suppress(InterruptedError):
                ready = poller.poll(1000)
            if not ready:
                # Nothing waiting in the pipe: had the agent itself been stalled, the
                # responder's heartbeats would be there now. So silence is the responder's.
                silent = time.monotonic() - heard >= self.stuck_s
                if silent and not self._stopping and not poller.poll(0):  # (GIL-starved: no)
                    self.stuck = True
                    self._kill()
                continue
            heard = time.monotonic()
            chunk = self._read_chunk()
            if chunk is None:
                break
            # Never dies of a message: a dead reader would not see the process die, and the
            # agent's copy of the group would keep its pending opens waiting.
            told = False
            for msg in self._lines(chunk):
                try:
                    told = self._take(msg) or told
                except Exception:  # a malformed message is dropped
                    continue
            if told:
                with contextlib.suppress(Exception):
                    self.on_report()
        rc = None
        if self._popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                rc = self._popen.wait(STOP_TIMEOUT_S)
        if not self._stopping:
            self._died(rc)

    def _died(self, rc: int | None) -> None:
        """The process went while the hold was on: let everything pending go now (the
        agent's copy of the group is the last), and say so."""
        self.group.close()
        self.died = exit_words(rc) if not isinstance(self._popen, Adopted) else Adopted.ENDED
        if self.stuck:
            self.died = f"was silent for {self.stuck_s:g}s (stuck) and was {self.died}"
        self.notices.append(
            {
                "kind": "hold-responder-died",
                "pid": self.pid,
                "how": self.died,
                "stuck": self.stuck,
                "meaning": "the hold's responder process ended while the hold was on: the "
                "agent closed its copy of the group, so the kernel let every pending open go "
                "(a held load of nvidia-peermem may have gone on with the gate closed); "
                "the agent starts a new responder and marks again",
            }
        )
        self.reported += 1
        self.on_report()

    def _read_chunk(self) -> bytes | None:
        """What the pipe has (b"" for nothing yet), None at its end."""
        try:
            data = os.read(self._out_r, 1 << 16)
        except BlockingIOError:
            return b""
        except InterruptedError:
            return b""
        except OSError:
            return None
        return data if data else None

    def _lines(self, chunk: bytes) -> list[dict[str, Any]]:
        self._buf += chunk
        *whole, rest = self._buf.split(b"\n")
        self._buf = bytearray(rest)
        out: list[dict[str, Any]] = []
        for line in whole:
            with contextlib.suppress(ValueError):
                msg = json.loads(line)
                if isinstance(msg, dict):
                    out.append(msg)
        return out

    def _take(self, msg: dict[str, Any]) -> bool:
        """One message; True when the loop should record something."""
        kind = msg.get("t")
        if kind == "report":
            with contextlib.suppress(TypeError):
                report = HoldReport.from_message(msg, file_key(msg.get("file")))
                if len(self.reports) == self.reports.maxlen:
                    self.reports_lost += 1  # the oldest goes: counted, said in one record
                self.reports.append(report)
                self.reported += 1
                return True
        elif kind == "notice" and isinstance(msg.get("notice"), dict):
            self.notices.append(msg["notice"])
            self.reported += 1
            return True
        elif kind == "held-files" and isinstance(msg.get("files"), list):
            with self._lock:
                self._held_files = msg["files"][:HELD_FILES_MAX]
            return True  # a pass: the gate judges them now
        elif kind == "beat":
            self.beats += 1  # (its arrival is what the reader counts as a sign of life)
        elif kind == "state":
            with self._lock:
                before = self._state.get("held_count")
                self._state, self._state_at = msg, time.monotonic()
                counts = msg.get("counts")
                if isinstance(counts, dict):
                    self._counts.update({k: int(v) for k, v in counts.items() if k in COUNT_KEYS})
            # A load newly held (or let go): a pass, so status says it now, not at the resync.
            return msg.get("held_count") != before
        return False

    # -- the end --------------------------------------------------------------------

    def _kill(self) -> None:
        if self._popen is not None and self._popen.poll() is None:
            with contextlib.suppress(OSError):
                self._popen.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(STOP_TIMEOUT_S)

    def _close_fds(self) -> None:
        if self._lease is not None:
            self._lease.close()
        if isinstance(self._popen, Adopted):
            self._popen.close()
        for name in ("_wake_fd", "_life_w", "_out_r"):
            fd = getattr(self, name)
            if fd >= 0:
                setattr(self, name, -1)
                with contextlib.suppress(OSError):
                    os.close(fd)
