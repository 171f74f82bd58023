"""node-problem-detector: the plugin run as NPD runs it, against a real running agent.

NPD's custom plugin monitor runs each rule's ``path`` with its ``args``, kills it
past the rule's ``timeout`` (Unknown), and keeps ``max_output_length`` characters
of its stdout (plugin/plugin.go). Here the rules come from
``deploy/npd/nodeagent-monitor.json``; the only changes are where the files are
(the plugin from this checkout; ``/run/nodeagent`` is the test node's), as
NPD's DaemonSet patch mounts them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodeagent.core.conditions import (
    CONDITION_TYPES,
    EVENT_KINDS,
    condition_message,
    event_of,
    one_line,
)
from nodeagent.core.guard import Verdict
from nodeagent.guards.registry import GUARDS
from nodeagent.journal import message
from nodeagent.sim.node import READY
from tests.healthy import healthy_node
from tests.waiting import WAIT, until

REPO = Path(__file__).resolve().parent.parent
NPD = REPO / "deploy/npd"
PLUGIN = NPD / "nodeagent-npd-check"
MONITOR = json.loads((NPD / "nodeagent-monitor.json").read_text())
JOURNAL_MONITOR = json.loads((NPD / "nodeagent-journal-monitor.json").read_text())
OUT_MAX = MONITOR["pluginConfig"]["max_output_length"]


def seconds(text: str) -> float:
    m = re.fullmatch(r"(\d+)s", text)
    assert m, text
    return float(m.group(1))


def rule_for(what: str, name: str) -> dict[str, Any]:
    (rule,) = [r for r in MONITOR["rules"] if r["args"][-2:] == [what, name]]
    return rule


def run_rule(rule: dict[str, Any], root: Path) -> tuple[int, str]:
    """As NPD runs it: argv, killed (Unknown) if it hangs, the output cut.

    NPD kills the plugin past the rule's ``timeout`` (the configs test bounds it); here
    the kill is a hang detector only (a blocking read never returns), so a plugin slowed
    by a busy machine is not taken for one that blocks.
    """
    assert rule["path"] == "/opt/nodeagent-npd/nodeagent-npd-check"
    args = [a.replace("/run/nodeagent", str(root / "run/nodeagent")) for a in rule["args"]]
    try:
        p = subprocess.run([str(PLUGIN), *args], capture_output=True, text=True, timeout=WAIT)
    except subprocess.TimeoutExpired:
        return 3, "timeout"
    out = p.stdout.strip()[:OUT_MAX]
    assert p.stdout.count("\n") <= 1 and len(p.stdout.rstrip("\n")) <= OUT_MAX, p.stdout
    return p.returncode, out


def condition(guard: str, root: Path) -> tuple[int, str]:
    return run_rule(rule_for("condition", guard), root)


def event(kind: str, root: Path) -> tuple[int, str]:
    return run_rule(rule_for("event", kind), root)


# -- the configs ----------------------------------------------------------------------------


def test_the_monitor_has_a_permanent_rule_per_guard_and_a_temporary_one_per_event() -> None:
    assert MONITOR["plugin"] == "custom" and OUT_MAX == 80
    declared = {c["type"] for c in MONITOR["conditions"]}
    permanent = [r for r in MONITOR["rules"] if r["type"] == "permanent"]
    assert {r["condition"] for r in permanent} == declared == set(CONDITION_TYPES.values())
    assert {r["args"][-1] for r in permanent} == {e.name for e in GUARDS}
    for r in permanent:
        assert CONDITION_TYPES[r["args"][-1]] == r["condition"]
    temporary = [r for r in MONITOR["rules"] if r["type"] == "temporary"]
    assert sorted(r["args"][-1] for r in temporary) == sorted(EVENT_KINDS)
    for r in MONITOR["rules"]:
        assert seconds(r["timeout"]) <= seconds(MONITOR["pluginConfig"]["timeout"])
    assert os.access(PLUGIN, os.X_OK), "NPD executes the path: it must be executable"


def test_the_journal_monitor_matches_the_journal_message_of_each_event() -> None:
    assert JOURNAL_MONITOR["plugin"] == "journald"
    assert JOURNAL_MONITOR["pluginConfig"]["source"] == "nodeagent"  # SYSLOG_IDENTIFIER
    records = {
        "peermem-load-failed": {"kind": "action", "guard": "peermem", "action": "load x",
                                "performed": True, "ok": False, "error": "EINVAL"},
        "peermem-held-past-budget": {"kind": "held-open", "opener": "modprobe", "seconds": 300,
                                     "ended": "budget expired"},
        "storage-in-use": {"kind": "decision", "guard": "storage", "verdict": "in-use",
                           "ok": False, "reasons": ["rpcrdma is in use"]},
        "vf-degraded": {"kind": "decision", "guard": "sriov", "verdict": "degraded",
                        "ok": False, "reasons": ["PF 0000:01:00.0 VF 3: timeout"]},
    }  # fmt: skip
    assert sorted(records) == sorted(EVENT_KINDS)
    patterns = {r["reason"]: r["pattern"] for r in JOURNAL_MONITOR["rules"]}
    for kind, rec in records.items():
        assert event_of(rec) is not None and event_of(rec)[0] == kind  # type: ignore[index]
        text = message(rec)
        matching = [r for r, pat in patterns.items() if re.fullmatch(pat, text)]
        assert len(matching) == 1, (kind, text)
    quiet = {"kind": "decision", "guard": "storage", "verdict": "clear", "ok": True}
    assert not any(re.fullmatch(p, message(quiet)) for p in patterns.values())


def test_condition_messages_are_one_printable_line_of_80() -> None:
    v = Verdict("peermem", "closed", False, ("MOFED\nis restarting \x1b[31m" + "x" * 200,))
    msg = condition_message(v)
    assert len(msg) <= 80 and msg.isprintable() and msg.isascii() and msg.endswith("...")
    assert one_line("a\tb\u00e9c") == "a b c"


# -- against a real running agent -----------------------------------------------------------

AGENT_CONFIG = """
mode = "observe"
resync_seconds = 0.3
uevents = false
journal = false
metrics_address = "off"
[npd]
enabled = true
"""
PF = "sys/bus/pci/devices/0000:01:00.0"


def start_agent(root: Path) -> subprocess.Popen[str]:
    config = root.parent / f"{root.name}.toml"
    config.write_text(AGENT_CONFIG)
    return subprocess.Popen(
        [sys.executable, "-m", "nodeagent", "run", "--host-root", str(root), "--config",
         str(config)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def until_says(code: int, ask: Callable[[], tuple[int, str]], what: str) -> str:
    """Run a rule until it exits ``code``; what it said."""

    def said() -> tuple[int, str] | None:
        got = ask()
        return got if got[0] == code else None

    got = until(said, what)
    assert got is not None  # for the type checker: until returns only a truthy answer
    return got[1]


def beat(root: Path) -> int:
    """The heartbeat's ``beat`` (boot-time seconds), 0 while there is none."""
    try:
        text = (root / "run/nodeagent/npd/heartbeat").read_text()
    except OSError:
        return 0
    m = re.search(r"^beat=(\d+)$", text, re.M)
    return int(m.group(1)) if m else 0


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    root = tmp_path / "node"
    healthy_node(root).kernel.uevent_source.close()
    proc = start_agent(root)
    try:
        until((root / "run/nodeagent/npd/heartbeat").exists, "the first heartbeat")
        yield root, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(WAIT)


