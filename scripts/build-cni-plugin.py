#!/usr/bin/python3.11
"""Build the self-contained ``istio-cni`` plugin: Debian's CPython + the plugin module.

    /usr/bin/python3.11 scripts/build-cni-plugin.py [--out build/istio-cni]

Run it with Debian's own ``python3.11`` (package ``python3.11-minimal``): that interpreter
is what gets bundled, and the ``.pyc`` files are compiled by it, so the bytecode matches.
Needs ``patchelf`` (Debian package). Output (``--out``, replaced whole)::

    bin/python3.11                 Debian's interpreter (libpython linked in), RUNPATH
                                   $ORIGIN/../lib so it loads the bundled libraries
    lib/libz.so.1, libexpat.so.1   its two libraries that are not glibc
    lib/python311.zip              encodings/*, the plugin (cni/plugin*.py) and the stdlib
                                   modules it imports (json on its error path), as
                                   unchecked-hash .pyc
    lib/python3.11/lib-dynload/    the extension modules of that set (_json)
    MANIFEST.json                  sha256 and mode of every file, the Debian package
                                   versions the files came from

CPython finds its prefix from the executable's real location (``lib/python311.zip`` is
its landmark), so the directory works wherever it is copied. The plugin then runs as
``bin/python3.11 -I -S -c "from cni.plugin import exit_main; exit_main()"`` and needs
only glibc (>= 2.35, Debian 12's) from the host: no Python, nothing of the agent.
:mod:`cni.install` copies the directory into the CNI bin dir and writes the launcher
that runs it. Same inputs (the repo's plugin, the same Debian package versions), same
bytes: zip entries are sorted with fixed timestamps and the bytecode is unchecked-hash.
Why this and not PyInstaller/Nuitka/cx_Freeze: docs/cni.md "The plugin binary".
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import marshal
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the plugin's modules: cni/plugin.py imports the other two (and nothing else of cni/)
PLUGIN_SOURCES = {f"cni/{name}": os.path.join(ROOT, "cni", name)
                  for name in ("__init__.py", "plugin.py", "plugin_request.py", "plugin_wire.py")}
LIBS = ("libz.so.1", "libexpat.so.1")  # DT_NEEDED of python3.11 besides glibc's
PACKAGES = ("python3.11-minimal", "libpython3.11-minimal", "libpython3.11-stdlib",
            "zlib1g", "libexpat1")
ZIP_DATE = (1980, 1, 1, 0, 0, 0)
ENTRY = "from cni.plugin import exit_main;exit_main()"


class BuildError(RuntimeError):
    pass


def _pyc(source: bytes, name: str) -> bytes:
    """Unchecked-hash pyc (PEP 552): deterministic, never re-validated against a source."""
    code = compile(source, name, "exec", dont_inherit=True, optimize=0)
    flags = (0b11).to_bytes(4, "little")  # hash-based, check_source=0
    return importlib.util.MAGIC_NUMBER + flags + importlib.util.source_hash(source) + \
        marshal.dumps(code)


# What the plugin imports, also on its error paths (json's error messages). Measured by
# importing them in a clean interpreter rather than by modulefinder, which follows every
# function-level import of the stdlib (asyncio, ctypes, decimal, ...: 10 MB more).
CLOSURE_PROBE = ("import sys; sys.path.insert(0, sys.argv[1]); import cni.plugin, json, time;"
                 "print('\\n'.join(sorted(m.__file__ for m in list(sys.modules.values())"
                 " if getattr(m, '__file__', None))))")


def _stdlib_closure(stdlib: str) -> tuple[dict[str, str], dict[str, str]]:
    """``({arcname.py: source path}, {so name: path})`` of the stdlib modules the plugin
    imports (:data:`CLOSURE_PROBE`), plus the whole ``encodings`` package (which codec a
    run needs depends on the runtime's locale)."""
    r = subprocess.run([sys.executable, "-I", "-S", "-c", CLOSURE_PROBE, ROOT],
                       capture_output=True, text=True, env={"LC_ALL": "C"}, check=True)
    py: dict[str, str] = {}
    so: dict[str, str] = {}
    for path in r.stdout.split():
        if path.endswith(".so"):
            so[os.path.basename(path)] = path
        elif path.startswith(stdlib + os.sep) and path.endswith(".py"):
            py[os.path.relpath(path, stdlib)] = path
    enc = os.path.join(stdlib, "encodings")
    for f in os.listdir(enc):
        if f.endswith(".py"):
            py["encodings/" + f] = os.path.join(enc, f)
    return py, so


def _package_versions() -> dict[str, str]:
    out = {}
    for pkg in PACKAGES:
        r = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", pkg],
                           capture_output=True, text=True)
        if r.returncode != 0 or not r.stdout:
            raise BuildError(f"Debian package {pkg} is not installed: "
                             "apt-get install python3.11-minimal libpython3.11-stdlib")
        out[pkg] = r.stdout
    return out


