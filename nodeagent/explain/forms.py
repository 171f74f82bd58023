"""One form of a signature and how a line is searched with it: RE2 first (linear by
construction), Python's re only where RE2 cannot say. Pure.

Every pattern runs in time linear in the line (a line is at most ``LINE_MAX``
characters, and anyone can write one into the journal with ``logger``): no two
unbounded repeats that can take the same text, no unbounded repeat that can
re-run over the literal before it when ``search`` restarts there (the shape
``/sys/\\S*/net``: every ``/sys/`` in a long run scanned the rest of the run, 0.5
MB/s), no unbounded repeat of a group holding one. tests/explain/test_explain_linear.py
checks each pattern's shape and times hostile lines built from its pieces.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import re2


@dataclass(frozen=True)
class Signature:
    """One form of a signature: a name may have several forms (entries), any one of which
    makes the line its evidence."""

    name: str
    pattern: re.Pattern[str]
    source: str  # where its words come from: source file, seed or public report
    # Lower-case words one of which is in every line the pattern matches (of the line
    # lower-cased: `in` tests, far cheaper than a search): the pattern is searched only
    # in a line with one of them.
    needs: tuple[str, ...]
    # The pattern is written reversed and searched in the reversed line: a form whose
    # fixed text is at its end (``/sys/\S*/net/? not found``) is then read from that
    # text, one scan of the path before it, not one scan per ``/sys/`` in it.
    backward: bool = False

    def __post_init__(self) -> None:
        fast = _fast(self.pattern)
        if fast is not None:
            _FAST[self.pattern] = fast

    def match(self, line: str, low: str) -> re.Match[str] | None:
        """``low``: ``line.lower()`` (once per line, by the caller)."""
        for word in self.needs:
            if word in low:
                return self.search(line)
        return None

    def search(self, line: str) -> re.Match[str] | None:
        """The pattern alone (the caller knows one of ``needs`` is in the line)."""
        text = line[::-1] if self.backward else line
        fast = _FAST.get(self.pattern)
        # ASCII only: RE2's \w, \s, \b are ASCII, Python's take any letter or space.
        if fast is not None and text.isascii() and fast.regex.search(text.encode()) is None:
            return None  # RE2's superset says no: so does the pattern
        return self.pattern.search(text)

    def fields(self, line: str, encoded: bytes | None) -> tuple[tuple[str, str], ...] | None:
        """The named groups the pattern matched in ``line`` (None: no match). ``encoded``:
        the line as ASCII bytes, when it is ASCII; then a pattern RE2 takes as written is
        searched by RE2 alone (groups and all: RE2 keeps Perl's leftmost-first choice), at
        a tenth of re's cost on a long line, and the others only where their superset
        matches."""
        fast = _FAST.get(self.pattern)
        if fast is not None and encoded is not None:
            m = fast.regex.search(encoded[::-1] if self.backward else encoded)
            if m is None:
                return None
            if fast.exact:
                groups = m.groupdict()
                return tuple(
                    (k, v.decode()) for k in fast.names if (v := groups[k.encode()]) is not None
                )
        text = line[::-1] if self.backward else line
        found = self.pattern.search(text)
        if found is None:
            return None
        return tuple((k, v) for k, v in found.groupdict().items() if v is not None)

    def found_in(self, line: str, low: str) -> bool:
        return self.match(line, low) is not None


def superset(pattern: str) -> str:
    """``pattern`` loosened into what RE2 takes: possessive quantifiers and atomic groups made
    plain, lookarounds dropped. Every line the pattern matches, this matches (each change
    only lets more text through), so a line RE2 rejects in one DFA pass needs no search."""
    out: list[str] = []
    i, klass = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i : i + 2])
            i += 2
            continue
        if klass:
            klass = c != "]"
            out.append(c)
            i += 1
            continue
        if c == "[":
            klass = True
            out.append(c)
            # a ']' right after '[' or '[^' is a member, not the end
            if pattern[i + 1 : i + 2] == "^":
                out.append("^")
                i += 1
            if pattern[i + 1 : i + 2] == "]":
                out.append("]")
                i += 1
            i += 1
            continue
        if pattern.startswith("(?>", i):
            out.append("(?:")
            i += 3
            continue
        look = next((x for x in ("(?<!", "(?<=", "(?!", "(?=") if pattern.startswith(x, i)), "")
        if look:
            end = pattern.find(")", i)
            if end < 0 or "(" in pattern[i + len(look) : end]:
                raise ValueError("a nested lookaround")
            i = end + 1
            continue
        if c == "+" and out and out[-1] in ("+", "*", "?", "}") and not _escaped(out):
            i += 1  # possessive: the quantifier before it, plain
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _escaped(out: list[str]) -> bool:
    """The last token is an escaped character (``\\+``), not a quantifier."""
    return len(out[-1]) == 2 and out[-1].startswith("\\")


@dataclass(frozen=True)
class _Fast:
    """A signature's pattern for RE2, over a line's ASCII bytes."""

    regex: Any
    exact: bool  # the pattern as written (no construct loosened): RE2's match is the match
    names: tuple[str, ...]  # its named groups in the pattern's order (re's groupdict's)


def _fast(pattern: re.Pattern[str]) -> _Fast | None:
    try:
        text = superset(pattern.pattern)
        flags = "(?i)" if pattern.flags & re.IGNORECASE else ""
        flags += "(?m)" if pattern.flags & re.MULTILINE else ""
        names = tuple(sorted(pattern.groupindex, key=pattern.groupindex.__getitem__))
        return _Fast(re2.compile((flags + text).encode()), text == pattern.pattern, names)
    except (ValueError, re2.error):
        return None  # searched with re alone


# Each signature's RE2 form, where there is one (by pattern; a Signature adds its own).
_FAST: dict[re.Pattern[str], _Fast] = {}
