"""``nodeagent explain``: name the race from the logs an admin already has. Pure.

Three parts, each in one place:

- ``SIGNATURES``: which log lines are evidence of what, each citing the source
  of its words (the kernel's module loader, kmod, ``openibd``, the operators'
  containers) or the seed it came from. A form may name fields (``module``,
  ``symbol``, ``err``) that the rules read.
- ``classify``: the rules that turn one node's evidence into incidents. The
  peermem family is decided per failed load: a "disagrees" line and an
  ``Invalid argument`` from the same load (the same file within
  ``SAME_LOAD_LINES`` lines, or stamps within ``SAME_LOAD_S``) are an ABI
  mismatch; an ``Invalid argument`` while MOFED's log shows a restart under way
  is the load race; one with neither is its own kind, which names both causes.
- ``INCIDENTS``: each kind's title, remedy in operator words, and which
  deployment modes of ``deploy/README.md`` would have prevented it.

Lines are matched after ``split`` takes off what tools put in front of them
(``kubectl logs --timestamps``, ``dmesg``, ``dmesg -T``, ``journalctl``, CR,
ANSI colour) and keeps the time it says; a line with none inherits the last
time its file said within ``INHERIT_LINES`` lines. Times are compared only on
one clock: wall clock (seconds into the year: a journal line has no year, and
each tool's zone is taken as the same) or seconds since boot (``dmesg``).

Evidence is kept per node: a bundle (``host/bundle.py``) says which node a file
is about, loose files are one node, and no rule correlates two nodes' lines.

Every pattern runs in time linear in the line (a line is at most ``LINE_MAX``
characters, and anyone can write one into the journal with ``logger``): no two
unbounded repeats that can take the same text, no unbounded repeat that can
re-run over the literal before it when ``search`` restarts there (the shape
``/sys/\\S*/net``: every ``/sys/`` in a long run scanned the rest of the run, 0.5
MB/s), no unbounded repeat of a group holding one. tests/test_explain_linear.py
checks each pattern's shape and times hostile lines built from its pieces.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import re2

LINE_MAX = 4096  # what is kept of a line (a 10 MB line is cut, not held)
SAME_LOAD_LINES = 20  # a kernel line this near a failed insert, in one file: the same load
SAME_LOAD_S = 2.0  # or stamped this near it
INHERIT_LINES = 10  # a line without a time takes its file's last one, this near
WINDOW_SLACK_S = 5.0  # around a restart window: the two tools' clocks and flushes
KEEP = 200  # evidence lines kept per signature and node (for the rules; bounded)
# ... and per signature over all nodes: past it each node keeps its share, at least SHOW,
# so a bundle of 400 nodes holds what its report shows, not 400 times KEEP lines
KEEP_TOTAL = 10_000
EVIDENCE_TEXT = 512  # what is kept of an evidence line's text (the report quotes it)
SHOW = 8  # evidence lines shown per incident

_MONTH_NAMES = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_MONTHS = {m: i for i, m in enumerate(_MONTH_NAMES)}
_DAYS_BEFORE = (0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334)

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# Each prefix keeps its time in named groups: a month (number or name), day, H:M:S, or
# seconds since boot.
_PREFIXES = (
    # kubectl logs --prefix (the GPU Operator's must-gather): [pod/<pod>/<container>]
    re.compile(r"^\[pod/[^\]\s/]++/[^\]\s]++\]\s*"),
    # kubectl --timestamps (RFC 3339); journalctl -o short-iso
    re.compile(
        r"^\d{4}-(?P<mon>\d\d)-(?P<day>\d\d)T(?P<hms>\d\d:\d\d:\d\d)(?:\.\d+)?"
        r"(?:Z|[+-]\d\d:?\d\d)\s+"
    ),
    re.compile(r"^(?:stdout|stderr) [FP] "),  # a kubelet (CRI) log file, after its time
    re.compile(r"^\[\s*(?P<boot>\d+\.\d+)\]\s*"),  # dmesg
    # dmesg -T
    re.compile(
        r"^\[[A-Z][a-z]{2} (?P<mname>[A-Z][a-z]{2}) (?P<day>[ \d]\d) (?P<hms>\d\d:\d\d:\d\d) "
        r"\d{4}\]\s*"
    ),
    # journal; ++: a run given back never lets the rest match (it stops at the space,
    # or at the ':' that ends the prefix)
    re.compile(
        r"^(?P<mname>[A-Z][a-z]{2}) (?P<day>[ \d]\d) (?P<hms>\d\d:\d\d:\d\d) \S++ "
        r"[^:\s]++(?:\[\d+\])?:\s*"
    ),
)
# Times a tool writes inside its line (kept, not taken off): MOFED's and the DOCA driver
# container's "[26-Sep-24_05:02:12]", logrus' time="2025-11-21T11:51:41Z", klog's
# "I1121 11:51:41.123456".
_LOGRUS_TIME = re.compile(r"\btime=\"?\d{4}-(?P<mon>\d\d)-(?P<day>\d\d)T(?P<hms>\d\d:\d\d:\d\d)")
_INLINE_TIMES = (
    re.compile(r"^\[(?P<day>\d\d)-(?P<mname>[A-Z][a-z]{2})-\d\d_(?P<hms>\d\d:\d\d:\d\d)\]"),
    _LOGRUS_TIME,
    re.compile(r"^[IWEF](?P<mon>\d\d)(?P<day>\d\d) (?P<hms>\d\d:\d\d:\d\d)\.\d+ "),
)


@dataclass(frozen=True, slots=True)
class Stamp:
    """A time a line said: ``clock`` "wall" (seconds into the year) or "boot"."""

    clock: str
    t: float


def _stamp(m: re.Match[str]) -> Stamp | None:
    g = m.groupdict()
    if g.get("boot"):
        return Stamp("boot", float(g["boot"]))
    month = int(g["mon"]) - 1 if g.get("mon") else _MONTHS.get(g.get("mname") or "", -1)
    if not 0 <= month < 12:
        return None
    h, mi, s = (int(x) for x in g["hms"].split(":"))
    day = int(g["day"])
    return Stamp("wall", ((_DAYS_BEFORE[month] + day - 1) * 24 + h) * 3600 + mi * 60 + s)


def split(line: str) -> tuple[str, Stamp | None]:
    """The line as the tool wrote it (prefixes, colour and CR off) and the time it says."""
    line = line.rstrip("\r\n")
    if "\x1b" in line:  # colour is rare: the search for it costs a scan of the line
        line = _ANSI.sub("", line)
    line = line.replace("\r", "")
    stamp = None
    for prefix in _PREFIXES:
        m = prefix.match(line)
        if m:
            # the outer time wins: kubectl's when it holds a container's dmesg line
            stamp = stamp or _stamp(m)
            line = line[m.end() :]
    line = line.strip()
    if stamp is None:
        for inline in _INLINE_TIMES:
            # the logrus form is searched only where its word is (a search from every
            # position of a long line costs more than the rest of the line's reading)
            if inline is _LOGRUS_TIME and "time=" not in line:
                continue
            m = inline.search(line)
            if m:
                stamp = _stamp(m)
                break
    return line, stamp


def normalize(line: str) -> str:
    return split(line)[0]


# The GPUDirect modules: nvidia_peermem (the driver's, since 465) and nv_peer_mem
# (MLNX_OFED's before it, Mellanox/nv_peer_memory), as modprobe, the kernel and a
# file name spell them.
_PEERMEM = r"(?P<module>nvidia[_-]peermem|nv_peer_mem)"
# Storage modules that sit on the RDMA stack and are built for one of its two builds
# (inbox or MOFED): MOFED refuses to install under them (seed 004).
_STORAGE = r"(?P<module>nvme_rdma|nvmet_rdma|rpcrdma|xprtrdma|svcrdma|ib_iser|ib_isert|ib_srpt?)"
# The modules openibd loads and unloads, the storage on them and the GPU's: "is in use"
# names an openibd incident only for one of these (any vendor's rmmod prints the words).
_STACK_MODULE = (
    r"(?:(?:ib|rdma|iw|mlx4|mlx5|nvme|nvmet)_\w+|mlx_compat|mlxfw|mlxdevm|knem|irdma"
    r"|rpcrdma|xprtrdma|svcrdma|nvidia\w*|nv_peer_mem)\b"
)
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
# What kmod and the kernel print about one module's symbols: "<mod>: ..." (the kernel),
# "<path>/<mod>.ko ..." (depmod)
_SYMBOL_WORDS = (
    r"(?:\.ko)?:? (?P<how>disagrees about version of|Unknown|needs unknown) symbol "
    r"(?P<symbol>\w+)(?: \(err (?P<err>-?\d+)\))?"
)
# Failed inserts: modprobe "could not insert 'mod': strerror" and insmod "could not
# insert module path/mod.ko: strerror" (kmod tools/modprobe.c, tools/insmod.c)
_INSERT = r"could not insert (?:module )?'?(?:[\w./-]{0,200}/)?"


def may_have_evidence(chunk: bytes | memoryview, *, or_errors: bool = False) -> bool:
    """Whether ``chunk`` (as read: any case) has an evidence word, or (``or_errors``) an
    error-looking one ("what it did see" still wants lines): one RE2 pass either way."""
    return (_PREFILTER_OR_ERRORS if or_errors else _PREFILTER).search(chunk) is not None


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


# Where the words come from (docs/explain-sources.md has each format with its line).
KERNEL = "torvalds/linux kernel/module/main.c, version.c (before 5.19: kernel/module.c)"
KMOD = "kmod-project/kmod tools/modprobe.c, insmod.c, rmmod.c, modinfo.c, depmod.c"
BUSYBOX = "busybox modutils/modprobe.c, insmod.c"
OPENIBD = "MLNX_OFED ofed_scripts/openibd (from 25.04: mod_load_funcs)"
DOCA = "Mellanox/doca-driver-build entrypoint.sh (bash) and entrypoint/ (Go)"
OFED_DOCKER = "Mellanox/ofed-docker entrypoint.sh"
GPU_DRIVER = "NVIDIA/gpu-driver-container nvidia-driver (driver container, peermem sidecar)"
DRIVER_MANAGER = "NVIDIA/k8s-driver-manager (init container)"
NV_PEER_MEM = "Mellanox/nv_peer_memory nv_peer_mem init script (the unit systemd makes of it)"

SIGNATURES: tuple[Signature, ...] = (
    # ---- the GPUDirect module's load
    Signature(
        "peermem-einval",
        # EINVAL from finit_module: modprobe prints strerror, insmod "Invalid parameters"
        re.compile(_INSERT + _PEERMEM + r"(?:\.ko)?'?: Invalid (?:argument|parameters)"),
        f"{KMOD}; seeds 000-002; NVIDIA/gpu-operator issue 2868",
        ("could not insert",),
    ),
    Signature(
        "peermem-einval",
        re.compile(
            r"can't (?:insert|load module) '?(?:[\w./-]{0,200}/)?"
            r"(?P<module>nvidia[_-]peermem|nv_peer_mem)[^:]{0,200}: [Ii]nvalid argument"
        ),
        BUSYBOX,
        ("can't insert", "can't load module"),
    ),
    Signature(
        "peermem-symbol",
        # the kernel: "<mod>: disagrees about version of symbol <sym>", "<mod>: Unknown
        # symbol <sym> (err <n>)" (no "(err" before 2.6.35; err %li, 0 for none, to 4.18);
        # depmod -e: "<path>.ko needs unknown symbol <sym>", "... disagrees about ..."
        re.compile(_PEERMEM + _SYMBOL_WORDS),
        f"{KERNEL}; {KMOD} (depmod); NVIDIA/gpu-operator issue 2868",
        ("disagrees about version of symbol", "unknown symbol"),
    ),
    Signature(
        "peermem-symbol",
        # built for another kernel: "<mod>: version magic '<x>' should be '<y>'"
        re.compile(_PEERMEM + r": (?P<how>version magic) '"),
        KERNEL,
        ("version magic",),
    ),
    Signature(
        "peermem-busy-provider",
        # resolve_symbol_wait: the provider (ib_core) was still in its init after 30 s;
        # then "Unknown symbol <sym> (err -16)" and modprobe's strerror(EBUSY)
        re.compile(_PEERMEM + r": gave up waiting for init of module (?P<provider>\w+)"),
        KERNEL,
        ("gave up waiting for init of module",),
    ),
    Signature(
        "peermem-busy-provider",
        re.compile(
            _INSERT + r"(?:nvidia[_-]peermem|nv_peer_mem)(?:\.ko)?'?: Device or resource busy"
        ),
        KMOD,
        ("could not insert",),
    ),
    Signature(
        "peermem-not-built",
        # modprobe "Module %s not found in directory %s" (FATAL; WARNING with -a), modinfo
        # "Module %s not found.", busybox "module %s not found in modules.dep", nv_peer_mem's
        # init script "Module nv_peer_mem does not exist"
        re.compile(r"[Mm]odule '?(?:nvidia[_-]peermem|nv_peer_mem)'? (?:not found|does not exist)"),
        f"{KMOD}; {BUSYBOX}; {NV_PEER_MEM}; NVIDIA/gpu-operator issue 2619",
        ("peermem not found", "peer_mem not found", "peermem' not found", "peer_mem does not"),
    ),
    Signature(
        "peermem-not-built",
        # the compiler's error in the GPUDirect module's own source (a DKMS or driver
        # container build): no module comes of it
        re.compile(r"(?:nvidia-peermem|nv_peer_mem)\.c:\d+:\d+: (?:fatal )?error:"),
        "gcc's diagnostics, as DKMS and the driver containers log a build",
        ("peermem.c:", "peer_mem.c:"),
    ),
    Signature(
        "peermem-no-gpu-driver-loaded",
        # nv_peer_mem's init script checks its required modules first
        re.compile(r"required module is not loaded: (?P<provider>nvidia|ib_core)\b"),
        NV_PEER_MEM,
        ("required module is not loaded",),
    ),
    Signature(
        "peermem-load-failed",
        # a failure that does not say why: modprobe's ENOENT text (the kernel's lines name
        # the symbol), the peermem sidecar, nv_peer_mem's script and its unit; each form
        # starts with its fixed text, which the search skips to
        re.compile(
            _INSERT + r"(?:nvidia[_-]peermem|nv_peer_mem)(?:\.ko)?'?: Unknown symbol in module"
        ),
        KMOD,
        ("could not insert",),
    ),
    Signature(
        "peermem-load-failed",
        re.compile(r"ailed to (?:load|start) (?:nvidia-peermem|nv_peer_mem)"),
        f"{GPU_DRIVER}; {NV_PEER_MEM}",
        ("failed to load nvidia-peermem", "failed to load nv_peer_mem", "to start nv_peer_mem"),
    ),
    Signature(
        "peermem-load-failed",
        re.compile(
            r"nv_peer_mem\.service: Failed with result|Failed to start [^\n]{0,80}nv_peer_mem"
        ),
        NV_PEER_MEM,
        ("nv_peer_mem.service: failed", "nv_peer_mem to start"),
    ),
    Signature(
        "module-signature-rejected",
        # secure boot and lockdown: not this tool's incident; a failed load next to one
        # is not called a GPUDirect failure of unknown cause
        re.compile(
            r"Key was rejected by service|Required key not available"
            r"|unsigned module loading is restricted|Loading of unsigned module is rejected"
        ),
        KERNEL,
        ("could not insert", "can't insert", "unsigned module"),
    ),
    # ---- MOFED's restart, and openibd's own words
    Signature(
        "openibd-failed",
        # openibd's [FAILED] lines (colour and CR taken off; echo loses the label's space)
        re.compile(
            r"(?P<what>Loading HCA driver and Access Layer|No HCA kernel modules loaded"
            r"|Failed loading kernel module [\w.-]{1,64}|Module not found: [\w.-]{1,64}"
            r"|Avoid loading inbox module: [\w.-]{1,64}|(?:Unl|L)oading [\w.-]{1,64}"
            r"|Module [\w.-]{1,64} does not exist, skipping\.{0,3})"
            r":? {0,80}\[ {0,4}FAILED {0,4}\]"
        ),
        OPENIBD,
        ("failed ]", "failed]"),
    ),
    Signature(
        "openibd-failed",
        # a refused stop, and the containers' words for a failed restart
        re.compile(
            r"Cannot unload the Infiniband driver stack"
            r"|Command \"/etc/init\.d/openibd restart\" failed with exit code"
            r"|failed to restart openibd service"
            r"|Error occured while restarting driver"
        ),
        f"{OPENIBD}; {DOCA}; {OFED_DOCKER}",
        ("cannot unload the infiniband", "openibd", "occured while restarting driver"),
    ),
    Signature(
        "openibd-ok",
        re.compile(r"Loading HCA driver and Access Layer: {0,80}\[ {0,4}OK {0,4}\]"),
        OPENIBD,
        ("access layer",),
    ),
    Signature(
        "openibd-trace-exit",
        # the DOCA entrypoint's set -x trace: the exit code exec_cmd kept of its command
        re.compile(r"^\+{1,3} exit_code=(?P<code>\d+)$"),
        DOCA,
        ("exit_code=",),
    ),
    Signature(
        "openibd-restart-begin",
        # the restart as the containers run it: exec_cmd (traced, or its debug line), or
        # ofed-docker's bash -x
        re.compile(
            r"exec_cmd '?/etc/init\.d/openibd restart"
            r"|Executing command: /etc/init\.d/openibd restart"
            r"|^\+{1,3} /etc/init\.d/openibd restart"
        ),
        f"{DOCA}; {OFED_DOCKER}",
        ("openibd restart",),
    ),
    Signature(
        "mofed-restarting",
        re.compile(
            r"Unsetting driver ready state|openibd restart|Waiting for MOFED"
            r"|remove driver ready indicator|driver ready indicator cleared"
            r"|waiting for mellanox ofed and nvidia drivers"
        ),
        f"seeds 000-001; {DOCA}; {DRIVER_MANAGER}; {GPU_DRIVER}",
        (
            "unsetting driver ready state",
            "openibd restart",
            "waiting for mofed",
            "driver ready indicator",
            "waiting for mellanox ofed",
        ),
    ),
    Signature(
        "mofed-ready",
        re.compile(
            r"(?<!Un)[Ss]etting driver ready state|set driver ready indicator"
            r"|driver ready indicator set"
        ),
        f"seed 001; {DOCA}",
        ("setting driver ready state", "driver ready indicator"),
    ),
    # ---- storage modules
    Signature(
        "storage-modules-loaded",
        # bash: "Storage modules are loaded for current driver, terminating ..."; Go:
        # "storage modules are loaded for current driver,terminating ..."
        re.compile(r"[Ss]torage modules are loaded for current driver"),
        f"seed 004; Mellanox/network-operator issue 1084; {DOCA}",
        ("storage modules are loaded for current driver",),
    ),
    Signature(
        "storage-modules-loaded",
        # openibd refusing to stop under a storage module in use; OFED 4.0-4.1 said it
        # unquoted, "... unload nvme_rdma module first.", after "Cannot unload driver
        # while nvme_rdma is loaded..." (docs/explain-sources.md)
        re.compile(
            r"Please close all nvmet? sessions and unload '?(?P<module>nvmet?_rdma)\b"
            r"|Please close all isert sessions and unload '?ib_isert\b"
            r"|Please make sure module '(?P<m2>rpcrdma|xprtrdma|ib_srpt)' is not in use"
            r"|Please logout from all open-iscsi over iSER sessions"
            r"|Please flush multipath devices running over SRP devices"
            r"|Cannot unload driver while (?P<m3>ib_isert|nvmet?_rdma) is loaded"
        ),
        OPENIBD,
        (
            "please close all",
            "please make sure module",
            "over iser sessions",
            "over srp devices",
            "cannot unload driver while",
        ),
    ),
    Signature(
        "storage-symbol",
        re.compile(r"\b" + _STORAGE + _SYMBOL_WORDS),
        f"{KERNEL}; {KMOD} (depmod); Mellanox/doca-driver-build PR 79; spdk/spdk issue 684",
        ("disagrees about version of symbol", "unknown symbol"),
    ),
    Signature(
        "storage-symbol",
        re.compile(
            _INSERT + _STORAGE + r"(?:\.ko)?'?: (?P<how>Invalid argument|Unknown symbol in module)"
        ),
        KMOD,
        ("could not insert",),
    ),
    Signature(
        "rdma-symbol",
        # any other module that takes RDMA-stack or mlx5 symbols (mlx5_ib, mlx5_vdpa, an
        # SMB-Direct or DRBD transport...): the same meeting of the two stacks' builds
        re.compile(
            r"(?<!\S)(?P<module>\w+)(?:\.ko)?:? (?P<how>disagrees about version of|Unknown) "
            r"symbol (?P<symbol>(?:__)?(?:ib|rdma|mlx5|mlx4|iw|uverbs|mlxfw)_\w+)"
            r"(?: \(err (?P<err>-?\d+)\))?"
        ),
        f"{KERNEL}; Mellanox/doca-driver-build PR 51 (mlx5_vdpa), issue 52 (mlx5_ib)",
        ("disagrees about version of symbol", "unknown symbol"),
    ),
    Signature(
        "module-in-use",
        # rmmod "Module %s is in use by: ..." (garbled after "by:" in kmod 34), "Module %s is
        # in use"; modprobe -r "Module %s is in use." Only where the module, or what holds
        # it, is of the RDMA stack, its storage or the GPU's: any vendor's module prints it.
        re.compile(
            rf"Module (?:{_STACK_MODULE}) is in use(?: by:? ?\S+)?"
            rf"|Module \w+ is in use by:? ?(?:{_STACK_MODULE})"
        ),
        f"{KMOD} (rmmod, modprobe -r); Mellanox/doca-driver-build PR 481",
        (" is in use",),
    ),
    Signature(
        "module-in-use",
        # the DOCA container refusing before its restart: nvidia_peermem is in use
        re.compile(
            r"Module (nvidia_peermem) is used and will FAIL driver reload"
            r"|failed to unload (nvidia_peermem) module"
        ),
        DOCA,
        ("nvidia_peermem",),
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


# Each signature's RE2 form, where there is one (by pattern).
_FAST = {s.pattern: f for s in SIGNATURES if (f := _fast(s.pattern)) is not None}

# Cheap before any per-line work: a chunk without one of these words (in any case) has no
# evidence (``may_have_evidence``: one RE2 pass; Python's re runs such an alternation at
# ~20 MB/s). Each signature's lines have one of them (tests/test_explain_linear.py
# checks): not its own ``needs``, some of which ("tore") are in most chunks.
PREFILTER_WORDS = (
    b"peermem",
    b"peer_mem",
    b"t insert",  # could not insert, can't insert
    b"t load module",
    b"symbol",  # unknown symbol, disagrees about version of symbol, needs unknown symbol
    b"version magic",
    b"gave up waiting",
    b"required module is",
    b"unsigned module",
    b"storage modules",
    b"please close all",
    b"cannot unload driver while",
    b"please make sure module",
    b"over iser sessions",
    b"over srp devices",
    b"is in use",
    b"openibd",
    b"access layer",
    b"failed]",
    b"failed ]",
    b"cannot unload the infiniband",
    b"occured while restarting",
    b"exit_code=",
    b"driver ready",  # state, indicator
    b"waiting for mofed",
    b"waiting for mellanox",
    b"cannot find device",
    b"restore",
    b"/net not found",
    b"/net/ not found",
)
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

MODES = ("operator-peermem", "operator-peermem-dm09", "host-mofed", "dma-buf")
HOLD_MODES = ("operator-peermem-hold", "operator-peermem-dm09-hold")


@dataclass(frozen=True)
class Incident:
    kind: str
    title: str
    remedy: str
    prevented_by: tuple[str, ...]  # deployment modes (deploy/README.md), with the agent
    not_prevented_by: tuple[str, ...]


INCIDENTS: tuple[Incident, ...] = (
    Incident(
        "peermem-load-race",
        "nvidia_peermem loaded while MOFED was restarting its RDMA stack (Invalid argument)",
        "wait for MOFED's ready flag (/run/mellanox/drivers/.driver-ready) before loading "
        "nvidia_peermem; restarting the driver pod after MOFED is ready clears it",
        HOLD_MODES,
        ("operator-peermem", "operator-peermem-dm09 (nothing shipped waits on the gate)"),
    ),
    Incident(
        "peermem-abi-mismatch",
        "the GPUDirect module was built against another MOFED (or GPU driver) than the one "
        "loaded: its symbol versions disagree",
        "recreate the GPU driver pod (cordon, drain, delete it) so nvidia-peermem is rebuilt "
        "against the MOFED now loaded (nv_peer_mem: rebuild its package against the installed "
        "MLNX_OFED); the agent's verdict for this is 'rebuild'",
        (),
        (*MODES[:3], "operator-peermem-hold (the load is let go and fails as before)"),
    ),
    Incident(
        "peermem-einval-unexplained",
        "the GPUDirect module failed to load with Invalid argument, and these logs do not say why",
        "three causes fit; the kernel's lines and MOFED's log at that minute tell them "
        "apart. (1) A load while MOFED restarted its RDMA stack (peermem-load-race): MOFED's "
        "container log shows 'Unsetting driver ready state' or an openibd restart at that "
        "minute, a later try works; remedy: load it after MOFED's ready flag "
        "(/run/mellanox/drivers/.driver-ready), restart the driver pod once MOFED is ready. "
        "(2) A module built against another MOFED (peermem-abi-mismatch): `dmesg | grep -i "
        "peermem` shows 'disagrees about version of symbol' on every try; remedy: recreate "
        "the GPU driver pod so it is rebuilt against the MOFED loaded. (3) A module built "
        "with no MOFED present (its init returns EINVAL and the kernel prints nothing): "
        "every try fails and dmesg is silent; remedy: rebuild it once MOFED is installed "
        "(GPU Operator: recreate the driver pod after MOFED's pod is ready)",
        (HOLD_MODES[0], f"{HOLD_MODES[1]} (the race only)"),
        ("operator-peermem", "operator-peermem-dm09 (either cause)"),
    ),
    Incident(
        "peermem-no-peer-api",
        "the GPUDirect module loaded against an ib_core without the peer-memory API (the "
        "kernel's inbox one), or with none loaded",
        "load MOFED's RDMA stack before nvidia-peermem (the inbox ib_core lacks "
        "ib_register_peer_memory_client), or use DMA-BUF where the GPU and kernel allow",
        ("operator-peermem-hold", "operator-peermem-dm09-hold (an inbox ib_core load is held)"),
        ("operator-peermem", "operator-peermem-dm09", "host-mofed"),
    ),
    Incident(
        "peermem-no-gpu-driver",
        "the GPUDirect module loaded without the NVIDIA driver's P2P API (nvidia_p2p_*): "
        "nvidia.ko not loaded first",
        "load the NVIDIA driver (nvidia.ko) before nv_peer_mem/nvidia-peermem; on the GPU "
        "Operator the driver container does this in order: look at why nvidia.ko failed",
        (),
        MODES,
    ),
    Incident(
        "peermem-load-failed",
        "the GPUDirect module failed to load, and these logs do not have the kernel's reason",
        "read the kernel's lines for that load: `dmesg | grep -iE 'peer_?mem'` on the node "
        "('disagrees about version of symbol': rebuild against the MOFED loaded; 'Unknown "
        "symbol ib_register_peer_memory_client': an inbox ib_core, load MOFED first; 'Unknown "
        "symbol nvidia_p2p_*': load the NVIDIA driver first), then run explain on them too",
        (),
        (),
    ),
    Incident(
        "peermem-not-built",
        "nvidia-peermem.ko is not there to load (the driver install left it out)",
        "reinstall the driver with peermem built (GPU Operator: recreate the driver pod; "
        "a userspace-only fast path skips it)",
        (),
        MODES,
    ),
    Incident(
        "storage-blocks-mofed",
        "storage modules (rpcrdma, nvme_rdma, ...) loaded, so MOFED refused to install",
        "unload the storage chain before MOFED installs (UNLOAD_STORAGE_MODULES=true if "
        "unloading them is acceptable), or run nodeagent's storage guard (policy hold)",
        MODES,
        (),
    ),
    Incident(
        "storage-module-other-stack",
        "a storage module built for one RDMA stack (inbox or MOFED) met the other's "
        "symbols: it cannot load (or MOFED's install meets it loaded)",
        "load the storage modules built for the stack that is loaded: once MOFED is up, "
        "MOFED's own builds (its nvme-rdma/rpcrdma packages, or the driver container's "
        "storage modules), not the kernel's inbox ones; nodeagent's storage guard loads "
        "the chain back with the node's modprobe, so it meets this too if the node's tree "
        "holds only the inbox builds",
        (),
        MODES,
    ),
    Incident(
        "rdma-module-other-stack",
        "a module built for one RDMA stack (inbox or MOFED) met the other's mlx5/RDMA "
        "symbols, so it could not load",
        "load it from the stack that is loaded: after MOFED's restart, MOFED's own build "
        "(inbox auxiliaries such as mlx5_vdpa are blacklisted during the restart and loaded "
        "after it); a module of your own built against the inbox ib_core (an SMB-Direct or "
        "DRBD transport) must be rebuilt against MOFED's (its ofa_kernel headers)",
        (),
        MODES,
    ),
    Incident(
        "openibd-module-in-use",
        "openibd restart failed: a module it must unload is in use",
        "find the holder (lsmod, the 'in use by' module): an idle nvidia_peermem is unloaded "
        "by nodeagent at the restart's start; a storage or user-held module needs its users "
        "stopped first",
        MODES[:3],
        (),
    ),
    Incident(
        "openibd-restart-failed",
        "MOFED's openibd restart failed (or its log ends mid-restart), so the RDMA stack "
        "was not loaded back",
        "read openibd's output in the MOFED container's log (it is printed after openibd "
        "ends, just before 'Command \"/etc/init.d/openibd restart\" failed'): a module "
        "named '[FAILED]' is in use (lsmod shows by what) or is not MOFED's build; fix "
        "that, then restart the MOFED pod",
        (),
        MODES[:3],
    ),
    Incident(
        "vf-restore-before-netdev",
        "a VF restore ran before the VF's netdev existed",
        "restore each VF when its netdev appears (nodeagent's VF guard does), then re-run the "
        "restore; pods on the VFs that lost their config need a restart",
        MODES,
        (),
    ),
)
_KINDS = {i.kind: i for i in INCIDENTS}


@dataclass(frozen=True, slots=True)
class Evidence:
    file: str
    line: int
    text: str
    signature: str
    stamp: Stamp | None = None
    fields: tuple[tuple[str, str], ...] = ()

    def get(self, name: str) -> str | None:
        return dict(self.fields).get(name)


@dataclass
class Found:
    """One node's evidence, by signature name."""

    by_sig: dict[str, list[Evidence]] = field(default_factory=dict)
    cut: int = 0  # the fewest lines of a kind kept when more were there (0: none cut)

    def add(self, ev: Evidence, keep: int = KEEP) -> None:
        got = self.by_sig.setdefault(ev.signature, [])
        if len(got) < keep:
            got.append(ev)
        else:
            self.cut = min(self.cut or keep, keep)

    def trim(self, keep: int) -> None:
        """Each kind's first ``keep`` lines (a bundle's node count grew)."""
        for name, got in self.by_sig.items():
            if len(got) > keep:
                self.by_sig[name] = got[:keep]
                self.cut = min(self.cut or keep, keep)

    def __getitem__(self, name: str) -> list[Evidence]:
        return self.by_sig.get(name, [])


