"""``nodeagent explain``: name the race from the logs an admin already has. Pure.

One table (``SIGNATURES``) says which log lines are evidence of what, each with
the seed or public report it came from; one table (``INCIDENTS``) says which
evidence makes an incident, its remedy in operator words, and which deployment
modes of ``deploy/README.md`` would have prevented it with nodeagent. Adding a
class is an entry in each and its test.

Lines are matched after ``normalize`` takes off what tools put in front of
them: ``kubectl logs --timestamps`` (RFC 3339), ``dmesg`` (``[  12.345678]``)
and ``dmesg -T`` (``[Tue Sep  8 17:16:02 2026]``), ``journalctl``
(``Nov 21 11:51:41 host kernel: ``), CR and ANSI colour codes.

Every pattern runs in time linear in the line (a line is at most ``LINE_MAX``
characters, and anyone can write one into the journal with ``logger``): no two
unbounded repeats that can take the same text, no unbounded repeat that can
re-run over the literal before it when ``search`` restarts there (the shape
``/sys/\\S*/net``: every ``/sys/`` in a long run scanned the rest of the run, 0.5
MB/s), no unbounded repeat of a group holding one. tests/test_explain_linear.py
checks each pattern's shape and times hostile lines built from its pieces.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_PREFIXES = (
    re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:?\d\d)\s+"),  # kubectl
    re.compile(r"^\[\s*\d+\.\d+\]\s*"),  # dmesg
    re.compile(r"^\[[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4}\]\s*"),  # dmesg -T
    # journal; ++: a run given back never lets the rest match (it stops at the space,
    # or at the ':' that ends the prefix)
    re.compile(r"^[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \S++ [^:\s]++(?:\[\d+\])?:\s*"),
)
# Cheap before any per-line work: a chunk without one of these words (lower-cased) has
# no evidence. Plain substring tests: a case-insensitive regex alternation runs at
# ~20 MB/s, bytes.lower() and `in` at hundreds.
PREFILTER_WORDS = (
    b"peermem",
    b"storage modules",
    b"is in use",
    b"cannot find device",
    b"restore",
    b"openibd",
    b"driver ready state",
    b"/net not found",
    b"/net/ not found",
)


def may_have_evidence(lower: bytes) -> bool:
    """``lower``: a chunk, lower-cased (once, by the caller)."""
    return any(word in lower for word in PREFILTER_WORDS)


LINE_MAX = 4096  # what is kept of a line (a 10 MB line is cut, not held)


def normalize(line: str) -> str:
    line = _ANSI.sub("", line.rstrip("\r\n")).replace("\r", "")
    for prefix in _PREFIXES:
        line = prefix.sub("", line, count=1)
    return line.strip()


@dataclass(frozen=True)
class Signature:
    """One form of a signature: a name may have several forms (entries), any one of which
    makes the line its evidence."""

    name: str
    pattern: re.Pattern[str]
    source: str  # the seed or public report it came from
    # Lower-case words one of which is in every line the pattern matches (of the line
    # lower-cased: `in` tests, far cheaper than a search): the pattern is searched only
    # in a line with one of them.
    needs: tuple[str, ...]
    # The pattern is written reversed and searched in the reversed line: a form whose
    # fixed text is at its end (``/sys/\S*/net/? not found``) is then read from that
    # text, one scan of the path before it, not one scan per ``/sys/`` in it.
    backward: bool = False

    def found_in(self, line: str, low: str) -> bool:
        """``low``: ``line.lower()`` (once per line, by the caller)."""
        for word in self.needs:
            if word in low:
                return self.pattern.search(line[::-1] if self.backward else line) is not None
        return False


SIGNATURES: tuple[Signature, ...] = (
    Signature(
        "peermem-einval",
        re.compile(r"could not insert '?nvidia[_-]peermem'?: Invalid argument"),
        "seeds 000-002; NVIDIA/gpu-operator issue 2868",
        ("could not insert",),
    ),
    Signature(
        "peermem-symbol-crc",
        re.compile(r"nvidia[_-]peermem: disagrees about version of symbol (\w+)"),
        "NVIDIA/gpu-operator issue 2868",
        ("disagrees about version of symbol",),
    ),
    Signature(
        "peermem-unknown-symbol",
        # the second \w* ends the pattern: once it is reached the match is made, so the
        # first is never re-tried against it
        re.compile(r"nvidia[_-]peermem: Unknown symbol (\w*peer_memory\w*)"),
        "NVIDIA/gpu-operator issue 2868 (with the CRC lines); alone: an inbox ib_core",
        ("unknown symbol",),
    ),
    Signature(
        "peermem-not-built",
        re.compile(r"Module nvidia[_-]peermem not found"),
        "NVIDIA/gpu-operator issue 2619",
        ("peermem not found",),
    ),
    Signature(
        "mofed-restarting",
        re.compile(r"Unsetting driver ready state|openibd restart|Waiting for MOFED"),
        "seeds 000-001 (the MOFED pod and k8s-driver-manager)",
        ("unsetting driver ready state", "openibd restart", "waiting for mofed"),
    ),
    Signature(
        "storage-modules-loaded",
        re.compile(r"Storage modules are loaded for current driver"),
        "seed 004; Mellanox/network-operator issue 1084",
        ("storage modules are loaded for current driver",),
    ),
    Signature(
        "module-in-use",
        re.compile(r"Module (\w+) is in use(?: by:? ?(\S+))?"),
        "Mellanox/doca-driver-build PR 481 (openibd restart and nvidia_peermem)",
        (" is in use",),
    ),
    Signature(
        "vf-no-netdev",
        re.compile(r'Cannot find device "?([\w.-]+)"?'),
        "seed 003 (MOFED's restore_sriov_config)",
        ("cannot find device",),
    ),
    Signature(
        "vf-no-netdev",
        # /sys/\S*/net/? not found, reversed: from " not found" back over the path to
        # the first /sys/ in it (was searched forwards: 0.5 MB/s on lines of /sys/)
        re.compile(r"dnuof ton /?ten/\S*?/sys/"),
        "seed 003 (MOFED's restore_sriov_config)",
        ("/net not found", "/net/ not found"),
        backward=True,
    ),
    # (?i)VF restore(?:\W+\w+)?\W+FAIL|restore_sriov_config, as two forms whose first
    # letter is a class ([Vv], [Rr]: all that (?i) takes for V, R), so the search skips
    # to it instead of trying the case-blind branches at every character. The first
    # \W+ taken once, before the optional word (the same lines); \W and \w take no
    # character of each other (nor F), so giving any back never helps (++)
    Signature(
        "vf-restore-failed",
        re.compile(r"[Vv](?i:F restore\W++(?:\w++\W++)?FAIL)"),
        "seed 003",
        ("vf re",),
    ),
    Signature(
        "vf-restore-failed",
        re.compile(r"[Rr](?i:estore_sriov_config)"),
        "seed 003",
        # none of these letters has a case-blind match that lower() does not turn into
        # it (s has: U+017F; i has: U+0131); tests/test_explain_linear.py checks
        ("tore",),
    ),
    Signature(
        "peermem-harmless-callback",
        # nv_get_p2p_free_callback.*invalid context, from the first callback name on
        # the line only (atomic): searched from each one, each .* re-ran to the end
        re.compile(r"(?m)^(?>.*?nv_get_p2p_free_callback).*invalid context"),
        "Mellanox/nv_peer_memory issue 120 (a loaded peermem's runtime message: harmless)",
        ("nv_get_p2p_free_callback",),
    ),
)
_BY_NAME = {s.name: s for s in SIGNATURES}
# Module names a line that is no evidence names ("what it did see"); each has one of the words.
_MODULES = re.compile(r"\b(nvidia\w*|mlx5_\w+|ib_\w+|rdma\w*|rpcrdma|nvme_rdma)\b")
_MODULE_WORDS = ("nvidia", "mlx5_", "ib_", "rdma")

MODES = ("operator-peermem", "operator-peermem-dm09", "host-mofed", "dma-buf")


@dataclass(frozen=True)
class Incident:
    kind: str
    title: str
    needs: tuple[str, ...]  # every one of these signatures
    excludes: tuple[str, ...]  # none of these (a more specific class owns them)
    remedy: str
    prevented_by: tuple[str, ...]  # deployment modes (deploy/README.md), with the agent
    not_prevented_by: tuple[str, ...]


INCIDENTS: tuple[Incident, ...] = (
    Incident(
        "peermem-abi-mismatch",
        "nvidia-peermem built against another MOFED: its symbol versions disagree",
        ("peermem-symbol-crc",),
        (),
        "recreate the GPU driver pod (cordon, drain, delete it) so nvidia-peermem is rebuilt "
        "against the MOFED now loaded; the agent's verdict for this is 'rebuild'",
        (),
        (*MODES[:3], "operator-peermem-hold (the load is let go and fails as before)"),
    ),
    Incident(
        "peermem-no-peer-api",
        "nvidia-peermem loaded against an ib_core without the peer-memory API (inbox)",
        ("peermem-unknown-symbol",),
        ("peermem-symbol-crc",),
        "load MOFED's RDMA stack before nvidia-peermem (the inbox ib_core lacks "
        "ib_register_peer_memory_client), or use DMA-BUF where the GPU and kernel allow",
        ("operator-peermem-hold", "operator-peermem-dm09-hold (an inbox ib_core load is held)"),
        ("operator-peermem", "operator-peermem-dm09", "host-mofed"),
    ),
    Incident(
        "peermem-load-race",
        "nvidia_peermem loaded while MOFED was restarting its RDMA stack (Invalid argument)",
        ("peermem-einval", "mofed-restarting"),
        ("peermem-symbol-crc", "peermem-unknown-symbol"),
        "wait for MOFED's ready flag (/run/mellanox/drivers/.driver-ready) before loading "
        "nvidia_peermem; restarting the driver pod after MOFED is ready clears it",
        ("operator-peermem-hold", "operator-peermem-dm09-hold"),
        ("operator-peermem", "operator-peermem-dm09 (nothing shipped waits on the gate)"),
    ),
    Incident(
        "peermem-not-built",
        "nvidia-peermem.ko is not there to load (the driver install left it out)",
        ("peermem-not-built",),
        (),
        "reinstall the driver with peermem built (GPU Operator: recreate the driver pod; "
        "a userspace-only fast path skips it)",
        (),
        MODES,
    ),
    Incident(
        "storage-blocks-mofed",
        "storage modules (rpcrdma, nvme_rdma, ...) loaded, so MOFED refused to install",
        ("storage-modules-loaded",),
        (),
        "unload the storage chain before MOFED installs (UNLOAD_STORAGE_MODULES=true if "
        "unloading them is acceptable), or run nodeagent's storage guard (policy hold)",
        MODES,
        (),
    ),
    Incident(
        "openibd-module-in-use",
        "openibd restart failed: a module it must unload is in use",
        ("module-in-use",),
        (),
        "find the holder (lsmod, the 'in use by' module): an idle nvidia_peermem is unloaded "
        "by nodeagent at the restart's start; a storage or user-held module needs its users "
        "stopped first",
        MODES[:3],
        (),
    ),
    Incident(
        "vf-restore-before-netdev",
        "a VF restore ran before the VF's netdev existed",
        ("vf-no-netdev",),
        (),
        "restore each VF when its netdev appears (nodeagent's VF guard does), then re-run the "
        "restore; pods on the VFs that lost their config need a restart",
        MODES,
        (),
    ),
)


@dataclass(frozen=True)
class Evidence:
    file: str
    line: int
    text: str
    signature: str


@dataclass
class Explainer:
    """Fed lines in order (several files in turn); ``report()`` at the end."""

    found: dict[str, list[Evidence]] = field(default_factory=dict)
    lines: int = 0  # lines looked at
    total: list[int] = field(default_factory=lambda: [0])  # lines read, looked at or not
    errors: list[Evidence] = field(default_factory=list)  # error-looking lines, unexplained
    modules: set[str] = field(default_factory=set)
    per_signature_max: int = 5

    def feed(self, file: str, lineno: int, raw: str) -> None:
        self.lines += 1
        line = normalize(raw[:LINE_MAX])
        low = line.lower()
        for sig in SIGNATURES:
            if not sig.found_in(line, low):
                continue
            got = self.found.setdefault(sig.name, [])
            if len(got) < self.per_signature_max:
                got.append(Evidence(file, lineno, line, sig.name))
            return
        if ("error" in low or "fail" in low) and len(self.errors) < 5:
            self.errors.append(Evidence(file, lineno, line, ""))
        if len(self.modules) < 20 and any(word in low for word in _MODULE_WORDS):
            for m in _MODULES.finditer(low):
                if len(self.modules) < 20:
                    self.modules.add(m.group(1))

    def incidents(self) -> list[dict[str, Any]]:
        out = []
        for inc in INCIDENTS:
            if not all(n in self.found for n in inc.needs):
                continue
            if any(n in self.found for n in inc.excludes):
                continue
            evidence = [e for n in inc.needs for e in self.found[n]]
            out.append(
                {
                    "kind": inc.kind,
                    "title": inc.title,
                    "evidence": [_ev(e) for e in evidence],
                    "remedy": inc.remedy,
                    "prevented_by": list(inc.prevented_by),
                    "not_prevented_by": list(inc.not_prevented_by),
                    "sources": sorted({_BY_NAME[n].source for n in inc.needs}),
                }
            )
        return out

    def ambiguity(self) -> list[str]:
        """Classes the evidence fits equally, and what would tell them apart."""
        notes = []
        if "peermem-einval" in self.found and not {
            "peermem-symbol-crc",
            "peermem-unknown-symbol",
            "mofed-restarting",
        } & set(self.found):
            notes.append(
                "nvidia_peermem failed with Invalid argument but these logs do not say why: "
                "a load while MOFED restarted (peermem-load-race), nvidia-peermem built "
                "against another MOFED (peermem-abi-mismatch) or an inbox ib_core "
                "(peermem-no-peer-api) all fit. The kernel's lines tell them apart: run "
                "`dmesg | grep -i peermem` on the node ('disagrees about version of symbol': "
                "a rebuild; 'Unknown symbol' alone: inbox ib_core; neither, with MOFED's pod "
                "restarting at that time: the race)"
            )
        return notes

    def report(self) -> dict[str, Any]:
        lines = max(self.lines, self.total[0])
        doc: dict[str, Any] = {"incidents": self.incidents(), "lines": lines}
        notes = self.ambiguity()
        if notes:
            doc["ambiguous"] = notes
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
