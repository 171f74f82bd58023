"""A driver-container-like process, started as a container runtime starts one.

``build_lower`` makes an image layer: the given tools with their libraries, and
the entrypoint script ``/usr/local/bin/nvidia-driver`` (``#!/bin/sh``, waits on
stdin). ``start`` mounts a fresh overlay over it *only inside a new mount
namespace* (the host's mount table never shows it, as with containerd) and
``exec``s into it: ``unshare`` → ``sh`` → ``chroot`` → the script, all one pid,
so the pid appears under ``/proc`` first as ``unshare …`` and becomes
``/bin/sh /usr/local/bin/nvidia-driver init`` at the last ``exec``, like
``runc init`` becoming the entrypoint. Closing its stdin ends it, and its mount
namespace, and so the overlay, go with it.

Used by ``tests/guards/peermem/test_container_roots.py`` on this machine's kernel and by the
real-kernel suite, where modules are loaded from the same kind of root.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

ENTRYPOINT = "/usr/local/bin/nvidia-driver"
SCRIPT = "#!/bin/sh\nread x\n"
# The same command, whose first line read makes it chroot into /flip (the image needs chroot).
FLIP_ENTRYPOINT = "/opt/flip/nvidia-driver"
FLIP_SCRIPT = "#!/bin/sh\nread x\nexec chroot /flip /bin/sh -c 'read y'\n"


def _copy_in(lower: Path, path: str) -> None:
    """The file at ``path`` and at its resolved path (links become copies: simpler than
    rebuilding each distribution's merged-/usr links, and the loader finds both)."""
    real = os.path.realpath(path)
    for p in {path, real}:
        dest = Path(f"{lower}{p}")
        if not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(real, dest)


def build_lower(lower: Path, tools: list[str]) -> None:
    """An image layer with ``/bin/sh``, ``tools`` (absolute paths) and their libraries."""
    tools = ["/bin/sh", *tools]
    for t in tools:
        _copy_in(lower, t)
    ldd = subprocess.run(["ldd", *tools], capture_output=True, text=True).stdout.split()
    for lib in (w for w in ldd if w.startswith("/") and os.path.exists(w)):
        _copy_in(lower, lib)
    for d in ("proc", "dev", "tmp"):
        (lower / d).mkdir(exist_ok=True)
    for path, text in ((ENTRYPOINT, SCRIPT), (FLIP_ENTRYPOINT, FLIP_SCRIPT)):
        script = Path(f"{lower}{path}")
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(text)
        script.chmod(0o755)


def driver_image(
    lower: Path,
    entry: str,
    kver: str,
    modules: Mapping[str, Path],
    tools: Sequence[str] = (),
) -> None:
    """A GPU driver image layer: kmod's tools under ``/usr/sbin``, ``entry`` as its
    entrypoint script, and ``modules`` (a path under ``lib/modules/<kver>/`` -> a built
    ``.ko``) with the ``modules.dep`` its own ``depmod`` writes; ``tools`` (absolute
    paths), more of the host's tools with their libraries (e.g. ``mount``)."""
    kmod = shutil.which("kmod") or "/usr/bin/kmod"
    build_lower(lower, [kmod, *tools])
    (lower / ENTRYPOINT.lstrip("/")).write_text(entry)
    (lower / "usr/sbin").mkdir(parents=True, exist_ok=True)
    for n in ("modprobe", "insmod", "modinfo", "depmod"):
        os.symlink(kmod, lower / "usr/sbin" / n)
    tree = lower / f"lib/modules/{kver}"
    for rel, ko in modules.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ko, tree / rel)
    subprocess.run(["chroot", str(lower), "/usr/sbin/depmod", kver], check=True)


@dataclass
class Container:
    proc: subprocess.Popen[bytes]
    merged: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def enter(self, *argv: str) -> list[str]:
        """``argv`` run inside: the container's mount namespace and root."""
        return ["nsenter", "-t", str(self.pid), "-m", "-r", *argv]

    def send(self, line: str) -> None:
        """A line on its stdin (an entrypoint that waits on ``read`` goes on)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start(
    lower: Path,
    top: Path,
    argv: tuple[str, ...] = (ENTRYPOINT, "init"),
    *,
    drop_sys_module: bool = False,
    user_namespace: bool = False,
    flip_to_tmpfs: bool = False,
    flip_to_overlay: bool = False,
    bidirectional: Path | None = None,
    output: IO[bytes] | None = None,
) -> Container:
    """A container start: a new overlay (its own upper/work under ``top``), entered.

    ``drop_sys_module``: ``CAP_SYS_MODULE`` dropped from its bounding set (every
    unprivileged pod); ``user_namespace``: in a user namespace of its own, root inside
    (``unshare -U -r``: a full capability set, relative to that namespace);
    ``flip_to_tmpfs``: a tmpfs holding a copy of the image is mounted at ``/flip`` in its
    namespace, and the first line on its stdin makes it ``exec chroot /flip``: its root
    becomes that tmpfs, same pid (a process flipping its root under a scanner);
    ``flip_to_overlay``: the same with a second overlay of the image (upper/work of its
    own) at ``/flip``: a driver container that ``chroot``s into a new overlay;
    ``bidirectional``: a host directory, a *shared* mount (``mount --make-rshared``), bound
    at the same path in its root as a pod's ``mountPropagation: Bidirectional`` volume is:
    what the container mounts under it, the host sees there (and the container gets a
    ``/proc``, which its ``mount`` and ``findmnt`` read). As containerd does for such a pod
    (its root ``rshared``), the namespace keeps the host's propagation (``unshare
    --propagation unchanged``), so every shared mount of the host stays a peer: use it
    where the others are private (the real-kernel guest's are);
    ``output``: where its stdout and stderr go (the container's log), inherited otherwise."""
    n = len(list(top.glob("start-*")))
    base = top / f"start-{n}"
    upper, work, merged = base / "u", base / "w", base / "m"
    for d in (upper, work, merged):
        d.mkdir(parents=True)
    opts = f"lowerdir={lower},upperdir={upper},workdir={work}"
    script = f"mount -t overlay overlay -o {opts} {merged}"
    if flip_to_tmpfs:
        script += (
            f" && mkdir -p {merged}/flip && mount -t tmpfs tmpfs {merged}/flip"
            f" && cp -a {lower}/. {merged}/flip/"
        )
        argv = (FLIP_ENTRYPOINT, "init")
    if flip_to_overlay:
        fu, fw = base / "fu", base / "fw"
        fu.mkdir()
        fw.mkdir()
        fopts = f"lowerdir={lower},upperdir={fu},workdir={fw}"
        script += f" && mkdir -p {merged}/flip && mount -t overlay overlay -o {fopts} {merged}/flip"
        argv = (FLIP_ENTRYPOINT, "init")
    propagation = "private"
    if bidirectional is not None:
        # A bind of a shared mount joins its peer group: mounts under it propagate both ways.
        inside = f"{merged}{bidirectional}"
        script += (
            f" && mount -t proc proc {merged}/proc"
            f" && mkdir -p {inside} && mount --rbind {bidirectional} {inside}"
        )
        propagation = "unchanged"
    drop = "setpriv --bounding-set -sys_module " if drop_sys_module else ""
    script += f' && exec {drop}chroot {merged} "$@"'
    userns = ["-U", "-r"] if user_namespace else []
    proc = subprocess.Popen(
        ["unshare", *userns, "-m", "--propagation", propagation, "sh", "-c", script, "sh", *argv],
        stdin=subprocess.PIPE,
        stdout=output,
        stderr=None if output is None else subprocess.STDOUT,
    )
    return Container(proc, merged)
