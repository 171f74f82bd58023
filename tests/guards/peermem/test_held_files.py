"""What crosses the process boundary so the gate judges the held file (issue 65): the
facts read from a descriptor (heldfiles.py), their strict parse, and the verdicts in
the lease (lease.py): whole, current, with the gate they were written with, or none."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nodeagent.guards.peermem.heldfiles import (
    GO,
    REBUILD,
    WAIT,
    held_module,
    held_modules,
    read_held_fd,
)
from nodeagent.guards.peermem.lease import (
    LEASE,
    TABLE_AT,
    HeldVerdicts,
    HoldLease,
    boottime,
    read_lease,
    read_verdicts,
)
from nodeagent.sim.kofile import write_module_file

SYM = "ib_register_peer_memory_client"


@pytest.mark.parametrize("compression", [None, "xz", "zst", "gz"])
def test_the_facts_are_read_from_the_descriptor_without_moving_its_offset(
    tmp_path: Path, compression: str | None
) -> None:
    suffix = f".ko.{compression}" if compression else ".ko"
    ko = tmp_path / f"nvidia-peermem{suffix}"
    write_module_file(
        ko,
        compression,  # type: ignore[arg-type]
        name="nvidia-peermem",
        vermagic="6.1.0-test SMP mod_unload",
        depends=("ib_core", "nvidia"),
        required_crcs={SYM: 0x1234ABCD},
    )
    fd = os.open(ko, os.O_RDONLY)
    try:
        os.lseek(fd, 7, os.SEEK_SET)  # the opener's offset, as modprobe left it
        facts = read_held_fd(fd, "/lib/modules/x/nvidia-peermem.ko")
        assert os.lseek(fd, 0, os.SEEK_CUR) == 7
    finally:
        os.close(fd)
    st = ko.stat()
    assert facts["file"] == [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
    assert facts["crcs"] == {SYM: 0x1234ABCD} and facts["depends"] == ["ib_core", "nvidia"]
    module = held_module(facts)
    assert module is not None and module.vermagic == "6.1.0-test SMP mod_unload"
    assert module.module.name == "nvidia_peermem" and module.module.problem is None


def test_a_file_that_is_not_a_module_is_named_never_trusted(tmp_path: Path) -> None:
    ko = tmp_path / "nvidia-peermem.ko"
    ko.write_bytes(b"not an ELF file\n")
    fd = os.open(ko, os.O_RDONLY)
    try:
        facts = read_held_fd(fd, "/x/nvidia-peermem.ko")
    finally:
        os.close(fd)
    module = held_module(facts)
    assert module is not None and module.module.problem is not None
    assert "not an ELF" in module.module.problem or "bad magic" in module.module.problem


OK = {"path": "p", "file": [1, 2, 3, 4], "name": "nvidia_peermem", "depends": [], "crcs": {}}


def test_a_whole_description_is_judged() -> None:
    modules, problems = held_modules([OK])
    assert problems == [] and [m.file for m in modules] == [(1, 2, 3, 4)]


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ("x", "not an object"),
        ({"path": "p", "file": [1, 2, 3]}, "file is not"),
        ({"path": "p", "file": [1, 2, 3, -4]}, "file is not"),
        ({**OK, "depends": "ib_core"}, "depends"),
        ({**OK, "depends": ["a/b"]}, "depends"),
        ({**OK, "crcs": {"s": 1 << 33}}, "32-bit"),
        ({**OK, "name": None}, "name is not a string"),
        ({"path": 5, "file": [1, 2, 3, 4]}, "path is not a string"),
    ],
)
def test_a_malformed_description_is_one_problem_and_nothing_judged(
    entry: object, words: str
) -> None:
    modules, problems = held_modules([entry])
    assert modules == () and len(problems) == 1 and words in problems[0]


def _table_bytes(fd: int) -> bytes:
    return os.pread(fd, 4096, 0)


def test_the_verdicts_read_back_whole_with_their_gate() -> None:
    lease = HoldLease()
    try:
        assert read_verdicts(lease.fd) == HeldVerdicts()  # a new lease: closed, none judged
        verdicts = {(1, 2, 3, 4): GO, (5, 6, 7, 8): REBUILD, (9, 9, 9, 9): WAIT}
        lease.write(False, verdicts=verdicts)
        assert read_lease(lease.fd) is False and read_verdicts(lease.fd) == HeldVerdicts(verdicts)
        lease.write(True, verdicts={(1, 2, 3, 4): GO}, judge_all=True)
        got = read_verdicts(lease.fd)
        assert read_lease(lease.fd) is True and got == HeldVerdicts({(1, 2, 3, 4): GO}, True)
    finally:
        lease.close()


def test_a_torn_stale_or_foreign_table_is_no_verdict_at_all() -> None:
    lease = HoldLease()
    try:
        lease.write(True, verdicts={(1, 2, 3, 4): GO})
        good = _table_bytes(lease.fd)
        # Torn: an entry's byte changed under the digest.
        torn = bytearray(good)
        torn[TABLE_AT + 20] ^= 0xFF
        os.pwrite(lease.fd, bytes(torn), 0)
        assert read_verdicts(lease.fd) is None
        # An older agent rewrote the gate alone: the table is not its gate's any more.
        os.pwrite(lease.fd, good, 0)
        os.pwrite(lease.fd, LEASE.pack(0, 0.0, 0), 0)
        assert read_verdicts(lease.fd) is None
        # Stale: written long ago (a stalled loop renews nothing).
        os.pwrite(lease.fd, good, 0)
        assert read_verdicts(lease.fd, now=boottime() + 60) is None
        assert read_verdicts(lease.fd) == HeldVerdicts({(1, 2, 3, 4): GO})
    finally:
        lease.close()
