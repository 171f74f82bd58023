"""Field tables: each guard's ``[<guard>]`` config table and its saved memory, one row a field.

A guard names each field once, with what it must be; the two readers here apply
a table and are the only code that does:

- **Policy** (the config file): a row is ``Setting(key, attr, parse)``: the TOML
  key, the policy dataclass field it sets, and ``parse(where, value)`` (``where``
  is ``"<guard>.<key>"``), which returns the value or raises ``NodeagentError``
  in one line naming the key and the value (``number``, ``whole``, ``one_of``,
  ``flag``, ``modules``, ``params``, ``paths`` below, or a guard's own).
  ``apply_settings`` refuses a key no row names, then sets the fields the table
  gives, in table order.
- **Saved memory** (state.json): a row is ``Saved(key, kind, default)``: the JSON
  key, which is also the memory dataclass field, what the value must be, and
  what an absent key means. A ``Check`` kind is a test, a conversion and the line
  that says why a value fails (``{key}`` and ``{value}`` in it); ``Custom`` wraps
  a guard's own reader. ``read_record`` returns the fields by name, or raises
  ``FieldError`` (a ValueError) in one line naming the key and the value.

Pure, as all of core/.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from nodeagent.core import policy as cfgval
from nodeagent.core.guard import is_count, is_finite
from nodeagent.core.names import is_module_name, validate_module_param
from nodeagent.errors import NodeagentError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    P = TypeVar("P", bound=DataclassInstance)

# -- policy: the [<guard>] table of the config file ---------------------------------------

Parse = Callable[[str, Any], Any]  # (where, e.g. "sriov.parallel", value) -> the field's value


@dataclass(frozen=True)
class Setting:
    key: str  # the config key, e.g. "retry_base_seconds"
    attr: str  # the policy field it sets, e.g. "retry_base_s"
    parse: Parse


def apply_settings(
    section: str, table: Mapping[str, Any], settings: Sequence[Setting], pol: P
) -> P:
    """``[section]`` of the config file over ``pol``; NodeagentError naming a bad key or value."""
    cfgval.reject_unknown(section, table, [s.key for s in settings])
    changes = {
        s.attr: s.parse(f"{section}.{s.key}", table[s.key]) for s in settings if s.key in table
    }
    return replace(pol, **changes)


def number(lo: float, hi: float) -> Parse:
    """A number (a TOML integer or float, not a boolean) in lo..hi, as a float."""
    return lambda where, value: cfgval.number(where, value, lo, hi)


def whole(lo: int, hi: int) -> Parse:
    """A TOML integer in lo..hi (1.5 is refused, not truncated)."""
    return lambda where, value: cfgval.whole(where, value, lo, hi)


def one_of(words: Iterable[str]) -> Parse:
    """One of ``words``."""
    options = tuple(words)
    return lambda where, value: cfgval.choice(where, value, options)


def flag(where: str, value: Any) -> bool:
    """true or false."""
    return cfgval.boolean(where, value)


def modules(where: str, value: Any) -> tuple[str, ...]:
    """A non-empty list of kernel module names, normalized ('-' as '_')."""
    if not isinstance(value, list) or not value:
        raise NodeagentError(
            f"config {where}: expected a non-empty list of module names, got {_shown(value)}"
        )
    return cfgval.module_list(where, value)


def params(where: str, value: Any) -> tuple[str, ...]:
    """A list (maybe empty) of module parameters, ``key`` or ``key=value``."""
    if not isinstance(value, list):
        raise NodeagentError(
            f"config {where}: expected a list of key=value strings, got {_shown(value)}"
        )
    try:
        return tuple(validate_module_param(x) for x in value)
    except NodeagentError as exc:
        raise NodeagentError(f"config {where}: {exc}") from None


def paths(where: str, value: Any) -> tuple[str, ...]:
    """A list (maybe empty) of paths relative to the host root."""
    if not isinstance(value, list):
        raise NodeagentError(f"config {where}: expected a list of paths, got {_shown(value)}")
    return tuple(cfgval.check_relpath(where, p) for p in value)


# -- saved memory: a guard's part of state.json --------------------------------------------


class FieldError(ValueError):
    """A saved value that is not what its field says (one line naming the key and the value)."""


class Kind(Protocol):
    def read(self, value: Any, key: str) -> Any:
        """The field's value from ``value`` (saved under ``key``), or FieldError."""
        ...


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Check:
    """A value passing ``test``, converted by ``make``; ``says`` is the refusal, with
    ``{key}`` and ``{value}`` in it."""

    says: str
    test: Callable[[Any], bool]
    make: Callable[[Any], Any] = _same

    def read(self, value: Any, key: str) -> Any:
        if not self.test(value):
            raise FieldError(self.says.format(key=key, value=_shown(value)))
        return self.make(value)


@dataclass(frozen=True)
class Custom:
    """A guard's own reader, ``read(value, key)``, for a nested structure."""

    reader: Callable[[Any, str], Any]

    def read(self, value: Any, key: str) -> Any:
        return self.reader(value, key)


@dataclass(frozen=True)
class Saved:
    key: str  # the JSON key, and the memory dataclass field
    kind: Kind
    default: Any = None  # the value read when the key is absent (checked as any other)


def read_record(
    data: Mapping[str, Any],
    table: Sequence[Saved],
    where: str = "",
    *,
    reject_unknown: bool = False,
) -> dict[str, Any]:
    """The fields of ``table`` read from ``data``, by name, in table order; FieldError on the
    first bad one (``where`` prefixes its key). An unknown key is refused if
    ``reject_unknown``, else ignored."""
    if reject_unknown:
        unknown = set(data) - {f.key for f in table}
        if unknown:
            raise FieldError(f"{where}unknown field {sorted(unknown)[0]!r}")
    return {f.key: f.kind.read(data.get(f.key, f.default), where + f.key) for f in table}


def _is_strings(x: object) -> bool:
    return isinstance(x, list) and all(isinstance(s, str) for s in x)


def _shown(value: Any) -> str:
    """The value in an error line: its repr, at most 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# A scalar's refusal shows the value in place ("failures is 'lots', not a count"); a
# structure's says what it is not first, then what it got.
COUNT = Check("{key} is {value}, not a count", is_count, int)
TIME = Check("{key} is {value}, not a finite time", is_finite, float)
TEXT = Check("{key} is {value}, not a string", lambda x: isinstance(x, str))
BOOL = Check("{key} is not a boolean (got {value})", lambda x: isinstance(x, bool))
STRINGS = Check("{key} is not a list of strings (got {value})", _is_strings, tuple)
MODULES = Check(
    "{key} is not a list of module names (got {value})",
    lambda x: isinstance(x, list) and all(is_module_name(m) for m in x),
    tuple,
)
OBJECT = Check("{key} is not an object (got {value})", lambda x: isinstance(x, Mapping))


def word(words: Iterable[str]) -> Check:
    """One of ``words`` ("phase 'exploded' is not one of stable, ...")."""
    options = tuple(words)
    return Check(f"{{key}} {{value}} is not one of {', '.join(options)}", lambda x: x in options)


def optional(kind: Check, null: Any = None) -> Check:
    """``kind``, or null (read as ``null``)."""
    return Check(
        kind.says,
        lambda x: x is None or kind.test(x),
        lambda x: null if x is None else kind.make(x),
    )
