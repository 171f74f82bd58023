"""scripts/image.sh's arguments: a bad REGISTRY/REPO or platform refused before anything runs;
--dry-run prints the buildah commands and the helm line that pins the digest."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

# Where arm64 can be built, an arm64-only list is not refused.
ARM64 = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64").exists() or os.uname().machine == "aarch64"
SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "image.sh"


def image_sh(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "args",
    [
        ["--push", "Reg/Upper"],
        ["--push", "reg.example/repo:tag"],
        ["--push", "reg.example/repo;rm -rf /"],
        ["--push", "nodeagent"],
        ["--push"],
        ["--platform", "linux/s390x"],
        ["--what"],
        ["--platform", "linux/arm64"] if not ARM64 else ["--platform", "linux/s390x"],
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(args: list[str]) -> None:
    result = image_sh(*args, "--dry-run")
    assert result.returncode == 2
    assert "buildah" not in result.stdout
    assert result.stderr.startswith("image.sh: ")


def test_the_dry_run_builds_pushes_and_prints_the_pinning_line() -> None:
    result = image_sh("--push", "reg.example:5000/gpu/nodeagent", "--dry-run")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "buildah manifest create reg.example:5000/gpu/nodeagent:0.1.0 "
    assert "--platform linux/amd64" in lines[1]
    assert lines[-1] == (
        "helm install nodeagent deploy/helm/nodeagent -n nodeagent"
        " --set image.repository=reg.example:5000/gpu/nodeagent --set image.digest=sha256:DIGEST"
    )
