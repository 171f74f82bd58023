"""scripts/image.sh: a bad REGISTRY/REPO, platform or base refused before anything runs;
--dry-run prints the buildah commands and the helm line that pins the digest; and a real run
here (the base bootstrapped as tests/image_setup.py does: no base registry is reachable)
builds the image, writes its OCI layout, the digest and the SBOM."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.chromium_setup import SetupError
from tests.image_setup import BASE, CA_BUNDLE, base, tools

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
        ["--base", "debian:bookworm;id"],
        ["--base", "Debian"],
        ["--pip-ca", "/nonexistent/ca.pem"],
        ["--out", "--dry-run"],
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
    assert "--build-arg BASE_IMAGE=debian:bookworm-slim" in lines[1]
    assert any("--target sbom --output type=local\\,dest=build/image" in line for line in lines)
    assert any(
        line.startswith("buildah manifest push --all --digestfile build/image/digest ")
        and line.rstrip().endswith("docker://reg.example:5000/gpu/nodeagent:0.1.0")
        for line in lines
    )
    assert lines[-1] == (
        "helm install nodeagent deploy/helm/nodeagent -n nodeagent"
        " --set image.repository=reg.example:5000/gpu/nodeagent --set image.digest=sha256:DIGEST"
    )


def test_a_run_here_builds_the_image_and_writes_its_digest_and_sbom(tmp_path: Path) -> None:
    """What the README's first step does, on this machine: no push, so the manifest list goes
    to an OCI layout whose index names the digest printed; the SBOM lists the image's venv."""
    try:
        tools()
        base()
    except SetupError as err:
        pytest.skip(f"the image cannot be built here: {err}")
    out = tmp_path / "out"
    ca = ["--pip-ca", str(CA_BUNDLE)] if CA_BUNDLE.is_file() else []
    result = subprocess.run(
        [str(SCRIPT), "--base", BASE, *ca, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    printed = re.search(r"^digest: (sha256:[0-9a-f]{64})$", result.stdout, re.M)
    assert printed, result.stdout[-2000:]
    digest = printed.group(1)
    assert (out / "digest").read_text().strip() == digest
    index = json.loads((out / "oci" / "index.json").read_text())
    assert [m["digest"] for m in index["manifests"]] == [digest]
    manifest_list = json.loads((out / "oci" / "blobs" / "sha256" / digest[7:]).read_text())
    platforms = [m["platform"]["architecture"] for m in manifest_list["manifests"]]
    assert platforms == ["amd64"]

    sbom = json.loads((out / "sbom.cdx.json").read_text())
    assert sbom["bomFormat"] == "CycloneDX"
    assert sbom["metadata"]["component"]["name"] == "nodeagent"
    declared = tomllib.loads((SCRIPT.parent.parent / "pyproject.toml").read_text())
    wanted = {re.split(r"[<>=!~ ]", d)[0] for d in declared["project"]["dependencies"]}

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    assert {norm(c["name"]) for c in sbom["components"]} == {norm(n) for n in wanted}
    for component in sbom["components"]:
        assert component["version"] and component["purl"].startswith("pkg:pypi/"), component