def test_each_guards_condition_and_the_agent_dead(
    agent: tuple[Path, subprocess.Popen[str]],
) -> None:
    root, proc = agent
    healthy = {"peermem": "peermem open", "storage": "storage clear"}
    for guard, words in healthy.items():
        assert condition(guard, root) == (0, words)
    # No PF on this node: no problem, and the message says why (issue 54).
    code, says = condition("sriov", root)
    assert code == 0 and says.startswith("sriov not-applicable: no SR-IOV PF on this node"), says
    for kind in EVENT_KINDS:
        assert event(kind, root)[0] == 0

    # peermem: MOFED not ready -> the gate closes.
    (root / READY).unlink()
    out = until_says(1, lambda: condition("peermem", root), "peermem closed")
    assert out.startswith("peermem closed: ")
    # storage: rpcrdma loaded with an NFS-over-RDMA mount while MOFED is pending (its flag
    # was seen, then removed): in use, a problem and a Warning event.
    mod = root / "sys/module/rpcrdma"
    (mod / "holders").mkdir(parents=True)
    (mod / "initstate").write_text("live\n")
    (mod / "refcnt").write_text("1\n")
    (root / "proc/1").mkdir(parents=True, exist_ok=True)
    (root / "proc/1/mountinfo").write_text(
        "22 1 259:2 / / rw - ext4 /dev/nvme0n1p2 rw\n"
        "120 22 0:52 / /mnt/data rw - nfs4 10.0.0.5:/export rw,vers=4.2,proto=rdma\n"
    )
    out = until_says(1, lambda: condition("storage", root), "storage in use")
    assert out.startswith("storage in-use: ")
    out = until_says(1, lambda: event("storage-in-use", root), "the event")
    assert out.startswith("storage chain in use while MOFED waits: ")
    # sriov: a PF never snapshotted that reads badly -> unknown, a problem.
    pf = root / PF
    pf.mkdir(parents=True)
    (pf / "sriov_totalvfs").write_text("four\n")
    (pf / "sriov_numvfs").write_text("0\n")
    out = until_says(1, lambda: condition("sriov", root), "sriov unknown")
    assert out.startswith("sriov unknown: PF 0000:01:00.0 not guarded")

    # Dead: kill -9 leaves a heartbeat that goes stale within the rule's -a 5.
    proc.send_signal(signal.SIGKILL)
    proc.wait(WAIT)
    out = until_says(3, lambda: condition("peermem", root), "stale")
    assert out.startswith("nodeagent stale: no heartbeat for ")
    assert event("storage-in-use", root)[0] == 0, "a dead agent raises no event"


