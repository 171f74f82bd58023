"""``nodeagent explain`` on a large log: throughput and peak memory, as a user runs it.

A synthetic journal-style log of ``--size`` bytes (kernel and container lines,
with the seed-001 race's evidence near the end), then ``nodeagent explain
--json FILE`` in its own process: wall time, MB/s, and its peak RSS (the
child's ru_maxrss), beside the same for a log a tenth of the size (memory must
not grow with the input).

Then the same for a hostile log of each size (issue 37: lines anyone can write with
``logger``, each with an evidence word so no chunk is skipped): runs of ``/sys/``
(the reported shape, 0.5 MB/s before the patterns were made linear), the same
ended by `` /net not found`` (the signature's own ending, so it is searched),
callback names repeated, ``VF restore`` before a run of dashes, and (issue 41)
openibd's ``Unloading `` repeated before ``[FAILED]``, ``mlx5_ib: `` repeated before
``Unknown symbol``, a failed insert's path of 2000 directories. Its rate is
printed next to the normal one: they must be of the same order.

Last, a must-gather ``.tar.gz`` of ``--nodes`` nodes and of a tenth of them (each driver
pod's log 60 failed loads of 4 KB: the shape that made memory grow with the node count):
its time and peak RSS.

    .venv/bin/python bench/explain.py [--size 1G] [--runs 3] [--against DIR] [--nodes 400]

Each figure is the median of ``--runs`` runs. ``--against DIR`` (a checkout of an older
commit: ``git worktree add DIR <commit>``) runs that code the same way, alternated run by
run with this one, and prints both and their ratio: the machine's noise hits both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the repo's tests/ (the bundle bench reads the test's bundle)

from tests.explain.bundles import many_nodes, tar, write  # noqa: E402

LINES = [
    b"Nov 21 11:50:%02d gpu-1 kubelet[2121]: I1121 11:50:00.000000 2121 kubelet.go:2415] "
    b"SyncLoop (PLEG): event for pod nvidia-gpu-operator/nvidia-dcgm-exporter-x7k2p\n",
    b'Nov 21 11:50:%02d gpu-1 containerd[1010]: time="2025-11-21T11:50:00Z" level=info '
    b'msg="StartContainer for \\"3f2a\\" returns successfully"\n',
    b"Nov 21 11:50:%02d gpu-1 kernel: mlx5_core 0000:01:00.0: E-Switch: Enable: mode(LEGACY), "
    b"nvfs(0), active vports(0)\n",
]
EVIDENCE = (
    b"Nov 21 11:51:06 gpu-1 mofed[3030]: [21-Nov-25_11:51:06] Unsetting driver ready state\n"
    b"Nov 21 11:51:41 gpu-1 driver[4040]: modprobe: ERROR: could not insert 'nvidia_peermem': "
    b"Invalid argument\n"
)

HOSTILE = [
    b"/sys/" * 800 + b" peermem\n",
    b"/sys/" * 800 + b" /net not found peermem\n",
    b"nv_get_p2p_free_callback" * 165 + b" peermem\n",
    b"VF restore" + b"-" * 4000 + b" peermem\n",
    # issue 41's forms: openibd's labels before a [FAILED], words before a symbol line
    b"Unloading " * 400 + b" [FAILED] peermem\n",
    b"mlx5_ib: " * 450 + b"Unknown symbol peermem\n",
    b"could not insert '" + b"a/" * 2000 + b"nvidia_peermem\n",
]


def size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def make_log(path: Path, n: int, hostile: bool = False) -> None:
    if hostile:
        block = b"".join(HOSTILE) * 64
    else:
        block = b"".join(line % (i % 60) for i in range(300) for line in LINES)
    with path.open("wb") as fh:
        written = 0
        while written < n:
            fh.write(block)
            written += len(block)
        fh.write(EVIDENCE)


def make_bundle(path: Path, nodes: int, lines: int = 60) -> None:
    """The must-gather of ``nodes`` nodes the 400-node test reads (its generator), as a
    ``.tar.gz`` at ``path``."""
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        tar(write(Path(tmp) / "must-gather", many_nodes(nodes, lines)), path)


def run(path: Path, code: Path) -> tuple[float, float, list[str]]:
    """One ``nodeagent explain --json`` of ``path`` with the package under ``code``: its
    wall time, its own peak RSS (MiB; GNU time's, not the children's maximum so far), the
    incidents it found."""
    t0 = time.perf_counter()
    p = subprocess.run(
        ["/usr/bin/time", "-f", "%M", sys.executable, "-m", "nodeagent", "explain", "--json",
         str(path)],
        capture_output=True, text=True, check=True, cwd=code,
        env={**os.environ, "PYTHONPATH": str(code)},
    )  # fmt: skip
    took = time.perf_counter() - t0
    peak_kib = int(p.stderr.strip().splitlines()[-1])
    kinds = [i["kind"] for i in json.loads(p.stdout)["incidents"]]
    return took, peak_kib / 1024, kinds


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1G")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--against", type=Path, help="a checkout of the code to compare with")
    ap.add_argument("--nodes", type=int, default=400, help="the bundle's node count")
    args = ap.parse_args(argv)
    print(f"$ .venv/bin/python bench/explain.py {' '.join(argv or sys.argv[1:])}".rstrip())
    codes = {"this": REPO}
    if args.against is not None:
        codes["against"] = args.against.resolve()
    n = size(args.size)
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        for each in (n // 10, n):
            for hostile in (False, True):
                log = Path(tmp) / "journal.log"
                make_log(log, each, hostile)
                actual = log.stat().st_size
                took: dict[str, list[float]] = {name: [] for name in codes}
                peaks: dict[str, list[float]] = {name: [] for name in codes}
                found: dict[str, list[str]] = {}
                for _ in range(args.runs):  # alternated: this, against, this, against ...
                    for name, code in codes.items():
                        seconds, peak, kinds = run(log, code)
                        took[name].append(seconds)
                        peaks[name].append(peak)
                        found[name] = kinds
                kind = "hostile" if hostile else "normal "
                rates = {}
                for name in codes:
                    rates[name] = actual / 1e6 / statistics.median(took[name])
                    print(
                        f"{kind} {actual / 1e6:,.0f} MB, {name:7}: median of {args.runs} "
                        f"{statistics.median(took[name]):.1f} s, {rates[name]:,.0f} MB/s, "
                        f"peak RSS {statistics.median(peaks[name]):.1f} MiB, found {found[name]}"
                    )
                if "against" in rates:
                    print(f"        this/against rate: {rates['this'] / rates['against']:.2f}")
                log.unlink()
        for nodes in (args.nodes // 10, args.nodes):
            bundle = Path(tmp) / "must-gather.tar.gz"
            make_bundle(bundle, nodes)
            for name, code in codes.items():
                runs = [run(bundle, code) for _ in range(args.runs)]
                print(
                    f"bundle  {nodes} nodes ({bundle.stat().st_size / 1e3:,.0f} KB), {name:7}: "
                    f"median of {args.runs} {statistics.median(r[0] for r in runs):.1f} s, "
                    f"peak RSS {statistics.median(r[1] for r in runs):.1f} MiB, "
                    f"{len(runs[0][2])} incidents"
                )
            bundle.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
