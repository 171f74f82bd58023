#!/bin/sh
# The Dockerfile's build stage, in two steps so a source change rebuilds only the second:
#
#   sh scripts/install-venv.sh deps SRC_DIR VENV_DIR   # a venv with pyproject.toml's dependencies
#   sh scripts/install-venv.sh app  SRC_DIR VENV_DIR   # nodeagent itself, then pip out, bytecode in
#   sh scripts/install-venv.sh sbom SRC_DIR VENV_DIR OUT  # VENV_DIR's CycloneDX SBOM into OUT
#
# PYTHON: the interpreter that makes the venv (default python3). tests/test_image.py
# runs both steps on the checkout too, and builds the Dockerfile with them.
set -eu
step=$1
src=$2
venv=$3
python=${PYTHON:-python3}
# A CA bundle given as the build secret pip-ca (a TLS-inspecting proxy's): pip trusts it.
if [ -s /run/secrets/pip-ca ]; then
  export PIP_CERT=/run/secrets/pip-ca
fi
case $step in
deps)
  "$python" -m venv "$venv"
  # The dependencies alone, read from pyproject.toml (no source needed yet).
  "$venv/bin/python" -c 'import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' \
    "$src/pyproject.toml" > "$venv/requirements.txt"
  "$venv/bin/python" -m pip install --no-cache-dir --quiet --only-binary=:all: \
    -r "$venv/requirements.txt"
  ;;
app)
  "$venv/bin/python" -m pip install --no-cache-dir --quiet --no-deps "$src"
  # The venv needs no installer at run time; the image's root filesystem is read-only,
  # so the bytecode is compiled now (checked by hash, not by the sources' times).
  "$venv/bin/python" -m pip uninstall --yes --quiet pip setuptools
  rm -f "$venv/requirements.txt"
  "$venv/bin/python" -m compileall -q -j 0 --invalidation-mode unchecked-hash "$venv/lib"
  ;;
sbom)
  # cyclonedx-bom in a venv of its own (never in VENV_DIR): it reads VENV_DIR's installed
  # distributions by running VENV_DIR's interpreter; nodeagent itself is the root component.
  out=$4
  tool=$(mktemp -d)
  "$python" -m venv "$tool"
  "$tool/bin/python" -m pip install --no-cache-dir --quiet --only-binary=:all: \
    'cyclonedx-bom>=7.5,<8'
  "$tool/bin/cyclonedx-py" environment --pyproject "$src/pyproject.toml" \
    --output-reproducible --output-format JSON -o "$out" "$venv"
  rm -rf "$tool"
  ;;
*)
  echo "usage: install-venv.sh deps|app SRC_DIR VENV_DIR | sbom SRC_DIR VENV_DIR OUT" >&2
  exit 2
  ;;
esac
