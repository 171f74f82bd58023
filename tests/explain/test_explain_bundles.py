"""``nodeagent explain DIR|BUNDLE.tar[.gz]``: the operators' support bundles, built here in
the layouts their scripts write (explain/nodes.py cites each), read as a user runs it."""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from nodeagent.explain.nodes import NodeMap, is_log
from tests.explain.bundles import (
    DRIVER_POD_1,
    DRIVER_POD_2,
    EINVAL,
    by_node,
    gpu_must_gather,
    many_nodes,
    tar,
    write,
)


def explain(*args: str) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    p = subprocess.run(
        [sys.executable, "-m", "nodeagent", "explain", "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout), p


def test_a_gpu_operator_must_gather_directory_per_node(tmp_path: Path) -> None:
    root = write(tmp_path / "nvidia-gpu-operator_20261121_1210", gpu_must_gather())
    doc, _ = explain(str(root))
    assert by_node(doc) == {"gpu-1": ["peermem-load-race"], "gpu-2": ["peermem-abi-mismatch"]}
    (b,) = doc["bundles"]
    assert b["kind"] == "GPU Operator must-gather" and b["nodes"] == ["gpu-1", "gpu-2"]
    race = doc["incidents"][0]
    files = {e["file"] for e in race["evidence"]}
    assert files == {str(root / f"gpu_operand_pod_{DRIVER_POD_1}.log")}
    # the kubectl --prefix and --timestamps are off the text shown
    assert EINVAL in [e["text"] for e in race["evidence"]]
    abi = doc["incidents"][1]
    assert {Path(e["file"]).name for e in abi["evidence"]} == {
        f"gpu_operand_pod_{DRIVER_POD_2}.log",
        "nvidia-bug-report_gpu-2.log.gz",
    }


def test_the_text_names_the_bundle_and_groups_by_node(tmp_path: Path) -> None:
    root = write(tmp_path / "mg", gpu_must_gather())
    p = subprocess.run(
        [sys.executable, "-m", "nodeagent", "explain", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = p.stdout
    assert p.returncode == 0, p.stderr
    assert f"bundle {root} (GPU Operator must-gather): " in out
    assert out.index("== node gpu-1") < out.index("peermem-load-race") < out.index("== node gpu-2")


def test_the_same_must_gather_under_oc_adm_must_gather_as_a_tar_gz(tmp_path: Path) -> None:
    """oc adm must-gather: must-gather.local.<n>/<image-dir>/ holds the same flat files."""
    image_dir = "must-gather.local.5308/nvcr-io-nvidia-gpu-operator-sha256-0a1b"
    root = tmp_path / "must-gather.local.5308"
    write(tmp_path, {f"{image_dir}/{k}": v for k, v in gpu_must_gather().items()})
    bundle = tar(root, tmp_path / "must-gather.tar.gz")
    doc, _ = explain(str(bundle))
    assert by_node(doc) == {"gpu-1": ["peermem-load-race"], "gpu-2": ["peermem-abi-mismatch"]}
    file = doc["incidents"][0]["evidence"][0]["file"]
    assert file.startswith(f"{bundle}:must-gather.local.5308/nvcr-io-nvidia-gpu-operator")


MOFED_POD = "mofed-ubuntu22.04-6d4f8b9c7-ds-x7k2p"


def netop_sosreport() -> dict[str, bytes | str]:
    """kubectl netop-sosreport (v26.1+): pods/<pod>-<container>.log beside <pod>.yaml,
    ofed-driver/diagnostics/<node>-<what>.txt."""
    pods = "operator/components/ofed-driver/pods"
    diag = "operator/components/ofed-driver/diagnostics"
    return {
        "metadata/collection-info.txt": "NVIDIA Network Operator SOS-Report\n",
        f"{pods}/{MOFED_POD}.yaml": f"kind: Pod\nmetadata:\n  name: {MOFED_POD}\n"
        "spec:\n  nodeName: gpu-3\n",
        f"{pods}/{MOFED_POD}-mofed-container.log": (
            "[26-Sep-26_05:02:12] NVIDIA driver container exec start\n"
            "[26-Sep-26_05:02:12] Storage modules are loaded for current driver, terminating "
            'prior driver reload failure due to UNLOAD_STORAGE_MODULES not set to "true"\n'
        ),
        f"{pods}/{MOFED_POD}-mofed-container-previous.log": "",
        f"{diag}/gpu-3-dmesg.txt": (
            "[  812.345678] rpcrdma: disagrees about version of symbol ib_dealloc_pd_user\n"
            "[  812.345690] rpcrdma: Unknown symbol ib_dealloc_pd_user (err -22)\n"
        ),
        f"{diag}/gpu-3-lsmod.txt": "mlx5_core 2031616 1 mlx5_ib\n",
        "crds/instances/nicclusterpolicies/all.yaml": "spec: {}\n",
    }


def test_a_network_operator_sosreport_tar_gz(tmp_path: Path) -> None:
    root = write(tmp_path / "network-operator-sosreport-20260926-050500", netop_sosreport())
    bundle = tar(root, tmp_path / "network-operator-sosreport-20260926-050500.tar.gz")
    doc, _ = explain(str(bundle))
    assert by_node(doc) == {"gpu-3": ["storage-blocks-mofed", "storage-module-other-stack"]}
    assert doc["bundles"][0]["kind"] == "Network Operator sosreport"
    files = [e["file"] for inc in doc["incidents"] for e in inc["evidence"]]
    assert any(f.endswith(f"pods/{MOFED_POD}-mofed-container.log") for f in files)
    assert any(f.endswith("diagnostics/gpu-3-dmesg.txt") for f in files)


def test_oc_adm_inspect_and_a_nodes_sos_report(tmp_path: Path) -> None:
    ns = "namespaces/nvidia-gpu-operator/pods"
    inspect = write(
        tmp_path / "inspect.local.42",
        {
            f"{ns}/{DRIVER_POD_1}/{DRIVER_POD_1}.yaml": "spec:\n  nodeName: gpu-7\n",
            f"{ns}/{DRIVER_POD_1}/nvidia-driver-ctr/nvidia-driver-ctr/logs/current.log": (
                f"2026-11-21T11:52:10.2Z {EINVAL}\n"
            ),
            f"{ns}/{DRIVER_POD_1}/nvidia-driver-ctr/nvidia-driver-ctr/logs/previous.log": "",
        },
    )
    sos = write(
        tmp_path / "sosreport-gpu-8-2026-11-21-abcdefg",
        {
            "hostname": "gpu-8\n",
            "sos_commands/kernel/dmesg": (
                "[   52.1] nv_peer_mem: Unknown symbol ib_register_peer_memory_client (err 0)\n"
            ),
            "sos_commands/logs/journalctl_--no-pager": (
                "Nov 21 11:00:01 gpu-8 systemd[1]: Failed to start LSB: Activates/Deactivates "
                "nv_peer_mem to start at boot time.\n"
            ),
        },
    )
    doc, _ = explain(str(inspect), str(tar(sos, tmp_path / "sos.tar.xz", "w:xz")))
    assert by_node(doc) == {
        "gpu-7": ["peermem-einval-unexplained"],
        "gpu-8": ["peermem-no-peer-api"],
    }
    assert [b["kind"] for b in doc["bundles"]] == ["oc adm inspect", "sos report"]


def test_no_rule_correlates_two_nodes(tmp_path: Path) -> None:
    """MOFED restarting on gpu-1 says nothing of a failed load on gpu-2 at that minute."""
    files = gpu_must_gather()
    del files["nvidia-bug-report_gpu-2.log.gz"]
    files[f"gpu_operand_pod_{DRIVER_POD_2}.log"] = (
        f"[pod/{DRIVER_POD_2}/nvidia-driver-ctr] 2026-11-21T11:52:11Z {EINVAL}\n"
    )
    doc, _ = explain(str(write(tmp_path / "mg", files)))
    assert by_node(doc) == {
        "gpu-1": ["peermem-load-race"],
        "gpu-2": ["peermem-einval-unexplained"],
    }


def test_nothing_inside_a_bundle_is_followed_and_names_are_only_labels(tmp_path: Path) -> None:
    secret = tmp_path / "outside.log"
    secret.write_text("Storage modules are loaded for current driver\n")
    root = write(tmp_path / "b", {"ok.log": "nothing here\n"})
    (root / "link.log").symlink_to(secret)
    os.mkfifo(root / "fifo.log")  # would block a reader
    doc, _ = explain(str(root))
    assert doc["incidents"] == [] and doc["bundles"][0]["logs"] == 1
    # a member named to climb out is read as a stream, never written anywhere
    evil = tmp_path / "evil.tar"
    with tarfile.open(evil, "w") as t:
        body = b"Storage modules are loaded for current driver\n"
        info = tarfile.TarInfo("../../etc/mofed.log")
        info.size = len(body)
        t.addfile(info, io.BytesIO(body))
    doc, _ = explain(str(evil))
    assert doc["incidents"][0]["evidence"][0]["file"] == f"{evil}:../../etc/mofed.log"
    assert not (tmp_path.parent / "etc" / "mofed.log").exists()


def test_a_corrupt_archive_is_one_line_and_the_rest_is_read(tmp_path: Path) -> None:
    bad = tmp_path / "bundle.tar.gz"
    bad.write_bytes(gzip.compress(b"not a tar at all" * 100)[:-20])
    good = tmp_path / "mofed.log"
    good.write_text("Storage modules are loaded for current driver\n")
    doc, p = explain(str(bad), str(good))
    assert [i["kind"] for i in doc["incidents"]] == ["storage-blocks-mofed"]
    (line,) = p.stderr.splitlines()
    assert line.startswith(f"nodeagent explain: {bad}: ") and line.endswith("; not read")
    # alone, nothing could be read: exit 2, as for a missing file
    alone = subprocess.run(
        [sys.executable, "-m", "nodeagent", "explain", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert alone.returncode == 2 and "Traceback" not in alone.stderr, alone.stderr
    fifo = tmp_path / "x.tar"
    os.mkfifo(fifo)
    doc, p = explain(str(fifo), str(good))  # a FIFO named like a tar: refused, not waited on
    assert p.stderr.strip() == f"nodeagent explain: {fifo}: is not a regular file; not read"


@pytest.mark.parametrize(
    ("path", "log"),
    [
        ("gpu_operand_pod_x.log", True),
        ("gpu_operand_pods.yaml", False),
        ("nvidia-bug-report_gpu-1.log.gz", True),
        ("crds/instances/a/all.yaml", False),
        ("report.html", False),
        ("sos_commands/kernel/dmesg", True),
        ("x.tar.gz.sha256", False),
    ],
)
def test_which_files_are_logs(path: str, log: bool) -> None:
    assert is_log(path) is log


def test_a_netop_pod_log_s_pod_is_the_longest_name_with_its_yaml() -> None:
    nm = NodeMap()
    nm.learn("pods/mofed-a-ds-x.yaml", "spec:\n  nodeName: n1\n")
    nm.learn("pods/mofed-a.yaml", "spec:\n  nodeName: wrong\n")
    assert nm.node_of("pods/mofed-a-ds-x-mofed-container-previous.log") == "n1"
    assert nm.node_of("pods/other-pod-c.log") == ""


def test_the_corpus_runner_scores_excerpts_by_their_expect_line(tmp_path: Path) -> None:
    """scripts/explain_corpus.py: the way a held-out corpus of real excerpts is run."""
    corpus = write(
        tmp_path,
        {
            "a.log": "# source: here\n# expect: peermem-not-built\n"
            "modinfo: ERROR: Module nvidia-peermem not found.\n",
            "b.log": "# source: there\n# expect: none\nNVRM: Xid (PCI:0000:3b:00): 79\n",
            "c.log": "# source: x\n# expect: old-name\n# note: n\n"
            "rmmod: ERROR: Module ib_core is in use by: nvidia_peermem\n",
            "d.log": "# source: y\n# expect: storage-blocks-mofed\nnothing\n",
        },
    )
    script = Path(__file__).resolve().parents[2] / "scripts" / "explain_corpus.py"
    run = [sys.executable, str(script), str(corpus), "--alias", "old-name=openibd-module-in-use"]
    p = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr  # d.log is missed
    assert "XX d.log: expect storage-blocks-mofed, got nothing" in p.stdout
    assert p.stdout.strip().endswith("3 of 4 named right (1 wrong; unclear ones not scored)")


def _remove_deep(top: Path) -> None:
    """A chain of single directories removed bottom up, one level at a time."""
    fds = [os.open(top, os.O_DIRECTORY)]
    while True:
        try:
            fds.append(os.open("d", os.O_DIRECTORY, dir_fd=fds[-1]))
        except FileNotFoundError:
            break
    for name in os.listdir(fds[-1]):
        os.unlink(name, dir_fd=fds[-1])
    for parent in reversed(fds[:-1]):
        os.close(fds.pop())
        os.rmdir("d", dir_fd=parent)
    os.close(fds.pop())
    top.rmdir()


def test_a_bundle_1500_levels_deep_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    """Issue 56: os.walk recursed into a planted tree until RecursionError (exit 1). Now
    64 levels are read, one line names where it stopped, the rest of the bundle is read."""
    top = tmp_path / "must-gather"
    top.mkdir()
    (top / "mofed.log").write_text("Storage modules are loaded for current driver\n")
    # Past PATH_MAX: built one level at a time from a descriptor.
    fd = os.open(top, os.O_DIRECTORY)
    for _ in range(1500):
        os.mkdir("d", dir_fd=fd)
        down = os.open("d", os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = down
    log = os.open("deep.log", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
    os.write(log, b"Storage modules are loaded for current driver\n")
    os.close(log)
    os.close(fd)
    try:
        doc, p = explain(str(top))
    finally:
        _remove_deep(top / "d")  # shutil.rmtree recurses too: pytest's cleanup would crash
    assert [i["kind"] for i in doc["incidents"]] == ["storage-blocks-mofed"]
    assert "Traceback" not in p.stderr
    (line,) = p.stderr.splitlines()
    assert line.startswith("nodeagent explain: ") and "more than 64 levels deep" in line


def test_a_bundle_s_logs_share_one_decompressed_budget(tmp_path: Path) -> None:
    """Issue 56: each file was cut at 8 GiB, but many small compressed files together had
    no bound. With a 1 MiB budget, three logs of 600 KiB each: the first read whole, the
    second up to the budget, the third not at all; one line says so."""
    from nodeagent.explain.walk import walk

    top = tmp_path / "bundle"
    top.mkdir()
    line = b"2026-11-28T10:00:00Z nothing to see here, a line of ordinary log text\n"
    for i in range(3):
        (top / f"n{i}.log.gz").write_bytes(gzip.compress(line * (600 * 1024 // len(line))))
    fed: dict[str, int] = {}

    def feed(label: str, fh: Any, node: str) -> None:
        fed[label] = len(fh.read())

    problems: list[str] = []
    out = walk(str(top), feed, problems, budget=1 << 20)
    assert out["logs"] == 2 and sum(fed.values()) == 1 << 20
    (said,) = problems
    assert said.startswith(f"{top}: 1 MiB decompressed read in 2 logs") and "rest not read" in said


STORAGE_LINE = "Storage modules are loaded for current driver\n"
PLAIN = b"2026-11-28T10:00:00Z kubelet: a line of ordinary log text, nothing in it\n"


def gzip_bomb(streams: int) -> bytes:
    """``streams`` gzip streams one after another (as nvidia-bug-report appends them), each
    8 MiB of log lines in ~30 KB: read through gzip, 8 MiB times ``streams``."""
    return gzip.compress(PLAIN * ((8 << 20) // len(PLAIN)), 9) * streams


def test_a_small_bundle_of_nested_compressed_logs_reads_its_budget_and_stops(
    tmp_path: Path,
) -> None:
    """Issue 56: a ~100 KB bundle of .gz logs in a .tar.gz, each 800 MiB decompressed, read
    for minutes (only 32 GiB bounded it). The bundle gives at most 200 times its size on
    disk (at least 256 MiB): one line says what was read, and the report so far is there."""
    top = tmp_path / "must-gather"
    files: dict[str, bytes | str] = {"mofed.log": STORAGE_LINE}
    for i in range(4):
        files[f"n{i}/kubelet.log.gz"] = gzip_bomb(100)
    bundle = tar(write(top, files), tmp_path / "must-gather.tar.gz")
    assert bundle.stat().st_size < 400_000  # 3.2 GiB of logs inside
    doc, p = explain(str(bundle))  # its timeout (120 s) is the hang detector
    assert [i["kind"] for i in doc["incidents"]] == ["storage-blocks-mofed"]
    (said,) = p.stderr.splitlines()
    assert said.startswith(f"nodeagent explain: {bundle}: 256 MiB decompressed read in 2 logs")
    assert said.endswith("the rest not read (--max-read to read more)")
    assert doc["bundles"][0]["logs"] == 2


def test_max_read_sets_the_budget_and_a_bad_value_is_one_line(tmp_path: Path) -> None:
    top = tmp_path / "bundle"
    bundle = tar(write(top, {"a.log.gz": gzip_bomb(2), "b.log": STORAGE_LINE}), tmp_path / "b.tgz")
    doc, p = explain("--max-read", "1M", str(bundle))
    assert doc["incidents"] == []  # b.log comes after the 1 MiB a.log.gz gives
    assert "1 MiB decompressed read in 1 logs" in p.stderr
    doc, p = explain("--max-read", "1G", str(bundle))
    assert [i["kind"] for i in doc["incidents"]] == ["storage-blocks-mofed"] and not p.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "nodeagent", "explain", "--max-read", "lots", str(bundle)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "'lots' is not a size" in bad.stderr
    assert "Traceback" not in bad.stderr


class Zeros(io.RawIOBase):
    """``n`` zero bytes, read in pieces (never all held)."""

    def __init__(self, n: int) -> None:
        self.left = n

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        n = min(len(buf), self.left)
        buf[:n] = bytes(n)
        self.left -= n
        return n


def test_a_tar_whose_members_give_more_than_the_budget_stops_reading_the_stream(
    tmp_path: Path,
) -> None:
    """A tar is read as a stream, so a member is read through to reach the next one: a
    300 MiB member of zeros in a ~300 KB .tar.gz (JSON, not a log: never fed) is where the tar
    stops, said in one line; the log before it was read."""
    bundle = tmp_path / "bundle.tar.gz"
    with tarfile.open(bundle, "w:gz", compresslevel=9) as t:
        first = tarfile.TarInfo("bundle/mofed.log")
        first.size = len(STORAGE_LINE)
        t.addfile(first, io.BytesIO(STORAGE_LINE.encode()))
        big = tarfile.TarInfo("bundle/nodes.json")
        big.size = 300 << 20
        t.addfile(big, Zeros(big.size))
        last = tarfile.TarInfo("bundle/after.log")
        last.size = len(EINVAL) + 1
        t.addfile(last, io.BytesIO(EINVAL.encode() + b"\n"))
    assert bundle.stat().st_size < 2_000_000
    doc, p = explain(str(bundle))
    assert [i["kind"] for i in doc["incidents"]] == ["storage-blocks-mofed"]
    said, *more = p.stderr.splitlines()
    assert not more, p.stderr
    assert "its members give more than 256 MiB decompressed" in said
    assert "read up to bundle/nodes.json, the rest not read" in said


def test_a_gz_log_reads_its_budget_and_says_so(tmp_path: Path) -> None:
    """A .gz log given by name: 200 times its size on disk at least 256 MiB, as a bundle."""
    log = tmp_path / "kubelet.log.gz"
    log.write_bytes(gzip.compress(STORAGE_LINE.encode()) + gzip_bomb(40))
    doc, p = explain(str(log))
    assert [i["kind"] for i in doc["incidents"]] == ["storage-blocks-mofed"]
    (said,) = p.stderr.splitlines()
    assert said == (
        f"nodeagent explain: {log}: 256 MiB decompressed read, its budget; the rest not "
        "read (--max-read to read more)"
    )


def test_the_read_budget_is_200_times_the_size_on_disk_between_256_mib_and_32_gib(
    tmp_path: Path,
) -> None:
    from nodeagent.explain.walk import BUNDLE_MAX, READ_FLOOR, read_budget, walk

    assert read_budget(0) == READ_FLOOR == 256 << 20
    assert read_budget(10 << 20) == 2000 << 20
    assert read_budget(1 << 40) == BUNDLE_MAX == 32 << 30
    # a directory's size on disk is its files' together: ~1.6 MB of gzip streams giving
    # 440 MiB, a budget of ~300 MiB (the ratio's, above the floor)
    top = tmp_path / "dir"
    top.mkdir()
    (top / "mofed.log").write_text(STORAGE_LINE)
    (top / "n2.log.gz").write_bytes(gzip_bomb(55))
    problems: list[str] = []
    walk(str(top), lambda label, fh, node: fh.read(), problems)
    (said,) = problems
    budget = read_budget(sum(f.stat().st_size for f in top.iterdir()))
    assert 256 << 20 < budget < 440 << 20
    assert said.startswith(f"{top}: {budget / (1 << 20):.3g} MiB decompressed read in 2 logs")


def peak_rss_mib(*args: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    """``nodeagent explain --json ARGS`` run by a fresh Python whose only child it is: the
    child's own peak RSS (RUSAGE_CHILDREN of that parent), and what it printed."""
    runner = (
        "import resource, subprocess, sys\n"
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "sys.stderr.write(p.stderr)\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
        "print(p.stdout)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", runner, sys.executable, "-m", "nodeagent", "explain", "--json",
         *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    peak, out = p.stdout.split("\n", 1)
    return int(peak) / 1024, subprocess.CompletedProcess(p.args, 0, out, p.stderr)


def test_a_bundle_of_400_nodes_holds_what_its_report_shows_not_400_times_more(
    tmp_path: Path,
) -> None:
    """Issue 56: memory grew with the node count (each node kept 200 lines of each kind,
    4 KB each). Past 10,000 lines of a kind each node keeps its share (25 of 400 nodes),
    a kept line's text is its first 512 characters: the report still names every node,
    says what was not kept, and the peak stays near the 30 MiB of a small log (the bound
    here is a leak detector: the old code peaked at ~155 MiB on this bundle)."""
    bundle = tar(write(tmp_path / "mg", many_nodes(400, 60)), tmp_path / "mg.tar.gz")
    peak, p = peak_rss_mib(str(bundle))
    doc = json.loads(p.stdout)
    assert {i["node"] for i in doc["incidents"]} == {f"gpu-{n:04d}" for n in range(400)}
    assert {i["kind"] for i in doc["incidents"]} == {"peermem-einval-unexplained"}
    first = doc["incidents"][0]
    assert first["notes"] == [
        "only the first 25 lines of each kind were kept for each of the 400 nodes: what "
        "later lines of a kind say is not weighed"
    ]
    texts = [e["text"] for i in doc["incidents"] for e in i["evidence"]]
    assert len(texts) == 400 * 8 and all(len(t) == 512 and t.endswith("\u2026") for t in texts)
    assert peak < 80, f"peak RSS {peak:.0f} MiB"
