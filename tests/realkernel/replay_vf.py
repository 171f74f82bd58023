"""Seed 003 end to end on the real Debian 6.1 kernel (QEMU): MOFED's VF restore after a PF
driver reload runs before the VF netdevs exist.

QEMU's igb (an 82576 SR-IOV PF) stands for the ConnectX PF, ``igb`` for ``mlx5_core``,
``igbvf`` for the VF driver. VFs are configured (admin MAC, VLAN/QoS, spoofchk, trust,
max rate; MTU and up on the VF netdev), then the MOFED container (a process in its own
mount namespace, its flock on ``.lock``) restarts ``openibd`` as the seed's did: the
blacklist written, each VF's MAC, MTU and state saved (all MOFED saves), the PF driver
reloaded (the VFs go with it), ``sriov_numvfs`` written back, then the serial restore,
which looks for VF 0's netdev at once: it is not there yet (the VF drivers' probes come
later: here the test binds them one by one, after MOFED's attempt), and MOFED exits, as
in the seed. Its restart by the kubelet finds the driver loaded, skips the reload and
writes the ready flag. The VFs' netdevs then appear.

- Without the agent: no VF has its config back.
- With the real ``nodeagent run`` (the peermem-hold component's config plus
  ``[sriov] mofed_drivers = ["igb"]``: igb is this node's MOFED PF driver), every VF has
  every field back, read with iproute2, not with the agent's netlink code.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.realkernel.guest_agent import HOLD_CONFIG, GuestAgent
from tests.realkernel.igb_vfs import (
    PCI,
    bind,
    configure,
    igb_pf,
    link,
    numvfs,
    vf_pci,
    vfinfo,
    wanted,
)
from tests.realkernel.mofed_container import (
    BLACKLIST,
    MOFED_PROLOGUE,
    MOFED_ROOT,
    READY,
    RESTARTS,
    Mofed,
    start_mofed,
)

from .. import waiting

WAIT = 180.0  # a hang detector under TCG: each igbvf probe takes 2-4 s, a reload more


NVFS = 2


TOP = Path("/tmp/na-seed-vf")


# After MOFED_PROLOGUE (its lock, its flag removed): a restart that finds the driver
# reloaded already skips the reload; the first one reloads and restores.
MOFED_BODY = """PF={pf}
N={n}
if [ -e {top}/reloaded ]; then
  say "Driver already loaded (srcversion match): skipping reload"
  : > "$D/.driver-ready"
  say "Setting driver ready state"
  read stop
  exit 0
fi
read built || exit 0
say "openibd restart: Unloading HCA driver"
echo "blacklist igb" > {blacklist}
i=0
while [ $i -lt $N ]; do
  net=$(ls /sys/bus/pci/devices/$PF/virtfn$i/net | head -n 1)
  echo "$i $(cat /sys/class/net/$net/address) $(cat /sys/class/net/$net/mtu)" >> {top}/saved
  i=$((i + 1))
done
rmmod igbvf
rmmod igb
modprobe igb
modprobe igbvf
: > {top}/reloaded
rm -f {blacklist}
say "Loading HCA driver and Access Layer: [  OK  ]"
pfif=$(ls /sys/bus/pci/devices/$PF/net | head -n 1)
ip link set "$pfif" up
say "restore_sriov_config: $pfif up, echo $N > sriov_numvfs"
echo $N > /sys/bus/pci/devices/$PF/sriov_numvfs
while read i mac mtu; do
  net=$(ls /sys/bus/pci/devices/$PF/virtfn$i/net 2>/dev/null | head -n 1)
  if [ -z "$net" ]; then
    where="/sys/class/net/$pfif/device/virtfn$i/net/"
    say "VF$i: $where not found: \\"dev argument required\\"; VF restore failed, exiting"
    exit 1
  fi
  ip link set "$pfif" vf $i mac $mac && ip link set "$net" mtu $mtu up || exit 1
