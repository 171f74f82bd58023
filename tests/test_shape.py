"""The shape the design promises: the decision code is pure and never reaches the host."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

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


EXPLAIN = CORE.parent / "explain"
# explain's files that read: the bundle walk and the log files; the rest is pure.
EXPLAIN_READERS = ("walk.py", "files.py")


def declared_pure(wing: Path) -> list[Path]:
    """The files a wing's ``__init__.py`` declares pure (``PURE_FILES``, a tuple of file
    names; none if it declares nothing), each asserted to exist."""
    for node in ast.parse((wing / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == [
            "PURE_FILES"
        ]:
            files = [wing / name for name in ast.literal_eval(node.value)]
            missing = [str(f) for f in files if not f.is_file()]
            assert not missing, f"{wing.name} declares pure files it does not have: {missing}"
            return files
    return []


def pure_files() -> list[Path]:
    """core/, explain's matcher, tables and rules, and the files each wing declares pure:
    held to one import ban."""
    explain = [f for f in EXPLAIN.glob("*.py") if f.name not in EXPLAIN_READERS]
    guards = CORE.parent / "guards"
    wings = [f for d in sorted(guards.iterdir()) if d.is_dir() for f in declared_pure(d)]
    return sorted(CORE.glob("*.py")) + sorted(explain) + wings


def impure_imports(path: Path) -> list[str]:
    """What ``path`` imports that could do I/O (the ban)."""
    return [
        name
        for name in imports(path)
        if any(name == x or name.startswith(x + ".") for x in FORBIDDEN)
    ]


def test_a_wing_declares_its_pure_files(tmp_path: Path) -> None:
    peermem = CORE.parent / "guards" / "peermem"
    assert [f.name for f in declared_pure(peermem)] == ["telemetry.py", "reports.py"]
    assert peermem / "telemetry.py" in pure_files()
    (tmp_path / "__init__.py").write_text('"""a wing"""\nPURE_FILES = ("here.py", "gone.py")\n')
    (tmp_path / "here.py").write_text("import os\n")
    with pytest.raises(AssertionError, match=r"gone\.py"):
        declared_pure(tmp_path)
    (tmp_path / "__init__.py").write_text('PURE_FILES = ("here.py",)\n')
    assert impure_imports(declared_pure(tmp_path)[0]) == ["os"]  # and the ban sees it


def test_core_imports_nothing_that_does_io() -> None:
    files = pure_files()
    assert len(files) >= 12 and EXPLAIN / "matcher.py" in files
    assert all(f.is_file() for f in files)
    for f in files:
        bad = impure_imports(f)
        assert not bad, f"{f.relative_to(CORE.parent)} imports {bad}: it must stay pure"


def test_the_ban_finds_an_import_that_does_io(tmp_path: Path) -> None:
    leaky = tmp_path / "leaky.py"
    leaky.write_text("import re\nfrom os import path\nimport nodeagent.host.fs\n")
    assert impure_imports(leaky) == ["os", "nodeagent.host.fs"]


def test_core_calls_no_open() -> None:
    for f in pure_files():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in ("open", "print", "input"), f"{f.name}: {node.func.id}()"


HOST = CORE.parent / "host"


def guard_modules() -> set[str]:
    from nodeagent.guards.registry import GUARDS

    return {e.build.__module__ for e in GUARDS} | {"nodeagent.guards.registry"}


def test_the_host_layer_never_imports_a_guard() -> None:
    guards = guard_modules()
    files = sorted(HOST.glob("*.py"))
    assert len(files) >= 8
    for f in files:
        for name in imports(f):
            assert name not in guards, f"host/{f.name} imports {name}: the host never decides"


def test_guards_never_import_each_other() -> None:
    guards = guard_modules() - {"nodeagent.guards.registry"}
    assert len(guards) >= 1
    for mod in guards:
        path = CORE / (mod.rsplit(".", 1)[-1] + ".py")
        others = guards - {mod}
        for name in imports(path):
            assert name not in others, f"{path.name} imports the guard {name}"
            assert name != "nodeagent.guards.registry", f"{path.name} imports the guard list"


LOOP = CORE.parent / "loop"


def test_the_loop_never_runs_or_joins_a_plan_itself() -> None:
    """The loop hands plans to loop/workers.py; it never runs one in its own thread."""
    called_in: dict[str, set[str]] = {}
    for f in sorted(LOOP.glob("*.py")):
        if f.name == "workers.py":
            continue
        called_in[f.name] = {
            node.func.attr
            for node in ast.walk(ast.parse(f.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        }
    assert "submit" in called_in["passes.py"]  # the plans go to the workers
    for name, called in called_in.items():
        banned = called & {"run_plan", "run_plans", "join", "perform"}
        assert not banned, f"loop/{name} calls {banned}: plans run in the workers"


PACKAGE = CORE.parent


def module_files() -> dict[str, Path]:
    """Every module of nodeagent/ by its dotted name (a package by its __init__)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Who imports whom inside nodeagent/, counting every import: at the top, inside a
    function, under ``TYPE_CHECKING``. ``from a import b`` names a.b when b is a module."""
    modules = module_files()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                assert node.level == 0, f"{path}: a relative import (the graph reads absolute ones)"
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    targets.add(sub if sub in modules else node.module)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    # The real graph sees imports inside functions: wiring.py imports the run loop only
    # inside build_agent (and under TYPE_CHECKING), so that ``check`` never loads it.
    graph = import_graph()
    assert "nodeagent.loop.agent" in graph["nodeagent.loop.wiring"]


def test_no_import_cycle_anywhere_in_nodeagent() -> None:
    graph = import_graph()
    assert len(graph) > 50
    assert cycles(graph) == []


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else module


def test_the_layers_point_one_way() -> None:
    """core <- host <- guards <- loop: the loop may import the guards' host sides, the host
    layer and the core; none of those imports the loop, and the host and core never import
    the guards' list or their host sides."""
    graph = import_graph()
    below_loop = {"core", "host", "guards"}
    checked = 0
    for module, targets in graph.items():
        layer = layer_of(module)
        for t in targets:
            if layer in below_loop:
                assert layer_of(t) != "loop", f"{module} imports {t}: the loop is above it"
                assert t != "nodeagent.agent", f"{module} imports the agent"
            if layer in {"core", "host"}:
                assert layer_of(t) != "guards", f"{module} imports {t}: guards plug into the loop"
            checked += 1
    assert checked > 100


