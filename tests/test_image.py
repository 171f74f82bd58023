"""The image: the Dockerfile is hadolint-clean, and its build steps work without a builder.

No container builder runs here (no Docker daemon; base images cannot be
pulled), so the build stage's own script (scripts/install-venv.sh: wheels,
a fresh venv installed from them only, pip taken out) runs in a temp dir and
the installed ``nodeagent`` is exercised as the image's entry point would be.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "Dockerfile"


def tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]' brings it)")
    return found


def test_dockerfile_is_hadolint_clean() -> None:
    p = subprocess.run([tool("hadolint"), str(DOCKERFILE)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_dockerfile_shape() -> None:
    text = DOCKERFILE.read_text()
    stages = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert len(stages) == 2, "multi-stage: build, then the final image"
    final = text[text.rindex("\nFROM ") :]
    assert "libkmod2" in final and "kmod=" in final
    assert "COPY --from=build /opt/nodeagent" in final
    assert "pip uninstall" in final, "the base image's pip leaves the final stage"
    assert not re.search(r"\b(gcc|build-essential|g\+\+)\b", text), "no compilers"
    assert re.search(r"^USER\s+(?!0\b|root\b)", final, re.M), "non-root by default"
    assert 'ENTRYPOINT ["nodeagent"]' in final and 'CMD ["run"]' in final
    for label in ("title", "version", "revision", "licenses", "description"):
        assert f"org.opencontainers.image.{label}=" in final
    assert "scripts/install-venv.sh" in text


def test_the_build_stage_steps_make_a_working_pipless_venv(tmp_path: Path) -> None:
    venv, wheels = tmp_path / "opt-nodeagent", tmp_path / "wheels"
    env = {**os.environ, "PYTHON": sys.executable}
    p = subprocess.run(
        ["sh", str(REPO / "scripts/install-venv.sh"), str(REPO), str(venv), str(wheels)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if p.returncode != 0 and re.search(r"No matching distribution|Could not fetch", p.stderr):
        pytest.skip(f"no package index reachable: {p.stderr.strip().splitlines()[-1]}")
    assert p.returncode == 0, p.stderr
    assert any(w.name.startswith("nodeagent-") for w in wheels.glob("*.whl"))
    assert not (venv / "bin" / "pip").exists()
    assert subprocess.run([venv / "bin/python", "-m", "pip"], capture_output=True).returncode != 0

    # The entry point, from the installed wheel (not this checkout).
    run = subprocess.run([venv / "bin/nodeagent", "--help"], capture_output=True, text=True)
    assert run.returncode == 0 and "check" in run.stdout
    host = tmp_path / "host"
    host.mkdir()
    check = subprocess.run(
        [venv / "bin/nodeagent", "check", "--host-root", str(host)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert check.returncode == 1, check.stderr  # an empty node: the gate is closed
    assert "peermem: closed" in check.stdout
    where = subprocess.run(
        [venv / "bin/python", "-c", "import nodeagent; print(nodeagent.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert str(venv) in where.stdout, "imported from the venv, not the checkout"
