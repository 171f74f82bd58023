"""The shape the design promises: the decision code is pure and never reaches the host."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parent.parent / "nodeagent" / "core"
# Anything that could read a file, a clock, a socket or a process from the core.
FORBIDDEN = (
    "nodeagent.host",
    "nodeagent.agent",
    "nodeagent.sim",
    "nodeagent.cli",
    "os",
    "time",
    "datetime",
    "subprocess",
    "socket",
    "ctypes",
    "pathlib",
    "io",
    "shutil",
    "threading",
    "random",
    "select",
    "tempfile",
)


def imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_core_imports_nothing_that_does_io() -> None:
    files = sorted(CORE.glob("*.py"))
    assert len(files) >= 6
    for f in files:
        for name in imports(f):
            bad = [x for x in FORBIDDEN if name == x or name.startswith(x + ".")]
            assert not bad, f"{f.name} imports {name}: the core must stay pure"


def test_core_calls_no_open() -> None:
    for f in sorted(CORE.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in ("open", "print", "input"), f"{f.name}: {node.func.id}()"
