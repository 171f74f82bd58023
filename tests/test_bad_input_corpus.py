# ruff: noqa: E501  (the corpus is a table: one case a line reads best)
"""The bad-input corpus: one table, each case one thing wrong on an otherwise healthy node.

The base node (the simulator's files: sysfs, markers, module trees) has the
peermem gate open. Each case breaks one fact — a sysfs attribute, a marker,
a ``.ko`` file or a compression bomb, ``modules.dep``, the config, saved
memory, ``status.json``, a gate file, the command line — runs one command
in-process and asserts the exact clean outcome: exit code, verdict (for
``check``), the key words of the reason, no traceback, and that it returned
(a thread joined with a timeout: a FIFO read that blocked would fail here).
"""

from __future__ import annotations

import functools
import gzip
import json
import lzma
import os
import shutil
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import zstandard

from nodeagent.cli import main
from nodeagent.host import gatefile
from nodeagent.sim.node import BLACKLIST, READY
from tests.healthy import KVER, healthy_node
from tests.waiting import WAIT

GPU_DIR = f"run/nvidia/driver/lib/modules/{KVER}"
MOFED_DIR = f"run/mellanox/drivers/lib/modules/{KVER}"
PEER = f"{GPU_DIR}/kernel/drivers/video/nvidia-peermem.ko"
NVIDIA_KO = f"{GPU_DIR}/kernel/drivers/video/nvidia.ko"
MLX = "sys/module/mlx5_core"
STATE = "run/nodeagent/state.json"
STATUS = "run/nodeagent/status.json"
GATE = "run/nodeagent/peermem.gate"
VALIDATIONS = "run/nvidia/validations"
TIMELINE = "var/lib/nodeagent/timeline.jsonl"
RETURN_WITHIN = WAIT  # seconds: a case that has not returned by then hangs (fails)


# ------------------------------------------------------------------ the base node


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("healthy-node")
    healthy_node(root).kernel.uevent_source.close()
    return root


# ------------------------------------------------------------------ ways to break it

Setup = Callable[[Path], None]


def put(rel: str, data: bytes | str | Callable[[], str]) -> Setup:
    """Write ``data`` (a callable: made when the case runs, e.g. to hold the current time)."""

    def go(root: Path) -> None:
        p = root / rel
        _clear(p)
        p.parent.mkdir(parents=True, exist_ok=True)
        made = data() if callable(data) else data
        p.write_bytes(made.encode() if isinstance(made, str) else made)

    return go


def fifo(rel: str) -> Setup:
    def go(root: Path) -> None:
        p = root / rel
        _clear(p)
        p.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(p)

    return go


def directory(rel: str) -> Setup:
    def go(root: Path) -> None:
        p = root / rel
        _clear(p)
        p.mkdir(parents=True)

    return go


def loop(rel: str) -> Setup:
    """``rel`` replaced by a symlink to itself (ELOOP on every open)."""
    return link(rel, rel.rpartition("/")[2])


def link(rel: str, target: str) -> Setup:
    def go(root: Path) -> None:
        p = root / rel
        _clear(p)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.symlink_to(target)

    return go


def gone(rel: str) -> Setup:
    return lambda root: _clear(root / rel)


def sparse(rel: str, size: int) -> Setup:
    def go(root: Path) -> None:
        p = root / rel
        _clear(p)
        with open(p, "wb") as f:
            f.truncate(size)

    return go


def both(*steps: Setup) -> Setup:
    def go(root: Path) -> None:
        for s in steps:
            s(root)

    return go


def moved(rel: str, to: str, *, absolute_link: bool) -> Setup:
    """Move a file elsewhere under the root and leave a symlink to it."""

    def go(root: Path) -> None:
        (root / to).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(root / rel, root / to)
        target = "/" + to if absolute_link else os.path.relpath(root / to, (root / rel).parent)
        (root / rel).symlink_to(target)

    return go


def many_validations(n: int) -> Setup:
    def go(root: Path) -> None:
        d = root / VALIDATIONS
        d.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            (d / f"marker-{i:05d}-ready").touch()

    return go


def _clear(p: Path) -> None:
    if p.is_symlink() or p.is_file() or (p.exists() and not p.is_dir()):
        p.unlink()
    elif p.is_dir():
        shutil.rmtree(p)


def elf_header(shoff: int, shnum: int, klass: int = 2, data: int = 1) -> bytes:
    ident = b"\x7fELF" + bytes([klass, data, 1]) + bytes(9)
    return struct.pack("<16sHHIQQQIHHHHHH", ident, 1, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64, shnum, 0)


