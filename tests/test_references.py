"""Everything a maintainer needs is in the repository: no reference that does not resolve.

Scans every tracked text file (code, docs, scripts, manifests) and fails, naming file and
line, on:

- a ``§`` section reference (they pointed at specification files kept outside the
  repository); RFC sections (``RFC 9113 §3.4``) are public and allowed;
- a mention of ``DESIGN.md`` or of a ``spec/`` document;
- a ``*.md`` path that names no file: tried against the repository root, ``docs/`` and the
  mentioning file's own directory. Upstream paths (``istio/istio:…``, ``istio/ztunnel:…``)
  are not ours to check and are skipped.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUFFIXES = {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt", ".service", ".cfg", ".ini"}
SECTION = re.compile(r"§")
RFC_SECTION = re.compile(r"RFC \d+ §[\d.]+(?:\s*,\s*§[\d.]+)*")
OUTSIDE = re.compile(r"DESIGN\.md|\bspec/[\w./-]+")
MD_PATH = re.compile(r"(?<![\w:/.-])([\w.-]+(?:/[\w.-]+)*\.md)\b")
UPSTREAM = re.compile(r"(?:istio/istio|istio/ztunnel|istio/api|envoyproxy/\w+)(?::|/)[\w./-]*\.md")


def _tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    files = [ROOT / name for name in out.stdout.decode().split("\0") if name]
    return [f for f in files if f.suffix in SUFFIXES and f.is_file()
            and not f.name.endswith(("_pb2.py", "_pb2_grpc.py"))]


def _resolves(mention: str, where: Path) -> bool:
    return any((base / mention).is_file() for base in (ROOT, ROOT / "docs", where.parent))


def problems(path: Path) -> list[str]:
    """Every unresolvable reference in ``path``, as ``file:line: what``."""
    found = []
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if SECTION.search(RFC_SECTION.sub("", line)):
            found.append(f"{rel}:{number}: section reference to a document outside the repository")
        for hit in OUTSIDE.finditer(line):
            found.append(f"{rel}:{number}: {hit.group(0)!r} is not in the repository")
        for hit in MD_PATH.finditer(UPSTREAM.sub("", line)):
            if not _resolves(hit.group(1), path):
                found.append(f"{rel}:{number}: {hit.group(1)!r} names no file")
    return found


def test_scan_sees_the_repository():
    files = _tracked_files()
    assert len(files) > 200
    assert ROOT / "docs" / "architecture.md" in files or ROOT / "docs" / "zds.md" in files


def test_every_reference_resolves():
    found = [p for f in _tracked_files() if f != Path(__file__) for p in problems(f)]
    assert not found, "unresolvable references:\n" + "\n".join(found)


def test_checker_catches_each_kind(tmp_path):
    """The rules themselves: each bad form is reported, the good forms are not."""
    probe = tmp_path / "probe.md"
    probe.write_text("see cni-zds.md §3.1\nDESIGN.md\nspec/x.md\ndocs/nope.md\n"
                     "RFC 9113 §9.2.2 ok\ndocs/zds.md ok\nistio/istio:cni/README.md ok\n")
    found = problems(probe)
    kinds = [p.split(": ", 1)[1] for p in found]
    assert kinds == [
        "section reference to a document outside the repository",
        "'cni-zds.md' names no file",
        "'DESIGN.md' is not in the repository",
        "'DESIGN.md' names no file",
        "'spec/x.md' is not in the repository",
        "'spec/x.md' names no file",
        "'docs/nope.md' names no file",
    ], kinds
