"""The table ``scripts/flakes.sh`` ends with: how many runs each test passed, worst first.

``python -m tests.flaketable DIR N`` reads ``DIR/run-*.xml`` (pytest's JUnit XML).
A test counts as passed in a run when its case has no failure or error; a
skipped one is counted apart; a test missing from a run (the run was cut, or
did not collect it) counts as not passed there. Exit 1 when any test failed.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Tally:
    runs: int
    passed: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    unreadable: list[str] = field(default_factory=list)

    def tests(self) -> set[str]:
        return set(self.passed) | set(self.skipped) | set(self.failed)

    def worst_first(self) -> list[tuple[str, int, int]]:
        """(test, passed, skipped) for every test, fewest passes (skips aside) first."""
        rows = [(t, self.passed[t], self.skipped[t]) for t in self.tests()]
        return sorted(rows, key=lambda r: (r[1] + r[2], r[0]))

    def flaky(self) -> list[tuple[str, int, int]]:
        return [r for r in self.worst_first() if r[1] + r[2] < self.runs]


def case_id(case: ET.Element) -> str:
    cls, name = case.get("classname", ""), case.get("name", "")
    parts = cls.split(".")
    # pytest writes tests.test_x.Class for tests/test_x.py::Class
    path = [p for p in parts if p[:1].islower()]
    rest = parts[len(path) :]
    return "::".join(["/".join(path) + ".py", *rest, name]) if path else f"{cls}::{name}"


def tally(directory: Path, runs: int) -> Tally:
    t = Tally(runs)
    for xml in sorted(directory.glob("run-*.xml")):
        try:
            root = ET.parse(xml).getroot()
        except (ET.ParseError, OSError) as exc:
            t.unreadable.append(f"{xml}: {exc}")
            continue
        for case in root.iter("testcase"):
            test = case_id(case)
            if case.find("failure") is not None or case.find("error") is not None:
                t.failed[test] += 1
            elif case.find("skipped") is not None:
                t.skipped[test] += 1
            else:
                t.passed[test] += 1
    return t


def report(t: Tally) -> list[str]:
    lines = [
        f"{p}/{t.runs} passed{f' ({s} skipped)' if s else ''}  {test}" for test, p, s in t.flaky()
    ]
    lines += [f"unreadable: {u}" for u in t.unreadable]
    perfect = len(t.tests()) - len(t.flaky())
    lines.append(f"{perfect} of {len(t.tests())} tests passed (or skipped) in all {t.runs} runs")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: python -m tests.flaketable DIR RUNS", file=sys.stderr)
        return 2
    directory, runs = Path(argv[0]), int(argv[1])
    t = tally(directory, runs)
    table = [f"{p}/{runs} passed, {s} skipped  {test}" for test, p, s in t.worst_first()]
    (directory / "table.txt").write_text("\n".join(table) + "\n")
    print("\n".join(report(t)))
    print(f"full table: {directory / 'table.txt'}")
    return 1 if t.flaky() or t.unreadable or not t.tests() else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
