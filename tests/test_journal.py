"""Records to the host journal (systemd's native protocol) and to stderr.

The end-to-end test runs ``nodeagent run --once`` against a real Debian
``systemd-journald`` started in a private mount namespace (tests/journald.py)
and reads the fields back with ``journalctl -o json``.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeagent.journal import (
    KNOWN_KINDS,
    JournalExporter,
    encode,
    field_name,
    journal_fields,
    message_id,
)
from nodeagent.sim.node import READY, Node
from tests.healthy import healthy_node
from tests.journald import PrivateJournald, SetupError, private_journald

DOCS = Path(__file__).resolve().parent.parent / "docs" / "operations.md"


def test_values_with_newlines_use_the_binary_form() -> None:
    data = encode([("MESSAGE", "one line"), ("NODEAGENT_REASONS", "a\nb")])
    assert data.startswith(b"MESSAGE=one line\n")
    rest = data[len(b"MESSAGE=one line\n") :]
    assert rest.startswith(b"NODEAGENT_REASONS\n")
    (length,) = struct.unpack("<Q", rest[18:26])
    assert length == 3 and rest[26:] == b"a\nb\n"


def test_fields_come_from_the_record_keys() -> None:
    rec = {
        "ts": 1.0,
        "kind": "action",
        "guard": "peermem",
        "module": "nvidia_peermem",
        "pci": "0000:3b:00.0",
        "action": "load nvidia_peermem from x.ko",
        "performed": True,
        "ok": False,
        "error": "Invalid argument (EINVAL)",
        "kernel_messages": ["nvidia_peermem: disagrees about version of symbol x"],
        "errno": None,
    }
    fields = dict(journal_fields(rec))
    assert fields["MESSAGE_ID"] == message_id("action")
    assert fields["PRIORITY"] == "3"  # a failed action is an error
    assert fields["NODEAGENT_GUARD"] == "peermem"
    assert fields["NODEAGENT_MODULE"] == "nvidia_peermem"
    assert fields["NODEAGENT_PCI"] == "0000:3b:00.0"
    assert fields["NODEAGENT_OK"] == "false"
    assert "NODEAGENT_ERRNO" not in fields and "NODEAGENT_TS" not in fields
    assert "failed: Invalid argument" in fields["MESSAGE"]
    assert field_name("woken-by") == "NODEAGENT_WOKEN_BY"


def test_message_ids_are_stable_and_documented() -> None:
    ids = {k: message_id(k) for k in KNOWN_KINDS}
    assert len(set(ids.values())) == len(ids)
    assert all(re.fullmatch(r"[0-9a-f]{32}", v) for v in ids.values())
    assert message_id("decision") == "937e7ed4a84a59ab8b8c207e93f011aa", "ids never change"
    text = DOCS.read_text()
    for kind, mid in ids.items():
        assert re.search(rf"`{re.escape(kind)}`\s*\|\s*`{mid}`", text), f"{kind} not in {DOCS}"


def test_no_socket_is_said_once_and_sending_resumes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "socket"
    exp = JournalExporter(str(path))
    with caplog.at_level(logging.WARNING, logger="nodeagent.journal"):
        exp.on_record({"kind": "start"})
        exp.on_record({"kind": "stop"})
        assert [r.getMessage() for r in caplog.records if "absent" in r.getMessage()] != []
        assert len(caplog.records) == 1, "said once"
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
            server.bind(str(path))
            exp.on_record({"kind": "decision", "guard": "peermem", "verdict": "open"})
            got = server.recv(65536)
        assert b"NODEAGENT_GUARD=peermem\n" in got
        assert exp.available and "back" in caplog.records[-1].getMessage()
    exp.close()


def test_a_full_journal_queue_drops_instead_of_blocking(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "socket"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(str(path))  # never read: its queue fills
        exp = JournalExporter(str(path))
        with caplog.at_level(logging.WARNING, logger="nodeagent.journal"):
            for _ in range(2000):  # a blocking send would hang here
                exp.on_record({"kind": "decision", "guard": "peermem", "reasons": ["x" * 512]})
        assert exp.sent > 0 and exp.dropped > 0
        assert [r.getMessage() for r in caplog.records if "full" in r.getMessage()] != []
        assert len(caplog.records) == 1, "said once"
        exp.close()


def _exporter_for(root: Path, journal: bool = True) -> JournalExporter:
    """The journal exporter as the agent builds it for host root ``root``."""
    from nodeagent.config import Config
    from nodeagent.loop.exporters import build_exporters

    cfg = Config(host_root=str(root), journal=journal, metrics_address="off")
    exporters = build_exporters(cfg)
    (exp,) = [e for e in exporters.exporters if isinstance(e, JournalExporter)]
    return exp


def test_the_journal_socket_resolves_inside_the_host_root(tmp_path: Path) -> None:
    """An absolute symlink on the way resolves inside the host root, as if chrooted; a
    symlink as the socket itself is refused, never followed out of the root."""
    root = tmp_path / "host"
    outside = tmp_path / "container-run"  # what "/" would be to an absolute link
    (root / "var/jd").mkdir(parents=True)
    (root / "run/systemd").mkdir(parents=True)
    outside.mkdir()
    # /run/systemd/journal -> /var/jd: inside the root, that is root/var/jd.
    (root / "run/systemd/journal").symlink_to("/var/jd")
    with (
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as inside,
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as escape,
    ):
        inside.bind(str(root / "var/jd/socket"))
        escape.bind(str(outside / "socket"))
        inside.setblocking(False)
        escape.setblocking(False)
        exp = _exporter_for(root)
        exp.on_record({"kind": "start"})
        assert b"SYSLOG_IDENTIFIER=nodeagent\n" in inside.recv(65536)
        exp.close()
        # The socket itself an absolute symlink out: refused, nothing sent anywhere.
        (root / "var/jd/socket").unlink()
        (root / "var/jd/socket").symlink_to(outside / "socket")
        exp = _exporter_for(root)
        exp.on_record({"kind": "start"})
        assert exp.available is False and exp.sent == 0
        with pytest.raises(BlockingIOError):
            escape.recv(65536)
        exp.close()


def test_a_journald_restart_makes_a_new_socket_and_sending_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "socket"
    exp = JournalExporter(str(path))
    for n in range(2):
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
            server.bind(str(path))
            exp.on_record({"kind": "decision", "guard": "peermem", "verdict": f"v{n}"})
            assert f"NODEAGENT_VERDICT=v{n}\n".encode() in server.recv(65536)
        path.unlink()
    assert exp.sent == 2
    exp.close()


# -- against a real journald --------------------------------------------------


@pytest.fixture
def journald_node() -> Iterator[tuple[PrivateJournald, Node]]:
    # A short host root: the socket path must fit a unix socket address (108 bytes)
    # once prefixed with /proc/<pid>/root.
    with tempfile.TemporaryDirectory(prefix="na-j") as tmp:
        node = healthy_node(Path(tmp), ready=False)
        try:
            with private_journald(node.root) as jd:
                yield jd, node
        except SetupError as exc:
            pytest.skip(f"no private journald: {exc}")
        finally:
            node.kernel.uevent_source.close()


def test_records_reach_a_real_journald_with_their_fields(
    journald_node: tuple[PrivateJournald, Node], tmp_path: Path
) -> None:
    jd, node = journald_node
    (node.root / READY).write_text("")  # the gate opens: a decision and a (decided) load
    cfg = tmp_path / "agent.toml"
    cfg.write_text('uevents = false\nmetrics_address = "off"\n')
    host_root = jd.root / str(node.root).lstrip("/")
    argv = ["run", "--once", "--host-root", str(host_root), "--config", str(cfg)]
    p = subprocess.run(
        [sys.executable, "-m", "nodeagent", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    assert "journal socket" not in p.stderr, "the socket was there: no warning"
    # stderr has the same records as JSON lines.
    kinds = [json.loads(line).get("record", {}).get("kind") for line in p.stderr.splitlines()]
    assert "decision" in kinds and "action" in kinds

    wanted = {("decision", "peermem"), ("action", "peermem")}  # the gate's decision, its load

    def keyed(entries: list[dict[str, Any]]) -> dict[tuple[Any, Any], dict[str, Any]]:
        return {(e.get("NODEAGENT_KIND"), e.get("NODEAGENT_GUARD")): e for e in entries}

    entries = jd.wait_for(
        "the peermem decision and load in the journal",
        lambda found: wanted <= keyed(found).keys(),
        SYSLOG_IDENTIFIER="nodeagent",
    )
    by_kind = keyed(entries)
    decision, action = by_kind["decision", "peermem"], by_kind["action", "peermem"]
    assert decision["MESSAGE_ID"] == message_id("decision")
    assert decision["NODEAGENT_GUARD"] == "peermem"
    assert decision["NODEAGENT_VERDICT"] == "open"
    assert decision["PRIORITY"] == "6"
    assert decision["MESSAGE"] == "peermem: open"
    assert json.loads(decision["NODEAGENT_EVIDENCE"])["mofed_ready"] is True
    assert action["MESSAGE_ID"] == message_id("action")
    assert action["NODEAGENT_MODULE"] == "nvidia_peermem"
    assert action["NODEAGENT_PERFORMED"] == "false"
    assert action["_TRANSPORT"] == "journal"


def test_a_large_record_goes_through_a_sealed_memfd(
    journald_node: tuple[PrivateJournald, Node],
) -> None:
    jd, node = journald_node
    exp = JournalExporter(str(jd.root / str(node.root).lstrip("/") / "run/systemd/journal/socket"))
    big = "x" * (1 << 20)  # past the datagram limit (net.core.wmem_max is ~208 KiB)
    exp.on_record({"kind": "vf-restore", "guard": "vf", "pci": "0000:3b:00.0", "blob": big})
    assert exp.available and exp.sent == 1
    entries = jd.wait_for("the large record in the journal", bool, NODEAGENT_KIND="vf-restore")
    assert len(entries) == 1
    e = entries[0]
    assert e["NODEAGENT_PCI"] == "0000:3b:00.0"
    assert e["MESSAGE_ID"] == message_id("vf-restore")
    assert len(e["NODEAGENT_BLOB"]) == 1 << 20
    exp.close()


def test_every_record_kind_the_agent_writes_is_known_with_a_message() -> None:
    """Drift: a record kind written anywhere in the agent (``"kind": "<name>"``) is in
    ``KNOWN_KINDS`` (so docs/operations.md lists its MESSAGE_ID) and has a message of its
    own, not the generic fallback (a kind without a priority of its own is INFO)."""
    from nodeagent.journal import MESSAGES

    root = Path(__file__).resolve().parent.parent / "nodeagent"
    written = set()
    for path in root.rglob("*.py"):
        if "sim" in path.relative_to(root).parts:
            continue  # the simulator's actors' own records
        written |= set(re.findall(r'"kind": "([a-z-]+)"', path.read_text()))
    assert written, "no record kind found: the pattern is wrong"
    assert written <= set(KNOWN_KINDS), sorted(written - set(KNOWN_KINDS))
    assert not written - MESSAGES.keys(), sorted(written - MESSAGES.keys())
