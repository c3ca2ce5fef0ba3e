#!/usr/bin/env bash
# Create .venv with the project (editable) and its test extra. Idempotent.
# Says what it is doing (a first install downloads and builds for a few minutes); -qq
# keeps pip to errors: setuptools' "Editable installation" banner is a warning.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "install-venv: creating .venv with $("$py" --version 2>&1)"
    "$py" -m venv .venv
fi
echo "install-venv: upgrading pip"
.venv/bin/python -m pip install -qq --upgrade pip
echo "install-venv: installing the project and its test extra (first run: a few minutes)"
.venv/bin/python -m pip install -qq -e '.[test]'
echo "install-venv: done (.venv/bin/ambient-agent)"
