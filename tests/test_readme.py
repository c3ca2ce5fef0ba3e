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
    assert command in ci.splitlines()
