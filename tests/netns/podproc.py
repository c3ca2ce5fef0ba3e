"""Real processes that belong to a netns "pod" the way a kubelet's do.

A :class:`PodProcesses` starts a real process (``sleep``) inside a pod's netns
(``ip netns exec``) and moves it into a real cgroup laid out like the kubelet's
cgroupfs driver, ``<root>/kubepods/besteffort/pod<uid>/<container id>``, so that
``/proc/<pid>/cgroup`` and ``/proc/<pid>/ns/net`` map the process to the pod exactly as
on a node: what the agent's ``/proc`` scan (``cni.podnetns.scan``) reads. The cgroup
hierarchy is the machine's cgroup v2 mount when there is one (a fresh Debian 12:
``/sys/fs/cgroup``; hybrid hosts: ``/sys/fs/cgroup/unified``), else a v1 hierarchy
without controllers to configure (``pids``, ``name=systemd``).

``close()`` kills every process and removes every cgroup it made (processes still in
them are moved back to the hierarchy's root first), also after a failed test. Needs
root; :func:`cgroup_root` returns None when no hierarchy is writable (callers skip).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time

from tests.netns.toolkit import Pod


def _mounts() -> list[tuple[str, str, str]]:
    out = []
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 4:
                out.append((parts[1], parts[2], parts[3]))
    return out


def cgroup_root() -> str | None:
    """A cgroup hierarchy we can make child groups in, or None."""
    mounts = _mounts()
    candidates = [m for m, fs, _ in mounts if fs == "cgroup2"]
    candidates += [m for m, fs, opts in mounts if fs == "cgroup"
                   and ("pids" in opts.split(",") or "name=systemd" in opts.split(","))]
    for path in candidates:
        probe = os.path.join(path, f"ambient-probe-{secrets.token_hex(4)}")
        try:
            os.mkdir(probe)
            os.rmdir(probe)
            return path
        except OSError:
            continue
    return None


class PodProcesses:
    """Processes in pod netns and pod cgroups; see the module docstring."""

    def __init__(self, root: str):
        self.root = root
        self.base = os.path.join(root, f"ambient-test-{secrets.token_hex(4)}")
        self.procs: list[subprocess.Popen] = []
        self.dirs: list[str] = []

    def start(self, pod: Pod, uid: str | None = None) -> int:
        """A process in ``pod``'s netns, in the cgroup of pod ``uid`` (default: the pod's
        own uid; another uid makes an impostor). Returns its pid once it is inside."""
        uid = uid or pod.uid
        cgroup = os.path.join(self.base, "kubepods", "besteffort", f"pod{uid}",
                              secrets.token_hex(32))
        os.makedirs(cgroup)
        self.dirs.append(cgroup)
        proc = subprocess.Popen(["ip", "netns", "exec", pod.name, "sleep", "3600"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(proc.pid))
        want = os.stat(pod.netns_path).st_ino
        deadline = time.monotonic() + 5
        while os.stat(f"/proc/{proc.pid}/ns/net").st_ino != want:  # `ip` setns, then exec
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"process for pod {pod.name} never entered its netns")
            time.sleep(0.005)
        return proc.pid

    def stop(self, pid: int) -> None:
        for proc in self.procs:
            if proc.pid == pid and proc.poll() is None:
                proc.kill()
                proc.wait(5)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        for path in self.dirs:
            try:
                with open(os.path.join(path, "cgroup.procs")) as f:
                    stragglers = f.read().split()
                for pid in stragglers:
                    with open(os.path.join(self.root, "cgroup.procs"), "w") as root:
                        root.write(pid)
            except OSError:
                pass
        for dirpath, _dirs, _files in sorted(os.walk(self.base), key=lambda w: -len(w[0])):
            for _ in range(50):  # a killed process leaves its cgroup a moment later
                try:
                    os.rmdir(dirpath)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)
