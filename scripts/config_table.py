"""Print the README's configuration table from ``agent.core.config.SETTINGS``.

``python scripts/config_table.py`` prints it; ``--write`` replaces the table between the
``<!-- config-table -->`` markers in README.md. tests/test_readme.py fails when the README
is stale.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent.core.config import SETTINGS  # noqa: E402

BEGIN, END = "<!-- config-table -->", "<!-- /config-table -->"


def _default(s) -> str:
    if callable(s.default):
        return "derived" if s.name != "node_name" else "hostname"
    if s.default in (None, ""):
        return "—"
    if isinstance(s.default, tuple):
        return json.dumps(list(s.default))
    return json.dumps(s.default) if isinstance(s.default, (list, dict)) else str(s.default)


def table() -> str:
    lines = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for s in SETTINGS:
        help_text = s.help.replace("|", "\\|")
        lines.append(f"| `{s.flag}` | `{s.env_name}` | `{_default(s)}` | {help_text} |")
    return "\n".join(lines)


def render_readme(text: str) -> str:
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


if __name__ == "__main__":
    if "--write" in sys.argv:
        readme = ROOT / "README.md"
        readme.write_text(render_readme(readme.read_text()))
    else:
        print(table())
