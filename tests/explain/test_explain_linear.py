"""``nodeagent explain`` takes time linear in its input, whatever its lines hold (issue 37).

Any local user can write lines into the journal (``logger``); one pattern,
``/sys/\\S*/net/? not found``, scanned the rest of a run of non-space text from
every ``/sys/`` in it: 4 MB of such lines took 8-16 s, a 1 GB journal an hour.

Every pattern the explainer searches (``SIGNATURES``, the prefixes ``normalize``
takes off, the ANSI codes) is checked two ways:

- its shape (``re._parser``): no unbounded repeat of a group holding one; no
  unbounded repeat that can be re-run over text an earlier unbounded repeat can
  also take (the two adjacent with characters in common, or with only text both
  take between them), unless nothing after it can fail. ``search`` is such an
  earlier repeat, of any character, in front of every pattern (it restarts at
  each position): a pattern must not begin with text its first unbounded repeat
  takes too (``/sys/\\S*``), unless an anchor (``^``, ``(?<!\\S)``) stops the
  restarts inside it.
- time: hostile lines built from each pattern's own pieces (its literal text
  repeated, long runs of what its repeats take), read as the CLI reads them
  (explain/files.py, then the explainer), must be done within a bound of seconds
  where the quadratic forms took 100 times as long: a hang detector, the one
  timed assertion here.

The rewritten patterns are checked against the old ones: the same lines recognised.
"""

from __future__ import annotations

import io
import re
import sys
import time
from dataclasses import dataclass
from itertools import count
from re import _constants as C  # type: ignore[attr-defined]
from re import _parser as P  # type: ignore[attr-defined]
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeagent.explain.files import lines_of
from nodeagent.explain.forms import Signature
from nodeagent.explain.matcher import LINE_MAX, Explainer, may_have_evidence
from nodeagent.explain.signatures import SIGNATURES
from nodeagent.explain.stamps import _ANSI, _PREFIXES

# ---------------------------------------------------------------- the shape check

# Characters a set is judged on: ASCII, Unicode spaces, and the letters case-blind
# matching treats specially (long s, dotless i, dotted I, Kelvin sign).
ALL = frozenset(map(chr, range(128))) | frozenset("\u00a0\u2003\u3000\u017f\u0131\u0130\u212aé中")
_CATEGORIES = {
    C.CATEGORY_DIGIT: r"\d",
    C.CATEGORY_NOT_DIGIT: r"\D",
    C.CATEGORY_SPACE: r"\s",
    C.CATEGORY_NOT_SPACE: r"\S",
    C.CATEGORY_WORD: r"\w",
    C.CATEGORY_NOT_WORD: r"\W",
}
CATEGORY = {k: frozenset(c for c in ALL if re.fullmatch(v, c)) for k, v in _CATEGORIES.items()}
REPEATS = (C.MAX_REPEAT, C.MIN_REPEAT, C.POSSESSIVE_REPEAT)
_keys = count()


def _literal(code: int, flags: int) -> frozenset[str]:
    c = chr(code)
    return frozenset(x for x in ALL if re.fullmatch(re.escape(c), x, flags & re.I)) | {c}


def _leaf(op: Any, av: Any, flags: int) -> frozenset[str]:
    """The characters one single-character item takes."""
    if op is C.LITERAL:
        return _literal(av, flags)
    if op is C.NOT_LITERAL:
        return ALL - _literal(av, flags)
    if op is C.ANY:
        return ALL if flags & re.S else ALL - {"\n"}
    assert op is C.IN, op
    got: set[str] = set()
    negate = False
    for iop, iav in av:
        if iop is C.NEGATE:
            negate = True
        elif iop is C.LITERAL:
            got |= _literal(iav, flags)
        elif iop is C.RANGE:
            lo, hi = iav
            for c in ALL:
                forms = (c, c.lower(), c.upper()) if flags & re.I else (c,)
                if any(len(f) == 1 and lo <= ord(f) <= hi for f in forms):
                    got.add(c)
        elif iop is C.CATEGORY:
            got |= CATEGORY[iav]
        else:
            raise ValueError(f"unknown set item {iop}")
    return ALL - got if negate else frozenset(got)


LEAVES = (C.LITERAL, C.NOT_LITERAL, C.ANY, C.IN)


def _flags(flags: int, av: Any) -> int:
    _group, add, remove, _sub = av
    return int((flags | add) & ~remove)


