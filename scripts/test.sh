#!/usr/bin/env bash
# The whole test suite: lint, unit, integration (real inotify), simulator, and
# the real-kernel suite (a Debian kernel under QEMU; set up on first use, as root).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q -e '.[test]' >/dev/null 2>&1 || .venv/bin/python -m pip install -e '.[test]'
.venv/bin/ruff check nodeagent tests bench
.venv/bin/ruff format --check nodeagent tests bench
.venv/bin/mypy nodeagent
exec .venv/bin/pytest -q -rs "$@"
