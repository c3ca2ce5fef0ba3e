"""Enrollment: putting ambient pods into the mesh and taking them out (``docs/enrollment.md``).

Modules, top to bottom (upstream's ``cni/pkg/nodeagent`` is split the same way):

- :mod:`~cni.enrollment.reconciler`: the ``enrollment`` component (:class:`Enrollment`):
  records by pod UID, one lock per pod, CNI ADD/DEL, the retry queue's ``process``.
- :mod:`~cni.enrollment.watch`: running pods following their labels (the store watch).
- :mod:`~cni.enrollment.recovery`: restart recovery.
- :mod:`~cni.enrollment.dataplane`: the pipeline (netns -> rules -> ZDS -> probe set ->
  status) with its failure policies, rollback and removal.
- :mod:`~cni.enrollment.records`: :class:`PodRecord`, its states and steps, the state files.
- :mod:`~cni.enrollment.api`: the protocols enrollment needs (ZDS, netns ops, probe set);
  :mod:`~cni.enrollment.kernel`: the real netns ops.

The package never imports ``zds``: the daemon hands :class:`Enrollment` a
:class:`~cni.enrollment.api.ZdsChannel` (:func:`agent.enrollment_zds.build`).
"""

from cni.enrollment.records import PodRecord, PodState, PodStateStore, Step
from cni.enrollment.reconciler import Enrollment
from cni.events import EnrollmentError

__all__ = ["Enrollment", "EnrollmentError", "PodRecord", "PodState", "PodStateStore", "Step"]
