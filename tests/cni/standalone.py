"""Helpers for tests of the standalone plugin build (scripts/build-cni-plugin.py).

``build_bundle`` runs the repo's build script with Debian's interpreter, exactly as the
image build does. ``glibc_busybox_root`` makes a directory tree holding only the files of
Debian's ``libc6`` package and a static busybox (with its applet links): a node with no
Python at all, where the plugin is run under ``chroot``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "scripts" / "build-cni-plugin.py"
DEBIAN_PYTHON = "/usr/bin/python3.11"


def missing_build_tools() -> str:
    """Why the build can't run here ("" when it can)."""
    if not os.path.exists(DEBIAN_PYTHON):
        return f"{DEBIAN_PYTHON} (Debian python3.11-minimal) missing"
    if shutil.which("patchelf") is None:
        return "patchelf missing (scripts/install-system-deps.sh installs it)"
    return ""


def build_bundle(out: Path) -> Path:
    r = subprocess.run([DEBIAN_PYTHON, str(BUILD_SCRIPT), "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1] == str(out)
    return out


def missing_chroot_tools() -> str:
    if os.geteuid() != 0:
        return "needs root (chroot)"
    if not os.path.exists("/bin/busybox"):
        return "busybox-static missing"
    if subprocess.run(["dpkg-query", "-W", "libc6"], capture_output=True).returncode:
        return "dpkg has no libc6"
    return ""


def _copy_into(root: Path, path: str) -> None:
    """Copy host file ``path`` to ``root/path``: real directories on the way (a merged-/usr
    host has /lib and /lib64 as symlinks), a symlink kept when it names a file in the
    same directory (``libc.so`` style), otherwise the file's content."""
    dest = root / path.lstrip("/")
    if os.path.lexists(dest) or not os.path.isfile(path):
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    if os.path.islink(path) and "/" not in os.readlink(path):
        os.symlink(os.readlink(path), dest)
    else:
        shutil.copy2(os.path.realpath(path), dest)


def glibc_busybox_root(root: Path) -> Path:
    """A root with only Debian's libc6 files and /bin/busybox (+ applet symlinks)."""
    files = subprocess.run(["dpkg-query", "-L", "libc6"], capture_output=True, text=True,
                           check=True).stdout.split("\n")
    for path in files:
        if path and path != "/.":
            _copy_into(root, path)
    # the ELF interpreter every glibc program names
    for interp in ("/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-aarch64.so.1"):
        if os.path.exists(interp):
            _copy_into(root, interp)
    (root / "bin").mkdir(exist_ok=True)
    shutil.copy2("/bin/busybox", root / "bin" / "busybox")
    subprocess.run([shutil.which("chroot") or "/usr/sbin/chroot", str(root), "/bin/busybox", "--install", "-s", "/bin"],
                   check=True, capture_output=True)
    for d in ("tmp", "run", "dev", "proc", "opt/cni/bin"):
        (root / d).mkdir(parents=True, exist_ok=True)
    return root


def python_files(root: Path) -> list[str]:
    """Every python interpreter or stdlib directory under ``root`` outside ``/opt/cni``."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel.startswith("opt/cni"):
            dirnames[:] = []
            continue
        found += [os.path.join(rel, n) for n in filenames + dirnames if n.startswith("python")]
    return found