EXPORTERS = ("nodeagent.metrics", "nodeagent.metrics_server", "nodeagent.journal")


def test_exporters_never_import_the_loop() -> None:
    """An exporter reads records and pass results; it never reaches into the loop."""
    graph = import_graph()
    for module in EXPORTERS:
        for t in graph[module]:
            assert layer_of(t) != "loop" and t != "nodeagent.agent", f"{module} imports {t}"


def test_no_file_of_the_loop_is_over_500_lines() -> None:
    sizes = {f.name: len(f.read_text().splitlines()) for f in LOOP.glob("*.py")}
    assert {"agent.py", "passes.py", "wiring.py", "workers.py"} <= set(sizes)
    assert max(sizes.values()) <= 500, sizes


def test_the_loop_names_no_guard() -> None:
    """Every guard plugs in through its registry entry; no file of loop/ knows one by name."""
    from nodeagent.guards.registry import GUARDS

    names = [e.name for e in GUARDS]
    for f in sorted(LOOP.glob("*.py")):
        text = f.read_text()
        for name in names:
            assert f'"{name}"' not in text and f"'{name}'" not in text, f"loop/{f.name}: {name}"
        for module in guard_modules() - {"nodeagent.guards.registry"}:
            assert module not in imports(f), f"loop/{f.name} imports {module}"


