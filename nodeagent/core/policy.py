"""Validation of config values, shared by the config loader and each guard's policy parser.

Pure: a bad value is a NodeagentError naming the key and the value, in one line.
Each guard parses its own ``[<guard>]`` table with these (see guards/registry.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from nodeagent.core.names import validate_module_name
from nodeagent.errors import NodeagentError

PATH_MAX_BYTES = 1024
NAME_MAX_BYTES = 255  # one component, as the kernel allows


def check_relpath(key: str, value: Any) -> str:
    """A path relative to the host root: plain components only (no '..', '.', empty or
    blank ones, no control characters), each at most 255 bytes."""
    if not isinstance(value, str) or not value:
        raise NodeagentError(f"config {key}: expected a non-empty path, got {value!r}")
    shown = repr(value[:80])
    if value.startswith("/") or ".." in value.split("/"):
        raise NodeagentError(
            f"config {key}: {shown} must be relative to the host root, without '..'"
        )
    if not value.isprintable():
        raise NodeagentError(f"config {key}: {shown} has a control character")
    if len(value.encode()) > PATH_MAX_BYTES:
        raise NodeagentError(f"config {key}: longer than {PATH_MAX_BYTES} bytes")
    for part in value.split("/"):
        if part in ("", ".") or not part.strip():
            raise NodeagentError(
                f"config {key}: {shown} has an empty, blank or '.' component; write it as a/b/c"
            )
        if len(part.encode()) > NAME_MAX_BYTES:
            raise NodeagentError(
                f"config {key}: a component longer than {NAME_MAX_BYTES} bytes ({part[:20]!r}...)"
            )
    return value


# The agent writes its own files only in directories of its own: never the kernel's
# pseudo-filesystems nor the driver containers' trees.
NOT_THE_AGENTS = ("proc", "sys", "dev", "run/mellanox/drivers", "run/nvidia", "lib/modules")


def check_own_dir(key: str, value: str) -> str:
    """A directory the agent writes in (``state_dir``, ``timeline_dir``)."""
    for other in NOT_THE_AGENTS:
        if value == other or value.startswith(f"{other}/"):
            raise NodeagentError(
                f"config {key}: {value!r} is inside {other}/, not a directory of the agent's own"
            )
    return value


def number(key: str, value: Any, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise NodeagentError(f"config {key}: expected a number, got {value!r}")
    if not lo <= value <= hi:
        raise NodeagentError(f"config {key}: {value!r} is outside {lo}..{hi}")
    return float(value)


def whole(key: str, value: Any, lo: int, hi: int) -> int:
    """A count (a TOML integer): 1.5 is refused, not truncated."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise NodeagentError(f"config {key}: expected a whole number, got {value!r}")
    if not lo <= value <= hi:
        raise NodeagentError(f"config {key}: {value!r} is outside {lo}..{hi}")
    return value


def boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise NodeagentError(f"config {key}: expected true or false, got {value!r}")
    return value


def choice(key: str, value: Any, allowed: Iterable[str]) -> str:
    options = tuple(allowed)
    if value not in options:
        raise NodeagentError(
            f"config {key}: expected {' or '.join(repr(o) for o in options)}, got {value!r}"
        )
    return str(value)


def reject_unknown(section: str, data: Mapping[str, Any], known: Iterable[str]) -> None:
    known_set = set(known)
    unknown = sorted(set(data) - known_set)
    if unknown:
        where = f"[{section}] " if section else ""
        raise NodeagentError(
            f"config {where}has unknown key {unknown[0]!r} (known: {', '.join(sorted(known_set))})"
        )


def table(section: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise NodeagentError(f"config [{section}] must be a table")
    return value


def module_list(key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise NodeagentError(f"config {key}: expected a non-empty list of module names")
    try:
        return tuple(validate_module_name(v) for v in value)
    except NodeagentError as exc:
        raise NodeagentError(f"config {key}: {exc}") from None
