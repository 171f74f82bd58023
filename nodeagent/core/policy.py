"""Validation of config values, shared by the config loader and each guard's policy parser.

Pure: a bad value is a NodeagentError naming the key and the value, in one line.
Each guard parses its own ``[<guard>]`` table with these (see core/registry.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from nodeagent.core.names import validate_module_name
from nodeagent.errors import NodeagentError


def check_relpath(key: str, value: Any) -> str:
    """A path relative to the host root, without '..'."""
    if not isinstance(value, str) or not value:
        raise NodeagentError(f"config {key}: expected a non-empty path, got {value!r}")
    if value.startswith("/") or ".." in value.split("/") or "\0" in value:
        raise NodeagentError(
            f"config {key}: {value!r} must be relative to the host root, without '..'"
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
