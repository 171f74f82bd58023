"""Seed 004 replayed on the real guest kernel, without and with the real agent (issue 40).

The incident: an NFS-over-RDMA mount attempted before MOFED is installed makes the
kernel load ``rpcrdma`` and its chain; the mount fails (the fabric is not up), the
chain stays loaded with no user; MOFED's container then refuses to install while
storage modules are loaded and crash-loops, and the node loses its GPUs.

Here every party is real but MOFED's installer: the mount is ``mount(2)`` with
``proto=rdma`` over Soft-RoCE (``rdma_rxe`` on a dummy netdev) to the netdev's own
address, where no NFS server listens, so the kernel loads the chain and refuses the
connection; MOFED is a shell script in its own mount namespace doing what the
container's entrypoint does (its flock on ``.lock``, the ready flag removed, the
seed's ``lsmod | egrep`` check and words), restarted by a kubelet stand-in; the
agent is ``nodeagent run`` as the DaemonSet runs it (``guest_agent.GuestAgent``).

``replay_storage(with_agent)`` returns one row (a bench can print the table); the
tests assert on the rows.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from tests import waiting
from tests.kobuild import require_tool
from tests.realkernel.guest_agent import GuestAgent
from tests.realkernel.loaded import kernel_lines, observed_names
from tests.realkernel.storage_setup import HOLD, LOCK, MOFED, READY, STORAGE, force_back, run

SEED = "004 NFS over RDMA before MOFED"


# Soft-RoCE on a dummy netdev; the NFS "server" is the netdev's own address, where
# nothing listens on 20049: the kernel loads the transport, then the connection is refused.
NETDEV, RXE = "na_seed0", "na_seedrxe0"


ADDR = "10.96.0.1"


MOUNT_POINT = Path("/mnt/seed004-shared")


# What a kubelet mounts for an NFS-over-RDMA volume (nfs(5)); soft: the failure comes
# back to the caller instead of retrying forever.
MOUNT_DATA = f"addr={ADDR},proto=rdma,port=20049,vers=4.1,soft,timeo=10,retrans=1"


KERNEL_WORDS = re.compile(r"rpc|nfs|rdma", re.IGNORECASE)  # dmesg lines worth a row


# The container's entrypoint, reduced to what seed 004 is about. Its lsmod | egrep is the
# seed's, verbatim (it counts "used by" columns too, as the real one does).
MOFED_SH = r"""
set -u
d=/run/mellanox/drivers
mkdir -p "$d"
# As the Go entrypoint takes it (gofrs/flock: open O_CREATE|O_RDONLY, then flock): the
# file made on the first start, reopened read-only after, which no inotify watch sees.
[ -e "$d/.lock" ] || : > "$d/.lock"
exec 9<"$d/.lock"
flock -n 9 || { echo "another MOFED holds $d/.lock, exiting"; exit 1; }
echo "Unsetting driver ready state"
rm -f "$d/.driver-ready"
sleep 1.7  # the entrypoint's own steps before its check: ~1.7 s in seed 004's log
storage_modules_loaded=$(lsmod | egrep 'ib_isert|nvme_rdma|nvmet_rdma|rpcrdma|xprtrdma|ib_srpt' -c)
if [ "$storage_modules_loaded" != 0 ]; then
    printf '%s %s\n' 'Storage modules are loaded for current driver, terminating prior driver' \
        'reload failure due to UNLOAD_STORAGE_MODULES not set to "true"'
    exit 1
