"""The image: the project's own Dockerfile built and started as the DaemonSet starts it.

``tests/image_setup.py`` builds the Dockerfile with buildah (chroot isolation),
only its ``BASE_IMAGE`` replaced by the same Debian release bootstrapped from
Debian's packages (no base-image registry is reachable here); where buildah or
mmdebstrap cannot be had, those tests skip with the reason and the build
stage's own script still runs on the checkout
(``test_the_build_stage_steps_make_a_working_pipless_venv``).

The image is started two ways: ``buildah run`` (its entrypoint, uid 0 as the
DaemonSet runs it, or its default user; a host-root fixture at ``/host``), and,
for a read-only root filesystem, by hand as a runtime would: its root bound
read-only in a private mount namespace, the fixture at ``/host``, ``/proc``
mounted, ``chroot`` with the image's own environment.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from nodeagent.sim.node import READY
from tests.chromium_setup import SetupError
from tests.healthy import healthy_node
from tests.image_setup import Built, build, inspect
from tests.waiting import WAIT

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
    # build, the SBOM's two stages (scripts/image.sh's --target sbom), the image: one base
    assert stages == ["${BASE_IMAGE}", "build", "scratch", "${BASE_IMAGE}"], stages
    assert re.search(r"^ARG BASE_IMAGE=debian:bookworm-slim$", text, re.M)
    build_stage, final = text[: text.rindex("\nFROM ")], text[text.rindex("\nFROM ") :]
    # The dependencies' layer comes before the source: a source change rebuilds one step.
    order = [build_stage.index(s) for s in ("COPY pyproject.toml", "install-venv.sh deps",
                                            "COPY nodeagent", "install-venv.sh app")]  # fmt: skip
    assert order == sorted(order)
    assert "libkmod2" in final and "kmod" in final and "python3" in final
    assert "COPY --from=build /opt/nodeagent" in final
    assert "pip uninstall" not in final, "Debian's python3 has no pip; nothing to take out"
    assert not re.search(r"=\d[\w.+~-]*-\S*deb\d+", text), "no exact Debian revisions"
    assert not re.search(r"\b(gcc|build-essential|g\+\+)\b", text), "no compilers"
    assert re.search(r"^USER\s+(?!0\b|root\b)", final, re.M), "non-root by default"
    assert 'ENTRYPOINT ["nodeagent"]' in final and 'CMD ["run"]' in final
    for label in ("title", "version", "revision", "licenses", "description"):
        assert f"org.opencontainers.image.{label}=" in final


def test_the_build_stage_steps_make_a_working_pipless_venv(tmp_path: Path) -> None:
    """The build stage's two steps on this checkout (the build test runs them in the image)."""
    venv = tmp_path / "opt-nodeagent"
    env = {**os.environ, "PYTHON": sys.executable}
    for step in ("deps", "app"):
        p = subprocess.run(
            ["sh", str(REPO / "scripts/install-venv.sh"), step, str(REPO), str(venv)],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        if p.returncode != 0 and re.search(r"No matching distribution|Could not fetch", p.stderr):
            pytest.skip(f"no package index reachable: {p.stderr.strip().splitlines()[-1]}")
        assert p.returncode == 0, p.stderr
    assert not (venv / "bin" / "pip").exists()
    pkg = next((venv / "lib").glob("python3*/site-packages/nodeagent"))
    assert list((pkg / "__pycache__").glob("cli.*.pyc")), "bytecode compiled at build time"
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


# -- built with buildah, started as the DaemonSet starts it ---------------------------------


@pytest.fixture(scope="module")
def built() -> Built:
    try:
        return build()
    except SetupError as err:
        pytest.skip(f"the image cannot be built here: {err}")


class Container:
    """A working container of the image; commands run through its entrypoint."""

    def __init__(self, image: str) -> None:
        p = subprocess.run(["buildah", "from", image], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        self.name = p.stdout.strip()
        config: Any = inspect(image)["OCIv1"]
        self.config: dict[str, Any] = config["config"]
        self.entrypoint: list[str] = self.config["Entrypoint"]

    def argv(
        self, args: Sequence[str], *, user: str = "0:0", host: Path | None = None
    ) -> list[str]:
        volumes = ["-v", f"{host}:/host"] if host is not None else []
        return [
            "buildah", "run", "--isolation", "chroot", "--user", user, *volumes,
            self.name, "--", *self.entrypoint, *args,
        ]  # fmt: skip

    def run(
        self, *args: str, user: str = "0:0", host: Path | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(args, user=user, host=host), capture_output=True, text=True, timeout=timeout
        )

    def shell(
        self, *argv: str, user: str = "0:0", timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """A command in the container other than the entrypoint (to look at it from inside)."""
        return subprocess.run(
            ["buildah", "run", "--isolation", "chroot", "--user", user, self.name, "--", *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def close(self) -> None:
        subprocess.run(["buildah", "rm", self.name], capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def container(built: Built) -> Iterator[Container]:
    c = Container(built.image)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "host"
    n = healthy_node(root)
    n.kernel.uevent_source.close()
    os.chmod(tmp_path, 0o755)  # the image's default user reads the fixture too
    yield root


def test_the_image_is_the_dockerfiles(built: Built, container: Container) -> None:
    cfg = container.config
    assert container.entrypoint == ["nodeagent"] and cfg["Cmd"] == ["run"]
    assert cfg["User"] == "65532:65532"
    assert "NODEAGENT_HOST_ROOT=/host" in cfg["Env"]
    assert cfg["Labels"]["org.opencontainers.image.title"] == "nodeagent"
    version = container.run("--version")
    assert version.returncode == 0 and version.stdout.strip() == "nodeagent 0.1.0", version


@pytest.mark.parametrize("ready", [True, False], ids=["healthy", "blocked"])
def test_check_in_the_image_on_a_node(container: Container, node: Path, ready: bool) -> None:
    if not ready:
        (node / READY).unlink()  # MOFED not ready: the gate stays closed
    p = container.run("check", "--json", host=node)
    assert p.returncode == (0 if ready else 1), p.stderr
    doc = json.loads(p.stdout)
    assert doc["guards"]["peermem"]["verdict"] == ("open" if ready else "closed")
    assert "Traceback" not in p.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# A hang detector for the daemon's start in a container and its first pass (seconds on a
# quiet machine; a busy one may take a good many).
DAEMON_UP_S = 120


def test_run_in_the_image_serves_metrics_on_loopback_and_the_default_user_reads_it(
    container: Container, node: Path
) -> None:
    """The daemon as root for a few seconds, metrics on loopback scraped from inside; the
    image's default user (65532) runs check, status and wait against what it writes."""
    port = _free_port()
    daemon = subprocess.Popen(
        container.argv(
            ["run", "--mode", "observe", "--metrics-address", f"127.0.0.1:{port}"], host=node
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        scrape = (  # until the first pass's series are there (a deadline, not a count)
            "import sys, time, urllib.request\n"
            "text = ''\n"
            f"end = time.monotonic() + {DAEMON_UP_S}\n"
            "while time.monotonic() < end:\n"
            "    try:\n"
            f"        text = urllib.request.urlopen('http://127.0.0.1:{port}/metrics',"
            f" timeout={WAIT}).read().decode()\n"
            "    except OSError: pass\n"
            "    if 'nodeagent_guard_ok{guard=\"peermem\"} 1.0' in text: break\n"
            "    time.sleep(0.1)\n"
            "sys.stdout.write(text)\n"
        )
        got = container.shell(
            "python3", "-c", scrape, user="65532:65532", timeout=DAEMON_UP_S + 2 * WAIT
        )
        if 'nodeagent_guard_ok{guard="peermem"} 1.0' not in got.stdout:
            daemon.terminate()
            _, err = daemon.communicate(timeout=WAIT)
            seen = [line for line in got.stdout.splitlines() if "guard" in line]
            pytest.fail(f"the peermem gate not open in {DAEMON_UP_S} s: {seen}\n{err[-2000:]}")
        user = "65532:65532"
        wait = container.run("wait", "peermem", "--timeout", f"{WAIT:g}", host=node, user=user)
        assert wait.returncode == 0, wait.stderr
        status = container.run("status", host=node, user=user)
        assert status.returncode == 0 and "peermem: open" in status.stdout, status
        check = container.run("check", host=node, user=user)
        assert check.returncode == 0, check.stderr
        assert daemon.poll() is None, daemon.stderr.read() if daemon.stderr else ""
    finally:
        daemon.terminate()
        daemon.wait(timeout=WAIT)


def _rootfs(container: Container) -> Path:
    p = subprocess.run(["buildah", "mount", container.name], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return Path(p.stdout.strip())


READ_ONLY_RUNTIME = r"""
set -eu
root=$1; host=$2; shift 2
mkdir -p "$root/host"
mount --bind "$root" "$root"
mount --bind "$host" "$root/host"
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
mount -o remount,bind,ro "$root"
exec chroot --userspec=0:0 "$root" /usr/bin/env -i "$@"
"""


def test_the_image_runs_on_a_read_only_root_filesystem(container: Container, node: Path) -> None:
    """As the DaemonSet runs it (readOnlyRootFilesystem): nothing is written in the image."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here to make a private mount namespace")
    root = _rootfs(container)
    env = list(container.config["Env"])
    argv = [*env, *container.entrypoint]
    once = ["run", "--once", "--metrics-address", "off"]
    # The DaemonSet's own command (deploy/base: the supervisor, the agent its child) too.
    for args, rc in ((["check", "--json"], 0), (once, 0), (["supervise", *once], 0)):
        p = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", READ_ONLY_RUNTIME,
             "ro-runtime", str(root), str(node), *argv, *args],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if p.returncode != rc and "mount" in p.stderr and "permission" in p.stderr.lower():
            pytest.skip(f"cannot make mounts here: {p.stderr.strip().splitlines()[-1]}")
        assert p.returncode == rc, p.stderr
        assert "Traceback" not in p.stderr and "Read-only file system" not in p.stderr
    assert (node / "run/nodeagent/state.json").exists(), "the run wrote to the host, not the image"


def test_no_installer_compiler_or_cache_and_bytecode_compiled(container: Container) -> None:
    root = _rootfs(container)
    venv = root / "opt/nodeagent"
    assert not list(venv.glob("bin/pip*"))
    assert container.shell("python3", "-m", "pip", "--version").returncode != 0
    for compiler in ("gcc", "cc", "c++", "clang"):
        assert container.shell("sh", "-c", f"command -v {compiler}").returncode != 0, compiler
    assert not list((root / "var/lib/apt/lists").glob("*_Packages*"))
    assert not list((root / "var/cache/apt").glob("**/*.deb"))
    assert not (root / "root/.cache").exists()
    pkg = next(venv.glob("lib/python3*/site-packages/nodeagent"))
    sources = {f.relative_to(pkg).with_suffix("") for f in pkg.rglob("*.py")}
    compiled = {
        (f.parent.parent / f.name.split(".")[0]).relative_to(pkg)
        for f in pkg.rglob("__pycache__/*.pyc")
    }
    assert sources <= compiled, sorted(sources - compiled)[:5]