def test_a_clean_stop_is_unknown_at_once(agent: tuple[Path, subprocess.Popen[str]]) -> None:
    root, proc = agent
    assert condition("peermem", root)[0] == 0
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(WAIT) == 0
    assert condition("peermem", root) == (3, f"nodeagent not running: no heartbeat in {root}"
                                          "/run/nodeagent/npd"[:80])  # fmt: skip


def test_an_idle_healthy_agent_is_never_stale(agent: tuple[Path, subprocess.Popen[str]]) -> None:
    """Staleness is judged by the heartbeat the loop renews every second, not by passes:
    an idle agent with no open gate (peermem closed) still beats. Each renewal is read
    back at once (not after a fixed sleep), until the beats span more than the rule's 5 s
    max age with nothing happening on the node."""
    root, _proc = agent
    (root / READY).unlink()
    until(lambda: condition("peermem", root)[0] == 1, "peermem closed")

    def renewed(after: int) -> Callable[[], int]:
        return lambda: b if (b := beat(root)) > after else 0

    first = last = until(renewed(0), "a heartbeat")
    while last <= first + 5:
        last = until(renewed(last), f"the idle agent's heartbeat renewed past beat={last}")
        assert condition("peermem", root)[0] == 1, "a fresh heartbeat reads stale"


# -- the plugin on files of any shape -----------------------------------------------------


def _boot() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def _uptime() -> int:
    return int(float(Path("/proc/uptime").read_text().split()[0]))


def npd_dir(tmp: Path, heartbeat: str | bytes | None, cond: str | bytes | None) -> Path:
    d = tmp / "run/nodeagent/npd"
    d.mkdir(parents=True, exist_ok=True)
    for name, data in (("heartbeat", heartbeat), ("peermem", cond)):
        f = d / name
        if f.is_symlink() or f.exists():
            f.unlink()
        if data is not None:
            f.write_bytes(data.encode() if isinstance(data, str) else data)
    return tmp


