"""Validation of strings: module names and parameters, and decimal numbers.

The agent runs privileged on every GPU node; anything that names a module or
carries a parameter is checked here before it can reach libkmod or an argv,
and text read from the node or given by a user becomes a number only through
``is_decimal``.
"""

from __future__ import annotations

import re

from nodeagent.errors import NodeagentError

# MODULE_NAME_LEN is 64 - sizeof(unsigned long) = 56 on 64-bit, NUL included.
_MODULE_NAME = re.compile(r"[A-Za-z0-9_-]{1,55}")
# key or key=value; values may hold commas/dots/colons (lists, addresses) but
# no whitespace, quotes, shell metacharacters or control characters.
_MODULE_PARAM = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}(=[A-Za-z0-9_.,:/+@%-]{0,255})?")


def is_decimal(text: str) -> bool:
    """ASCII digits only: ``"²".isdigit()`` is True, and ``int("²")`` raises."""
    return text.isascii() and text.isdigit()


def normalize_module_name(name: str) -> str:
    """The kernel's spelling: '-' and '_' are the same in module names."""
    return name.replace("-", "_")


def is_module_name(name: object) -> bool:
    """Could the kernel have a module of this name (e.g. a /sys/module entry)?"""
    return isinstance(name, str) and _MODULE_NAME.fullmatch(name) is not None


def validate_module_name(name: str) -> str:
    """Return the normalized name, or raise NodeagentError naming the bad value."""
    if not is_module_name(name):
        raise NodeagentError(
            f"invalid kernel module name {name!r}: expected 1-55 characters of [A-Za-z0-9_-]"
        )
    return normalize_module_name(name)


def validate_module_param(param: str) -> str:
    """Return the parameter unchanged, or raise NodeagentError naming it."""
    if not isinstance(param, str) or not _MODULE_PARAM.fullmatch(param):
        raise NodeagentError(
            f"invalid module parameter {param!r}: expected key or key=value "
            "without spaces, quotes or shell characters"
        )
    return param
