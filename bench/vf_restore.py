"""VF restore: from each VF netdev's appearance to its whole config back, agent vs MOFED's method.

127 VFs on one PF of the simulated kernel (the agent's real loop, observer,
guard and executor; its netlink is the simulator's). The VFs are configured
(MAC, VLAN/QoS, trust, spoofchk, link state, rate, MTU, up), the agent takes
its snapshot, ``sriov_numvfs`` goes to 0 and back with autoprobe off, and each
VF is bound (its netdev appears) at a random time within 0-5 s of wall time.

Measured, in wall time, per VF: appearance -> config back (p50, p99, max), and
last netdev -> all 127 back. Then MOFED's method on the same VFs and the same
appearance times, run for real against the same kernel: ``BIND_DELAY_SEC``
(4 s) after ``sriov_numvfs``, then one VF after another, exiting on the first
VF whose netdev is not there (as the DOCA container does). Its per-VF cost on
a real node is ~6.45 s (seed 003); here its own calls take microseconds, so
the all-restored time of "MOFED had it waited for every netdev" is also given
with the seed's per-VF cost, and the ratio to the agent is taken from that.

    .venv/bin/python bench/vf_restore.py [--vfs 127] [--spread 5] [--seed 1]
    .venv/bin/python bench/vf_restore.py --igb [--vfs 4]   # real kernel, QEMU igb (TCG)

``--igb`` boots the real-kernel harness's VM (tests/realkernel: a Debian kernel,
q35 with QEMU's igb, an 82576 SR-IOV PF) and measures there: real igbvf
netdevs bound one by one at random times, the agent's real loop (kernel
uevents, pyroute2). Under TCG (software emulation) every figure is slowed by
the emulation; they are labelled so.
"""

from __future__ import annotations

import argparse
import random
import shlex
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from nodeagent.agent import Agent
from nodeagent.config import Config
from nodeagent.core.sriov import SriovMemory, SriovPolicy
from nodeagent.sim.kernel import PF_FIELDS, SimKernel, VfConfig
from nodeagent.sim.modtree import RDMA_MODULES, Generation, depmod, install_generation
from nodeagent.sim.netlink import SimSriovOps

KVER = "6.1.0-bench"
PF, PF_PCI = "enp1s0f0", "0000:01:00.0"
BIND_DELAY_S = 4.0  # MOFED's BIND_DELAY_SEC
SEED_PER_VF_S = 6.45  # seed 003: ~6.4 s per VF in MOFED's serial loop


def wanted(i: int) -> VfConfig:
    return VfConfig(
        mac=f"02:00:00:00:{i // 256:02x}:{i % 256:02x}",
        vlan=100 + i,
        qos=i % 8,
        trust=True,
        spoofchk=False,
        link_state="enable",
        max_tx_rate=1000 + i,
        mtu=9000,
        admin_up=True,
    )


class TimedOps(SimSriovOps):
    """The simulator's netlink, noting when each VF's whole config is back."""

    def __init__(
        self, kernel: SimKernel, want: list[VfConfig], hang: tuple[int, float] | None = None
    ) -> None:
        super().__init__(kernel)
        self.want = want
        self.hang = hang  # (VF index, seconds): that VF's first netlink write hangs
        self.back_at: dict[int, float] = {}
        self.armed = False
        self.lock = threading.Lock()

    def _check(self) -> None:
        if not self.armed:
            return
        now = time.monotonic()
        with self.lock:
            for vf in self.kernel.pfs[PF].vfs:
                if vf.index not in self.back_at and vf.config == self.want[vf.index]:
                    self.back_at[vf.index] = now

    def set_vf(self, pf_ifname: str, index: int, values: Any) -> None:
        if self.armed and self.hang is not None and index == self.hang[0]:
            seconds, self.hang = self.hang[1], None
            time.sleep(seconds)  # a netlink write that hangs (once)
        super().set_vf(pf_ifname, index, values)
        self._check()

    def set_link(self, ifname: str, name: str, value: Any) -> None:
        super().set_link(ifname, name, value)
        self._check()


def build_kernel(root: Path, n: int) -> SimKernel:
    k = SimKernel(root, KVER, init_delay=0.0, exit_delay=0.0)
    moddir = root / "lib/modules" / KVER
    install_generation(moddir, KVER, Generation("b", "MOFED bench", "25.10"), RDMA_MODULES)
    depmod(moddir)
    k.add_pf(PF, PF_PCI, totalvfs=max(128, n), probe_delay=0.0)
    k.probe("mlx5_core", str(moddir))
    k.sched.run(k.sched.now() + 1)
    (root / "run/mellanox/drivers").mkdir(parents=True, exist_ok=True)
    (root / "run/mellanox/drivers/.driver-ready").write_text("")
    return k