def good_heartbeat() -> str:
    return f"version=1\nboot_id={_boot()}\nbeat={_uptime()}\n"


def good_condition(status: str = "ok") -> str:
    return f"version=1\nstatus={status}\nboot_id={_boot()}\nmessage=peermem open\n"


@pytest.mark.parametrize(
    ("heartbeat", "cond", "code", "words"),
    [
        (None, None, 3, "nodeagent not running"),
        ("", None, 3, "nodeagent not running"),
        (b"\x00\xff" * 3000, None, 3, "nodeagent not running"),
        ("version=1\nboot_id=other\nbeat=1\n", None, 3, "has not run since this boot"),
        (lambda: f"version=1\nboot_id={_boot()}\nbeat={_uptime() + 1000}\n", None, 3, "unreadable"),
        (lambda: f"version=1\nboot_id={_boot()}\nbeat=12a\n", None, 3, "unreadable"),
        (lambda: f"version=1\nboot_id={_boot()}\nbeat={_uptime() - 60}\n", None, 3, "stale"),
        (lambda: f"version=2\nboot_id={_boot()}\nbeat={_uptime()}\n", None, 3, "not running"),
        (good_heartbeat, None, 3, "no readable peermem condition"),
        (good_heartbeat, "status=ok\n", 3, "no readable peermem condition"),
        (good_heartbeat, lambda: good_condition("maybe"), 3, "status unreadable"),
        (good_heartbeat, "version=1\nstatus=ok\nboot_id=x\nmessage=m\n", 3, "another boot"),
        (good_heartbeat, lambda: good_condition() + "x" * 1_000_000, 0, "peermem open"),
        (good_heartbeat, lambda: good_condition("problem"), 1, "peermem open"),
        (good_heartbeat, good_condition, 0, "peermem open"),
    ],
)  # fmt: skip
def test_files_of_any_shape_give_a_clean_answer(
    tmp_path: Path, heartbeat: Any, cond: Any, code: int, words: str
) -> None:
    hb = heartbeat() if callable(heartbeat) else heartbeat
    cd = cond() if callable(cond) else cond
    root = npd_dir(tmp_path, hb, cd)
    got = condition("peermem", root)
    assert got[0] == code and words in got[1], got


@pytest.mark.parametrize("odd", ["fifo", "directory", "symlink"])
@pytest.mark.parametrize("which", ["heartbeat", "peermem"])
def test_a_fifo_directory_or_symlink_is_unknown_and_never_blocks(
    tmp_path: Path, odd: str, which: str
) -> None:
    root = npd_dir(tmp_path, good_heartbeat(), good_condition())
    f = root / "run/nodeagent/npd" / which
    real = f.with_name(f"{which}.real")
    f.rename(real)
    if odd == "fifo":
        os.mkfifo(f)
    elif odd == "directory":
        f.mkdir()
    else:
        f.symlink_to(real.name)
    code, out = condition("peermem", root)  # a FIFO read would block: timeout -> 3 "timeout"
    assert code == 3 and out != "timeout", out


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(content=st.binary(max_size=600))
def test_a_condition_file_of_any_bytes(tmp_path: Path, content: bytes) -> None:
    root = npd_dir(tmp_path, good_heartbeat(), content)
    code, out = condition("peermem", root)
    assert code in (0, 1, 3) and len(out) <= OUT_MAX and out.isascii() and out.isprintable()
    if code != 3:  # only what the agent writes is OK or a problem
        assert b"version=1" in content and f"boot_id={_boot()}".encode() in content