@dataclass
class Finding:
    kind: str
    evidence: list[Evidence] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _near(a: Evidence, b: Evidence) -> bool:
    """The same load: one file within a few lines, or stamped within seconds."""
    if a.file == b.file and abs(a.line - b.line) <= SAME_LOAD_LINES:
        return True
    return (
        a.stamp is not None
        and b.stamp is not None
        and a.stamp.clock == b.stamp.clock
        and abs(a.stamp.t - b.stamp.t) <= SAME_LOAD_S
    )


@dataclass(frozen=True)
class Window:
    """MOFED restarting: from a restart's first line to the next ready line (or on)."""

    begin: Evidence
    end: Evidence | None

    def holds(self, s: Stamp) -> bool | None:
        """None: not on this window's clock."""
        b = self.begin.stamp
        if b is None or b.clock != s.clock:
            return None
        e = self.end.stamp if self.end else None
        return b.t - WINDOW_SLACK_S <= s.t and (e is None or s.t <= e.t + WINDOW_SLACK_S)


def restart_windows(found: Found) -> list[Window]:
    ends = [e for e in found["mofed-ready"] if e.stamp]
    out = []
    for b in found["mofed-restarting"] + found["openibd-restart-begin"]:
        end = None
        if b.stamp:
            after = [e for e in ends if e.stamp and e.stamp.clock == b.stamp.clock]
            after = [e for e in after if e.stamp and b.stamp and e.stamp.t >= b.stamp.t]
            end = min(after, key=lambda e: e.stamp.t if e.stamp else 0.0, default=None)
        out.append(Window(b, end))
    return out


