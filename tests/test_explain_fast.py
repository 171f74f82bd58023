"""explain's RE2 supersets (``core/explain.py``, ``superset``): before a signature's own
pattern is searched, RE2 (one DFA pass) rules out the lines it cannot match. A superset that
missed a line the pattern matches would lose evidence; each is checked on every line the
test corpora and the shared logs hold, and on random text built from the patterns' pieces."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeagent.core import explain
from nodeagent.core.explain import SIGNATURES, superset
from tests import test_explain_words as words

SHARED = Path(__file__).resolve().parent.parent.parent / "shared"


def corpus() -> list[str]:
    lines: list[str] = []
    for excerpt, _kind in words.KERNEL_AND_KMOD + words.OPENIBD_AND_CONTAINERS:
        for shape in words.SHAPES.values():
            lines += [shape(x) for x in excerpt]
    lines += words.UNRELATED + words.OTHER_IN_USE + list(words.MOFED)
    for d in ("real-logs", "seeds"):
        for f in sorted((SHARED / d).glob("*")):
            if f.is_file():
                lines += f.read_text(errors="replace").splitlines()
    return [x for x in lines if isinstance(x, str)]


def test_every_signature_has_a_superset() -> None:
    """Each pattern loosens into one RE2 takes: no signature is left to re alone."""
    assert {s.pattern for s in SIGNATURES} <= set(explain._FAST)


def test_no_superset_misses_a_line_its_pattern_matches() -> None:
    lines = corpus()
    assert len(lines) > 500
    matched = 0
    for sig in SIGNATURES:
        fast = explain._FAST[sig.pattern]
        for line in lines:
            text = line[::-1] if sig.backward else line
            if text.isascii() and sig.pattern.search(text):
                matched += 1
                assert fast.search(text), (sig.name, line)
    assert matched > 100  # the corpus has evidence for the signatures, not only noise


@pytest.mark.parametrize(
    ("pattern", "loose"),
    [
        (r"a++b*+c?+d{2}+", "a+b*c?d{2}"),
        (r"\++", r"\++"),  # an escaped '+', then a plain one: not possessive
        (r"[+]++x", "[+]+x"),
        (r"[]+]+", "[]+]+"),  # ']' first in a class is a member
        (r"(?>a.*?b)c", "(?:a.*?b)c"),
        (r"(?<!\S)mod(?=:)", "mod"),
        (r"x(?<=x)", "x"),
    ],
)
def test_the_loosening(pattern: str, loose: str) -> None:
    assert superset(pattern) == loose


def test_a_nested_lookaround_is_left_to_re() -> None:
    with pytest.raises(ValueError, match="nested"):
        superset(r"(?<!(a))b")


PIECES = st.sampled_from(
    ["/sys/", "/net", " not found", "peermem", "nvidia_peermem", " [FAILED]", "Unloading ",
     "mlx5_ib: ", "Unknown symbol ", "could not insert '", "a/", " ", ":", "'", "-", "VF restore",
     "FAIL", "disagrees about version of symbol ", "ib_core", "(err -22)", "\t", "x", "0"]
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(PIECES, max_size=40))
def test_random_lines_of_the_patterns_pieces(pieces: list[str]) -> None:
    line = "".join(pieces)
    for sig in SIGNATURES:
        text = line[::-1] if sig.backward else line
        if sig.pattern.search(text):
            assert explain._FAST[sig.pattern].search(text), (sig.name, line)


def test_it_is_searched_only_where_re2_cannot_rule_it_out() -> None:
    """A line RE2 rules out is never searched with re (the speed), and a non-ASCII line
    always is (RE2's \\w is ASCII: Python's takes any letter)."""
    sig = next(s for s in SIGNATURES if s.name == "rdma-symbol")
    calls: list[str] = []

    class Spy:
        def __init__(self, real: re.Pattern[str]) -> None:
            self.real = real

        def search(self, text: str) -> re.Match[str] | None:
            calls.append(text)
            return self.real.search(text)

    spied = type(sig)(sig.name, Spy(sig.pattern), sig.source, sig.needs, sig.backward)  # type: ignore[arg-type]
    explain._FAST[spied.pattern] = explain._FAST[sig.pattern]
    try:
        assert spied.search("mlx5_ib: " * 100 + "Unknown") is None
        assert calls == []
        assert spied.search("mlx5_ib: Unknown symbol ib_foo (err -22)") is not None
        assert spied.search("ünïcode: Unknown") is None and len(calls) == 2
    finally:
        del explain._FAST[spied.pattern]