def _zstd_zeros(head: bytes, total: int) -> bytes:
    obj = zstandard.ZstdCompressor(level=1).compressobj()
    out = [obj.compress(head)]
    zero = bytes(1 << 20)
    for _ in range(total >> 20):
        out.append(obj.compress(zero))
    out.append(obj.flush())
    return b"".join(out)


# Compression bombs: small files that decompress to hundreds of MiB.
ZSTD_BOMB_ELF = _zstd_zeros(elf_header(4096, 1), 300 << 20)  # header says 4 KiB, then zeros
ZSTD_BOMB_ZEROS = _zstd_zeros(b"", 300 << 20)  # not even an ELF header
XZ_BOMB = lzma.compress(bytes(32 << 20), preset=0)
GZ_BOMB = gzip.compress(bytes(64 << 20), compresslevel=1)
XZ_HUGE_HEADER = lzma.compress(elf_header(1 << 30, 16))  # claims a 1 GiB image


def peer_as(suffix: str, data: bytes) -> Setup:
    """nvidia-peermem under a compressed name, modules.dep pointing at it."""

    def go(root: Path) -> None:
        (root / PEER).unlink()
        (root / (PEER + suffix)).write_bytes(data)
        dep = root / GPU_DIR / "modules.dep"
        dep.write_text(dep.read_text().replace("nvidia-peermem.ko:", f"nvidia-peermem.ko{suffix}:"))

    return go


def state(doc: object | str) -> Setup:
    return put(STATE, doc if isinstance(doc, str) else json.dumps(doc))


def peer_memory(**fields: object) -> Setup:
    return guard_memory("peermem", **fields)


def guard_memory(guard: str, **fields: object) -> Setup:
    return state({"version": 1, "guards": {guard: fields}})


PF = "0000:01:00.0"
SAVED_PF = {"pci": PF, "numvfs": 1, "vfs": []}


def status(doc: object | str) -> Setup:
    return put(STATUS, doc if isinstance(doc, str) else json.dumps(doc))


def gate(doc: object | str) -> Setup:
    return put(GATE, doc if isinstance(doc, str) else json.dumps(doc))


def gate_lease(left: float, boot: str | None = None, wall: float = 0.0) -> Setup:
    """A gate file whose lease ends ``left`` seconds after the case is set up (boot-time
    clock; ``test_bad_input`` holds the readers' clock at that moment)."""
    return put(
        GATE,
        lambda: json.dumps(
            {
                "version": gatefile.GATE_VERSION,
                "guard": "peermem",
                "confirmed_at": time.time() + wall,
                "lease_until": gatefile.lease_clock() + left,
                "boot_id": gatefile.boot_id() if boot is None else boot,
                "pid": 1,
            }
        ),
    )


def fresh_status(**over: object) -> Setup:
    """A status.json of a pass that ran just before the case (plus ``over``)."""

    def make() -> str:
        doc = {
            "version": "0.1",
            "time": time.time(),
            "mode": "observe",
            "kernel": KVER,
            "resync_seconds": 30,
            "guards": {"peermem": {"verdict": "closed", "reasons": ["r"], "evidence": {}}},
            "last_actions": [],
        }
        doc.update(over)
        return json.dumps(doc)

    return put(STATUS, make)


def config(text: str) -> Setup:
    return put("c.toml", text)


def timeline(*bad: str) -> Setup:
    """A timeline of one good record, then the ``bad`` lines."""
    good = json.dumps({"ts": 1_795_000_000, "kind": "start", "mode": "observe"})
    return put(TIMELINE, "".join(line + "\n" for line in (good, *bad)))


# ------------------------------------------------------------------ the table


@dataclass(frozen=True)
class Case:
    id: str
    setup: Setup
    rc: int
    words: tuple[str, ...]  # each must appear in stdout + stderr
    verdict: str | None = None  # for check: the peermem verdict
    argv: tuple[str, ...] = ("check", "--json")


def check(id: str, setup: Setup, verdict: str, *words: str) -> Case:
    return Case(id, setup, 0 if verdict == "open" else 1, words, verdict)


def cmd(id: str, setup: Setup, argv: tuple[str, ...], rc: int, *words: str) -> Case:
    return Case(id, setup, rc, words, None, argv)


NOTHING: Setup = lambda root: None  # noqa: E731
WAIT0 = ("wait", "peermem", "--timeout", "0")
CFG = ("check", "--config", "{root}/c.toml")
TL = ("timeline",)
TL_HTML = ("timeline", "--format", "html")

