"""``nodeagent explain`` on the words of the tools that print them (issue 41): the kernel's
module loader, kmod, busybox, openibd, the DOCA driver container, the GPU driver
container and its sidecar, nv_peer_mem's script and unit, each excerpt written from the
source's format (explain/signatures.py names the file of each), in every shape a log gives
it: kubectl --timestamps, the must-gather's --prefix, dmesg, dmesg -T, journalctl,
CRLF, ANSI colour. Then the rules that correlate lines, and the families that must stay
silent."""

from __future__ import annotations

from typing import Any

import pytest

from nodeagent.explain.incidents import INCIDENTS
from nodeagent.explain.matcher import explain_lines
from nodeagent.explain.signatures import PREFILTER_WORDS, SIGNATURES
from tests.explain.corpus import (
    KERNEL_AND_KMOD,
    MOFED,
    OPENIBD_AND_CONTAINERS,
    OTHER_IN_USE,
    SHAPES,
    UNRELATED,
)


def kinds(*lines: str, file: str = "log") -> list[str]:
    doc = explain_lines([(file, list(lines))])
    return [i["kind"] for i in doc["incidents"]]


EXCERPTS = [
    pytest.param(lines, kind, shape, id=f"{kind}:{lines[-1][:40]}:{shape}")
    for lines, kind in KERNEL_AND_KMOD + OPENIBD_AND_CONTAINERS
    for shape in SHAPES
]


@pytest.mark.parametrize(("lines", "kind", "shape"), EXCERPTS)
def test_each_family_in_each_log_shape(lines: list[str], kind: str, shape: str) -> None:
    assert kinds(*map(SHAPES[shape], lines)) == [kind]


@pytest.mark.parametrize(("lines", "kind"), KERNEL_AND_KMOD + OPENIBD_AND_CONTAINERS)
def test_each_excerpt_passes_the_chunk_prefilter(lines: list[str], kind: str) -> None:
    """A chunk of a big log is split into lines only if it has a prefilter word."""
    for line in lines:
        if any(s.found_in(line, line.lower()) for s in SIGNATURES):
            assert any(w in line.lower().encode() for w in PREFILTER_WORDS), line


def test_every_signature_s_words_hold_a_prefilter_word() -> None:
    """Every line a form matches has one of its words (test_explain_linear checks), so a
    word holding a prefilter word lets no line of it be skipped with its chunk. The VF
    restore forms' words are cut short ("vf re", "tore": case-blind letters); what they
    match holds "restore". The harmless callback is evidence of nothing."""
    for sig in SIGNATURES:
        if sig.name == "vf-restore-failed":
            assert b"restore" in PREFILTER_WORDS
            continue
        if sig.name == "peermem-harmless-callback":  # evidence of no incident
            continue
        for word in sig.needs:
            assert any(w.decode() in word for w in PREFILTER_WORDS), (sig.name, word)


def test_every_kind_is_reached_by_some_excerpt() -> None:
    reached = {k for _, k in KERNEL_AND_KMOD + OPENIBD_AND_CONTAINERS}
    reached |= {"peermem-load-race", "vf-restore-before-netdev"}  # below, and test_explain
    assert reached == {i.kind for i in INCIDENTS}


def test_a_systemctl_status_block_of_nv_peer_mem() -> None:
    block = [
        "× nv_peer_mem.service - LSB: Activates/Deactivates nv_peer_mem to \\ start at boot time.",
        "     Loaded: loaded (/etc/init.d/nv_peer_mem; generated)",
        "     Active: failed (Result: exit-code) since Fri 2026-11-21 11:00:01 UTC; 3min ago",
        "    Process: 812 ExecStart=/etc/init.d/nv_peer_mem start (code=exited, status=1/FAILURE)",
        "Nov 21 11:00:01 gpu-8 systemd[1]: Starting LSB: Activates/Deactivates nv_peer_mem to \\ "
        "start at boot time....",
        "Nov 21 11:00:01 gpu-8 nv_peer_mem[812]: starting... modprobe: ERROR: could not insert "
        "'nv_peer_mem': Invalid argument",
        "Nov 21 11:00:01 gpu-8 nv_peer_mem[812]: Failed to load nv_peer_mem",
        "Nov 21 11:00:01 gpu-8 systemd[1]: nv_peer_mem.service: Control process exited, "
        "code=exited, status=1/FAILURE",
        "Nov 21 11:00:01 gpu-8 systemd[1]: nv_peer_mem.service: Failed with result 'exit-code'.",
        "Nov 21 11:00:01 gpu-8 systemd[1]: Failed to start LSB: Activates/Deactivates "
        "nv_peer_mem to \\ start at boot time..",
    ]
    assert kinds(*block) == ["peermem-einval-unexplained"]
    # and with the kernel's lines from journalctl -k of that second
    kernel = (
        "Nov 21 11:00:01 gpu-8 kernel: nv_peer_mem: disagrees about version of symbol "
        "ib_register_peer_memory_client"
    )
    assert kinds(*block, kernel) == ["peermem-abi-mismatch"]


