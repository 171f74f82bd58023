"""The guest's igb PF and its igbvf VFs (QEMU's 82576), for ``test_sriov_real.py`` and
``replay_vf.py``: find the PF, set its VF count, bind a VF, set and read a VF's
configuration as ``ip link`` does."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.waiting import until

PCI = Path("/sys/bus/pci/devices")


def sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def write(path: Path, text: str) -> None:
    with open(path, "w") as f:  # one write(2), as echo does
        f.write(text)


def igb_pf() -> tuple[str, str]:
    """(PCI address, netdev) of the igb PF, or skip saying why there is none."""
    subprocess.run(["modprobe", "igb"], check=False)
    subprocess.run(["modprobe", "igbvf"], check=False)
    for dev in sorted(PCI.iterdir()):
        vendor = (dev / "vendor").read_text().strip() if (dev / "vendor").exists() else ""
        if vendor == "0x8086" and (dev / "sriov_totalvfs").exists():
            nets = sorted(os.listdir(dev / "net")) if (dev / "net").is_dir() else []
            if nets:
                return dev.name, nets[0]
    pytest.skip("no igb SR-IOV PF in this VM: QEMU < 8 (setup installs it from backports)")


def numvfs(pf: str, n: int) -> None:
    dev = PCI / pf
    write(dev / "sriov_drivers_autoprobe", "0\n")  # VFs come without a driver
    write(dev / "sriov_numvfs", "0\n")
    if n:
        write(dev / "sriov_numvfs", f"{n}\n")


def vf_pci(pf: str, i: int) -> str:
    return os.path.basename(os.readlink(PCI / pf / f"virtfn{i}"))


def bind(vf: str) -> str:
    """driver_override + drivers_probe: the VF's igbvf netdev appears; its name."""
    write(PCI / vf / "driver_override", "igbvf\n")
    write(Path("/sys/bus/pci/drivers_probe"), f"{vf}\n")
    net = PCI / vf / "net"
    until(lambda: net.is_dir() and os.listdir(net), f"no netdev for VF {vf}", 60.0)
    return sorted(os.listdir(net))[0]


def wanted(i: int) -> dict[str, Any]:
    return {
        "mac": f"02:00:00:00:00:{0x10 + i:02x}",
        "vlan": 10 + i,
        "qos": i % 8,
        "spoofchk": False,
        "trust": True,
        "max_tx_rate": 100 + 10 * i,
        "mtu": 2000 + i,
    }


def configure(pf_if: str, i: int, netdev: str) -> None:
    w = wanted(i)
    spoof = "on" if w["spoofchk"] else "off"
    trust = "on" if w["trust"] else "off"
    sh(
        *("ip", "link", "set", pf_if, "vf", str(i), "mac", w["mac"]),
        *("vlan", str(w["vlan"]), "qos", str(w["qos"]), "spoofchk", spoof, "trust", trust),
        *("max_tx_rate", str(w["max_tx_rate"])),
    )
    sh("ip", "link", "set", netdev, "mtu", str(w["mtu"]), "up")


def vfinfo(pf_if: str) -> dict[int, dict[str, Any]]:
    """iproute2's view of IFLA_VFINFO_LIST (not the agent's netlink code)."""
    (link,) = json.loads(sh("ip", "-d", "-j", "link", "show", pf_if))
    out = {}
    for v in link.get("vfinfo_list", []):
        vlans = v.get("vlan_list") or [{}]
        out[v["vf"]] = {
            "mac": v.get("address"),
            "vlan": vlans[0].get("vlan", 0),
            "qos": vlans[0].get("qos", 0),
            "spoofchk": v.get("spoofchk"),
            "trust": v.get("trust"),
            "max_tx_rate": (v.get("rate") or {}).get("max_tx", 0),
        }
    return out


def link(netdev: str) -> dict[str, Any]:
    (info,) = json.loads(sh("ip", "-j", "link", "show", netdev))
    return {"mtu": info["mtu"], "up": "UP" in info["flags"]}