def chars_of(items: Any, flags: int) -> frozenset[str]:
    """Every character the items can take."""
    out: set[str] = set()
    for op, av in items:
        if op in LEAVES:
            out |= _leaf(op, av, flags)
        elif op in REPEATS:
            out |= chars_of(av[2], flags)
        elif op is C.SUBPATTERN:
            out |= chars_of(av[3], _flags(flags, av))
        elif op is C.ATOMIC_GROUP:
            out |= chars_of(av, flags)
        elif op is C.BRANCH:
            for alt in av[1]:
                out |= chars_of(alt, flags)
        elif op not in (C.AT, C.ASSERT, C.ASSERT_NOT):
            raise ValueError(f"unknown item {op}")
    return frozenset(out)


def has_unbounded(items: Any) -> bool:
    for op, av in items:
        if op in REPEATS and (av[1] == C.MAXREPEAT or has_unbounded(av[2])):
            return True
        if op is C.SUBPATTERN and has_unbounded(av[3]):
            return True
        if op is C.ATOMIC_GROUP and has_unbounded(av):
            return True
        if op is C.BRANCH and any(has_unbounded(alt) for alt in av[1]):
            return True
    return False


def cannot_fail(items: Any) -> bool:
    """Whether the items match (the empty string at least) wherever they are tried."""
    for op, av in items:
        if op in REPEATS and av[0] == 0:
            continue
        if op is C.SUBPATTERN and cannot_fail(av[3]):
            continue
        if op is C.ATOMIC_GROUP and cannot_fail(av):
            continue
        if op is C.BRANCH and any(cannot_fail(alt) for alt in av[1]):
            continue
        return False
    return True


@dataclass(frozen=True)
class Run:
    """An unbounded repeat met earlier that can still give back, or take, what follows:
    ``seps`` is, position by position, what it can take of the text matched since."""

    chars: frozenset[str]
    seps: tuple[frozenset[str], ...]
    what: str
    key: int


def _absorb(pending: list[Run], cs: frozenset[str]) -> list[Run]:
    """Runs that can also take one more item taking ``cs``."""
    return [Run(r.chars, (*r.seps, r.chars & cs), r.what, r.key) for r in pending if r.chars & cs]


def _not_after(pending: list[Run], forbidden: frozenset[str]) -> list[Run]:
    """Runs still live where the character before may not be in ``forbidden``."""
    out = []
    for r in pending:
        if r.seps:
            last = r.seps[-1] - forbidden
            if last:
                out.append(Run(r.chars, (*r.seps[:-1], last), r.what, r.key))
        elif r.chars - forbidden:
            out.append(Run(r.chars - forbidden, r.seps, r.what, r.key))
    return out


def _show(cs: frozenset[str]) -> str:
    return "[" + "".join(sorted(c for c in cs if c.isprintable()))[:24] + "...]"


def _walk(items: Any, pending: list[Run], flags: int, tail: bool, problems: list[str]) -> list[Run]:
    """``tail``: nothing after these items can fail."""
    items = list(items)
    for i, (op, av) in enumerate(items):
        rest_ok = tail and cannot_fail(items[i + 1 :])
        if op in LEAVES:
            pending = _absorb(pending, _leaf(op, av, flags))
        elif op in REPEATS:
            lo, hi, sub = av
            if hi == C.MAXREPEAT:
                cs = chars_of(sub, flags)
                what = f"unbounded repeat of {_show(cs)}"
                if has_unbounded(sub):
                    problems.append(f"{what} holds an unbounded repeat")
                _walk(sub, [], flags, False, problems)
                if not rest_ok:
                    for r in pending:
                        if r.chars & cs and all(s & cs for s in r.seps):
                            problems.append(f"{what} can re-run over what {r.what} takes")
                pending = _absorb(pending, cs)
                if op is not C.POSSESSIVE_REPEAT:  # one that never gives back is no run
                    pending = [*pending, Run(cs, (), what, next(_keys))]
            else:
                taken = _walk(sub, pending, flags, rest_ok and hi == 1, problems)
                if hi > 1:
                    taken = _walk(sub, taken, flags, False, problems)
                pending = taken + pending if lo == 0 else taken
        elif op is C.SUBPATTERN:
            pending = _walk(av[3], pending, _flags(flags, av), rest_ok, problems)
        elif op is C.ATOMIC_GROUP:
            before = {r.key for r in pending}
            after = _walk(av, pending, flags, rest_ok, problems)
            pending = [r for r in after if r.key in before]  # its own runs never give back
        elif op is C.BRANCH:
            pending = [r for alt in av[1] for r in _walk(alt, pending, flags, rest_ok, problems)]
        elif op is C.AT:
            if av is C.AT_BEGINNING and flags & re.M:
                pending = _not_after(pending, ALL - {"\n"})
            elif av in (C.AT_BEGINNING, C.AT_BEGINNING_STRING):
                pending = []
            # the others take no character and stop no restart: nothing to do
        elif op is C.ASSERT_NOT and av[0] < 0 and len(av[1]) == 1 and av[1][0][0] in LEAVES:
            pending = _not_after(pending, chars_of(av[1], flags))  # (?<!x): not after an x
        elif op in (C.ASSERT, C.ASSERT_NOT):
            _walk(av[1], [], flags, False, problems)
        else:
            raise ValueError(f"unknown item {op}")
    return pending