def _first_after(b: Evidence, evs: list[Evidence]) -> Evidence | None:
    return min(
        (e for e in evs if e.file == b.file and e.line > b.line), key=lambda e: e.line, default=None
    )


def unfinished_restarts(found: Found) -> list[Evidence]:
    """openibd restarts a container ran (exec_cmd, traced or logged) that its log does not
    see end well: the trace's exit_code after it is not 0, or nothing after it in that
    file says the stack loaded (openibd's OK, the ready flag)."""
    out = []
    exits = found["openibd-trace-exit"]
    oks = found["openibd-ok"] + found["mofed-ready"]
    for b in found["openibd-restart-begin"]:
        code = _first_after(b, exits)
        if code is not None:
            if code.get("code") != "0":
                out.append(code)
        elif _first_after(b, oks) is None:
            out.append(b)
    return out


def _during_restart(ev: Evidence, windows: list[Window]) -> tuple[bool | None, Window | None]:
    """(True, the window) when ``ev``'s time is in one; False when its time is known on a
    window's clock and in none; None when no window's time can be compared with it."""
    if ev.stamp is None:
        return None, None
    answers = [(w.holds(ev.stamp), w) for w in windows]
    for held, w in answers:
        if held:
            return True, w
    return (False, None) if any(h is False for h, _ in answers) else (None, None)