def explain_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Arrows that break explain's place: it reads logs, not the node, so it imports no
    layer of the agent but core; and only the command line imports it."""
    bad = []
    for module, targets in graph.items():
        for t in targets:
            if layer_of(module) == "explain" and layer_of(t) not in ("explain", "core"):
                bad.append(f"{module} -> {t}")
            if (
                layer_of(t) == "explain"
                and layer_of(module) != "explain"
                and module != ("nodeagent.cli")
            ):
                bad.append(f"{module} -> {t}")
    return sorted(bad)


def test_explain_stands_apart() -> None:
    graph = import_graph()
    assert "nodeagent.explain.files" in graph["nodeagent.cli"]
    assert explain_arrows(graph) == []


def test_the_explain_check_finds_both_wrong_arrows() -> None:
    graph = {
        "nodeagent.explain.walk": {"nodeagent.host.fs"},
        "nodeagent.loop.agent": {"nodeagent.explain.matcher"},
        "nodeagent.cli": {"nodeagent.explain.files"},
        "nodeagent.explain.files": {"nodeagent.explain.walk", "nodeagent.core.names"},
    }
    assert explain_arrows(graph) == [
        "nodeagent.explain.walk -> nodeagent.host.fs",
        "nodeagent.loop.agent -> nodeagent.explain.matcher",
    ]


GUARDS_DIR = CORE.parent / "guards"
# What a wing may import besides itself: the side contract, the host layer, the core.
WING_MAY_IMPORT = (
    "nodeagent.guards.side",
    "nodeagent.errors",
    "nodeagent",
)  # (the package: its path)


def wing_of(module: str) -> str | None:
    """``nodeagent.guards.<wing>`` for a module of a guard's wing (a folder under
    guards/), else None."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] == "guards" and (GUARDS_DIR / parts[2]).is_dir():
        return ".".join(parts[:3])
    return None


def wing_arrows(graph: dict[str, set[str]], wing: Callable[[str], str | None]) -> list[str]:
    """Arrows that break a wing's walls: a wing imports only itself, the side contract,
    host/ and core/ (so no other wing); only the registry and the simulator import one."""
    bad = []
    for module, targets in graph.items():
        mine = wing(module)
        for t in targets:
            theirs = wing(t)
            leaves = mine and theirs != mine and t not in WING_MAY_IMPORT
            if leaves and layer_of(t) not in ("host", "core"):
                bad.append(f"{module} -> {t}")
            if (
                theirs
                and theirs != mine
                and not (module == "nodeagent.guards.registry" or layer_of(module) == "sim")
            ):
                bad.append(f"{module} -> {t}")
    return sorted(bad)


def test_a_wing_keeps_to_itself() -> None:
    graph = import_graph()
    wings = {w for m in graph if (w := wing_of(m))}
    assert "nodeagent.guards.sriov" in wings
    assert wing_arrows(graph, wing_of) == []


def test_the_wing_check_finds_each_wrong_arrow() -> None:
    def wing(module: str) -> str | None:
        parts = module.split(".")
        return (
            ".".join(parts[:3]) if parts[:2] == ["nodeagent", "guards"] and len(parts) > 3 else None
        )

    graph = {
        "nodeagent.guards.a.side": {"nodeagent.guards.b.act", "nodeagent.host.fs"},
        "nodeagent.guards.b.act": {"nodeagent.loop.passes", "nodeagent.core.sriov"},
        "nodeagent.loop.wiring": {"nodeagent.guards.a.side"},
        "nodeagent.guards.registry": {"nodeagent.guards.a.side"},
        "nodeagent.sim.harness": {"nodeagent.guards.b.act"},
    }
    assert wing_arrows(graph, wing) == [
        "nodeagent.guards.a.side -> nodeagent.guards.b.act",
        "nodeagent.guards.a.side -> nodeagent.guards.b.act",
        "nodeagent.guards.b.act -> nodeagent.loop.passes",
        "nodeagent.loop.wiring -> nodeagent.guards.a.side",
    ]