def test_npd_files_that_cannot_be_written_are_a_problem_and_the_pass_goes_on(
    tmp_path: Path,
) -> None:
    from nodeagent.agent import Agent
    from nodeagent.config import Config, NpdConfig

    root = tmp_path / "node"
    healthy_node(root).kernel.uevent_source.close()
    (root / "run/nodeagent").mkdir(parents=True, exist_ok=True)
    (root / "run/nodeagent/npd").write_text("a file where the directory should be")
    cfg = Config(host_root=str(root), mode="observe", uevents=False, npd=NpdConfig(enabled=True))
    agent = Agent(cfg, kernel_log=lambda m: [])
    try:
        result = agent.run_once()
    finally:
        agent.close()
    status = json.loads((root / "run/nodeagent/status.json").read_text())
    (problem,) = [p for p in status["problems"] if "node-problem-detector" in p]
    assert problem.startswith("node-problem-detector files not written (run/nodeagent/npd")
    assert result.verdicts["peermem"].ok and (root / "run/nodeagent/peermem.gate").exists()


# -- the plugin under each shell: numbers, events, odd files --------------------------------
#
# NPD runs the plugin with its container's /bin/sh (dash on NPD's Debian image); the
# shells at hand run it too, as sh would on another image. NPD turns any exit of a
# temporary rule but 0 into a Warning event, a crash included: an event rule exits 1
# for a recent event and 0 for anything else.

SHELLS = {
    name: argv
    for name, argv in (
        ("dash", ["dash"]),
        ("sh", ["sh"]),
        ("bash-posix", ["bash", "--posix"]),
        ("busybox-sh", ["busybox", "sh"]),
    )
    if shutil.which(argv[0])
}
EVENT = "vf-degraded"


@pytest.fixture(params=sorted(SHELLS))
def shell(request: pytest.FixtureRequest) -> list[str]:
    return SHELLS[request.param]


def run_plugin(shell: list[str], root: Path, *args: str) -> tuple[int, str]:
    """The plugin run by ``shell``: (exit code, its line); a shell error fails the test."""
    d = str(root / "run/nodeagent/npd")
    try:
        p = subprocess.run(
            [*shell, str(PLUGIN), "-d", d, *args], capture_output=True, text=True, timeout=WAIT
        )
    except subprocess.TimeoutExpired:
        return 3, "timeout"
    assert p.stderr == "", p.stderr  # "Illegal number", "arithmetic expression" ...
    assert p.stdout.count("\n") == 1 and len(p.stdout) <= OUT_MAX + 1, p.stdout
    out = p.stdout.rstrip("\n")
    assert out.isascii() and out.isprintable(), out
    return p.returncode, out


def write_event(root: Path, at: str, message: str = "VFs degraded: PF 1 VF 3") -> None:
    d = root / "run/nodeagent/npd/events"
    d.mkdir(parents=True, exist_ok=True)
    (d / EVENT).write_text(f"version=1\nboot_id={_boot()}\nat={at}\nmessage={message}\n")


def heartbeat_of(beat: str) -> str:
    return f"version=1\nboot_id={_boot()}\nbeat={beat}\n"


@pytest.mark.parametrize(
    ("ahead", "code", "words"),
    [(1000, 0, "ahead of this clock"), (10**9, 0, "ahead of this clock"),
     (1, 1, "VFs degraded"), (0, 1, "VFs degraded"), (-5, 1, "VFs degraded"),
     (-100, 0, "no recent")],
)  # fmt: skip
def test_an_event_ahead_of_the_clock_is_not_recent(
    tmp_path: Path, shell: list[str], ahead: int, code: int, words: str
) -> None:
    """As the heartbeat: a time past now + 2 s (the clocks' whole-second rounding) is no
    time this boot has reached, so no event for as long as the file stays."""
    if _uptime() + ahead < 0:
        pytest.skip("the machine booted less than 100 s ago")
    root = npd_dir(tmp_path, good_heartbeat(), None)
    write_event(root, str(_uptime() + ahead))
    got = run_plugin(shell, root, "-w", "20", "event", EVENT)
    assert got[0] == code and words in got[1], got


