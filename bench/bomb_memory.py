"""Peak memory of reading hostile module files: decompression bombs and oversized files.

Each case runs in a fresh child process (so ru_maxrss is that case's alone)
that reads one file the way the agent does (``read_module_fd`` on a descriptor
opened inside the host root) and prints the outcome, the file's size on disk,
what it would decompress to, the time taken and the child's peak RSS; a real
module (the simulator's ``nvidia-peermem.ko``) is the baseline.

    .venv/bin/python bench/bomb_memory.py
"""

from __future__ import annotations

import gzip
import json
import lzma
import shlex
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zstandard

CHILD = r"""
import json, os, resource, sys, time
from nodeagent.host.fs import HostRoot
from nodeagent.host.modfile import ModuleFileError, read_module_fd
root, rel = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
fd, _ = HostRoot(root).open_regular(rel, follow=True)
try:
    read_module_fd(fd, rel)
    outcome = "parsed"
except ModuleFileError as exc:
    outcome = "refused: " + str(exc).split(": ", 1)[1][:70]
took = time.perf_counter() - t0
print(json.dumps({"outcome": outcome, "ms": took * 1000,
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

BASE = r"""
import resource
from nodeagent.host import fs, modfile
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def elf_header(shoff: int, shnum: int) -> bytes:
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    return struct.pack("<16sHHIQQQIHHHHHH", ident, 1, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64, shnum, 0)


def zstd_stream(head: bytes, zeros: int) -> bytes:
    obj = zstandard.ZstdCompressor(level=1).compressobj()
    parts = [obj.compress(head)]
    block = bytes(1 << 20)
    parts += [obj.compress(block) for _ in range(zeros >> 20)]
    return b"".join([*parts, obj.flush()])


def main() -> None:
    from nodeagent.sim.kofile import write_module_file

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        found = sorted(
            Path.home().glob(
                ".cache/nodeagent-realkernel/k/*/kernel/lib/modules/*/"
                "kernel/drivers/net/ethernet/mellanox/mlx5/core/mlx5_core.ko"
            )
        )
        if found:  # a real module of real size (Debian's mlx5_core), plain and xz'ed
            real = root / "mlx5_core.ko"
            real.write_bytes(found[-1].read_bytes())
        else:
            real = write_module_file(root / "mlx5_core.ko", build_id=bytes(20))
        (root / "mlx5_core.ko.xz").write_bytes(lzma.compress(real.read_bytes(), preset=6))
        cases = {
            f"baseline: {real.name} ({'Debian' if found else 'simulated'})": (
                real.name, real.stat().st_size),
            "baseline: the same, xz-compressed": ("mlx5_core.ko.xz", real.stat().st_size),
            "zstd: ELF header (4 KiB declared) + 1 GiB zeros": (
                "a.ko.zst",
                zstd_stream(elf_header(4096, 1), 1 << 30),
                (1 << 30) + 64,
            ),
            "zstd: 1 GiB of zeros": ("b.ko.zst", zstd_stream(b"", 1 << 30), 1 << 30),
            "xz: 256 MiB of zeros": ("c.ko.xz", lzma.compress(bytes(256 << 20), preset=0),
                                     256 << 20),
            "gz: 256 MiB of zeros": ("d.ko.gz", gzip.compress(bytes(256 << 20), 1), 256 << 20),
            "xz: header declaring a 1 GiB image": ("e.ko.xz",
                                                   lzma.compress(elf_header(1 << 30, 16)), 1 << 30),
        }  # fmt: skip
        rows = []
        base = float(subprocess.run([sys.executable, "-c", BASE], capture_output=True,
                                    text=True, check=True).stdout)  # fmt: skip
        for label, spec in cases.items():
            if len(spec) == 3:
                name, data, expands = spec  # type: ignore[misc]
                (root / name).write_bytes(data)
            else:
                name, expands = spec  # type: ignore[misc]
            size = (root / name).stat().st_size
            out = subprocess.run([sys.executable, "-c", CHILD, tmp, name], capture_output=True,
                                 text=True, check=True)  # fmt: skip
            rows.append((label, size, expands, json.loads(out.stdout)))
    print(f"interpreter + nodeagent imports alone: peak RSS {base:.1f} MiB")
    for label, size, expands, r in rows:
        print(f"{label:48s} file {size / 1024:9.1f} KiB  expands to {expands / 2**20:7.1f} MiB  "
              f"{r['ms']:8.1f} ms  peak RSS {r['rss_mib']:6.1f} MiB  {r['outcome']}")  # fmt: skip
    print("command:", shlex.join([sys.executable, *sys.argv]))


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - t0:.1f} s")