done < {top}/saved
: > "$D/.driver-ready"
say "Setting driver ready state"
read stop
"""


def until(pred: Any, what: str) -> None:
    waiting.until(pred, what, WAIT)


def _pf_if(pf: str) -> str:
    nets = sorted(os.listdir(PCI / pf / "net")) if (PCI / pf / "net").is_dir() else []
    return nets[0] if nets else ""


def _pf_evidence(agent: GuestAgent, pf: str) -> dict[str, Any]:
    doc = agent.status() or {}
    sriov = (doc.get("guards") or {}).get("sriov") or {}
    pfs: dict[str, Any] = (sriov.get("evidence") or {}).get("pfs") or {}
    return pfs.get(pf) or {}


def _vfs_back(pf: str) -> tuple[int, dict[int, dict[str, Any]]]:
    """VFs with every configured field back (iproute2's view), and what each has."""
    have = vfinfo(_pf_if(pf))
    back = 0
    for i in range(NVFS):
        w = wanted(i)
        net = PCI / vf_pci(pf, i) / "net"
        netdev = sorted(os.listdir(net))[0] if net.is_dir() and os.listdir(net) else None
        got = {**have.get(i, {}), **(link(netdev) if netdev else {})}
        have[i] = got
        if all(got.get(k) == v for k, v in w.items()) and got.get("up"):
            back += 1
    return back, have


def _agent_config() -> Path:
    """The shipped component config, igb named as MOFED's PF driver (a [sriov] key a user
    sets where MOFED drives another NIC driver than mlx5_core)."""
    text = HOLD_CONFIG.read_text()
    owner = 'numvfs_owner = "mofed"\n'
    assert owner in text, "the shipped config's [sriov] numvfs_owner changed"
    path = TOP / "agent.toml"
    path.write_text(text.replace(owner, owner + 'mofed_drivers = ["igb"]\n'))
    return path


@contextlib.contextmanager
def _vf_node() -> Iterator[tuple[str, list[Mofed]]]:
    pf, pf_if = igb_pf()
    subprocess.run(["rm", "-rf", str(TOP)], check=True)
    TOP.mkdir(parents=True)
    MOFED_ROOT.mkdir(parents=True, exist_ok=True)
    READY.write_text("")  # MOFED was ready before its restart
    subprocess.run(["ip", "link", "set", pf_if, "up"], check=True)  # rate limits need it
    numvfs(pf, NVFS)
    for i in range(NVFS):
        configure(pf_if, i, bind(vf_pci(pf, i)))
    mofeds: list[Mofed] = []
    try:
        yield pf, mofeds
    finally:
        for m in mofeds:
            m.stop()
        READY.unlink(missing_ok=True)
        BLACKLIST.unlink(missing_ok=True)
        subprocess.run(["modprobe", "igb"], check=False)
        subprocess.run(["modprobe", "igbvf"], check=False)
        numvfs(pf, 0)


def _start_mofed(pf: str, mofeds: list[Mofed]) -> Mofed:
    body = MOFED_BODY.format(pf=pf, n=NVFS, blacklist=BLACKLIST, top=TOP)
    return start_mofed(MOFED_PROLOGUE + body, TOP, mofeds)


def replay_vf_restore(with_agent: bool) -> dict[str, Any]:
    """Seed 003: a row of VFs back, MOFED's exits and words."""
    row: dict[str, Any] = {"seed": "003 VF restore", "agent": with_agent, "vfs": NVFS}
    agent: GuestAgent | None = None
    with _vf_node() as (pf, mofeds):
        try:
            if with_agent:
                agent = GuestAgent(_agent_config()).start()
                a = agent
                a.until(
                    lambda: _pf_evidence(a, pf).get("vfs") == NVFS,
                    "the agent's snapshot of the VFs",
                    WAIT,
                )
            first = _start_mofed(pf, mofeds)
            first.step()  # the build done: openibd restart, the restore
            until(
                lambda: first.proc.poll() is not None or first.said("Setting driver ready state"),
                "restore",
            )
            for _ in range(RESTARTS):  # the kubelet restarts a MOFED container that failed
                if mofeds[-1].proc.poll() in (None, 0):
                    break
                again = _start_mofed(pf, mofeds)
                until(
                    lambda m=again: m.said("Setting driver ready state") or m.proc.poll(),
                    "MOFED restarted",
                )
            for i in range(NVFS):  # the VF drivers' probes end, after MOFED's attempt
                bind(vf_pci(pf, i))
            if agent is not None:
                a = agent
                a.until(
                    lambda: _pf_evidence(a, pf).get("restored") == NVFS,
                    f"every VF restored: {_pf_evidence(a, pf)}",
                    WAIT,
                )
            back, have = _vfs_back(pf)
            row["vfs_back"] = back == NVFS
            row["vfs_back_count"] = back
            row["vf_fields"] = {str(i): v for i, v in have.items()}
            row["mofed_exits"] = sum(1 for m in mofeds if m.proc.poll() not in (None, 0))
            words = [line for m in mofeds for line in m.log.read_text().splitlines()]
            row["mofed_words"] = [w for w in words if "failed" in w or "ready state" in w]
            row["mofed_ready"] = READY.exists()
        finally:
            if agent is not None:
                row["agent_exit"] = agent.stop()
                row["agent_log_tail"] = agent.tail()
    return row
