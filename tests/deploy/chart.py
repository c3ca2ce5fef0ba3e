"""The real ``helm`` for the chart tests (scripts/helm-build.sh), or why there is none.

:func:`helm_or_skip` returns the cached binary's path; when it is not built the test
skips, or fails when ``AMBIENT_REQUIRE_HELM`` is set (``.ci/run`` builds helm first and
sets it, as it does ``AMBIENT_REQUIRE_KUBE`` for the API server).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "helm-build.sh"


def helm_or_skip() -> str:
    if os.environ.get("HELM"):
        return os.environ["HELM"]
    r = subprocess.run(["bash", str(SCRIPT), "path"], capture_output=True, text=True)
    if r.returncode == 0:
        return r.stdout.strip()
    why = f"no helm: {r.stderr.strip()}"
    if os.environ.get("AMBIENT_REQUIRE_HELM"):
        pytest.fail(f"{why} (AMBIENT_REQUIRE_HELM is set: .ci/run builds it)")
    pytest.skip(why)