def shape_problems(pattern: re.Pattern[str]) -> list[str]:
    """What in ``pattern`` makes ``pattern.search`` take more than linear time."""
    parsed = P.parse(pattern.pattern, pattern.flags)
    problems: list[str] = []
    start = Run(ALL, (), "search's restart at every position", next(_keys))
    _walk(parsed, [start], parsed.state.flags, True, problems)
    return sorted(set(problems))


def _label(sig: Signature) -> str:
    return f"{sig.name}{' (backward)' if sig.backward else ''}: {sig.pattern.pattern}"


PATTERNS = [
    *((_label(s), s.pattern) for s in SIGNATURES),
    ("ANSI codes", _ANSI),
    *((f"prefix {p.pattern}", p) for p in _PREFIXES),
]


@pytest.mark.parametrize(("label", "pattern"), PATTERNS, ids=[p[0] for p in PATTERNS])
def test_every_pattern_has_a_linear_shape(label: str, pattern: re.Pattern[str]) -> None:
    assert shape_problems(pattern) == [], label


# The two quadratic signatures before the rewrite, and the textbook forms.
QUADRATIC = [
    r"/sys/\S*/net/? not found",  # issue 37: every /sys/ scanned the rest of the run
    r"Cannot find device \"?([\w.-]+)\"?|/sys/\S*/net/? not found",  # the whole old one
    r"nv_get_p2p_free_callback.*invalid context",  # each name: .* to the end and back
    r"(a+)+$",  # nested
    r"\S*\S*x",  # adjacent, overlapping
    r"\w*peer_memory\w*x",  # overlapping, with text both take between them
    r"\S*x",  # a leading unbounded repeat under search
    r"(?>\S*)x",  # atomic, but search restarts inside it
    r"(?<!\S)\S*?/sys/\S*/net",  # anchored, but the lazy run re-extends to each /sys/
]
LINEAR = [
    r"symbol (\w*peer_memory\w*)",  # the second run ends it: reaching it is a match
    r"Module (\w+) is in use",  # the run cannot take the space after it
    r"^\S*x",  # no restart
    r"(?<!\S)(?>\S*?/sys/)\S*/net/? not found",  # one run per token
    r"dnuof ton /?ten/\S*?/sys/",  # the backward form: a space before the run
    r"a{0,100}a{0,100}x",  # bounded
]


@pytest.mark.parametrize("pattern", QUADRATIC)
def test_the_shape_check_finds_the_quadratic_forms(pattern: str) -> None:
    assert shape_problems(re.compile(pattern)) != []


@pytest.mark.parametrize("pattern", LINEAR)
def test_the_shape_check_passes_linear_forms(pattern: str) -> None:
    assert shape_problems(re.compile(pattern)) == []


# ------------------------------------------------------------- the hang detector

HANG_BOUND = 4.0  # seconds for a few MB: linear code takes ~0.1 s, the quadratic 8-16 s
TAIL = " peermem"  # an evidence word: the chunk is split into lines, each line fed


def explain_within(data: bytes, bound: float = HANG_BOUND) -> dict[str, Any]:
    """Read ``data`` as ``nodeagent explain`` reads a file; fail if it takes ``bound``."""
    ex = Explainer()
    start = time.perf_counter()
    for n, line in lines_of(io.BytesIO(data), may_have_evidence, ex.total):
        ex.feed("hostile.log", n, line)
    took = time.perf_counter() - start
    assert took < bound, f"{len(data) / 1e6:.1f} MB took {took:.1f} s (bound {bound} s)"
    return ex.report()


def test_the_reported_case_lines_of_sys_then_peermem() -> None:
    data = ("/sys/" * 800 + TAIL + "\n").encode() * 1000  # 4 MB, was 8-16 s
    assert explain_within(data)["lines"] == 1000


