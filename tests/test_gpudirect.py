"""GPUDirect mode: DMA-BUF capable or peermem required, from what the node shows."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import pytest

from nodeagent.core.actions import UnloadModule
from nodeagent.core.gpudirect import classify, kernel_release
from nodeagent.core.peermem import PEERMEM, PeermemGate
from nodeagent.core.snapshot import NodeSnapshot, TextFact
from tests.snapshots import flag, healthy, loaded, with_files, with_modules

VERSION = "proc/driver/nvidia/version"
PEERS = "sys/kernel/mm/memory_peers"
# First lines of /proc/driver/nvidia/version as the two kinds of module print them.
OPEN = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  "
    "(dvs-builder@U22-I3-AE18-23-3)  Tue Sep 23 09:54:07 UTC 2025\n"
    "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14+deb12u1)\n"
)
PROPRIETARY = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.163.01  Tue Apr  8 12:32:51 UTC 2025\n"
    "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14+deb12u1)\n"
)
GATE = PeermemGate()


def text(content: str | None) -> TextFact:
    return TextFact(VERSION, content, None if content is not None else "absent")


@pytest.mark.parametrize(
    ("banner", "kernel", "capable", "modules", "required"),
    [
        (OPEN, "6.1.0-40-amd64", True, "open", "no"),
        (OPEN, "5.12.0", True, "open", "no"),
        (OPEN, "5.11.22-100.fc32.x86_64", False, "open", "yes"),
        (OPEN, "5.14.0-427.96.1.el9_4.aarch64+64k", True, "open", "no"),
        (PROPRIETARY, "6.8.0-45-generic", False, "proprietary", "yes"),
        (None, "6.1.0-40-amd64", None, "unknown", "unknown"),
        ("garbage\n", "6.1.0", None, "unknown", "unknown"),
        (OPEN, "unknown", None, "open", "unknown"),
    ],
)
def test_classify(
    banner: str | None, kernel: str, capable: bool | None, modules: str, required: str
) -> None:
    g = classify(text(banner), kernel, ())
    assert (g.dmabuf_capable, g.modules, g.peermem_required) == (capable, modules, required)
    if capable:
        assert g.summary == "DMA-BUF capable; peermem not required"
    if banner in (OPEN, PROPRIETARY):
        assert g.driver_version == ("580.95.05" if banner == OPEN else "550.163.01")


def test_banner_without_trailing_text_and_kernel_release_parsing() -> None:
    bare = "NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  580.82.09"
    g = classify(text(bare), "6.6", ())
    assert g.modules == "open" and g.driver_version == "580.82.09"
    assert kernel_release("5.14.0-427.el9") == (5, 14) and kernel_release("x") is None


def node(banner: str | None, kernel: str, peers: tuple[str, ...] = ()) -> NodeSnapshot:
    snap = replace(healthy(), kernel=kernel)
    texts = {} if banner is None else {VERSION: text(banner)}
    return replace(
        snap,
        texts=MappingProxyType(texts),
        listings=MappingProxyType({**snap.listings, PEERS: peers}),
    )


def test_peermem_evidence_says_dma_buf_capable_and_the_reasons_say_not_required() -> None:
    snap = with_files(node(OPEN, "6.1.0-40-amd64", ("nv_mem",)), flag(False))
    d = GATE.decide(snap, GATE.initial_memory())
    ev = d.verdict.evidence["gpudirect"]
    assert ev["dmabuf_capable"] is True and ev["peermem_required"] == "no"
    assert ev["modules"] == "open" and ev["peer_memory_clients"] == ["nv_mem"]
    assert d.verdict.verdict == "closed"  # the ready flag is absent: still closed
    assert d.verdict.reasons[-1].startswith(
        "GPUDirect RDMA: DMA-BUF capable; peermem not required (open kernel modules 580.95.05"
    )


def test_proprietary_modules_say_peermem_is_required() -> None:
    snap = with_files(node(PROPRIETARY, "6.8.0-45-generic"), flag(False))
    d = GATE.decide(snap, GATE.initial_memory())
    assert d.verdict.evidence["gpudirect"]["peermem_required"] == "yes"
    assert d.verdict.reasons[-1] == (
        "GPUDirect RDMA: not DMA-BUF capable; peermem required for GPUDirect RDMA "
        "(proprietary kernel modules 550.163.01)"
    )


def test_an_open_gate_is_not_closed_by_the_classification() -> None:
    d = GATE.decide(node(OPEN, "6.1.0-40-amd64"), GATE.initial_memory())
    assert d.verdict.verdict == "open" and d.verdict.reasons == ()
    assert d.verdict.evidence["gpudirect"]["dmabuf_capable"] is True


def test_dma_buf_capable_is_never_a_reason_to_unload_peermem() -> None:
    idle = loaded(PEERMEM, "P" * 23, refcnt=0)
    steady = with_modules(node(OPEN, "6.1.0-40-amd64", ("nv_mem",)), nvidia_peermem=idle)
    d = GATE.decide(steady, GATE.initial_memory())
    assert not any(isinstance(a, UnloadModule) for a in d.actions)
    assert d.verdict.evidence["gpudirect"]["dmabuf_capable"] is True


def test_check_json_on_an_open_module_node(tmp_path: Path) -> None:
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/osrelease").write_text("6.1.0-40-amd64\n")
    (tmp_path / "proc/driver/nvidia").mkdir(parents=True)
    (tmp_path / VERSION).write_text(OPEN)
    (tmp_path / PEERS / "nv_mem").mkdir(parents=True)
    (tmp_path / "sys/module").mkdir(parents=True)
    p = subprocess.run(
        [sys.executable, "-m", "nodeagent", "check", "--host-root", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert p.returncode == 1, p.stderr  # closed: nothing else is there
    peermem = json.loads(p.stdout)["guards"]["peermem"]
    assert peermem["evidence"]["gpudirect"]["dmabuf_capable"] is True
    assert peermem["evidence"]["gpudirect"]["peer_memory_clients"] == ["nv_mem"]
    assert any("DMA-BUF capable; peermem not required" in r for r in peermem["reasons"])


def test_a_symlinked_banner_is_not_followed_and_reads_as_unknown(tmp_path: Path) -> None:
    from nodeagent.config import Config
    from nodeagent.host.fs import HostRoot
    from nodeagent.host.observe import Observer

    (tmp_path / "proc/driver/nvidia").mkdir(parents=True)
    (tmp_path / "elsewhere").write_text(OPEN)
    (tmp_path / VERSION).symlink_to(tmp_path / "elsewhere")
    observer = Observer(HostRoot(str(tmp_path)), Config(host_root=str(tmp_path)))
    fact = observer.read_text_fact(VERSION)
    assert fact.text is None and fact.problem is not None and "unreadable" in fact.problem
    assert classify(fact, "6.1.0", ()).dmabuf_capable is None


def test_metrics_sample_says_dma_buf_capable_and_is_absent_while_unknown() -> None:
    def samples(snap: NodeSnapshot) -> dict[str, tuple[dict[str, str], float]]:
        verdict = GATE.decide(snap, GATE.initial_memory()).verdict
        found = GATE.metric_samples(verdict, ())
        return {s.family: (dict(s.labels), s.value) for s in found}

    open_node = samples(node(OPEN, "6.1.0-40-amd64"))
    assert open_node["nodeagent_gpudirect_dmabuf_capable"] == ({"modules": "open"}, 1.0)
    prop = samples(node(PROPRIETARY, "6.8.0"))
    assert prop["nodeagent_gpudirect_dmabuf_capable"] == ({"modules": "proprietary"}, 0.0)
    assert "nodeagent_gpudirect_dmabuf_capable" not in samples(node(None, "6.1.0"))
    families = {f.name for f in GATE.metric_families}
    assert "nodeagent_gpudirect_dmabuf_capable" in families
