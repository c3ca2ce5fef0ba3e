"""The state dir's filesystem full (issue 28): an ADD fails with one clear, retryable
error naming the state dir, no traceback, and the pod is never reported enabled while
its record could not be written; once there is room the retry enrolls it.

A real filesystem fills up: a 256 KiB tmpfs mounted for this test (root), filled with
one file, unmounted after, pass or fail."""

from __future__ import annotations

import errno
import logging
import os
import subprocess

import pytest

from cni.enrollment import EnrollmentError, PodState, Step
from tests.cni.test_enrollment_reconciler import IP, NETNS, UID, Rig, event, until


@pytest.fixture
def full_state_dir(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root: mounts a small tmpfs")
    mnt = tmp_path / "state"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mnt)],
                   check=True)
    try:
        filler = mnt / "filler"
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError as e:
                assert e.errno == errno.ENOSPC
        (mnt / "pods").mkdir(exist_ok=True)
        yield mnt, filler
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


async def test_add_on_a_full_state_dir_fails_clearly_and_recovers(full_state_dir, caplog):
    state, filler = full_state_dir
    rig = Rig(state)
    rig.netns.create(NETNS)
    statuses: list[str | None] = []
    real_set_status = rig.enrollment.dataplane.set_status

    async def set_status(rec, value):
        statuses.append(value)
        return await real_set_status(rec, value)
    rig.enrollment.dataplane.set_status = set_status  # type: ignore[method-assign]
    try:
        with caplog.at_level(logging.INFO):
            with pytest.raises(EnrollmentError) as err:
                await rig.enrollment.enroll(event())
        text = str(err.value)
        assert err.value.retryable  # 503 to the plugin: "try again later", not code 999
        assert f"cannot record the pod in the state dir {state}/pods" in text
        assert "No space left on device (errno 28)" in text
        assert not any(r.exc_info for r in caplog.records), "a traceback was logged"
        rec = rig.enrollment.pods()[UID]
        assert rec.status is PodState.PENDING and rec.steps[Step.STATE] is False
        assert rig.enrollment.debug_state()["pods"][UID]["status"] == "pending"
        assert "enabled" not in statuses  # never reported enrolled
        assert not list((state / "pods").glob("*.json")) and not list(state.glob("pods/*.tmp*"))
        filler.unlink()  # room again: the retry queue finishes the enrollment
        await until(lambda: rig.enrollment.pods()[UID].status is PodState.ENABLED, timeout=10)
        assert (state / "pods" / f"{UID}.json").exists()
        assert rig.probes.entries == {UID: {IP}}
    finally:
        rig.close()
