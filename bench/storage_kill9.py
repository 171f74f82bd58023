"""kill -9 at random moments of a storage removal; how many trials load everything back.

    .venv/bin/python bench/storage_kill9.py [--trials 30]

Each trial: the real agent loop in a child process removes three storage modules at
100 ms per ``delete_module`` while MOFED is pending, and is SIGKILLed a uniform random
0-350 ms after the plan's first step (the hold file) is written; then MOFED becomes ready
and a new agent starts on the same root (``tests/faults/test_storage_kill9.py``, which runs
a few of these in the suite). Prints, per trial, the offset, what the killed agent left
loaded and whether the restarted one loaded everything back.
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.faults

from tests.faults.test_storage_kill9 import MODULES, trial


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    print("command:", shlex.join([sys.executable, *sys.argv]))
    rng = random.Random(args.seed)
    back = 0
    for i in range(args.trials):
        offset = rng.uniform(0.0, 0.35)
        with tempfile.TemporaryDirectory(prefix="na-kill9-") as tmp:
            left, after = trial(Path(tmp), None, offset)
        ok = after == set(MODULES)
        back += ok
        removed = sorted(set(MODULES) - left)
        print(
            f"  trial {i:2d}: killed {offset * 1000:5.1f} ms in, removed {removed or '-'}, "
            f"all loaded back: {'yes' if ok else 'NO'}"
        )
    print(
        f"{back}/{args.trials} trials loaded back every module the killed agent removed "
        f"({len(MODULES)} modules, 100 ms per removal)"
    )
    return 0 if back == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