fi
echo "Installing MOFED packages"
date +%s.%N > "$d/.installed"
echo "Current mlx5_core driver version: seed-004; setting driver ready state"
touch "$d/.driver-ready"
"""


RESTARTS = 3  # the kubelet's restarts of a refusing pod, without the agent


# With the agent: each attempt checks ~1.7 s after taking the lock, as the real entrypoint
# does (seed 004's log). The agent, never woken by a flock, sees MOFED pending only if a
# pass reads /proc/locks in that window: on the pod's first start the lock file's creation
# wakes one; a restart reopening it wakes none (docs/design.md, the storage guard's
# residual). The kubelet keeps restarting; this many restarts makes a miss of all unlikely.
RESTARTS_AGENT = 10


WAIT = 240.0  # a hang detector under TCG (~20x slower; the agent's passes take seconds)


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_ulong,
        ctypes.c_char_p,
    ]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    return libc


def nfs_rdma_mount() -> str:
    """``mount -t nfs -o proto=rdma`` as mount.nfs would call mount(2); the kernel's
    answer (strerror of the errno), "" when it mounted."""
    MOUNT_POINT.mkdir(parents=True, exist_ok=True)
    libc = _libc()
    rc = libc.mount(f"{ADDR}:/shared".encode(), bytes(MOUNT_POINT), b"nfs", 0, MOUNT_DATA.encode())
    return os.strerror(ctypes.get_errno()) if rc != 0 else ""


def _refcnt(name: str) -> int | None:
    for line in Path("/proc/modules").read_text().splitlines():
        fields = line.split()
        if fields[0] == name:
            return int(fields[2])
    return None


def _soft_roce_up() -> None:
    for argv in (
        ("ip", "link", "add", NETDEV, "type", "dummy"),
        ("ip", "addr", "add", f"{ADDR}/24", "dev", NETDEV),
        ("ip", "link", "set", NETDEV, "up"),
        ("rdma", "link", "add", RXE, "type", "rxe", "netdev", NETDEV),
    ):
        p = run(*argv)
        assert p.returncode == 0, (argv, p.stderr)


def mofed_attempt(script: Path) -> tuple[bool, list[str]]:
    """One run of MOFED's container (its own mount namespace); installed?, its words."""
    p = subprocess.run(
        ["unshare", "-m", "bash", str(script)],
        capture_output=True,
        text=True,
        timeout=WAIT,
        check=False,
    )
    words = (p.stdout + p.stderr).splitlines()
    assert p.returncode in (0, 1), (p.returncode, words)
    return p.returncode == 0, words


def _storage_loaded() -> set[str]:
    return STORAGE & observed_names()


def _agent_rows(agent: GuestAgent) -> tuple[list[str], list[str]]:
    """The storage guard's verdicts as the timeline recorded them (each change once),
    and the actions it performed."""
    verdicts: list[str] = []
    done: list[str] = []
    for r in agent.records():
        if r.get("guard") != "storage":
            continue
        if r.get("kind") == "decision" and (not verdicts or verdicts[-1] != r.get("verdict")):
            verdicts.append(str(r.get("verdict")))
        if r.get("kind") == "action" and r.get("ok"):
            done.append(str(r.get("action")))
    return verdicts, done


def idle() -> None:
    """The failed mount's transport is torn down asynchronously (rpcrdma keeps a reference
    for a moment after mount(2) returned): wait until nothing uses the chain."""
    waiting.until(lambda: not _refcnt("rpcrdma"), "rpcrdma unused after the mount", WAIT)


