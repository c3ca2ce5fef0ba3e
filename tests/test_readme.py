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


def test_listening_ports_table_names_every_default_tcp_listener():
    """Every TCP port the agent listens on with its defaults is a row of the "It listens
    on" table, with where it binds (a newuser finding: 15014 was missing)."""
    import os

    from agent.core import config as agent_config

    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("It listens on"):]
    table = table[:table.index("\n\n", table.index("|"))]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| (\d+) \| ([^|]+) \|", table, re.M)}
    cfg = agent_config.load(flags={"config_file": os.devnull}, env={})
    for setting, address, port in agent_config.tcp_listeners(cfg):
        assert str(port) in rows, f"{setting} {port} missing from README's listening table"
        want = "127.0.0.1" if address == "127.0.0.1" else "all addresses"
        assert rows[str(port)].startswith(want), (setting, port, rows[str(port)])
