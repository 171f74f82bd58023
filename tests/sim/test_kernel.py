"""The simulated kernel's rules, one test each, against real .ko files on a temp root."""

from __future__ import annotations

import errno
import os
import select
from pathlib import Path

import pytest

from nodeagent.agent import build_reconciler
from nodeagent.config import Config
from nodeagent.host.events import readable
from nodeagent.host.fs import HostRoot
from nodeagent.host.kmod import ModuleOpError, ModuleOps
from nodeagent.host.modfile import read_module_file
from nodeagent.host.observe import Observer
from nodeagent.sim.clock import Scheduler
from nodeagent.sim.kernel import SimKernel, VfConfig, WakePipe, build_id_note
from nodeagent.sim.modtree import (
    RDMA_MODULES,
    depmod,
    install_generation,
)
from tests.sim.trees import KVER, NEW, OLD, gpu_tree, moddir
from tests.waiting import poke_mid_drain


@pytest.fixture
def kernel(tmp_path: Path) -> SimKernel:
    k = SimKernel(tmp_path, KVER)
    install_generation(moddir(tmp_path), KVER, OLD, RDMA_MODULES)
    depmod(moddir(tmp_path))
    return k


def ko(k: SimKernel, name: str, where: str = "") -> str:
    d = moddir(k.root, where)
    hits = [p for p in d.rglob("*.ko*") if read_module_file(p).name == name]
    assert len(hits) == 1, hits
    return str(hits[0])


def sysmod(k: SimKernel, name: str) -> Path:
    return k.root / "sys/module" / name


def test_implements_module_ops(kernel: SimKernel) -> None:
    assert isinstance(kernel, ModuleOps)


def test_load_writes_the_sysfs_layout_the_agent_reads(kernel: SimKernel) -> None:
    kernel.probe("ib_uverbs", str(moddir(kernel.root)))
    d = sysmod(kernel, "ib_core")
    info = read_module_file(ko(kernel, "ib_core"))
    assert (d / "initstate").read_text() == "live\n"
    assert (d / "refcnt").read_text() == "1\n"
    assert (d / "srcversion").read_text().strip() == info.srcversion
    assert os.readlink(d / "holders/ib_uverbs") == "../../ib_uverbs"
    raw = (d / "notes/.note.gnu.build-id").read_bytes()
    assert raw == build_id_note(bytes.fromhex(info.build_id or ""))
    assert raw[:12] == (4).to_bytes(4, "little") + (20).to_bytes(4, "little") + (3).to_bytes(
        4, "little"
    )
    # ... and the agent's own observer reads it back as the same module as on disk.
    cfg = Config(host_root=str(kernel.root))
    snap = Observer(HostRoot(kernel.root), cfg, build_reconciler(cfg).needs()).observe(0.0)
    loaded, disk = snap.modules["ib_core"], snap.disk["ib_core"]
    assert loaded.live and loaded.holders == ("ib_uverbs",)
    assert (loaded.srcversion, loaded.build_id) == (disk.srcversion, disk.build_id)
    assert (kernel.root / "proc/sys/kernel/osrelease").read_text() == KVER + "\n"


def test_remove_with_holders_is_ebusy(kernel: SimKernel) -> None:
    kernel.probe("ib_uverbs", str(moddir(kernel.root)))
    with pytest.raises(ModuleOpError) as err:
        kernel.remove("ib_core")
    assert err.value.errno == errno.EBUSY and "ib_uverbs" in str(err.value)
    kernel.remove("ib_uverbs")
    kernel.remove("ib_core")
    assert not sysmod(kernel, "ib_core").exists()


def test_remove_with_a_non_module_user_is_ebusy(kernel: SimKernel) -> None:
    kernel.probe("ib_core", str(moddir(kernel.root)))
    kernel.get_module("ib_core")  # e.g. a mount holds it
    assert (sysmod(kernel, "ib_core") / "refcnt").read_text() == "1\n"
    with pytest.raises(ModuleOpError) as err:
        kernel.remove("ib_core")
    assert err.value.errno == errno.EBUSY
    kernel.put_module("ib_core")
    kernel.remove("ib_core")


