#!/usr/bin/env python3
"""Run ``nodeagent explain`` on a corpus of real log excerpts and score it.

Each ``*.log`` in DIR starts with comment lines: ``# source: <where it was
copied from>``, ``# expect: <kind>`` (``none`` for a log that must stay
silent, ``unclear`` for one scored by nobody), and optionally ``# note: ...``;
the rest is the excerpt as its report shows it. A file is named right when the
expected kind is among the incidents (``none``: when there are none). Prints a
line per file and the score; exit 1 when a definite expectation is missed.
Kinds with another name in an older corpus are mapped with ``--alias OLD=NEW``.

    .venv/bin/python scripts/explain_corpus.py DIR [--alias openibd-failed=openibd-restart-failed]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HEADER = re.compile(r"^# (source|expect|note): ?(.*)$")


def read(path: Path) -> tuple[dict[str, str], str]:
    head: dict[str, str] = {}
    lines = path.read_text(errors="replace").splitlines(keepends=True)
    n = 0
    while n < len(lines) and n < 3:
        m = HEADER.match(lines[n].rstrip("\n"))
        if not m:
            break
        head[m.group(1)] = m.group(2).strip()
        n += 1
    return head, "".join(lines[n:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--alias", action="append", default=[], metavar="OLD=NEW")
    args = ap.parse_args(argv)
    alias = dict(a.split("=", 1) for a in args.alias)
    right = wrong = 0
    with tempfile.TemporaryDirectory() as tmp:
        for path in sorted(args.dir.glob("*.log")):
            head, body = read(path)
            expect = alias.get(head.get("expect", "unclear"), head.get("expect", "unclear"))
            excerpt = Path(tmp) / path.name
            excerpt.write_text(body)
            p = subprocess.run(
                [sys.executable, "-m", "nodeagent", "explain", "--json", str(excerpt)],
                capture_output=True,
                text=True,
                check=True,
            )
            kinds = [i["kind"] for i in json.loads(p.stdout)["incidents"]]
            if expect == "unclear":
                mark = "--"
            elif (expect == "none" and not kinds) or expect in kinds:
                mark, right = "ok", right + 1
            else:
                mark, wrong = "XX", wrong + 1
            print(f"{mark} {path.name}: expect {expect}, got {', '.join(kinds) or 'nothing'}")
    print(f"{right} of {right + wrong} named right ({wrong} wrong; unclear ones not scored)")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
