#!/bin/sh
# Build nodeagent's wheel and every dependency's, install them into a fresh venv
# from those wheels only, then take pip out of it. The Dockerfile's build stage
# runs exactly this; tests/test_image.py runs it too, so the image's steps are
# exercised where no container builder can run.
#
#   sh scripts/install-venv.sh SRC_DIR VENV_DIR WHEEL_DIR      (PYTHON: the interpreter, default python3)
set -eu
src=$1
venv=$2
wheels=$3
python=${PYTHON:-python3}
"$python" -m pip wheel --no-cache-dir --quiet --wheel-dir "$wheels" "$src"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --no-cache-dir --quiet --no-index --find-links "$wheels" nodeagent
# The venv needs no installer at run time.
"$venv/bin/python" -m pip uninstall --yes --quiet pip setuptools
