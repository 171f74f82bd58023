"""The hold against the driver container's real order (issue 65), on this machine's kernel.

The GPU driver container's ``nvidia-driver init`` loads ``nvidia-peermem`` from its own
root and bind-mounts that root at ``/run/nvidia/driver`` only after the load
(gpu-driver-container ``ubuntu22.04/nvidia-driver`` 842-843, ``rhel9/nvidia-driver``
873-875): while its ``modprobe`` is held, the host's ``run/nvidia/driver`` is empty. Here
the container is a real overlay in a mount namespace of its own (``tests/containerroot``:
its command line ``nvidia-driver init``, marked as the agent marks one), its image holding
the ``nvidia-peermem.ko`` it loads; the host's ``run/nvidia/driver`` is an empty
directory; the agent is ``Agent`` with the hold on, its responder a process apart; the
loader is a ``modprobe`` by name run in the container's namespaces (``nsenter -m -r``).
The budget is 120 s: a load let go by the budget, not by its verdict, fails these tests
(they wait 30 s at most). Before the gate judged the held file, the first waited for its
budget (``cannot verify nvidia_peermem.ko``) and the second was let go with no reason.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeagent.guards.peermem.start import sees_host_pids
from nodeagent.host.fanotify import FanotifyGroup
from nodeagent.host.modfile import read_module_file
from nodeagent.sim.kofile import write_module_file
from nodeagent.sim.node import READY
from tests import containerroot
from tests.guards.peermem.rig import fake_modprobe, held_pids, hold_status, overlay_works, recorded
from tests.healthy import KVER, healthy_node
from tests.waiting import WAIT, until

BUDGET_S = 120.0
PEERMEM_IN_IMAGE = f"/lib/modules/{KVER}/kernel/drivers/video/nvidia-peermem.ko"
SYM = "ib_register_peer_memory_client"


@pytest.fixture
def machine(tmp_path: Path) -> Iterator[None]:
    if not sees_host_pids():
        pytest.skip("this test process does not see host PIDs (the hold refuses to start)")
    (tmp_path / "probe").mkdir()
    why = overlay_works(tmp_path / "probe")
    if why:
        pytest.skip(why)
    try:
        FanotifyGroup().close()
    except OSError as exc:
        pytest.skip(f"this kernel refuses a fanotify permission group: {exc}")
    yield


def _image(tmp_path: Path, host: Path, modprobe: str, crc_off: bool) -> tuple[Path, bytes]:
    """The driver image: the loader and the node's own nvidia-peermem.ko (or one built
    against another ib_core: the peer-memory symbol's CRC flipped); (lower, its bytes)."""
    node_ko = next((host / "run/nvidia/driver").rglob("nvidia-peermem.ko"))
    lower = tmp_path / "lower"
    containerroot.build_lower(lower, [modprobe])
    ko = lower / PEERMEM_IN_IMAGE.lstrip("/")
    ko.parent.mkdir(parents=True)
    if crc_off:
        mod = read_module_file(node_ko)
        crcs = dict(mod.required_crcs)
        crcs[SYM] ^= 0x5A5A5A5A
        write_module_file(
            ko,
            name=mod.name,
            vermagic=mod.vermagic,
            depends=mod.depends,
            srcversion=mod.srcversion,
            required_crcs=crcs,
        )
    else:
        shutil.copy(node_ko, ko)
    return lower, ko.read_bytes()


