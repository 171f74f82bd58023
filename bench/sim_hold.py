"""The seeds' node with the hold, simulated: MOFED's ready flag -> the driver container's held
load goes on; and what a simulated run costs.

    .venv/bin/python bench/sim_hold.py [--runs 20] [--mode operator-peermem-dm09-hold]

Replays ``kernel-upgrade-race`` (seeds 000-002) with the real agent in the given
``-hold`` mode, ``--runs`` times with seeds 1..N, and reads from each run:
the ready flag's time, the held open's end (the agent's ``held-open`` record),
and the driver container's "Done" line, all in seed-seconds; and the run's wall
time. The simulated kernel releases an open when the agent's shipped responder
answers it (stepped between whole agent passes), so flag -> release measures
the agent's decision path in the model's time, not a machine's: the real
kernel's wall-clock figure is ``bench/hold_latency.py``. This scene has no VFs,
so the seeds do not move its timings: equal figures across runs are the
determinism the simulator promises, shown.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys

from nodeagent.sim.scenarios import SCENARIOS, run_scenario


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--mode", default="operator-peermem-dm09-hold")
    args = ap.parse_args()
    print("command:", shlex.join([sys.executable, *sys.argv]))
    release: list[float] = []
    done: list[float] = []
    held: list[float] = []
    wall: list[float] = []
    failed = restarts = 0
    for seed in range(1, args.runs + 1):
        r = run_scenario(SCENARIOS["kernel-upgrade-race"], agent=True, seed=seed, mode=args.mode)
        v = r.verdict
        assert v.ready_flag_at is not None, "MOFED never set its ready flag"
        ends = [rec for rec in r.agent_records if rec.get("kind") == "held-open"]
        assert ends, f"seed {seed}: nothing was held"
        release.append(float(ends[0]["ts"]) - v.ready_flag_at)
        held.append(float(ends[0]["seconds"]))
        gpu_done = [e.t for e in r.events if e.column == "GPU driver" and e.text.startswith("Done")]
        done.append(gpu_done[0] - v.ready_flag_at)
        wall.append(r.wall_seconds)
        failed += v.peermem_failed_loads
        restarts += v.driver_restarts
    print(f"kernel-upgrade-race, mode {args.mode}, {args.runs} runs (seeds 1..{args.runs})")
    for name, xs, unit in (
        ("ready flag -> held open let go", release, "seed-s"),
        ("ready flag -> driver container done", done, "seed-s"),
        ("how long the open was held", held, "seed-s"),
        ("wall time per run", wall, "s"),
    ):
        print(
            f"  {name:38s} p50 {pct(xs, 0.5):8.3f} {unit}  p99 {pct(xs, 0.99):8.3f} {unit}"
            f"  (min {min(xs):.3f}, max {max(xs):.3f}, stdev {statistics.pstdev(xs):.3f})"
        )
    print(f"  failed nvidia_peermem loads: {failed}; driver-container restarts: {restarts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
