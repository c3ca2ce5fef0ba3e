"""The README stays true: its configuration table matches the settings, and its test
command is the one .ci/run runs."""

from __future__ import annotations

import re
from pathlib import Path

from scripts.config_table import render_readme

ROOT = Path(__file__).resolve().parent.parent


def test_config_table_current():
    text = (ROOT / "README.md").read_text()
    assert render_readme(text) == text, "README config table is stale: python scripts/config_table.py --write"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r"Run the tests:\s*\n\s*\n\s+(.+)\n", readme).group(1).strip()
    # .ci/run may add reporting flags (-rs: list the skips), nothing that selects tests
    runs = [line for line in ci.splitlines() if line == command or line.startswith(command + " ")]
    assert runs, f"{command!r} not run by .ci/run"
    assert all(re.fullmatch(r"( -r\w+)*( \|\| rc=\$\?)?", line[len(command):]) for line in runs), runs