def test_the_reported_case_with_the_signature_s_own_ending() -> None:
    """The backward form's own ending, so it is searched: after runs of /sys/, and at
    the end of one (a match, from the first /sys/ of the run)."""
    miss = "/sys/" * 800 + " /net not found" + TAIL
    hit = "/sys/" * 800 + "/net not found" + TAIL
    doc = explain_within(((miss + "\n") * 999 + hit + "\n").encode())
    assert [i["kind"] for i in doc["incidents"]] == ["vf-restore-before-netdev"]
    assert doc["incidents"][0]["evidence"][0]["line"] == 1000


def pieces(sig: Signature) -> tuple[list[str], list[str]]:
    """The literal runs of a signature's pattern (as they read in the line: a backward
    form's reversed), and a few characters each of its sets and repeats take."""
    texts: list[str] = []
    chars: list[str] = []
    preferred = " /a.-_:[]1\"'\tZ"

    def walk(items: Any, flags: int) -> None:
        run = ""
        for op, av in items:
            if op is C.LITERAL:
                run += chr(av)
                continue
            if run:
                texts.append(run)
                run = ""
            if op in (C.IN, C.ANY, C.NOT_LITERAL):
                cs = _leaf(op, av, flags)
                chars.extend([c for c in preferred if c in cs][:3] or sorted(cs)[:1])
            elif op in REPEATS:
                walk(av[2], flags)
            elif op is C.SUBPATTERN:
                walk(av[3], _flags(flags, av))
            elif op is C.ATOMIC_GROUP:
                walk(av, flags)
            elif op is C.BRANCH:
                for alt in av[1]:
                    walk(alt, flags)
            elif op in (C.ASSERT, C.ASSERT_NOT):
                walk(av[1], flags)
        if run:
            texts.append(run)

    parsed = P.parse(sig.pattern.pattern, sig.pattern.flags)
    walk(parsed, parsed.state.flags)
    if sig.backward:
        texts = [t[::-1] for t in texts]
    return texts, sorted(set(chars))


def hostile_lines(sig: Signature) -> list[str]:
    """Lines of one signature's pieces: each repeated to the line's length; runs of each
    character its repeats take, after its first piece and before its last; its pieces
    in order, over and over, with and without the last. Each with the signature's
    words (so its pattern is searched) and an evidence word."""
    texts, chars = pieces(sig)
    order = texts[::-1] if sig.backward else texts
    width = LINE_MAX - 64
    bodies = [(t * width)[:width] for t in texts]
    bodies += [order[0] + c * width for c in chars] + [c * width + order[-1] for c in chars]
    whole = "".join(texts)
    bodies += [(whole * width)[:width], ("".join(texts[:-1]) * width)[:width]]
    bodies += [((order[0] + c) * width)[:width] for c in chars]
    word = sig.needs[0]
    return [f"{b} {word}{TAIL}" for b in bodies] + [f"{word} {b}{TAIL}" for b in bodies]


FORMS = [pytest.param(s, id=_label(s)) for s in SIGNATURES]


@pytest.mark.parametrize("sig", FORMS)
def test_each_signature_s_own_pieces_repeated_take_linear_time(sig: Signature) -> None:
    lines = hostile_lines(sig)
    data = "".join(lines[i % len(lines)] + "\n" for i in range(1000)).encode()  # ~4 MB
    explain_within(data)


@st.composite
def built_from(draw: st.DrawFn, sig: Signature) -> str:
    texts, chars = pieces(sig)
    atoms = [*texts, *chars, *sig.needs, " ", "x"]
    parts = draw(
        st.lists(st.tuples(st.sampled_from(atoms), st.integers(1, 2000)), min_size=1, max_size=6)
    )
    return "".join(a * n for a, n in parts)[: LINE_MAX - 16] + TAIL


@pytest.mark.parametrize("sig", FORMS)
@settings(max_examples=8)
@given(data=st.data())
def test_any_line_of_a_signature_s_pieces_takes_linear_time(sig: Signature, data: Any) -> None:
    line = data.draw(built_from(sig))
    explain_within(((line + "\n") * 250).encode(), bound=2.0)  # ~1 MB


# ------------------------------------------ the rewrite recognises what the old did