def test_remove_of_a_module_not_loaded_is_enoent(kernel: SimKernel) -> None:
    with pytest.raises(ModuleOpError) as err:
        kernel.remove("ib_core")
    assert err.value.errno == errno.ENOENT


def test_missing_dependency_is_enoent_unknown_symbol(kernel: SimKernel) -> None:
    with pytest.raises(ModuleOpError) as err:
        kernel.insert_file(ko(kernel, "ib_uverbs"), [])  # insmod: ib_core is not loaded
    assert err.value.errno == errno.ENOENT
    assert kernel.kernel_messages("ib_uverbs") == [
        "ib_uverbs: Unknown symbol ib_register_client (err -2)"
    ]
    assert not sysmod(kernel, "ib_uverbs").exists()


def test_loading_a_loaded_module_is_eexist(kernel: SimKernel) -> None:
    kernel.insert_file(ko(kernel, "ib_core"), [])
    with pytest.raises(ModuleOpError) as err:
        kernel.insert_file(ko(kernel, "ib_core"), [])
    assert err.value.errno == errno.EEXIST
    kernel.probe("ib_core", str(moddir(kernel.root)))  # modprobe: already loaded is fine


def test_peermem_built_against_another_ib_core_is_einval(kernel: SimKernel) -> None:
    gpu = gpu_tree(kernel, built_against=NEW)  # headers of NEW, OLD is what gets loaded
    kernel.probe("ib_core", str(moddir(kernel.root)))
    kernel.probe("nvidia", str(gpu))
    with pytest.raises(ModuleOpError) as err:
        kernel.probe("nvidia_peermem", str(gpu))
    assert err.value.errno == errno.EINVAL
    assert kernel.kernel_messages("nvidia_peermem") == [
        "nvidia_peermem: disagrees about version of symbol ib_register_peer_memory_client",
        "nvidia_peermem: Unknown symbol ib_register_peer_memory_client (err -22)",
        "nvidia_peermem: disagrees about version of symbol ib_unregister_peer_memory_client",
        "nvidia_peermem: Unknown symbol ib_unregister_peer_memory_client (err -22)",
    ]
    assert not sysmod(kernel, "nvidia_peermem").exists()


def test_peermem_built_against_the_loaded_ib_core_loads(kernel: SimKernel) -> None:
    gpu = gpu_tree(kernel, built_against=OLD)
    kernel.probe("ib_core", str(moddir(kernel.root)))
    kernel.probe("nvidia_peermem", str(gpu))  # pulls nvidia in from modules.dep
    assert kernel.is_live("nvidia_peermem") and kernel.is_live("nvidia")
    assert sorted(os.listdir(sysmod(kernel, "ib_core") / "holders")) == ["nvidia_peermem"]


def test_vermagic_of_another_kernel_is_enoexec(kernel: SimKernel, tmp_path: Path) -> None:
    other = tmp_path / "other"
    install_generation(other, "5.15.0-other", OLD, RDMA_MODULES[:1])
    with pytest.raises(ModuleOpError) as err:
        kernel.insert_file(str(next(other.rglob("ib_core.ko"))), [])
    assert err.value.errno == errno.ENOEXEC
    assert "version magic" in kernel.kernel_messages("ib_core")[0]


def test_probe_of_an_unknown_module_is_enoent(kernel: SimKernel) -> None:
    with pytest.raises(ModuleOpError) as err:
        kernel.probe("no_such_module", str(moddir(kernel.root)))
    assert err.value.errno == errno.ENOENT


