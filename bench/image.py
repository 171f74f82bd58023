"""The image: its size and layers, a warm and a source-change build, and `check` inside it.

Builds the project's own Dockerfile as tests/image_setup.py does (buildah,
chroot isolation, the Debian base bootstrapped from Debian's packages), then:

- the image's layers and their sizes (uncompressed, from the local manifest),
  the base's apart from what the Dockerfile adds;
- a warm rebuild (nothing changed) and a rebuild after a one-line change to the
  agent's source (a copy of the build context, the dependencies' layer cached);
- ``nodeagent check --json`` on the same healthy node fixture, whole-process
  wall time, in the image (timed by the image's own Python around the process,
  so buildah's start-up is not counted) and from this checkout's venv; median
  of ``--runs``.

    .venv/bin/python bench/image.py [--runs 15]

``--cold`` first removes the cached base tarball and image and times the
whole setup from nothing (mmdebstrap, the base import, every layer).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the repo's tests/ (the image bench shares their setup)

from tests.healthy import healthy_node  # noqa: E402
from tests.image_setup import BASE, CACHE, IMAGE, build, inspect, run  # noqa: E402

CONTEXT = ("Dockerfile", ".dockerignore", "pyproject.toml", "README.md", "nodeagent", "scripts")

TIMER = """
import statistics, subprocess, sys, time
runs, argv = int(sys.argv[1]), sys.argv[2:]
took = []
for _ in range(runs):
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True)
    took.append(time.perf_counter() - t0)
    assert p.returncode == 0, p.stderr
print(statistics.median(took))
"""


def layers(image: str) -> list[int]:
    manifest = json.loads(str(inspect(image)["Manifest"]))
    return [int(layer["size"]) for layer in manifest["layers"]]


def mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def in_image(fixture: Path, runs: int) -> float:
    ctr = run("buildah", "from", IMAGE).stdout.strip()
    try:
        p = run(
            "buildah", "run", "--isolation", "chroot", "--user", "0:0",
            "-v", f"{fixture}:/host", ctr, "--",
            "python3", "-c", TIMER, str(runs), "nodeagent", "check", "--json",
        )  # fmt: skip
        assert p.returncode == 0, p.stderr
        return float(p.stdout.strip())
    finally:
        run("buildah", "rm", ctr)


def in_checkout(fixture: Path, runs: int) -> float:
    exe = str(Path(sys.executable).parent / "nodeagent")
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            TIMER,
            str(runs),
            exe,
            "check",
            "--json",
            "--host-root",
            str(fixture),
        ],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    return float(p.stdout.strip())


def source_change_rebuild() -> float:
    """A copy of the build context with one line of the agent changed, built again."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = Path(tmp)
        for name in CONTEXT:
            src = REPO / name
            if src.is_dir():
                shutil.copytree(src, ctx / name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(src, ctx / name)
        init = ctx / "nodeagent/__init__.py"
        init.write_text(init.read_text() + f"# bench {time.time()}\n")
        built = build(ctx, tag="localhost/nodeagent:bench-source-change")
    run("buildah", "rmi", "localhost/nodeagent:bench-source-change")
    return built.seconds


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--cold", action="store_true", help="time the setup from nothing first")
    args = ap.parse_args(argv)
    print(f"$ .venv/bin/python bench/image.py {' '.join(argv or sys.argv[1:])}".rstrip())
    if args.cold:
        run("buildah", "rmi", "--force", IMAGE, BASE)
        run("buildah", "rmi", "--prune")
        shutil.rmtree(CACHE, ignore_errors=True)
        t0 = time.monotonic()
        cold = build()
        total = time.monotonic() - t0
        print(
            f"cold: {total:.0f} s from nothing (base bootstrapped and imported "
            f"{cold.base_seconds:.0f} s, build {cold.seconds:.0f} s)"
        )
    warm = build()
    print(f"warm rebuild, nothing changed: {warm.seconds:.1f} s")
    print(f"rebuild after a one-line source change: {source_change_rebuild():.1f} s")
    sizes, base = layers(IMAGE), layers(BASE)
    print(
        f"image: {len(sizes)} layers, {mb(sum(sizes))} uncompressed; the base "
        f"({len(base)} layer) {mb(sum(base))}, added by the Dockerfile: "
        + ", ".join(mb(s) for s in sizes[len(base) :])
    )
    with tempfile.TemporaryDirectory() as tmp:
        fixture = Path(tmp) / "host"
        node = healthy_node(fixture)
        node.kernel.uevent_source.close()
        Path(tmp).chmod(0o755)
        image_s, checkout_s = in_image(fixture, args.runs), in_checkout(fixture, args.runs)
    print(
        f"nodeagent check --json, whole process, median of {args.runs} (healthy node fixture): "
        f"in the image {image_s * 1000:.0f} ms, from the checkout {checkout_s * 1000:.0f} ms "
        f"(ratio {image_s / checkout_s:.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