DOCA_TRACE_HEAD = [
    "+ exec_cmd '/etc/init.d/openibd restart'",
    "+ debug_print 'Executing command: /etc/init.d/openibd restart'",
    "+ true",
    "+ timestamp_print Executing command: /etc/init.d/openibd restart",
    "++ date +%d-%b-%y_%H:%M:%S",
    "+ date_time_stamp=26-Sep-26_05:02:12",
    "[26-Sep-26_05:02:12] Executing command: /etc/init.d/openibd restart",
    "++ eval '/etc/init.d/openibd restart'",
    "+++ /etc/init.d/openibd restart",
]


def test_a_doca_entrypoint_trace_that_ends_without_its_success_line() -> None:
    doc = explain_lines([("mofed-container.log", DOCA_TRACE_HEAD)])
    (inc,) = doc["incidents"]
    assert inc["kind"] == "openibd-restart-failed"
    assert "cut mid-restart" in inc["notes"][0]
    failed = [*DOCA_TRACE_HEAD, "+ output='Unloading ib_core[FAILED]\r", "+ exit_code=1"]
    assert kinds(*failed) == ["openibd-restart-failed"]


def test_a_doca_entrypoint_trace_that_restarts_well_is_silent() -> None:
    ok = [
        *DOCA_TRACE_HEAD,
        "+ output='Unloading HCA driver:\x1b[60G[  \x1b[1;32mOK\x1b[0;39m  ]\r",
        "Loading HCA driver and Access Layer:\x1b[60G[  \x1b[1;32mOK\x1b[0;39m  ]\r'",
        "+ exit_code=0",
        "+ [[ 0 -ne 0 ]]",
        "[26-Sep-26_05:03:40] Setting driver ready state",
    ]
    assert kinds(*ok) == []
    # ofed-docker's bash -x, and openibd's own lines in colour, without a trace
    assert (
        kinds("+ /etc/init.d/openibd restart", "Loading HCA driver and Access Layer:[  OK  ]") == []
    )
    assert kinds("+ /etc/init.d/openibd restart") == ["openibd-restart-failed"]


# ---------------------------------------------------------------- correlation

EINVAL = "modprobe: ERROR: could not insert 'nvidia_peermem': Invalid argument"
CRC = "nvidia_peermem: disagrees about version of symbol ib_register_peer_memory_client"


def explain(*files: tuple[str, list[str]]) -> dict[str, Any]:
    return explain_lines(list(files))


def only(doc: dict[str, Any]) -> dict[str, Any]:
    (inc,) = doc["incidents"]
    return inc


def test_the_same_load_by_timestamp_across_files_is_an_abi_mismatch() -> None:
    doc = explain(
        ("driver.log", [f"2026-11-21T12:00:00.5Z {EINVAL}"]),
        ("dmesg-T.txt", ["noise"] * 50 + [f"[Fri Nov 21 12:00:01 2026] {CRC}"]),
    )
    inc = only(doc)
    assert inc["kind"] == "peermem-abi-mismatch"
    assert [e["file"] for e in inc["evidence"]] == ["driver.log", "dmesg-T.txt"]


def test_a_disagrees_line_of_another_time_is_not_this_load_s_reason() -> None:
    doc = explain(
        ("driver.log", [f"2026-11-21T12:00:00Z {EINVAL}"]),
        ("dmesg-T.txt", [f"[Fri Nov 21 09:14:00 2026] {CRC}"]),
    )
    assert [i["kind"] for i in doc["incidents"]] == [
        "peermem-abi-mismatch",  # the kernel's line is its own evidence, of an earlier load
        "peermem-einval-unexplained",
    ]


def test_an_invalid_argument_inside_mofed_s_restart_window_is_the_race() -> None:
    doc = explain(("mofed.log", MOFED), ("driver.log", [f"2026-11-21T11:52:10Z {EINVAL}"]))
    inc = only(doc)
    assert inc["kind"] == "peermem-load-race"
    assert [e["text"] for e in inc["evidence"]] == [
        EINVAL,
        "[21-Nov-26_11:51:06] Unsetting driver ready state",
    ]


def test_mid_restart_the_disagrees_lines_are_the_race_s_too() -> None:
    """Mid-restart the ib_core a load meets may be the inbox one (the real-kernel seeds)."""
    doc = explain(
        ("mofed.log", MOFED),
        ("driver.log", [f"2026-11-21T11:52:10Z {EINVAL}"]),
        ("dmesg", [f"[Fri Nov 21 11:52:10 2026] {CRC}"]),
    )
    assert only(doc)["kind"] == "peermem-load-race"