def test_host_modprobe_honours_install_rules(kernel: SimKernel) -> None:
    (kernel.root / "etc/modprobe.d/hold.conf").write_text("install ib_uverbs /bin/false\n")
    with pytest.raises(ModuleOpError) as err:
        kernel.modprobe("mlx5_ib", moddir(kernel.root), install_rules=True)
    assert err.value.errno == errno.EPERM and "ib_uverbs" in str(err.value)
    assert not kernel.is_live("ib_uverbs")
    (kernel.root / "etc/modprobe.d/hold.conf").write_text("install ib_uverbs /bin/true\n")
    loaded = kernel.modprobe("ib_umad", moddir(kernel.root), install_rules=True)
    assert loaded == ["ib_umad"] or loaded == ["ib_core", "ib_umad"]
    # a pod's chroot modprobe (the agent's probe) does not read the host's rules
    kernel.probe("ib_uverbs", str(moddir(kernel.root)))
    assert kernel.is_live("ib_uverbs")


def test_add_and_remove_emit_uevents_on_a_pipe(kernel: SimKernel) -> None:
    src = kernel.uevent_source
    assert src.drain() == []
    kernel.probe("ib_core", str(moddir(kernel.root)))
    ready, _, _ = select.select([src], [], [], 0)
    assert ready == [src]
    assert src.drain() == ["uevent add module ib_core"]
    assert select.select([src], [], [], 0)[0] == []
    kernel.remove("ib_core")
    assert src.drain() == ["uevent remove module ib_core"]
    assert [(u.action, u.devpath) for u in kernel.uevents] == [
        ("add", "/module/ib_core"),
        ("remove", "/module/ib_core"),
    ]


def test_initstate_goes_coming_live_going_in_virtual_time(tmp_path: Path) -> None:
    sched = Scheduler()
    k = SimKernel(tmp_path, KVER, sched, init_delay=1.0, exit_delay=1.0)
    install_generation(moddir(tmp_path), KVER, OLD, RDMA_MODULES[:1])
    depmod(moddir(tmp_path))
    seen: list[tuple[float, str | None]] = []

    def look() -> None:
        f = sysmod(k, "ib_core") / "initstate"
        seen.append((sched.now(), f.read_text().strip() if f.exists() else None))

    for t in (0.5, 1.5, 2.5, 3.5):
        sched.call_at(t, look)

    def actor() -> None:
        k.probe("ib_core", str(moddir(tmp_path)))  # t 0 -> 1
        sched.sleep(1.0)
        k.remove("ib_core")  # t 2 -> 3

    sched.spawn("insmod", actor)
    sched.run(10.0)
    sched.close()
    assert seen == [(0.5, "coming"), (1.5, "live"), (2.5, "going"), (3.5, None)]


def test_sriov_numvfs_creates_vfs_whose_netdevs_appear_late(kernel: SimKernel) -> None:
    root = kernel.root
    pf = kernel.add_pf("enp1s0f0", "0000:01:00.0", totalvfs=8, vf_delay=lambda i: 2.0)
    kernel.probe("mlx5_core", str(moddir(root)))
    kernel.sched.run(kernel.sched.now() + 2)  # the PF's netdev after the driver probe
    dev = root / "sys/class/net/enp1s0f0/device"
    assert (dev / "sriov_numvfs").read_text() == "0\n"
    kernel.uevent_source.drain()
    kernel.write_sriov_numvfs("enp1s0f0", 3)
    assert (dev / "sriov_numvfs").read_text() == "3\n"
    assert os.readlink(dev / "virtfn2") == "../0000:01:00.5"
    assert (dev / "virtfn0/physfn").exists()
    assert kernel.vf_netdev("enp1s0f0", 0) is None  # the VF exists, its netdev not yet
    t0 = kernel.sched.now()
    kernel.sched.run(t0 + 2.1)
    assert kernel.vf_netdev("enp1s0f0", 0) == "eth0" and kernel.vf_netdev("enp1s0f0", 1) is None
    kernel.sched.run(t0 + 10)
    assert [kernel.vf_netdev("enp1s0f0", i) for i in range(3)] == [
        "enp1s0f0v0",
        "enp1s0f0v1",
        "enp1s0f0v2",
    ]
    adds = [d for d in kernel.uevent_source.drain() if d.startswith("uevent add net")]
    assert adds == ["uevent add net eth0"] * 3  # each one, then renamed by udev
    assert pf.vfs[2].netdev == "enp1s0f0v2"


