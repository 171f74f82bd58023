#!/usr/bin/env bash
# The main job on a fresh machine: replay the seed incidents on a simulated
# node without the agent, with it as shipped and with the peermem hold, and
# print one summary matrix of the verdicts. `scripts/demo.sh --lanes` adds each
# run's timeline (side by side); other arguments go to `nodeagent simulate`.
# Installs what it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q -e . >/dev/null 2>&1 || .venv/bin/python -m pip install -e .
# The summary alone has nothing to watch: run at full speed unless asked otherwise.
pace=(--speed 0)
for arg in "$@"; do
  case "$arg" in --speed|--speed=*|--lanes) pace=() ;; esac
done
exec .venv/bin/nodeagent simulate "${@:-all}" --compare "${pace[@]}"
