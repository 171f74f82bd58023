"""The installed ``kubectl-nodeagent`` (the package's console script) against a fake kubectl on
PATH that records its argv and answers with a canned pod list: the exact argv it runs, names
refused before kubectl is called, and ``explain`` run here on a bundle with no kubectl at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Installed next to the interpreter by `pip install` (pyproject's [project.scripts]).
PLUGIN = Path(sys.executable).parent / "kubectl-nodeagent"
SEEDS = Path(__file__).resolve().parent.parent.parent / "shared" / "seeds"
PODS = {
    "items": [
        {"metadata": {"name": "nodeagent-abcde"}, "status": {"phase": "Running"}},
        {"metadata": {"name": "nodeagent-old"}, "status": {"phase": "Succeeded"}},
    ]
}
FAKE_KUBECTL = """#!{python}
import json, os, sys
with open(os.environ["ARGV_LOG"], "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
if sys.argv[1] == "get":
    sys.stdout.write(os.environ["PODS"])
"""


def plugin(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], list[list[str]]]:
    fake = tmp_path / "kubectl"
    fake.write_text(FAKE_KUBECTL.format(python=sys.executable))
    fake.chmod(0o755)
    log = tmp_path / "argv.log"
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "ARGV_LOG": str(log)}
    env["PODS"] = json.dumps(PODS)
    result = subprocess.run(
        [str(PLUGIN), *args], capture_output=True, text=True, env=env, timeout=60
    )
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return result, calls


def test_it_is_installed_with_the_package() -> None:
    assert PLUGIN.is_file() and os.access(PLUGIN, os.X_OK), f"{PLUGIN} (pip install -e .)"


def test_help_names_every_command(tmp_path: Path) -> None:
    result, calls = plugin(tmp_path, "--help")
    assert result.returncode == 0
    assert all(c in result.stdout for c in ("status", "timeline", "explain BUNDLE"))
    assert calls == []


@pytest.mark.parametrize("command", ["status", "timeline"])
def test_it_execs_the_agents_cli_in_the_pod_on_the_node(tmp_path: Path, command: str) -> None:
    result, calls = plugin(tmp_path, command, "gpu-node-7.example")
    assert result.returncode == 0, result.stderr
    assert calls == [
        [
            "get", "pods", "-n", "nodeagent", "-l", "app.kubernetes.io/name=nodeagent",
            "--field-selector", "spec.nodeName=gpu-node-7.example", "-o", "json",
        ],
        [
            "exec", "-n", "nodeagent", "nodeagent-abcde", "-c", "nodeagent", "--",
            "nodeagent", command,
        ],
    ]  # fmt: skip


def test_the_namespace_and_extra_arguments_are_passed_as_argv(tmp_path: Path) -> None:
    result, calls = plugin(tmp_path, "status", "n1", "-n", "gpu-ops", "--", "--json")
    assert result.returncode == 0, result.stderr
    assert calls[0][3] == "gpu-ops"
    assert calls[1] == [
        "exec", "-n", "gpu-ops", "nodeagent-abcde", "-c", "nodeagent", "--",
        "nodeagent", "status", "--json",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "args",
    [
        ["status", "Node1"],
        ["status", "n1;rm -rf /"],
        ["status", "-n1"],
        ["status", "x" * 254],
        ["status", "n1", "-n", "a.b"],
        ["logs", "n1"],
        ["timeline", "n1", "n2"],
        ["status"],
    ],
)
def test_bad_names_are_refused_before_kubectl_is_called(tmp_path: Path, args: list[str]) -> None:
    result, calls = plugin(tmp_path, *args)
    assert result.returncode == 2
    assert calls == []


def test_explain_reads_a_bundle_here_with_no_kubectl(tmp_path: Path) -> None:
    """A must-gather saved on a laptop: the driver pod's log names the race, no cluster."""
    from tests.explain.bundles import by_node, gpu_must_gather, tar, write

    bundle = tar(write(tmp_path / "must-gather", gpu_must_gather()), tmp_path / "mg.tar.gz")
    result, calls = plugin(tmp_path, "explain", str(bundle), "--", "--json")
    assert result.returncode == 0, result.stderr
    assert calls == []
    doc = json.loads(result.stdout)
    assert by_node(doc) == {"gpu-1": ["peermem-load-race"], "gpu-2": ["peermem-abi-mismatch"]}