@pytest.mark.parametrize(
    ("beat", "alive"),
    [(lambda: f"0{_uptime()}", True), (lambda: "0" * 40 + str(_uptime()), True),
     (lambda: str(_uptime() + 2), True), ("08", False), ("09", False), ("0", False),
     ("", False), ("9" * 13, False), ("9" * 40, False), (lambda: f"+{_uptime()}", False),
     (lambda: f"-{_uptime()}", False), (lambda: f" {_uptime()}", False),
     (lambda: f"{_uptime()} ", False), (lambda: f"0x{_uptime():x}", False),
     (lambda: f"{_uptime()}.5", False), (lambda: f"{_uptime()}\r", False),
     ("$((1/0))", False), ("`reboot`", False)],
)  # fmt: skip
def test_heartbeat_numbers_are_decimal_text_never_shell_arithmetic(
    tmp_path: Path, shell: list[str], beat: Any, alive: bool
) -> None:
    """``beat=08`` is 8 (dash's arithmetic took it for octal: "Illegal number", exit 2,
    which NPD's temporary rules raise as an event); more than 12 digits, a sign, a
    space, anything else is unreadable: Unknown for a condition, no event."""
    root = npd_dir(tmp_path, heartbeat_of(beat() if callable(beat) else beat), good_condition())
    write_event(root, str(_uptime()))
    code, out = run_plugin(shell, root, "-a", "5", "condition", "peermem")
    assert (code, out) == (0, "peermem open") if alive else code == 3, (code, out)
    code, out = run_plugin(shell, root, "-w", "20", "event", EVENT)
    assert code == (1 if alive else 0), (code, out)


@pytest.mark.parametrize(
    ("at", "code"),
    [(lambda: f"0{_uptime()}", 1), (lambda: "0" * 40 + str(_uptime()), 1), ("08", 0),
     ("0", 0), ("", 0), ("9" * 13, 0), (lambda: f"-{_uptime()}", 0),
     (lambda: f"+{_uptime()}", 0), (lambda: f"{_uptime()} ", 0), ("x", 0)],
)  # fmt: skip
def test_event_times_are_decimal_text_and_an_unreadable_one_is_no_event(
    tmp_path: Path, shell: list[str], at: Any, code: int
) -> None:
    root = npd_dir(tmp_path, good_heartbeat(), None)
    write_event(root, at() if callable(at) else at)
    assert run_plugin(shell, root, "-w", "20", "event", EVENT)[0] == code


@pytest.mark.parametrize(("a", "w"), [("05", "020"), ("0005", "00000000000020")])
def test_options_are_decimal_text_too(tmp_path: Path, shell: list[str], a: str, w: str) -> None:
    root = npd_dir(tmp_path, heartbeat_of(str(_uptime() - 2)), good_condition())
    write_event(root, str(_uptime() - 10))
    assert run_plugin(shell, root, "-a", a, "condition", "peermem") == (0, "peermem open")
    assert run_plugin(shell, root, "-w", w, "event", EVENT)[0] == 1
    for bad in ("9" * 13, "-1", "", "08x"):
        assert run_plugin(shell, root, "-a", bad, "condition", "peermem")[0] == 3


def test_a_message_of_any_bytes_comes_out_as_one_printable_line(
    tmp_path: Path, shell: list[str]
) -> None:
    """The agent writes printable ASCII (one_line); a file with other bytes (a terminal
    escape, UTF-8, a NUL, a CR) still gives NPD one printable line of at most 80."""
    cond = (
        good_condition("problem")
        .encode()
        .replace(b"message=peermem open", b"message=\x1b[31mred\x00\xc3\xa9\rx" + b"y" * 200)
    )
    root = npd_dir(tmp_path, good_heartbeat(), cond)
    code, out = run_plugin(shell, root, "condition", "peermem")
    assert code == 1 and out.startswith(" [31mred") and len(out) == OUT_MAX, out