def _find_lib(name: str) -> str:
    for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu",
              "/usr/lib/aarch64-linux-gnu", "/lib64", "/usr/lib"):
        p = os.path.join(d, name)
        if os.path.exists(p):
            return os.path.realpath(p)
    raise BuildError(f"library {name} not found")


def manifest_of(root: str, packages: dict[str, str]) -> bytes:
    files = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for f in sorted(filenames):
            p = os.path.join(dirpath, f)
            rel = os.path.relpath(p, root)
            if rel == "MANIFEST.json":
                continue
            with open(p, "rb") as fh:
                digest = hashlib.sha256(fh.read()).hexdigest()
            files[rel] = {"sha256": digest, "mode": "%o" % (os.stat(p).st_mode & 0o777)}
    doc = {"entry": ["bin/python3.11", "-I", "-S", "-c", ENTRY], "files": files,
           "packages": packages, "python": sys.version.split()[0]}
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


def build(out: str) -> str:
    """Build into ``out`` (replaced). Returns the bundle id (sha256 of MANIFEST.json)."""
    exe = os.path.realpath(sys.executable)
    if not exe.startswith("/usr/bin/python3.11") or sys.version_info[:2] != (3, 11):
        raise BuildError(f"run this with Debian's /usr/bin/python3.11 (got {exe} "
                         f"{sys.version.split()[0]}): its interpreter is what is bundled")
    if shutil.which("patchelf") is None:
        raise BuildError("patchelf not found: apt-get install patchelf")
    packages = _package_versions()
    stdlib = sysconfig.get_paths()["stdlib"]
    py, so = _stdlib_closure(stdlib)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".istio-cni-build.", dir=parent)
    try:
        os.makedirs(os.path.join(tmp, "bin"))
        dynload = os.path.join(tmp, "lib", "python3.11", "lib-dynload")
        os.makedirs(dynload)
        shutil.copyfile(exe, os.path.join(tmp, "bin", "python3.11"))
        subprocess.run(["patchelf", "--set-rpath", "$ORIGIN/../lib",
                        os.path.join(tmp, "bin", "python3.11")], check=True)
        for lib in LIBS:
            shutil.copyfile(_find_lib(lib), os.path.join(tmp, "lib", lib))
        for name, path in sorted(so.items()):
            shutil.copyfile(path, os.path.join(dynload, name))
        with zipfile.ZipFile(os.path.join(tmp, "lib", "python311.zip"), "w",
                             zipfile.ZIP_STORED) as zf:
            entries = {**{k: v for k, v in py.items()}, **PLUGIN_SOURCES}
            for arc in sorted(entries):
                with open(entries[arc], "rb") as fh:
                    source = fh.read()
                info = zipfile.ZipInfo(arc + "c", ZIP_DATE)
                info.external_attr = 0o644 << 16
                zf.writestr(info, _pyc(source, arc))
        for dirpath, _dirnames, filenames in os.walk(tmp):
            os.chmod(dirpath, 0o755)
            for f in filenames:
                p = os.path.join(dirpath, f)
                os.chmod(p, 0o755 if p.endswith("/bin/python3.11") else 0o644)
        manifest = manifest_of(tmp, packages)
        with open(os.path.join(tmp, "MANIFEST.json"), "wb") as fh:
            fh.write(manifest)
        os.chmod(os.path.join(tmp, "MANIFEST.json"), 0o644)
        _smoke(tmp)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return hashlib.sha256(manifest).hexdigest()


def _smoke(bundle: str) -> None:
    """The bundle answers VERSION with an empty environment besides CNI_COMMAND."""
    argv = [os.path.join(bundle, "bin", "python3.11"), "-I", "-S", "-c", ENTRY]
    r = subprocess.run(argv, env={"CNI_COMMAND": "VERSION"}, input=b"", capture_output=True)
    if r.returncode != 0 or b"supportedVersions" not in r.stdout or r.stderr:
        raise BuildError(f"built plugin does not answer VERSION: exit {r.returncode}, "
                         f"stdout {r.stdout[:200]!r}, stderr {r.stderr[:500]!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "build", "istio-cni"),
                   help="output directory (replaced; default build/istio-cni)")
    args = p.parse_args(argv)
    try:
        bundle_id = build(args.out)
    except (BuildError, OSError, subprocess.CalledProcessError) as e:
        print(f"build-cni-plugin: {e}", file=sys.stderr)
        return 1
    print(f"built {args.out} (bundle {bundle_id[:16]})")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