def test_after_the_restart_window_it_is_not_the_race() -> None:
    doc = explain(("mofed.log", MOFED), ("driver.log", [f"2026-11-21T12:30:00Z {EINVAL}"]))
    inc = only(doc)
    assert inc["kind"] == "peermem-einval-unexplained"
    assert "not at the time of this load" in inc["notes"][0]


def test_with_no_time_to_compare_a_restart_in_the_logs_is_taken_as_the_race() -> None:
    doc = explain(("mofed.log", MOFED), ("driver.log", ["Loading NVIDIA Peer Memory...", EINVAL]))
    inc = only(doc)
    assert inc["kind"] == "peermem-load-race" and "not on one clock" in inc["notes"][0]


def test_a_line_takes_its_file_s_last_time_only_nearby() -> None:
    near = [
        "time=2026-11-21T11:52:09Z level=info msg=Mellanox device found at 0000:01:00.0",
        EINVAL,
    ]
    assert kinds(*near) == ["peermem-einval-unexplained"]
    doc = explain(("mofed.log", MOFED), ("driver.log", near))
    assert only(doc)["kind"] == "peermem-load-race"
    far = [near[0], *["x"] * 30, EINVAL]  # past INHERIT_LINES: no time; race by presence
    doc = explain(("mofed.log", MOFED), ("driver.log", far))
    assert "not on one clock" in only(doc)["notes"][0]


def test_dmesg_seconds_since_boot_are_not_compared_with_wall_clock() -> None:
    doc = explain(
        ("driver.log", [f"2026-11-21T12:00:00Z {EINVAL}"]),
        ("dmesg.txt", ["x"] * 30 + [f"[  812.345678] {CRC}"]),
    )
    assert [i["kind"] for i in doc["incidents"]] == [
        "peermem-abi-mismatch",
        "peermem-einval-unexplained",
    ]


# ---------------------------------------------------------------- silence


@pytest.mark.parametrize("shape", SHAPES)
def test_the_unrelated_families_stay_silent_in_every_shape(shape: str) -> None:
    """With another vendor's module in use (issue 56): "in use" names openibd's incident
    only for a module of the RDMA stack, its storage or the GPU's."""
    assert kinds(*map(SHAPES[shape], UNRELATED + OTHER_IN_USE)) == []


def test_a_module_held_by_the_gpu_s_is_an_openibd_incident_whatever_its_name() -> None:
    held = "rmmod: ERROR: Module xyz_helper is in use by: nvidia_peermem"
    assert kinds(held) == ["openibd-module-in-use"]


def _typographic(line: str) -> str:
    """As a forum, a wiki or a word processor gives it back: curly quotes, dashes."""
    out, opened = [], False
    for ch in line:
        if ch == "'":
            out.append("\u2019" if opened else "\u2018")
            opened = not opened
        elif ch == '"':
            out.append("\u201d" if opened else "\u201c")
            opened = not opened
        else:
            out.append(ch)
    return "".join(out).replace(" - ", " \u2013 ")


TYPOGRAPHIC = [
    pytest.param(lines, kind, shape, id=f"{kind}:{lines[-1][:40]}:{shape}")
    for lines, kind in KERNEL_AND_KMOD + OPENIBD_AND_CONTAINERS
    if any("'" in line or '"' in line or " - " in line for line in lines)
    for shape in SHAPES
]


@pytest.mark.parametrize(("lines", "kind", "shape"), TYPOGRAPHIC)
def test_each_family_pasted_with_typographic_quotes(
    lines: list[str], kind: str, shape: str
) -> None:
    """Issue 56: logs pasted through forums turn 'nvidia_peermem' into ‘nvidia_peermem’;
    matched as ASCII, and the evidence quotes the line as written."""
    pasted = [SHAPES[shape](_typographic(line)) for line in lines]
    doc = explain_lines([("log", pasted)])
    assert [i["kind"] for i in doc["incidents"]] == [kind]
    quoted = [e["text"] for i in doc["incidents"] for e in i["evidence"]]
    assert any(ch in q for q in quoted for ch in "\u2018\u2019\u201c\u201d\u2013")


def test_kubectl_s_time_wins_over_a_dmesg_line_s_own() -> None:
    """A container that prints dmesg, read with --timestamps: the wall clock is kept."""
    doc = explain(
        ("driver.log", [f"2026-11-21T12:00:00Z {EINVAL}"]),
        ("peermem-ctr.log", ["x"] * 40 + [f"2026-11-21T12:00:01Z [  812.345678] {CRC}"]),
    )
    assert only(doc)["kind"] == "peermem-abi-mismatch"