@pytest.mark.parametrize(
    "heartbeat",
    [lambda: good_heartbeat().replace("\n", "\r\n"), lambda: good_heartbeat().replace("\n", "\r"),
     lambda: good_heartbeat().replace("beat=", "beat ="),
     lambda: "x" * 5000 + good_heartbeat()],
)  # fmt: skip
def test_a_heartbeat_not_as_the_agent_writes_it_is_not_running(
    tmp_path: Path, shell: list[str], heartbeat: Callable[[], str]
) -> None:
    """CRLF or CR lines, a key not spelled as the agent does, the real lines past the
    4 KiB read: no fresh heartbeat (a NUL is dropped, as dash drops it)."""
    root = npd_dir(tmp_path, heartbeat(), good_condition())
    write_event(root, str(_uptime()))
    assert run_plugin(shell, root, "condition", "peermem")[0] == 3
    assert run_plugin(shell, root, "event", EVENT)[0] == 0


@pytest.mark.parametrize("link", ["npd", "events"])
def test_a_symlinked_directory_is_never_read_through(
    tmp_path: Path, shell: list[str], link: str
) -> None:
    """Files the agent never wrote (it refuses a symlink on its way) are not read: a
    symlinked DIR is no heartbeat, a symlinked events/ no event."""
    real = tmp_path / "elsewhere"
    npd_dir(real, good_heartbeat(), good_condition())
    write_event(real, str(_uptime()))
    d = tmp_path / "run/nodeagent/npd"
    if link == "npd":
        d.parent.mkdir(parents=True)
        d.symlink_to(real / "run/nodeagent/npd")
        code, out = run_plugin(shell, tmp_path, "condition", "peermem")
        assert code == 3 and "not running" in out, out
    else:
        npd_dir(tmp_path, good_heartbeat(), good_condition())
        d.joinpath("events").symlink_to(real / "run/nodeagent/npd/events")
        assert run_plugin(shell, tmp_path, "condition", "peermem") == (0, "peermem open")
    assert run_plugin(shell, tmp_path, "event", EVENT)[0] == 0


@pytest.mark.parametrize("odd", ["fifo", "directory", "symlink"])
def test_an_event_file_that_is_a_fifo_directory_or_symlink_is_no_event_and_never_blocks(
    tmp_path: Path, shell: list[str], odd: str
) -> None:
    root = npd_dir(tmp_path, good_heartbeat(), None)
    write_event(root, str(_uptime()))
    f = root / "run/nodeagent/npd/events" / EVENT
    f.rename(f.with_name("real"))
    if odd == "fifo":
        os.mkfifo(f)
    elif odd == "directory":
        f.mkdir()
    else:
        f.symlink_to("real")
    assert run_plugin(shell, root, "event", EVENT) == (0, f"no {EVENT} event")


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    beat=st.text(alphabet="0123456789 +-x\t\r", max_size=24),
    junk=st.binary(max_size=300),
)
def test_an_event_rule_exits_1_only_for_a_recent_event(
    tmp_path: Path, beat: str, junk: bytes
) -> None:
    """Whatever the heartbeat's number or the event file's bytes: 0, or 1 for an event
    file as the agent writes it; never 2 (a shell error) or 3, which NPD would raise."""
    root = npd_dir(tmp_path, heartbeat_of(beat), None)
    d = root / "run/nodeagent/npd/events"
    d.mkdir(exist_ok=True)
    (d / EVENT).write_bytes(junk)
    code, _out = run_plugin(["dash"] if "dash" in SHELLS else ["sh"], root, "event", EVENT)
    assert code == 0
    write_event(root, str(_uptime()))
    code, _out = run_plugin(["dash"] if "dash" in SHELLS else ["sh"], root, "event", EVENT)
    assert code in (0, 1)


# -- the agent's side: no file vouches for what it could not write ---------------------------


def npd_files(root: Path) -> Any:
    from nodeagent.host.conditions import NpdFiles
    from nodeagent.host.fs import HostRoot

    return NpdFiles(HostRoot(root), "run/nodeagent")


def three(peermem_ok: bool = True, storage_ok: bool = True) -> dict[str, Verdict]:
    return {
        "peermem": Verdict("peermem", "open" if peermem_ok else "closed", peermem_ok,
                           () if peermem_ok else ("MOFED not ready",)),
        "storage": Verdict("storage", "clear" if storage_ok else "in-use", storage_ok,
                           () if storage_ok else ("rpcrdma is in use",)),
        "sriov": Verdict("sriov", "stable", True, ()),
    }  # fmt: skip


