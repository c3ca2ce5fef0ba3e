"""What the agent knows about each pod it enrolls, and how that survives a restart.

:class:`PodRecord` is one pod (upstream keeps the same facts split between its pod cache,
``cni/pkg/nodeagent/pod_cache.go``, and the Pod object it re-reads); :class:`PodStateStore`
persists the part a restarted agent needs (``<state_dir>/pods/<uid>.json``).
:class:`PodState` and :class:`Step` are the reconciler's state machine (``docs/enrollment.md``).

On-disk format (unchanged since the first release; a record written by an older agent
loads): one JSON object per file, ``{"uid", "name", "namespace", "service_account",
"netns", "ips", "annotations"}``; unknown keys are ignored, missing ones default. States
and steps are never written to disk (they are re-established at start), and both are
``str`` enums, so ``debug_state`` and log lines show the same strings as before.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
from pathlib import Path
from typing import Any

from agent.core.files import write_atomic
from cni.podips import usable_ips

log = logging.getLogger(__name__)


class PodState(enum.StrEnum):
    """Where one pod's enrollment stands.

    ``PENDING``: started, or a retryable step failed (rules kept: fail closed; retried).
    ``ENABLED``: every :class:`Step` succeeded (the record is persisted before the
    status step).
    ``FAILED``: a permanent failure for this ADD (netns unusable, rules refused).
    ``NETNS_MISSING``: recovered at restart but its netns was not found (retried).
    """

    PENDING = "pending"
    ENABLED = "enabled"
    FAILED = "failed"
    NETNS_MISSING = "netns-missing"


class Step(enum.StrEnum):
    """The enrollment steps, in order (``NETNS`` is opening the pod netns, before any)."""

    NETNS = "netns"
    RULES = "rules"
    ZDS = "zds"
    HOSTSET = "hostset"
    STATE = "state"  # the record written under <state_dir>/pods/
    STATUS = "status"


@dataclasses.dataclass
class PodRecord:
    """One pod the agent enrolls. Persisted (JSON, :attr:`PERSISTED`) minus the
    runtime-only fields. ``ips`` are canonical, unmapped addresses (:mod:`cni.podips`)."""

    uid: str
    name: str = ""
    namespace: str = ""
    service_account: str = "default"
    netns: str = ""
    ips: list[str] = dataclasses.field(default_factory=list)
    annotations: dict[str, str] = dataclasses.field(default_factory=dict)
    # runtime-only
    status: PodState = PodState.PENDING
    error: str = ""
    steps: dict[Step, bool] = dataclasses.field(default_factory=dict)
    attempts: int = 0
    answer_by: float | None = None  # loop time the CNI ADD in flight must be answered by
    rollback_problems: list[str] = dataclasses.field(default_factory=list)  # of a cancelled ADD

    PERSISTED = ("uid", "name", "namespace", "service_account", "netns", "ips", "annotations")

    def __post_init__(self) -> None:
        # canonical, unmapped (cni.podips): a record read from an older state file or
        # built from a Pod object compares equal to the CNI event's addresses
        self.ips = usable_ips(self.ips if isinstance(self.ips, list) else [], "ips[{i}]",
                              f"pod record {self.uid}")

    def label(self) -> str:
        who = f"{self.namespace}/{self.name}" if self.name else "pod"
        return f"{who} (uid {self.uid})"

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.PERSISTED}

    def fail(self, step: Step, why: str, status: PodState = PodState.FAILED) -> None:
        """Record that ``step`` failed (logged with the pod's name)."""
        self.status, self.error = status, f"{step}: {why}"
        self.steps[step] = False
        log.warning("%s: %s failed: %s", self.label(), step, why)

    def enabled(self) -> None:
        """Record that every step succeeded."""
        self.status, self.error = PodState.ENABLED, ""

    def debug(self) -> dict[str, Any]:
        """The record as ``debug_state`` shows it (plain strings)."""
        return {"pod": self.label(), "status": str(self.status), "error": self.error,
                "steps": {str(k): v for k, v in self.steps.items()}, "netns": self.netns,
                "ips": self.ips, "attempts": self.attempts}


class PodStateStore:
    """``<state_dir>/pods/<uid>.json`` files (dir 0700, files 0600, atomic writes)."""

    def __init__(self, state_dir: str):
        self.dir = Path(state_dir, "pods")

    def save(self, rec: PodRecord) -> None:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self.dir / f"{_safe(rec.uid)}.json"
        write_atomic(path, json.dumps(rec.to_json()), 0o600, fsync=False)

    def remove(self, uid: str) -> None:
        try:
            (self.dir / f"{_safe(uid)}.json").unlink()
        except FileNotFoundError:
            pass

    def load(self) -> list[PodRecord]:
        """Every readable record; a malformed file is logged and skipped, never fatal."""
        records = []
        for path in sorted(self.dir.glob("*.json")) if self.dir.exists() else []:
            try:
                data = json.loads(path.read_text())
                if not isinstance(data, dict) or not isinstance(data.get("uid"), str):
                    raise ValueError("field 'uid' missing or not a string")
                records.append(PodRecord(**{k: data[k] for k in PodRecord.PERSISTED
                                            if k in data}))
            except (OSError, ValueError, TypeError) as e:
                log.error("skipping pod state file %s: %s", path, e)
        return records


def _safe(uid: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in uid)
