"""Carry out guard actions on the node. The only place a module is loaded or removed.

Transient errors (EAGAIN, EINTR, and EBUSY on removal while a reference is
being dropped) are retried a few times within the action, with tenacity;
anything else is returned to the guard, whose own backoff decides when to try
again on a later pass, so a bad module is never retried in a tight loop.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

from tenacity import (
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from nodeagent.core.actions import Action, ActionOutcome, LoadModuleFile, UnloadModule
from nodeagent.errors import NodeagentError
from nodeagent.host.fs import HostRoot
from nodeagent.host.kmod import ModuleOpError, ModuleOps

KernelLog = Callable[[str], list[str]]
_TRANSIENT = {errno.EAGAIN, errno.EINTR}


def _transient(op: str) -> Callable[[BaseException], bool]:
    def check(exc: BaseException) -> bool:
        if not isinstance(exc, ModuleOpError):
            return False
        return exc.errno in _TRANSIENT or (op == "unload" and exc.errno == errno.EBUSY)

    return check


class Actuator:
    def __init__(
        self,
        host: HostRoot,
        ops: ModuleOps,
        kernel_log: KernelLog,
        attempts: int = 3,
        first_wait_s: float = 0.05,
        verified_fd: Callable[[str], int | None] | None = None,
    ) -> None:
        """``verified_fd(path)``: the descriptor the observer read and checked ``path`` from;
        a load uses it, never a second lookup. Without it (tools, tests) the file is
        opened once, inside the host root, and loaded by that descriptor."""
        self.verified_fd = verified_fd
        self.host = host
        self.ops = ops
        self.kernel_log = kernel_log
        self.attempts = attempts
        self.first_wait_s = first_wait_s

    def _retrying(self, op: str) -> Retrying:
        return Retrying(
            retry=retry_if_exception(_transient(op)),
            stop=stop_after_attempt(self.attempts),
            wait=wait_exponential(multiplier=self.first_wait_s, max=1.0),
            reraise=True,
        )

    def _load(self, action: LoadModuleFile) -> None:
        if self.verified_fd is not None:
            fd = self.verified_fd(action.path)
            if fd is None:
                raise NodeagentError(
                    f"{action.path} changed or was not read cleanly since the gate checked it; "
                    "it is checked again on the next pass"
                )
            self._insert(fd, action)
            return
        fd, _st = self.host.open_regular(action.path, follow=True)
        try:
            self._insert(fd, action)
        finally:
            os.close(fd)

    def _insert(self, fd: int, action: LoadModuleFile) -> None:
        for attempt in self._retrying("load"):
            with attempt:
                self.ops.insert_fd(fd, action.module, action.params)

    def perform(self, action: Action) -> ActionOutcome:
        try:
            if isinstance(action, LoadModuleFile):
                self._load(action)
            elif isinstance(action, UnloadModule):
                for attempt in self._retrying("unload"):
                    with attempt:
                        self.ops.remove(action.module)
            else:  # pragma: no cover - the Action union is closed
                raise TypeError(f"unknown action {action!r}")
        except (NodeagentError, OSError) as exc:  # a path or name refused before any syscall
            return ActionOutcome(action=action, ok=False, error=f"{action.describe()}: {exc}")
        except ModuleOpError as exc:
            messages: tuple[str, ...] = ()
            if isinstance(action, LoadModuleFile):
                messages = tuple(self.kernel_log(action.module))
            return ActionOutcome(
                action=action,
                ok=False,
                errno=exc.errno,
                error=str(exc),
                kernel_messages=messages,
            )
        return ActionOutcome(action=action, ok=True)


def kmsg_reader(path: str = "/dev/kmsg", keep: int = 8) -> KernelLog:
    """Recent kernel log lines about a module (``<module>: ...``), read from /dev/kmsg."""

    def messages(module: str) -> list[str]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return []
        found: list[str] = []
        prefix = f"{module}:"
        try:
            for _ in range(100_000):  # bounded: the ring buffer holds far fewer records
                try:
                    record = os.read(fd, 8192)
                except BlockingIOError:
                    break
                except OSError as exc:
                    if exc.errno == errno.EPIPE:  # record overwritten while reading: skip it
                        continue
                    break
                if not record:
                    break
                text = record.decode("utf-8", errors="replace")
                message = text.split(";", 1)[-1].split("\n", 1)[0]
                if message.startswith(prefix):
                    found.append(message)
        finally:
            os.close(fd)
        return found[-keep:]

    return messages
