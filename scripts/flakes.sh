#!/usr/bin/env bash
# Hunt flaky tests: rerun the chosen tests N times while the CPU is busy.
#
#   bash scripts/flakes.sh [N] [pytest args]
#
# N defaults to 10; the pytest args to the whole suite but the QEMU tests
# (-m "not realkernel"). Two busy processes per core run for the whole hunt
# (started here, stopped when the script ends, however it ends), so a test that
# assumes an order or a quick thread hand-off shows itself. Each run's results
# go to .flakes/run-<i>.xml ($FLAKES_DIR); at the end one line per test that
# did not pass every run says how many it passed, worst first (every test in
# .flakes/table.txt). Exit 1 when any test failed in any run.
# docs/testing.md: how to hunt a flake with it.
set -uo pipefail
cd "$(dirname "$0")/.."
runs=10
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
  runs=$1
  shift
fi
if [[ $runs -lt 1 ]]; then
  echo "flakes.sh: N must be at least 1" >&2
  exit 2
fi
args=("$@")
[[ ${#args[@]} -gt 0 ]] || args=(-m "not realkernel")
# The venv scripts/test.sh made; installed here only when missing (a hunt reruns often).
if [ ! -x .venv/bin/pytest ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  .venv/bin/python -m pip install -q -e '.[test]' >/dev/null 2>&1 || .venv/bin/python -m pip install -e '.[test]'
fi

out=${FLAKES_DIR:-.flakes}
rm -rf "$out"
mkdir -p "$out"

busy=()
stop_busy() {
  [[ ${#busy[@]} -gt 0 ]] && kill "${busy[@]}" 2>/dev/null
  wait "${busy[@]}" 2>/dev/null
  busy=()
}
trap stop_busy EXIT
trap 'exit 130' INT TERM
cores=$(nproc)
per_core=${FLAKES_BUSY_PER_CORE:-2}
[[ $per_core =~ ^[0-9]+$ ]] || { echo "flakes.sh: FLAKES_BUSY_PER_CORE must be a count" >&2; exit 2; }
for _ in $(seq 1 $((per_core * cores))); do
  bash -c 'while :; do :; done' &
  busy+=($!)
done
echo "flakes.sh: $runs runs of: pytest ${args[*]}"
echo "flakes.sh: pressure: ${#busy[@]} busy processes on $cores cores"

start=$(date +%s)
for i in $(seq "$runs"); do
  t0=$(date +%s)
  # A hung run is cut (FLAKES_RUN_TIMEOUT, default an hour): its tests count as not passed.
  timeout --kill-after=30 "${FLAKES_RUN_TIMEOUT:-3600}" \
    .venv/bin/pytest -q -p no:cacheprovider --junitxml="$out/run-$i.xml" "${args[@]}" \
    >"$out/run-$i.log" 2>&1
  rc=$?
  echo "flakes.sh: run $i/$runs: exit $rc in $(($(date +%s) - t0)) s: $(tail -n 1 "$out/run-$i.log")"
done
stop_busy
echo "flakes.sh: $runs runs in $(($(date +%s) - start)) s"
.venv/bin/python -m tests.flaketable "$out" "$runs"