def configure(k: SimKernel, n: int) -> list[VfConfig]:
    pf = k.pfs[PF]
    pf.autoprobe = False
    k.write_sriov_numvfs(PF, n)
    want = [wanted(i) for i in range(n)]
    for i, cfg in enumerate(want):
        k.bind_vf(PF, i)
        k.set_vf(PF, i, **{f: getattr(cfg, f) for f in PF_FIELDS})
        netdev = k.vf_netdev(PF, i)
        assert netdev is not None
        k.set_link(netdev, mtu=cfg.mtu, admin_up=cfg.admin_up)
    return want


def recreate(k: SimKernel, n: int) -> float:
    """sriov_numvfs to 0 and back (autoprobe off): VFs without drivers or netdevs."""
    k.write_sriov_numvfs(PF, 0)
    t = time.monotonic()
    k.write_sriov_numvfs(PF, n)
    return t


def bind_on_schedule(
    k: SimKernel, t0: float, schedule: list[tuple[float, int]]
) -> dict[int, float]:
    appeared: dict[int, float] = {}
    for at, i in schedule:
        delay = t0 + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        k.bind_vf(PF, i)
        appeared[i] = time.monotonic()
    return appeared


def wait_until(cond: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def run_agent(
    k: SimKernel,
    n: int,
    want: list[VfConfig],
    schedule: list[tuple[float, int]],
    hang: tuple[int, float] | None = None,
) -> dict[str, Any]:
    ops = TimedOps(k, want, hang)
    policy = SriovPolicy(numvfs_owner="mofed", poll_s=2.0)
    cfg = Config(host_root=str(k.root), mode="enforce", uevents=False, policies={"sriov": policy})
    agent = Agent(
        cfg,
        module_ops=k,
        kernel_log=k.kernel_messages,
        wake_sources=[k.uevent_source],
        guard_ports={"sriov": ops},
    )
    thread = threading.Thread(target=agent.run, name="nodeagent", daemon=True)
    thread.start()

    def snapshot_taken() -> bool:
        mem = agent.memory.get("sriov")
        return (
            isinstance(mem, SriovMemory)
            and PF_PCI in mem.pfs
            and mem.pfs[PF_PCI].phase == "stable"
            and len(mem.pfs[PF_PCI].saved.vfs) == n
            and all(v.settings.get("mtu") == 9000 for v in mem.pfs[PF_PCI].saved.vfs)
        )

    k.uevent_source.push("bench: configured")
    if not wait_until(snapshot_taken, 60):
        raise SystemExit("the agent did not take its snapshot of the configured VFs")
    ops.armed = True
    t0 = recreate(k, n)
    k.uevent_source.push("bench: numvfs")
    appeared = bind_on_schedule(k, t0, schedule)
    ok = wait_until(lambda: len(ops.back_at) == n, 60)
    agent.stop()
    thread.join(10)
    if not ok:
        raise SystemExit(f"only {len(ops.back_at)}/{n} VFs got their config back")
    lat = [ops.back_at[i] - appeared[i] for i in range(n)]
    return {
        "latency": lat,
        "last_netdev_to_all": max(ops.back_at.values()) - max(appeared.values()),
        "numvfs_to_all": max(ops.back_at.values()) - t0,
        "passes": agent.passes,
    }


def run_mofed(
    k: SimKernel, n: int, want: list[VfConfig], schedule: list[tuple[float, int]]
) -> dict[str, Any]:
    """MOFED's restore on the same appearance schedule: bind delay, serial, exit on a miss."""
    t0 = recreate(k, n)
    binder = threading.Thread(target=bind_on_schedule, args=(k, t0, schedule), daemon=True)
    binder.start()
    time.sleep(BIND_DELAY_S)
    restored, failed_at, failed_t = 0, None, None
    for i in range(n):
        netdev = k.vf_netdev(PF, i)
        if netdev is None:
            failed_at, failed_t = i, time.monotonic() - t0
            break
        k.set_vf(PF, i, mac=want[i].mac)
        k.set_link(netdev, mtu=want[i].mtu, admin_up=want[i].admin_up)
        restored += 1
    binder.join()
    # Had it waited for every netdev: its serial loop with the seed's per-VF cost.
    appear = dict((i, at) for at, i in schedule)
    t = BIND_DELAY_S
    for i in range(n):
        t = max(t, appear[i]) + SEED_PER_VF_S
    full = sum(1 for vf in k.pfs[PF].vfs if vf.config == want[vf.index])
    return {
        "restored": restored,
        "failed_at": failed_at,
        "failed_t": failed_t,
        "whole_config": full,
        "waited_all_s": t,
    }


def igb_in_guest(n: int, spread: float, seed: int) -> int:
    """Inside the VM: the igb PF's VFs, bound at random times; the agent restores them."""
    import os
    import subprocess

    from nodeagent.core.sriov import SriovPolicy

    pci = Path("/sys/bus/pci/devices")
    subprocess.run(["modprobe", "igb"], check=False)
    subprocess.run(["modprobe", "igbvf"], check=False)
    pfs = [d for d in sorted(pci.iterdir()) if (d / "sriov_totalvfs").exists()]
    if not pfs or not (pfs[0] / "net").is_dir():
        print("no igb SR-IOV PF in the VM (QEMU < 8?)")
        return 1
    pf = pfs[0]
    pf_if = sorted(os.listdir(pf / "net"))[0]

    def sh(*a: str) -> None:
        subprocess.run(a, check=True, capture_output=True)

    def write(path: Path, text: str) -> None:
        with open(path, "w") as f:
            f.write(text)

    def numvfs(k: int) -> None:
        write(pf / "sriov_drivers_autoprobe", "0\n")
        write(pf / "sriov_numvfs", "0\n")
        write(pf / "sriov_numvfs", f"{k}\n")

    def bind(i: int) -> str:
        vf = os.path.basename(os.readlink(pf / f"virtfn{i}"))
        write(pci / vf / "driver_override", "igbvf\n")
        write(Path("/sys/bus/pci/drivers_probe"), f"{vf}\n")
        while not ((pci / vf / "net").is_dir() and os.listdir(pci / vf / "net")):
            time.sleep(0.005)
        return sorted(os.listdir(pci / vf / "net"))[0]

    sh("ip", "link", "set", pf_if, "up")
    numvfs(n)
    for i in range(n):
        netdev = bind(i)
        sh("ip", "link", "set", pf_if, "vf", str(i), "mac", f"02:00:00:00:01:{i:02x}")
        sh("ip", "link", "set", pf_if, "vf", str(i), "vlan", str(100 + i), "qos", "1")
        sh("ip", "link", "set", pf_if, "vf", str(i), "spoofchk", "off", "trust", "on")
        sh("ip", "link", "set", pf_if, "vf", str(i), "max_tx_rate", "100")
        sh("ip", "link", "set", netdev, "mtu", "2000", "up")
    done: dict[int, float] = {}
    took: dict[int, float] = {}  # the restore action itself (netlink writes, read-back)

    def on_record(rec: dict[str, Any]) -> None:
        what = str(rec.get("action", ""))
        if rec.get("kind") == "action" and rec.get("ok") and what.startswith("restore VF "):
            i = int(what.split()[2])
            done.setdefault(i, float(rec["ts"]))
            took.setdefault(i, float(rec.get("seconds") or 0.0))

    policy = SriovPolicy(mofed="host", numvfs_owner="sriov-operator", poll_s=2.0)
    cfg = Config(host_root="/", mode="enforce", policies={"sriov": policy})
    agent = Agent(cfg, on_record=on_record)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()

    def phase() -> str | None:
        mem = agent.memory.get("sriov")
        m = mem.pfs.get(pf.name) if isinstance(mem, SriovMemory) else None
        return None if m is None else m.phase

    if not wait_until(lambda: phase() == "stable", 120):
        raise SystemExit("no snapshot")
    t0 = time.time()
    numvfs(n)
    if not wait_until(lambda: phase() == "restoring", 120):
        raise SystemExit("no disruption seen")
    rng = random.Random(seed)
    schedule = sorted((rng.uniform(0, spread), i) for i in range(n))
    start = time.time()
    appeared: dict[int, float] = {}
    for at, i in schedule:
        delay = start + at - time.time()
        if delay > 0:
            time.sleep(delay)
        bind(i)
        appeared[i] = time.time()
    ok = wait_until(lambda: phase() == "restored" and len(done) == n, 120)
    agent.stop()
    thread.join(30)
    if not ok:
        raise SystemExit(f"restored {len(done)}/{n}")
    lat = [(done[i] - appeared[i]) * 1000 for i in range(n)]
    print(
        f"input: igb in QEMU (TCG), kernel {os.uname().release}: {n} igbvf VFs bound one by one "
        f"at random times within 0-{spread:g} s (seed {seed}; each probe ~2-4 s under TCG)"
    )
    act = sorted(took.values())
    print(
        f"agent (TCG): appearance -> restore recorded: p50 {statistics.median(lat):.0f} ms, "
        f"max {max(lat):.0f} ms; the restore action itself: p50 "
        f"{statistics.median(act) * 1000:.0f} ms, max {max(act) * 1000:.0f} ms; last netdev -> "
        f"all back {(max(done.values()) - max(appeared.values())) * 1000:.0f} ms; "
        f"numvfs -> all back {max(done.values()) - t0:.1f} s"
    )
    return 0


def igb_on_vm(n: int, spread: float, seed: int) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo's tests/
    from tests.realkernel import vm

    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--in-guest-igb",
        *("--vfs", str(n), "--spread", str(spread), "--seed", str(seed)),
    ]
    root = Path(__file__).resolve().parent.parent
    r = vm.boot(argv, timeout=900, cwd=root, env={"PYTHONPATH": str(root)})
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    sys.stdout.write(r.output)
    return r.rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vfs", type=int, default=None, help="127 (simulator), 4 (--igb)")
    ap.add_argument("--spread", type=float, default=5.0, help="netdevs appear within 0..S s")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--igb", action="store_true", help="on the real kernel's igb VFs (TCG)")
    ap.add_argument("--in-guest-igb", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--hang",
        type=float,
        default=0.0,
        help="S: also run with the first-appearing VF's netlink write hanging S s, and compare",
    )
    args = ap.parse_args(argv)
    if args.in_guest_igb:
        return igb_in_guest(args.vfs or 4, args.spread, args.seed)
    if args.igb:
        return igb_on_vm(args.vfs or 4, args.spread, args.seed)
    n = args.vfs or 127
    rng = random.Random(args.seed)
    schedule = sorted((rng.uniform(0, args.spread), i) for i in range(n))
    with tempfile.TemporaryDirectory(prefix="nodeagent-bench-vf-", dir="/dev/shm") as tmp:
        k = build_kernel(Path(tmp), n)
        want = configure(k, n)
        agent = run_agent(k, n, want, schedule)
        mofed = run_mofed(k, n, want, schedule)
    if args.hang > 0:
        return compare_hang(n, schedule, args, agent)
    lat_ms = [x * 1000 for x in agent["latency"]]
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(
        f"input: {n} VFs on one PF (simulated kernel), {len(fields(VfConfig))} fields each; "
        f"netdevs appear at random within 0-{args.spread:g} s (seed {args.seed}); wall time"
    )
    print(
        f"agent: appearance -> config back: p50 {statistics.median(lat_ms):.1f} ms, "
        f"p99 {pct(lat_ms, 99):.1f} ms, max {max(lat_ms):.1f} ms"
    )
    print(
        f"agent: last netdev -> all {n} back: {agent['last_netdev_to_all'] * 1000:.1f} ms; "
        f"numvfs -> all back: {agent['numvfs_to_all']:.2f} s ({agent['passes']} passes)"
    )
    if mofed["failed_at"] is None:
        print(f"MOFED method: restored {mofed['restored']}/{n} (MAC, MTU, state only)")
    else:
        print(
            f"MOFED method (4 s bind delay, serial, exit on a missing netdev): restored "
            f"{mofed['restored']}/{n} (MAC, MTU, state only), then exited at VF"
            f"{mofed['failed_at']} (netdev not there) {mofed['failed_t']:.2f} s after numvfs; "
            f"VFs with their whole config: {mofed['whole_config']}/{n}"
        )
    ratio = mofed["waited_all_s"] / agent["numvfs_to_all"]
    print(
        f"MOFED method had it waited for each netdev, at the seed's {SEED_PER_VF_S} s a VF: "
        f"all back {mofed['waited_all_s']:.0f} s after numvfs; ratio to the agent: {ratio:.0f}x"
    )
    return 0