def replay_storage(
    with_agent: bool,
    restarts: int | None = None,
    agent_late: bool = False,
) -> dict[str, Any]:
    """Seed 004 on this kernel: the failed NFS-over-RDMA mount, then MOFED's pod started
    and restarted as a kubelet would (the volume's mount retried in between); with the
    agent, ``nodeagent run`` is up before MOFED's pod, or with ``agent_late`` only after
    its first refusal (MOFED already crash-looping: each restart reopens the lock file the
    first made, which wakes no watch). ``restarts``: how many times the kubelet restarts
    a refusing pod before the replay gives up."""
    if restarts is None:
        restarts = RESTARTS_AGENT if with_agent else RESTARTS
    for tool in ("ip", "rdma"):
        require_tool(tool, "iproute2")
    require_tool("unshare", "util-linux")
    require_tool("flock", "util-linux")
    before = observed_names()
    assert not STORAGE & before, sorted(STORAGE & before)
    flags = (READY, LOCK, HOLD, MOFED / ".installed")
    made = [d for d in (MOFED.parent, MOFED) if not d.exists()]  # removed afterwards
    for path in flags:
        path.unlink(missing_ok=True)
    row: dict[str, Any] = {"seed": SEED, "agent": with_agent}
    dmesg_before = len(kernel_lines(0))
    agent: GuestAgent | None = None
    mount_errors: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "mofed-entrypoint.sh"
        script.write_text(MOFED_SH)
        try:
            for name in ("dummy", "rdma_rxe"):
                p = run("modprobe", name)
                assert p.returncode == 0, p.stderr
            _soft_roce_up()
            # The shared volume's mount, before MOFED: the kernel loads the chain, fails.
            mount_errors.append(nfs_rdma_mount())
            row["rpcrdma_after_mount"] = "rpcrdma" in observed_names()
            # The failed transport is torn down asynchronously: idle once its reference goes.
            idle()

            def start_agent() -> GuestAgent:
                ga = GuestAgent().start()
                ga.until(
                    lambda: ga.verdict("storage") == "clear",
                    "the agent's storage verdict clear (MOFED not attempting now)",
                    WAIT,
                )
                return ga

            if with_agent and not agent_late:
                agent = start_agent()
            attempts: list[dict[str, Any]] = []
            retries: list[dict[str, Any]] = []  # the kubelet's retries of the mount
            tool_words: list[str] = []
            for n in range(1 + restarts):  # the pod, then the kubelet's restarts
                if n == 1 and with_agent and agent_late:
                    agent = start_agent()
                    row["agent_started_after"] = len(attempts)
                if n:
                    # Between MOFED's restarts (CrashLoopBackOff) the kubelet retries the
                    # volume's mount: without a hold it loads the chain again.
                    held = HOLD.exists() and not _storage_loaded()
                    mount_errors.append(nfs_rdma_mount())
                    after = sorted(_storage_loaded())
                    retries.append({"held": held, "error": mount_errors[-1], "after": after})
                    idle()
                loaded = sorted(_storage_loaded())
                installed, words = mofed_attempt(script)
                attempts.append({"installed": installed, "storage_loaded": loaded})
                tool_words += words
                if installed:
                    break
            row["attempts"] = attempts
            row["mount_retries"] = retries
            row["refusals"] = sum(not a["installed"] for a in attempts)
            row["mofed_installed"] = READY.exists()
            row["tool_words"] = list(dict.fromkeys(tool_words))
            if agent is not None and row["mofed_installed"]:
                ga = agent
                # The load-back's record is written once the load returned: waiting on it
                # (not only on /proc/modules) gives the row the agent's whole account.
                ga.until(
                    lambda: any(d.startswith("load rpcrdma") for d in _agent_rows(ga)[1]),
                    "the agent's load-back of rpcrdma once MOFED is ready",
                    WAIT,
                )
            row["storage_back"] = "rpcrdma" in observed_names() and not HOLD.exists()
            if agent is not None:
                row["agent_verdicts"], row["agent_done"] = _agent_rows(agent)
            row["mount_errors"] = mount_errors
            new = kernel_lines(dmesg_before)
            row["kernel_words"] = [
                *(f"mount(2): {e}" for e in dict.fromkeys(mount_errors)),
                *(line.split("] ", 1)[-1] for line in new if KERNEL_WORDS.search(line)),
            ]
        finally:
            if agent is not None:
                row["agent_exit"] = agent.stop()  # (its state and timeline removed)
            _libc().umount2(bytes(MOUNT_POINT), 2)  # MNT_DETACH; only if a mount worked
            with contextlib.suppress(OSError):
                MOUNT_POINT.rmdir()
            for path in flags:
                path.unlink(missing_ok=True)
            run("rdma", "link", "delete", RXE)
            run("ip", "link", "del", NETDEV)
            for d in reversed(made):
                with contextlib.suppress(OSError):
                    d.rmdir()
            force_back(before)
    row["left_loaded"] = sorted(observed_names() - before)
    return row