def test_sriov_n_to_m_is_ebusy_and_config_store(kernel: SimKernel) -> None:
    kernel.add_pf("enp1s0f0", "0000:01:00.0", totalvfs=8, vf_delay=lambda i: 0.1)
    kernel.probe("mlx5_core", str(moddir(kernel.root)))
    kernel.sched.run(kernel.sched.now() + 2)
    kernel.write_sriov_numvfs("enp1s0f0", 4)
    with pytest.raises(OSError) as err:
        kernel.write_sriov_numvfs("enp1s0f0", 2)
    assert err.value.errno == errno.EBUSY
    with pytest.raises(OSError) as err:
        kernel.set_link("enp1s0f0v0", mtu=9000)  # its netdev is not there yet
    assert err.value.errno == errno.ENODEV
    kernel.sched.run(kernel.sched.now() + 5)
    kernel.set_vf("enp1s0f0", 0, mac="02:00:00:00:00:01", vlan=100, trust=True, spoofchk=False)
    kernel.set_link("enp1s0f0v0", mtu=9000, admin_up=True)
    cfg = kernel.vf_configs("enp1s0f0")[0]
    assert cfg.differences(VfConfig()) == ["mac", "vlan", "trust", "spoofchk", "mtu", "admin_up"]
    kernel.write_sriov_numvfs("enp1s0f0", 0)
    kernel.write_sriov_numvfs("enp1s0f0", 2)
    assert kernel.vf_configs("enp1s0f0") == [VfConfig(), VfConfig()]  # a new VF starts blank
    kernel.write_sriov_numvfs("enp1s0f0", 0)
    with pytest.raises(OSError) as err:
        kernel.write_sriov_numvfs("enp1s0f0", 9)  # more than sriov_totalvfs
    assert err.value.errno == errno.ERANGE


def test_unloading_the_pf_driver_destroys_the_vfs(kernel: SimKernel) -> None:
    kernel.add_pf("enp1s0f0", "0000:01:00.0", totalvfs=8, vf_delay=lambda i: 0.1)
    kernel.probe("mlx5_core", str(moddir(kernel.root)))
    kernel.sched.run(kernel.sched.now() + 2)
    kernel.write_sriov_numvfs("enp1s0f0", 2)
    kernel.sched.run(kernel.sched.now() + 5)
    kernel.remove("mlx5_core")
    assert not (kernel.root / "sys/class/net/enp1s0f0").exists()
    assert not (kernel.root / "sys/class/net/enp1s0f0v0").exists()
    assert kernel.pfs["enp1s0f0"].vfs == []
    with pytest.raises(OSError) as err:
        kernel.write_sriov_numvfs("enp1s0f0", 2)  # no driver bound
    assert err.value.errno == errno.ENOENT


def test_a_push_while_the_agent_drains_the_wake_pipe_leaves_no_byte_without_its_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The harness's fence is pushed from its thread while the agent's may be draining it
    (woken by inotify). A push between the drain's read of the pipe and its take of the
    reasons had its reason taken and its byte left: the agent's next pass read the fence
    as pending (its gate withdrawn, not fresh), and the drain of that byte gave no reason
    (no pass), while ``pending`` said 0 (the harness settled): kernel-upgrade-race's held
    load was never let go. Here the push comes at exactly that point, every time."""
    pipe = WakePipe()
    taken = poke_mid_drain(pipe, lambda: pipe.push("simulation step"), monkeypatch)
    # Readable exactly while a reason is pending, and a drain of it gives that reason.
    assert bool(readable([pipe])) == (pipe.pending > 0), (taken, pipe.pending)
    assert [*taken, *pipe.drain()] == ["simulation step"]
    assert not readable([pipe]) and pipe.pending == 0
    pipe.close()