def compare_hang(
    n: int, schedule: list[tuple[float, int]], args: argparse.Namespace, plain: dict[str, Any]
) -> int:
    """The same run with the first VF to appear hanging in its netlink write: the others'
    appearance -> config back, beside the run without the hang (one process, one run)."""
    first = schedule[0][1]
    with tempfile.TemporaryDirectory(prefix="nodeagent-bench-vf-", dir="/dev/shm") as tmp:
        k = build_kernel(Path(tmp), n)
        want = configure(k, n)
        hung = run_agent(k, n, want, schedule, hang=(first, args.hang))
    others = [i for i in range(n) if i != first]
    a = [plain["latency"][i] * 1000 for i in others]
    b = [hung["latency"][i] * 1000 for i in others]
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(
        f"input: {n} VFs (simulated kernel), netdevs within 0-{args.spread:g} s (seed "
        f"{args.seed}); VF {first} (the first to appear) hangs {args.hang:g} s in its "
        "netlink write; the other VFs measured"
    )
    print(f"  no hang:  p50 {statistics.median(a):7.1f} ms  p99 {pct(a, 99):7.1f} ms")
    print(f"  one hung: p50 {statistics.median(b):7.1f} ms  p99 {pct(b, 99):7.1f} ms")
    print(f"  p99 ratio (hung / no hang): {pct(b, 99) / pct(a, 99):.2f}")
    print(f"  the hung VF itself: {hung['latency'][first]:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
