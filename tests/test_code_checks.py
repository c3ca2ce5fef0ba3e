"""The static checks CI runs before the tests (``scripts/check-code.sh``: ruff, the import
contracts, mypy) also run here, so the suite a change must pass before it lands covers
them. Configuration and what each holds: ``docs/maintainers/code-checks.md``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@pytest.mark.parametrize("tool, argv", [
    ("ruff", ["ruff", "check", "--no-cache", "."]),
    ("import contracts", ["lint-imports", "--no-cache"]),
    ("mypy", ["mypy", "--cache-dir", os.devnull]),
])
def test_static_check_passes(tool, argv):
    exe = BIN / argv[0]
    if not exe.exists():
        pytest.fail(f"{argv[0]} is not installed in {BIN}: reinstall the test extra "
                    "(bash scripts/install-venv.sh)")
    done = subprocess.run([str(exe), *argv[1:]], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, f"{tool} failed:\n{done.stdout}\n{done.stderr}"
