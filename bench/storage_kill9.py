"""kill -9 at random moments of a storage removal; how many trials converge.

    .venv/bin/python bench/storage_kill9.py [--trials 30]

Each trial: the real agent loop in a child process removes three storage modules at
100 ms per ``delete_module`` while MOFED is pending, and is SIGKILLed a uniform random
0-350 ms after the plan's first step (the hold file) is written; an unload it began ends
after the kill, as the kernel's does (``tests/faults/test_storage_kill9.py``, which runs a
few of these in the suite). Two restarts:

- **ready**: MOFED becomes ready, then a new agent starts on the same root and must load
  back everything the killed one removed;
- **pending**: a new agent starts while MOFED still waits; after its first pass (and its
  plan) no storage module may be loaded; then MOFED becomes ready and one more pass (and
  its load time) must bring every module back.
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.faults

from tests.faults.storage_trials import MODULES, pending_trial, trial


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    print("command:", shlex.join([sys.executable, *sys.argv]))
    rng = random.Random(args.seed)
    back = 0
    print("restarted with MOFED ready:")
    for i in range(args.trials):
        offset = rng.uniform(0.0, 0.35)
        with tempfile.TemporaryDirectory(prefix="na-kill9-") as tmp:
            try:
                left, after = trial(Path(tmp), None, offset)
            except AssertionError as exc:  # it never converged: a failed trial, named
                left, after = set(), set()
                print(f"  trial {i:2d}: {str(exc).splitlines()[0]}")
        ok = after == set(MODULES)
        back += ok
        removed = sorted(set(MODULES) - left)
        print(
            f"  trial {i:2d}: killed {offset * 1000:5.1f} ms in, removed {removed or '-'}, "
            f"all loaded back: {'yes' if ok else 'NO'}"
        )
    print("restarted while MOFED waits, then MOFED ready:")
    stayed = missing = 0
    for i in range(args.trials):
        offset = rng.uniform(0.0, 0.35)
        with tempfile.TemporaryDirectory(prefix="na-kill9-") as tmp:
            left, while_pending, after, error = pending_trial(Path(tmp), offset)
        stayed += bool(while_pending)
        missing += after != set(MODULES)
        print(
            f"  trial {i:2d}: killed {offset * 1000:5.1f} ms in, left {sorted(left) or '-'}, "
            f"loaded while MOFED waits {sorted(while_pending) or '-'}, "
            f"missing one pass after ready {sorted(set(MODULES) - after) or '-'}"
            + (f" (last error: {error})" if error else "")
        )
    print(
        f"ready restart: {back}/{args.trials} trials loaded back every module the killed "
        f"agent removed; pending restart: {stayed}/{args.trials} with a storage module loaded "
        f"while MOFED waits, {missing}/{args.trials} with a module missing one pass after "
        f"ready ({len(MODULES)} modules, 100 ms per removal)"
    )
    return 0 if back == args.trials and not stayed and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
