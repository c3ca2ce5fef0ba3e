"""The ``istio-cni`` binary :mod:`cni.install` writes: the POSIX ``sh`` launcher
(:func:`launcher_text` for a development checkout, :func:`bundle_launcher_text` for a
standalone build) and the standalone build's copy into the bin dir (:func:`read_bundle`,
:func:`copy_bundle`). Same inputs, same bytes, so a reinstall with nothing changed
writes nothing. Why the launcher answers ``VERSION`` itself: :func:`_launcher`.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shlex
import shutil
import sys

PLUGIN_NAME = "istio-cni"
PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


BUNDLE_DIR = PLUGIN_NAME + ".d"  # <bin dir>/istio-cni.d/<bundle id>/: standalone builds
ENTRY_CODE = "from cni.plugin import exit_main;exit_main()"


def launcher_text(python: str = sys.executable, project_root: str = PROJECT_ROOT) -> str:
    """The development launcher: runs the plugin on ``python`` with ``project_root`` on
    ``sys.path`` (this agent's own interpreter and checkout: the node must have them).

    Same inputs, same bytes. See :func:`_launcher` for what the script does.
    """
    code = f"import sys;sys.path.insert(0,{project_root!r});{ENTRY_CODE}"
    return _launcher(f"{shlex.quote(python)} -I -S -c {shlex.quote(code)}",
                     "runs the Python plugin of the agent's own checkout")


def bundle_launcher_text(bundle_id: str) -> str:
    """The launcher of a standalone build installed at ``<its dir>/istio-cni.d/<id>``.

    The script finds its own directory from ``$0`` (runtimes exec plugins by path), so it
    is the same whatever the host bin dir is and wherever the agent's container mounts
    it. See :func:`_launcher`.
    """
    python = f'"$d/{BUNDLE_DIR}/{bundle_id}/bin/python3.11"'
    preamble = ('case $0 in */*) self=$0 ;; *) self=$(command -v -- "$0") ;; esac\n'
                'd=${self%/*}\n')
    return _launcher(f"{python} -I -S -c {shlex.quote(ENTRY_CODE)}",
                     f"runs the standalone build {BUNDLE_DIR}/{bundle_id} (no Python "
                     "needed on the node)", preamble)


def _launcher(run: str, what: str, preamble: str = "") -> str:
    """A POSIX ``sh`` script: ``CNI_COMMAND=VERSION`` is answered by the shell when the
    request has the shape libcni sends (``{"cniVersion":"V"}``, or empty stdin) and
    ``CNI_IFNAME`` is plainly valid: it prints what :func:`cni.plugin.main` prints, in
    ~1 ms instead of a ~8 ms interpreter start (runtimes ask VERSION before ADD and
    before DEL). Any other request, and every other command, ``exec``s ``run`` (a Python
    ``-I -S`` running :func:`cni.plugin.exit_main`) with the same arguments, environment
    and stdin bytes. One difference: ``sh`` drops NUL bytes from a VERSION request's
    stdin (an invalid network config either way: Python says code 6, the shell may
    answer the version).
    """
    from cni.plugin_request import LATEST_VERSION, SUPPORTED_VERSIONS

    supported = ",".join(f'"{v}"' for v in SUPPORTED_VERSIONS)
    return f"""#!/bin/sh
# istio-cni: written by `ambient-agent cni install` (cni/install.py); {what}.
# VERSION is answered here; everything else runs the Python plugin with the standard
# library only (-I: no PYTHON* env, no user site; -S: no site, no .pth files).
{preamble}if [ "${{CNI_COMMAND-}}" = VERSION ] && [ "$#" = 0 ]; then
  case ${{CNI_IFNAME-}} in
    .|..|*[!A-Za-z0-9_.-]*) ;;
    *) if [ "${{#CNI_IFNAME}}" -le 15 ]; then
      v={LATEST_VERSION}
      if ! [ -t 0 ]; then
        # the request, byte for byte (a last line without newline included)
        req=
        while IFS= read -r line; do req="$req$line
