#!/usr/bin/env bash
# The whole test suite: lint, unit, integration (real inotify), simulator, and
# the real-kernel suite (a Debian kernel under QEMU; set up on first use, as root), and
# the HTML timeline in headless Chromium (Debian's package, installed on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q -e '.[test]' >/dev/null 2>&1 || .venv/bin/python -m pip install -e '.[test]'
.venv/bin/ruff check nodeagent tests bench
.venv/bin/ruff format --check nodeagent tests bench
.venv/bin/mypy nodeagent
# The real-kernel environment (QEMU, kmod's tools, a Debian kernel in ~/.cache),
# prepared up front so every test sees the same machine; if it cannot be had
# (not root, no apt) the real-kernel tests skip with the reason.
.venv/bin/python -m tests.realkernel.setup >/dev/null \
  || echo "real-kernel setup unavailable: those tests will be skipped (reason above)" >&2
# The image: buildah and mmdebstrap (Debian's, installed as root when missing), a
# Debian base bootstrapped into ~/.cache, the Dockerfile built (layers cached).
.venv/bin/python -m tests.image_setup >/dev/null \
  || echo "image setup unavailable: the image tests will be skipped (reason above)" >&2
# Debian's prometheus (promtool for the alert tests, the server for the real scrape),
# installed as root when missing, its service never started.
.venv/bin/python -m tests.prometheus_setup >/dev/null \
  || echo "prometheus setup unavailable: the promtool and scrape tests will be skipped" >&2
# Debian's Chromium for the HTML timeline test (installed as root when missing).
.venv/bin/python -m tests.chromium_setup >/dev/null \
  || echo "chromium setup unavailable: the headless-browser test will be skipped" >&2
# The 15 slowest tests close the run (where the time goes: docs/testing.md).
exec .venv/bin/pytest -q -rs --durations=15 "$@"