def _run(
    tmp_path: Path, crc_off: bool, ready: bool = False
) -> tuple[dict[str, Any], dict[str, Any] | None, bytes, bytes]:
    """The held load from MOFED mid-restart (or, ``ready``, MOFED ready from the start: the
    gate open, its file check deferred) to its end; (its record, the held file's verdict
    while held: None when ``ready``, what the loader read, the image's bytes)."""
    from nodeagent.agent import Agent
    from nodeagent.config import Config
    from nodeagent.core.peermem import PeermemPolicy
    from nodeagent.guards.peermem.side import PeermemHold

    host = tmp_path / "host"
    node = healthy_node(host, ready=ready)  # not ready: MOFED mid-restart, no ready flag
    modprobe = fake_modprobe(tmp_path)
    lower, image_ko = _image(tmp_path, host, modprobe, crc_off)
    driver = host / "run/nvidia/driver"
    shutil.rmtree(driver)
    driver.mkdir()  # the mount point, empty: the container mounts its root after its load
    pol = PeermemPolicy(
        hold_loads="fanotify", hold_roots=(), hold_scan_s=0.02, hold_budget_s=BUDGET_S
    )
    cfg = Config(host_root=str(host), mode="enforce", uevents=False, policies={"peermem": pol})
    agent = Agent(cfg, module_ops=node.kernel, kernel_log=lambda m: [])
    thread = threading.Thread(target=agent.run, daemon=True)
    container = loader = None
    try:
        thread.start()
        side = agent.side("peermem")
        assert isinstance(side, PeermemHold)
        until(lambda: side.containers is not None, "the container scanner did not start")
        top = tmp_path / "starts"
        top.mkdir()
        container = containerroot.start(lower, top)
        until(lambda: side.containers is not None and side.containers.roots(), "not marked")
        loader = subprocess.Popen(
            container.enter(modprobe, PEERMEM_IN_IMAGE), stdout=subprocess.PIPE
        )
        waiting = None
        if not ready:
            until(lambda: loader.pid in held_pids(side), "the container's load was not held")
            waiting = until(lambda: hold_status(host).get("held_files"), "not judged")
            assert loader.poll() is None
            node.write(READY)  # MOFED ready, its stack final: the held file's own verdict
        out, _ = loader.communicate(timeout=WAIT)
        assert loader.returncode == 0
        (record,) = until(lambda: recorded(host, "held-open"), "the held open was not recorded")
        return record, waiting[0] if waiting else None, out, image_ko
    finally:
        if loader is not None and loader.poll() is None:
            loader.kill()
            loader.wait(WAIT)
        agent.stop()
        thread.join(WAIT)
        if container is not None:
            container.stop()
        node.kernel.uevent_source.close()


def test_the_containers_load_held_mid_restart_goes_on_at_the_ready_flag(
    machine: None, tmp_path: Path
) -> None:
    record, waiting, out, image_ko = _run(tmp_path, crc_off=False)
    assert (
        waiting is not None and waiting["verdict"] == "wait" and "ready flag" in waiting["reason"]
    )
    assert waiting["path"].endswith(PEERMEM_IN_IMAGE)  # as the responder names it
    assert out == image_ko  # the bytes the loader read are the image's, held and let go
    assert record["ended"] == "gate opened" and record["seconds"] < BUDGET_S
    assert "agrees with it" in record["why"] and PEERMEM_IN_IMAGE in record["why"]


def test_a_held_file_built_against_another_ib_core_is_let_go_naming_the_symbol(
    machine: None, tmp_path: Path
) -> None:
    record, waiting, out, image_ko = _run(tmp_path, crc_off=True)
    assert waiting is not None and waiting["verdict"] == "wait"
    assert out == image_ko
    assert record["ended"] == "rebuild" and record["seconds"] < BUDGET_S
    why = record["why"]
    assert f"needs {SYM} CRC" in why and "but the loaded ib_core exports" in why
    crcs = [w for w in why.replace(",", " ").split() if w.startswith("0x")]
    assert len(crcs) == 2 and crcs[0] != crcs[1], why


@pytest.mark.parametrize("crc_off", [False, True], ids=["agrees", "another-ib_core"])
def test_with_the_gate_open_and_no_file_checked_the_containers_load_waits_for_its_verdict(
    machine: None, tmp_path: Path, crc_off: bool
) -> None:
    """MOFED ready all along, the host's driver root empty: the gate is open with its file
    check deferred, so it vouches for no file. The container's open of nvidia-peermem.ko
    is held until that file has its own verdict (the seeds' order: modprobe opens the peer
    module after its dependency was let go at the flag, the gate open by then)."""
    record, _, out, image_ko = _run(tmp_path, crc_off=crc_off, ready=True)
    assert out == image_ko
    if crc_off:
        assert record["ended"] == "rebuild" and f"needs {SYM} CRC" in record["why"]
    else:
        assert record["ended"] == "gate opened" and "agrees with it" in record["why"]