# The patterns issue 37 rewrote, as they were; the rewrite must agree with them.
OLD = {
    "vf-no-netdev": r"Cannot find device \"?([\w.-]+)\"?|/sys/\S*/net/? not found",
    "vf-restore-failed": r"(?i)VF restore(?:\W+\w+)?\W+FAIL|restore_sriov_config",
    "peermem-harmless-callback": r"nv_get_p2p_free_callback.*invalid context",
}
OLD_RE = {name: re.compile(p) for name, p in OLD.items()}

ATOMS = sorted(
    {t for s in SIGNATURES for t in pieces(s)[0]}
    | {t for s in SIGNATURES for t in s.needs}
    | {"/sys/", "/net", "/net/", " not found", "VF RESTORE", "reſtore", "FAILED", "fail"}
    | {"nvidia_peermem", "nvidia-peermem", "peer_memory", "ib_core", "eth0", '"', "'"}
    | set(" \t\u3000/:-_.*xX9\u017f\u0131\u0130\u212a\n")
)


def test_the_rewritten_signatures_keep_their_names() -> None:
    names = [s.name for s in SIGNATURES]
    assert all(name in names for name in OLD)


@settings(max_examples=1500)
@given(st.lists(st.sampled_from(ATOMS), max_size=14).map("".join))
def test_each_signature_recognises_what_the_old_pattern_did(line: str) -> None:
    low = line.lower()
    for name, old in OLD_RE.items():
        new = any(s.found_in(line, low) for s in SIGNATURES if s.name == name)
        assert new == (old.search(line) is not None), (name, line)


@pytest.mark.parametrize(
    "line",
    [
        "| |  /sys/.../net/ not found   |",  # seed 003
        "x/sys/a/sys/net not found",  # the path's /sys/ and /net share a slash
        "/sys/net not found",  # they may not share /sys/'s own
        "/sys//net not found",
        "a /sys/x /net not found",  # a space between: not one path
        "/sys/x/net\t not found",
        "nvidia-peermem nv_get_p2p_free_callback:127 ERROR detected invalid context",
        "invalid context nv_get_p2p_free_callback",
        "nv_get_p2p_free_callback\ninvalid context",
        "*** VF RESTORE FAILED ***",
        "VF restore -- eth0 -- failed",
        "VF restore a b FAIL",
        "VF reſtore FAIL",  # long s: (?i) takes it for s
        "restore_srıov_config",  # dotless i
        "RESTORE_SRIOV_CONFIG:",
    ],
)
def test_edge_lines_are_recognised_as_before(line: str) -> None:
    test_each_signature_recognises_what_the_old_pattern_did.hypothesis.inner_test(line)  # type: ignore[attr-defined]


EVERY_CHARACTER = "".join(map(chr, range(sys.maxunicode + 1)))


def test_case_blind_forms_words_are_in_every_line_they_match_lower_cased() -> None:
    """A form's ``needs`` are tested on the line lower-cased: each letter of a
    case-blind form's words must be in the lower case of every character (?i) takes
    for it (s is not: U+017F; i is not: U+0131), and its first-letter class must hold
    every character (?i) takes for that letter."""
    blind = [s for s in SIGNATURES if "(?i" in s.pattern.pattern]
    assert blind
    for sig in blind:
        for letter in set("".join(sig.needs)):
            taken = re.findall("(?i)" + re.escape(letter), EVERY_CHARACTER)
            assert all(letter in c.lower() for c in taken), (sig.pattern.pattern, letter, taken)
        first = re.match(r"\[(\w+)\]", sig.pattern.pattern)
        assert first, sig.pattern.pattern
        letters = first.group(1)
        taken = re.findall("(?i)" + re.escape(letters[0]), EVERY_CHARACTER)
        assert sorted(taken) == sorted(letters), (letters, taken)


def test_every_signature_s_words_are_lower_case() -> None:
    assert all(w == w.lower() and w for s in SIGNATURES for w in s.needs)


OLD_JOURNAL = re.compile(r"^[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \S+ [^:\s]+(?:\[\d+\])?:\s*")
JOURNAL_ATOMS = ["Nov 21 11:51:41 ", "gpu-1", "kernel", "[12]", "[", "]", "1", ":", " ", "\t", "a"]


@settings(max_examples=1500)
@given(st.lists(st.sampled_from(JOURNAL_ATOMS), max_size=12).map("".join))
def test_the_journal_prefix_takes_off_what_it_did(line: str) -> None:
    (new,) = (p for p in _PREFIXES if p.pattern.startswith("^(?P<mname>"))
    assert new.sub("", line, count=1) == OLD_JOURNAL.sub("", line, count=1)
