#!/usr/bin/env bash
# Static checks CI runs before the tests (docs/maintainers/code-checks.md): ruff (lint),
# lint-imports (the package layers declared in pyproject.toml), mypy (types) and vulture
# (dead code; false positives in scripts/vulture_whitelist.py). Each
# tool reads its configuration from pyproject.toml. Exit status: the first failing tool's.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=.venv/bin
echo "ruff:"; "$bin/ruff" check .
echo "import contracts:"; "$bin/lint-imports"
echo "mypy:"; "$bin/mypy"
echo "dead code:"; "$bin/vulture"
