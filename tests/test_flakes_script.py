"""``scripts/flakes.sh`` run as a developer runs it: a flaky test is found, the
pressure it starts is gone when it ends, and its table counts each run."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

from tests.flaketable import case_id, main, tally

REPO = Path(__file__).resolve().parent.parent

FLAKY = """
from pathlib import Path

COUNT = Path(__file__).with_name("count")


def test_steady():
    assert True


def test_every_other_run():
    n = int(COUNT.read_text()) if COUNT.exists() else 0
    COUNT.write_text(str(n + 1))
    assert n % 2 == 1
"""


def _processes_with(token: str) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if token.encode() in (d / "environ").read_bytes():
                found.append(int(d.name))
        except OSError:
            continue
    return found


def test_the_script_finds_a_flaky_test_and_stops_its_pressure(tmp_path: Path) -> None:
    tests = tmp_path / "t"
    tests.mkdir()
    (tests / "test_sample.py").write_text(FLAKY)
    token = f"FLAKES_TEST_TOKEN={uuid.uuid4()}"
    env = {
        **os.environ,
        "FLAKES_DIR": str(tmp_path / "out"),
        "FLAKES_BUSY_PER_CORE": "1",  # the pressure, lighter on the suite around it
        token.split("=")[0]: token,
    }
    p = subprocess.run(
        ["bash", str(REPO / "scripts/flakes.sh"), "2", str(tests)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"pressure: {len(os.sched_getaffinity(0))} busy processes" in p.stdout
    assert "1/2 passed" in p.stdout and "test_every_other_run" in p.stdout
    assert "1 of 2 tests passed (or skipped) in all 2 runs" in p.stdout
    table = (tmp_path / "out" / "table.txt").read_text().splitlines()
    assert table[0].startswith("1/2 passed") and "test_every_other_run" in table[0]
    assert table[1].startswith("2/2 passed") and "test_steady" in table[1]
    assert _processes_with(token) == []  # the busy processes went with the script


def _junit(path: Path, cases: list[tuple[str, str, str | None]]) -> None:
    body = "".join(
        f'<testcase classname="{c}" name="{n}">{f"<{o}/>" if o else ""}</testcase>'
        for c, n, o in cases
    )
    path.write_text(f'<testsuites><testsuite name="pytest">{body}</testsuite></testsuites>')


def test_the_table_counts_passes_skips_failures_and_missing_runs(tmp_path: Path) -> None:
    _junit(
        tmp_path / "run-1.xml",
        [("tests.test_a", "test_x", None), ("tests.test_a.TestK", "test_y[1]", "skipped")],
    )
    _junit(tmp_path / "run-2.xml", [("tests.test_a", "test_x", "failure")])
    (tmp_path / "run-3.xml").write_text("<testsuites><testsuite")  # a run cut short
    t = tally(tmp_path, 3)
    assert t.worst_first() == [
        ("tests/test_a.py::TestK::test_y[1]", 0, 1),
        ("tests/test_a.py::test_x", 1, 0),
    ]
    assert len(t.unreadable) == 1 and "run-3.xml" in t.unreadable[0]
    assert main([str(tmp_path), "3"]) == 1
    assert main([str(tmp_path), "x"]) == 2


def test_a_clean_hunt_exits_zero(tmp_path: Path) -> None:
    for i in (1, 2):
        _junit(tmp_path / f"run-{i}.xml", [("tests.test_a", "test_x", None)])
    assert main([str(tmp_path), "2"]) == 0
    assert (
        tmp_path / "table.txt"
    ).read_text() == "2/2 passed, 0 skipped  tests/test_a.py::test_x\n"


def test_case_ids_read_as_pytest_node_ids() -> None:
    import xml.etree.ElementTree as ET

    case = ET.fromstring('<testcase classname="tests.realkernel.test_k.TestA" name="t[a-b]"/>')
    assert case_id(case) == "tests/realkernel/test_k.py::TestA::t[a-b]"
