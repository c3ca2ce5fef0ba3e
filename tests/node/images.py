"""Container images for the real node, made here (no registry is reachable from CI).

:func:`docker_archive` writes a one-layer image in the ``docker save`` archive format
(``manifest.json`` naming the config and the layer tars, ``RepoTags`` naming the image),
which ``ctr images import`` reads; :func:`pause_image` holds the static ``pause`` program
scripts/kube-test-node.sh builds (the pod sandbox's process); :func:`busybox_image`
holds Debian's static busybox and an ``index.html`` for its httpd (the test pods).
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

BUSYBOX = "/bin/busybox"  # Debian's busybox-static


def _add(tar: tarfile.TarFile, name: str, data: bytes | None = None, mode: int = 0o644,
         kind: bytes = tarfile.REGTYPE, link: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.mode = mode
    info.type = kind
    info.linkname = link
    info.size = len(data) if data is not None else 0
    tar.addfile(info, io.BytesIO(data) if data is not None else None)


def _layer(files: dict[str, bytes | tuple[bytes, int] | str]) -> bytes:
    """An uncompressed layer tar: ``path -> bytes`` (0644), ``(bytes, mode)``, or a str
    (a symlink target). Parent directories are added (0755)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs: set[str] = set()
        for path in sorted(files):
            parts = path.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                d = "/".join(parts[:i])
                if d and d not in dirs:
                    dirs.add(d)
                    _add(tar, d + "/", mode=0o755, kind=tarfile.DIRTYPE)
            value = files[path]
            if isinstance(value, str):
                _add(tar, path, mode=0o777, kind=tarfile.SYMTYPE, link=value)
            elif isinstance(value, tuple):
                _add(tar, path, value[0], mode=value[1])
            else:
                _add(tar, path, value)
    return buf.getvalue()


def docker_archive(out: Path, ref: str, files: dict, entrypoint: list[str],
                   cmd: list[str] | None = None) -> Path:
    """Write image ``ref`` (``localhost/name:tag``) with one layer of ``files`` to ``out``
    (a tar in ``docker save`` format); returns ``out``."""
    layer = _layer(files)
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": entrypoint, "Cmd": cmd or [],
                   "Env": ["PATH=/bin:/usr/bin:/sbin:/usr/sbin"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": "tests/node/images.py"}],
    }, sort_keys=True).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [ref],
                            "Layers": ["layer/layer.tar"]}]).encode()
    with tarfile.open(out, "w") as tar:
        _add(tar, "layer/", mode=0o755, kind=tarfile.DIRTYPE)
        _add(tar, "layer/layer.tar", layer)
        _add(tar, config_name, config)
        _add(tar, "manifest.json", manifest)
    return out


def pause_image(out: Path, ref: str, pause_binary: Path) -> Path:
    return docker_archive(out, ref, {"pause": (pause_binary.read_bytes(), 0o755)},
                          ["/pause"])


def busybox_image(out: Path, ref: str) -> Path:
    """busybox at /bin/busybox, /bin/sh a link to it, /www/index.html for httpd."""
    return docker_archive(out, ref, {
        "bin/busybox": (Path(BUSYBOX).read_bytes(), 0o755),
        "bin/sh": "busybox",
        "www/index.html": b"ok\n",
        "etc/passwd": b"root:x:0:0:root:/:/bin/sh\n",
        "etc/group": b"root:x:0:\n",
        "tmp/.keep": b"",
    }, ["/bin/busybox"], ["sleep", "3600"])
