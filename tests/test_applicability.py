"""A node without the hardware is not a broken node (issue 54): ``not-applicable`` for each
guard, decided from what the node has, and ``disabled`` when turned off.

Built host roots of each node kind (the simulator's node, its PCI bus as sysfs shows it),
checked as an admin does: ``nodeagent check --host-root R --json``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nodeagent.config import Config, load_config
from nodeagent.core.applicability import DISABLED, NOT_APPLICABLE, devices
from nodeagent.core.snapshot import NodeSnapshot, PciDevice
from nodeagent.errors import NodeagentError
from nodeagent.sim.modtree import GPU_MODULES, RDMA_MODULES
from nodeagent.sim.node import READY, Node
from nodeagent.sim.scenarios import MOFED_2507, NVIDIA
from tests.healthy import KVER

STACK = ("mlx5_core", "mlx5_ib", "ib_uverbs")


def built(root: Path, hardware: tuple[str, ...], *, pf: bool = False) -> Node:
    """A node at rest with ``hardware``: MOFED's stack loaded and ready where it has the
    NIC, nvidia loaded where it has the GPU; an SR-IOV PF if asked."""
    node = Node(root, KVER, seed=0, hardware=hardware)
    node.kernel.init_delay = node.kernel.exit_delay = 0.0
    nic, gpu = "rdma-nic" in hardware, "gpu" in hardware
    if nic:
        node.install(MOFED_2507, RDMA_MODULES, "mofed")
        node.write_headers(MOFED_2507, RDMA_MODULES)
    if gpu:
        node.install(NVIDIA, GPU_MODULES, "gpu", against=node.headers() if nic else None)
    with node.sched.world:
        if nic:
            for m in STACK:
                node.kernel.modprobe(m, node.mofed_moddir)
        if gpu:
            node.kernel.modprobe("nvidia", node.gpu_moddir)
    if nic:
        node.write(READY)
    if pf:
        node.kernel.add_pf("ens1f0", "0000:5e:00.1", totalvfs=8)
    node.kernel.uevent_source.close()
    return node


def check(root: Path, *config: str) -> tuple[int, dict[str, Any]]:
    cfg = root.parent / "agent.toml"
    cfg.write_text("\n".join(config) + "\n")
    p = subprocess.run(
        [sys.executable, "-m", "nodeagent", "check", "--config", str(cfg),
         "--host-root", str(root), "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode in (0, 1), p.stderr
    return p.returncode, json.loads(p.stdout)["guards"]


def test_a_nic_only_node_checks_ok_with_peermem_not_applicable(tmp_path: Path) -> None:
    built(tmp_path / "root", ("rdma-nic",))
    code, guards = check(tmp_path / "root")
    peermem = guards["peermem"]
    assert peermem["verdict"] == NOT_APPLICABLE and peermem["ok"] is True
    assert "no NVIDIA GPU" in peermem["reasons"][0]
    assert guards["storage"]["verdict"] == "clear"  # MOFED is here: the storage guard applies
    assert guards["sriov"]["verdict"] == NOT_APPLICABLE
    assert code == 0, guards


def test_a_gpu_node_without_an_rdma_nic_checks_ok_with_each_reason(tmp_path: Path) -> None:
    built(tmp_path / "root", ("gpu",))
    code, guards = check(tmp_path / "root")
    assert guards["peermem"]["verdict"] == NOT_APPLICABLE
    assert "no RDMA NIC" in guards["peermem"]["reasons"][0]
    assert guards["storage"]["verdict"] == NOT_APPLICABLE
    assert "no MOFED on this node" in guards["storage"]["reasons"][0]
    assert guards["sriov"]["verdict"] == NOT_APPLICABLE
    assert code == 0, guards


def test_a_full_node_with_a_pf_has_every_guard_applicable(tmp_path: Path) -> None:
    built(tmp_path / "root", ("gpu", "rdma-nic"), pf=True)
    _, guards = check(tmp_path / "root")
    assert guards["peermem"]["verdict"] == "open"
    assert guards["storage"]["verdict"] == "clear"
    # The PF is there: the guard applies (its netdev is the simulator's, which this
    # machine's netlink cannot show, so it reads "unknown" and check exits 1).
    assert guards["sriov"]["verdict"] not in (NOT_APPLICABLE, DISABLED)
    assert "0000:5e:00.1" in json.dumps(guards["sriov"]["evidence"])
    assert all(g["evidence"].get("applicable") is not False for g in guards.values())


def test_a_gpu_node_whose_driver_is_not_loaded_yet_is_closed_not_not_applicable(
    tmp_path: Path,
) -> None:
    """What the node has, not what is loaded: the driver container has not loaded nvidia."""
    node = built(tmp_path / "root", ("gpu", "rdma-nic"))
    with node.sched.world:
        node.kernel.remove("nvidia")
    code, guards = check(tmp_path / "root")
    assert guards["peermem"]["verdict"] == "closed"
    assert "nvidia is not loaded" in guards["peermem"]["reasons"]
    assert code == 1


def test_turned_off_a_guard_says_disabled_everywhere_and_observes_nothing(
    tmp_path: Path,
) -> None:
    built(tmp_path / "root", ("gpu", "rdma-nic"))
    code, guards = check(
        tmp_path / "root", "[storage]", "enabled = false", "[sriov]", "enabled = false"
    )
    for g in ("storage", "sriov"):
        assert guards[g]["verdict"] == DISABLED and guards[g]["ok"] is True
        assert "enabled = false" in guards[g]["reasons"][0]
    cfg = load_config_text(tmp_path, "[storage]\nenabled = false\n")
    from nodeagent.agent import build_reconciler

    needs = build_reconciler(cfg).needs()
    assert not needs.locks and not needs.mounts and not needs.nvme, "storage's reads dropped"
    assert code == 0


def test_enabled_true_applies_on_a_node_without_the_hardware(tmp_path: Path) -> None:
    built(tmp_path / "root", ("rdma-nic",))
    code, guards = check(tmp_path / "root", "[peermem]", "enabled = true")
    assert guards["peermem"]["verdict"] == "closed"  # no GPU: nvidia never loads
    assert code == 1


def test_mofed_none_makes_peermem_and_storage_not_applicable(tmp_path: Path) -> None:
    built(tmp_path / "root", ("gpu", "rdma-nic"))
    code, guards = check(
        tmp_path / "root", "[peermem]", 'mofed = "none"', "[storage]", 'mofed = "none"'
    )
    assert guards["peermem"]["verdict"] == NOT_APPLICABLE
    assert guards["storage"]["verdict"] == NOT_APPLICABLE
    assert all('mofed = "none"' in guards[g]["reasons"][0] for g in ("peermem", "storage"))
    assert code == 0


def test_a_device_appearing_later_makes_the_guard_applicable_at_the_next_check(
    tmp_path: Path,
) -> None:
    node = built(tmp_path / "root", ("rdma-nic",))
    assert check(tmp_path / "root")[1]["peermem"]["verdict"] == NOT_APPLICABLE
    node.kernel.add_pci_device("0000:3b:00.0", "0x10de", "0x030200")  # hotplugged
    assert check(tmp_path / "root")[1]["peermem"]["verdict"] == "closed"


def load_config_text(tmp_path: Path, text: str) -> Config:
    f = tmp_path / "x.toml"
    f.write_text(text)
    return load_config(str(f))


@pytest.mark.parametrize("value", ["yes", 1, "Auto", ["auto"]])
def test_a_bad_enabled_value_is_refused_naming_the_key(tmp_path: Path, value: object) -> None:
    with pytest.raises(NodeagentError, match=r"config sriov\.enabled: expected \"auto\", true"):
        load_config_text(tmp_path, f"[sriov]\nenabled = {json.dumps(value)}\n")


def snap(pci: dict[str, PciDevice] | None) -> NodeSnapshot:
    return NodeSnapshot(now=0.0, kernel=KVER, modules={}, disk={}, pci=pci)


def test_what_cannot_be_read_counts_as_present() -> None:
    """Fail closed: no PCI view, an empty bus, a device whose IDs are unreadable."""
    assert devices(snap(None), 0x10DE, 0x03) is None
    assert devices(snap({}), 0x10DE, 0x03) is None
    bridge = PciDevice(0x8086, 0x060000)
    assert devices(snap({"0000:00:00.0": bridge}), 0x10DE, 0x03) == []
    unread = {"0000:00:00.0": bridge, "0000:3b:00.0": PciDevice(None, None)}
    assert devices(snap(unread), 0x10DE, 0x03) == ["0000:3b:00.0"]
    audio = {"0000:00:00.0": bridge, "0000:3b:00.1": PciDevice(0x10DE, 0x040300)}
    assert devices(snap(audio), 0x10DE, 0x03) == [], "a GPU's audio function is no GPU"


def shelved_verdicts(word: str) -> dict[str, Any]:
    from nodeagent.core.applicability import shelved

    return {
        g: shelved(g, word, f"no {g} hardware here", None).verdict
        for g in ("peermem", "storage", "sriov")
    }


@pytest.mark.parametrize("word", [NOT_APPLICABLE, DISABLED])
def test_every_output_says_it_the_same_way(word: str) -> None:
    """The NFD labels (n-a), the NPD condition (no problem, with the reason), and the
    state metric's words for every guard."""
    from nodeagent.agent import build_reconciler
    from nodeagent.core.conditions import condition_message, condition_text
    from nodeagent.core.labels import node_labels
    from nodeagent.core.telemetry import verdict_words

    verdicts = shelved_verdicts(word)
    labels = node_labels(verdicts, "feature.node.kubernetes.io")
    assert labels["feature.node.kubernetes.io/nodeagent-peermem-gate"] == "n-a"
    assert labels["feature.node.kubernetes.io/nodeagent-vfs-restored"] == "n-a"
    assert labels["feature.node.kubernetes.io/nodeagent-storage-ok"] == "true"
    v = verdicts["storage"]
    assert condition_message(v) == f"storage {word}: no storage hardware here"
    assert "status=ok\n" in condition_text(v, 1.0, "boot")
    for guard in build_reconciler(Config()).guards.values():
        assert verdict_words(guard)[-2:] == (NOT_APPLICABLE, DISABLED), guard.name


def test_wait_peermem_answers_at_once_where_the_gate_does_not_apply(tmp_path: Path) -> None:
    """A driver container told to wait on the gate goes on, on a node without an RDMA NIC,
    as it would without the agent (exit 0), instead of waiting forever."""
    from tests.waiting import WAIT, until

    root = tmp_path / "root"
    built(root, ("gpu",))
    agent = subprocess.Popen(
        [sys.executable, "-m", "nodeagent", "run", "--host-root", str(root),
         "--metrics-address", "off"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        until((root / "run/nodeagent/status.json").exists, "the agent's first status")
        p = subprocess.run(
            [sys.executable, "-m", "nodeagent", "wait", "peermem", "--host-root", str(root),
             "--timeout", "30"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert p.returncode == 0, p.stderr
        assert p.stdout.startswith("peermem gate is open")
    finally:
        agent.terminate()
        agent.wait(WAIT)
