"""What guards ask the host layer to do, and what came of it.

Actions are plain immutable values; ``nodeagent.host.act`` is the only code
that turns them into kernel or file operations. Every action names the guard
that asked for it and why, so the timeline can show the evidence.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoadModuleFile:
    """Insert exactly this .ko (the one the guard verified), like insmod."""

    guard: str
    module: str
    path: str  # relative to the host root
    params: tuple[str, ...]
    reason: str

    def describe(self) -> str:
        params = " ".join(self.params)
        return f"load {self.module} from {self.path}" + (f" ({params})" if params else "")


@dataclass(frozen=True)
class UnloadModule:
    guard: str
    module: str
    reason: str

    def describe(self) -> str:
        return f"unload {self.module}"


Action = LoadModuleFile | UnloadModule


@dataclass(frozen=True)
class ActionOutcome:
    action: Action
    ok: bool
    errno: int | None = None
    error: str | None = None  # one line, e.g. "Invalid argument (EINVAL)"
    kernel_messages: tuple[str, ...] = ()  # the kernel's own lines about the module
    performed: bool = True  # False in observe mode: decided and recorded, not done
