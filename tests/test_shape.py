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


HOST = CORE.parent / "host"


def guard_modules() -> set[str]:
    from nodeagent.core.registry import GUARDS

    return {e.build.__module__ for e in GUARDS} | {"nodeagent.core.registry"}


def test_the_host_layer_never_imports_a_guard() -> None:
    guards = guard_modules()
    files = sorted(HOST.glob("*.py"))
    assert len(files) >= 8
    for f in files:
        for name in imports(f):
            assert name not in guards, f"host/{f.name} imports {name}: the host never decides"


def test_guards_never_import_each_other() -> None:
    guards = guard_modules() - {"nodeagent.core.registry"}
    assert len(guards) >= 1
    for mod in guards:
        path = CORE / (mod.rsplit(".", 1)[-1] + ".py")
        others = guards - {mod}
        for name in imports(path):
            assert name not in others, f"{path.name} imports the guard {name}"
            assert name != "nodeagent.core.registry", f"{path.name} imports the guard list"


def test_the_loop_never_runs_or_joins_a_plan_itself() -> None:
    """agent.py hands plans to host/worker.py; it never runs one in its own thread."""
    agent = CORE.parent / "agent.py"
    called = {
        node.func.attr
        for node in ast.walk(ast.parse(agent.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }
    assert "submit" in called  # the plans go to the workers
    banned = called & {"run_plan", "run_plans", "join", "perform"}
    assert not banned, f"agent.py calls {banned}: plans run in the workers"
