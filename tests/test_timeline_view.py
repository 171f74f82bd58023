"""``nodeagent timeline``: the recorded decisions as lanes, gate spans and VF bars."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from nodeagent.cli import main
from nodeagent.sim.scenarios import SCENARIOS, RunResult, run_scenario
from nodeagent.timeline_view import build_picture, render_html, render_text
from tests import chromium_setup

EPOCH = 1_795_000_000.0  # 2026-11-17: the sim's seed-seconds moved onto a real clock
_cache: dict[str, RunResult] = {}


def agent_records() -> list[dict[str, Any]]:
    """The real agent's records from the seed race (kernel-upgrade-race, with the agent)."""
    if "kur" not in _cache:
        _cache["kur"] = run_scenario(SCENARIOS["kernel-upgrade-race"], agent=True)
    return [{**r, "ts": EPOCH + r["ts"]} for r in _cache["kur"].agent_records]


def write_timeline(root: Path, records: list[dict[str, Any]], split: int | None = None) -> None:
    """Records as the agent writes them; ``split``: the older ones in the rotated ``.1``."""
    d = root / "var/lib/nodeagent"
    d.mkdir(parents=True, exist_ok=True)
    split = 0 if split is None else split
    lines = [json.dumps(r) + "\n" for r in records]
    if split:
        (d / "timeline.jsonl.1").write_text("".join(lines[:split]))
    (d / "timeline.jsonl").write_text("".join(lines[split:]))


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_text_draws_the_lanes_and_the_gate_spans_from_rotated_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = agent_records()
    write_timeline(tmp_path, records, split=len(records) // 2)
    code, out, _err = cli(capsys, "timeline", "--host-root", str(tmp_path))
    assert code == 0
    header = next(line for line in out.splitlines() if line.startswith("time"))
    assert all(lane in header for lane in ("MOFED", "GPU driver", "agent", "kernel"))
    assert "[ready]" in out and "[not ready]" in out  # MOFED's lane
    assert "[restarting openibd (blacklist" in out  # wrapped in its column
    mofed = build_picture(records).lane("MOFED")
    assert "restarting openibd (blacklist present)" in [s.label for s in mofed.segments]
    spans = out[out.index("gates:") : out.index("time ")]
    assert "peermem gate" in spans
    assert re.search(r"\d\d:\d\d:\d\d–\d\d:\d\d:\d\d \(\S+\) closed: ", spans)
    assert re.search(r"\(\S+\) open", spans)
    # The older half, in the rotated file, is read too: the picture starts at its first record.
    head = out.splitlines()[0]
    assert head.startswith(f"nodeagent timeline ({time.strftime('%Y-%m-%d', time.gmtime(EPOCH))}")
    assert f": {time.strftime('%H:%M:%S', time.gmtime(records[0]['ts']))} – " in head


def test_since_starts_the_picture_there(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = agent_records()
    ready = next(
        r["ts"] for r in records if r.get("kind") == "decision" and r.get("verdict") == "open"
    )
    write_timeline(tmp_path, records)
    code, out, _ = cli(capsys, "timeline", "--host-root", str(tmp_path), "--since", str(ready))
    assert code == 0
    assert "restarting openibd" not in out  # ended before --since
    assert "[ready]" in out  # holds at --since: starts there
    code, everything, _ = cli(capsys, "timeline", "--host-root", str(tmp_path), "--since", "1d")
    assert code == 0 and "restarting openibd" not in everything  # EPOCH is long ago


@pytest.mark.parametrize("since", ["yesterday", "10 minutes", "2026-13-01T00:00:00Z"])
def test_a_bad_since_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], since: str
) -> None:
    write_timeline(tmp_path, agent_records())
    code, out, err = cli(capsys, "timeline", "--host-root", str(tmp_path), "--since", since)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "--since" in err and repr(since) in err


def test_no_records_is_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _out, err = cli(capsys, "timeline", "--host-root", str(tmp_path))
    assert code == 1 and "no timeline records" in err


HOSTILE = '<script>alert("x")</script><img src="http://example.com/x.png">'


