"""Issue 27: ``podman events`` outlived a SIGKILLed agent (an orphan; the next agent
started another). Real podman: the label source's child dies with the process that
started it, and a marked stream left over from an earlier agent of the same state dir
is killed when the next one starts."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from cni.runtime_labels import OWNER_ENV, PodmanLabels

pytestmark = [pytest.mark.podman,
              pytest.mark.skipif(shutil.which("podman") is None, reason="podman not installed")]

CHILD = """
import asyncio, sys
from cni.runtime_labels import PodmanLabels
async def main():
    labels = PodmanLabels(None, owner=sys.argv[1])
    await labels.start()
    await labels.started.wait()
    print(labels._proc.pid, flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def _own_stream_runs(labels, owner: str, timeout: float = 30.0) -> bool:
    """True once the watcher's current ``podman events`` child is alive and carries the
    owner mark; waits up to ``timeout`` s (restarts back off from 0.5 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc = labels._proc
        if proc is not None and proc.returncode is None:
            try:
                if psutil.Process(proc.pid).environ().get(OWNER_ENV) == owner:
                    return True
            except psutil.Error:
                pass
        time.sleep(0.1)
    return False


def test_events_child_dies_with_a_sigkilled_agent(tmp_path):
    owner = str(tmp_path / "state")
    agent = subprocess.Popen([sys.executable, "-c", CHILD, owner], stdout=subprocess.PIPE,
                             text=True, cwd=os.path.dirname(os.path.dirname(
                                 os.path.dirname(os.path.abspath(__file__)))))
    try:
        pid = int(agent.stdout.readline())
        assert psutil.Process(pid).environ().get(OWNER_ENV) == owner
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        assert _gone(pid), "podman events outlived the agent"
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()


async def test_stale_marked_stream_is_killed_at_start(tmp_path):
    owner = str(tmp_path / "state")
    env = {**os.environ, OWNER_ENV: owner}
    # an orphan as a SIGKILLed agent without the death signal left it: reparented away
    launcher = subprocess.run(
        ["sh", "-c", "podman events --format json --filter type=container "
                     ">/dev/null 2>&1 & echo $!"], env=env, capture_output=True, text=True,
        timeout=30, start_new_session=True)
    stale = int(launcher.stdout.strip())
    other = subprocess.Popen(["podman", "events", "--format", "json"], env={
        **os.environ, OWNER_ENV: owner + "-other"}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    labels = PodmanLabels(None, owner=owner)
    try:
        assert psutil.Process(stale).ppid() != os.getpid()
        await labels.start()
        await asyncio.wait_for(labels.started.wait(), 10)
        assert await asyncio.to_thread(_gone, stale), "the stale stream still runs"
        assert other.poll() is None, "another owner's stream was killed"
        # our own stream runs (the watcher restarts it if podman exits by itself: a
        # first one died of SIGABRT once under load, the restart is the recovery)
        assert await asyncio.to_thread(_own_stream_runs, labels, owner), \
            "no podman events stream of this owner runs"
    finally:
        await labels.stop()
        other.kill()
        other.wait()
        try:
            os.kill(stale, signal.SIGKILL)
        except ProcessLookupError:
            pass
