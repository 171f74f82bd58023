"""What MOFED (the Network Operator's driver container) is doing, read from its markers.

Shared by every guard that waits on MOFED, so "restarting", "pending" and
"ready" mean one thing:

- **restart signals** (peermem): the ready flag absent, the blacklist file
  present (``openibd restart`` in progress), ``mlx5_core`` absent or leaving;
- **stale flag**: a flag incarnation present when a restart was seen counts
  again only once its identity (inode, mtime, ctime) differs;
- **pending** (storage): the ready flag is absent and MOFED is visibly about to
  install: its ``.lock`` is held (a ``FLOCK`` in /proc/locks on that file's
  device and inode; the agent never takes the lock, MOFED's entrypoint exits
  when it cannot get it), or the agent saw the flag removed;
- **ready**: the ready flag is present.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from nodeagent.core.snapshot import FileFact, FileId, NodeSnapshot

# "none": the node runs no MOFED (inbox RDMA, or no RDMA): peermem and storage do not apply.
MofedMode = Literal["container", "host", "none"]
MOFED_MODES: tuple[MofedMode, ...] = ("container", "host", "none")


@dataclass(frozen=True)
class MofedMarkers:
    """Where MOFED's markers live, relative to the host root."""

    ready: str = "run/mellanox/drivers/.driver-ready"
    lock: str = "run/mellanox/drivers/.lock"
    blacklist: str = "etc/modprobe.d/blacklist-ofed-modules.conf"
    driver_root: str = "run/mellanox/drivers"

    @property
    def files(self) -> frozenset[str]:
        return frozenset((self.ready, self.lock, self.blacklist))


def restart_signals(snap: NodeSnapshot, markers: MofedMarkers, mode: MofedMode) -> tuple[str, ...]:
    """Evidence that MOFED is restarting the RDMA stack right now."""
    signals = []
    if mode == "container":
        if not snap.file(markers.ready).present:
            signals.append("MOFED ready flag absent")
        if snap.file(markers.blacklist).present:
            signals.append("MOFED blacklist file present (openibd restart in progress)")
    mlx5 = snap.module("mlx5_core")
    if mlx5 is None:
        signals.append("mlx5_core not loaded")
    elif mlx5.initstate == "going":
        signals.append("mlx5_core unloading")
    return tuple(signals)


@dataclass(frozen=True)
class RestartTrack:
    """A guard's memory of MOFED restarts (each guard keeps its own copy)."""

    # A MOFED restart was seen and no fresh ready flag has appeared since.
    pending: bool = False
    # The flag incarnation present when the restart was seen: it is stale.
    stale_flag: FileId | None = None
    # The restart signals of the last pass, to report a restart once, when it begins.
    last_signals: tuple[str, ...] = ()


def track_restart(
    track: RestartTrack, signals: tuple[str, ...], ready: FileFact, mode: MofedMode
) -> tuple[RestartTrack, list[str]]:
    """The next track and the events worth a timeline line."""
    events: list[str] = []
    if signals:
        if not track.last_signals:
            events.append("MOFED restart began: " + "; ".join(signals))
        track = replace(track, pending=True, stale_flag=ready.ident if ready.present else None)
    elif track.pending and mode == "container":
        if ready.present and ready.ident != track.stale_flag:
            track = replace(track, pending=False, stale_flag=None)
            events.append("MOFED ready flag (re)created after the restart")
    elif track.pending:
        track = replace(track, pending=False, stale_flag=None)
    return replace(track, last_signals=signals), events


def lock_holders(snap: NodeSnapshot, markers: MofedMarkers) -> tuple[int, ...]:
    """Pids holding a FLOCK on MOFED's lock file (matched by device and inode)."""
    lock = snap.file(markers.lock)
    if not lock.present or lock.ident is None or lock.device is None:
        return ()
    return tuple(
        sorted(
            {
                held.pid
                for held in snap.locks
                if held.kind == "FLOCK"
                and held.inode == lock.ident.inode
                and held.device == lock.device
            }
        )
    )


def unreadable_markers(snap: NodeSnapshot, markers: MofedMarkers) -> list[str]:
    """MOFED's ready flag or lock that could not be read as a file (a symlink, a directory,
    a directory that cannot be opened): whether MOFED is installing cannot be told from
    them, and a lock that cannot be stat'ed cannot be matched in /proc/locks."""
    out = []
    for rel in (markers.ready, markers.lock):
        fact = snap.file(rel)
        if fact.problem and fact.problem != "not observed":
            out.append(f"{rel} {fact.problem}")
    return out


def pending_signals(
    snap: NodeSnapshot, markers: MofedMarkers, saw_flag_removed: bool
) -> tuple[str, ...]:
    """Why MOFED is about to install (empty when it is not): the flag absent and more."""
    if snap.file(markers.ready).present:
        return ()
    signals = []
    pids = lock_holders(snap, markers)
    if pids:
        signals.append(
            f"MOFED holds its lock {markers.lock} (pid {', '.join(str(p) for p in pids)})"
        )
    if saw_flag_removed:
        signals.append(f"MOFED ready flag {markers.ready} was removed")
    return tuple(signals)