CASES = [
    check("healthy-node", NOTHING, "open"),
    # -- sysfs attributes
    check("initstate-garbage", put(f"{MLX}/initstate", "bananas\n"), "closed", "mlx5_core is not live", "bananas"),
    check("initstate-empty", put(f"{MLX}/initstate", ""), "closed", "mlx5_core is not live"),
    check("initstate-nul", put(f"{MLX}/initstate", "live\0\n"), "closed", "mlx5_core is not live"),
    check("initstate-fifo", fifo(f"{MLX}/initstate"), "closed", "mlx5_core is not live", "FIFO"),
    check("initstate-directory", directory(f"{MLX}/initstate"), "closed", "mlx5_core is not live", "directory"),
    check("initstate-symlink", link(f"{MLX}/initstate", "/etc/hostname"), "closed", "mlx5_core is not live", "initstate unreadable"),
    check("initstate-oversized", put(f"{MLX}/initstate", "live" + " " * 8000), "closed", "mlx5_core is not live", "larger than 4096"),
    check("initstate-going", put(f"{MLX}/initstate", "going\n"), "closed", "mlx5_core is not live (initstate going)"),
    check("initstate-binary", put(f"{MLX}/initstate", b"\xff\xfe\x1b[31m"), "closed", "mlx5_core is not live"),
    check("refcnt-superscript", put(f"{MLX}/refcnt", "²\n"), "open", "refcnt is '²' (not a number)"),
    check("refcnt-negative", put(f"{MLX}/refcnt", "-1\n"), "open", "refcnt is '-1' (not a number)"),
    check("refcnt-float", put(f"{MLX}/refcnt", "1e3\n"), "open", "(not a number)"),
    check("refcnt-hex", put(f"{MLX}/refcnt", "0x10\n"), "open", "(not a number)"),
    check("refcnt-arabic-digits", put(f"{MLX}/refcnt", "٣\n"), "open", "(not a number)"),
    check("refcnt-fifo", fifo(f"{MLX}/refcnt"), "open", "refcnt unreadable"),
    # srcversion unusable: the GNU build-id still proves the identity (reported, not fatal)
    check("srcversion-not-hex", put(f"{MLX}/srcversion", "zz-top\n"), "open", "not hexadecimal"),
    check("srcversion-too-long", put(f"{MLX}/srcversion", "A" * 65 + "\n"), "open", "not hexadecimal"),
    check("srcversion-and-build-id-unusable", both(put(f"{MLX}/srcversion", "zz\n"), gone(f"{MLX}/notes")), "closed", "cannot tell whether"),
    check("srcversion-other-module", put(f"{MLX}/srcversion", "0123456789ABCDEF01234567\n"), "closed", "is not the one on disk"),
    check("srcversion-fifo", fifo(f"{MLX}/srcversion"), "open", "srcversion unreadable", "FIFO"),
    check("srcversion-directory", directory(f"{MLX}/srcversion"), "open", "srcversion unreadable"),
    check("build-id-note-truncated", both(gone(f"{MLX}/srcversion"), put(f"{MLX}/notes/.note.gnu.build-id", b"\x04\0\0\0\x14\0")), "closed", "mlx5_core", "note"),
    check("build-id-note-fifo", both(gone(f"{MLX}/srcversion"), fifo(f"{MLX}/notes/.note.gnu.build-id")), "closed", "build-id note unreadable"),
    check("osrelease-traversal", put("proc/sys/kernel/osrelease", "../../etc\n"), "closed", "kernel release", "malformed"),
    check("osrelease-empty", put("proc/sys/kernel/osrelease", ""), "closed", "malformed"),
    check("osrelease-escape-codes", put("proc/sys/kernel/osrelease", "\x1b]0;pwned\x07\n"), "closed", "malformed", "\\x1b"),
    check("osrelease-fifo", fifo("proc/sys/kernel/osrelease"), "closed", "kernel release unreadable", "FIFO"),
    check("osrelease-oversized", put("proc/sys/kernel/osrelease", "6" * 1000), "closed", "kernel release unreadable"),
    check("sys-module-missing", gone("sys/module"), "closed", "nvidia is not loaded", "no loadable modules"),
    check("sys-module-is-a-file", put("sys/module", "x"), "closed", "nvidia is not loaded", "sys/module does not exist"),
    check("module-dir-odd-names", both(directory("sys/module/mlx5 core"), directory("sys/module/..x")), "open"),
    # -- markers
    check("ready-flag-absent", gone(READY), "closed", "ready flag", "is absent"),
    check("ready-flag-symlink", link(READY, "/etc/hostname"), "closed", "is a symlink", "ignored"),
    check("ready-flag-directory", directory(READY), "closed", "is a directory", "ignored"),
    check("ready-flag-fifo", fifo(READY), "closed", "is a FIFO", "ignored"),
    check("ready-flag-dir-symlinked-in-root", moved("run/mellanox/drivers/.driver-ready", "var/mofed/.driver-ready", absolute_link=True), "closed", "is a symlink"),
    check("blacklist-present", put(BLACKLIST, "blacklist mlx5_core\n"), "closed", "MOFED is restarting openibd"),
    check("blacklist-symlink", link(BLACKLIST, "/nonexistent"), "closed", "MOFED is restarting openibd", "counted as present"),
    check("blacklist-directory", directory(BLACKLIST), "closed", "MOFED is restarting openibd", "is a directory"),
    check("blacklist-fifo", fifo(BLACKLIST), "closed", "MOFED is restarting openibd", "FIFO"),
    check("validations-10000-markers", many_validations(10_000), "open", "more left out"),
    check("validations-is-a-file", put(VALIDATIONS, "x"), "open"),
    check("validations-fifo", fifo(VALIDATIONS), "open"),
    check("validations-symlink-loop", loop(VALIDATIONS), "open", "run/nvidia/validations unreadable"),
    check("holders-symlink-loop", loop(f"{MLX}/holders"), "open", "holders unreadable"),
    check("mofed-lock-fifo", fifo("run/mellanox/drivers/.lock"), "open"),
    # -- .ko files and compression bombs
    check("peermem-ko-empty", put(PEER, b""), "closed", "cannot verify nvidia_peermem.ko", "not an ELF file"),
    check("peermem-ko-truncated", lambda r: (r / PEER).write_bytes((r / PEER).read_bytes()[:200]), "closed", "cannot verify nvidia_peermem.ko", "truncated"),
    check("peermem-ko-garbage", put(PEER, b"MZ" + bytes(4000)), "closed", "cannot verify nvidia_peermem.ko", "bad magic"),
    check("peermem-ko-fifo", fifo(PEER), "closed", "cannot verify nvidia_peermem.ko", "FIFO"),
    check("peermem-ko-directory", directory(PEER), "closed", "cannot verify nvidia_peermem.ko", "directory"),
    check("peermem-ko-elf32", put(PEER, elf_header(64, 1, klass=1)), "closed", "cannot verify", "only ELF64"),
    check("peermem-ko-big-endian", put(PEER, elf_header(64, 1, data=2)), "closed", "cannot verify", "only little-endian"),
    check("peermem-ko-sparse-300MiB", sparse(PEER, 300 << 20), "closed", "cannot verify", "exceeds"),
    check("peermem-ko-absolute-link-in-root", moved(PEER, "opt/weak-updates/nvidia-peermem.ko", absolute_link=True), "open"),
    check("peermem-ko-relative-link", moved(PEER, "opt/other/nvidia-peermem.ko", absolute_link=False), "open"),
    check("peermem-ko-link-escaping-root", link(PEER, "../../../../../../../../../../etc/passwd"), "closed", "cannot verify", "No such file"),
    check("peermem-ko-link-loop", link(PEER, "nvidia-peermem.ko"), "closed", "cannot verify", "symbolic links"),
    check("peermem-zstd-bomb-elf-header", peer_as(".zst", ZSTD_BOMB_ELF), "closed", "cannot verify", "exceeds"),
    check("peermem-zstd-bomb-zeros", peer_as(".zst", ZSTD_BOMB_ZEROS), "closed", "cannot verify", "not an ELF file"),
    check("peermem-xz-bomb", peer_as(".xz", XZ_BOMB), "closed", "cannot verify", "not an ELF file"),
    check("peermem-gz-bomb", peer_as(".gz", GZ_BOMB), "closed", "cannot verify", "not an ELF file"),
    check("peermem-xz-header-claims-1GiB", peer_as(".xz", XZ_HUGE_HEADER), "closed", "cannot verify", "exceeds"),
    check("peermem-xz-corrupt", peer_as(".xz", lzma.compress(b"x" * 1000)[:40] + b"garbage"), "closed", "cannot verify", "decompress"),
    check("peermem-xz-suffix-not-xz", peer_as(".xz", b"plain text"), "closed", "cannot verify", "not xz data"),
    check("nvidia-ko-garbage", put(NVIDIA_KO, b"\x7fELF garbage"), "closed", "cannot verify nvidia"),
    check("mlx5-ko-garbage", put(f"{MOFED_DIR}/extra/mlnx-ofa_kernel/drivers/net/ethernet/mellanox/mlx5/core/mlx5_core.ko", b"junk"), "closed", "mlx5_core", "cannot read"),
    # -- modules.dep
    check("gpu-modules-dep-missing", gone(f"{GPU_DIR}/modules.dep"), "closed", "cannot verify nvidia_peermem.ko", "not in modules.dep"),
    check("gpu-modules-dep-fifo", fifo(f"{GPU_DIR}/modules.dep"), "closed", "not in modules.dep"),
    check("gpu-modules-dep-directory", directory(f"{GPU_DIR}/modules.dep"), "closed", "not in modules.dep"),
    check("gpu-modules-dep-binary", put(f"{GPU_DIR}/modules.dep", bytes(range(256)) * 10), "closed", "not in modules.dep"),
    check("gpu-modules-dep-dotdot", put(f"{GPU_DIR}/modules.dep", "../../../../etc/nvidia-peermem.ko:\n"), "closed", "cannot verify nvidia_peermem.ko", "not in modules.dep"),
    check("gpu-modules-dep-absolute-elsewhere", put(f"{GPU_DIR}/modules.dep", "/etc/nvidia-peermem.ko:\n"), "closed", "cannot verify nvidia_peermem.ko", "not in modules.dep"),
    check("gpu-modules-dep-oversized", sparse(f"{GPU_DIR}/modules.dep", 65 << 20), "closed", "not in modules.dep"),
    check("mofed-modules-dep-missing", gone(f"{MOFED_DIR}/modules.dep"), "closed", "mlx5_core", "not in modules.dep"),
    check("gpu-modules-dep-absolute-link", moved(f"{GPU_DIR}/modules.dep", "srv/modules.dep", absolute_link=True), "open"),
    # -- saved memory (check reads it, read-only)
    check("state-not-json", state("{"), "open", "state.json", "state file is corrupt"),
    check("state-nan", state('{"version": 1, "guards": {"peermem": {"retry_at": NaN}}}'), "open", "NaN is not a finite number"),
    check("state-infinity", state('{"version": 1, "guards": {"peermem": {"retry_at": Infinity}}}'), "open", "Infinity is not a finite number"),
    check("state-1e999", state('{"version": 1, "guards": {"peermem": {"retry_at": 1e999}}}'), "open", "not a finite number"),
    check("state-failures-string", peer_memory(failures="lots"), "open", "failures is 'lots', not a count", "that guard starts fresh"),
    check("state-failures-negative", peer_memory(failures=-1), "open", "not a count"),
    check("state-failures-bool", peer_memory(failures=True), "open", "not a count"),
    check("state-retry-at-string", peer_memory(retry_at="soon"), "open", "retry_at is 'soon'"),
    check("state-stale-flag-short", peer_memory(stale_flag=[1, 2]), "open", "stale_flag is not"),
    check("state-stale-flag-strings", peer_memory(stale_flag=["a", "b", "c"]), "open", "stale_flag is not"),
    check("state-pending-string", peer_memory(restart_pending="yes"), "open", "restart_pending is not a boolean"),
    check("state-unknown-field", peer_memory(surprise=1), "open", "unknown field 'surprise'"),
    check("state-wrong-version", state({"version": 0, "guards": {}}), "open", "not a version-1 state object"),
    check("state-newer-version", state({"version": 2, "guards": {}}), "open", "written by a newer nodeagent (state version 2; this one reads version 1: a downgrade)"),
    check("state-top-level-list", state("[1, 2]"), "open", "not a version-1 state object"),
    check("state-guards-not-object", state({"version": 1, "guards": [1]}), "open", "'guards' is not an object"),
    check("state-deep-nesting", state("[" * 100_000 + "]" * 100_000), "open", "state file is corrupt"),
    check("state-not-utf8", state(b"\xff\xfe{}".decode("latin-1")), "open", "state file is corrupt"),
    check("state-fifo", fifo(STATE), "open", "state file is a FIFO"),
    check("state-directory", directory(STATE), "open", "state file is a directory"),
    check("state-symlink", link(STATE, "/etc/passwd"), "open", "state file is a symlink"),
    check("state-stale-flag-memory-closes", peer_memory(restart_pending=True, stale_flag=[0, 0, 0]), "open"),
    check("state-storage-retry-at-nan-text", guard_memory("storage", retry_at="nan"), "open", "retry_at is 'nan', not a finite time", "that guard starts fresh"),
    check("state-storage-failures-fraction", guard_memory("storage", failures=1.5), "open", "failures is 1.5, not a count"),
    check("state-storage-removed-not-a-module", guard_memory("storage", removed=["../../x"]), "open", "removed is not a list of module names", "that guard starts fresh"),
    check("state-sriov-pfs-null", guard_memory("sriov", pfs=None), "open", "pfs is not an object", "that guard starts fresh"),
    check("state-sriov-restores-list", guard_memory("sriov", pfs={PF: {"saved": SAVED_PF, "phase": "stable", "restores": [1]}}), "open", "restores is not an object"),
    check("state-sriov-attempts-text", guard_memory("sriov", pfs={PF: {"saved": SAVED_PF, "phase": "restoring", "restores": {"0": {"status": "waiting", "attempts": "2"}}}}), "open", "attempts is '2', not a count"),
    # -- status.json (status must never trace back)
    cmd("status-list", status("[1, 2, 3]"), ("status",), 1, "agent state unknown"),
    cmd("status-string", status('"hello"'), ("status",), 1, "agent state unknown"),
    cmd("status-guards-list", fresh_status(guards=[1]), ("status",), 0, "agent reconciling"),
    cmd("status-guard-is-string", fresh_status(guards={"peermem": "open"}), ("status",), 0, "peermem: unknown"),
    cmd("status-time-string", fresh_status(time="yesterday"), ("status",), 1, "agent state unknown"),
    cmd("status-nan", status('{"time": NaN}'), ("status",), 2, "status.json: unreadable", "NaN"),
    cmd("status-old-pass", fresh_status(time=1000.0), ("status",), 1, "agent not reconciling since 1970-01-01"),
    cmd("status-fifo", fifo(STATUS), ("status",), 2, "unreadable", "FIFO"),
    cmd("status-directory", directory(STATUS), ("status",), 2, "unreadable", "directory"),
    cmd("status-binary", status("\udcff".encode("utf-8", "surrogatepass").decode("latin-1")), ("status",), 2, "unreadable"),
    cmd("status-escape-codes", fresh_status(guards={"peermem": {"verdict": "open", "reasons": ["\x1b[2J wiped"]}}), ("status",), 0, "\\x1b[2J wiped"),
    cmd("status-actions-odd", fresh_status(last_actions=[1, {"action": 3}, {"performed": "yes"}]), ("status",), 0, "last action: ?"),
    # -- gate files (wait must not be fooled)
    cmd("gate-empty-object", gate("{}"), WAIT0, 1, "not a gate file the agent wrote"),
    cmd("gate-garbage", gate("open!"), WAIT0, 1, "not a gate file the agent wrote"),
    cmd("gate-expired", gate_lease(-3600), WAIT0, 1, "the lease expired"),
    cmd("gate-lease-absurd", gate_lease(1e308), WAIT0, 1, "longer than any the agent gives"),
    cmd("gate-lease-a-day", gate_lease(86400), WAIT0, 1, "longer than any the agent gives"),
    cmd("gate-other-boot", gate_lease(2, boot="00000000-0000-0000-0000-000000000000"), WAIT0, 1, "another boot"),
    cmd("gate-v1-no-lease", gate('{"confirmed_at": 1e12, "resync_seconds": 1e308}'), WAIT0, 1, "not a gate file"),
    cmd("gate-confirmed-nan", gate('{"version": 2, "confirmed_at": NaN, "lease_until": 1, "boot_id": ""}'), WAIT0, 1, "not a gate file"),
    cmd("gate-directory", directory(GATE), WAIT0, 1, "unreadable", "directory"),
    cmd("gate-fifo", fifo(GATE), WAIT0, 1, "unreadable", "FIFO"),
    cmd("gate-symlink", link(GATE, "/etc/hostname"), WAIT0, 1, "unreadable"),
    cmd("gate-fresh", gate_lease(2.5), WAIT0, 0, "open"),
    # The wall clock plays no part: a lease from a pass an hour "ahead" is judged on its lease.
    cmd("gate-wall-clock-an-hour-ahead", gate_lease(2.5, wall=3600), WAIT0, 0, "open"),
    # -- config and command line
    cmd("config-fifo", fifo("c.toml"), CFG, 2, "not a regular file"),
    cmd("config-directory", directory("c.toml"), CFG, 2, "not a regular file"),
    cmd("config-nan", config("resync_seconds = nan"), CFG, 2, "resync_seconds"),
    cmd("config-inf", config("resync_seconds = inf"), CFG, 2, "resync_seconds"),
    cmd("config-keep-fraction", config("timeline_keep = 1.5"), CFG, 2, "config timeline_keep: expected a whole number, got 1.5"),
    cmd("config-sriov-parallel-fraction", config("[sriov]\nparallel = 2.5"), CFG, 2, "config sriov.parallel: expected a whole number"),
    cmd("config-hold-file-is-mofeds-flag", config('[storage]\nhold_file = "run/mellanox/drivers/.driver-ready"'), CFG, 2, "config storage.hold_file", "must be a NAME.conf file"),
    cmd("config-hold-file-is-mofeds-blacklist", config('[storage]\nhold_file = "etc/modprobe.d/blacklist-ofed-modules.conf"'), CFG, 2, "is MOFED's own file"),
    cmd("config-sriov-parallel-zero", config("[sriov]\nparallel = 0"), CFG, 2, "config sriov.parallel: 0 is outside 1..256"),
    cmd("config-binary", put("c.toml", b"\xff\xfe"), CFG, 2, "does not parse as TOML"),
    cmd("config-shell-in-module", config('[peermem]\nrdma_stack = ["$(reboot)"]'), CFG, 2, "invalid kernel module"),
    cmd("config-state-dir-dot", config('[paths]\nstate_dir = "."'), CFG, 2, "config paths.state_dir: '.' has an empty, blank or '.' component"),
    cmd("config-state-dir-double-slash", config('[paths]\nstate_dir = "run//nodeagent"'), CFG, 2, "empty, blank or '.' component"),
    cmd("config-state-dir-blank", config('[paths]\nstate_dir = " "'), CFG, 2, "empty, blank or '.' component"),
    cmd("config-state-dir-in-mofed", config('[paths]\nstate_dir = "run/mellanox/drivers/na"'), CFG, 2, "is inside run/mellanox/drivers/, not a directory of the agent's own"),
    cmd("config-timeline-dir-in-proc", config('[paths]\ntimeline_dir = "proc"'), CFG, 2, "config paths.timeline_dir: 'proc' is inside proc/"),
    cmd("config-path-newline", config('[paths]\nstate_dir = "run/nodeagent\\n"'), CFG, 2, "has a control character"),
    cmd("config-path-long-component", config('[paths]\nstate_dir = "' + "x" * 300 + '"'), CFG, 2, "a component longer than 255 bytes"),
    cmd("config-labels-prefix-not-dns", config('[labels]\nprefix = "Feature.Node/x"'), CFG, 2, "config labels.prefix: 'Feature.Node/x' is not a DNS subdomain"),
    cmd("config-labels-prefix-kubernetes-io", config('[labels]\nprefix = "node.kubernetes.io"'), CFG, 2, "is under kubernetes.io, which NFD refuses"),
    cmd("config-labels-nfd-text", config('[labels]\nnfd = "yes"'), CFG, 2, "config labels.nfd"),
    cmd("config-labels-expiry-short", config('[labels]\nexpiry_seconds = 5'), CFG, 2, "config labels.expiry_seconds: 5 is outside 60"),
    cmd("config-labels-unknown-key", config('[labels]\ncolour = "red"'), CFG, 2, "labels"),
    cmd("config-nested-too-deep", config("a = " + "[" * 100_000 + "]" * 100_000), CFG, 2, "nested too deep to parse"),
    cmd("config-too-large", config("# " + "x" * (1 << 20)), CFG, 2, "larger than 1048576 bytes"),
    cmd("timeout-nan", NOTHING, ("wait", "peermem", "--timeout", "nan"), 2, "finite number >= 0"),
    cmd("timeout-inf", NOTHING, ("wait", "peermem", "--timeout", "inf"), 2, "finite number >= 0"),
    cmd("timeout-negative", NOTHING, ("wait", "peermem", "--timeout", "-1"), 2, "finite number >= 0"),
    cmd("timeout-word", NOTHING, ("wait", "peermem", "--timeout", "soon"), 2, "not a number of seconds"),
    cmd("wait-unknown-gate", NOTHING, ("wait", "storage-ish"), 2, "invalid choice"),
    cmd("unknown-command", NOTHING, ("frobnicate",), 2, "invalid choice"),
    cmd("speed-inf", NOTHING, ("simulate", "--speed", "inf"), 2, "--speed must be within"),
    cmd("speed-nan", NOTHING, ("simulate", "--speed", "nan"), 2, "--speed must be within"),
    cmd("speed-negative", NOTHING, ("simulate", "--speed", "-5"), 2, "--speed must be within"),
    # -- the timeline (a bad record is skipped and counted; an unreadable file is one line)
    cmd("timeline-fifo", fifo(TIMELINE), TL, 2, "timeline.jsonl: unreadable", "FIFO"),
    cmd("timeline-fifo-html", fifo(TIMELINE), TL_HTML, 2, "timeline.jsonl: unreadable", "FIFO"),
    cmd("timeline-directory", directory(TIMELINE), TL, 2, "timeline.jsonl: unreadable", "directory"),
    cmd("timeline-symlink-loop", link(TIMELINE, "timeline.jsonl"), TL, 2, "timeline.jsonl: unreadable"),
    cmd("timeline-rotated-fifo", both(timeline(), fifo(TIMELINE + ".1")), TL, 2, "timeline.jsonl.1: unreadable"),
    cmd("timeline-deep-nesting", timeline("[" * 50000 + "]" * 50000), TL, 0, "1 records skipped", "running (observe)"),
    cmd("timeline-deep-nesting-html", timeline("[" * 50000 + "]" * 50000), TL_HTML, 0, "1 records skipped", "<svg"),
    cmd("timeline-ts-overflow", timeline('{"ts": 1e999, "kind": "decision"}'), TL, 0, "1 records skipped", "running (observe)"),
    cmd("timeline-ts-overflow-html", timeline('{"ts": 1e999, "kind": "decision"}'), TL_HTML, 0, "1 records skipped", "<svg"),
    cmd("timeline-ts-very-negative", timeline('{"ts": -1e308, "kind": "decision"}'), TL, 0, "1 records skipped"),
    cmd("timeline-ts-nan-and-torn", timeline('{"ts": NaN, "kind": "stop"}', '{"ts": 17'), TL_HTML, 0, "2 records skipped"),
    cmd("timeline-odd-field-types", timeline('{"ts": 1795000001, "kind": "decision", "guard": ["g"], "verdict": {"a": 1}, "reasons": "r", "events": 5, "ok": "yes"}', '{"ts": 1795000002, "kind": "action", "action": {"x": 1}, "ok": [], "performed": "no", "kernel_messages": {"k": 1}}'), TL, 0, "running (observe)"),
    cmd("timeline-odd-field-types-html", timeline('{"ts": 1795000001, "kind": "decision", "events": 5, "reasons": 7}'), TL_HTML, 0, "<svg"),
    cmd("timeline-only-bad-records", put(TIMELINE, '{"ts": 1e999, "kind": "decision"}\n'), TL, 1, "1 records skipped", "no timeline records"),
    cmd("since-inf", NOTHING, (*TL, "--since", "inf"), 2, "--since: 'inf' is not a time between"),
    cmd("since-1e308", NOTHING, (*TL_HTML, "--since", "1e308"), 2, "--since: '1e308' is not a time between"),
    cmd("since-1e999", NOTHING, (*TL, "--since", "1e999"), 2, "--since: '1e999' is not a time between"),
    cmd("since-nan", NOTHING, (*TL, "--since", "nan"), 2, "--since: 'nan' is not a time between"),
    cmd("since-huge-duration", NOTHING, (*TL, "--since", "99999999999999999999h"), 2, "is not a time between"),
    cmd("since-year-one", NOTHING, (*TL, "--since", "0001-01-01T00:00:00Z"), 2, "is not a time between"),
    cmd("metrics-port-superscript", NOTHING, ("run", "--once", "--host-root", "{root}", "--metrics-address", "127.0.0.1:9²"), 2, "metrics address '127.0.0.1:9²'"),
]  # fmt: skip


