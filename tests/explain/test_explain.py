"""``nodeagent explain`` on the shared real log excerpts and the seeds, as a user runs it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nodeagent.explain.incidents import INCIDENTS
from nodeagent.explain.matcher import explain_lines
from nodeagent.explain.signatures import SIGNATURES
from nodeagent.explain.stamps import normalize

SHARED = Path(__file__).resolve().parents[3] / "shared"
LOGS = SHARED / "real-logs"
SEEDS = SHARED / "seeds"


def explain(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nodeagent", "explain", *args],
        input=stdin.decode() if stdin is not None else None,
        capture_output=True,
        text=True,
        timeout=60,
    )


def kinds(*files: Path) -> list[str]:
    p = explain("--json", *map(str, files))
    assert p.returncode == 0, p.stderr
    return [i["kind"] for i in json.loads(p.stdout)["incidents"]]


needs_shared = pytest.mark.skipif(
    not LOGS.is_dir(), reason=f"{LOGS} is not here (the shared folder beside the checkout)"
)


@needs_shared
@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (["gpu-operator-2868-peermem-abi.log"], ["peermem-abi-mismatch"]),
        (["network-operator-1084-storage-modules.log"], ["storage-blocks-mofed"]),
        (["seed-004-mofed-storage.log"], ["storage-blocks-mofed"]),
        (["seed-001-driver-ctr.log"], ["peermem-load-race"]),
        (["seed-001-mofed.log", "seed-001-driver-ctr.log"], ["peermem-load-race"]),
        (["nv-peer-memory-120-harmless-callback.log"], []),
        (["seed-001-mofed.log"], []),
    ],
)
def test_the_shared_real_logs(files: list[str], expected: list[str]) -> None:
    assert kinds(*(LOGS / f for f in files)) == expected


@needs_shared
@pytest.mark.parametrize(
    ("seed", "expected"),
    [
        ("001_b2ec0e1b56bea0c4.txt", ["peermem-load-race"]),
        ("003_73941f46bb2b21c1.txt", ["vf-restore-before-netdev"]),
        ("004_2150439ff42f7296.txt", ["storage-blocks-mofed"]),
    ],
)
def test_the_seeds_own_log_lines(seed: str, expected: list[str]) -> None:
    assert kinds(SEEDS / seed) == expected


@needs_shared
def test_the_text_names_the_evidence_lines_the_remedy_and_the_modes() -> None:
    p = explain(str(LOGS / "gpu-operator-2868-peermem-abi.log"))
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert out.startswith("1 recognised in 8 lines of 1 input(s)")
    assert "peermem-abi-mismatch: the GPUDirect module was built against another MOFED" in out
    # file:line of each CRC line, with its text (the dmesg -T prefix taken off)
    assert (
        "gpu-operator-2868-peermem-abi.log:5: nvidia_peermem: disagrees about version of "
        "symbol ib_register_peer_memory_client"
    ) in out
    assert "remedy: recreate the GPU driver pod" in out
    assert "not prevented in: operator-peermem" in out


def test_an_invalid_argument_alone_is_its_own_kind_naming_both_causes() -> None:
    line = "modprobe: ERROR: could not insert 'nvidia_peermem': Invalid argument\n"
    p = explain("--json", stdin=line.encode())
    doc = json.loads(p.stdout)
    assert p.returncode == 0
    (inc,) = doc["incidents"]
    assert inc["kind"] == "peermem-einval-unexplained"
    remedy = inc["remedy"]
    assert "peermem-load-race" in remedy and "peermem-abi-mismatch" in remedy
    # what tells them apart, and each cause's remedy
    assert "dmesg | grep -i peermem" in remedy and "disagrees about version of symbol" in remedy
    assert ".driver-ready" in remedy and "rebuilt against the MOFED loaded" in remedy


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("2025-11-21T11:51:41.123456789Z modprobe: x", "modprobe: x"),  # kubectl --timestamps
        ("[25033.266922] nvidia-peermem x", "nvidia-peermem x"),  # dmesg
        ("[Tue Sep  8 17:16:02 2026] nvidia_peermem: y", "nvidia_peermem: y"),  # dmesg -T
        ("Nov 21 11:51:41 gpu-1 kernel: nvidia_peermem: z", "nvidia_peermem: z"),  # journalctl
        ("\x1b[31mmodprobe: ERROR\x1b[0m\r\n", "modprobe: ERROR"),  # colour, CRLF
    ],
)
def test_prefixes_colours_and_crlf_are_taken_off(raw: str, clean: str) -> None:
    assert normalize(raw) == clean


def test_every_signature_has_a_source_and_every_incident_a_remedy() -> None:
    assert all(s.source for s in SIGNATURES)
    for inc in INCIDENTS:
        assert inc.title and inc.remedy, inc.kind
    assert len({i.kind for i in INCIDENTS}) == len(INCIDENTS)


def test_the_same_evidence_in_other_log_forms() -> None:
    """journalctl, dmesg -T, kubectl --timestamps and CRLF forms of the 2868 lines."""
    lines = [
        "2026-09-08T17:16:01Z modprobe: ERROR: could not insert 'nvidia_peermem': Invalid "
        "argument\r",
        "Sep 08 17:16:02 gb300-7 kernel: nvidia_peermem: disagrees about version of symbol "
        "ib_register_peer_memory_client",
    ]
    doc: dict[str, Any] = explain_lines([("journal", lines)])
    assert [i["kind"] for i in doc["incidents"]] == ["peermem-abi-mismatch"]


def test_unreadable_inputs_are_named_and_the_rest_read(tmp_path: Path) -> None:
    good = tmp_path / "mofed.log"
    good.write_text("Storage modules are loaded for current driver, terminating\n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    empty = tmp_path / "empty-dir"  # a directory is a bundle now (test_explain_bundles.py)
    empty.mkdir()
    p = explain("--json", str(empty), str(fifo), str(tmp_path / "missing"), str(good))
    assert p.returncode == 0
    assert [i["kind"] for i in json.loads(p.stdout)["incidents"]] == ["storage-blocks-mofed"]
    errors = p.stderr.strip().splitlines()
    assert len(errors) == 3 and all(e.startswith("nodeagent explain: ") for e in errors)
    assert "empty-dir: no log files in it" in errors[0] and "not a regular file" in errors[1]
    nothing = explain(str(tmp_path / "missing"))
    assert nothing.returncode == 2 and "No such file" in nothing.stderr


def test_binary_invalid_utf8_and_a_10_mb_line(tmp_path: Path) -> None:
    f = tmp_path / "odd.log"
    with f.open("wb") as fh:
        fh.write(b"\x00\xff\xfe binary \x80\x81\n")
        fh.write(b"x" * 10_000_000 + b"\n")
        fh.write(b"modprobe: FATAL: Module nvidia-peermem not found in directory /lib\n")
    p = explain("--json", str(f))
    doc = json.loads(p.stdout)
    assert p.returncode == 0 and [i["kind"] for i in doc["incidents"]] == ["peermem-not-built"]
    assert doc["incidents"][0]["evidence"][0]["line"] == 3
    assert doc["lines"] == 3


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        ("rmmod: ERROR: Module ib_uverbs is in use by: nvidia_peermem", "openibd-module-in-use"),
        (
            "[  812.3] nvidia_peermem: Unknown symbol ib_register_peer_memory_client (err -2)",
            "peermem-no-peer-api",
        ),
        (
            "modprobe: FATAL: Module nvidia-peermem not found in directory /lib/modules/x",
            "peermem-not-built",
        ),
        ('Cannot find device "eth0"', "vf-restore-before-netdev"),
    ],
)
def test_each_class_from_one_line(line: str, kind: str) -> None:
    doc = explain_lines([("log", [line])])
    assert [i["kind"] for i in doc["incidents"]] == [kind]
    (ev,) = doc["incidents"][0]["evidence"]
    assert (ev["file"], ev["line"]) == ("log", 1)


def test_unrelated_failures_are_nothing_recognised_and_listed() -> None:
    lines = [
        "Error: failed to pull image nginx:latest: i/o timeout",
        "nvidia-container-runtime: ERROR: GPU 0 fell off the bus",
    ]
    doc = explain_lines([("log", lines)])
    assert doc["incidents"] == [] and "ambiguous" not in doc
    assert [e["line"] for e in doc["seen"]["errors"]] == [1, 2]


def format_sources() -> set[str]:
    """The project each signature's words were read from (its source, split at "; "),
    leaving out the seeds and public reports (an issue or PR: where it was seen, not the
    format's source)."""
    out = set()
    for sig in SIGNATURES:
        for part in sig.source.split("; "):
            if part.startswith("seed") or re.search(r" (?:issue|PR) \d+", part):
                continue
            out.add(part.split()[0])
    return out


def test_docs_explain_sources_has_every_signature_s_source() -> None:
    """docs/explain-sources.md, checked against the table: each project a signature's
    words come from has its place on that page."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "explain-sources.md").read_text()
    sources = format_sources()
    assert {"torvalds/linux", "kmod-project/kmod", "MLNX_OFED", "gcc's"} <= sources
    missing = sorted(s for s in sources if s not in doc)
    assert not missing, f"docs/explain-sources.md names no {missing}"


@needs_shared
def test_every_seed_a_signature_cites_is_in_the_shared_seeds() -> None:
    seeds = {f.name[:3] for f in (LOGS.parent / "seeds").glob("*.txt")}
    cited = set()
    for sig in SIGNATURES:
        for part in sig.source.split("; "):
            if part.startswith("seed"):
                first, _, last = part.split()[1].partition("-")
                cited |= {f"{n:03d}" for n in range(int(first), int(last or first) + 1)}
    assert cited and cited <= seeds, cited - seeds