def test_no_heartbeat_before_this_runs_first_publish(tmp_path: Path) -> None:
    """A previous run's files of this boot (its verdicts) are not made current by a new
    run's loop beating before its first pass published (a pass that keeps failing)."""
    old = npd_files(tmp_path)
    old.publish(three())
    old.stop()  # a clean stop: no heartbeat; the condition files stay
    new = npd_files(tmp_path)
    new.beat()
    assert not (tmp_path / "run/nodeagent/npd/heartbeat").exists()
    assert condition("storage", tmp_path)[0] == 3
    assert new.publish(three(storage_ok=False)) is None
    new.beat()
    assert condition("storage", tmp_path) == (1, "storage in-use: rpcrdma is in use")


@pytest.mark.parametrize("odd", ["directory", "fifo", "symlink"])
def test_a_guards_file_that_cannot_be_written_is_unknown_and_the_others_are_written(
    tmp_path: Path, odd: str
) -> None:
    """Something in the place of peermem's file: its write is refused (a problem), the
    storage and sriov files are written anyway (not left at a previous run's verdict
    behind a fresh heartbeat), and what can be removed is, for the next pass to write."""
    old = npd_files(tmp_path)
    old.publish(three())  # storage ok, of this boot
    d = tmp_path / "run/nodeagent/npd"
    (d / "peermem").unlink()
    (tmp_path / "outside").write_text(good_condition())
    if odd == "directory":
        (d / "peermem").mkdir()
    elif odd == "fifo":
        os.mkfifo(d / "peermem")
    else:
        (d / "peermem").symlink_to(tmp_path / "outside")
    files = npd_files(tmp_path)
    problem = files.publish(three(storage_ok=False))
    assert problem is not None and problem.startswith(
        "node-problem-detector files not written (run/nodeagent/npd: peermem: "
    ), problem
    assert condition("peermem", tmp_path)[0] == 3
    assert condition("storage", tmp_path) == (1, "storage in-use: rpcrdma is in use")
    assert (tmp_path / "outside").read_text() == good_condition()  # never followed
    again = files.publish(three(storage_ok=False))
    if odd == "directory":  # never removed: Unknown, a problem each pass
        assert again is not None and (d / "peermem").is_dir()
        assert condition("peermem", tmp_path)[0] == 3
    else:
        assert again is None and condition("peermem", tmp_path) == (0, "peermem open")


def test_a_stale_file_that_can_be_neither_written_nor_removed_withholds_the_heartbeat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An old "ok" that stays (say an immutable file) must not read as current: no
    heartbeat while it stands, so every condition is Unknown, never that stale OK."""
    files = npd_files(tmp_path)
    files.publish(three())
    host = files.host
    real_write, real_remove = host.write_atomic, host.remove
    stuck = "run/nodeagent/npd/peermem"

    def write(rel: str, *a: Any, **k: Any) -> bool:
        if rel == stuck:
            raise PermissionError(1, "Operation not permitted")
        return bool(real_write(rel, *a, **k))

    def remove(rel: str) -> bool:
        if rel == stuck:
            raise PermissionError(1, "Operation not permitted")
        return bool(real_remove(rel))

    monkeypatch.setattr(host, "write_atomic", write)
    monkeypatch.setattr(host, "remove", remove)
    problem = files.publish(three(peermem_ok=False))
    assert problem is not None and "heartbeat: withheld: peermem" in problem, problem
    files.beat()
    assert not (tmp_path / "run/nodeagent/npd/heartbeat").exists()
    assert condition("peermem", tmp_path)[0] == 3 and condition("sriov", tmp_path)[0] == 3
    monkeypatch.setattr(host, "write_atomic", real_write)
    monkeypatch.setattr(host, "remove", real_remove)
    assert files.publish(three(peermem_ok=False)) is None
    assert condition("peermem", tmp_path) == (1, "peermem closed: MOFED not ready")
