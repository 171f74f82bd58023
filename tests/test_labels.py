"""Node labels through node-feature-discovery's features.d: the label set, NFD's rules, the file."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from nodeagent.agent import Agent
from nodeagent.config import Config, LabelsConfig, config_from_mapping
from nodeagent.core.guard import Verdict
from nodeagent.core.labels import DEFAULT_PREFIX, check_prefix, label_value, node_labels
from nodeagent.errors import NodeagentError
from nodeagent.sim.node import READY
from tests.healthy import healthy_node
from tests.waiting import WAIT, until

FEATURES = "etc/kubernetes/node-feature-discovery/features.d"
P = DEFAULT_PREFIX
# NFD's own checks (pkg/apis/nfd/validate): a qualified name, a label value.
NFD_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
NFD_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?")


def verdicts(peermem: str, storage: str, sriov: str, dmabuf: bool | None) -> dict[str, Verdict]:
    ok = {"open": True, "closed": False, "rebuild": False, "clear": True, "holding": True,
          "blocking": False, "in-use": False, "unknown": False, "stable": True, "restored": True,
          "disrupted": True, "restoring": True, "degraded": False}  # fmt: skip
    gd = {"dmabuf_capable": dmabuf}
    return {
        "peermem": Verdict("peermem", peermem, ok[peermem], (), {"gpudirect": gd}),
        "storage": Verdict("storage", storage, ok[storage], ()),
        "sriov": Verdict("sriov", sriov, ok[sriov], ()),
    }


@pytest.mark.parametrize("peermem", ["open", "closed", "rebuild"])
@pytest.mark.parametrize("storage", ["clear", "holding", "blocking", "in-use", "unknown"])
@pytest.mark.parametrize(
    "sriov", ["stable", "restored", "disrupted", "restoring", "degraded", "unknown"]
)
@pytest.mark.parametrize("dmabuf", [True, False, None])
def test_the_label_set_under_every_verdict(
    peermem: str, storage: str, sriov: str, dmabuf: bool | None
) -> None:
    v = verdicts(peermem, storage, sriov, dmabuf)
    labels = node_labels(v, P)
    assert labels == {
        f"{P}/nodeagent-gpudirect": {True: "dmabuf", False: "peermem", None: "unknown"}[dmabuf],
        f"{P}/nodeagent-peermem-gate": "open" if peermem == "open" else "closed",
        f"{P}/nodeagent-peermem-ok": str(v["peermem"].ok).lower(),
        f"{P}/nodeagent-storage-ok": str(v["storage"].ok).lower(),
        f"{P}/nodeagent-sriov-ok": str(v["sriov"].ok).lower(),
        f"{P}/nodeagent-vfs-restored": str(sriov in ("stable", "restored")).lower(),
    }
    for key, value in labels.items():
        prefix, _, name = key.partition("/")
        assert prefix == P and NFD_NAME.fullmatch(name) and NFD_VALUE.fullmatch(value)


@pytest.mark.parametrize(
    "prefix",
    ["Feature.Node", "a..b", "-a.example.com", "a-.example.com", "kubernetes.io",
     "x.kubernetes.io", "a" * 64 + ".com", "é.example.com", "", 5, "a/b", "a.b "],
)  # fmt: skip
def test_a_label_prefix_nfd_would_refuse_is_a_config_error(prefix: object) -> None:
    with pytest.raises(NodeagentError, match=r"^config labels.prefix: "):
        check_prefix("labels.prefix", prefix)
    with pytest.raises(NodeagentError, match=r"^config labels.prefix: "):
        config_from_mapping({"labels": {"prefix": prefix}})


@pytest.mark.parametrize(
    "prefix", [P, f"gpu.{P}", "nodeagent.example.com", "example.com", "a" * 63 + ".io"]
)
def test_prefixes_nfd_accepts(prefix: str) -> None:
    assert config_from_mapping({"labels": {"prefix": prefix}}).labels.prefix == prefix


@pytest.mark.parametrize(
    "text",
    ["mlx5_core" * 12, "ib_core-" + "x" * 90, "../../etc", "née", "-_.", "", "a b\nc", "v" * 63],
)
def test_any_text_becomes_a_valid_label_value(text: str) -> None:
    value = label_value(text)
    assert len(value) <= 63 and value and NFD_VALUE.fullmatch(value), value


def test_a_guard_name_that_makes_no_label_name_is_left_out() -> None:
    long = "x" * 60  # nodeagent-<60>-ok is past NFD's 63 characters
    v = {long: Verdict(long, "ok", True, ()), "y": Verdict("y", "ok", False, ())}
    assert node_labels(v, P) == {f"{P}/nodeagent-y-ok": "false"}


# -- the file, written by the real agent ---------------------------------------------------


def agent_on(root: Path, **labels: Any) -> Agent:
    cfg = Config(
        host_root=str(root),
        mode="observe",
        uevents=False,
        labels=LabelsConfig(nfd=True, **labels),
    )
    return Agent(cfg, kernel_log=lambda m: [])


def read_labels(root: Path) -> dict[str, str]:
    lines = (root / FEATURES / "nodeagent").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if not line.startswith("#"))


@pytest.fixture
def node(tmp_path: Path) -> Path:
    n = healthy_node(tmp_path)
    n.kernel.uevent_source.close()
    (tmp_path / FEATURES).mkdir(parents=True)
    return tmp_path


def test_the_file_follows_the_verdicts_and_is_rewritten_only_on_change(node: Path) -> None:
    agent = agent_on(node)
    try:
        agent.run_once()
        f = node / FEATURES / "nodeagent"
        assert read_labels(node)[f"{P}/nodeagent-peermem-gate"] == "open"
        assert re.search(r"^# \+expiry-time=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$", f.read_text(), re.M)
        before = os.stat(f)
        agent.run_once()
        after = os.stat(f)
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
        (node / READY).unlink()  # MOFED not ready: the gate closes, the label follows
        agent.run_once()
        labels = read_labels(node)
        assert labels[f"{P}/nodeagent-peermem-gate"] == "closed"
        assert labels[f"{P}/nodeagent-peermem-ok"] == "false"
        assert not [n for n in os.listdir(node / FEATURES) if n != "nodeagent"]  # no temp left
    finally:
        agent.close()


def test_the_expiry_is_refreshed_before_it_runs_out(node: Path) -> None:
    now = [1_000_000.0]
    agent = agent_on(node, expiry_seconds=600.0)
    agent.exporters.get("labels").file.wall = lambda: now[0]
    try:
        agent.run_once()
        first = (node / FEATURES / "nodeagent").read_text()
        now[0] += 200  # a third of the expiry: not rewritten
        agent.run_once()
        assert (node / FEATURES / "nodeagent").read_text() == first
        now[0] += 200  # past half: rewritten with a later expiry
        agent.run_once()
        assert (node / FEATURES / "nodeagent").read_text() != first
    finally:
        agent.close()


def _bind_read_only(d: Path) -> str | None:
    p = subprocess.run(["mount", "--bind", str(d), str(d)], capture_output=True, text=True)
    if p.returncode != 0:
        return f"cannot bind-mount here: {p.stderr.strip()}"
    p = subprocess.run(["mount", "-o", "remount,bind,ro", str(d)], capture_output=True, text=True)
    if p.returncode != 0:
        subprocess.run(["umount", str(d)], check=False)
        return f"cannot remount read-only here: {p.stderr.strip()}"
    return None


@pytest.mark.parametrize("how", ["missing", "symlink", "file", "read-only"])
def test_an_unusable_features_dir_is_a_problem_and_the_pass_goes_on(node: Path, how: str) -> None:
    d = node / FEATURES
    d.rmdir()
    if how == "symlink":
        (node / "elsewhere").mkdir()
        d.symlink_to(node / "elsewhere")
    elif how == "file":
        d.write_text("")
    elif how == "read-only":
        d.mkdir()
        why = _bind_read_only(d)
        if why is not None:
            pytest.skip(f"{why} (missing/symlink/file cover the same path)")
    agent = agent_on(node)
    try:
        result = agent.run_once()
        status = json.loads((node / "run/nodeagent/status.json").read_text())
    finally:
        agent.close()
        if how == "read-only":
            subprocess.run(["umount", str(d)], check=False)
    (problem,) = [p for p in status["problems"] if p.startswith("node labels not written")]
    assert f"{FEATURES}/nodeagent" in problem
    assert result.verdicts["peermem"].ok and (node / "run/nodeagent/peermem.gate").exists()
    assert not (node / "elsewhere/nodeagent").exists()


def test_a_clean_stop_removes_the_labels(node: Path) -> None:
    agent = agent_on(node)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    f = node / FEATURES / "nodeagent"
    until(f.exists, "the labels file of the first pass")
    agent.stop()
    thread.join(WAIT)
    assert not thread.is_alive() and not f.exists()


@pytest.mark.parametrize("odd", ["symlink", "fifo", "directory"])
def test_something_in_place_of_the_file_is_never_followed_and_replaced_if_it_can_be(
    node: Path, odd: str
) -> None:
    """NFD follows a symlink named ``nodeagent`` (labels from any file, an old "open"
    gate) and blocks reading a FIFO. The write is refused, never through it; what is not
    a directory is removed, so the next pass writes the real labels."""
    f = node / FEATURES / "nodeagent"
    forged = f"{P}/nodeagent-peermem-gate=open\n"
    (node / "forged").write_text(forged)
    if odd == "symlink":
        f.symlink_to(node / "forged")
    elif odd == "fifo":
        os.mkfifo(f)
    else:
        f.mkdir()
    (node / READY).unlink()  # the gate is closed: the forged "open" must not stand
    agent = agent_on(node)
    try:
        agent.run_once()
        first = json.loads((node / "run/nodeagent/status.json").read_text())["problems"]
        agent.run_once()
        second = json.loads((node / "run/nodeagent/status.json").read_text())["problems"]
    finally:
        agent.close()
    assert [p for p in first if p.startswith(f"node labels not written ({FEATURES}/nodeagent")]
    assert (node / "forged").read_text() == forged
    if odd == "directory":
        assert f.is_dir() and [p for p in second if p.startswith("node labels not written")]
    else:
        assert not f.is_symlink() and f.is_file()
        assert read_labels(node)[f"{P}/nodeagent-peermem-gate"] == "closed"
        assert not [p for p in second if p.startswith("node labels not written")]


def test_labels_that_cannot_be_rewritten_are_removed_not_left_to_expire(
    node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that fails (a full disk) leaves no older labels standing: a gate "open"
    while it has closed would hold until the expiry."""
    agent = agent_on(node)
    try:
        agent.run_once()
        f = node / FEATURES / "nodeagent"
        assert read_labels(node)[f"{P}/nodeagent-peermem-gate"] == "open"
        host = agent.exporters.get("labels").file.host
        real_write = host.write_atomic

        def write(rel: str, *a: Any, **k: Any) -> bool:
            if rel.endswith("features.d/nodeagent"):
                raise OSError(28, "No space left on device")
            return bool(real_write(rel, *a, **k))

        monkeypatch.setattr(host, "write_atomic", write)
        (node / READY).unlink()
        agent.run_once()
        assert not f.exists()
        monkeypatch.setattr(host, "write_atomic", real_write)
        agent.run_once()
        assert read_labels(node)[f"{P}/nodeagent-peermem-gate"] == "closed"
    finally:
        agent.close()