def hostile_records() -> list[dict[str, Any]]:
    """Strings from the node that try to be markup, and a VF that needed two tries."""
    t = EPOCH
    restore = "restore VF 3 (0000:01:00.5) of 0000:01:00.0"
    return [
        {"ts": t, "kind": "start", "mode": "enforce"},
        {
            "ts": t + 1,
            "kind": "decision",
            "guard": "peermem",
            "verdict": "closed",
            "reasons": [f"mlx5_core: {HOSTILE}"],
            "events": [HOSTILE],
            "kernel": "6.1.0-<b>",
            "evidence": {"mofed_mode": "container", "mofed_ready_flag": {"present": False}},
        },
        {
            "ts": t + 5,
            "kind": "action",
            "action": restore,
            "performed": True,
            "ok": False,
            "error": f"ENODEV {HOSTILE}",
            "kernel_messages": [HOSTILE],
        },
        {"ts": t + 9, "kind": "action", "action": restore, "performed": True, "ok": True},
        {"ts": t + 12, "kind": "decision", "guard": "peermem", "verdict": "open", "reasons": []},
    ]


def test_html_is_one_self_contained_file() -> None:
    page = render_html(build_picture(agent_records()), lambda t: f"{t:.0f}", "kernel-upgrade-race")
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "</svg>" in page
    lowered = page.lower()
    for needle in ("http://", "https://", "src=", "href=", "url(", "@import", "<script", "<link"):
        assert needle not in lowered, needle


def test_html_escapes_the_nodes_strings() -> None:
    pic = build_picture(hostile_records())
    page = render_html(pic, lambda t: f"{t - EPOCH:.0f}s", f"title {HOSTILE}")
    # A URL from the node is shown as text, never as an attribute that would fetch it.
    assert not re.search(r"<[^>]*\s(src|href)\s*=", page, re.IGNORECASE)
    assert "<script" not in page.lower() and "<img" not in page.lower()
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page
    assert "&lt;img src=&quot;http://example.com/x.png&quot;&gt;" in page
    assert "6.1.0-&lt;b&gt;" in page


def test_vf_restores_are_bars_from_first_attempt_to_success() -> None:
    pic = build_picture(hostile_records())
    (bar,) = pic.vfs
    assert (bar.pf, bar.index, bar.vf_pci) == ("0000:01:00.0", 3, "0000:01:00.5")
    assert (bar.start, bar.end, bar.ok, bar.attempts, bar.failures) == (
        EPOCH + 5,
        EPOCH + 9,
        True,
        2,
        1,
    )
    text = render_text(pic, lambda t: f"{t - EPOCH:05.0f}s")
    line = next(x for x in text.splitlines() if "VF3" in x)
    assert "ok, 2 attempt(s), 1 failed" in line and "█" in line
    assert "kmsg: <script>alert" in text  # markup is harmless on a terminal: shown as it was


def test_text_escapes_control_characters_from_the_node() -> None:
    records = hostile_records()
    records[1] = {**records[1], "reasons": ["mlx5_core: \x1b[2J\x1b]0;owned\x07 gone"]}
    text = render_text(build_picture(records), lambda t: f"{t - EPOCH:.0f}s")
    assert "\x1b" not in text and "\x07" not in text
    assert "\\x1b[2J" in text and "\\x07 gone" in text


def test_simulate_writes_one_html_timeline_per_scenario(tmp_path: Path) -> None:
    from nodeagent.sim.cli import simulate_main

    out = tmp_path / "pictures"
    argv = ["kernel-upgrade-race", "--speed", "0", "--json", "--timeline-html", str(out)]
    assert simulate_main(argv) == 0
    page = (out / "kernel-upgrade-race.html").read_text()
    assert "mode operator-peermem-dm09" in page and "peermem gate" in page
    assert "http" not in page