"; done
        req="$req$line"
        body=${{req%
}}
        case $body in
          '') ;;
          '{{"cniVersion":"'*'"}}') v=${{body#'{{"cniVersion":"'}}; v=${{v%'"}}'}} ;;
          '{{"cniVersion": "'*'"}}') v=${{body#'{{"cniVersion": "'}}; v=${{v%'"}}'}} ;;
          *) v= ;;
        esac
        case $v in
          ''|*[!A-Za-z0-9._+-]*)
            printf '%s' "$req" | exec {run} "$@"
            exit ;;
        esac
      fi
      printf '{{"cniVersion":"%s","supportedVersions":[{supported}]}}\\n' "$v"
      exit 0
    fi ;;
  esac
fi
exec {run} "$@"
"""


class BundleError(RuntimeError):
    """The standalone plugin build (setting ``cni_plugin_bundle``) is missing or damaged."""


def read_bundle(bundle: str) -> tuple[str, dict]:
    """``(bundle id, manifest)`` of a build of ``scripts/build-cni-plugin.py``; the id is
    the sha256 (first 16 hex digits) of its ``MANIFEST.json``. Raises :class:`BundleError`
    naming the path."""
    path = os.path.join(bundle, "MANIFEST.json")
    try:
        with open(path, "rb") as f:
            raw = f.read()
        manifest = json.loads(raw)
        files = manifest["files"]
        if not isinstance(files, dict) or "bin/python3.11" not in files:
            raise ValueError("no bin/python3.11 in its file list")
    except FileNotFoundError:
        raise BundleError(f"cni_plugin_bundle {bundle!r}: no MANIFEST.json (build it with "
                          "scripts/build-cni-plugin.py)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BundleError(f"cni_plugin_bundle {bundle!r}: bad MANIFEST.json: {e}") from None
    return hashlib.sha256(raw).hexdigest()[:16], manifest


def copy_bundle(bundle: str, dest_root: str) -> tuple[str, bool]:
    """Copy the build ``bundle`` to ``<dest_root>/<id>`` as one rename: every file is
    written to ``<dest_root>/.tmp.<random>/``, checked against the manifest's sha256 and
    mode and fsynced, then the directory is renamed into place, so a launcher never
    points at a partial copy. Returns ``(id, copied)``; an existing complete copy is
    kept. Raises :class:`BundleError` when a file is missing or differs from its manifest.
    """
    bundle_id, manifest = read_bundle(bundle)
    final = os.path.join(dest_root, bundle_id)
    if os.path.isfile(os.path.join(final, "MANIFEST.json")):
        return bundle_id, False
    if os.path.lexists(final):  # not made by us (our copies appear whole): replace it
        shutil.rmtree(final) if os.path.isdir(final) else os.unlink(final)
    os.makedirs(dest_root, mode=0o755, exist_ok=True)
    tmp = os.path.join(dest_root, f".tmp.{secrets.token_hex(4)}")
    os.mkdir(tmp, 0o755)
    try:
        for rel in sorted(manifest["files"]) + ["MANIFEST.json"]:
            src, dst = os.path.join(bundle, rel), os.path.join(tmp, rel)
            os.makedirs(os.path.dirname(dst), mode=0o755, exist_ok=True)
            try:
                with open(src, "rb") as f:
                    data = f.read()
            except OSError as e:
                raise BundleError(f"cni_plugin_bundle {bundle!r}: {rel}: {e.strerror}") from None
            entry = manifest["files"].get(rel)
            mode = 0o644
            if entry is not None:
                if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
                    raise BundleError(f"cni_plugin_bundle {bundle!r}: {rel} differs from "
                                      "its MANIFEST.json sha256 (damaged build?)")
                mode = int(entry.get("mode", "644"), 8) & 0o755
            fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                os.fchmod(f.fileno(), mode)
                os.fsync(f.fileno())
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return bundle_id, True


def read_file(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None
