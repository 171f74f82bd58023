"""The storage guard's facts, read under the host root: who uses the RDMA storage chain.

``/proc/locks`` (who holds MOFED's install lock), ``/proc/1/mountinfo``
(NFS-over-RDMA mounts), NVMe controllers (``/sys/class/nvme``) and NVMe-oF
target ports (configfs). These are the observer's default readers of those
facts (``host/observe.py``, ``Readers``), kept apart from it: each is a
bounded read and a parser that counts the lines it could not read rather than
raising.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from nodeagent.core.names import is_decimal
from nodeagent.core.snapshot import FileLock, Mount, NvmeController, NvmetPort
from nodeagent.host.fs import HostRoot

# -- the default readers --------------------------------------------------------

_MAX_PROC_TEXT = 4 << 20


def _read_proc(host: HostRoot, rel: str) -> tuple[str | None, list[str]]:
    try:
        return host.read_text(rel, _MAX_PROC_TEXT), []
    except FileNotFoundError:
        return None, [f"{rel} does not exist"]
    except OSError as exc:
        return None, [f"{rel} is unreadable: {exc.strerror}"]


def _read_parsed(
    host: HostRoot, rel: str, parse: Callable[[str], tuple[tuple[Any, ...], int]]
) -> tuple[tuple[Any, ...], list[str]]:
    text, problems = _read_proc(host, rel)
    if text is None:
        return (), problems
    facts, bad = parse(text)
    if bad:
        problems.append(f"{rel}: {bad} malformed line(s) ignored")
    return facts, problems


def read_proc_locks(host: HostRoot, rel: str) -> tuple[tuple[Any, ...], list[str]]:
    return _read_parsed(host, rel, parse_proc_locks)


def read_mountinfo(host: HostRoot, rel: str) -> tuple[tuple[Any, ...], list[str]]:
    return _read_parsed(host, rel, parse_mountinfo)


def parse_proc_locks(text: str) -> tuple[tuple[FileLock, ...], int]:
    """Held locks of /proc/locks (waiters, ``->``, are not holders) and the malformed count.

    ``1: FLOCK  ADVISORY  WRITE 1234 00:19:5678 0 EOF``: the device is
    ``major:minor`` in hex, the inode in decimal.
    """
    out: list[FileLock] = []
    bad = 0
    for line in text.splitlines():
        fields = line.split()
        if not fields:
            continue
        if len(fields) > 1 and fields[1] == "->":
            continue
        try:
            kind, _, access, pid, where = fields[1:6]
            major, minor, inode = where.split(":")
            out.append(
                FileLock(
                    kind=kind,
                    access=access,
                    pid=int(pid),
                    device=(int(major, 16), int(minor, 16)),
                    inode=int(inode),
                )
            )
        except ValueError:
            bad += 1
    return tuple(out), bad


_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> tuple[tuple[Mount, ...], int]:
    """``36 35 98:0 /root /mnt opts [optional...] - fstype source superopts``."""
    out: list[Mount] = []
    bad = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        left, sep, right = line.partition(" - ")
        lf, rf = left.split(), right.split()
        if not sep or len(lf) < 6 or len(rf) < 2:
            bad += 1
            continue
        superopts = rf[2].split(",") if len(rf) > 2 else []
        out.append(
            Mount(
                mount_point=_unescape(lf[4]),
                source=_unescape(rf[1]),
                fstype=rf[0],
                options=(*lf[5].split(","), *superopts),
            )
        )
    return tuple(out), bad


_TRANSPORT = re.compile(r"[a-z][a-z0-9-]{0,31}")
# An older kernel's controller may lack these; its transport it always has.
_OPTIONAL_NVME = frozenset({"subsysnqn", "address"})


def _list_entries(host: HostRoot, rel: str) -> tuple[list[str], list[str]]:
    """Names in a sysfs/configfs directory ([] when missing) and why it could not be listed
    (a file where the directory should be, no permission, an I/O error)."""
    try:
        return host.listdir(rel, strict=True), []
    except OSError as exc:
        return [], [f"{rel} unreadable: {exc.strerror}"]


def _read_attrs(
    host: HostRoot, d: str, attrs: tuple[str, ...], missing_ok: frozenset[str]
) -> tuple[dict[str, str], list[str]]:
    """Small attributes of one device directory ("" when unreadable) and what went wrong."""
    values: dict[str, str] = {}
    problems: list[str] = []
    for attr in attrs:
        try:
            values[attr] = host.read_text(f"{d}/{attr}", 4096).strip()
        except FileNotFoundError:
            values[attr] = ""
            if attr not in missing_ok:
                problems.append(f"{attr} does not exist")
        except OSError as exc:
            values[attr] = ""
            problems.append(f"{attr} unreadable: {exc.strerror}")
    return values, problems


def _transport(raw: str, attr: str, problems: list[str]) -> str:
    """A transport name as the kernel writes it, else "unknown" (and why, unless it was empty)."""
    if _TRANSPORT.fullmatch(raw):
        return raw
    if raw:
        problems.append(f"{attr} is {raw[:40]!r} (not a transport name)")
    return "unknown"


def read_nvme(host: HostRoot, rel: str) -> tuple[tuple[NvmeController, ...], list[str]]:
    """Controllers under /sys/class/nvme: transport, subsystem NQN, address.

    What cannot be read rides on the controller (``problem``; transport
    "unknown"); a class directory that cannot be listed is the reader's problem.
    """
    out: list[NvmeController] = []
    names, unlisted = _list_entries(host, rel)
    for name in names:
        if not re.fullmatch(r"nvme\d{1,10}", name):  # the kernel's nvme%d, any instance
            continue
        values, problems = _read_attrs(
            host, f"{rel}/{name}", ("transport", "subsysnqn", "address"), _OPTIONAL_NVME
        )
        out.append(
            NvmeController(
                name=name,
                transport=_transport(values["transport"], "transport", problems),
                subsysnqn=values["subsysnqn"],
                address=values["address"],
                problem="; ".join(problems) or None,
            )
        )
    return tuple(out), unlisted


def read_nvmet_ports(host: HostRoot, rel: str) -> tuple[tuple[NvmetPort, ...], list[str]]:
    """NVMe-oF target ports in configfs: transport, address and linked subsystems.

    What cannot be read rides on the port (``problem``; transport "unknown").
    """
    out: list[NvmetPort] = []
    names, unlisted = _list_entries(host, rel)
    for name in names:
        if not is_decimal(name):
            continue
        d = f"{rel}/{name}"
        values, problems = _read_attrs(
            host, d, ("addr_trtype", "addr_traddr", "addr_trsvcid"), frozenset()
        )
        subsystems, unlinked = _list_entries(host, f"{d}/subsystems")
        problems += [p.removeprefix(f"{d}/") for p in unlinked]
        out.append(
            NvmetPort(
                name=name,
                transport=_transport(values["addr_trtype"], "addr_trtype", problems),
                address=f"{values['addr_traddr']}:{values['addr_trsvcid']}",
                subsystems=tuple(subsystems),
                problem="; ".join(problems) or None,
            )
        )
    return tuple(out), unlisted
