"""The image's test bench: buildah, a Debian base bootstrapped from Debian's packages, the build.

    python -m tests.image_setup        # from the repository root: prepare, build, print the image

No base-image registry is reachable here, so the Dockerfile's ``BASE_IMAGE``
(``debian:bookworm-slim``) is replaced by the same distribution bootstrapped
with ``mmdebstrap`` (minbase, documentation left out as the slim image does)
and imported into buildah's storage as ``BASE``. Everything else is the
project's own ``Dockerfile``, built with ``buildah build --isolation chroot``
(``podman run`` and OCI runtimes fail here: ``crun: setrlimit RLIMIT_NOFILE``).

Cached between runs: the base tarball under ``~/.cache/nodeagent-image`` and
buildah's layer cache (``/var/lib/containers``), so a warm build only redoes
the layers whose inputs changed. The build's pip trusts the CA bundle this
machine trusts, given as the build secret ``pip-ca`` as the Dockerfile tells a
user behind a TLS-inspecting proxy to (a secret is never in a layer). Anything that cannot
be done raises :class:`SetupError` with a one-line reason (the tests' skip
reason). Standard library only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.chromium_setup import SetupError, apt_install

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nodeagent-image"
SUITE = "bookworm"  # the Dockerfile's debian:bookworm-slim
BASE = f"localhost/nodeagent-base:{SUITE}"
IMAGE = "localhost/nodeagent:test"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# As debian:*-slim: no manuals, documentation (but copyrights), translations, info.
SLIM = (
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/locale/*",
    "path-exclude=/usr/share/info/*",
)


def run(*argv: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired as e:
        raise SetupError(f"{argv[0]} {argv[1]} timed out after {timeout:.0f}s") from e


def _last_line(p: subprocess.CompletedProcess[str]) -> str:
    lines = (p.stderr or p.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit {p.returncode}"


def tools() -> None:
    """buildah and mmdebstrap, installed from Debian's packages when missing."""
    missing = [t for t in ("buildah", "mmdebstrap") if shutil.which(t) is None]
    if missing:
        apt_install(*missing)
    if any(shutil.which(t) is None for t in ("buildah", "mmdebstrap")):
        raise SetupError("buildah or mmdebstrap not on PATH after installing them")


def _have_image(name: str) -> bool:
    return run("buildah", "inspect", "--type", "image", name, timeout=60).returncode == 0


def base() -> float:
    """The base image in buildah's storage; the seconds it took (0.0: cached)."""
    if _have_image(BASE):
        return 0.0
    t0 = time.monotonic()
    CACHE.mkdir(parents=True, exist_ok=True)
    tarball = CACHE / f"base-{SUITE}.tar"
    if not tarball.exists():
        partial = tarball.with_suffix(".partial")
        opts = [f"--dpkgopt={o}" for o in SLIM]
        p = run("mmdebstrap", "--variant=minbase", *opts, SUITE, str(partial))
        if p.returncode != 0:
            raise SetupError(f"mmdebstrap {SUITE} failed: {_last_line(p)}")
        partial.rename(tarball)
    ctr = run("buildah", "from", "scratch", timeout=60)
    if ctr.returncode != 0:
        raise SetupError(f"buildah from scratch failed: {_last_line(ctr)}")
    name = ctr.stdout.strip()
    try:
        for argv in (("add", name, str(tarball), "/"), ("commit", "-q", name, BASE)):
            p = run("buildah", *argv, timeout=600)
            if p.returncode != 0:
                raise SetupError(f"buildah {argv[0]} of the base failed: {_last_line(p)}")
    finally:
        run("buildah", "rm", name, timeout=60)
    return time.monotonic() - t0


@dataclass(frozen=True)
class Built:
    image: str
    seconds: float  # the build alone (base and tools excluded)
    base_seconds: float  # 0.0 when the base came from the cache


def build(context: Path = REPO, tag: str = IMAGE) -> Built:
    """The project's own Dockerfile, only its base replaced by the bootstrapped one."""
    tools()
    base_s = base()
    secret = ["--secret", f"id=pip-ca,src={CA_BUNDLE}"] if CA_BUNDLE.is_file() else []
    t0 = time.monotonic()
    p = run(
        "buildah",
        "build",
        "--isolation",
        "chroot",
        "--layers",
        "--pull=never",
        *secret,
        "--build-arg",
        f"BASE_IMAGE={BASE}",
        "-f",
        str(context / "Dockerfile"),
        "-t",
        tag,
        str(context),
        timeout=1800,
    )
    if p.returncode != 0:
        tail = " | ".join((p.stdout + p.stderr).strip().splitlines()[-3:])
        raise SetupError(f"buildah build failed: {tail}")
    return Built(tag, time.monotonic() - t0, base_s)


def inspect(image: str) -> dict[str, object]:
    p = run("buildah", "inspect", "--type", "image", image, timeout=60)
    if p.returncode != 0:
        raise SetupError(f"buildah inspect {image} failed: {_last_line(p)}")
    doc: dict[str, object] = json.loads(p.stdout)
    return doc


if __name__ == "__main__":
    try:
        built = build()
    except SetupError as err:
        print(f"image setup: {err}", file=sys.stderr)
        sys.exit(1)
    print(f"{built.image}: built in {built.seconds:.1f}s (base {built.base_seconds:.1f}s)")
