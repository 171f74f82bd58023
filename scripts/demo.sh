#!/usr/bin/env bash
# The main job on a fresh machine: replay the seed incidents on a simulated
# node, without and with the agent, side by side. Installs what it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q -e . >/dev/null 2>&1 || .venv/bin/python -m pip install -e .
exec .venv/bin/nodeagent simulate "${@:-all}" --compare
