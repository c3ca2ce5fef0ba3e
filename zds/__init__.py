"""ZDS: the agent↔ztunnel protocol that hands pod netns fds to ztunnel (``docs/zds.md``).

- :mod:`zds.server`: the agent side (component ``zds``): :class:`ZdsServer` with
  ``add(PodInfo)``, ``delete(uid)``, ``debug_state()``; it drives each connection with
  :mod:`zds.connection` (socket I/O) over :mod:`zds.session` (the protocol state
  machine, no I/O); :mod:`zds.pods` holds the recorded pods.
- :mod:`zds.wire`: framing (SEQPACKET, SCM_RIGHTS, 1024-byte limit) and encoders.
"""

from zds.api import NoZtunnel, PodInfo, ZdsError, ZdsNack, ZdsTimeout

__all__ = ["PodInfo", "ZdsError", "ZdsNack", "ZdsTimeout", "NoZtunnel", "ZdsServer", "build"]


def __getattr__(name: str) -> object:
    # Lazy so `import zds` (e.g. for the pb2 module) stays light and import-cycle free.
    if name in ("ZdsServer", "build"):
        from zds import server
        return getattr(server, name)
    raise AttributeError(name)