def _symbol_cause(ev: Evidence) -> str:
    """What one "Unknown symbol"/"disagrees"/"needs unknown symbol" line says, from the
    kernel's err (kernel/module/main.c simplify_symbols: -EINVAL from check_version's
    CRC mismatch, -EBUSY from a provider still in its init, -ENOENT (0 before 4.x: a
    NULL symbol) for none exported)."""
    how, err, sym = ev.get("how") or "", ev.get("err"), ev.get("symbol") or ""
    if how.startswith(("disagrees", "version magic")) or err == "-22":
        return "crc"
    if err == "-16":
        return "busy"
    return "no-gpu-driver" if sym.startswith("nvidia_p2p") else "no-peer-api"


def classify(found: Found) -> list[Finding]:
    """One node's incidents: the rules, in one place."""
    out: dict[str, Finding] = {}

    seen: dict[str, set[Evidence]] = {}  # each finding's evidence, for a look-up in O(1)

    def add(kind: str, *evs: Evidence, note: str = "") -> None:
        f = out.setdefault(kind, Finding(kind))
        has = seen.setdefault(kind, set())
        for ev in evs:
            if ev not in has:
                has.add(ev)
                f.evidence.append(ev)
        if note and note not in f.notes:
            f.notes.append(note)

    windows = restart_windows(found)
    symbols = found["peermem-symbol"]
    crc = [e for e in symbols if _symbol_cause(e) == "crc"]
    busy = [e for e in symbols if _symbol_cause(e) == "busy"] + found["peermem-busy-provider"]
    explained: set[int] = set()  # ids of symbol lines some failed insert already took

    for ins in found["peermem-einval"]:
        same = [e for e in crc if _near(e, ins)]
        explained.update(id(e) for e in same)
        during, w = _during_restart(ins, windows)
        if during:
            add("peermem-load-race", ins, w.begin if w else ins, *same)
        elif same:
            note = ""
            if windows and during is None:
                note = (
                    "MOFED restarted in these logs too, at a time they do not let me compare "
                    "with the load's: if the load fell in that restart, it was the race"
                )
            add("peermem-abi-mismatch", ins, *same, note=note)
        elif windows and during is None:
            add(
                "peermem-load-race",
                ins,
                windows[0].begin,
                note="the load's time and the restart's are not on one clock in these logs; "
                "MOFED restarted, and no kernel line says the symbols disagree",
            )
        else:
            note = ""
            if during is False:
                note = "MOFED restarted in these logs, but not at the time of this load"
            add("peermem-einval-unexplained", ins, note=note)

    for e in crc:
        if id(e) in explained:
            continue
        during, w = _during_restart(e, windows)
        if during and w:
            add("peermem-load-race", e, w.begin)
        else:
            add("peermem-abi-mismatch", e)
    for e in busy:
        add("peermem-load-race", e)
    for e in symbols:
        cause = _symbol_cause(e)
        if cause in ("no-peer-api", "no-gpu-driver"):
            add(f"peermem-{cause}", e)
    for e in found["peermem-no-gpu-driver-loaded"]:
        add("peermem-no-gpu-driver" if e.get("provider") == "nvidia" else "peermem-no-peer-api", e)
    if found["peermem-not-built"]:
        add("peermem-not-built", *found["peermem-not-built"])
    # a failure with no reason in these logs: only when nothing above explains a load, and
    # not beside a signature rejection (secure boot: not this tool's incident)
    if (
        found["peermem-load-failed"]
        and not any(k.startswith("peermem-") for k in out)
        and not found["module-signature-rejected"]
    ):
        add("peermem-load-failed", *found["peermem-load-failed"])

    if found["storage-modules-loaded"]:
        add("storage-blocks-mofed", *found["storage-modules-loaded"])
    if found["storage-symbol"]:
        add("storage-module-other-stack", *found["storage-symbol"])
    if found["rdma-symbol"]:
        add("rdma-module-other-stack", *found["rdma-symbol"])
    if found["module-in-use"]:
        add("openibd-module-in-use", *found["module-in-use"])
    # openibd failed: said by its own [FAILED] lines, by the container, or by a restart
    # its trace does not see end; the more specific kinds above own their lines
    failed = found["openibd-failed"] + unfinished_restarts(found)
    if failed:
        owner = next(
            (k for k in ("openibd-module-in-use", "storage-blocks-mofed") if k in out), None
        )
        if owner:
            add(owner, *failed)
        else:
            note = ""
            if not found["openibd-failed"]:
                note = (
                    "the container's log shows openibd restart start and not end well "
                    "(no exit code 0, no 'Loading HCA driver and Access Layer: [ OK ]', no "
                    "ready flag after it): it failed, or the log was cut mid-restart"
                )
            add("openibd-restart-failed", *failed, note=note)
    if found["vf-no-netdev"]:
        add("vf-restore-before-netdev", *found["vf-no-netdev"])
    order = {i.kind: n for n, i in enumerate(INCIDENTS)}
    return sorted(out.values(), key=lambda f: order[f.kind])


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
                inc = _KINDS[finding.kind]
                doc: dict[str, Any] = {
                    "kind": inc.kind,
                    "title": inc.title,
                    "evidence": [_ev(e) for e in finding.evidence[:SHOW]],
                    "remedy": inc.remedy,
                    "prevented_by": list(inc.prevented_by),
                    "not_prevented_by": list(inc.not_prevented_by),
                    "sources": sorted({_BY_NAME[e.signature].source for e in finding.evidence}),
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
