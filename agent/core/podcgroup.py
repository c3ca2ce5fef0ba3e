"""Which pod (or container) a process belongs to, from its ``/proc/<pid>/cgroup`` text.

Two callers need the same answer and must never disagree: restart recovery's ``/proc``
scan (``cni.podnetns.scan``, finding the netns of a pod enrolled before the restart) and
SDS attestation (``agent.sds.attest``, tying a caller's PID to the pod whose certificate
it may have). Both parse with :func:`parse_cgroup`.

The rules are upstream's (``istio/istio:cni/pkg/nodeagent/podcgroupns.go``): a kubelet
cgroup path ends ``pod<uid>/<container id>`` under either driver (cgroupfs
``/kubepods/burstable/pod<uid>/<ctr>``, systemd
``.../kubepods-besteffort-pod<uid_with_underscores>.slice/cri-containerd-<ctr>.scope``),
punctuation in the UID may be any ASCII punctuation (POSIX ``[[:punct:]]``), a
``.scope`` suffix is trimmed, and a CRI-O ``crio-<id>`` path gives a container ID with
no pod UID. Ours in addition: podman's ``libpod-<64 hex>`` container cgroup (cgroupfs
``/libpod_parent/libpod-<id>``, systemd ``/machine.slice/libpod-<id>.scope[/container]``;
conmon's ``libpod-conmon-<id>`` is not the container).

Pure string work: nothing here reads a file or blocks.
"""

from __future__ import annotations

import re

_P = r"""[!-/:-@\[-`{-~]"""  # POSIX [[:punct:]] in ASCII
_N = r"""[^!-/:-@\[-`{-~]"""
_UID = rf"[0-9a-fA-F]{{8}}{_P}?[0-9a-fA-F]{{4}}{_P}?[0-9a-fA-F]{{4}}{_P}?[0-9a-fA-F]{{4}}{_P}?[0-9a-fA-F]{{12}}"
_POD_RE = re.compile(rf"{_P}pod({_UID}){_P}(?:{_N}+{_P})*({_N}+)$")
_CRIO_RE = re.compile(rf"{_P}crio-({_N}+)$")
_LIBPOD_RE = re.compile(r"/libpod-([0-9a-f]{64})(?:\.scope)?(?:/|$)")


class CgroupError(ValueError):
    """A process's cgroup file is malformed or names more than one pod or container."""


def canonical_uid(uid: str) -> str:
    """Compare-form of a pod UID: lowercase hex digits only (``_`` or ``-`` separators and
    none at all name the same pod)."""
    return re.sub(r"[^0-9a-f]", "", uid.lower())


def parse_cgroup(text: str) -> tuple[str, str]:
    """``(pod uid, container id)`` from a ``/proc/<pid>/cgroup`` text; ``("", "")`` when
    the process is not in a pod. The uid has its punctuation replaced by ``-``
    (``pod2c48913c_b29f_...`` -> ``2c48913c-b29f-...``). CRI-O and podman paths without
    a pod uid give ``("", container id)``. Raises :class:`CgroupError` on a line with
    fewer than three ``:``-separated fields, or on several different uids / container
    ids."""
    uids: set[str] = set()
    cids: set[str] = set()
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split(":", 2)
        if len(parts) < 3:
            raise CgroupError(f"cgroup line {line!r} has fewer than 3 fields")
        path = parts[2]
        if path.endswith(".scope"):
            path = path[: -len(".scope")]
        m = _POD_RE.search(path)
        if m:
            uids.add(re.sub(_P, "-", m.group(1)))
            cids.add(m.group(2))
            continue
        m = _CRIO_RE.search(path)
        if m:
            cids.add(m.group(1))
            continue
        m = _LIBPOD_RE.search(parts[2])
        if m:
            cids.add(m.group(1))
    if len(cids) > 1:
        raise CgroupError(f"multiple container IDs found in cgroups ({', '.join(sorted(cids))})")
    if len(uids) > 1:
        raise CgroupError(f"multiple pod UIDs found in cgroups ({', '.join(sorted(uids))})")
    return (uids.pop() if uids else ""), (cids.pop() if cids else "")
