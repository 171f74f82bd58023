"""What the fanotify peermem hold holds: which opens, and which processes' roots it marks.

**Which opens** (``held_open``): a module loader's open, while the peermem gate is
closed, of

- ``nvidia-peermem.ko`` (any compression), from any tree: the seeds' load;
- an RDMA core module (``ib_core``, ``ib_uverbs``, ``mlx5_core``, ...) from the
  kernel's own tree (``lib/modules/<kver>/kernel/``): a held peermem load pulls
  its dependencies first (modprobe inserts them before it opens peermem), so an
  inbox ``ib_core`` would go in before MOFED's and MOFED's install then fails on
  it — the seeds' failure by another road. MOFED's own modules live under
  ``updates/`` or ``extra/`` and are never held, so MOFED's ``openibd`` never
  waits on the gate that waits on it.

**Which roots**:

The GPU Operator's ``nvidia-driver-ctr`` loads ``nvidia-peermem`` from its own
root, before it bind-mounts that root at ``/run/nvidia/driver``, and each start
is a new overlay; so the hold marks each driver container's root as it starts
(``guards/peermem/roots.py``). Cgroup paths under containerd and CRI-O name a pod
and a container *id*, not the container's name, so the rule reads the command
line, which is the one thing the DaemonSet sets and every runtime shows:

- ``nvidia-driver init``: the driver container as shipped (every distribution,
  precompiled or not: ``command: [nvidia-driver]``, ``args: [init]``);
- ``ocp_dtk_entrypoint nv-ctr-run-with-dtk``: the same container on OpenShift
  with the Driver Toolkit.

A rule is words: the first is a command's file name, the rest are the
arguments that must follow it. A script started through its ``#!`` line shows
as ``/bin/bash /usr/local/bin/nvidia-driver init`` (perhaps with one
interpreter option), so the command may stand at ``argv[0]``, ``[1]`` or
``[2]``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from nodeagent.errors import NodeagentError

DRIVER_CONTAINER_RULES: tuple[str, ...] = (
    "nvidia-driver init",
    "ocp_dtk_entrypoint nv-ctr-run-with-dtk",
)
MAX_RULES = 32

PEERMEM_FILE = re.compile(r"nvidia[-_]peermem\.ko(\.(xz|zst|gz))?")
# The modules MOFED replaces that nvidia-peermem's dependency chain can pull.
INBOX_RDMA_MODULES = frozenset(
    {"ib_core", "ib_uverbs", "ib_cm", "iw_cm", "rdma_cm", "ib_umad", "mlx5_core", "mlx5_ib"}
)
_MODULE_FILE = re.compile(r"(?P<name>[^/]+)\.ko(\.(xz|zst|gz))?")
_KERNEL_TREE = re.compile(r"/lib/modules/[^/]+/kernel/")


def held_open(path: str) -> str | None:
    """Why a module loader's open of ``path`` waits for the gate (None: it does not)."""
    base = path.rsplit("/", 1)[-1]
    if PEERMEM_FILE.fullmatch(base):
        return "nvidia-peermem"
    m = _MODULE_FILE.fullmatch(base)
    if m and m["name"].replace("-", "_") in INBOX_RDMA_MODULES and _KERNEL_TREE.search(path):
        return "inbox RDMA dependency"
    return None


_MAX_WORD = 255


def parse_rules(key: str, value: Any) -> tuple[str, ...]:
    """A config list of rules, each normalised to single-spaced words; NodeagentError
    naming the bad entry."""
    if not isinstance(value, list) or not value:
        raise NodeagentError(f"config {key}: expected a non-empty list of command rules")
    if len(value) > MAX_RULES:
        raise NodeagentError(f"config {key}: {len(value)} rules, at most {MAX_RULES}")
    rules: list[str] = []
    for item in value:
        words = item.split() if isinstance(item, str) else []
        if not words:
            raise NodeagentError(f"config {key}: {item!r} is not a command rule (words)")
        for w in words:
            if len(w) > _MAX_WORD or not w.isprintable():
                raise NodeagentError(f"config {key}: {item!r} has an odd word {w[:40]!r}")
        if "/" in words[0]:
            raise NodeagentError(
                f"config {key}: {item!r}: the command is a file name, without a directory"
            )
        rules.append(" ".join(words))
    return tuple(rules)


def split_cmdline(raw: bytes) -> list[str]:
    """``/proc/<pid>/cmdline`` (NUL-separated) as words; undecodable bytes replaced."""
    text = raw.decode("utf-8", "replace")
    return text.rstrip("\0").split("\0") if text.strip("\0") else []


def matching_rule(argv: Sequence[str], rules: Sequence[str]) -> str | None:
    """The first rule ``argv`` matches, or None."""
    for rule in rules:
        command, *args = rule.split()
        for i in range(min(3, len(argv))):
            if argv[i].rsplit("/", 1)[-1] != command:
                continue
            if list(argv[i + 1 : i + 1 + len(args)]) == args:
                return rule
    return None


# What a kernel module file can start with: an ELF relocatable object (``ET_REL``, either
# byte order) or a compressed one (xz, zstd, gzip: ``.ko.xz``, ``.ko.zst``, ``.ko.gz``).
_COMPRESSED_MAGIC = (b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd", b"\x1f\x8b")
MODULE_HEAD_BYTES = 18  # enough for e_ident and e_type
_ET_REL = 1


def could_be_module(head: bytes) -> bool:
    """Whether a regular file that starts with ``head`` could be loaded as a module.

    The hold filters in the kernel (an ignore mark) only files that could not: a file
    is a target by its name, and a renamed or linked file keeps its inode's mark, so
    no file whose content could be a module is ever ignored, whatever it is called.
    A write clears the mark (``host/fanotify.IgnoreMarks``), so content that becomes a
    module later is seen again."""
    if head.startswith(b"\x7fELF"):
        if len(head) < MODULE_HEAD_BYTES:
            return True  # a header cut short: not ruled out
        e_type = head[16:18] if head[5] == 1 else head[17:15:-1]  # little-endian, or big
        return int.from_bytes(e_type, "little") == _ET_REL
    return head.startswith(_COMPRESSED_MAGIC)
