"""Bad input gets a clear one-line error or a closed reason, never a traceback."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from nodeagent.agent import Agent, build_reconciler
from nodeagent.cli import main
from nodeagent.config import Config, load_config
from nodeagent.errors import NodeagentError
from nodeagent.host.fs import HostRoot
from nodeagent.host.observe import Observer
from nodeagent.host.state import StateStore
from nodeagent.timeline import Timeline
from tests.snapshots import READY

BUILD_ID = bytes(range(20))


def note(desc: bytes = BUILD_ID) -> bytes:
    return struct.pack("<III", 4, len(desc), 3) + b"GNU\0" + desc


def sysmod(root: Path, name: str, **attrs: str | bytes) -> Path:
    d = root / "sys/module" / name
    (d / "holders").mkdir(parents=True, exist_ok=True)
    for key, value in attrs.items():
        target = d / ("notes/.note.gnu.build-id" if key == "note" else key)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(value if isinstance(value, bytes) else (value + "\n").encode())
    return d


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/osrelease").write_text("6.1.0-test\n")
    return tmp_path


def observe(root: Path):
    cfg = Config(host_root=str(root))
    return Observer(HostRoot(root), cfg, build_reconciler(cfg).needs()).observe(1.0)


def test_garbage_sysfs_values_become_named_problems(root: Path) -> None:
    sysmod(root, "ib_core", initstate="bananas", refcnt="1x", srcversion="not hex!")
    snap = observe(root)
    mod = snap.modules["ib_core"]
    assert mod.initstate is None and mod.refcnt is None and mod.srcversion is None
    assert "initstate is 'bananas' (expected live, coming or going)" in mod.problems
    assert "refcnt is '1x' (not a number)" in mod.problems
    assert "srcversion is 'not hex!' (not hexadecimal)" in mod.problems
    verdict = build_reconciler(Config()).decide(snap, build_reconciler(Config()).initial_memory())
    assert "ib_core is not live (initstate unreadable)" in verdict.verdicts["peermem"].reasons


def test_a_module_unloaded_while_it_is_read_is_not_loaded_not_unreadable(root: Path) -> None:
    """Its directory goes between two reads (the kernel's unload ends mid-pass): it is
    gone, not "refcnt unreadable", which the storage guard takes for a possible user and
    answers by stopping the very removal that unloaded it (issue 55's flake). A module
    whose refcnt is missing while it stays is read as it is."""
    import shutil

    gone = sysmod(root, "rpcrdma", initstate="live", refcnt="0")
    sysmod(root, "ib_cm", initstate="live")  # no refcnt, and it stays
    host = HostRoot(root)
    read_text = host.read_text

    def unload_after_initstate(rel: str, limit: int = 4096) -> str:
        text = read_text(rel, limit)
        if rel.endswith("rpcrdma/initstate") and gone.exists():
            shutil.rmtree(gone)
        return text

    host.read_text = unload_after_initstate  # type: ignore[method-assign]
    observer = Observer(host, Config(host_root=str(root)))
    assert observer.read_loaded_module("rpcrdma") is None
    stays = observer.read_loaded_module("ib_cm")
    assert stays is not None and stays.refcnt is None and stays.initstate == "live"


def test_truncated_build_id_note_is_a_problem_not_a_crash(root: Path) -> None:
    sysmod(root, "mlx5_core", initstate="live", refcnt="0", note=note()[:17])
    good = sysmod(root, "mlx5_ib", initstate="live", refcnt="0", note=note())
    assert good.exists()
    snap = observe(root)
    assert snap.modules["mlx5_core"].build_id is None
    assert any("build-id" in p or "note" in p for p in snap.modules["mlx5_core"].problems)
    assert snap.modules["mlx5_ib"].build_id == BUILD_ID.hex()


def test_builtin_modules_without_initstate_are_not_loaded_modules(root: Path) -> None:
    (root / "sys/module/printk/parameters").mkdir(parents=True)
    assert "printk" not in observe(root).modules


def test_symlink_at_driver_ready_is_reported_and_not_followed(root: Path) -> None:
    elsewhere = root / "elsewhere"
    elsewhere.write_text("")
    flag = root / "run/mellanox/drivers/.driver-ready"
    flag.parent.mkdir(parents=True)
    flag.symlink_to(elsewhere)
    snap = observe(root)
    assert snap.file(READY).present is False
    assert "symlink" in (snap.file(READY).problem or "")
    d = build_reconciler(Config()).decide(snap, build_reconciler(Config()).initial_memory())
    assert any("is a symlink" in r for r in d.verdicts["peermem"].reasons)


def test_malformed_kernel_release(root: Path) -> None:
    (root / "proc/sys/kernel/osrelease").write_text("../../etc\n")
    snap = observe(root)
    assert snap.kernel == "unknown"
    assert any("malformed" in p for p in snap.problems)


def test_missing_host_root_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["check", "--host-root", str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and "not a directory" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ("mode = [", "does not parse as TOML"),
        ('mode = "yolo"', "mode: expected one of observe, enforce, got 'yolo'"),
        ('[peermem]\nrdma_stack = ["mlx5_core", "ib core; rm -rf /"]', "invalid kernel module"),
        ('[peermem]\nload_params = ["a=$(reboot)"]', "invalid module parameter"),
        ('[peermem]\nmofed = "sometimes"', "peermem.mofed"),
        ('[paths]\nmofed_ready = "/etc/passwd"', "must be relative to the host root"),
        ('[paths]\nstate_dir = "run/../../x"', "without '..'"),
        ("frobnicate = 1", "unknown key 'frobnicate'"),
        ('[storage]\nmodules = ["rpcrdma", "nvme rdma"]', "invalid kernel module name 'nvme rdma'"),
        ('[storage]\npolicy = "yank"', "storage.policy"),
        ('[storage]\nhold_file = "../etc/x.conf"', "without '..'"),
        ("resync_seconds = -1", "resync_seconds"),
    ],
)
def test_bad_config_is_one_line_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, expect: str
) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    with pytest.raises(NodeagentError) as exc:
        load_config(str(cfg), host_root=str(tmp_path))
    assert expect in str(exc.value)
    assert "\n" not in str(exc.value)
    rc = main(["check", "--host-root", str(tmp_path), "--config", str(cfg)])
    err = capsys.readouterr().err
    assert rc == 2 and expect in err and "Traceback" not in err


def test_corrupt_state_file_is_set_aside_and_agent_starts_fresh(root: Path) -> None:
    state = root / "run/nodeagent/state.json"
    state.parent.mkdir(parents=True)
    state.write_text('{"version": 1, "guards": {"peermem": {"failures": "lots"')
    cfg = Config(host_root=str(root), uevents=False)
    agent = Agent(cfg, module_ops=_NoOps(), kernel_log=lambda m: [])
    assert [p.name for p in (root / "run/nodeagent").glob("state.json.bad-*")]
    agent.run_pass(["test"])
    saved = json.loads(state.read_text())
    assert saved["version"] == 1 and "peermem" in saved["guards"]
    kinds = [r["kind"] for r in Timeline(HostRoot(root), "var/lib/nodeagent", 1 << 20, 2).records()]
    assert "state-problem" in kinds


def test_bad_guard_memory_resets_only_that_guard(root: Path) -> None:
    state = root / "run/nodeagent/state.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps({"version": 1, "guards": {"peermem": {"failures": "lots"}}}))
    store = StateStore(HostRoot(root), "run/nodeagent")
    memory, problems = store.load_memory(build_reconciler(Config()))
    assert memory["peermem"].failures == 0
    assert problems and "peermem memory is malformed" in problems[0]


def test_symlinked_state_file_is_not_followed(root: Path) -> None:
    victim = root / "victim"
    victim.write_text("precious")
    state = root / "run/nodeagent/state.json"
    state.parent.mkdir(parents=True)
    state.symlink_to(victim)
    agent = Agent(
        Config(host_root=str(root), uevents=False), module_ops=_NoOps(), kernel_log=lambda m: []
    )
    agent.run_pass(["test"])
    assert victim.read_text() == "precious"
    assert not state.is_symlink()


def test_symlinked_state_dir_is_refused_for_writes(root: Path) -> None:
    (root / "run").mkdir()
    (root / "run/nodeagent").symlink_to(root / "proc")
    with pytest.raises(NodeagentError, match="not a directory"):
        HostRoot(root).write_atomic("run/nodeagent/status.json", b"{}")


def test_timeline_rotates_and_reads_back_in_order(tmp_path: Path) -> None:
    tl = Timeline(HostRoot(tmp_path), "var/lib/nodeagent", max_bytes=4096, keep=2)
    for i in range(400):
        tl.append({"i": i, "pad": "x" * 40})
    files = sorted(os.listdir(tmp_path / "var/lib/nodeagent"))
    assert files == ["timeline.jsonl", "timeline.jsonl.1", "timeline.jsonl.2"]
    got = [r["i"] for r in tl.records()]
    assert got == sorted(got) and got[-1] == 399
    assert all(os.path.getsize(tmp_path / "var/lib/nodeagent" / f) <= 4096 + 100 for f in files)


def test_cli_has_no_traceback_on_unknown_command() -> None:
    p = subprocess.run([sys.executable, "-m", "nodeagent", "frob"], capture_output=True, text=True)
    assert p.returncode == 2 and "Traceback" not in p.stderr


class _NoOps:
    def insert_file(self, path: str, params: object) -> None:
        raise AssertionError("observe-mode agent must not load")

    def insert_fd(self, fd: int, name: str, params: object) -> None:
        raise AssertionError("observe-mode agent must not load")

    def remove(self, name: str) -> None:
        raise AssertionError("observe-mode agent must not unload")

    def probe(self, name: str, moddir: str, params: object = ()) -> None:
        raise AssertionError("observe-mode agent must not probe")


def test_unknown_module_in_config_is_a_closed_reason_naming_it(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = root / "c.toml"
    cfg.write_text('[peermem]\nrdma_stack = ["mlx5_core", "no_such_module"]\n')
    rc = main(["check", "--host-root", str(root), "--config", str(cfg), "--json"])
    out = capsys.readouterr()
    assert rc == 1 and "Traceback" not in out.err
    reasons = json.loads(out.out)["guards"]["peermem"]["reasons"]
    assert "no_such_module is not loaded" in reasons


STORAGE_LOCK = "run/mellanox/drivers/.lock"


def _mofed_pending_with_rpcrdma(root: Path) -> None:
    """rpcrdma loaded (no users: the mount table has only /) and MOFED's lock held."""
    sysmod(root, "rpcrdma", initstate="live", refcnt="0")
    (root / "proc/1").mkdir(parents=True)
    (root / "proc/1/mountinfo").write_text("22 1 259:2 / / rw - ext4 /dev/nvme0n1p2 rw\n")
    lock = root / STORAGE_LOCK
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    st = os.stat(lock)
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    (root / "proc/locks").write_text(f"1: FLOCK  ADVISORY  WRITE 77 {where} 0 EOF\n")


class _RecordingOps(_NoOps):
    def __init__(self) -> None:
        self.removed: list[str] = []

    def remove(self, name: str) -> None:
        self.removed.append(name)


def test_a_hold_file_that_is_a_symlink_is_not_written_through(root: Path) -> None:
    _mofed_pending_with_rpcrdma(root)
    victim = root / "victim"
    victim.write_text("precious\n")
    hold = root / "etc/modprobe.d/nodeagent-storage-hold.conf"
    hold.parent.mkdir(parents=True)
    hold.symlink_to(victim)
    ops = _RecordingOps()
    agent = Agent(Config(host_root=str(root), mode="enforce", uevents=False), module_ops=ops)
    result = agent.run_once(["test"])
    assert result.verdicts["storage"].verdict == "blocking"
    assert result.verdicts["storage"].evidence["hold_file"]["problem"].startswith("is a symlink")
    (failed,) = [o for o in result.outcomes if o.action.guard == "storage"]
    assert not failed.ok and "symlink" in (failed.error or "")
    assert victim.read_text() == "precious\n" and hold.is_symlink()
    assert ops.removed == []  # the sequence stopped at the failed hold: nothing half-done


def test_garbage_in_proc_locks_and_mountinfo_is_named_and_skipped(root: Path) -> None:
    _mofed_pending_with_rpcrdma(root)
    good = (root / "proc/locks").read_text()
    (root / "proc/locks").write_text("garbage\n1: FLOCK ADVISORY WRITE x 00:zz:1 0 EOF\n" + good)
    (root / "proc/1/mountinfo").write_bytes(
        b"\xff\xfe not a mount\n36 35 0:50 / /mnt/a\\040b rw - nfs4 srv:/x rw,proto=rdma\n"
    )
    snap = observe(root)
    assert "proc/locks: 2 malformed line(s) ignored" in snap.problems
    assert "proc/1/mountinfo: 1 malformed line(s) ignored" in snap.problems
    (mount,) = snap.mounts
    assert mount.mount_point == "/mnt/a b" and "proto=rdma" in mount.options
    assert snap.locks[0].pid == 77  # the good line still counts: MOFED is pending
    d = build_reconciler(Config()).decide(snap, build_reconciler(Config()).initial_memory())
    storage = d.verdicts["storage"]  # the mount read past the garbage is a named user
    assert storage.verdict == "in-use"
    assert storage.reasons[0] == "rpcrdma is in use: NFS-over-RDMA mount /mnt/a b (srv:/x)"


def test_a_crashed_writers_temp_with_our_pid_is_replaced_not_a_failure(tmp_path: Path) -> None:
    """A killed agent's temp file (``.<name>.tmp.<pid>``) whose pid a later agent has: the
    write removes it and goes on; a leftover symlink there is removed, never followed."""
    host = HostRoot(str(tmp_path))
    (tmp_path / "run/nodeagent").mkdir(parents=True)
    leftover = tmp_path / f"run/nodeagent/.status.json.tmp.{os.getpid()}"
    leftover.write_bytes(b"half a file")
    assert host.write_atomic("run/nodeagent/status.json", b"{}")
    assert (tmp_path / "run/nodeagent/status.json").read_bytes() == b"{}"
    assert not leftover.exists()
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep")
    leftover.symlink_to(target)
    assert host.write_atomic("run/nodeagent/status.json", b"[]", durable=False)
    assert target.read_bytes() == b"keep" and not leftover.is_symlink()
    assert (tmp_path / "run/nodeagent/status.json").read_bytes() == b"[]"