def test_no_file_of_a_wing_is_over_500_lines() -> None:
    files = [f for d in GUARDS_DIR.iterdir() if d.is_dir() for f in d.glob("*.py")]
    assert len(files) >= 4
    sizes = {str(f.relative_to(GUARDS_DIR)): len(f.read_text().splitlines()) for f in files}
    assert max(sizes.values()) <= 500, sizes


def test_the_host_layer_has_at_most_20_files() -> None:
    """Kernel primitives, the agent's own files, observation, actions: what a guard owns
    lives in its wing."""
    files = sorted(f.name for f in HOST.glob("*.py"))
    assert len(files) <= 20, files


BLOCKED_IMPORT = """
import importlib.abc, sys
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in sys.argv[2:]:
            raise ImportError(f"{name} is not importable here")
sys.meta_path.insert(0, Blocked())
import importlib
importlib.import_module(sys.argv[1])
"""


def import_without(module: str, *libraries: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKED_IMPORT, module, *libraries],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_the_loop_imports_without_the_exporters_libraries() -> None:
    """loop/ imports no exporter library at import time: a pass needs neither."""
    p = import_without("nodeagent.loop.passes", "prometheus_client", "psutil")
    assert p.returncode == 0, p.stderr


def test_the_import_check_sees_a_library_imported() -> None:
    p = import_without("nodeagent.metrics", "prometheus_client", "psutil")
    assert p.returncode == 1 and "is not importable here" in p.stderr


# -- the tests mirror the code ---------------------------------------------------------

TESTS = Path(__file__).resolve().parent


def borrowed_from_test_files(path: Path, root: Path = TESTS) -> list[str]:
    """What ``path`` takes from a test file (``test_*.py``) but its tests: a test file
    shares nothing else. What files share is a helper module or a folder's conftest.py;
    a test imported to run again elsewhere (the real-kernel suite does) is allowed."""
    inside = path.is_relative_to(root)  # a bench: no relative import
    package = ["tests", *path.relative_to(root).parent.parts] if inside else []
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            bad += [a.name for a in node.names if a.name.split(".")[-1].startswith("test_")]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = [*base, *(node.module.split(".") if node.module else [])]
            folder = root.joinpath(*module[1:])
            for a in node.names:
                a_test = a.name.startswith("test_")
                helper = module[-1].startswith("test_") and not a_test
                whole_file = a_test and (folder / f"{a.name}.py").is_file()
                if helper or whole_file:
                    bad.append(f"{'.'.join(module)}.{a.name}")
    return bad


def test_no_test_file_lends_its_helpers() -> None:
    """Neither to another test file nor to a bench (a bench runs what tests assert on:
    a replay, a trial, a flood, from the helper module that holds it)."""
    files = sorted(TESTS.rglob("*.py")) + sorted((TESTS.parent / "bench").glob("*.py"))
    assert len(files) > 100
    lent = {
        str(f.relative_to(TESTS.parent)): b for f in files if (b := borrowed_from_test_files(f))
    }
    assert lent == {}


def test_the_lending_check_finds_each_way_of_borrowing(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "test_a.py").write_text("def helper(): ...\ndef test_x(): ...\n")
    borrower = tmp_path / "sub" / "test_b.py"
    borrower.write_text(
        "from tests.sub.test_a import helper, test_x\n"  # helper: no; a test to rerun: yes
        "from .test_a import helper as h\n"
        "from tests.sub import test_a\n"
        "import tests.sub.test_a\n"
    )
    assert borrowed_from_test_files(borrower, tmp_path) == [
        "tests.sub.test_a.helper",
        "tests.sub.test_a.helper",
        "tests.sub.test_a",
        "tests.sub.test_a",
    ]
