#!/usr/bin/env python3
"""Regenerate the committed Python modules for the wire-contract protos.

Usage: ``python scripts/gen_protos.py [OUTPUT_ROOT]`` (default: the repo root).

Sources live under ``proto/`` and are compiled with ``-Iproto`` so generated
imports are package-relative (``from ambient import workload_pb2``) and each
module lands next to its users:

    proto/zds/zds.proto                -> zds/zds_pb2.py{,i}
    proto/ambient/workload.proto       -> ambient/workload_pb2.py{,i}
    proto/ambient/authorization.proto  -> ambient/authorization_pb2.py{,i}
    proto/agent/sds/ca.proto           -> agent/sds/ca_pb2.py{,i}, agent/sds/ca_pb2_grpc.py

Output is deterministic for a given grpcio-tools version; tests/test_protos.py
regenerates into a temporary directory and fails on any byte difference.
Raises ``subprocess.CalledProcessError`` if protoc rejects a file.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"

# Message-only protos (no services).
MESSAGE_PROTOS = (
    "zds/zds.proto",
    "ambient/workload.proto",
    "ambient/authorization.proto",
)
# Protos that also get gRPC stubs.
GRPC_PROTOS = ("agent/sds/ca.proto",)


def generated_files() -> list[str]:
    """Return the repo-relative paths of every generated module, sorted."""
    out = []
    for proto in MESSAGE_PROTOS + GRPC_PROTOS:
        stem = proto[: -len(".proto")]
        out += [f"{stem}_pb2.py", f"{stem}_pb2.pyi"]
        if proto in GRPC_PROTOS:
            out.append(f"{stem}_pb2_grpc.py")
    return sorted(out)


def _protoc(out_root: Path, protos: tuple[str, ...], grpc: bool) -> None:
    args = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
    ]
    if grpc:
        args.append(f"--grpc_python_out={out_root}")
    args += [str(PROTO_ROOT / p) for p in protos]
    subprocess.run(args, check=True, cwd=REPO_ROOT)


def generate(out_root: Path | str = REPO_ROOT) -> list[Path]:
    """Generate all modules under ``out_root``; return the generated paths."""
    out_root = Path(out_root).resolve()
    out_root.mkdir(parents=True, exist_ok=True)
    _protoc(out_root, MESSAGE_PROTOS, grpc=False)
    _protoc(out_root, GRPC_PROTOS, grpc=True)
    return [out_root / f for f in generated_files()]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) > 1:
        print(__doc__, file=sys.stderr)
        return 2
    for path in generate(argv[0] if argv else REPO_ROOT):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
