"""The pod's ``ambient.istio.io/redirection`` annotation, written through the config source.

Upstream (``cni/pkg/util/podutil.go``: ``AnnotateEnrolledPod``,
``AnnotatePartiallyEnrolledPod``, ``AnnotateUnenrollPod``; called from
``cni/pkg/nodeagent/meshdataplane_linux.go``) writes three states with a JSON merge
patch on the pod's ``status`` subresource (lower privilege than ``pods``, and it can
still change ``metadata``): ``enabled`` once rules, ztunnel and the probe set are done,
``pending`` when the rules are in but no ztunnel accepted the pod yet, and removal
(``null``) on un-enrollment. There is no ``disabled`` value. The control plane, and our
own index (HBONE for captured pods), read it.

This module is the consumer's side of that seam: :class:`PodAnnotator` is what the
enrollment needs from a config source (both sources implement it: the kubernetes source
with a real PATCH, the files source with an in-memory overlay on its stored Pod), and
:class:`RedirectionStatus` writes the annotation through it, retrying failed writes in
the background through a keyed retry queue (:mod:`agent.core.retryqueue`: exponential
backoff, 0.2 s doubling to 30 s, per pod) and logging each failure with the pod's name.
A failed write never raises out of the queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Callable, Mapping, Protocol, runtime_checkable

from agent.core.retryqueue import RetryQueue

log = logging.getLogger(__name__)

REDIRECTION_ANNOTATION = "ambient.istio.io/redirection"
ENABLED, PENDING = "enabled", "pending"
BACKOFF_INITIAL, BACKOFF_MAX = 0.2, 30.0


@runtime_checkable
class PodAnnotator(Protocol):
    """Writes a pod's annotations in the config source (implemented by
    ``ambient.source.ConfigSource``, which delegates to its files or kubernetes backend).

    ``annotations`` maps a key to its new value, or to None to remove it. Returns the
    updated Pod object. Raises ``LookupError``, or an exception whose ``status`` is 404,
    when the source has no such pod; any other exception is a failure worth retrying
    (``status`` carries the HTTP status when the API answered: 403, 409, 429, 5xx).
    """

    async def patch_pod_annotations(self, namespace: str, name: str,
                                    annotations: Mapping[str, str | None]) -> dict:
        ...


@dataclasses.dataclass(frozen=True)
class PodRef:
    """The pod to annotate: ``uid`` keys retries, ``namespace``/``name`` address it."""

    uid: str
    namespace: str
    name: str

    def label(self) -> str:
        return f"{self.namespace}/{self.name} (uid {self.uid})"


def is_not_found(error: BaseException) -> bool:
    """True when ``error`` says the pod does not exist (nothing to annotate)."""
    return isinstance(error, LookupError) or getattr(error, "status", None) == 404


def describe(error: BaseException) -> str:
    """One line for the log: ``403 Forbidden: <message>`` for API errors (the
    kubernetes client's own ``str()`` spans lines and dumps every response header)."""
    status = getattr(error, "status", None)
    if isinstance(status, int):
        reason = str(getattr(error, "reason", "") or "").strip()
        return f"{status} {reason}".strip()
    return f"{type(error).__name__}: {error}"


class RedirectionStatus:
    """Writes ``ambient.istio.io/redirection`` for pods through ``annotator()``.

    ``annotator`` returns the current :class:`PodAnnotator`, or None when the agent runs
    no config source (then nothing is written and every write counts as done).
    ``current`` returns the value the source's stored Pod carries now (or None), so a
    write that would change nothing is skipped (a restarted agent does not re-PATCH
    every enrolled pod). Background writes go through one keyed
    :class:`agent.core.retryqueue.RetryQueue` (``retries``, key: the pod UID), so a pod
    has at most one write in flight and a newer write for the same pod replaces the
    older one.
    """

    def __init__(self, annotator: Callable[[], PodAnnotator | None],
                 current: Callable[[PodRef], str | None] | None = None):
        self._annotator = annotator
        self._current = current or (lambda ref: None)
        self._wanted: dict[str, tuple[PodRef, str | None]] = {}  # uid -> what to write
        self.retries = RetryQueue(self._retry, initial=BACKOFF_INITIAL, maximum=BACKOFF_MAX,
                                  name="annotate")
        self.failures = 0  # write attempts that failed (for /debug and tests)

    def pending_retries(self) -> dict[str, str]:
        """``{uid: "retrying"}`` for pods whose write is still being retried."""
        return {uid: "retrying" for uid in self._wanted if uid in self.retries}

    async def write(self, ref: PodRef, value: str | None) -> bool:
        """One attempt now. True when written, when there is nothing to write (no
        source, no such pod: upstream ignores a 404 on removal, and an enrollment of a
        pod whose object is gone has nothing to annotate) or when the pod already has
        ``value``. False after a logged failure; the caller decides whether to retry
        (:meth:`ensure`). Cancels a background retry of an older value for this pod."""
        self.cancel(ref.uid)
        return await self._attempt(ref, value)

    def ensure(self, ref: PodRef, value: str | None) -> None:
        """Keep trying to write ``value`` in the background (first attempt at once, then
        exponential backoff, 0.2 s doubling to 30 s) until it is written, the pod is
        gone, or a newer write for the same pod supersedes it. Used for removal, whose
        caller can't wait."""
        self.cancel(ref.uid)
        self._wanted[ref.uid] = (ref, value)
        self.retries.add(ref.uid, now=True)

    def cancel(self, uid: str) -> None:
        """Forget the background write of pod ``uid`` (an attempt in flight is cancelled)."""
        self._wanted.pop(uid, None)
        self.retries.forget(uid)

    async def close(self, grace: float = 1.0) -> None:
        """Cancel every background retry (agent stop)."""
        self._wanted.clear()
        await self.retries.stop(grace)

    async def _retry(self, uid: str) -> bool:
        """The queue's ``process``: one attempt of pod ``uid``'s wanted write; True when
        done (written, nothing to write, or superseded), False to retry after the
        backoff."""
        wanted = self._wanted.get(uid)
        if wanted is None:
            return True
        ref, value = wanted
        first = self.retries.backoff(uid) == self.retries.initial
        if await self._attempt(ref, value):
            if self._wanted.get(uid) is wanted:
                del self._wanted[uid]
            if not first:
                log.info("%s: annotation %s=%s written after retrying", ref.label(),
                         REDIRECTION_ANNOTATION, value)
            return True
        log.info("%s: retrying annotation %s=%s in %.1fs", ref.label(),
                 REDIRECTION_ANNOTATION, value, self.retries.backoff(uid))
        return False

    async def _attempt(self, ref: PodRef, value: str | None) -> bool:
        annotator = self._annotator()
        if annotator is None or not ref.name or not ref.namespace:
            return True
        try:
            if self._current(ref) == value:
                return True
        except Exception:  # noqa: BLE001 - a broken store lookup only costs a PATCH
            pass
        try:
            await annotator.patch_pod_annotations(ref.namespace, ref.name,
                                                  {REDIRECTION_ANNOTATION: value})
            return True
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - every API failure is logged and retried
            if is_not_found(e):
                log.info("%s: pod not found in the config source; annotation %s=%s not "
                         "written", ref.label(), REDIRECTION_ANNOTATION, value)
                return True
            self.failures += 1
            log.warning("%s: writing annotation %s=%s failed: %s", ref.label(),
                        REDIRECTION_ANNOTATION, value, describe(e))
            return False