def test_html_draws_a_held_load_as_a_bar_in_the_gpu_driver_lane(tmp_path: Path) -> None:
    """The hold's run (seeds 000-002, the seeds' operator settings plus the hold): the
    driver container's modprobe, held mid-``openibd restart``, is a bar in the GPU driver
    lane from its hold to its release, naming the loader, the file and why it ended."""
    from nodeagent.sim.cli import simulate_main

    out = tmp_path / "pictures"
    argv = ["kernel-upgrade-race", "--speed", "0", "--json", "--timeline-html", str(out)]
    assert simulate_main([*argv, "--deployment-mode", "operator-peermem-dm09-hold"]) == 0
    page = (out / "kernel-upgrade-race.html").read_text()
    run = run_scenario(
        SCENARIOS["kernel-upgrade-race"], agent=True, mode="operator-peermem-dm09-hold"
    )
    (held,) = [r for r in run.agent_records if r.get("kind") == "held-open"]
    start, end = held["ts"] - held["seconds"], held["ts"]
    assert held["ended"] == "gate opened" and held["seconds"] > 60

    def attrs(tag: str) -> dict[str, str]:
        return dict(re.findall(r'([\w-]+)="([^"]*)"', tag))

    (bar_tag,) = re.findall(r'<rect class="held"[^>]*>', page)
    bar = attrs(bar_tag)
    title = re.search(r'<rect class="held"[^>]*><title>([^<]*)</title>', page)
    assert title is not None
    tip = title.group(1)
    assert held["path"] in tip and held["path"].endswith("nvidia-peermem.ko")
    assert f"{held['opener']} (pid {held['pid']})" in tip and "ended: gate opened" in tip
    # In the GPU driver lane: its data names it, and it lies inside that lane's box.
    assert bar["data-lane"] == "GPU driver"
    lanes = {
        attrs(t)["data-lane"]: attrs(t) for t in re.findall(r'<rect class="lanebox"[^>]*>', page)
    }
    box = lanes["GPU driver"]
    y, top = float(bar["y"]), float(box["y"])
    assert top <= y and y + float(bar["height"]) <= top + float(box["height"])
    assert not any(
        float(b["y"]) <= y < float(b["y"]) + float(b["height"])
        for name, b in lanes.items()
        if name != "GPU driver"
    )
    # From the moment it was held to the moment it was let go, by the records.
    assert float(bar["data-start"]) == pytest.approx(start, abs=1e-3)
    assert float(bar["data-end"]) == pytest.approx(end, abs=1e-3)
    pic = build_picture(run.agent_records, since=0.0, until=run.scenario.duration)
    span = (1400 - 150 - 20) / (pic.end - pic.start)
    assert float(bar["x"]) == pytest.approx(150 + (start - pic.start) * span, abs=0.1)
    assert float(bar["width"]) == pytest.approx((end - start) * span, abs=0.2)
    # The events table has its start, the text view its bar.
    assert "held: modprobe (pid" in page and "until 11:58:41: gate opened" in page
    text = render_text(pic, lambda t: f"{t:.0f}s")
    assert "held loads (1;" in text and "nvidia-peermem.ko: gate opened" in text


# -- in a real browser -------------------------------------------------------------


def _png_size_and_colours(data: bytes) -> tuple[int, int, int]:
    """Width, height and how many distinct byte values the image data has (a blank
    page compresses to a handful)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width, height = 8, b"", 0, 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    return width, height, len(set(zlib.decompress(idat)))


def test_html_timeline_renders_in_headless_chromium(tmp_path: Path) -> None:
    try:
        chromium = chromium_setup.ensure()
    except chromium_setup.SetupError as err:
        pytest.skip(f"headless Chromium unavailable: {err}")
    pic = build_picture(agent_records(), since=EPOCH)  # from the seed's t=0, as simulate draws it
    page = tmp_path / "timeline.html"
    page.write_text(render_html(pic, lambda t: f"{t - EPOCH:.0f}s", "kernel-upgrade-race"))
    shot = tmp_path / "timeline.png"
    argv = [
        chromium,
        *chromium_setup.FLAGS,
        f"--user-data-dir={tmp_path / 'profile'}",
        "--window-size=1440,900",
        f"--screenshot={shot}",
        page.as_uri(),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    width, height, colours = _png_size_and_colours(shot.read_bytes())
    assert (width, height) == (1440, 900)
    assert colours > 40, "the screenshot looks blank"
    dom = subprocess.run(
        [*argv[:-2], "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert dom.stdout.count("<rect") >= 10 and "peermem gate" in dom.stdout
    print(f"screenshot: {shot}")
