"""``nodeagent supervise ARGS...``: the container's first process, so an agent crash is not a
pod death (issue 52).

It runs ``python -m nodeagent ARGS...`` (the agent: ``supervise run --config ...``) and
does three things only:

- **it reaps.** It is the subreaper of everything under it (``PR_SET_CHILD_SUBREAPER``):
  the hold's responder, left behind by an agent that died (``guards/peermem/process_main.py``),
  is reparented here, not to the host's init (the pod runs with ``hostPID``: the
  container has no init of its own), so it stays in the pod and is reaped when it ends;
- **it restarts an agent that died otherwise than asked** (killed, an uncaught error,
  an OOM kill of the agent alone), after ``RESTART_FIRST_S`` doubling to
  ``RESTART_MAX_S`` (back to the first once an agent ran ``STEADY_S``). The new agent
  adopts the responder left behind (``guards/peermem/start.adopt``): what it held stays
  held. An agent that exits 0 (stopped) or 2 (a usage or config error: a restart would
  fail the same way) ends the supervisor with its code, as the agent alone would;
- **it forwards SIGTERM, SIGINT and SIGHUP to the agent** and exits with the agent's
  code once the agent ended after one (the agent's own stop, with its drain, decides
  what a held load does). A signal that finds no agent (between two) ends it at once.
  Before it exits, each process still under it (a responder no agent adopted) is sent
  SIGTERM: a stop lets held loads go, as a stop of the agent alone always did.

It imports nothing of the agent's, opens no file but ``/proc/<pid>/stat`` (its
children, at exit) and keeps no state: small enough not to be the thing that dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

PR_SET_CHILD_SUBREAPER = 36
RESTART_FIRST_S = 1.0
RESTART_MAX_S = 30.0
STEADY_S = 60.0  # an agent that ran this long had a good start: the next delay is the first
FINAL_CODES = (0, 2)  # stopped, or a usage error: not a crash, never restarted
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
LEFT_WAIT_S = 5.0  # at exit, how long what is left under it may take to end after SIGTERM


def say(text: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, f"nodeagent supervise: {text}\n".encode())


def set_subreaper() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0


def ended_words(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(sig).name}"
        return f"was killed by signal {sig}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"


class Supervisor:
    def __init__(self, agent: Sequence[str]) -> None:
        self.agent_argv = list(agent)
        self.agent: subprocess.Popen[bytes] | None = None
        self.asked: int | None = None  # the first stop signal received
        self.restarts = 0
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.asked = self.asked or signum
        agent = self.agent
        if agent is not None and agent.returncode is None:
            with contextlib.suppress(OSError):
                os.kill(agent.pid, signum)
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"s")

    def _start(self) -> float:
        self.agent = subprocess.Popen(self.agent_argv, stdin=subprocess.DEVNULL)
        if self.asked is not None:  # a signal between two agents' starts: it is this one's
            with contextlib.suppress(OSError):
                os.kill(self.agent.pid, self.asked)
        return time.monotonic()

    def _pause(self, seconds: float) -> bool:
        """Wait before a restart; False when a stop signal came meanwhile."""
        deadline = time.monotonic() + seconds
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        while self.asked is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            with contextlib.suppress(InterruptedError):
                poller.poll(int(left * 1000) + 1)
            self._reap_orphans()
        return False

    def _reap_orphans(self) -> None:
        """Between two agents: reap what ended under it (never blocks)."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            say(f"reaped process {pid}, which its agent had left ({ended_words(status)})")

    def run(self) -> int:
        if not set_subreaper():
            say("PR_SET_CHILD_SUBREAPER refused: a responder its agent leaves goes to init")
        for sig in FORWARDED:
            signal.signal(sig, self._on_signal)
        delay = RESTART_FIRST_S
        started = self._start()
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:  # (never: the agent is ours until reaped)
                return 1
            agent = self.agent
            if agent is None or pid != agent.pid:
                say(f"reaped process {pid}, which its agent had left ({ended_words(status)})")
                continue
            agent.returncode = os.waitstatus_to_exitcode(status)
            code = agent.returncode if agent.returncode >= 0 else 128 - agent.returncode
            if self.asked is not None:
                self._end_the_rest()
                return code
            if agent.returncode in FINAL_CODES:
                say(f"the agent {ended_words(status)}: done")
                self._end_the_rest()
                return code
            if time.monotonic() - started >= STEADY_S:
                delay = RESTART_FIRST_S
            self.restarts += 1
            say(
                f"the agent {ended_words(status)}; starting it again in {delay:g}s "
                f"(restart {self.restarts}; a responder it left keeps holding until adopted)"
            )
            if not self._pause(delay):
                self._end_the_rest()
                return 128 + (self.asked or 0)
            delay = min(delay * 2, RESTART_MAX_S)
            started = self._start()

    def _end_the_rest(self) -> None:
        """SIGTERM to each process still under it, then reap them (bounded)."""
        left = children(os.getpid())
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + LEFT_WAIT_S
        while left and time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                time.sleep(0.05)  # (bounded by LEFT_WAIT_S; at exit only)
                continue
            left = [p for p in left if p != pid]


def children(parent: int, proc: str = "/proc") -> list[int]:
    """Pids whose parent is ``parent`` (each ``stat`` read once, bounded)."""
    out: list[int] = []
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            fd = os.open(f"{proc}/{name}/stat", os.O_RDONLY | os.O_CLOEXEC)
            try:
                raw = os.read(fd, 4096)
            finally:
                os.close(fd)
        except OSError:
            continue
        fields = raw[raw.rfind(b")") + 2 :].split()  # after the command, which may hold spaces
        if len(fields) > 1 and fields[1] == str(parent).encode():
            out.append(int(name))
    return out


def supervise_main(args: Sequence[str]) -> int:
    if not args or args[0] in ("-h", "--help"):
        usage = "usage: nodeagent supervise ARGS... (runs and restarts `nodeagent ARGS...`)"
        print(usage, file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    return Supervisor([sys.executable, "-m", "nodeagent", *args]).run()
