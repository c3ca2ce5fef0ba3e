"""Rootful podman as a CNI runtime, the way it works on this kind of host.

podman 4.3 with the CNI backend (``docs/maintainers/testing.md``) runs containers here only
with ``runc`` (crun refuses hybrid cgroups), with NOFILE/NPROC ulimits below the
sandbox's hard limits and with the ``cni`` network backend. :func:`write_containers_conf`
writes such a ``containers.conf``; :class:`Podman` runs every command with
``CONTAINERS_CONF`` pointing at it, so the host's podman and CNI configuration (its
``/etc/containers``, ``/etc/cni/net.d``) are never read or changed. Networks come from
``network_config_dir`` (a conflist's ``name`` is the podman network name); plugins are
looked up in ``cni_plugin_dirs`` in order.

What podman's CNI call carries (libpod ``GetCNIArgs``): ``CNI_CONTAINERID`` = the
container ID, ``CNI_ARGS`` = ``IgnoreUnknown=1;K8S_POD_NAME=<container name>`` (no
namespace, no UID), ``CNI_NETNS`` = ``/run/netns/netns-<uuid>``; ADD runs in
``podman start``/``run``, DEL (with the cached ``prevResult``) in ``stop``/``rm``.

Images come from no registry: :meth:`Podman.import_busybox` imports a rootfs made of
Debian's static busybox (``podman import``, ~0.2 s).

Every call blocks (``subprocess.run``); async callers run them in a worker thread.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
from typing import Iterable

BUSYBOX = "/bin/busybox"
DEFAULT_TIMEOUT = 120.0  # seconds; a CNI ADD waits for the agent's enrollment


class PodmanError(RuntimeError):
    """A podman command failed; the message has the command and podman's stderr.
    ``returncode``: podman's exit status (negative: killed by that signal; None: timed
    out)."""

    def __init__(self, message: str, returncode: int | None = None):
        super().__init__(message)
        self.returncode = returncode


def available() -> bool:
    """True when ``podman`` and ``runc`` are on PATH (the only runtime that works here)."""
    return shutil.which("podman") is not None and shutil.which("runc") is not None


def write_containers_conf(path: str | os.PathLike, plugin_dirs: Iterable[str],
                          network_config_dir: str | os.PathLike) -> None:
    """Write a ``containers.conf`` for rootful podman with the CNI backend (what
    works on this machine): runc, cgroupfs, file event logger, ulimits nofile/nproc, CNI
    networks from
    ``network_config_dir``, plugins from ``plugin_dirs`` (searched in order)."""
    dirs = ", ".join(json.dumps(str(d)) for d in plugin_dirs)
    text = f"""[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1000:1000"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
[network]
network_backend = "cni"
cni_plugin_dirs = [{dirs}]
network_config_dir = {json.dumps(str(network_config_dir))}
"""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def busybox_rootfs_tar() -> bytes:
    """An uncompressed tar of ``/bin/busybox`` and ``/bin/sh -> busybox``.

    Raises PodmanError when ``/bin/busybox`` is missing (Debian ``busybox-static``)."""
    if not os.access(BUSYBOX, os.X_OK):
        raise PodmanError(f"{BUSYBOX} not found: install Debian's busybox-static")
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        bindir = tarfile.TarInfo("bin")
        bindir.type, bindir.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(bindir)
        tar.add(BUSYBOX, arcname="bin/busybox")
        link = tarfile.TarInfo("bin/sh")
        link.type, link.linkname = tarfile.SYMTYPE, "busybox"
        tar.addfile(link)
    return out.getvalue()


class Podman:
    """podman with a private ``containers.conf``. ``conf``: its path (see
    :func:`write_containers_conf`), or None for the host's configuration (enough for
    queries such as ``ps``/``image exists``: rootful storage is the same)."""

    def __init__(self, conf: str | os.PathLike | None):
        self.conf = str(conf) if conf is not None else None
        self.env = dict(os.environ)
        if self.conf is None:
            self.env.pop("CONTAINERS_CONF", None)
        else:
            self.env["CONTAINERS_CONF"] = self.conf

    def run(self, *args: str, input: bytes | None = None,
            timeout: float = DEFAULT_TIMEOUT, check: bool = True,
            idempotent: bool = False) -> str:
        """``podman <args>``; returns stdout (stripped). Raises PodmanError with podman's
        stderr when it exits non-zero (unless ``check`` is false) or times out.
        ``idempotent``: a command killed by a signal is run once more. Each command gets
        a session of its own, but a Ctrl-C sent to the demo's group between the fork and
        the child's ``setsid`` can stay pending in the child and kill it once it runs
        (seen: a teardown's ``podman rm`` exited -2 on a second Ctrl-C, leaving the
        container and its image behind)."""
        try:
            return self._run_once(args, input, timeout, check)
        except PodmanError as e:
            if not idempotent or e.returncode is None or e.returncode >= 0:
                raise
        return self._run_once(args, input, timeout, check)

    def _run_once(self, args: tuple[str, ...], input: bytes | None, timeout: float,
                  check: bool) -> str:
        cmd = ["podman", *args]
        try:
            # a session of its own: a Ctrl-C at the terminal (SIGINT to the whole
            # foreground group) must not kill the podman rm of the demo's teardown
            r = subprocess.run(cmd, input=input, env=self.env, capture_output=True,
                               timeout=timeout, start_new_session=True)
        except subprocess.TimeoutExpired:
            raise PodmanError(f"{' '.join(cmd)}: timed out after {timeout:.0f}s") from None
        if check and r.returncode != 0:
            err = r.stderr.decode(errors="replace").strip()
            raise PodmanError(f"{' '.join(cmd)}: exit {r.returncode}: {err}", r.returncode)
        return r.stdout.decode(errors="replace").strip()

    def import_busybox(self, image: str) -> None:
        """Import the busybox rootfs as ``image`` (e.g. ``localhost/bb:tag``)."""
        self.run("import", "-", image, input=busybox_rootfs_tar())

    def image_exists(self, image: str) -> bool:
        """``podman image exists`` (exit 0 yes, 1 no)."""
        r = subprocess.run(["podman", "image", "exists", image], env=self.env,
                           capture_output=True, timeout=DEFAULT_TIMEOUT, start_new_session=True)
        return r.returncode == 0

    def create(self, name: str, network: str, image: str, *cmd: str,
               labels: dict[str, str] | None = None) -> str:
        """``podman create``; returns the container ID (64 hex digits)."""
        flags = [f"--label={k}={v}" for k, v in (labels or {}).items()]
        return self.run("create", "--name", name, "--network", network, *flags, image, *cmd)

    def start(self, container: str) -> None:
        """``podman start``: the network (CNI ADD) is set up before it returns."""
        self.run("start", container)

    def inspect(self, container: str) -> dict:
        """The container's ``podman inspect`` object (raises PodmanError if unknown)."""
        data = json.loads(self.run("inspect", "--type", "container", container))
        return data[0]

    def netns_and_ip(self, container: str, network: str) -> tuple[str, str]:
        """``(netns path, IPv4 address on network)`` of a running container."""
        c = self.inspect(container)
        settings = c.get("NetworkSettings") or {}
        netns = settings.get("SandboxKey") or ""
        ip = ((settings.get("Networks") or {}).get(network) or {}).get("IPAddress") or ""
        if not netns or not ip:
            raise PodmanError(f"container {container} has no netns or no IP on network "
                              f"{network!r} (SandboxKey={netns!r}, IPAddress={ip!r})")
        return netns, ip

    def remove(self, container: str) -> None:
        """``podman rm -f -t 0``: kill at once (busybox as PID 1 ignores SIGTERM), CNI
        DEL, remove. A container that is already gone is not an error."""
        self.run("rm", "-f", "-t", "0", "--ignore", container, idempotent=True)

    def remove_image(self, image: str) -> None:
        self.run("rmi", image, idempotent=True)

    def containers(self, label: str) -> list[str]:
        """Names of every container (any state) carrying ``label`` (``key=value``)."""
        out = self.run("ps", "-a", "--filter", f"label={label}", "--format", "{{.Names}}")
        return [line for line in out.splitlines() if line.strip()]
