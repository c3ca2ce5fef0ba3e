"""The ZDS server's API for the enrollment side: the pod record and the errors.

Shapes are fixed by ``docs/internal-interfaces.md`` ("ZDS server API"). The wire
facts behind them are ``docs/zds.md``.
"""

from __future__ import annotations

import dataclasses


class ZdsError(Exception):
    """Base of every error :meth:`zds.server.ZdsServer.add` raises."""


class ZdsNack(ZdsError):
    """ztunnel answered ``Ack{error=text}``; ``text`` is ztunnel's reason (``docs/zds.md``)."""

    def __init__(self, text: str, uid: str = ""):
        self.text, self.uid = text, uid
        super().__init__(f"ztunnel rejected pod {uid}: {text}" if uid else f"ztunnel NACK: {text}")


class ZdsTimeout(ZdsError):
    """No ack (or the socket stayed unwritable) within the per-message timeout (5 s)."""


class NoZtunnel(ZdsError):
    """No ztunnel connection was available within the wait asked for (at most the
    ``ztunnel_wait`` setting). ``socket`` is the ZDS socket path nobody connected to,
    ``waited`` the seconds waited."""

    def __init__(self, text: str, socket: str = "", waited: float = 0.0):
        super().__init__(text)
        self.socket, self.waited = socket, waited


class MessageTooLarge(ValueError):
    """A pod whose ZDS request would exceed ztunnel's receive buffer (1024 bytes): the
    text names the pod and the length of each field; ``size`` is the encoded bytes."""

    def __init__(self, text: str, size: int):
        super().__init__(text)
        self.size = size


@dataclasses.dataclass(frozen=True)
class PodInfo:
    """A pod as ZDS announces it.

    ``uid`` = ``metadata.uid`` (the ZDS key), ``name``/``namespace`` = metadata,
    ``service_account`` = ``spec.serviceAccountName`` (``podToWorkload``).
    ``netns_fd`` is an open fd of the pod's netns, or None when the netns is not known
    (the snapshot then sends ``KeepWorkload``). The server dups the fd; the caller keeps
    and closes its own.
    """

    uid: str
    name: str = ""
    namespace: str = ""
    service_account: str = ""
    netns_fd: int | None = None

    def validate(self) -> None:
        """Raise ValueError naming the first bad field (uid must be a non-empty string)."""
        if not isinstance(self.uid, str) or not self.uid:
            raise ValueError(f"PodInfo.uid must be a non-empty string, got {self.uid!r}")
        for name in ("name", "namespace", "service_account"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ValueError(f"PodInfo.{name} must be a string, got {value!r}")
        fd = self.netns_fd
        if fd is not None and (isinstance(fd, bool) or not isinstance(fd, int) or fd < 0):
            raise ValueError(f"PodInfo.netns_fd must be an open fd or None, got {fd!r}")
