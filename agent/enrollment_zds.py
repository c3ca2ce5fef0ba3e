"""The application's wiring of enrollment to the ZDS server.

``cni.enrollment`` owns the shape it needs from ZDS (:class:`cni.enrollment.api.ZdsChannel`)
and never imports ``zds``; this module adapts the real :class:`zds.server.ZdsServer` to it
and builds the ``enrollment`` component with it (called by ``agent.daemon.build``).
"""

from __future__ import annotations

from agent.core.lifecycle import AgentContext
from cni.enrollment import Enrollment
from cni.enrollment.api import RegisteredPods, ZdsPod, ZdsRejected, ZtunnelUnavailable
from cni.sourceapi import PodSource
from zds.api import NoZtunnel, PodInfo, ZdsError
from zds.server import ZdsServer


class ZdsServerChannel:
    """:class:`cni.enrollment.api.ZdsChannel` over a :class:`ZdsServer`: pods become
    :class:`zds.PodInfo`; :class:`zds.NoZtunnel` becomes ``ZtunnelUnavailable`` and any
    other :class:`zds.ZdsError` ``ZdsRejected`` (its class name kept as ``kind``);
    ValueError (a bad field, or :class:`zds.api.MessageTooLarge`: a pod too large for
    ztunnel's receive buffer) passes through; enrollment fails that pod's ADD with it."""

    def __init__(self, server: ZdsServer):
        self.server = server

    @property
    def path(self) -> str:
        return self.server.path

    async def add(self, pod: ZdsPod, wait_ack: bool = True,
                  ztunnel_wait: float | None = None) -> None:
        info = PodInfo(uid=pod.uid, name=pod.name, namespace=pod.namespace,
                       service_account=pod.service_account, netns_fd=pod.netns_fd)
        try:
            await self.server.add(info, wait_ack=wait_ack, ztunnel_wait=ztunnel_wait)
        except NoZtunnel as e:
            raise ZtunnelUnavailable(str(e), e.socket, e.waited) from e
        except ZdsError as e:
            raise ZdsRejected(str(e), type(e).__name__) from e

    async def delete(self, uid: str) -> None:
        await self.server.delete(uid)

    def open_accept(self) -> None:
        self.server.open_accept()

    def connected(self) -> bool:
        return self.server.latest() is not None


def build(ctx: AgentContext, zds: ZdsServer | None, source: PodSource,
          registrar: RegisteredPods | None) -> Enrollment:
    """The ``enrollment`` component with ``zds`` as its ZDS channel (None: no ZDS server
    in this agent, every ADD fails retryably), the config ``source``'s pods and the
    ``registrar``'s registered ones; ``agent.daemon.build`` builds it after ``zds`` and
    before ``cni-events``."""
    return Enrollment(ctx, zds=ZdsServerChannel(zds) if zds is not None else None,
                      source=source, registrar=registrar)
