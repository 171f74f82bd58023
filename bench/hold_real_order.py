"""The hold in the GPU driver container's real order: MOFED's ready flag -> the held load done.

    .venv/bin/python bench/hold_real_order.py [--trials 100]

The real ``nvidia-driver init`` (gpu-driver-container ``ubuntu22.04/nvidia-driver``
``init()``, 842-843; ``rhel9`` 873-875) loads ``nvidia-peermem`` from its own root (the
container's overlay) and bind-mounts that root at the host's ``/run/nvidia/driver`` only
after the load: while its ``modprobe`` is held, the host's ``run/nvidia/driver`` is empty,
and the agent judges the held file itself (the responder reads its facts from the
event's descriptor; the lease carries the file's verdict). Here, as in
``tests/guards/peermem/test_hold_real_order.py``:

- the node is ``bench/hold_latency.py``'s at real size (250 modules loaded, a ~6000-line
  ``modules.dep`` in the host's and MOFED's trees: ``bench/gate_latency.py``'s fillers),
  ``/run`` a tmpfs, the GPU driver's tree (its padded ``modules.dep`` too) moved into the
  container's image, the host's ``run/nvidia/driver`` an empty directory;
- the container is a real overlay in a mount namespace of its own (``tests/containerroot``),
  its command line ``nvidia-driver init``, marked by the agent's container scanner;
- the agent is ``Agent``'s real loop (enforce mode, real inotify, ``hold_loads =
  "fanotify"``, no ``hold_roots``), its responder a process apart;
- each trial runs ``modprobe <the image's nvidia-peermem.ko>`` (a copy of ``cat`` named
  ``modprobe``) in the container's namespaces (``nsenter -m -r``) with the ready flag
  absent, waits until it is held and the agent has judged the held file (``wait``: the
  ready flag's reason) and the loop is idle, then creates the flag as ``touch`` does and
  times flag -> the loader's exit; then removes the flag and waits for the node at rest.

Each process's times are ``CLOCK_MONOTONIC`` (the stopwatch is ``hold_latency.py``'s, a
process of its own). It prints figures, never asserts them. Needs root, host PIDs, an
overlay mount and a fanotify permission group: says so and exits 0 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this tree's nodeagent and tests/ (tests.containerroot)
sys.path.insert(1, str(REPO / "bench"))

from hold_latency import (  # noqa: E402
    KVER,
    bench_agent,
    flag_trials,
    pad_to_real_size,
    print_latency,
    wait,
)

import nodeagent  # noqa: E402
from nodeagent.core.peermem import PeermemPolicy  # noqa: E402
from nodeagent.guards.peermem.side import PeermemHold  # noqa: E402
from nodeagent.guards.peermem.start import sees_host_pids  # noqa: E402
from nodeagent.host.fanotify import FanotifyGroup  # noqa: E402
from nodeagent.sim.node import Node  # noqa: E402
from nodeagent.sim.scenarios import stack_node  # noqa: E402
from tests import containerroot  # noqa: E402
from tests.guards.peermem.rig import overlay_works  # noqa: E402

PEERMEM_IN_IMAGE = f"/lib/modules/{KVER}/kernel/drivers/video/nvidia-peermem.ko"
BUDGET_S = 120.0  # a load let go by its budget, not by its verdict, is no trial
# The container's command line, and the agent's rule for it: ``nvidia-driver init`` but
# for the command's name. Every agent on a node marks each container whose command line
# its rules match (the default rules: ``nvidia-driver init``), and on this shared machine
# other suites' agents run (one left behind by a killed test held this bench's loader
# for its own 900 s budget): a name of its own keeps the bench's container to its agent.
ENTRYPOINT = "/usr/local/bin/nvidia-driver-bench"
RULE = "nvidia-driver-bench init"


def why_not_here(probe: Path) -> str | None:
    """Why this machine cannot run the bench (None: it can)."""
    if os.geteuid() != 0:
        return "not root (mount, overlay, fanotify)"
    if not sees_host_pids():
        return "this process does not see host PIDs (the hold refuses to start)"
    probe.mkdir(parents=True)
    why = overlay_works(probe)  # the tools, an overlay in a mount namespace of its own
    if why:
        return why
    try:
        FanotifyGroup().close()
    except OSError as exc:
        return f"this kernel refuses a fanotify permission group: {exc}"
    return None


def real_order_node(top: Path) -> tuple[Node, Path, Path, tuple[int, int]]:
    """(the node, its host root, the driver image's lower layer, (modules loaded, lines of
    the largest modules.dep)): the host's ``run/nvidia/driver`` empty, its tree in the
    image with the loader."""
    host = top / "host"
    run = host / "run"
    run.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "nodeagent-bench-run", str(run)], check=True)
    node = stack_node(host, KVER)
    size = pad_to_real_size(host, node)
    modprobe = top / "bin/modprobe"  # a module loader by name, outside any mark
    modprobe.parent.mkdir()
    shutil.copy("/bin/cat", modprobe)
    lower = top / "lower"
    containerroot.build_lower(lower, [str(modprobe)])
    shutil.copy(lower / containerroot.ENTRYPOINT.lstrip("/"), lower / ENTRYPOINT.lstrip("/"))
    driver = host / "run/nvidia/driver"
    shutil.copytree(driver, lower, dirs_exist_ok=True)  # the image's /lib/modules/<kver>
    assert (lower / PEERMEM_IN_IMAGE.lstrip("/")).is_file()
    shutil.rmtree(driver)
    driver.mkdir()  # the mount point, empty: the container mounts its root after its load
    return node, host, lower, size


def held_open_endings(host: Path, pids: set[int]) -> collections.Counter[str]:
    timeline = host / "var/lib/nodeagent/timeline.jsonl"
    out: collections.Counter[str] = collections.Counter()
    for line in timeline.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "held-open":
            out[str(rec.get("ended")) + ("" if rec.get("pid") in pids else " (not a trial's)")] += 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=100)
    args = ap.parse_args()
    print(f"# command: {shlex.join([sys.executable, *sys.argv])}")
    print(
        f"# machine: {os.cpu_count()} cpus, kernel {os.uname().release}, python "
        f"{sys.version.split()[0]}, nodeagent from {Path(nodeagent.__file__).parent}"
    )
    top = Path(tempfile.mkdtemp(prefix="nodeagent-bench-realorder-"))
    why = why_not_here(top / "probe")
    if why:
        print(f"bench: {why}; nothing measured")
        shutil.rmtree(top, ignore_errors=True)
        return 0
    # Everything on a tmpfs of its own: a filesystem mark on the disk /tmp is on (another
    # agent's hold_roots, or one a killed test left) would hold the image's files too.
    subprocess.run(["mount", "-t", "tmpfs", "nodeagent-bench-top", str(top)], check=True)
    node, host, lower, (loaded, dep_lines) = real_order_node(top)
    print(
        f"# node: {loaded} modules loaded, modules.dep of {dep_lines} lines in each tree "
        "(host, MOFED's; the GPU driver's in its image); the host's run/nvidia/driver empty"
    )

    pol = PeermemPolicy(
        hold_loads="fanotify", hold_roots=(), hold_budget_s=BUDGET_S, hold_containers=(RULE,)
    )
    agent = bench_agent(host, node, pol)
    thread = threading.Thread(target=agent.run, daemon=True)
    container = None
    pids: set[int] = set()
    try:
        thread.start()
        side = agent.side("peermem")
        assert isinstance(side, PeermemHold)
        wait(lambda: side.hold is not None and side.containers is not None, "the hold started")
        starts = top / "starts"
        starts.mkdir()
        container = containerroot.start(lower, starts, (ENTRYPOINT, "init"))
        wait(lambda: side.containers is not None and side.containers.roots(), "its root marked")
        loader = container.enter(str(top / "bin/modprobe"), PEERMEM_IN_IMAGE)
        print(
            f"# container: {ENTRYPOINT} init (pid {container.pid}, rule {RULE!r}); "
            f"loader: {shlex.join(loader)}"
        )

        def judged_wait(pid: int) -> bool:
            pids.add(pid)
            return any(
                e["verdict"] == "wait" and e["path"].endswith(PEERMEM_IN_IMAGE)
                for e in side.held_judged
            )

        lat, cpu = flag_trials(agent, thread, node, loader, args.trials, held=judged_wait)
        time.sleep(0.2)  # the last held open's record
        ends = held_open_endings(host, pids)
    finally:
        agent.stop()
        thread.join(10)
        if container is not None:
            container.stop()
        node.kernel.uevent_source.close()
        subprocess.run(["umount", "-l", str(host / "run")], capture_output=True)
        subprocess.run(["umount", "-l", str(top)], capture_output=True)
        shutil.rmtree(top, ignore_errors=True)
    print_latency("ready flag -> held load done, real order", lat, cpu)
    print("  held opens ended: " + ", ".join(f"{k} {v}" for k, v in sorted(ends.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
