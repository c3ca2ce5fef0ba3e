"""Every module of the project imports first, on its own: no import cycle hides behind an
import order that happens to work (``cni.kubeevents`` once failed when imported before
``cni.enrollment``). One interpreter: before each module, the project's own modules are
dropped from ``sys.modules`` (third-party ones stay loaded, so this is quick)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("agent", "ambient", "cni", "zds")

SCRIPT = r"""
import importlib, sys, traceback
packages = tuple(sys.argv[1].split(","))
failed = []
for name in sys.argv[2:]:
    for m in [m for m in sys.modules if m.split(".")[0] in packages]:
        del sys.modules[m]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc(limit=3).strip().splitlines()[-1])
print("\n".join(failed))
sys.exit(1 if failed else 0)
"""


def _modules() -> list[str]:
    names = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__main__":
                continue  # runs the program when imported
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_every_module_imports_first():
    modules = _modules()
    assert len(modules) > 100, modules  # the walk found the project
    p = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(PACKAGES), *modules],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"modules that fail when imported first:\n{p.stdout}{p.stderr}"
