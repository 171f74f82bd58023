"""The ``Explainer`` a run feeds line by line: which signatures a line is evidence of, per
node, and what it did see when nothing was recognised. It knows no signature and no
kind by name (the tables do). Pure."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import re2

from nodeagent.explain.incidents import KINDS
from nodeagent.explain.rules import KEEP, Evidence, Found, classify
from nodeagent.explain.signatures import PREFILTER_WORDS, SIGNATURES
from nodeagent.explain.stamps import Stamp, split

LINE_MAX = 4096  # what is kept of a line (a 10 MB line is cut, not held)
INHERIT_LINES = 10  # a line without a time takes its file's last one, this near
# Evidence lines kept per signature over all nodes (rules.py keeps KEEP per node): past
# it each node keeps its share, at least SHOW, so a bundle of 400 nodes holds what its
# report shows, not 400 times KEEP lines
KEEP_TOTAL = 10_000
EVIDENCE_TEXT = 512  # what is kept of an evidence line's text (the report quotes it)
SHOW = 8  # evidence lines shown per incident

# Typographic forms of ASCII punctuation, as logs pasted through forums, wikis and word
# processors carry them: matched as ASCII, quoted as written.
_TYPOGRAPHIC = str.maketrans(
    {
        "\u2018": "'", "\u2019": "'", "\u201a": "'", "\u201b": "'", "\u2032": "'",
        "\u201c": '"', "\u201d": '"', "\u201e": '"', "\u201f": '"', "\u2033": '"',
        "\u2010": "-", "\u2011": "-", "\u2012": "-", "\u2013": "-", "\u2014": "-",
        "\u2212": "-", "\u00a0": " ", "\u2009": " ", "\u202f": " ",
    }
)  # fmt: skip


def may_have_evidence(chunk: bytes | memoryview, *, or_errors: bool = False) -> bool:
    """Whether ``chunk`` (as read: any case) has an evidence word, or (``or_errors``) an
    error-looking one ("what it did see" still wants lines): one RE2 pass either way."""
    return (_PREFILTER_OR_ERRORS if or_errors else _PREFILTER).search(chunk) is not None


BY_NAME = {s.name: s for s in SIGNATURES}


# Every word at once, case-insensitive, in one pass of RE2's DFA (google-re2: linear by
# construction, ~500-650 MB/s here on a chunk with no word). Measured on 1 MiB of kubelet
# lines (bench/explain.py's normal log): the 30 substring tests of bytes.lower() ran at
# ~78 MB/s, pyahocorasick's Aho-Corasick at ~76 (its per-character walk), RE2 at ~520.
_PREFILTER = re2.compile(b"(?i)" + b"|".join(re.escape(w) for w in PREFILTER_WORDS))
_PREFILTER_OR_ERRORS = re2.compile(_PREFILTER.pattern + b"|error|fail")


# Module names a line that is no evidence names ("what it did see"); each has one of the words.
_MODULE_NAME = r"(nvidia\w*|nv_peer_mem|mlx5_\w+|ib_\w+|rdma\w*|rpcrdma|nvme_rdma)\b"
# Searched by re without the leading \b, which it checks itself (_module_names): a pattern
# that opens with a group of letters lets re skip every position without one of them
# (7x faster on a 4 KiB line of none); RE2 finds the first (one DFA pass) on ASCII.
_MODULES = re.compile(_MODULE_NAME)
_FIRST_MODULE = re2.compile(rb"\b" + _MODULE_NAME.encode())
_MODULE_WORDS = ("nvidia", "nv_peer", "mlx5_", "ib_", "rdma")


def _module_names(low: str, encoded: bytes | None) -> Iterator[str]:
    """The module names in the lower-cased line ``low`` (``encoded``: the line's ASCII
    bytes, when it is ASCII), each one a whole word."""
    pos = 0
    if encoded is not None:
        first = _FIRST_MODULE.search(encoded.lower())
        if first is None:
            return
        pos = first.start()
    for m in _MODULES.finditer(low, pos):
        # no word character before it: the \b the pattern leaves out (inside a name
        # there is no boundary, so no whole-word name is skipped by taking this one)
        if m.start() == 0 or not (low[m.start() - 1].isalnum() or low[m.start() - 1] == "_"):
            yield m.group(1)


# What a line's words say, besides which signatures to search: an error-looking line,
# a line naming modules ("what it did see").
_ERROR_LINE, _MODULE_LINE = -1, -2


def _words_set() -> tuple[Any, list[list[int]]]:
    """Every signature's ``needs`` words, ``error``/``fail`` and the module words in one
    case-blind RE2 set: a line's words in one pass, where ~70 substring tests of a 4 KiB
    line took ~300 µs (9 µs); and for each word the signatures (by index, in table order)
    that need it, or ``_ERROR_LINE``/``_MODULE_LINE``."""
    words: dict[str, list[int]] = {}
    for i, sig in enumerate(SIGNATURES):
        for word in sig.needs:
            words.setdefault(word, []).append(i)
    for word in ("error", "fail"):
        words.setdefault(word, []).append(_ERROR_LINE)
    for word in _MODULE_WORDS:
        words.setdefault(word, []).append(_MODULE_LINE)
    options = re2.Options()
    options.case_sensitive = False  # the words are lower-case: as `in` of the line lowered
    found = re2.Set.SearchSet(options)
    for word in words:
        found.Add(re2.escape(word).encode())
    found.Compile()
    return found, list(words.values())


_WORDS, _WORD_MEANS = _words_set()


@dataclass
class _FileState:
    stamp: Stamp | None = None
    line: int = 0


@dataclass
class Explainer:
    """Fed lines in order (several files in turn, each with the node it is about when a
    bundle says); ``report()`` at the end."""

    nodes: dict[str, Found] = field(default_factory=dict)  # "" for files of no known node
    lines: int = 0  # lines looked at
    total: list[int] = field(default_factory=lambda: [0])  # lines read, looked at or not
    errors: list[Evidence] = field(default_factory=list)  # error-looking lines, unexplained
    modules: set[str] = field(default_factory=set)
    files: dict[str, _FileState] = field(default_factory=dict)
    bundles: list[dict[str, Any]] = field(default_factory=list)  # what each bundle was
    texts: dict[str, str] = field(default_factory=dict)  # evidence texts, one of each

    def feed(self, file: str, lineno: int, raw: str, node: str = "") -> None:
        self.lines += 1
        line, stamp = split(raw[:LINE_MAX])
        state = self.files.setdefault(file, _FileState())
        if stamp is not None:
            state.stamp, state.line = stamp, lineno
        elif state.stamp is not None and lineno - state.line <= INHERIT_LINES:
            stamp = state.stamp
        text = line if line.isascii() else line.translate(_TYPOGRAPHIC)
        # An ASCII line is read by RE2 as bytes (the wrapper's own str handling doubles
        # its cost); another is lower-cased for the set, as `in` tests read it before.
        encoded = text.encode() if text.isascii() else None
        present = _WORDS.Match(encoded if encoded is not None else text.lower()) or ()
        means = {i for word in present for i in _WORD_MEANS[word]}
        for i in sorted(i for i in means if i >= 0):  # table order: the first form wins
            sig = SIGNATURES[i]
            fields = sig.fields(text, encoded)
            if fields is None:
                continue
            found = self.nodes.get(node)
            if found is None:
                found = self._new_node(node)
            found.add(Evidence(file, lineno, self._kept(line), sig.name, stamp, fields), self.keep)
            return
        if _ERROR_LINE in means and len(self.errors) < 5:
            self.errors.append(Evidence(file, lineno, self._kept(line), ""))
        if _MODULE_LINE in means and len(self.modules) < 20:
            # At most 20 names read of a line: one of 4096 characters can name a thousand
            # (or one module a thousand times, which never fills the set).
            for name in itertools.islice(_module_names(text.lower(), encoded), 20):
                self.modules.add(name)
                if len(self.modules) >= 20:
                    break

    def _new_node(self, node: str) -> Found:
        before = self.keep
        found = self.nodes[node] = Found()
        if self.keep < before:
            for other in self.nodes.values():
                other.trim(self.keep)
        return found

    @property
    def keep(self) -> int:
        """Evidence lines kept per signature and node: KEEP, or each node's share of
        KEEP_TOTAL when the logs cover many nodes, never fewer than the report shows."""
        return max(SHOW, min(KEEP, KEEP_TOTAL // max(1, len(self.nodes))))

    def _kept(self, line: str) -> str:
        """The text kept of an evidence line: its first EVIDENCE_TEXT characters, one
        string for lines that read the same (a CrashLoop's failed load, again and again)."""
        if len(line) > EVIDENCE_TEXT:
            line = line[: EVIDENCE_TEXT - 1] + "\u2026"
        if len(self.texts) < KEEP_TOTAL:
            return self.texts.setdefault(line, line)
        return self.texts.get(line, line)

    @property
    def found(self) -> dict[str, list[Evidence]]:
        """Every node's evidence by signature (for tests and "what it saw")."""
        out: dict[str, list[Evidence]] = {}
        for f in self.nodes.values():
            for name, evs in f.by_sig.items():
                out.setdefault(name, []).extend(evs)
        return out

    def incidents(self) -> list[dict[str, Any]]:
        out = []
        for node in sorted(self.nodes):
            for finding in classify(self.nodes[node]):
                inc = KINDS[finding.kind]
                doc: dict[str, Any] = {
                    "kind": inc.kind,
                    "title": inc.title,
                    "evidence": [_ev(e) for e in finding.evidence[:SHOW]],
                    "remedy": inc.remedy,
                    "prevented_by": list(inc.prevented_by),
                    "not_prevented_by": list(inc.not_prevented_by),
                    "sources": sorted({BY_NAME[e.signature].source for e in finding.evidence}),
                }
                if node:
                    doc["node"] = node
                notes = list(finding.notes)
                cut = self.nodes[node].cut
                if cut:
                    notes.append(
                        f"only the first {cut} lines of each kind were kept"
                        + (f" for each of the {len(self.nodes)} nodes" if cut < KEEP else "")
                        + ": what later lines of a kind say is not weighed"
                    )
                if notes:
                    doc["notes"] = notes
                out.append(doc)
        return out

    def report(self) -> dict[str, Any]:
        lines = max(self.lines, self.total[0])
        doc: dict[str, Any] = {"incidents": self.incidents(), "lines": lines}
        if self.bundles:
            doc["bundles"] = self.bundles
        if not doc["incidents"]:
            doc["seen"] = {
                "modules": sorted(self.modules),
                "errors": [_ev(e) for e in self.errors],
                "harmless": [_ev(e) for e in self.found.get("peermem-harmless-callback", [])],
            }
        return doc


def _ev(e: Evidence) -> dict[str, Any]:
    return {"file": e.file, "line": e.line, "text": e.text}


def explain_lines(named: Iterable[tuple[str, Iterable[str]]]) -> dict[str, Any]:
    """Convenience for tests: (file name, lines) pairs in; the report out."""
    ex = Explainer()
    for name, lines in named:
        for n, line in enumerate(lines, 1):
            ex.feed(name, n, line)
    return ex.report()
