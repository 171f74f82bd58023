"""explain's RE2 supersets (``explain/forms.py``, ``superset``): before a signature's own
pattern is searched, RE2 (one DFA pass) rules out the lines it cannot match. A superset that
missed a line the pattern matches would lose evidence; each is checked on every line the
test corpora and the shared logs hold, and on random text built from the patterns' pieces."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeagent.explain import forms as explain
from nodeagent.explain import matcher
from nodeagent.explain.forms import Signature, superset
from nodeagent.explain.signatures import SIGNATURES
from tests.explain import corpus as words

SHARED = Path(__file__).resolve().parents[3] / "shared"


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
        fast = explain._FAST[sig.pattern].regex
        for line in lines:
            text = line[::-1] if sig.backward else line
            if text.isascii() and sig.pattern.search(text):
                matched += 1
                assert fast.search(text.encode()), (sig.name, line)
    assert matched > 100  # the corpus has evidence for the signatures, not only noise


def re_fields(sig: Signature, line: str) -> tuple[tuple[str, str], ...] | None:
    """What re alone finds: the reference the RE2 path must equal."""
    m = sig.pattern.search(line[::-1] if sig.backward else line)
    if m is None:
        return None
    return tuple((k, v) for k, v in m.groupdict().items() if v is not None)


def test_re2_finds_what_re_finds_groups_and_all() -> None:
    """A pattern RE2 takes as written is searched by RE2 alone on an ASCII line: its match
    and every named group equal re's (RE2 keeps Perl's leftmost-first choice), on every
    corpus line; the others equal re's by construction (re runs where RE2 says maybe)."""
    lines = corpus()
    exact = [s for s in SIGNATURES if explain._FAST[s.pattern].exact]
    assert len(exact) >= 25
    compared = 0
    for sig in SIGNATURES:
        for line in lines:
            encoded = line.encode() if line.isascii() else None
            want = re_fields(sig, line)
            assert sig.fields(line, encoded) == want, (sig.name, line)
            compared += want is not None
    assert compared > 100


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
            assert explain._FAST[sig.pattern].regex.search(text.encode()), (sig.name, line)
        assert sig.fields(line, line.encode()) == re_fields(sig, line), (sig.name, line)


class Spy:
    """A pattern that counts re's searches."""

    def __init__(self, real: re.Pattern[str], calls: list[str]) -> None:
        self.real, self.calls = real, calls
        # what a Signature reads of its pattern to make its RE2 form
        self.pattern, self.flags, self.groupindex = real.pattern, real.flags, real.groupindex

    def search(self, text: str) -> re.Match[str] | None:
        self.calls.append(text)
        return self.real.search(text)


def spied(name: str, calls: list[str]) -> Signature:
    sig = next(s for s in SIGNATURES if s.name == name)
    spy = type(sig)(sig.name, Spy(sig.pattern, calls), sig.source, sig.needs, sig.backward)  # type: ignore[arg-type]
    explain._FAST[spy.pattern] = explain._FAST[sig.pattern]
    return spy


def fields(sig: Signature, line: str) -> tuple[tuple[str, str], ...] | None:
    return sig.fields(line, line.encode() if line.isascii() else None)


def test_it_is_searched_only_where_re2_cannot_rule_it_out() -> None:
    """A loosened pattern (rdma-symbol's lookbehind): a line RE2 rules out is never
    searched with re (the speed), and a non-ASCII line always is (RE2's \\w is ASCII:
    Python's takes any letter)."""
    calls: list[str] = []
    spy = spied("rdma-symbol", calls)
    assert not explain._FAST[spy.pattern].exact
    try:
        assert spy.search("mlx5_ib: " * 100 + "Unknown") is None
        assert fields(spy, "mlx5_ib: " * 100 + "Unknown") is None
        assert calls == []
        assert fields(spy, "mlx5_ib: Unknown symbol ib_foo (err -22)") == (
            ("module", "mlx5_ib"), ("how", "Unknown"), ("symbol", "ib_foo"), ("err", "-22")
        )  # fmt: skip
        assert fields(spy, "ünïcode: Unknown") is None and len(calls) == 2
    finally:
        del explain._FAST[spy.pattern]


def test_a_pattern_re2_takes_as_written_never_runs_re_on_an_ascii_line() -> None:
    calls: list[str] = []
    spy = spied("peermem-einval", calls)
    assert explain._FAST[spy.pattern].exact
    try:
        line = "modprobe: ERROR: could not insert 'nvidia_peermem': Invalid argument"
        assert fields(spy, line) == (("module", "nvidia_peermem"),)
        assert fields(spy, "modprobe: could not insert 'nvidia_peermem'") is None
        assert calls == []
        assert fields(spy, line.replace("modprobe", "mödprobe")) == (("module", "nvidia_peermem"),)
        assert len(calls) == 1  # not ASCII: re's
    finally:
        del explain._FAST[spy.pattern]


WHOLE_WORD_MODULES = re.compile(
    r"\b(nvidia\w*|nv_peer_mem|mlx5_\w+|ib_\w+|rdma\w*|rpcrdma|nvme_rdma)\b"
)
NAME_PIECES = st.sampled_from(
    ["nvidia", "_peermem", "nv_peer_mem", "mlx5_", "ib", "_core", "rdma", "rpcrdma", "x", " ",
     ":", "/", "-", "_", "0", "é", "ß"]
)  # fmt: skip


def module_names(line: str) -> list[str]:
    low = line.lower()
    return list(matcher._module_names(low, low.encode() if low.isascii() else None))


@settings(max_examples=400, deadline=None)
@given(st.lists(NAME_PIECES, max_size=30))
def test_module_names_are_the_whole_word_ones(pieces: list[str]) -> None:
    """The names "what it did see" reads (re without the leading \\b, RE2 to find the first)
    are exactly those a whole-word search finds."""
    low = "".join(pieces).lower()
    assert module_names(low) == WHOLE_WORD_MODULES.findall(low)


def test_module_names_of_the_corpus() -> None:
    named = 0
    for line in corpus():
        low = line.lower()
        assert module_names(low) == WHOLE_WORD_MODULES.findall(low), line
        named += bool(WHOLE_WORD_MODULES.findall(low))
    assert named > 100