def test_the_corpus_is_large_and_ids_are_unique() -> None:
    assert len(CASES) >= 80
    assert len({c.id for c in CASES}) == len(CASES)


def _with_root(argv: tuple[str, ...], root: Path) -> list[str]:
    out = [a.replace("{root}", str(root)) for a in argv]
    if out[0] in ("check", "status", "wait", "timeline"):
        out[1:1] = ["--host-root", str(root)]
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(
    case: Case,
    template: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root = tmp_path / "root"
    shutil.copytree(template, root, symlinks=True)
    # The boot-time clock a lease is judged on stands still at the moment the case is set
    # up: a lease with 2.5 s left is fresh however long a busy machine takes to get from
    # the setup to the read (the running clock and leases running out: test_gate_lease.py).
    now = gatefile.lease_clock()
    monkeypatch.setattr(gatefile, "lease_clock", lambda: now)
    monkeypatch.setattr(
        gatefile, "GateFiles", functools.partial(gatefile.GateFiles, clock=lambda: now)
    )
    case.setup(root)
    result: list[object] = []
    worker = threading.Thread(target=lambda: result.append(_run(_with_root(case.argv, root))))
    worker.start()
    worker.join(RETURN_WITHIN)
    assert not worker.is_alive(), f"{case.id}: did not return within {RETURN_WITHIN}s"
    out, err = capsys.readouterr()
    assert result and not isinstance(result[0], BaseException), f"raised: {result!r}\n{err}"
    assert "Traceback" not in out + err
    assert result[0] == case.rc, f"exit {result[0]}, expected {case.rc}\n{out}\n{err}"
    text = out + err
    if case.verdict is not None:
        doc = json.loads(out)
        assert doc["guards"]["peermem"]["verdict"] == case.verdict, doc["guards"]["peermem"]
        text = json.dumps(doc, ensure_ascii=False) + err
    for word in case.words:
        assert word in text, f"{word!r} not in output:\n{out}\n{err}"
    if case.rc == 2 and case.argv[0] != "simulate":  # simulate keeps its usage line
        assert err.count("\n") == 1, f"not one line: {err!r}"
    if case.argv[0] in ("check", "status", "wait"):  # readers leave no trace on the node
        assert not (root / "var/lib/nodeagent").exists()
        assert not (root / "run/nodeagent/agent.lock").exists()


def _run(argv: list[str]) -> object:
    try:
        return main(argv)
    except BaseException as exc:
        return exc
