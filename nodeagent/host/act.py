"""Carry out guard plans on the node. The only place a module is loaded or a file written.

Each action type has one handler, found in one table built from the shared
``EXECUTORS`` (modules: libkmod/insmod; files: atomic writes under the host
root) and those a guard's host side brings for actions of its own kinds (the
VF guard's netlink: ``guards/sriov/``). How a plan runs (its strategy,
its timeouts, one worker per guard) is ``loop/workers.py``; this performs one
action.

Transient errors (EAGAIN, EINTR, and EBUSY on removal while a reference is
being dropped) are retried a few times within the action, with tenacity;
anything else is returned to the guard, whose own backoff decides when to try
again on a later pass, so a bad module is never retried in a tight loop.
"""

from __future__ import annotations

import errno
import functools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from tenacity import (
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from nodeagent.core.actions import (
    Action,
    ActionOutcome,
    LoadModule,
    LoadModuleFile,
    RemoveFile,
    UnloadModule,
    WriteFile,
)
from nodeagent.core.identity import chain_refusals
from nodeagent.core.snapshot import DiskModule, LoadedModule
from nodeagent.errors import NodeagentError, StepFailed
from nodeagent.host.fs import HostRoot
from nodeagent.host.kmod import ModuleOpError, ModuleOps, PlansProbes
from nodeagent.host.ports import KernelLog

# Performs one action; raises StepFailed, OSError, NodeagentError. It may return per-field
# results, (field, "written" | "unsupported" | ...), for an action that sets several fields.
Handler = Callable[[Any], tuple[tuple[str, str], ...] | None]
# (tree, the modules an insert adds in order, the trees) -> (their files in that tree, the
# loaded modules they depend on with the file that is the loaded one).
ChainFacts = Callable[
    [str, Sequence[str], tuple[str, ...]],
    tuple[list[DiskModule], dict[str, tuple[LoadedModule, DiskModule]]],
]
_TRANSIENT = {errno.EAGAIN, errno.EINTR}


@dataclass(frozen=True)
class NodeHands:
    """What executors act through."""

    host: HostRoot
    ops: ModuleOps
    kernel_log: KernelLog
    attempts: int = 3
    first_wait_s: float = 0.05
    # The descriptor the observer read and checked a .ko from (None: not verified now).
    verified_fd: Callable[[str], int | None] | None = None
    # What a load by name would insert, read for the CRC check before it (None: no check:
    # the kernel decides). ``Observer.chain_facts``, on an observer of the executor's own.
    chain_facts: ChainFacts | None = None


class Executor(Protocol):
    def handlers(self) -> Mapping[type, Handler]: ...


def _transient(op: str) -> Callable[[BaseException], bool]:
    def check(exc: BaseException) -> bool:
        if not isinstance(exc, ModuleOpError):
            return False
        return exc.errno in _TRANSIENT or (op == "unload" and exc.errno == errno.EBUSY)

    return check


class ModuleExecutor:
    """Module loads and removals, through ``ModuleOps`` (libkmod, or the simulator)."""

    def __init__(self, hands: NodeHands) -> None:
        self.hands = hands

    def handlers(self) -> Mapping[type, Handler]:
        return {
            LoadModuleFile: self.load_file,
            LoadModule: self.load,
            UnloadModule: self.unload,
        }

    def _retrying(self, op: str) -> Retrying:
        return Retrying(
            retry=retry_if_exception(_transient(op)),
            stop=stop_after_attempt(self.hands.attempts),
            wait=wait_exponential(multiplier=self.hands.first_wait_s, max=1.0),
            reraise=True,
        )

    def _run(self, op: str, module: str, call: Callable[[], None], log_kernel: bool) -> None:
        try:
            for attempt in self._retrying(op):
                with attempt:
                    call()
        except ModuleOpError as exc:
            messages = tuple(self.hands.kernel_log(module)) if log_kernel else ()
            raise StepFailed(str(exc), exc.errno, messages) from None

    def load_file(self, action: LoadModuleFile) -> None:
        """finit_module on the descriptor the gate verified: no second lookup by path.

        Without an observer (tools, tests) the file is opened once, inside the
        host root, and loaded by that descriptor.
        """
        if self.hands.verified_fd is not None:
            fd = self.hands.verified_fd(action.path)
            if fd is None:
                raise NodeagentError(
                    f"{action.path} changed or was not read cleanly since the gate checked it; "
                    "it is checked again on the next pass"
                )
            self._insert(fd, action)
            return
        fd, _st = self.hands.host.open_regular(action.path, follow=True)
        try:
            self._insert(fd, action)
        finally:
            os.close(fd)

    def _insert(self, fd: int, action: LoadModuleFile) -> None:
        insert = functools.partial(self.hands.ops.insert_fd, fd, action.module, action.params)
        self._run("load", action.module, insert, True)

    def load(self, action: LoadModule) -> None:
        """From the first tree whose modules.dep lists the module (ENOENT: try the next).

        Checked first, the way the peermem gate checks its module: libkmod's dry run
        says what the insert would add, and each of those files' symbol CRCs are
        compared with its providers' (``identity.chain_refusals``). A chain the kernel
        would refuse in part is not inserted at all (``StepFailed``, EINVAL, detail
        ``refused: crcs``): a module built against another stack (the host's
        ``rpcrdma`` against the inbox ``ib_core`` while MOFED's is loaded) never goes
        in, and nothing of its chain before it."""
        kernel = self.hands.host.read_text("proc/sys/kernel/osrelease", 256).strip()
        for i, tree in enumerate(action.trees):
            rel = f"{tree}/lib/modules/{kernel}" if tree else f"lib/modules/{kernel}"
            moddir = str(self.hands.host.path(rel))
            try:
                self._check_chain(action, tree, moddir)
                probe = functools.partial(self.hands.ops.probe, action.module, moddir)
                self._run("load", action.module, probe, True)
                return
            except StepFailed as exc:
                if exc.errno != errno.ENOENT or i == len(action.trees) - 1:
                    raise

    def _check_chain(self, action: LoadModule, tree: str, moddir: str) -> None:
        ops, facts = self.hands.ops, self.hands.chain_facts
        if facts is None or not isinstance(ops, PlansProbes):
            return
        try:
            plan = ops.probe_plan(action.module, moddir)
        except ModuleOpError as exc:  # ENOENT: not in this tree (the caller tries the next)
            raise StepFailed(str(exc), exc.errno) from None
        planned, loaded = facts(tree, [name for name, _opts in plan], action.trees)
        refusals = chain_refusals(planned, loaded)
        if refusals:
            where = f"/{tree}" if tree else "the host's tree"
            raise StepFailed(
                f"{action.module} not loaded from {where}: the kernel would refuse it: "
                + "; ".join(refusals),
                errno.EINVAL,
                detail=(("refused", "crcs"),),
            )

    def unload(self, action: UnloadModule) -> tuple[tuple[str, str], ...] | None:
        """Unload; a module already gone (ENOENT) has had its unload: done, not failed.
        (An agent killed mid-removal, restarted, finds what its last call took away.)"""
        try:
            self._run("unload", action.module, lambda: self.hands.ops.remove(action.module), False)
        except StepFailed as exc:
            if exc.errno != errno.ENOENT:
                raise
            return (("module", "already unloaded"),)
        return None


class FileExecutor:
    """Files under the host root: atomic writes and removals, never through a symlink."""

    def __init__(self, hands: NodeHands) -> None:
        self.host = hands.host

    def handlers(self) -> Mapping[type, Handler]:
        return {WriteFile: self.write, RemoveFile: self.remove}

    def write(self, action: WriteFile) -> None:
        self.host.write_atomic(action.path, action.content.encode())

    def remove(self, action: RemoveFile) -> None:
        self.host.remove(action.path)


# The executors every guard shares; a guard with actions of its own kinds brings their
# executor in its host side (guards/side.py), and the wiring adds it to these.
EXECUTORS: tuple[Callable[[NodeHands], Executor], ...] = (ModuleExecutor, FileExecutor)


class Actuator:
    def __init__(
        self,
        host: HostRoot,
        ops: ModuleOps,
        kernel_log: KernelLog,
        attempts: int = 3,
        first_wait_s: float = 0.05,
        executors: Sequence[Callable[[NodeHands], Executor]] = EXECUTORS,
        verified_fd: Callable[[str], int | None] | None = None,
        clock: Callable[[], float] = time.time,
        chain_facts: ChainFacts | None = None,
    ) -> None:
        """``verified_fd(path)``: the descriptor the observer read ``path`` from (loads use it);
        ``chain_facts``: what the CRC check before a load by name reads (None: no check)."""
        hands = NodeHands(
            host,
            ops,
            kernel_log,
            attempts,
            first_wait_s,
            verified_fd=verified_fd,
            chain_facts=chain_facts,
        )
        self.clock = clock
        self.table: dict[type, Handler] = {}
        for make in executors:
            for kind, handler in make(hands).handlers().items():
                if kind in self.table:
                    raise ValueError(f"two executors handle {kind.__name__}")
                self.table[kind] = handler

    def perform(self, action: Action) -> ActionOutcome:
        """Run one action; its outcome is stamped with when it ended and how long it took."""
        began = self.clock()
        outcome = self._perform(action)
        done = self.clock()
        return replace(outcome, finished_at=done, seconds=max(0.0, done - began))

    def _perform(self, action: Action) -> ActionOutcome:
        handler = self.table.get(type(action))
        if handler is None:
            return ActionOutcome(
                action=action, ok=False, error=f"{action.describe()}: no executor for this action"
            )
        try:
            detail = handler(action)
        except StepFailed as exc:
            return ActionOutcome(
                action=action,
                ok=False,
                errno=exc.errno,
                error=exc.error,
                kernel_messages=exc.kernel_messages,
                detail=exc.detail,
            )
        except (NodeagentError, OSError) as exc:  # a path or name refused, a write failed
            err = exc.errno if isinstance(exc, OSError) else None
            return ActionOutcome(
                action=action, ok=False, errno=err, error=f"{action.describe()}: {exc}"
            )
        return ActionOutcome(action=action, ok=True, detail=detail or ())


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
